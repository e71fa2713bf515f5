"""What lily's commands share: ``lily generate`` / ``chat`` (lily.cli) and ``lily serve`` (lily.server.cli)
take the same model flags and load the model the same way."""
from __future__ import annotations

import argparse
import sys
import time


def add_model_arguments(p: argparse.ArgumentParser, quiet_help: str = "print only the generated text") -> None:
    p.add_argument("--model", "-m", help="checkpoint folder or Hugging Face repo id (default: the tiny "
                                         "built-in synthetic checkpoint: random weights, gibberish text)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="compute device (default auto: CUDA when available)")
    p.add_argument("--max-context", type=int, default=None, help="session size in tokens (default 16384)")
    p.add_argument("--quantize", type=int, choices=(4, 8), default=None,
                   help="quantize a float (Hugging Face) checkpoint to 4 or 8 bits while loading "
                        "(as 'lily convert' would; default: run the stored floats)")
    p.add_argument("--quiet", "-q", action="store_true", help=quiet_help)


def load_model(args: argparse.Namespace):
    from .checkpoint.tiny import tiny_checkpoint
    from .model import Model

    path = args.model or tiny_checkpoint()
    if not args.quiet:
        print(f"lily: loading {path} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    model = Model.load(path, device=args.device, max_context=args.max_context, progress=not args.quiet,
                       quantize=args.quantize)
    if not args.quiet:
        print(f"lily: {model!r} loaded in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return model
