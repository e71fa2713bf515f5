"""The MLX-LM side of an arm: load the same checkpoint bytes with mlx-lm and time its own generate
loop, or compute teacher-forced logits. mlx is imported only inside these functions, so lily works
(and says so) without it.

Timing boundaries (docs/bench.md): `mlx_lm.generate.generate_step(prompt, model, max_tokens=65,
sampler=argmax)`; t0 right before the first `next()`; its first yield (the token sampled from the
prompt's last logits) ends the prefill; the next 64 yields are the decode steps. mlx-lm prefills in
chunks of `prefill_step_size` (2048) and evaluates asynchronously one step ahead, as it does when it
serves. The warm-up is the same loop, same prompt length, in the same process.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

INSTALL_HINT = ("install it with `pip install mlx-lm` (and on a CUDA host the MLX CUDA wheel, "
                "`pip install mlx-cuda-13`; see docs/bench.md), or put its install folder on PYTHONPATH")


class Unavailable(Exception):
    """MLX-LM cannot run here (not installed, or no model support); the message says why."""


def import_mlx():
    """(mlx.core, mlx_lm) or Unavailable with a readable reason."""
    try:
        import mlx.core as mx
    except Exception as e:  # ImportError, or a broken native library
        raise Unavailable(f"MLX-LM is not installed: cannot import mlx ({type(e).__name__}: {e}); "
                          f"{INSTALL_HINT}") from None
    try:
        import mlx_lm
    except Exception as e:
        raise Unavailable(f"MLX-LM is not installed: cannot import mlx_lm ({type(e).__name__}: {e}); "
                          f"{INSTALL_HINT}") from None
    return mx, mlx_lm


def require_gpu_if(device: str | None) -> None:
    """When lily runs on a GPU ('cuda'), MLX must too: a CPU fallback would be a meaningless baseline."""
    if device not in ("cuda", "gpu"):
        return
    try:
        import mlx.core as mx
    except Exception:
        import_mlx()  # raises Unavailable with the reason
        raise
    if "gpu" not in str(mx.default_device()).lower():
        raise Unavailable(f"MLX has no GPU here (mx.default_device() is {mx.default_device()}): is the MLX CUDA "
                          f"backend (mlx-cuda-13) installed next to mlx?")


def versions() -> dict:
    mx, mlx_lm = import_mlx()
    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "device": str(mx.default_device())}


def load(model_path: str | Path):
    """The mlx-lm model of a checkpoint folder (no tokenizer needed: synthetic checkpoints have none)."""
    mx, _ = import_mlx()
    from mlx_lm.utils import load_model

    model, _config = load_model(Path(model_path))
    mx.eval(model.parameters())
    return model


def timed(model_path: str | Path, ids: np.ndarray, decode: int, warmup_decode: int) -> dict:
    mx, _ = import_mlx()
    from mlx_lm.generate import generate_step

    info = versions()
    t0 = time.perf_counter()
    model = load(model_path)
    load_s = time.perf_counter() - t0

    def greedy(logprobs):
        return mx.argmax(logprobs, axis=-1)

    prompt = mx.array(ids)

    def run(steps: int) -> tuple[float, float, list[int]]:
        gen = generate_step(prompt, model, max_tokens=steps + 1, sampler=greedy)
        start = time.perf_counter()
        token, _ = next(gen)
        first = time.perf_counter()
        tokens = [int(token)]
        for token, _ in gen:
            tokens.append(int(token))
        end = time.perf_counter()
        gen.close()
        return first - start, end - first, tokens

    mx.reset_peak_memory()
    tw = time.perf_counter()
    run(warmup_decode)
    warmup_s = time.perf_counter() - tw
    mx.clear_cache()
    prefill_s, decode_s, tokens = run(decode)
    if len(tokens) != decode + 1:
        raise RuntimeError(f"mlx-lm's generate_step yielded {len(tokens)} tokens, expected {decode + 1}")
    return {"load_s": load_s, "warmup_s": warmup_s, "prefill_s": prefill_s, "decode_s": decode_s,
            "tokens": tokens, "peak_memory_bytes": int(mx.get_peak_memory()), "versions": info}


def logits(model_path: str | Path, ids: np.ndarray, dtype: str | None = None) -> tuple[np.ndarray, dict]:
    """Teacher-forced logits [T, V] float32 of one forward pass over ids [T]. dtype 'float32' casts
    the model's float parameters (norms, scales, biases, embeddings if unquantized) to fp32 first;
    the packed 4-bit codes stay as they are."""
    mx, _ = import_mlx()
    model = load(model_path)
    if dtype == "float32":
        model.set_dtype(mx.float32)
    elif dtype not in (None, "bfloat16", "native"):
        raise ValueError(f"dtype {dtype!r}: expected float32 or native")
    out = model(mx.array(np.asarray(ids, dtype=np.int32))[None])
    result = np.array(out[0].astype(mx.float32))
    return result, {"versions": versions(), "dtype": dtype or "native", "logits_dtype": str(out.dtype)}
