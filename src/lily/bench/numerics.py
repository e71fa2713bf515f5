"""Teacher-forced next-token comparison of engines on one fixed sequence, and reduced-layer copies.

The sequence is the contract's prompt of 193 tokens; each engine computes logits [192, V] at
positions 0..191 (position i predicts token i+1) in its own process (`python -m lily.bench.arm
--logits`), saved as .npy and compared here. Engines:
  lily-cuda  lily on the GPU (the engine under test)
  lily-cpu   lily's CPU backend: fp32 everywhere, the reference
  mlx        MLX-LM as it runs the checkpoint (bf16 activations)
  mlx-fp32   MLX-LM with its float parameters cast to fp32 (same 4-bit codes)
Pairs (reference, test): (lily-cpu, lily-cuda), (mlx, lily-cuda), (mlx-fp32, mlx) - the conditioning
check: if MLX's own bf16 and fp32 runs disagree, the checkpoint is too chaotic for end-to-end
agreement to mean anything - and (lily-cpu, mlx-fp32), (lily-cpu, mlx): MLX-LM against lily's fp32
reference on the same bytes.

Metrics per pair: perplexity of tokens 1..192 under each engine, relative difference
(ppl_test - ppl_ref) / ppl_ref, top-1 agreement (argmax equal), mean over positions of
KL(p_ref || p_test) in nats, and max |logit_test - logit_ref| / max |logit_ref|.

The CPU reference is slow on the full model, so the comparison also runs on a reduced-layer copy
(`reduce_checkpoint`: the first N layers, same bytes) where all engines see the same file.
"""
from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import NUMERICS_TOKENS, prompt_ids, run_logged, vocab_size_of

ENGINE_LABELS = ("lily-cuda", "lily-cpu", "mlx", "mlx-fp32")
PAIRS = (("lily-cpu", "lily-cuda"), ("mlx", "lily-cuda"), ("mlx-fp32", "mlx"), ("lily-cpu", "mlx-fp32"),
         ("lily-cpu", "mlx"))
ROW_BLOCK = 32


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of each row."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def perplexity(logits: np.ndarray, targets: np.ndarray) -> float:
    """exp(mean negative log-likelihood) of targets[i] under row i."""
    nll = []
    for s in range(0, len(targets), ROW_BLOCK):
        lp = log_softmax(logits[s:s + ROW_BLOCK])
        nll.append(-lp[np.arange(lp.shape[0]), targets[s:s + ROW_BLOCK]])
    return float(np.exp(np.concatenate(nll).mean()))


def compare(ref: np.ndarray, test: np.ndarray, targets: np.ndarray) -> dict:
    """The metrics of `test` logits against `ref` logits, both [T, V], for next tokens targets [T]."""
    ref, test = np.asarray(ref), np.asarray(test)
    if ref.shape != test.shape or ref.shape[0] != len(targets):
        raise ValueError(f"shapes differ: ref {ref.shape}, test {test.shape}, targets {len(targets)}")
    nll_ref, nll_test, kl = [], [], []
    for s in range(0, len(targets), ROW_BLOCK):
        a, b = log_softmax(ref[s:s + ROW_BLOCK]), log_softmax(test[s:s + ROW_BLOCK])
        rows = np.arange(a.shape[0])
        t = targets[s:s + ROW_BLOCK]
        nll_ref.append(-a[rows, t])
        nll_test.append(-b[rows, t])
        kl.append((np.exp(a) * (a - b)).sum(axis=-1))
    ppl_ref = float(np.exp(np.concatenate(nll_ref).mean()))
    ppl_test = float(np.exp(np.concatenate(nll_test).mean()))
    scale = float(np.abs(ref).max())
    return {
        "positions": int(len(targets)),
        "ppl_ref": ppl_ref,
        "ppl_test": ppl_test,
        "ppl_rel_diff": (ppl_test - ppl_ref) / ppl_ref,
        "top1_agreement": float((ref.argmax(axis=-1) == test.argmax(axis=-1)).mean()),
        "mean_kl": float(np.concatenate(kl).mean()),
        "max_rel_dlogit": float(np.abs(test.astype(np.float64) - ref).max() / scale) if scale > 0 else None,
    }


# ---------------------------------------------------------------------------------------------
# Reduced-layer copies

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_DROP = re.compile(r"(?:^|\.)(mtp|visual|vision_tower|vision_model)(?:\.|$)")


def keep_tensor(name: str, layers: int) -> bool:
    """Whether tensor `name` belongs to the text model's first `layers` layers (or is not per layer:
    embeddings, final norm, lm_head); MTP and vision tensors are dropped."""
    if _DROP.search(name):
        return False
    m = _LAYER.search(name)
    return m is None or int(m.group(1)) < layers


def reduce_config(raw: dict, layers: int) -> dict:
    """config.json with num_hidden_layers and layer_types cut to `layers`, no MTP layers, and the
    quantization entries of dropped layers removed."""
    raw = json.loads(json.dumps(raw))
    text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    n = int(text["num_hidden_layers"])
    if not 1 <= layers <= n:
        raise ValueError(f"layers={layers}: the checkpoint has {n} layers")
    text["num_hidden_layers"] = layers
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:layers]
    if "mtp_num_hidden_layers" in text:
        text["mtp_num_hidden_layers"] = 0
    for key in ("quantization", "quantization_config"):
        q = raw.get(key)
        if isinstance(q, dict):
            raw[key] = {k: v for k, v in q.items() if not isinstance(v, dict) or keep_tensor(k + ".", layers)}
    return raw


def reduce_checkpoint(src: str | Path, dst: str | Path, layers: int, workers: int = 4) -> Path:
    """Write a copy of checkpoint `src` with only its first `layers` layers into `dst`: the kept
    tensors byte for byte (lily's safetensors writer), the config cut to match, and the other
    files (tokenizer, generation config) copied."""
    from ..checkpoint.safetensors_io import INDEX_FILE, SafetensorsFile, save_sharded

    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError("the reduced copy needs another folder than the source")
    raw = json.loads((src / "config.json").read_text())
    config = reduce_config(raw, layers)
    files = [SafetensorsFile(p) for p in sorted(src.glob("*.safetensors"))]
    if not files:
        raise ValueError(f"{src}: no *.safetensors files")
    tensors, metadata = {}, files[0].metadata or None
    for f in files:
        for name in f.names():
            if keep_tensor(name, layers):
                tensors[name] = f.lazy(name)
    dst.mkdir(parents=True, exist_ok=True)
    save_sharded(dst, tensors, metadata=metadata, workers=workers)
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name not in ("config.json", INDEX_FILE) \
                and not p.name.startswith("."):
            shutil.copy2(p, dst / p.name)
    (dst / "config.json").write_text(json.dumps(config, indent=4) + "\n")
    return dst


# ---------------------------------------------------------------------------------------------
# Orchestration

def engine_command(label: str, model: str | Path, out: Path, tokens: int, python: str,
                   device: str = "auto") -> list[str]:
    """The arm command of one numerics engine; MLX gets lily's device under test (cuda: MLX must be on a GPU)."""
    base = [python, "-m", "lily.bench.arm", "--model", str(model), "--logits", str(out), "--tokens", str(tokens)]
    if label.startswith("lily-"):
        return base + ["--engine", "lily", "--device", label.split("-", 1)[1]]
    if label == "mlx":
        return base + ["--engine", "mlx", "--device", device]
    if label == "mlx-fp32":
        return base + ["--engine", "mlx", "--device", device, "--dtype", "float32"]
    raise ValueError(f"unknown numerics engine {label!r} (expected one of {', '.join(ENGINE_LABELS)})")


def run_engine(label: str, model: str | Path, workdir: Path, tokens: int, timeout: float | None,
               python: str = sys.executable, log_dir: Path | None = None,
               device: str = "auto") -> tuple[dict, Path | None]:
    """One engine's logits in its own process: (result record, .npy path or None)."""
    out = workdir / f"{label}.npy"
    cmd = engine_command(label, model, out, tokens, python, device)
    log_path = (log_dir or workdir) / f"numerics-{Path(model).name}-{label}.log"
    t0 = time.perf_counter()
    rec = run_logged(cmd, log_path, timeout)
    rec["wall_s"] = time.perf_counter() - t0
    return rec, (out if rec.get("status") == "ok" else None)


def compare_run(model: str | Path, engines: list[str], workdir: Path, timeout: float | None,
                python: str = sys.executable, log_dir: Path | None = None,
                log=lambda msg: print(msg, file=sys.stderr, flush=True), deadline: float | None = None,
                device: str = "auto") -> dict:
    """All `engines` on one checkpoint, then every pair of PAIRS whose two engines produced logits.
    `deadline` (time.monotonic()) bounds the whole run: later engines get what is left, or are skipped."""
    tokens = NUMERICS_TOKENS
    targets = prompt_ids(tokens, vocab_size_of(model))[1:]
    workdir.mkdir(parents=True, exist_ok=True)
    records, paths = {}, {}
    for label in engines:
        limit = timeout
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 1:
                records[label] = {"status": "skipped", "reason": "numerics time budget spent"}
                log(f"numerics {Path(model).name}: {label}: skipped (time budget spent)")
                continue
            limit = left if limit is None else min(limit, left)
        rec, path = run_engine(label, model, workdir, tokens, limit, python, log_dir, device)
        records[label] = rec
        if path is not None:
            logits = np.load(path, mmap_mode="r")
            rec["ppl"] = perplexity(logits, targets)
            paths[label] = path
            log(f"numerics {Path(model).name}: {label} {rec['seconds']:.1f} s, ppl {rec['ppl']:.4g}")
        else:
            log(f"numerics {Path(model).name}: {label}: {rec.get('status')}: "
                f"{rec.get('reason') or rec.get('error') or rec.get('limit_s')}")
    pairs = []
    for ref, test in PAIRS:
        if ref in paths and test in paths:
            m = compare(np.load(paths[ref], mmap_mode="r"), np.load(paths[test], mmap_mode="r"), targets)
            pairs.append({"ref": ref, "test": test, **m})
            log(f"numerics {Path(model).name}: {test} vs {ref}: ppl rel diff {m['ppl_rel_diff']:+.2e}, "
                f"top-1 {m['top1_agreement']:.3f}, mean KL {m['mean_kl']:.2e}")
    from ..checkpoint.convert import text_config_of

    layers = text_config_of(json.loads((Path(model) / "config.json").read_text()))["num_hidden_layers"]
    return {"checkpoint": str(model), "layers": layers, "tokens": tokens, "positions": tokens - 1,
            "engines": records, "pairs": pairs}


def run_numerics(model: str | Path, out: str | Path, *, device: str = "cuda", cpu_layers: int | None = 4,
                 full_engines: list[str] | None = None, reduced_engines: list[str] | None = None,
                 workdir: str | Path | None = None, timeout: float | None = 900, hash_checkpoint: bool = True,
                 time_budget: float | None = None, python: str = sys.executable,
                 log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict:
    """The numerics of docs/bench.md: on a `cpu_layers`-layer copy, every engine (lily on `device`,
    lily-cpu, mlx, mlx-fp32); on the full checkpoint, `full_engines` (default: all but lily-cpu).
    Written to `out` (JSON) after each run. With device 'cpu' the lily-cuda arm is left out.
    `timeout` bounds each engine run, `time_budget` all of them together."""
    deadline = None if time_budget is None else time.monotonic() + time_budget
    from .identity import identity
    from .sweep import write_json

    lily_dev = f"lily-{device}"
    default = [lily_dev, "lily-cpu", "mlx", "mlx-fp32"] if device != "cpu" else ["lily-cpu", "mlx", "mlx-fp32"]
    reduced_engines = reduced_engines or default
    full_engines = full_engines if full_engines is not None else [e for e in default if e != "lily-cpu"]
    keep = workdir is not None
    work = Path(workdir) if keep else Path(tempfile.mkdtemp(prefix="lily-numerics-"))
    log_dir = Path(str(out) + ".logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    result = {"schema": "lily-bench-numerics/1", "identity": identity(model, hash_checkpoint=hash_checkpoint),
              "sequence": {"tokens": NUMERICS_TOKENS, "positions": NUMERICS_TOKENS - 1,
                           "formula": "((i * 2654435761) mod 2^32) mod vocab_size"},
              "pairs_meaning": "ref -> test; KL(ref || test)", "runs": {}}
    if cpu_layers and any(e.startswith("mlx") for e in reduced_engines):
        from ..checkpoint.convert import text_config_of

        interval = text_config_of(json.loads((Path(model) / "config.json").read_text())).get(
            "full_attention_interval", 4)
        if cpu_layers < interval:
            raise ValueError(f"--cpu-layers {cpu_layers}: mlx-lm's qwen3_5 model needs at least "
                             f"full_attention_interval = {interval} layers (it indexes the cache of layer "
                             f"{interval - 1}, the first attention layer)")
    try:
        if cpu_layers:
            reduced = work / f"{Path(model).name}-{cpu_layers}l"
            t0 = time.perf_counter()
            reduce_checkpoint(model, reduced, cpu_layers)
            log(f"numerics: wrote the {cpu_layers}-layer copy in {time.perf_counter() - t0:.1f} s")
            result["runs"]["reduced"] = compare_run(reduced, reduced_engines, work / "reduced", timeout, python,
                                                    log_dir, log, deadline, device)
            write_json(out, result)
            shutil.rmtree(reduced, ignore_errors=True)
        if full_engines:
            result["runs"]["full"] = compare_run(model, full_engines, work / "full", timeout, python, log_dir, log,
                                                 deadline, device)
            write_json(out, result)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    write_json(out, result)
    return result
