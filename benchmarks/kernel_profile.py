"""Per-kernel device times of lily's decode steps (eager, then graph-replayed) and one prefill, through
torch.profiler (CUPTI sees every kernel of the process, including lily's own). Needs torch with CUDA.

    python benchmarks/kernel_profile.py --model PATH [--context 4096] [--steps 16] [--rows 40] [--short 11]
        [--sampling "temperature=0.7,top_p=0.8,top_k=20"]

--short N also profiles an N-token prefill (the first token of a short chat: time to first token) and
prints its wall time (median of 5, synchronised) next to the sum of its kernel times. --sampling profiles the
decode steps under that sampler (bench_engine.py's keys; default greedy): the sample kernel's row then shows what
top_k / top_p / min_p cost a step.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import lily
from bench_engine import parse_sampling  # (benchmarks/ is this script's directory, first on sys.path)


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
    ap.add_argument("--sampling", default="", help="the decode steps' sampler as key=value pairs (default greedy)")
    a = ap.parse_args()
    sampling = parse_sampling(a.sampling)
    torch.cuda.init()
    model = lily.Model.load(a.model, device="cuda", max_context=8)
    ids = prompt_ids(a.context, model.config.vocab_size)
    s, prof = decode_steps(model, ids, a.steps, use_graph=False, sampling=sampling)
    print(f"\n## eager decode at context {a.context}")
    table(prof, a.steps, a.rows)
    by_neighbours(prof, a.steps, a.rows)
    _, prof = decode_steps(model, ids, a.steps, use_graph=True, sampling=sampling)
    print(f"\n## graph-replayed decode at context {a.context}")
    table(prof, a.steps, a.rows)
    overlap(prof, a.steps)
    exposed(prof, a.steps, a.rows)
    s.reset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        s._core.prefill_sample(ids)
        torch.cuda.synchronize()
    print(f"\n## prefill of {a.context} tokens")
    table(prof, 1, a.rows)
    if a.short:
        short_prefill(model, ids[:a.short], a.rows)


def decode_steps(model, ids: np.ndarray, steps: int, use_graph: bool, sampling: dict | None = None):
    """A session prefilled with ids, 4 warm-up steps, then `steps` profiled decode steps under `sampling`
    (set_sampler's keywords; greedy without): (session, profile). Graph replays use programmatic launches (a
    kernel may start before its predecessor ends)."""
    s = model.new_session(max_context=len(ids) + 4 * steps + 8, use_graph=use_graph)
    s._core.set_sampler(**(sampling or {}))
    s._core.prefill_sample(ids)
    for _ in range(4):
        s._core.decode_sample(-1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            s._core.decode_sample(-1)
        torch.cuda.synchronize()
    return s, prof


def short_name(name: str) -> str:
    """A kernel's function name without namespace, template arguments or parameters."""
    base = name.split("(")[0]
    base = base.split("<")[0]
    return base.split("::")[-1].replace("void ", "")


def by_neighbours(prof, per: int, rows: int) -> None:
    """Per-kernel times split by the kernels launched just before and after (in device start order),
    which tells apart the calls of one kernel for different ops (e.g. the GEMV of in_proj, out_proj,
    the attention projections and lm_head)."""
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                 and e.time_range.end > e.time_range.start and not e.name.startswith("Memcpy")),
                key=lambda e: e.time_range.start)
    groups: dict[str, list[float]] = {}
    for i, e in enumerate(ev):
        prev = short_name(ev[i - 1].name) if i > 0 else "-"
        nxt = short_name(ev[i + 1].name) if i + 1 < len(ev) else "-"
        key = f"{short_name(e.name)} [{prev} > . > {nxt}]"
        groups.setdefault(key, []).append(e.time_range.end - e.time_range.start)
    total = sum(sum(v) for v in groups.values())
    print("| kernel [before > . > after] | us/pass | % | calls/pass | us/call (median) |")
    print("|---|---:|---:|---:|---:|")
    for key, v in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        print(f"| {key} | {sum(v) / per:.1f} | {100 * sum(v) / total:.1f} | {len(v) / per:.1f} | {np.median(v):.2f} |")


def overlap(prof, steps: int) -> None:
    """Per step: the device's busy time (union of kernel intervals) against the summed kernel times."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return
    busy, total, end = 0.0, sum(b - a for a, b in spans), -1.0
    for a, b in spans:  # union of the intervals
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    wall = spans[-1][1] - spans[0][0]
    print(f"per step: kernels {total / steps:.1f} us summed, device busy {busy / steps:.1f} us (union), "
          f"first start to last end {wall / steps:.1f} us; overlap {(total - busy) / steps:.1f} us, "
          f"idle {(wall - busy) / steps:.1f} us")


def exposed(prof, steps: int, rows: int) -> None:
    """Per kernel (split by neighbours as in by_neighbours): the time its end adds past every earlier
    kernel's end (in start order), i.e. its share of the step's critical path when programmatic launches
    let kernels start early. The shares sum to first start to last end, less the gaps."""
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                 and e.time_range.end > e.time_range.start and not e.name.startswith("Memcpy")),
                key=lambda e: e.time_range.start)
    groups: dict[str, list[float]] = {}
    end = None
    for i, e in enumerate(ev):
        prev = short_name(ev[i - 1].name) if i > 0 else "-"
        nxt = short_name(ev[i + 1].name) if i + 1 < len(ev) else "-"
        key = f"{short_name(e.name)} [{prev} > . > {nxt}]"
        start = e.time_range.start if end is None else max(e.time_range.start, end)
        groups.setdefault(key, []).append(max(0.0, e.time_range.end - start))
        end = e.time_range.end if end is None else max(end, e.time_range.end)
    total = sum(sum(v) for v in groups.values())
    print(f"exposed (critical-path) time per step: {total / steps:.1f} us")
    print("| kernel [before > . > after] | exposed us/pass | % | calls/pass | us/call (median) |")
    print("|---|---:|---:|---:|---:|")
    for key, v in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        print(f"| {key} | {sum(v) / steps:.1f} | {100 * sum(v) / total:.1f} | {len(v) / steps:.1f} | {np.median(v):.2f} |")


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
