"""The tiny built-in checkpoint (``hub.BUILTIN_NAMES``): random weights, the real Qwen3.6 tokenizer and
chat template; made once with lily.checkpoint.synthetic and cached, so a fresh install runs end to end
offline."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..tokenizer_files import write_tokenizer_files
from .synthetic import SYNTHETIC_MAX_NEW_TOKENS, make_checkpoint

def cache_root() -> Path:
    return Path(os.environ.get("LILY_CACHE_DIR") or Path.home() / ".cache" / "lily")


def tiny_checkpoint() -> Path:
    """The built-in tiny MLX 4-bit checkpoint (seed 0), created on first use."""
    dest = cache_root() / "checkpoints" / "tiny-mlx-4bit-seed0"
    if (dest / "config.json").is_file():
        # Cached before checkpoints carried a template, or a max_new_tokens (the default max_tokens).
        gen = dest / "generation_config.json"
        if not (dest / "chat_template.jinja").is_file() or not gen.is_file() or \
                "max_new_tokens" not in json.loads(gen.read_text()):
            write_tokenizer_files(dest, max_new_tokens=SYNTHETIC_MAX_NEW_TOKENS)
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
