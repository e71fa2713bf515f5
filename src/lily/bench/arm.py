"""One arm of the benchmark in a fresh process: one engine, one context length.

    python -m lily.bench.arm --engine lily|mlx --model PATH --context N [--decode 64] [--device cuda]
    python -m lily.bench.arm --engine lily|mlx --model PATH --logits OUT.npy [--tokens 193]
                             [--device cpu|cuda] [--dtype float32]

The last line on stdout is `lily-bench-result: {json}`: status "ok" with the measurements, or
"unavailable" (exit 3; the engine cannot run here, e.g. MLX-LM not installed) or "error" (exit 1).

Timed arm: the contract's prompt of N tokens; an exact-shape warm-up (a prefill of the same N
tokens and a few decode steps, which also captures lily's CUDA decode graph); then one measured
prefill ending when the first generated token is on the host, and exactly --decode greedy steps.
prefill tok/s = N / prefill seconds; decode tok/s = decode steps / decode seconds.
lily: `Session._core.prefill_sample(ids)`, then the steps as `Model.generate` runs them (pipelined,
docs/generation.md): each step is launched before the previous id has reached the host
(`decode_launch(-1)` ahead of `sampled()`), the sampled id stays on the device and is fed back there,
and every id is read on the host. MLX-LM: see mlx_arm.py.

Logits mode: teacher-forced logits [T-1, V] float32 of the first T-1 tokens of the contract's
prompt of --tokens T tokens (position i predicts token i+1), saved as .npy.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import numpy as np

from . import DECODE_STEPS, NUMERICS_TOKENS, RESULT_PREFIX, prompt_ids, vocab_size_of

WARMUP_DECODE = 4
FIRST_TOKENS = 8


def device_used_bytes() -> int | None:
    """GPU memory in use (nvidia-smi), None where there is no nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True, timeout=20).stdout
        return int(out.split()[0]) << 20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def lily_decode(core, steps: int) -> list[int]:
    """`steps` greedy ids after prefill_sample, pipelined as generate.py runs them: the step that feeds
    an id is queued before the id reaches the host, so the device never waits for the host's read."""
    out = []
    if steps:
        core.decode_launch(-1)
    for i in range(steps):
        core.sample_launch()
        if i + 1 < steps:
            core.decode_launch(-1)
        out.append(int(core.sampled()))
    return out


def lily_timed(model_path: str, ids: np.ndarray, decode: int, device: str, warmup_decode: int) -> dict:
    import lily

    t0 = time.perf_counter()
    model = lily.Model.load(model_path, device=device, max_context=8, progress=False)
    load_s = time.perf_counter() - t0
    context = int(ids.size)
    s = model.new_session(max_context=context + max(decode, warmup_decode) + 16)
    core = s._core
    core.set_sampler()  # greedy
    tw = time.perf_counter()
    core.prefill_sample(ids)
    for _ in range(warmup_decode):
        core.decode_sample(-1)
    warmup_s = time.perf_counter() - tw
    s.reset()
    core.set_sampler()
    t0 = time.perf_counter()
    tokens = [int(core.prefill_sample(ids))]
    t1 = time.perf_counter()
    tokens += lily_decode(core, decode)
    t2 = time.perf_counter()
    return {"load_s": load_s, "warmup_s": warmup_s, "prefill_s": t1 - t0, "decode_s": t2 - t1, "tokens": tokens,
            "device": model.device, "graph_nodes": int(core.decode_graph_nodes),
            "device_used_bytes": device_used_bytes() if model.device == "cuda" else None,
            "weight_bytes": int(model._engine.weight_bytes), "versions": {"lily": lily.__version__}}


def lily_logits(model_path: str, ids: np.ndarray, device: str) -> tuple[np.ndarray, dict]:
    import lily

    model = lily.Model.load(model_path, device=device, max_context=8, progress=False)
    s = model.new_session(max_context=int(ids.size) + 8)
    out = s.prefill(ids, all_logits=True)
    return out, {"device": model.device, "versions": {"lily": lily.__version__}}


def timed_arm(a: argparse.Namespace) -> dict:
    ids = prompt_ids(a.context, vocab_size_of(a.model))
    if a.engine == "lily":
        r = lily_timed(a.model, ids, a.decode, a.device, a.warmup_decode)
    else:
        from . import mlx_arm

        mlx_arm.require_gpu_if(a.device)
        r = mlx_arm.timed(a.model, ids, a.decode, a.warmup_decode)
        r["device"] = r["versions"]["device"]
    tokens = r.pop("tokens")
    return {"status": "ok", "engine": a.engine, "context": a.context, "decode_steps": a.decode, **r,
            "prefill_tok_s": a.context / r["prefill_s"], "decode_tok_s": a.decode / r["decode_s"] if a.decode else None,
            "decode_ms": r["decode_s"] / a.decode * 1e3 if a.decode else None,
            "first_tokens": tokens[:FIRST_TOKENS]}


def logits_arm(a: argparse.Namespace) -> dict:
    ids = prompt_ids(a.tokens, vocab_size_of(a.model))[:-1]
    t0 = time.perf_counter()
    if a.engine == "lily":
        out, info = lily_logits(a.model, ids, a.device)
    else:
        from . import mlx_arm

        mlx_arm.require_gpu_if(a.device)
        out, info = mlx_arm.logits(a.model, ids, a.dtype)
    seconds = time.perf_counter() - t0
    np.save(a.logits, np.ascontiguousarray(out, dtype=np.float32))
    return {"status": "ok", "engine": a.engine, "tokens": a.tokens, "shape": list(out.shape), "seconds": seconds,
            "finite": bool(np.isfinite(out).all()), "path": str(a.logits), **info}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lily.bench.arm", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--engine", choices=("lily", "mlx"), required=True)
    p.add_argument("--model", required=True, help="checkpoint folder (the same bytes for every engine)")
    p.add_argument("--context", type=int, help="prompt tokens of a timed arm")
    p.add_argument("--decode", type=int, default=DECODE_STEPS, help="measured decode steps (default 64)")
    p.add_argument("--warmup-decode", type=int, default=WARMUP_DECODE, help="decode steps of the warm-up")
    p.add_argument("--device", default="auto",
                   help="lily's device: auto, cpu or cuda; MLX runs on its default device, and with cuda it must be a GPU")
    p.add_argument("--logits", metavar="OUT.npy", help="save teacher-forced logits instead of timing")
    p.add_argument("--tokens", type=int, default=NUMERICS_TOKENS, help="sequence length of --logits (default 193)")
    p.add_argument("--dtype", help="MLX --logits: float32 casts the model's float parameters to fp32")
    return p


def emit(result: dict) -> None:
    sys.stdout.flush()
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if (a.context is None) == (a.logits is None):
        build_parser().error("give exactly one of --context (timed arm) or --logits (teacher-forced logits)")
    if a.context is not None and (a.context < 1 or a.decode < 0):
        build_parser().error("--context must be positive and --decode non-negative")
    base = {"engine": a.engine, "pid": os.getpid()}
    try:
        emit(timed_arm(a) if a.context is not None else logits_arm(a))
        return 0
    except Exception as e:
        from .mlx_arm import Unavailable

        if isinstance(e, Unavailable):
            print(f"lily bench: {e}", file=sys.stderr)
            emit({**base, "status": "unavailable", "reason": str(e)})
            return 3
        traceback.print_exc()
        emit({**base, "status": "error", "error": f"{type(e).__name__}: {e}"})
        return 1


if __name__ == "__main__":
    sys.exit(main())
