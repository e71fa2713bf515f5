"""The public entry point: Model.load, sessions, prefill / decode_step, a greedy generate.

A Session holds one conversation's state (KV cache, conv state, fp32 recurrent state, position).
``Session.prefill(ids)`` continues from the session's position, so a multi-turn chat prefills only
its new tokens; ``Model.prefill`` / ``Model.decode_step`` drive a default session, and
``Model.prefill`` starts it afresh.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from . import _core
from .config import TextConfig, load_config
from .errors import CheckpointError, DeviceError, LilyError
from .weights import load_weights

DEFAULT_MAX_CONTEXT = 16384
DEFAULT_PREFILL_CHUNK = {"cpu": 128, "cuda": 2048}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when this build has a usable CUDA backend, else 'cpu'."""
    if device not in ("auto", "cpu", "cuda", "metal"):
        raise DeviceError(f"unknown device {device!r} (expected 'auto', 'cpu', 'cuda' or 'metal')")
    if device == "auto":
        return "cuda" if _core.backend_available("cuda") else "cpu"
    if not _core.backend_available(device):
        raise DeviceError(f"device {device!r} is not available: this build of lily has no {device} backend "
                          f"or no such device is present (use device='cpu' or 'auto')")
    return device


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


def _token_array(token_ids: Iterable[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    a = np.asarray(list(token_ids) if not isinstance(token_ids, np.ndarray) else token_ids)
    if a.ndim != 1 or a.size == 0:
        raise LilyError(f"token ids must be a non-empty 1-D sequence, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise LilyError(f"token ids must be integers, got dtype {a.dtype}")
    bad = np.flatnonzero((a < 0) | (a >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise LilyError(f"token id {int(a[i])} at index {i} is outside the vocabulary [0, {vocab_size})")
    return np.ascontiguousarray(a, dtype=np.int32)


class Snapshot:
    """A saved session state; ``Session.restore`` resumes from it exactly."""

    def __init__(self, core: _core.Snapshot):
        self._core = core

    @property
    def position(self) -> int:
        return self._core.position

    @property
    def nbytes(self) -> int:
        return self._core.nbytes

    def __repr__(self) -> str:
        return f"Snapshot(position={self.position}, nbytes={self.nbytes})"


class Session:
    """One conversation: caches and recurrent state sized for ``max_context`` tokens."""

    def __init__(self, model: "Model", max_context: int, prefill_chunk: int, use_graph: bool = True):
        self.model = model
        # use_graph: on GPUs, replay one captured CUDA graph per decode step (False: launch eagerly).
        self._core = _core.Session(model._engine, int(max_context), int(prefill_chunk), bool(use_graph))

    @property
    def position(self) -> int:
        """Tokens processed so far (the RoPE position of the next token)."""
        return self._core.position

    @property
    def max_context(self) -> int:
        return self._core.max_context

    def _new_ids(self, token_ids) -> np.ndarray:
        """Validated int32 ids that fit in the remaining context."""
        ids = _token_array(token_ids, self.model.config.vocab_size)
        if self.position + ids.size > self.max_context:
            raise LilyError(f"context overflow: {self.position} tokens in the session + {ids.size} new exceed "
                            f"max_context {self.max_context}")
        return ids

    def prefill(self, token_ids: Sequence[int] | np.ndarray, *, all_logits: bool = False) -> np.ndarray:
        """Run ``token_ids`` [T] after the current position in chunks; logits [V] of the last token
        (float32), or [T, V] for every token when ``all_logits``."""
        return self._core.prefill(self._new_ids(token_ids), all_logits)

    def decode_step(self, token_id: int) -> np.ndarray:
        """Run one token; logits [V] float32 of the next position."""
        if isinstance(token_id, (bool, float)) or not isinstance(token_id, (int, np.integer)):
            raise LilyError(f"token id must be an integer, got {token_id!r}")
        return self._core.decode_step(int(token_id))

    def trace(self, token_ids: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """Debug: prefill ``token_ids`` [T] like ``prefill`` and also return named activations, each
        [T, H] float32: 'embedding', 'layers.{i}.mixer' (GDN/attention output), 'layers.{i}.moe',
        'layers.{i}.residual' (the stream after layer i), and 'logits' [T, V]."""
        return dict(self._core.trace(self._new_ids(token_ids)))

    def snapshot(self) -> Snapshot:
        return Snapshot(self._core.snapshot())

    def restore(self, snapshot: Snapshot) -> None:
        if not isinstance(snapshot, Snapshot):
            raise LilyError(f"restore expects a lily Snapshot, got {type(snapshot).__name__}")
        self._core.restore(snapshot._core)

    def reset(self) -> None:
        """Forget every token: position 0, zero recurrent and conv state."""
        self._core.reset()

    def state(self) -> dict[str, np.ndarray]:
        """Copies of the state tensors: per GDN layer conv_state [K-1, conv_dim] and recurrent_state
        [Hv, Dk, Dv]; per attention layer k_cache / v_cache [position, nKV, D]."""
        return dict(self._core.state())

    def __repr__(self) -> str:
        return f"Session(position={self.position}, max_context={self.max_context})"


@dataclass
class Generation:
    """Result of a blocking greedy generation."""
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    prompt_tokens: int = 0


class Model:
    """A loaded Qwen3.5/3.6 MoE checkpoint on one device."""

    def __init__(self, path: Path, config: TextConfig, raw_config: dict, engine, device: str, layout: str,
                 max_context: int, prefill_chunk: int):
        self.path, self.config, self.raw_config = path, config, raw_config
        self._engine, self.device, self.layout = engine, device, layout
        self.max_context, self.prefill_chunk = max_context, prefill_chunk
        self._tokenizer = None
        self._session: Session | None = None

    @classmethod
    def load(cls, path_or_repo: str | os.PathLike, device: str = "auto", *, max_context: int | None = None,
             prefill_chunk: int | None = None, progress: bool | None = None, revision: str | None = None) -> "Model":
        """Load a checkpoint folder (MLX or Hugging Face layout) or a Hugging Face repo id.

        ``device``: 'auto' (CUDA when available, else CPU), 'cpu' or 'cuda'. ``max_context``: the
        default session size in tokens. ``progress``: show a progress bar (default: for big checkpoints).
        """
        dev = resolve_device(device)
        path = resolve_path(path_or_repo, revision)
        config, raw = load_config(path)
        if progress is None:
            progress = sum(f.stat().st_size for f in path.glob("*.safetensors")) > (1 << 30)
        store = _core.WeightStore(dev)
        layout = load_weights(path, config, raw, store, progress=progress)
        engine = _core.Engine.create(config.to_core(), store)
        ctx = int(max_context or min(config.max_position_embeddings, DEFAULT_MAX_CONTEXT))
        chunk = int(prefill_chunk or DEFAULT_PREFILL_CHUNK.get(dev, 256))
        if ctx <= 0 or chunk <= 0:
            raise LilyError(f"max_context ({ctx}) and prefill_chunk ({chunk}) must be positive")
        return cls(path, config, raw, engine, dev, layout, ctx, chunk)

    def new_session(self, max_context: int | None = None, *, use_graph: bool = True) -> Session:
        """A fresh, independent conversation state."""
        return Session(self, max_context or self.max_context, self.prefill_chunk, use_graph)

    @property
    def session(self) -> Session:
        """The default session used by Model.prefill / decode_step / generate."""
        if self._session is None:
            self._session = self.new_session()
        return self._session

    def prefill(self, token_ids: Sequence[int] | np.ndarray, *, all_logits: bool = False) -> np.ndarray:
        """Reset the default session and run the prompt; logits [V] of its last token."""
        self.session.reset()
        return self.session.prefill(token_ids, all_logits=all_logits)

    def decode_step(self, token_id: int) -> np.ndarray:
        """Continue the default session by one token; logits [V]."""
        return self.session.decode_step(token_id)

    @property
    def tokenizer(self):
        """The checkpoint's tokenizers.Tokenizer (from tokenizer.json)."""
        if self._tokenizer is None:
            path = self.path / "tokenizer.json"
            if not path.is_file():
                raise CheckpointError(f"{path}: not found; this checkpoint has no tokenizer (pass token ids)")
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(path))
        return self._tokenizer

    def stop_token_ids(self) -> set[int]:
        """generation_config.json's eos ids, else the config's."""
        import json

        gen = self.path / "generation_config.json"
        ids = self.config.eos_token_id
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id", ids)
            ids = eos if isinstance(eos, list) else [eos]
        return {int(i) for i in ids}

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 32) -> Generation:
        """Greedy generation from text (tokenized without BOS) or token ids; stops at an eos id."""
        if max_tokens < 0:
            raise LilyError(f"max_tokens must be >= 0, got {max_tokens}")
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids if isinstance(prompt, str) else list(prompt)
        stops, out, reason = self.stop_token_ids(), [], "length"
        if max_tokens:
            logits = self.prefill(ids)
            while len(out) < max_tokens:
                tok = int(np.argmax(logits))
                if tok in stops:
                    reason = "stop"
                    break
                out.append(tok)
                if len(out) == max_tokens or self.session.position >= self.session.max_context:
                    break
                logits = self.decode_step(tok)
        text = self.tokenizer.decode(out, skip_special_tokens=False) if (self.path / "tokenizer.json").is_file() else ""
        return Generation(text=text, token_ids=out, finish_reason=reason, prompt_tokens=len(ids))

    def __repr__(self) -> str:
        c = self.config
        return (f"Model('{self.path}', device={self.device}, layout={self.layout}, layers={c.num_hidden_layers}, "
                f"hidden={c.hidden_size}, experts={c.num_experts}x top-{c.num_experts_per_tok}, "
                f"weights={self._engine.weight_bytes / 2**20:.1f} MiB)")
