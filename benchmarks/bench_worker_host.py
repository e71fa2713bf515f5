"""The generation worker's host time for a follow-up turn (issue 15, item 8): what `lily serve` does on
the worker thread between taking a follow-up's job and the engine's pass, engine calls excluded.

bench_server_host.py's scripted source skips the worker's preparation; this one runs it with the real
engine of the tiny built-in model on the CPU. A server (no HTTP traffic) gets a 7,000-word first message
and a few follow-ups through its worker, so the prefix cache holds the conversation's boundary
snapshots as on the GPU host; then each timed follow-up (a new 132-word question) is prepared as the
server prepares it and run on this thread while the worker thread idles:

  start     the worker's _start less the session's restore (the prefix lookup, the session's own
            tokens, the boundaries the cache lacks, model.generate up to its stream)
  restore   the engine's copy of the cached snapshot into the session (a device copy on the GPU)
  first     the first step less the engine's set_sampler and prefill_sample (prepare, resume, the
            prompt's array, the session's token list, the first event)

    python benchmarks/bench_worker_host.py [--requests 15]

Medians, ms; the markdown table is printed last. The tiny engine's CPU prefill (~160 ms) runs between
the timed parts, so the caches are as cold as after a real pass.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_server_host import messages  # noqa: E402 - the same conversation

TIMED = ("prefill_sample", "restore", "set_sampler")


class _Timed:
    """The session's engine object with the TIMED calls' seconds added up in ``spent``."""

    def __init__(self, core, spent: dict):
        self.__dict__.update(core=core, spent=spent)

    def __getattr__(self, name):
        f = getattr(self.core, name)
        if name not in TIMED:
            return f

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t
        return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=15)
    args = ap.parse_args()
    import lily
    from lily.server import Server, app, parse
    from lily.server.prompt import chat_prompt
    from lily.server.worker import Job

    model = lily.load("tiny", device="cpu")
    with Server(model, port=0, max_context=16384) as s:
        def through_worker(i: int) -> None:
            body = {"messages": messages("follow-up", i), "stream": True, "max_tokens": 1}
            job = app._prepare_chat(s, body, lambda: None)[0]
            while job.next_item(60)[0] not in ("done", "error", "cancelled"):
                pass
            time.sleep(0.3)  # the boundary snapshots are made after the reply

        for i in (-1, 1000, 1001, 1002):  # the history, then follow-ups: the cache holds the boundaries
            through_worker(i)
        wk, spent, rows = s.worker, {}, []
        wk.session._core = _Timed(wk.session._core, spent)
        for i in range(args.requests):
            body = {"messages": messages("follow-up", 100 + i), "stream": True, "max_tokens": 1}
            req = parse.parse_chat(body, s.defaults)
            prompt = chat_prompt(s.tokenizer, req.messages, req.tools, req.template_kwargs, wk.max_context, s.encoder)
            job = Job("bench", prompt, s.fit_context(prompt, req, "messages"))
            spent.clear()
            t0 = time.perf_counter()
            stream, cached, _, deferred = wk._start(job)
            t1, at_start = time.perf_counter(), dict(spent)
            next(stream)
            t2, at_first = time.perf_counter(), dict(spent)
            for _ in stream:
                pass
            if deferred is not None:
                wk._snapshot_boundaries(deferred)
            engine = at_first.get("prefill_sample", 0.0) + at_first.get("set_sampler", 0.0)
            rows.append({"start": t1 - t0 - at_start.get("restore", 0.0), "restore": at_start.get("restore", 0.0),
                         "first": t2 - t1 - engine, "set_sampler": at_first.get("set_sampler", 0.0),
                         "cached": cached, "tokens": len(prompt.ids)})
            time.sleep(0.05)
    print(f"\nfollow-up, {len(rows)} requests, {rows[-1]['cached']:,} of {rows[-1]['tokens']:,} tokens cached; "
          f"tiny model on the CPU, worker thread, medians\n")
    print("| part | ms |\n|---|---:|")
    for k in ("start", "restore", "first", "set_sampler"):
        print(f"| {k} | {statistics.median(r[k] for r in rows) * 1e3:.3f} |")
    print(f"| start + first (Python) | {statistics.median(r['start'] + r['first'] for r in rows) * 1e3:.3f} |")


if __name__ == "__main__":
    main()
