"""Per-kernel device times of lily's eager decode steps and one prefill, through torch.profiler
(CUPTI sees every kernel of the process, including lily's own). Needs torch with CUDA.

    python benchmarks/kernel_profile.py --model PATH [--context 4096] [--steps 16] [--rows 40] [--short 11]

--short N also profiles an N-token prefill (the first token of a short chat: time to first token) and
prints its wall time (median of 5, synchronised) next to the sum of its kernel times.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import lily


def prompt_ids(n: int, vocab: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 2654435761) % 2**32 % vocab).astype(np.int32)


def table(prof, per: int, rows: int) -> None:
    ev = [e for e in prof.key_averages() if e.device_time_total > 0]
    ev.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in ev)
    print(f"total {total / per / 1e3:.3f} ms per pass, {sum(e.count for e in ev) // per} kernels per pass")
    print("| kernel | us/pass | % | calls/pass | us/call |")
    print("|---|---:|---:|---:|---:|")
    for e in ev[:rows]:
        print(f"| {e.key[:90]} | {e.device_time_total / per:.1f} | {100 * e.device_time_total / total:.1f} | "
              f"{e.count / per:.0f} | {e.device_time_total / e.count:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--short", type=int, default=0, help="also profile a prefill of this many tokens")
    a = ap.parse_args()
    torch.cuda.init()
    model = lily.Model.load(a.model, device="cuda", max_context=8)
    ids = prompt_ids(a.context, model.config.vocab_size)
    s = model.new_session(max_context=a.context + 4 * a.steps + 8, use_graph=False)
    s._core.set_sampler()
    s._core.prefill_sample(ids)
    for _ in range(4):
        s._core.decode_sample(-1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            s._core.decode_sample(-1)
        torch.cuda.synchronize()
    print(f"\n## eager decode at context {a.context}")
    table(prof, a.steps, a.rows)
    s.reset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        s._core.prefill_sample(ids)
        torch.cuda.synchronize()
    print(f"\n## prefill of {a.context} tokens")
    table(prof, 1, a.rows)
    if a.short:
        short_prefill(model, ids[:a.short], a.rows)


def short_prefill(model, ids: np.ndarray, rows: int) -> None:
    s = model.new_session(max_context=len(ids) + 8, use_graph=False)
    s._core.set_sampler()
    walls = []
    for _ in range(6):  # the first is a warm-up
        s.reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s._core.prefill_sample(ids)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    s.reset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        s._core.prefill_sample(ids)
        torch.cuda.synchronize()
    print(f"\n## prefill of {len(ids)} tokens: wall {np.median(walls[1:]) * 1e3:.2f} ms (median of 5)")
    table(prof, 1, rows)


if __name__ == "__main__":
    main()
