"""The sweep: every (context, round, engine) arm in a fresh process, within a time budget.

Order: contexts ascending; within a context, round 1 runs the engines in the given order, round 2
in reverse, and so on. Before an arm starts, its wall time is predicted from the same engine's
arms so far: the same context measured in an earlier round -> that arm's wall time; else the
largest smaller context c0 -> (wall - 2 * prefill) + 2 * prefill * (c / c0)^k, with k = 1 (linear)
or, when two smaller contexts were measured, the exponent their prefill times show, clamped to
[1, 2] (warm-up and measured prefill both scale; load, start-up and decode do not). An arm whose
prediction exceeds the remaining budget or the arm timeout is recorded as skipped; an arm still
running at min(arm timeout, remaining budget) is killed and recorded as a timeout; after a timeout
the engine's larger contexts are skipped, and after "unavailable" (e.g. MLX-LM not installed) all
its arms. The results file is rewritten after every arm, so a killed sweep keeps what it measured.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from . import DECODE_STEPS, format_context, median, run_logged
from .arm import WARMUP_DECODE

SCHEMA = "lily-bench-sweep/1"


@dataclass
class SweepConfig:
    model: str
    out: str
    engines: list[str] = field(default_factory=lambda: ["lily", "mlx"])
    contexts: list[int] = field(default_factory=lambda: [256, 512])
    rounds: int = 2
    decode: int = DECODE_STEPS
    warmup_decode: int = WARMUP_DECODE
    device: str = "auto"                 # lily's device
    time_budget_s: float | None = None   # the whole sweep
    arm_timeout_s: float | None = 600.0  # one arm
    max_context: dict[str, int] = field(default_factory=dict)  # per-engine cap, e.g. {"mlx": 16384}
    python: str = sys.executable
    logs: str | None = None              # per-arm logs (default: <out>.logs/)
    hash_checkpoint: bool = True
    resume: bool = False


def plan(engines: list[str], contexts: list[int], rounds: int) -> list[tuple[str, int, int]]:
    """(engine, context, round) in run order: contexts ascending, engine order alternating by round."""
    arms = []
    for c in sorted(contexts):
        for r in range(1, rounds + 1):
            order = engines if r % 2 == 1 else list(reversed(engines))
            arms.extend((e, c, r) for e in order)
    return arms


def _prefill_exponent(points: list[tuple[int, float]]) -> float:
    """Growth exponent of prefill time with context from the two largest measured contexts, in [1, 2]."""
    if len(points) < 2:
        return 1.0
    (c1, t1), (c2, t2) = points[-2], points[-1]
    if t1 <= 0 or t2 <= 0 or c2 <= c1:
        return 1.0
    return min(2.0, max(1.0, math.log(t2 / t1) / math.log(c2 / c1)))


def predict_seconds(arms: list[dict], engine: str, context: int) -> tuple[float, str] | None:
    """(predicted wall seconds of arm (engine, context), how) from the engine's ok arms, or None."""
    ok = [a for a in arms if a["engine"] == engine and a["status"] == "ok" and "wall_s" in a]
    same = [a["wall_s"] for a in ok if a["context"] == context]
    if same:
        return max(same), f"measured at {format_context(context)}"
    by_ctx: dict[int, list[dict]] = {}
    for a in ok:
        if a["context"] < context:
            by_ctx.setdefault(a["context"], []).append(a)
    if not by_ctx:
        return None
    points = [(c, median([a["prefill_s"] for a in by_ctx[c]])) for c in sorted(by_ctx)]
    c0, p0 = points[-1]
    wall0 = max(a["wall_s"] for a in by_ctx[c0])
    k = _prefill_exponent(points)
    predicted = max(0.0, wall0 - 2 * p0) + 2 * p0 * (context / c0) ** k
    return predicted, f"from {format_context(c0)} ({wall0:.1f} s), prefill scaled by ({context}/{c0})^{k:.2f}"


def _arm_log_name(engine: str, context: int, rnd: int) -> str:
    return f"{engine}-{context}-r{rnd}.log"


def subprocess_runner(cfg: SweepConfig) -> Callable[[str, int, int, float | None], dict]:
    """An arm runner that starts `python -m lily.bench.arm` in a fresh process (own process group,
    killed whole at the timeout); stderr and the result line go to a per-arm log."""
    logs = Path(cfg.logs or (str(cfg.out) + ".logs"))
    logs.mkdir(parents=True, exist_ok=True)

    def run(engine: str, context: int, rnd: int, timeout: float | None) -> dict:
        cmd = [cfg.python, "-m", "lily.bench.arm", "--engine", engine, "--model", str(cfg.model),
               "--context", str(context), "--decode", str(cfg.decode), "--warmup-decode", str(cfg.warmup_decode),
               "--device", cfg.device]
        return run_logged(cmd, logs / _arm_log_name(engine, context, rnd), timeout)

    return run


def summarize(result: dict) -> dict:
    """Medians per (engine, context) over the ok arms, the reason where there are none, and the ratio
    first engine / second engine per context (tok/s over tok/s: > 1 means the first is faster)."""
    cfg = result["config"]
    engines, contexts = cfg["engines"], cfg["contexts"]
    per: dict[str, dict[str, dict]] = {}
    for e in engines:
        per[e] = {}
        for c in contexts:
            arms = [a for a in result["arms"] if a["engine"] == e and a["context"] == c]
            ok = [a for a in arms if a["status"] == "ok"]
            cell: dict = {"n": len(ok), "rounds": len(arms)}
            if ok:
                cell.update({
                    "prefill_tok_s": median([a["prefill_tok_s"] for a in ok]),
                    "decode_tok_s": median([a["decode_tok_s"] for a in ok]),
                    "prefill_s": median([a["prefill_s"] for a in ok]),
                    "decode_ms": median([a["decode_ms"] for a in ok]),
                    "load_s": median([a.get("load_s") for a in ok]),
                    "all_prefill_tok_s": [a["prefill_tok_s"] for a in ok],
                    "all_decode_tok_s": [a["decode_tok_s"] for a in ok],
                    "first_tokens": ok[0].get("first_tokens"),
                    "tokens_repeat": all(a.get("first_tokens") == ok[0].get("first_tokens") for a in ok),
                })
            failed = [a for a in arms if a["status"] != "ok"]
            if failed:
                cell["missing"] = [{"round": a["round"], "status": a["status"], "reason": arm_reason(a)} for a in failed]
            per[e][str(c)] = cell
    ratios: dict = {}
    if len(engines) >= 2:
        a, b = engines[0], engines[1]
        label = f"{a}/{b}"
        by_ctx = {}
        for c in contexts:
            x, y = per[a][str(c)], per[b][str(c)]
            by_ctx[str(c)] = {k: (x[f"{k}_tok_s"] / y[f"{k}_tok_s"] if x.get(f"{k}_tok_s") and y.get(f"{k}_tok_s")
                                  else None) for k in ("prefill", "decode")}
        ratios = {"label": label, "by_context": by_ctx}
    return {"engines": per, "ratios": ratios}


def arm_reason(a: dict) -> str:
    """A short human reason for an arm without measurements."""
    s = a["status"]
    if s == "timeout":
        return f"timeout (killed after {a.get('limit_s', 0):.0f} s{'; ' + a['why'] if a.get('why') else ''})"
    if s in ("skipped", "unavailable"):
        return a.get("reason", s)
    if s == "error":
        return f"error: {a.get('error', 'exit ' + str(a.get('returncode')))}"
    return s


def write_json(path: str | Path, data: dict) -> None:
    """Atomic: a reader (or a kill) never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_sweep(cfg: SweepConfig, runner=None, clock: Callable[[], float] = time.monotonic,
              log: Callable[[str], None] | None = None) -> dict:
    """Run every arm of the plan (see the module docstring); returns the results dict, also written
    to cfg.out after each arm. `runner(engine, context, round, timeout) -> dict` runs one arm
    (default: a fresh `python -m lily.bench.arm` process)."""
    from .identity import identity

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    start = clock()
    cfg.contexts = sorted(cfg.contexts)
    kept: list[dict] = []
    if cfg.resume and Path(cfg.out).is_file():
        previous = json.loads(Path(cfg.out).read_text())
        kept = [a for a in previous.get("arms", []) if keep_on_resume(a, cfg)]
        pc = previous.get("config", {})
        cfg.contexts = sorted(set(cfg.contexts) | set(pc.get("contexts", [])))
        cfg.engines = cfg.engines + [e for e in pc.get("engines", []) if e not in cfg.engines]
        log(f"lily bench: resuming {cfg.out}: keeping {len(kept)} arms (measured, or timed out at >= the arm "
            f"timeout); contexts {','.join(format_context(c) for c in cfg.contexts)}")
    ident = identity(cfg.model, hash_checkpoint=cfg.hash_checkpoint)
    if kept and cfg.hash_checkpoint:
        old = (previous.get("identity") or {}).get("checkpoint", {}).get("sha256")
        if old and old != ident["checkpoint"]["sha256"]:
            raise ValueError(f"{cfg.out} was measured on another checkpoint (sha256 {old[:12]}..., now "
                             f"{ident['checkpoint']['sha256'][:12]}...): use another --out or drop --resume")
    runner = runner or subprocess_runner(cfg)
    result = {"schema": SCHEMA, "started": _now(), "updated": _now(), "finished": False, "elapsed_s": 0.0,
              "command": sys.argv, "config": {**asdict(cfg), "contexts": cfg.contexts},
              "identity": ident, "engine_versions": {}, "arms": list(kept), "summary": {}}

    def save() -> None:
        result["updated"], result["elapsed_s"] = _now(), clock() - start
        result["summary"] = summarize(result)
        write_json(cfg.out, result)

    save()
    done = {(a["engine"], a["context"], a["round"]) for a in kept}
    blocked: dict[str, str] = {}  # engine -> reason all its later arms are skipped (unavailable)
    for order, (engine, context, rnd) in enumerate(plan(cfg.engines, cfg.contexts, cfg.rounds)):
        if (engine, context, rnd) in done:
            continue
        arm = {"engine": engine, "context": context, "round": rnd, "order": order}
        remaining = None if cfg.time_budget_s is None else cfg.time_budget_s - (clock() - start)
        predicted = predict_seconds(result["arms"], engine, context)
        if predicted is not None:
            arm["predicted_s"] = round(predicted[0], 2)
        cap = cfg.max_context.get(engine)
        timed_out = [a for a in result["arms"] if a["engine"] == engine and a["status"] == "timeout"
                     and a["context"] <= context]
        reason = None
        if engine in blocked:
            reason = blocked[engine]
        elif timed_out:
            t = timed_out[0]
            reason = f"{engine} timed out at {format_context(t['context'])} (limit {t.get('limit_s') or 0:.0f} s)"
        elif cap is not None and context > cap:
            reason = f"above --max-context {engine}={cap}"
        elif remaining is not None and remaining <= 0:
            reason = "time budget spent"
        elif predicted is not None and remaining is not None and predicted[0] > remaining:
            reason = f"predicted {predicted[0]:.0f} s > remaining budget {remaining:.0f} s ({predicted[1]})"
        elif predicted is not None and cfg.arm_timeout_s is not None and predicted[0] > cfg.arm_timeout_s:
            reason = f"predicted {predicted[0]:.0f} s > arm timeout {cfg.arm_timeout_s:.0f} s ({predicted[1]})"
        if reason is not None:
            arm.update(status="skipped", reason=reason)
            log(f"[{clock() - start:7.1f} s] {engine} {format_context(context)} round {rnd}: skipped: {reason}")
        else:
            limits = [x for x in (cfg.arm_timeout_s, remaining) if x is not None]
            timeout = min(limits) if limits else None
            t0 = clock()
            out = runner(engine, context, rnd, timeout)
            arm.update(out)
            arm["wall_s"] = clock() - t0
            if arm["status"] == "timeout" and remaining is not None and cfg.arm_timeout_s is not None \
                    and remaining < cfg.arm_timeout_s:
                arm["why"] = "the sweep's time budget ran out"
            if arm["status"] == "ok":
                result["engine_versions"].setdefault(engine, {**arm.get("versions", {}), "device": arm.get("device")})
                log(f"[{clock() - start:7.1f} s] {engine} {format_context(context)} round {rnd}: prefill "
                    f"{arm['prefill_tok_s']:,.0f} tok/s, decode {arm['decode_tok_s']:,.1f} tok/s (arm {arm['wall_s']:.1f} s"
                    + (f", predicted {arm['predicted_s']:.1f} s)" if "predicted_s" in arm else ")"))
            else:
                log(f"[{clock() - start:7.1f} s] {engine} {format_context(context)} round {rnd}: {arm_reason(arm)}")
            if arm["status"] == "unavailable":
                blocked[engine] = arm_reason(arm)
        result["arms"].append(arm)
        save()
    result["finished"] = True
    save()
    return result


def keep_on_resume(arm: dict, cfg: SweepConfig) -> bool:
    """A previous arm that a resumed sweep keeps instead of running again: a measurement, or a
    timeout at a limit at least the current arm timeout (it would time out again)."""
    if arm.get("status") == "ok":
        return True
    if arm.get("status") == "timeout" and arm.get("limit_s") is not None:
        return cfg.arm_timeout_s is not None and arm["limit_s"] >= cfg.arm_timeout_s
    return False


def status_counts(result: dict) -> str:
    """'18 ok, 2 skipped, 1 timeout' over the arms of a results dict."""
    counts: dict[str, int] = {}
    for a in result.get("arms", []):
        counts[a["status"]] = counts.get(a["status"], 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: (kv[0] != "ok", kv[0]))) or "none"


def parse_max_context(items: list[str] | None) -> dict[str, int]:
    from . import parse_context

    out = {}
    for item in items or []:
        engine, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--max-context {item!r}: expected ENGINE=CONTEXT, e.g. mlx=16K")
        out[engine.strip()] = parse_context(value)
    return out
