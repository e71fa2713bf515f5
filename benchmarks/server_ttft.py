"""Time to first token (TTFT) of `lily serve`, measured through HTTP (issue 15, item 8).

Starts `lily serve` on a free loopback port (or uses --url), warms it up, then measures over --rounds
rounds, one request of each case per round (interleaved, so drift hits every case alike):

  short       a new conversation of one user message (one word): 11 prompt tokens with the Qwen3.6
              template; a different word each round, so no snapshot is reused.
  follow-up   a conversation whose first user turn holds --history-tokens tokens (sent once before the
              rounds: the server keeps a snapshot at the end of that message), continued with a
              supplied assistant reply and a new user message of about --new-tokens tokens (different
              each round): the server resumes from the snapshot and prefills only the new tokens
              (usage.prompt_tokens_details.cached_tokens says how many it reused; checked).
  cold-long   the same shape and size as follow-up, but a fresh conversation (different leading text
              each round): nothing to reuse, the whole prompt is prefilled.

Each request is a streamed chat completion (`stream: true`, `stream_options.include_usage`,
`max_tokens` --max-tokens (1), `ignore_eos`), sent on a fresh keep-alive-less connection opened
before the clock starts. TTFT is the time from the first byte of the request sent to the arrival of
the first SSE chunk after the role-only chunk (`delta: {"role": "assistant", "content": ""}`, which
the server sends before generation starts): a chunk with reasoning or content text, or, when the
server holds the first token's text back (a possible `</think>` or tool-call tag), the chunk that
flushes it or the finish chunk: in every case the first event that needs a generated token. The
time to the role chunk is reported too (request parsing, rendering, tokenizing, queueing). After
each request the client polls /health until the worker is idle, so every request meets an idle
server; "busy after" is the time from the request's [DONE] to then: the server's work after the
reply (the request's boundary snapshots, docs/server.md), which a request sent at once would wait for.

    python benchmarks/server_ttft.py                                  # tiny built-in model, auto device
    python benchmarks/server_ttft.py -m CKPT --device cuda --rounds 10 --json ttft.json
    python benchmarks/server_ttft.py --device cpu --rounds 1 --history-tokens 500 --new-tokens 60

The client side uses the standard library only. The markdown table is printed last on stdout;
progress and the server's stderr tail (on failure) go to stderr. Exit status 0 when every request
succeeded (and the follow-up turns reused the history), 1 otherwise.
"""
from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import queue
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

HOST = "127.0.0.1"

# Each word is one token after a space (and at the start of a message) in Qwen3.6's tokenizer, which
# lily's synthetic checkpoints share, so a message of n words is n tokens.
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but "
         "have an they you were her she there one all we their has been if more when will would who so no "
         "time people water world year day way state life work part place case group number system "
         "program question government company hand home city house light").split()
# One-word messages of the short case (each one token, so the prompt is 11 tokens); a request that
# repeats one (more than len(OPENERS) requests) may resume from its snapshot: a note says so.
OPENERS = "Hello Hi Hey Greetings Welcome Thanks Cheers Hola Bonjour Yo Hallo Morning".split() + [
    w.capitalize() for w in WORDS]
REPLY = "Understood."  # the supplied assistant turn of the follow-up (3 tokens)
# Qwen3.6's template: a message is <|im_start|> role \n content <|im_end|> \n (5 tokens + content);
# the generation prompt is <|im_start|> assistant \n <think> \n (5 tokens).
MESSAGE_TOKENS, GEN_PROMPT_TOKENS, REPLY_TOKENS = 5, 5, 3

TIMED_EVENT = ("TTFT = request sent -> first SSE chunk after the role-only chunk (the first chunk that "
               "needs a generated token: text, or the flush/finish chunk when the text is held back)")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(n, 1)))


class ServerProcess:
    """`lily serve` as a subprocess; its stderr is read by a thread (tail kept for error reports)."""

    def __init__(self, args, deadline: float):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "lily.cli", "serve", "--host", HOST, "--port", "0", "--device", args.device,
               "--max-context", str(args.max_context), "--keepalive-timeout", "600", "--request-timeout", "600"]
        if args.model:
            cmd += ["--model", args.model]
        cmd += args.serve_arg
        self.cmd = cmd
        self.tail: collections.deque[str] = collections.deque(maxlen=60)
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, errors="replace", env=env)
        threading.Thread(target=self._drain, daemon=True).start()
        self.port = self._wait_port(deadline)

    def _drain(self) -> None:  # keeps reading, so the server never blocks on a full pipe
        for line in self.proc.stderr:
            self.tail.append(line.rstrip("\n"))
            self.lines.put(line)
        self.lines.put(None)

    def _wait_port(self, deadline: float) -> int:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.fail("lily serve did not start within the time limit (--max-seconds)")
            try:
                line = self.lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait()
                self.fail(f"lily serve exited with status {self.proc.returncode} before listening")
            if "http://" in line:
                return int(line.split("http://", 1)[1].split("/")[0].rsplit(":", 1)[1])

    def fail(self, message: str):
        self.stop()
        raise SystemExit(f"{message}\ncommand: {' '.join(self.cmd)}\n{self.stderr_tail()}")

    def stderr_tail(self, n: int = 30) -> str:
        lines = list(self.tail)[-n:]
        return "server stderr (last lines):\n" + "\n".join("  " + line for line in lines) if lines else \
            "server stderr: (nothing)"

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def get_json(host: str, port: int, path: str, timeout: float = 10.0) -> tuple[int, dict | None]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        data = r.read()
        try:
            return r.status, json.loads(data)
        except ValueError:
            return r.status, None
    finally:
        conn.close()


def wait_health(host: str, port: int, deadline: float, server: ServerProcess | None) -> dict:
    last = ""
    while time.monotonic() < deadline:
        if server is not None and server.proc.poll() is not None:
            server.fail(f"lily serve exited with status {server.proc.returncode}")
        try:
            status, obj = get_json(host, port, "/health", timeout=5)
            if status == 200 and obj and obj.get("status") == "ok":
                return obj
            last = f"status {status}: {obj}"
        except OSError as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.1)
    msg = f"/health did not answer ok within the time limit ({last})"
    if server is not None:
        server.fail(msg)
    raise SystemExit(msg)


def wait_idle(host: str, port: int, deadline: float, res: "Result") -> float | None:
    """Poll /health until the worker runs nothing (the server makes a request's boundary snapshots
    after its reply); ms from the request's [DONE] to then (to ~1 ms: one /health round trip)."""
    while time.monotonic() < deadline:
        status, obj = get_json(host, port, "/health", timeout=5)
        if status == 200 and obj and not obj.get("running") and not obj.get("queued"):
            return (time.perf_counter() - res.t_done) * 1e3
        time.sleep(0.001)
    return None


class Result:
    def __init__(self, case: str, label: str):
        self.case, self.label = case, label
        self.ok = False
        self.error = ""
        self.role_ms: float | None = None  # to the role-only chunk
        self.ttft_ms: float | None = None  # to the first chunk that needs a generated token
        self.total_ms: float | None = None  # to [DONE]
        self.busy_ms: float | None = None  # [DONE] -> the server idle (its work after the reply)
        self.t_done = 0.0  # perf_counter at [DONE]
        self.first_kind = ""  # what that chunk carried
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.completion_tokens: int | None = None

    def record(self) -> dict:
        return {k: v for k, v in vars(self).items()}


def first_kind(choice: dict) -> str:
    """What a chunk carries that needs a generated token ('' for the role-only chunk or nothing)."""
    delta = choice.get("delta") or {}
    for key in ("reasoning_content", "content", "tool_calls"):
        if delta.get(key):
            return key
    if choice.get("logprobs"):
        return "logprobs"
    if choice.get("finish_reason"):
        return f"finish ({choice['finish_reason']})"
    return ""


def stream_chat(host: str, port: int, case: str, label: str, messages: list[dict], args, deadline: float) -> Result:
    """One streamed chat request, timed; checked in full (200, usage, no error event, [DONE])."""
    res = Result(case, label)
    left = deadline - time.monotonic()
    if left <= 0:
        res.error = "not sent: the time limit (--max-seconds) was reached"
        return res
    body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": args.max_tokens, "ignore_eos": True}
    if args.api_key:
        headers = {"Authorization": f"Bearer {args.api_key}"}
    else:
        headers = {}
    headers["Content-Type"] = "application/json"
    data = json.dumps(body).encode()
    conn = http.client.HTTPConnection(host, port, timeout=min(left, args.request_seconds))
    try:
        conn.connect()  # before the clock: the TCP handshake is not the server's time to first token
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", data, headers)  # headers and body in one send
        r = conn.getresponse()
        if r.status != 200:
            res.error = f"status {r.status}: {r.read()[:500].decode(errors='replace')}"
            return res
        done = False
        while True:
            line = r.readline()
            now = time.perf_counter()
            if not line:
                break
            if time.monotonic() > deadline:
                res.error = "the time limit (--max-seconds) was reached mid-stream"
                return res
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[len(b"data: "):]
            if payload == b"[DONE]":
                done = True
                res.total_ms = (now - t0) * 1e3
                res.t_done = now
                break
            obj = json.loads(payload)
            if "error" in obj:
                res.error = f"error event: {json.dumps(obj['error'])[:500]}"
                return res
            choices = obj.get("choices") or []
            if choices and res.ttft_ms is None:
                kind = first_kind(choices[0])
                if kind:
                    res.ttft_ms, res.first_kind = (now - t0) * 1e3, kind
                elif res.role_ms is None and (choices[0].get("delta") or {}).get("role"):
                    res.role_ms = (now - t0) * 1e3
            if obj.get("usage"):
                u = obj["usage"]
                res.prompt_tokens = u.get("prompt_tokens")
                res.completion_tokens = u.get("completion_tokens")
                res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        if not done:
            res.error = "the stream ended without data: [DONE]"
        elif res.ttft_ms is None:
            res.error = "no chunk with a generated token"
        elif res.prompt_tokens is None:
            res.error = "no usage chunk (stream_options.include_usage)"
        elif res.completion_tokens != args.max_tokens:
            res.error = f"{res.completion_tokens} completion tokens, expected {args.max_tokens}"
        else:
            res.ok = True
    except (OSError, http.client.HTTPException, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return res


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def summarize(results: list[Result]) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_ms for r in ok]
    role = [r.role_ms for r in ok if r.role_ms is not None]
    busy = [r.busy_ms for r in ok if r.busy_ms is not None]

    def one(values):
        values = sorted(set(values), key=lambda v: (v is None, v))
        return values[0] if len(values) == 1 else values  # a list when the rounds differ

    return {
        "rounds": len(ok), "failed": len(results) - len(ok),
        "prompt_tokens": one([r.prompt_tokens for r in ok]) if ok else None,
        "cached_tokens": one([r.cached_tokens for r in ok]) if ok else None,
        "ttft_ms_median": round(statistics.median(ttft), 2) if ttft else None,
        "ttft_ms_min": round(min(ttft), 2) if ttft else None,
        "role_chunk_ms_median": round(statistics.median(role), 2) if role else None,
        "busy_after_ms_median": round(statistics.median(busy), 2) if busy else None,
        "first_chunk_kinds": sorted({r.first_kind for r in ok}),
    }


def table(summaries: dict) -> str:
    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, list):
            return f"{min(v)}-{max(v)}"
        return str(v)

    rows = ["| case | prompt tokens | cached tokens | TTFT median ms | TTFT min ms | rounds | role chunk median ms "
            "| busy after median ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for case, s in summaries.items():
        rounds = f"{s['rounds']} ({s['failed']} failed)" if s["failed"] else str(s["rounds"])
        rows.append(f"| {case} | {cell(s['prompt_tokens'])} | {cell(s['cached_tokens'])} | "
                    f"{fmt(s['ttft_ms_median'])} | {fmt(s['ttft_ms_min'])} | {rounds} | {fmt(s['role_chunk_ms_median'])} | "
                    f"{fmt(s['busy_after_ms_median'])} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", help="checkpoint folder or repo id (default: the tiny built-in model)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--max-context", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=5, help="timed requests per case (default 5)")
    ap.add_argument("--history-tokens", type=int, default=7000,
                    help="tokens of the follow-up's reused first turn (default 7000)")
    ap.add_argument("--new-tokens", type=int, default=150,
                    help="prompt tokens the follow-up adds: reply + new user message + generation prompt "
                         "(default 150, at least 20)")
    ap.add_argument("--max-tokens", type=int, default=1, help="max_tokens of every request (default 1)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed short requests first (default 2; one "
                    "follow-up and one cold-long request are always sent untimed as well)")
    ap.add_argument("--max-seconds", type=float, default=900,
                    help="time limit for the whole run, server start included (default 900)")
    ap.add_argument("--request-seconds", type=float, default=300, help="socket timeout of a request (default 300)")
    ap.add_argument("--url", help="measure a running server (http://HOST:PORT) instead of starting one")
    ap.add_argument("--api-key", default=os.environ.get("LILY_API_KEY"), help="for --url (default $LILY_API_KEY)")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for `lily serve`, repeatable (e.g. --serve-arg=--prefix-cache-mib=8192)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    args = ap.parse_args()
    if args.rounds < 1 or args.max_tokens < 1 or args.history_tokens < 8 or args.new_tokens < 20:
        ap.error("--rounds >= 1, --max-tokens >= 1, --history-tokens >= 8, --new-tokens >= 20")
    if args.history_tokens + args.new_tokens + args.max_tokens > args.max_context:
        need = args.history_tokens + args.new_tokens + args.max_tokens
        ap.error(f"--history-tokens + --new-tokens + --max-tokens ({need}) must fit --max-context ({args.max_context})")

    t_start = time.monotonic()
    deadline = t_start + args.max_seconds
    server = None
    if args.url:
        u = urlsplit(args.url)
        host, port = u.hostname or HOST, u.port or 80
        if args.serve_arg or args.model:
            print("server_ttft: --url given: --model and --serve-arg are not used", file=sys.stderr)
    else:
        args.api_key = None
        host = HOST
        print(f"server_ttft: starting lily serve ({args.model or 'tiny built-in model'}, --device {args.device})",
              file=sys.stderr, flush=True)
        server = ServerProcess(args, deadline)
        port = server.port
    results: list[Result] = []
    failed: list[Result] = []
    info: dict = {}
    exit_status = None
    prime: Result | None = None
    try:
        health = wait_health(host, port, deadline, server)
        status, version = get_json(host, port, "/version")
        info = {"version": version if status == 200 else None, "max_context": health.get("max_context"),
                "startup_seconds": round(time.monotonic() - t_start, 1)}
        print(f"server_ttft: server up on {host}:{port} after {info['startup_seconds']} s ({version})",
              file=sys.stderr, flush=True)

        rng = random.Random(args.seed)
        history_words = args.history_tokens - MESSAGE_TOKENS  # the rendered first turn is history_tokens
        new_words = args.new_tokens - 2 * MESSAGE_TOKENS - REPLY_TOKENS - GEN_PROMPT_TOKENS
        history = [{"role": "user", "content": "Read this. " + words(rng, history_words - 3)}]

        def short(i):
            return [{"role": "user", "content": OPENERS[i % len(OPENERS)]}]

        def follow_up(i):  # a new question each round: only the history's snapshot is reusable
            return history + [{"role": "assistant", "content": REPLY},
                              {"role": "user", "content": words(random.Random(f"{args.seed}-q{i}"), new_words)}]

        def cold_long(i):  # different from the first token on: nothing to reuse
            r = random.Random(f"{args.seed}-c{i}")
            return [{"role": "user", "content": f"{OPENERS[i % len(OPENERS)]} " + words(r, history_words - 1)},
                    {"role": "assistant", "content": REPLY},
                    {"role": "user", "content": words(random.Random(f"{args.seed}-q{i}"), new_words)}]

        def send(case, label, messages, timed):
            res = stream_chat(host, port, case, label, messages, args, deadline)
            if res.ok:  # every request meets an idle server: the one before has finished its work
                res.busy_ms = wait_idle(host, port, deadline, res)
            print(f"server_ttft: {label:<22} {'ok' if res.ok else 'FAILED':<6} prompt {res.prompt_tokens} "
                  f"cached {res.cached_tokens} role {fmt(res.role_ms)} ms TTFT {fmt(res.ttft_ms)} ms "
                  f"({res.first_kind or '-'}) total {fmt(res.total_ms)} ms"
                  f"{'' if res.ok else ': ' + res.error}", file=sys.stderr, flush=True)
            if not res.ok:
                failed.append(res)
                if server is not None and server.proc.poll() is not None:
                    raise RuntimeError(f"lily serve exited with status {server.proc.returncode}")
            elif timed:
                results.append(res)
            return res

        # Warm-up (untimed): a few short requests, the history turn (its snapshot is what the
        # follow-ups reuse), one follow-up and one cold long prompt.
        for w in range(args.warmup):  # the warm-up openers come from the end of the list
            send("warmup", f"warmup short {w}", short(-1 - w), False)
        prime = send("warmup", "warmup history turn", history, False)
        send("warmup", "warmup follow-up", follow_up(-1), False)
        send("warmup", "warmup cold-long", cold_long(-1), False)

        for i in range(args.rounds):
            if time.monotonic() > deadline:
                break
            send("short", f"round {i} short", short(i), True)
            send("follow-up", f"round {i} follow-up", follow_up(i), True)
            send("cold-long", f"round {i} cold-long", cold_long(i), True)
    except RuntimeError as e:
        print(f"server_ttft: {e}", file=sys.stderr)
        exit_status = 1
    except KeyboardInterrupt:
        print("server_ttft: interrupted", file=sys.stderr)
        exit_status = 1
    finally:
        code = server.stop() if server is not None else None

    cases = {c: summarize([r for r in results if r.case == c]) for c in ("short", "follow-up", "cold-long")}
    problems = [f"{r.label}: {r.error}" for r in failed]
    for c, s in cases.items():
        if s["rounds"] < args.rounds:
            problems.append(f"{c}: {s['rounds']} of {args.rounds} rounds measured")
    fu = [r for r in results if r.case == "follow-up"]
    hist_tokens = prime.prompt_tokens - GEN_PROMPT_TOKENS if prime is not None and prime.ok else None
    if hist_tokens and any((r.cached_tokens or 0) < hist_tokens for r in fu):
        problems.append(f"follow-up: the history ({hist_tokens} tokens) was not fully reused: cached "
                        f"{[r.cached_tokens for r in fu]} (prefix cache too small or evicted?)")
    reused = [r.label for r in results if r.case == "short" and r.cached_tokens]
    if reused:
        print(f"server_ttft: note: {len(reused)} short requests repeated an opener word and resumed from its "
              f"snapshot ({', '.join(reused[:5])}...)", file=sys.stderr)
    if server is not None and code not in (0, None):
        problems.append(f"lily serve exited with status {code}")
    if server is not None and (problems or exit_status):
        print(server.stderr_tail(), file=sys.stderr)
    for p in problems:
        print(f"server_ttft: problem: {p}", file=sys.stderr)

    summary = {"model": args.model or "tiny built-in", "device": args.device, "server": info,
               "max_tokens": args.max_tokens, "history_tokens_asked": args.history_tokens,
               "new_tokens_asked": args.new_tokens, "timed_event": TIMED_EVENT, "cases": cases,
               "requests": [r.record() for r in results + failed], "problems": problems,
               "total_seconds": round(time.monotonic() - t_start, 1)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    kinds = sorted({k for s in cases.values() for k in s["first_chunk_kinds"]})
    print(f"\n{TIMED_EVENT}; the first chunks carried: {', '.join(kinds) or '-'}. Streamed chat, "
          f"max_tokens {args.max_tokens}, {args.device}, {args.model or 'tiny built-in model'}, "
          f"{summary['total_seconds']} s in all.\n")
    print(table(cases))
    return 1 if problems or exit_status else 0


if __name__ == "__main__":
    sys.exit(main())
