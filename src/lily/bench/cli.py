"""`lily bench` sub-commands: sweep, numerics, report, reduce, identity (see docs/bench.md)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import CONTEXTS, DECODE_STEPS, ENGINES, format_context, parse_contexts

EPILOG = """examples:
  lily bench sweep --model CKPT --device cuda --out results.json --time-budget 420 --arm-timeout 240
  lily bench sweep --model CKPT --engines lily --device cpu --contexts 256,512 --out r.json
  lily bench numerics --model CKPT --device cuda --cpu-layers 4 --out numerics.json
  lily bench report results.json --numerics numerics.json --markdown results.md --plot results.png
  lily bench reduce CKPT CKPT-4l --layers 4
"""


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `lily bench` on the top-level sub-parsers."""
    b = sub.add_parser("bench", help="the end-to-end benchmark against MLX-LM: sweep, numerics, report",
                       description="lily's measurement contract (docs/bench.md): batch-1 greedy prefill and decode "
                                   "throughput per context, each arm in a fresh process, against MLX-LM; "
                                   "teacher-forced numerics; markdown and PNG reports.",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    add_commands(b)
    return b


def add_commands(b: argparse.ArgumentParser) -> None:
    """The sub-commands of `lily bench` on parser b."""
    bs = b.add_subparsers(dest="bench_command", required=True)

    s = bs.add_parser("sweep", help="time every engine at every context (fresh process per arm)")
    s.add_argument("--model", "-m", required=True, help="checkpoint folder (MLX 4-bit layout: both engines load it)")
    s.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, in round-1 order (default lily,mlx)")
    s.add_argument("--contexts", default=None,
                   help=f"comma-separated, 4K = 4096 (default: all of {','.join(format_context(c) for c in CONTEXTS)})")
    s.add_argument("--rounds", type=int, default=2, help="rounds per context, engine order alternating (default 2)")
    s.add_argument("--decode", type=int, default=DECODE_STEPS, help="measured decode steps (default 64)")
    s.add_argument("--device", default="auto", help="lily's device (auto, cpu, cuda)")
    s.add_argument("--out", "-o", default="bench-results.json", help="results JSON, rewritten after every arm")
    s.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="wall-clock budget of the whole sweep; arms predicted not to fit are skipped")
    s.add_argument("--arm-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="kill an arm after this long (default 600)")
    s.add_argument("--max-context", action="append", metavar="ENGINE=N",
                   help="largest context for one engine, e.g. mlx=16K (repeatable)")
    s.add_argument("--resume", action="store_true", help="keep the measured arms already in --out, run the rest")
    s.add_argument("--no-hash", action="store_true", help="do not hash the checkpoint files")
    s.add_argument("--logs", help="per-arm logs folder (default: OUT.logs/)")
    s.add_argument("--markdown", help="also write the markdown report here")
    s.add_argument("--plot", help="also write the PNG plot here (needs matplotlib)")
    s.set_defaults(func=cmd_sweep)

    n = bs.add_parser("numerics", help="teacher-forced comparison: perplexity, top-1 agreement, KL",
                      description="Logits at 192 positions of the contract's fixed sequence from each engine "
                                  "(each in its own process); pairs compared as in docs/bench.md.")
    n.add_argument("--model", "-m", required=True)
    n.add_argument("--device", default="cuda", help="lily's device under test (default cuda; cpu: no lily-cuda arm)")
    n.add_argument("--cpu-layers", type=int, default=4,
                   help="layers of the reduced copy every engine (incl. lily-cpu) runs on (0: none; default 4)")
    n.add_argument("--full-engines", default=None,
                   help="engines run on the full checkpoint (default: lily-DEVICE,mlx,mlx-fp32; '' for none)")
    n.add_argument("--reduced-engines", default=None, help="engines run on the reduced copy (default: all)")
    n.add_argument("--out", "-o", default="bench-numerics.json")
    n.add_argument("--timeout", type=float, default=900.0, help="per engine run (default 900 s)")
    n.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="all engine runs together; later ones get what is left or are skipped")
    n.add_argument("--workdir", help="keep the reduced copy and the logits here (default: a temp folder)")
    n.add_argument("--no-hash", action="store_true")
    n.set_defaults(func=cmd_numerics)

    r = bs.add_parser("report", help="markdown table and PNG plot from a results JSON")
    r.add_argument("results")
    r.add_argument("--numerics", help="a numerics JSON to include")
    r.add_argument("--markdown", help="write the markdown here (default: print it)")
    r.add_argument("--plot", help="write the PNG here")
    r.set_defaults(func=cmd_report)

    d = bs.add_parser("reduce", help="copy a checkpoint keeping only its first N layers")
    d.add_argument("src")
    d.add_argument("dst")
    d.add_argument("--layers", type=int, required=True)
    d.set_defaults(func=cmd_reduce)

    i = bs.add_parser("identity", help="print the hardware/software identity (and checkpoint hash) as JSON")
    i.add_argument("--model", "-m")
    i.add_argument("--no-hash", action="store_true")
    i.set_defaults(func=cmd_identity)


def _engine_list(text: str | None) -> list[str] | None:
    return None if text is None else [e.strip() for e in text.split(",") if e.strip()]


def cmd_sweep(args: argparse.Namespace) -> int:
    from ..errors import LilyError
    from . import report
    from .sweep import SweepConfig, parse_max_context, run_sweep

    try:
        contexts = parse_contexts(args.contexts)
        caps = parse_max_context(args.max_context)
    except ValueError as e:
        raise LilyError(str(e)) from None
    engines = _engine_list(args.engines)
    bad = [e for e in engines if e not in ENGINES]
    if bad or not engines or len(set(engines)) != len(engines):
        raise LilyError(f"--engines {args.engines!r}: expected distinct names among {', '.join(ENGINES)}")
    if args.rounds < 1 or args.decode < 1:
        raise LilyError("--rounds and --decode must be at least 1")
    if not (Path(args.model) / "config.json").is_file():
        raise LilyError(f"{args.model}: not a checkpoint folder (no config.json)")
    cfg = SweepConfig(model=str(args.model), out=args.out, engines=engines, contexts=contexts, rounds=args.rounds,
                      decode=args.decode, device=args.device, time_budget_s=args.time_budget,
                      arm_timeout_s=args.arm_timeout, max_context=caps, logs=args.logs,
                      hash_checkpoint=not args.no_hash, resume=args.resume)
    result = run_sweep(cfg)
    print(report.throughput_table(result))
    _write_reports(result, None, args.markdown, args.plot)
    return 0


def _write_reports(result: dict, numerics: dict | None, markdown: str | None, plot: str | None) -> None:
    from . import report

    if plot:
        try:
            report.plot(result, plot)
        except ImportError:
            print("lily bench: matplotlib is not installed, no plot (pip install matplotlib; "
                  "or run `lily bench report` where it is)", file=sys.stderr)
            plot = None
    if markdown:
        name = None
        if plot:
            try:
                name = str(Path(plot).resolve().relative_to(Path(markdown).resolve().parent))
            except ValueError:
                name = str(plot)
        Path(markdown).write_text(report.render_markdown(result, numerics, name))


def cmd_numerics(args: argparse.Namespace) -> int:
    from .numerics import ENGINE_LABELS, run_numerics

    full, reduced = _engine_list(args.full_engines), _engine_list(args.reduced_engines)
    for e in (full or []) + (reduced or []):
        if e not in ENGINE_LABELS:
            from ..errors import LilyError

            raise LilyError(f"unknown numerics engine {e!r} (expected {', '.join(ENGINE_LABELS)})")
    try:
        result = run_numerics(args.model, args.out, device=args.device, cpu_layers=args.cpu_layers or None,
                              full_engines=full, reduced_engines=reduced, workdir=args.workdir, timeout=args.timeout,
                              time_budget=args.time_budget, hash_checkpoint=not args.no_hash)
    except ValueError as e:
        from ..errors import LilyError

        raise LilyError(str(e)) from None
    from .report import numerics_table

    print(numerics_table(result))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from . import report

    result = report.load(args.results)
    numerics = report.load(args.numerics) if args.numerics else None
    if args.markdown or args.plot:
        _write_reports(result, numerics, args.markdown, args.plot)
    if not args.markdown:
        print(report.render_markdown(result, numerics, args.plot))
    return 0


def cmd_reduce(args: argparse.Namespace) -> int:
    from .numerics import reduce_checkpoint

    try:
        path = reduce_checkpoint(args.src, args.dst, args.layers)
    except ValueError as e:
        from ..errors import LilyError

        raise LilyError(str(e)) from None
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"wrote {path} ({args.layers} layers, {size / 1e9:.2f} GB of weights)")
    return 0


def cmd_identity(args: argparse.Namespace) -> int:
    from .identity import identity

    print(json.dumps(identity(args.model, hash_checkpoint=not args.no_hash), indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m lily.bench.cli ...` = `lily bench ...` (usable where the lily script is not on PATH)."""
    from ..errors import LilyError

    p = argparse.ArgumentParser(prog="python -m lily.bench.cli", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="= lily bench", epilog=EPILOG)
    add_commands(p)
    args = p.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except LilyError as e:
        print(f"lily: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
