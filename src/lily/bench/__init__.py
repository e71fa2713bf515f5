"""`lily bench`: the end-to-end measurement contract of the performance design, lily against MLX-LM.

Modules:
  arm       one engine, one context length, in a fresh process (`python -m lily.bench.arm`): a timed
            arm (exact-shape warm-up, one prefill, 64 decode steps) or teacher-forced logits
  mlx_arm   the MLX-LM side of an arm (imports mlx only when called)
  sweep     the orchestration: contexts ascending, rounds alternating engine order, a time budget,
            per-arm timeouts, results written after every arm, medians and ratios
  identity  hardware and software identity, checkpoint hash
  numerics  teacher-forced next-token comparison (perplexity, top-1 agreement, KL) and the
            reduced-layer checkpoint copy
  report    markdown table and PNG plot from a results file
  cli       the `lily bench` sub-commands

See docs/bench.md.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
from pathlib import Path

import numpy as np

# The contract's context lengths and decode steps (shared/design/performance.md, "Measurement contract").
CONTEXTS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
DECODE_STEPS = 64
# Numerics: one fixed sequence of 193 tokens; logits at positions 0..191 predict tokens 1..192.
NUMERICS_TOKENS = 193
PROMPT_MULTIPLIER = 2654435761
ENGINES = ("lily", "mlx")
RESULT_PREFIX = "lily-bench-result: "


def prompt_ids(n: int, vocab_size: int) -> np.ndarray:
    """The contract's prompt: token i = ((i * 2654435761) mod 2^32) mod vocab_size, int32 [n]."""
    i = np.arange(n, dtype=np.uint64)
    return ((i * np.uint64(PROMPT_MULTIPLIER)) % np.uint64(2**32) % np.uint64(vocab_size)).astype(np.int32)


_CONTEXT = re.compile(r"^(\d+)([kK]?)$")


def parse_context(text: str) -> int:
    """'4096' or '4K' (= 4096) -> 4096."""
    m = _CONTEXT.match(text.strip())
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"context length {text!r} is not a positive integer or N K (e.g. 4096 or 4K)")
    return int(m.group(1)) * (1024 if m.group(2) else 1)


def parse_contexts(text: str | None) -> list[int]:
    """'256,1K,4K' -> [256, 1024, 4096] (sorted, unique); None or 'all' -> the contract's list."""
    if text is None or text.strip() == "all":
        return list(CONTEXTS)
    return sorted({parse_context(t) for t in text.split(",") if t.strip()})


def format_context(n: int) -> str:
    """4096 -> '4K', 256 -> '256'."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def vocab_size_of(model_path: str | Path) -> int:
    """The vocabulary size in a checkpoint's config.json (nested text_config or flat)."""
    import json

    raw = json.loads((Path(model_path) / "config.json").read_text())
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    return int(text["vocab_size"])


def micro_checkpoint(path: str | Path, vocab_size: int = 4096, num_layers: int = 4, seed: int = 0) -> Path:
    """A tiny MLX 4-bit checkpoint with a small vocabulary (no tokenizer): the harness's CPU tests
    and `benchmarks/sweep_host.sh`'s dry run, fast enough for 64 decode steps on one core."""
    from ..checkpoint import synthetic

    text = dict(synthetic.TINY_TEXT_CONFIG, vocab_size=vocab_size, bos_token_id=0, eos_token_id=1,
                num_hidden_layers=num_layers, layer_types=synthetic._layer_types(num_layers))
    return synthetic.make_checkpoint(path, synthetic.full_config(text), layout="mlx", seed=seed,
                                     with_tokenizer=False, workers=1)


def median(values: list[float]) -> float | None:
    vals = sorted(v for v in values if v is not None and math.isfinite(v))
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def run_logged(cmd: list[str], log_path: Path, timeout: float | None) -> dict:
    """Run one arm's process (`cmd`, its own process group) with stderr and stdout in `log_path`; its
    result record from the last RESULT_PREFIX line of stdout, with returncode and log (plus log_tail
    on errors). On timeout the whole group is killed: {"status": "timeout", "limit_s", "log"}."""
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, _ = proc.communicate()
            log.write(out or "")
            return {"status": "timeout", "limit_s": timeout, "log": str(log_path)}
        log.write(out or "")
    lines = [ln for ln in (out or "").splitlines() if ln.startswith(RESULT_PREFIX)]
    rec = json.loads(lines[-1][len(RESULT_PREFIX):]) if lines else {
        "status": "error", "error": f"no result line from the arm (exit {proc.returncode})"}
    rec["returncode"] = proc.returncode
    rec["log"] = str(log_path)
    if rec.get("status") == "error":
        rec["log_tail"] = log_path.read_text()[-2000:]
    return rec
