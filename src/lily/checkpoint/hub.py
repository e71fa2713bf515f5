"""Where a checkpoint comes from: a local folder, or a Hugging Face repo id downloaded with huggingface_hub."""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import CheckpointError

# Names Model.load and lily serve accept for the tiny built-in checkpoint (lily.checkpoint.tiny).
BUILTIN_NAMES = ("tiny", "lily-tiny")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_path(path_or_repo: str | os.PathLike, revision: str | None = None) -> Path:
    """A local checkpoint folder, or a Hugging Face repo id downloaded with huggingface_hub."""
    p = Path(path_or_repo).expanduser()
    if p.exists():
        if not p.is_dir():
            raise CheckpointError(f"{p}: a checkpoint is a folder with config.json and *.safetensors")
        return p
    if not HUB_ID.match(str(path_or_repo)):
        raise CheckpointError(f"{path_or_repo}: no such folder, and not a Hugging Face repo id (org/name)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path_or_repo), revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt"]))
    except Exception as e:  # network, auth, missing repo: all reported the same way
        raise CheckpointError(f"could not fetch '{path_or_repo}' from the Hugging Face Hub: {e}") from None
