"""The ``lily`` command: generate, make-checkpoint.

``lily generate`` without ``--model`` runs the tiny built-in synthetic checkpoint (random weights,
real Qwen3.6 tokenizer), made once and cached, so a fresh install can run end to end offline.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .errors import LilyError


def cache_root() -> Path:
    return Path(os.environ.get("LILY_CACHE_DIR") or Path.home() / ".cache" / "lily")


def tiny_checkpoint() -> Path:
    """The built-in tiny MLX 4-bit checkpoint (seed 0), created on first use."""
    from .synthetic import make_checkpoint

    dest = cache_root() / "checkpoints" / "tiny-mlx-4bit-seed0"
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"lily: writing the built-in tiny checkpoint to {dest} ...", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tiny-"))
    try:
        make_checkpoint(tmp, "tiny", layout="mlx", seed=0)
        try:
            os.replace(tmp, dest)
        except OSError:  # another process won the race
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def cmd_generate(args: argparse.Namespace) -> int:
    from .model import Model

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    path = args.model or tiny_checkpoint()
    t0 = time.perf_counter()
    model = Model.load(path, device=args.device, max_context=args.max_context, progress=not args.quiet)
    t1 = time.perf_counter()
    result = model.generate(prompt, max_tokens=args.max_tokens)
    t2 = time.perf_counter()
    if not args.quiet:
        print(f"{model!r}\nprompt tokens: {result.prompt_tokens}", file=sys.stderr)
        print(f"generated token ids: {result.token_ids}", file=sys.stderr)
    print(result.text)
    if not args.quiet:
        n = len(result.token_ids)
        print(f"[{n} tokens, finish_reason={result.finish_reason}, load {t1 - t0:.2f}s, "
              f"generate {t2 - t1:.2f}s ({n / max(t2 - t1, 1e-9):.1f} tok/s incl. prefill)]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import synthetic

    p = argparse.ArgumentParser(prog="lily", description="Batch-1 inference for Qwen3.5/3.6 MoE checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="greedy generation from a prompt (argument or stdin)",
                       description="Greedy generation. Without --model, uses the tiny built-in synthetic "
                                   "checkpoint (random weights: the text is gibberish, the pipeline is real).")
    g.add_argument("prompt", nargs="?", help="prompt text (read from stdin when omitted)")
    g.add_argument("--model", "-m", help="checkpoint folder or Hugging Face repo id (default: tiny built-in)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="compute device")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    g.add_argument("--max-context", type=int, default=None, help="session size in tokens")
    g.add_argument("--quiet", "-q", action="store_true", help="print only the generated text")
    g.set_defaults(func=cmd_generate)
    m = sub.add_parser("make-checkpoint", help="write a random synthetic checkpoint",
                       description="Write a random checkpoint of any config, MLX 4-bit or Hugging Face bf16 layout.")
    synthetic.add_cli_arguments(m)
    m.set_defaults(func=synthetic.run_cli)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except LilyError as e:
        print(f"lily: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
