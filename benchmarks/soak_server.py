"""Soak test of `lily serve` (issue 14): mixed load, disconnects and idle sockets on loopback.

Starts `lily serve` on the tiny built-in model on 127.0.0.1 (a free port), holds --idle idle TCP
connections open for the whole run, and sends --requests requests from --clients threads: chat and
completions, streamed and not; some clients disconnect on purpose (mid-stream, or while waiting for
a non-streamed answer). Every other request is "valid" and must be answered completely: 200, the
right number of tokens, a stream ending in [DONE]. Reports the dropped valid requests (must be 0),
the server's RSS (after warm-up, at the middle and at the end of the run: bounded growth), latency,
and what the server counted (/health). Loopback only; bounded in count and in time (--max-seconds);
stops the server with SIGTERM and exits by itself.

    python benchmarks/soak_server.py                       # 1,000 requests + 1,000 idle sockets
    python benchmarks/soak_server.py --requests 200 --idle 100 --json out.json

Exit status 0 when no valid request was dropped, the idle sockets stayed open, the server stopped
cleanly and RSS grew less than --max-rss-growth-mib; 1 otherwise.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import resource
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HOST = "127.0.0.1"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def raise_fd_limit(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n if hard == resource.RLIM_INFINITY else min(n, hard)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def start_server(args) -> tuple[subprocess.Popen, int, list[str]]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "lily.cli", "serve", "--host", HOST, "--port", "0", "--device", "cpu",
           "--max-context", str(args.max_context), "--max-queue", str(args.clients * 4),
           "--max-connections", str(args.idle + args.clients * 4 + 64),
           "--keepalive-timeout", str(args.max_seconds + 60)]  # idle sockets stay open for the whole run
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    deadline = time.monotonic() + 120
    port = None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if "http://" in line:
            port = int(line.split("http://", 1)[1].split("/")[0].rsplit(":", 1)[1])
            break
    if port is None:
        proc.kill()
        raise SystemExit("lily serve did not start:\n" + "".join(lines))

    def drain():  # keep reading stderr so the server never blocks on a full pipe
        for line in proc.stderr:
            lines.append(line)

    threading.Thread(target=drain, daemon=True).start()
    return proc, port, lines


def get(port: int, path: str) -> dict:
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    conn.request("GET", path)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return json.loads(data)


class Outcome:
    def __init__(self, kind: str, valid: bool):
        self.kind, self.valid = kind, valid
        self.ok = False
        self.error = ""
        self.seconds = 0.0


def one_request(port: int, i: int, rng: random.Random, deadline: float, max_tokens: int,
                valid_only: bool = False) -> Outcome:
    """One request of a kind drawn from rng; valid ones are checked in full."""
    kind = rng.choices(["chat", "chat_stream", "completion", "completion_stream", "drop_stream", "drop_wait"],
                       weights=[20, 25, 20, 20, 0 if valid_only else 10, 0 if valid_only else 5])[0]
    out = Outcome(kind, valid=not kind.startswith("drop"))
    if time.monotonic() > deadline:
        out.error = "not sent: the time limit was reached"
        return out
    chat = kind.startswith("chat") or (kind.startswith("drop") and i % 2 == 0)
    stream = kind.endswith("stream")
    n = rng.randint(2, max_tokens)
    body: dict = {"max_tokens": n, "ignore_eos": True, "stream": stream, "seed": i}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Request {i}: tell me about {rng.random():.6f}"}]
    else:
        body["prompt"] = f"Request {i}, number {rng.random():.6f}, continues"
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if kind.startswith("drop"):
        body["max_tokens"] = 400  # long enough to be cut
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(HOST, port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        if kind == "drop_wait":  # gives up before the answer: close without reading
            time.sleep(rng.uniform(0.0, 0.2))
            _abort(conn, rng)
            out.ok = True
            return out
        r = conn.getresponse()
        if r.status != 200:
            out.error = f"status {r.status}: {r.read()[:300]!r}"
            return out
        if kind == "drop_stream":  # reads a few events, then goes away
            for _ in range(rng.randint(1, 6)):
                if not r.fp.readline():
                    break
            _abort(conn, rng)
            out.ok = True
            return out
        data = r.read()
        if stream:
            events = [e for e in data.decode().split("\n\n") if e]
            if not events or events[-1] != "data: [DONE]":
                out.error = f"stream did not end with [DONE]: {events[-2:]}"
                return out
            objs = [json.loads(e[len("data: "):]) for e in events[:-1]]
            if any("error" in o for o in objs):
                out.error = f"error event: {[o for o in objs if 'error' in o][:1]}"
                return out
            text_events = [o for o in objs if o.get("choices")]
            finish = [o["choices"][0]["finish_reason"] for o in text_events if o["choices"][0]["finish_reason"]]
            if finish != ["length"]:
                out.error = f"finish reasons {finish}"
                return out
            if "stream_options" in body:
                u = objs[-1].get("usage") or {}
                if u.get("completion_tokens") != n:
                    out.error = f"usage {u} != {n} tokens"
                    return out
        else:
            obj = json.loads(data)
            u = obj.get("usage") or {}
            if u.get("completion_tokens") != n or obj["choices"][0]["finish_reason"] != "length":
                out.error = f"usage {u}, finish {obj['choices'][0].get('finish_reason')}, expected {n} tokens"
                return out
        out.ok = True
    except Exception as e:  # noqa: BLE001 - counted as a drop when the request was valid
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.seconds = time.monotonic() - t0
        conn.close()
    return out


def _abort(conn: http.client.HTTPConnection, rng: random.Random) -> None:
    """Close the client's socket: half of the time with a reset (SO_LINGER 0), else a plain close."""
    if conn.sock is not None and rng.random() < 0.5:
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def idle_open(socks: list[socket.socket]) -> int:
    """How many of the idle sockets the server still holds open (no end of stream, no reset)."""
    n = 0
    for s in socks:
        s.setblocking(False)  # a socket with a timeout would wait for data
        try:
            data = s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            if data:
                n += 1  # the server wrote something (a 503?) but did not close
        except BlockingIOError:
            n += 1
        except OSError:
            pass
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--idle", type=int, default=1000, help="idle TCP connections held open during the run")
    ap.add_argument("--clients", type=int, default=16, help="concurrent client threads")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=12, help="valid requests ask for 2..this many tokens")
    ap.add_argument("--max-seconds", type=float, default=900, help="stop sending after this long")
    ap.add_argument("--max-rss-growth-mib", type=float, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the summary here")
    args = ap.parse_args()
    if not (0 < args.requests <= 100_000 and 0 <= args.idle <= 10_000 and 0 < args.clients <= 256):
        ap.error("--requests in (0, 100000], --idle in [0, 10000], --clients in (0, 256]")
    raise_fd_limit(args.idle + args.clients * 8 + 512)  # inherited by the server

    t_start = time.monotonic()
    proc, port, log = start_server(args)
    summary: dict = {"requests": args.requests, "idle_sockets": args.idle, "clients": args.clients}
    idle: list[socket.socket] = []
    try:
        warm_rng = random.Random(-1)
        for i in range(8):  # warm-up (allocator, caches), not counted
            one_request(port, 10**6 + i, warm_rng, float("inf"), args.max_tokens, valid_only=True)
        rss0 = rss_mib(proc.pid)
        for _ in range(args.idle):
            idle.append(socket.create_connection((HOST, port), timeout=10))
        time.sleep(0.5)
        rss_idle = rss_mib(proc.pid)

        rng = random.Random(args.seed)
        seeds = [rng.randrange(2**32) for _ in range(args.requests)]
        deadline = time.monotonic() + args.max_seconds
        rss_mid = [float("nan")]
        done = [0]
        lock = threading.Lock()

        def task(i):
            out = one_request(port, i, random.Random(seeds[i]), deadline, args.max_tokens)
            with lock:
                done[0] += 1
                if done[0] == args.requests // 2:
                    rss_mid[0] = rss_mib(proc.pid)
            return out

        t0 = time.monotonic()
        with ThreadPoolExecutor(args.clients) as pool:
            outcomes = list(pool.map(task, range(args.requests)))
        elapsed = time.monotonic() - t0
        time.sleep(0.5)
        rss1 = rss_mib(proc.pid)
        held = idle_open(idle)
        health = get(port, "/health")
    finally:
        for s in idle:
            s.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    valid = [o for o in outcomes if o.valid]
    dropped = [o for o in valid if not o.ok]
    by_kind: dict = {}
    for o in outcomes:
        k = by_kind.setdefault(o.kind, {"sent": 0, "ok": 0})
        k["sent"] += 1
        k["ok"] += o.ok
    lat = sorted(o.seconds for o in valid if o.ok)
    summary.update({
        "valid": len(valid), "dropped_valid": len(dropped), "deliberate_disconnects": len(outcomes) - len(valid),
        "by_kind": by_kind, "seconds": round(elapsed, 1),
        "latency_s": {"median": round(statistics.median(lat), 3) if lat else None,
                      "p99": round(lat[int(0.99 * (len(lat) - 1))], 3) if lat else None},
        "idle_sockets_still_open": held,
        "rss_mib": {"after_warmup": round(rss0, 1), "with_idle_sockets": round(rss_idle, 1),
                    "middle": round(rss_mid[0], 1), "end": round(rss1, 1), "growth": round(rss1 - rss0, 1),
                    "growth_second_half": round(rss1 - rss_mid[0], 1)},
        "server_totals": health.get("totals"), "prefix_cache": health.get("prefix_cache"),
        "server_exit": proc.returncode,
        "total_seconds": round(time.monotonic() - t_start, 1),
    })
    for o in dropped[:10]:
        print(f"dropped: {o.kind}: {o.error}", file=sys.stderr)
    errors = [line.rstrip() for line in log if "Traceback" in line or "leaked" in line or "Error" in line]
    summary["server_error_lines"] = errors[:20]
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    good = (not dropped and held == args.idle and proc.returncode == 0 and not errors
            and rss1 - rss0 < args.max_rss_growth_mib)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
