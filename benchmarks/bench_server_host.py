"""The host's share of `lily serve`'s time to first token (issue 15, item 8): where a streamed chat
request spends its time between the client's send and the first token's chunk, engine excluded.

The server runs in this process on the tiny built-in model's tokenizer and template, with a scripted
generation source that yields one token at once (no engine: only HTTP, parsing, rendering,
tokenizing, queueing and the thread hand-offs are left). The client runs in a child process, so the two
do not share a GIL; both stamp with time.perf_counter (CLOCK_MONOTONIC on Linux: one clock for both).
Each request carries its send time in a header; the server stamps its steps against it:

  read       the event loop reads the request's first bytes
  app        the ASGI application is called (httptools parse, uvicorn's request cycle)
  prepare    _prepare_chat starts (routing, body, JSON; on the event loop for a small plain request,
             else after a hand-off to the thread pool)
  submit     the job enters the worker's queue (validation, template, token ids)
  start      the response starts on the event loop (after the hand-off back from the thread pool, if
             any; for an idle worker, once it has reached the engine: the source's first step)
  role       the role-only chunk is written
  event      the worker puts the first token's event
  first      the first token's chunk is written
  client     the client reads the role chunk / the first token's chunk

    python benchmarks/bench_server_host.py [--requests 200] [--case short|follow-up] [--engine-ms 7]

--engine-ms: the scripted source sleeps that long before its token (the GIL released, as during the
engine's pass), so the role chunk is written while it waits, as on the GPU host; the first token's
chunk less that time is then the host's share of the time to first token. Default 0: the token at once.

follow-up: a 7,000-token first message (sent once, so its pieces are in the token cache), a reply and
a new 132-word question, as benchmarks/server_ttft.py's follow-up. Medians over the requests after 3
warm-up ones; the markdown table is printed last.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import statistics
import subprocess
import sys
import time

HEADER = "x-bench-t0"
WORDS = "the of and to in is that for it as was with be by on not he this are or his from at".split()
STEPS = ("read", "app", "prepare", "submit", "start", "role", "event", "first")


def messages(case: str, i: int) -> list[dict]:
    if case == "short":
        return [{"role": "user", "content": f"Hello{i}"}]
    rng = random.Random(0)
    history = [{"role": "user", "content": "Read this. " + " ".join(rng.choice(WORDS) for _ in range(7000))}]
    if i < 0:
        return history
    r = random.Random(i)
    return history + [{"role": "assistant", "content": "Understood."},
                      {"role": "user", "content": " ".join(r.choice(WORDS) for _ in range(132))}]


def client(port: int, n: int, case: str) -> None:
    """The child process: n streamed chats, one at a time; prints the client-side times as JSON."""
    out = []
    bodies = [json.dumps({"messages": messages(case, i), "stream": True, "max_tokens": 1}).encode()
              for i in range(-1, n)]
    for body in bodies:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json", HEADER: repr(t0)})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        chunks = []
        while True:
            line = r.readline()
            now = time.perf_counter()
            if not line or line.strip() == b"data: [DONE]":
                break
            if line.startswith(b"data: "):
                chunks.append((now - t0) * 1e3)
        conn.close()
        out.append(chunks[:2])
        time.sleep(0.005)
    print(json.dumps(out[1:]))  # the history turn of a follow-up is not timed


def instrument(stamps: dict, rows: list) -> None:
    """Stamp the server's steps into ``stamps`` (perf_counter seconds) for the request being timed; each
    finished response appends its steps to ``rows`` (ms after the client's send)."""
    from lily.server import app, worker

    received = app._Protocol.data_received

    def data_received(self, data):
        if HEADER.encode() in data:
            stamps.clear()
            stamps["t0"] = float(data.split(HEADER.encode() + b": ")[1].split(b"\r\n")[0])
            stamps["read"] = time.perf_counter()
        return received(self, data)

    call = app._App.__call__

    async def app_call(self, scope, receive, send):
        stamps.setdefault("app", time.perf_counter())

        async def stamped(message):
            if message["type"] == "http.response.start":
                stamps.setdefault("start", time.perf_counter())
            elif message["type"] == "http.response.body":
                stamps.setdefault("role" if "role" not in stamps else "first", time.perf_counter())
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body") and "t0" in stamps:
                rows.append({k: (stamps[k] - stamps["t0"]) * 1e3 for k in STEPS if k in stamps})

        return await call(self, scope, receive, stamped)

    prepare, submit, put = app._prepare_chat, app._submit, worker.Job.put

    def prepare_chat(*a, **k):
        stamps.setdefault("prepare", time.perf_counter())
        return prepare(*a, **k)

    def submit_job(*a, **k):
        stamps.setdefault("submit", time.perf_counter())
        return submit(*a, **k)

    def put_item(self, kind, payload=None):
        if kind == "event":
            stamps.setdefault("event", time.perf_counter())
        return put(self, kind, payload)

    app._Protocol.data_received, app._App.__call__ = data_received, app_call
    app._prepare_chat, app._submit, worker.Job.put = prepare_chat, submit_job, put_item


def one_token(engine_s: float):
    """A scripted source: one token after ``engine_s`` seconds (at once for 0)."""
    from lily import Generation, GenerationEvent, GenerationStream

    def source(job):
        result = Generation(text="x", thinking=job.prompt.thinking)
        result.usage.prompt_tokens = len(job.prompt.ids)
        return GenerationStream(events(result), result)

    def events(result):
        if engine_s:
            time.sleep(engine_s)
        result.token_ids.append(0)
        result.usage.completion_tokens = 1
        result.finish_reason = "length"
        yield GenerationEvent("x", 0, None, "length")

    return source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--case", choices=["short", "follow-up"], default="short")
    ap.add_argument("--engine-ms", type=float, default=0.0, help="the scripted source's wait before its token")
    ap.add_argument("--client-port", type=int, help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.client_port:
        client(args.client_port, args.requests, args.case)
        return
    import lily
    from lily.server import Server

    stamps: dict = {}
    rows: list[dict] = []
    instrument(stamps, rows)
    model = lily.load("tiny", device="cpu")
    with Server(model, port=0, source=one_token(args.engine_ms / 1e3), max_context=16384) as server:
        proc = subprocess.Popen([sys.executable, __file__, "--client-port", str(server.port), "--requests",
                                 str(args.requests), "--case", args.case], stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"the client failed (exit {proc.returncode})")
    client_times = json.loads(out)
    rows, client_times = rows[-len(client_times):][3:], client_times[3:]  # the timed requests less 3 warm-up
    wait = f" after {args.engine_ms:g} ms" if args.engine_ms else ""
    print(f"\n{args.case}: {len(client_times)} streamed chats, scripted one-token source{wait} (no engine), "
          f"medians, ms after the client's send\n")
    print("| step | ms |\n|---|---:|")
    for k in STEPS:
        values = [r[k] for r in rows if k in r]
        if values:
            print(f"| {k} | {statistics.median(values):.3f} |")
    print(f"| client: role chunk | {statistics.median(c[0] for c in client_times):.3f} |")
    print(f"| client: first token chunk | {statistics.median(c[1] for c in client_times):.3f} |")
    if args.engine_ms:
        print(f"| host share of the TTFT (first token chunk less {args.engine_ms:g} ms) | "
              f"{statistics.median(c[1] for c in client_times) - args.engine_ms:.3f} |")


if __name__ == "__main__":
    main()
