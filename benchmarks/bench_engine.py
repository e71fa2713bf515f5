"""First end-to-end numbers of one engine on one device: load time, prefill and decode throughput
at several context lengths, peak device memory and kernels per decode step.

    python benchmarks/bench_engine.py --model PATH [--device cuda] [--contexts 1024,4096,16384]

Prompt token i = ((i * 2654435761) mod 2^32) mod vocab (the measurement contract's prompt). Each
context gets a fresh session: a warm-up prefill of the same length and a few decode steps, then one
timed prefill (to the first sampled token) and `--decode` timed greedy steps fed on the device,
pipelined as Model.generate runs them (`decode_ms`: each step queued before the previous id reaches
the host, docs/generation.md "Pipelined decoding"), and again after a second prefill one step at a
time (`decode_sync_ms`: decode_sample(-1), the device idle while the host reads each id). A build
without the pipelined calls (ab_host.sh runs this script against the base tree's package too)
measures both rows synchronously. `--generate N` also times N tokens of Model.generate's stream at
each context (`generate_tok_s`: tokens after the first per second, the Python loop included).
`lily bench` (issue 6) is the full contract against MLX-LM; this is the engine's own quick check.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import lily
from lily.bench.arm import device_used_bytes


def prompt_ids(n: int, vocab: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 2654435761) % 2**32 % vocab).astype(np.int32)


def decode(core, steps: int, pipelined: bool) -> None:
    """`steps` greedy steps after prefill_sample, each id fed on the device and read on the host: one at
    a time (decode_sample), or pipelined (lily.bench.arm.lily_decode's loop, repeated here because this
    script also runs against base builds that predate it)."""
    if not pipelined:
        for _ in range(steps):
            core.decode_sample(-1)
        return
    core.decode_launch(-1)
    for i in range(steps):
        core.sample_launch()
        if i + 1 < steps:
            core.decode_launch(-1)
        core.sampled()


SAMPLING_KEYS = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "seed": int}


def parse_sampling(text: str) -> dict:
    """'temperature=0.7,top_p=0.8,top_k=20' -> the keyword arguments of set_sampler and Model.generate."""
    out = {}
    for part in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in SAMPLING_KEYS:
            raise SystemExit(f"bench_engine: --sampling takes {', '.join(SAMPLING_KEYS)} as key=value, got {part!r}")
        try:
            out[key] = SAMPLING_KEYS[key](value)
        except ValueError:
            kind = "an integer" if SAMPLING_KEYS[key] is int else "a number"
            raise SystemExit(f"bench_engine: --sampling {key} needs {kind}, got {value!r}")
    return out


def measure(model: lily.Model, ctx: int, steps: int, generate: int, sampling: dict) -> dict:
    s = model.new_session(max_context=ctx + max(steps, generate) + 8)
    ids = prompt_ids(ctx, model.config.vocab_size)
    core = s._core
    pipelined = hasattr(core, "sample_launch")
    core.set_sampler(**sampling)
    core.prefill_sample(ids)  # warm-up of the exact shape, and the decode graphs' capture (one per state copy)
    for _ in range(4):
        core.decode_sample(-1)
    rows = {}
    for name, pipe in (("decode", pipelined), ("decode_sync", False)):
        s.reset()
        t0 = time.perf_counter()
        core.prefill_sample(ids)
        t1 = time.perf_counter()
        decode(core, steps, pipe)
        t2 = time.perf_counter()
        rows[f"{name}_ms"] = (t2 - t1) / steps * 1e3
        if name == "decode":
            rows.update(prefill_s=t1 - t0, prefill_tok_s=ctx / (t1 - t0), decode_tok_s=steps / (t2 - t1))
    if generate:
        s.reset()  # the steps above went around the session's token list
        model.generate(ids, max_tokens=4, ignore_eos=True, session=s, **sampling)  # warm-up of the loop
        times = [time.perf_counter() for _ in model.generate(ids, max_tokens=generate, ignore_eos=True, session=s,
                                                              stream=True, **sampling)]
        rows["generate_tok_s"] = (len(times) - 1) / (times[-1] - times[0])
    return {"context": ctx, **rows, "pipelined": pipelined, "graph_nodes": core.decode_graph_nodes,
            "used_bytes": device_used_bytes()}


def profile(model: lily.Model, ctx: int, steps: int) -> dict:
    """Per-op times of one eager prefill of ctx tokens and `steps` eager decode steps."""
    s = model.new_session(max_context=ctx + 2 * steps + 8)
    ids = prompt_ids(ctx, model.config.vocab_size)
    s._core.set_sampler()
    s._core.profile(ids, steps)  # warm-up: kernel setup, caches
    s.reset()
    return s._core.profile(ids, steps)


def print_profile(ctx: int, steps: int, prof: dict) -> None:
    for phase, per in (("prefill", 1), ("decode", steps)):
        rows = sorted(prof[phase].items(), key=lambda kv: -kv[1][0])
        total = sum(ms for ms, _ in prof[phase].values())
        print(f"\n{phase} at context {ctx}: {total / per:.3f} ms per {'prefill' if per == 1 else 'step'} (eager)")
        print("| group | ms | % | calls |")
        print("|---|---:|---:|---:|")
        for name, (ms, calls) in rows:
            print(f"| {name} | {ms / per:.3f} | {100 * ms / total:.1f} | {calls // per} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--generate", type=int, default=0,
                    help="also time this many tokens of Model.generate's stream per context (0: skip)")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--profile", action="store_true", help="also time each op, by layer kind (eager passes)")
    ap.add_argument("--prefill-chunk", type=int, help="the model's prefill chunk (default: the device's)")
    ap.add_argument("--sampling", default="",
                    help="sampler of the decode and generate rows, e.g. 'temperature=0.7,top_p=0.8,top_k=20' "
                         "(keys: temperature, top_k, top_p, min_p, seed; default greedy)")
    a = ap.parse_args()
    sampling = parse_sampling(a.sampling)
    base = device_used_bytes()
    t0 = time.perf_counter()
    model = lily.Model.load(a.model, device=a.device, max_context=8, prefill_chunk=a.prefill_chunk)
    load_s = time.perf_counter() - t0
    rows = [measure(model, int(c), a.decode, a.generate, sampling) for c in a.contexts.split(",")]
    profiles = {int(c): profile(model, int(c), 16) for c in a.contexts.split(",")} if a.profile else {}
    peak = max((r["used_bytes"] or 0) for r in rows)
    result = {"sampling": sampling, "load_s": load_s, "weights_bytes": model._engine.weight_bytes, "device_base_bytes": base,
              "device_peak_bytes": peak, "rows": rows, "profiles": profiles}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"sampling {a.sampling or 'greedy'}; prefill chunk {model.prefill_chunk}; load {load_s:.1f} s; weights {model._engine.weight_bytes / 2**30:.2f} GiB; "
          f"device memory peak {peak / 2**30:.2f} GiB (before load {(base or 0) / 2**30:.2f} GiB)")
    print("| context | prefill tok/s | prefill ms | decode tok/s | decode ms/tok | one at a time ms/tok | "
          "generate tok/s | graph nodes |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        gen = f"{r['generate_tok_s']:.1f}" if "generate_tok_s" in r else "-"
        print(f"| {r['context']} | {r['prefill_tok_s']:.0f} | {r['prefill_s'] * 1e3:.1f} | {r['decode_tok_s']:.1f} | "
              f"{r['decode_ms']:.3f}{'' if r['pipelined'] else ' (one at a time)'} | {r['decode_sync_ms']:.3f} | "
              f"{gen} | {r['graph_nodes']} |")
    for ctx, prof in profiles.items():
        print_profile(ctx, 16, prof)


if __name__ == "__main__":
    main()
