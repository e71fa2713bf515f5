"""Markdown tables and a PNG plot from a sweep results file (and optionally a numerics file).

Missing measurements are shown as "—" with the reason (timeout, skipped by the time budget, MLX-LM
not installed, error) in a note under the table; the plot simply has no point there and says so
in its legend. matplotlib is needed only for the plot (`pip install lily[bench]`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from . import format_context
from .sweep import status_counts, summarize

DASH = "—"


def _fmt_rate(x: float | None) -> str:
    if x is None:
        return DASH
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}" if x >= 10 else f"{x:.2f}"


def _fmt_ratio(x: float | None) -> str:
    return DASH if x is None else f"{x:.2f}x"


def _cell(cell: dict, key: str, notes: list[str], engine: str, context: int) -> str:
    value = cell.get(key)
    if value is not None:
        rounds = f" ({cell['n']}/{cell['rounds']})" if cell["n"] < cell["rounds"] else ""
        return _fmt_rate(value) + rounds
    missing = cell.get("missing") or []
    if not missing:
        return DASH
    reason = missing[0]["reason"]
    note = f"{engine} at {format_context(context)}: {reason}"
    if note not in notes:
        notes.append(note)
    return f"{DASH} [{notes.index(note) + 1}]"


def throughput_table(result: dict) -> str:
    """The per-context table: each engine's median prefill and decode tok/s and the ratios."""
    summary = result.get("summary") or summarize(result)
    engines, contexts = result["config"]["engines"], result["config"]["contexts"]
    ratios = summary.get("ratios") or {}
    label = ratios.get("label")
    head = ["context"] + [f"{e} prefill tok/s" for e in engines] + ([f"prefill {label}"] if label else []) \
        + [f"{e} decode tok/s" for e in engines] + ([f"decode {label}"] if label else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    notes: list[str] = []
    for c in contexts:
        cells = [summary["engines"][e][str(c)] for e in engines]
        r = (ratios.get("by_context") or {}).get(str(c), {})
        row = [format_context(c)]
        row += [_cell(cell, "prefill_tok_s", notes, e, c) for e, cell in zip(engines, cells)]
        row += [_fmt_ratio(r.get("prefill"))] if label else []
        row += [_cell(cell, "decode_tok_s", notes, e, c) for e, cell in zip(engines, cells)]
        row += [_fmt_ratio(r.get("decode"))] if label else []
        lines.append("| " + " | ".join(row) + " |")
    text = "\n".join(lines) + "\n"
    if notes:
        text += "\n" + "\n".join(f"[{i + 1}] {n}" for i, n in enumerate(notes)) + "\n"
    return text


def identity_lines(result: dict) -> str:
    ident = result.get("identity") or {}
    lily = ident.get("lily") or {}
    ck = ident.get("checkpoint") or {}
    cfg = result["config"]
    commit = lily.get("commit")
    commit = f"{commit[:12]}{' (dirty)' if lily.get('dirty') else ''}" if commit else "unknown"
    rows = [
        ("GPU", ident.get("gpu") or "none"),
        ("driver / CUDA (driver) / nvcc", f"{ident.get('driver')} / {ident.get('cuda_driver')} / {ident.get('cuda_toolkit')}"),
        ("CPU", f"{ident.get('cpu')} ({ident.get('cpu_count')} cores)"),
        ("host / date", f"{ident.get('host')} / {ident.get('date')}"),
        ("lily", f"{lily.get('version')} commit {commit}, source tree sha256 {(lily.get('source_tree_sha256') or '?')[:16]}"),
    ]
    for engine, v in (result.get("engine_versions") or {}).items():
        if engine != "lily":
            rows.append((engine, ", ".join(f"{k} {val}" for k, val in v.items())))
    if ck:
        size = f", {ck['bytes'] / 1e9:.2f} GB" if ck.get("bytes") else ""
        rows.append(("checkpoint", f"`{ck.get('path')}` sha256 {(ck.get('sha256') or 'not hashed')[:16]}{size}"))
    rows.append(("contract", f"batch 1, greedy, {cfg['decode']} decode steps, {cfg['rounds']} rounds "
                             f"(engine order alternating), lily device {cfg['device']}"))
    budget, timeout = cfg.get("time_budget_s"), cfg.get("arm_timeout_s")
    rows.append(("limits", f"sweep time budget {f'{budget:.0f} s' if budget else 'none'}, arm timeout "
                           f"{f'{timeout:.0f} s' if timeout else 'none'}; arms: {status_counts(result)}"))
    return "\n".join(f"- {k}: {v}" for k, v in rows) + "\n"


def numerics_table(numerics: dict) -> str:
    out = []
    for run_name, run in (numerics.get("runs") or {}).items():
        out.append(f"\n{run_name} checkpoint ({run['layers']} layers, {run['positions']} positions): "
                   + ", ".join(f"{k} {'ppl %.4g' % v['ppl'] if 'ppl' in v else v.get('status')}"
                               for k, v in run["engines"].items()) + "\n")
        if not run["pairs"]:
            out.append("(no pair to compare: fewer than two engines produced logits)")
            continue
        out.append("| test vs ref | ppl ref | ppl test | ppl rel diff | top-1 agreement | mean KL (nats) | max rel dlogit |")
        out.append("|---|---:|---:|---:|---:|---:|---:|")
        for p in run["pairs"]:
            mr = p["max_rel_dlogit"]
            out.append(f"| {p['test']} vs {p['ref']} | {p['ppl_ref']:.4g} | {p['ppl_test']:.4g} | "
                       f"{p['ppl_rel_diff']:+.2e} | {p['top1_agreement']:.3f} | {p['mean_kl']:.2e} | "
                       f"{'—' if mr is None else f'{mr:.2e}'} |")
        missing = [f"{k}: {v.get('status')} ({v.get('reason') or v.get('error') or v.get('limit_s')})"
                   for k, v in run["engines"].items() if v.get("status") != "ok"]
        if missing:
            out.append("\nnot run: " + "; ".join(missing))
    return "\n".join(out).lstrip("\n") + "\n"


def render_markdown(result: dict, numerics: dict | None = None, plot_name: str | None = None) -> str:
    parts = ["## Throughput (median tok/s per context)\n", identity_lines(result), "\n", throughput_table(result)]
    if not result.get("finished"):
        parts.append("\n(the sweep did not finish: the file holds what it measured before it stopped)\n")
    if plot_name:
        parts.append(f"\n![throughput]({plot_name})\n")
    if numerics:
        parts += ["\n## Numerics (teacher-forced, next token)\n\n", numerics_table(numerics)]
    return "".join(parts)


def _plain_ticks(ax) -> None:
    """Log-scale y ticks as plain numbers (1,500 rather than 1.5x10^3)."""
    from matplotlib.ticker import FuncFormatter

    def fmt(v, _pos):
        return f"{v:,.0f}" if v >= 10 else f"{v:.2g}"

    ax.yaxis.set_major_formatter(FuncFormatter(fmt))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, p: fmt(v, p) if str(round(v / 10 ** math.floor(
        math.log10(v)))) in "25" else ""))


def _log_axes(ax, contexts: list[int]) -> None:
    """Log-2 context axis with the contexts as ticks; log y when the panel has data, else a note."""
    ax.set_xscale("log", base=2)
    ax.set_xlim(min(contexts) / 1.3, max(contexts) * 1.3)
    ax.set_xticks(contexts, [format_context(c) for c in contexts], rotation=45)
    has_data = any(len(line.get_xdata()) for line in ax.get_lines() if line.get_label() and
                   not line.get_label().startswith("_"))
    if has_data:
        ax.set_yscale("log")
        _plain_ticks(ax)
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="gray")


def plot(result: dict, path: str | Path) -> Path:
    """PNG: prefill and decode tok/s vs context (log-log, one line per engine) and the ratio panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result.get("summary") or summarize(result)
    engines, contexts = result["config"]["engines"], result["config"]["contexts"]
    ratios = summary.get("ratios") or {}
    fig, axes = plt.subplots(1, 3 if ratios else 2, figsize=(15 if ratios else 10, 4.4))
    ident = result.get("identity") or {}
    for ax, key, title in ((axes[0], "prefill_tok_s", "prefill (tok/s)"), (axes[1], "decode_tok_s", "decode (tok/s)")):
        for e in engines:
            cells = summary["engines"][e]
            xs = [c for c in contexts if cells[str(c)].get(key) is not None]
            ys = [cells[str(c)][key] for c in xs]
            missing = [c for c in contexts if cells[str(c)].get(key) is None]
            label = e + (f" (none at {', '.join(format_context(c) for c in missing)})" if missing and xs else
                         " (no data)" if not xs else "")
            line, = ax.plot(xs, ys, marker="o", label=label)
            for c in xs:  # every round, faint
                vals = cells[str(c)].get("all_" + key) or []
                ax.scatter([c] * len(vals), vals, s=10, color=line.get_color(), alpha=0.35)
        _log_axes(ax, contexts)
        ax.set_title(title)
        ax.set_xlabel("context (tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if ratios:
        ax = axes[2]
        for kind in ("prefill", "decode"):
            xs = [c for c in contexts if ratios["by_context"][str(c)][kind] is not None]
            ax.plot(xs, [ratios["by_context"][str(c)][kind] for c in xs], marker="o", label=kind)
        ax.axhline(1.0, color="gray", lw=0.8)
        _log_axes(ax, contexts)
        ax.set_title(f"ratio {ratios['label']} (tok/s over tok/s)")
        ax.set_xlabel("context (tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"batch-1 greedy, {result['config']['decode']} decode steps; {ident.get('gpu') or 'CPU'}"
                 f"; medians of {result['config']['rounds']} rounds", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
