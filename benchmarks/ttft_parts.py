"""Where a server turn's time to first token goes, engine side (issue 15, item 8): the steps the
server's worker runs for a request (lily/server/worker.py), timed one by one on one session.

  short      a new conversation: prefill up to the message boundary (--short-head tokens), snapshot,
             then generate 1 token over the rest (--short-tail tokens: the generation prompt)
  follow-up  restore a snapshot of --history tokens, prefill --new tokens to the next boundary,
             snapshot, generate 1 token over the last --short-tail tokens

Each step is timed (perf_counter; every step returns host data or synchronises), median of --rounds.
Also the one-pass alternative (the whole rest prefilled in one call, no boundary snapshot), to show
what the split costs.

    python benchmarks/ttft_parts.py -m CKPT --device cuda
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import lily


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default="tiny")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--short-head", type=int, default=7)
    ap.add_argument("--short-tail", type=int, default=4)
    ap.add_argument("--history", type=int, default=7000)
    ap.add_argument("--new", type=int, default=146)
    args = ap.parse_args()
    model = lily.Model.load(args.model, device=args.device)
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 100000, args.history + args.new + args.short_tail).tolist()
    session = model.new_session(max_context=len(ids) + 16)
    times: dict[str, list[float]] = {}

    def step(name, fn):
        t0 = time.perf_counter()
        out = fn()
        times.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
        return out

    def first_token(prompt):
        model.generate(prompt, session=session, max_tokens=1, temperature=0, ignore_eos=True)

    session.prefill(ids[:args.history])
    history = session.snapshot()
    short = ids[:args.short_head + args.short_tail]
    follow = ids[:args.history + args.new + args.short_tail]
    for _ in range(args.rounds + 1):  # the first round warms up (kernels, graphs)
        step("short: reset", session.reset)
        step("short: prefill head", lambda: session.prefill(short[:args.short_head]))
        step("short: snapshot", session.snapshot)
        step("short: generate over the tail", lambda: first_token(short))
        step("short, one pass: reset", session.reset)
        step("short, one pass: generate", lambda: first_token(short))
        step("follow-up: restore", lambda: session.restore(history))
        step("follow-up: prefill new", lambda: session.prefill(follow[args.history:args.history + args.new]))
        step("follow-up: snapshot", session.snapshot)
        step("follow-up: generate over the tail", lambda: first_token(follow))
        step("follow-up, one pass: restore", lambda: session.restore(history))
        step("follow-up, one pass: generate", lambda: first_token(follow))
    print(f"{model.device}, {args.model}: median of {args.rounds} rounds (first dropped)")
    print("| step | ms |\n|---|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts[1:]):.2f} |")


if __name__ == "__main__":
    main()
