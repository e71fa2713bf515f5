"""One conversation's state on a model: Session, and Snapshot, a saved copy of it.

A Session holds one conversation's state (KV cache, conv state, fp32 recurrent state, position) and
the token ids it has processed. ``Session.prefill(ids)`` continues from the session's position;
``snapshot`` / ``restore`` save and go back to a state exactly. Generation on a session
(``Session.generate`` / ``chat``) is ``lily.Model``'s (lily.model).
"""
from __future__ import annotations

import numbers
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from . import _core
from .checkpoint.config import TextConfig
from .errors import LilyError
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .model import Model

# Prefix snapshots a session keeps for reuse (each holds the full state: KV cache up to its position
# plus every GDN layer's recurrent state, ~60 MB + 20 KB/token for Qwen3.6-35B-A3B).
MAX_PREFIX_SNAPSHOTS = 4


def token_array(token_ids: Iterable[int] | np.ndarray, vocab_size: int) -> np.ndarray:
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
    """A saved session state and the token ids it holds; ``Session.restore`` resumes from it exactly.
    ``save(path)`` writes it to a file that ``Model.load_snapshot`` / ``Session.restore(path)`` read."""

    def __init__(self, core: _core.Snapshot, tokens: tuple[int, ...], model: "Model | None" = None,
                 images: tuple | None = ()):
        self._core = core
        self.tokens = tokens
        # (start, end, digest) of each image in tokens (lily.multimodal); None: unknown images.
        self.images = images
        # A weak reference: snapshots live in their sessions, which their model holds.
        self._model = weakref.ref(model) if model is not None else (lambda: None)

    def save(self, path: str | os.PathLike) -> Path:
        """Write this snapshot to ``path`` (atomically: a temporary file renamed into place); returns
        the path. The file records the model (config hash and weights fingerprint), the device's
        dtypes, the position, the token ids and the raw state; docs/generation.md has the format."""
        from . import snapshot_file

        return snapshot_file.save(self, path)

    @property
    def device(self) -> str:
        """The device whose memory holds the state ('cpu' or 'cuda')."""
        return self._core.device

    @property
    def position(self) -> int:
        return self._core.position

    @property
    def nbytes(self) -> int:
        return self._core.nbytes

    def __repr__(self) -> str:
        return f"Snapshot(position={self.position}, nbytes={self.nbytes / 2**20:.1f} MiB)"


class Closed:
    """Stands in for a released core object: any use names the problem."""

    def __init__(self, what: str):
        self._what = what

    def __getattr__(self, name: str):
        raise LilyError(f"{self._what} is closed (Model.close() released its memory)")


MAX_SIZE = 2**31 - 1  # max_context and prefill_chunk: positions are int32 on the device


def check_size(name: str, value) -> int:
    """A positive int32 session size, checked before anything is allocated from it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 < value <= MAX_SIZE:
        raise LilyError(f"{name} must be an integer in [1, {MAX_SIZE}], got {value!r}")
    return int(value)


def check_context(value, config: TextConfig) -> int:
    """A session size: a positive integer no larger than the model's max_position_embeddings."""
    ctx = check_size("max_context", value)
    if ctx > config.max_position_embeddings:
        raise LilyError(f"max_context {ctx} exceeds the model's max_position_embeddings "
                        f"({config.max_position_embeddings}); use at most that")
    return ctx


class Session:
    """One conversation: caches and recurrent state sized for ``max_context`` tokens."""

    def __init__(self, model: "Model", max_context: int, prefill_chunk: int, use_graph: bool = True):
        self.model = model
        # use_graph: on GPUs, replay one captured CUDA graph per decode step (False: launch eagerly).
        self._tokens: list[int] = []
        self._images: list[tuple[int, int, str]] | None = []  # image spans in _tokens (lily.multimodal)
        self._prefixes: list[Snapshot] = []
        self._busy = False
        self._core = _core.Session(model._engine, int(max_context), int(prefill_chunk), bool(use_graph))

    def _close(self) -> None:
        """Release the caches and state (Model.close)."""
        self._core = Closed("this session's model")
        self._prefixes.clear()
        self._tokens.clear()
        self._images = []

    @property
    def position(self) -> int:
        """Tokens processed so far (the RoPE position of the next token)."""
        return self._core.position

    @property
    def max_context(self) -> int:
        return self._core.max_context

    @property
    def tokens(self) -> tuple[int, ...]:
        """The token ids processed so far, in order (``len(tokens) == position``)."""
        return tuple(self._tokens)

    @property
    def image_spans(self) -> tuple[tuple[int, int, str], ...] | None:
        """(start, end, digest) of each image among ``tokens`` (None: image tokens prefilled in a way
        lily cannot identify, so no prefix of them is reused)."""
        return None if self._images is None else tuple(self._images)

    @property
    def prefix_snapshots(self) -> tuple[Snapshot, ...]:
        """Snapshots kept for prefix reuse, least recently used first."""
        return tuple(self._prefixes)

    def remember_prefix(self, snapshot: Snapshot) -> None:
        """Keep ``snapshot`` for prefix reuse by generate/chat (the least recently used one beyond
        MAX_PREFIX_SNAPSHOTS is dropped)."""
        self._prefixes = [s for s in self._prefixes if s is not snapshot
                          and (s.tokens, s.images) != (snapshot.tokens, snapshot.images)]
        self._prefixes.append(snapshot)
        del self._prefixes[:-MAX_PREFIX_SNAPSHOTS]

    def clear_prefix_snapshots(self) -> None:
        """Drop the snapshots kept for prefix reuse (frees their memory)."""
        self._prefixes.clear()

    def _acquire(self) -> None:
        # A session's state and token list change with every call: two requests at once would
        # interleave their tokens, so the second one is refused rather than silently corrupted.
        if self._busy:
            raise LilyError("this session is busy with another generation (finish or close that stream, "
                            "or use model.new_session())")
        self._busy = True

    def _release(self) -> None:
        self._busy = False

    def _new_ids(self, token_ids) -> np.ndarray:
        """Validated int32 ids that fit in the remaining context."""
        if self._busy:
            raise LilyError("this session is busy with a generation; finish or close that stream first")
        ids = token_array(token_ids, self.model.config.vocab_size)
        if self.position + ids.size > self.max_context:
            raise LilyError(f"context overflow: {self.position} tokens in the session + {ids.size} new exceed "
                            f"max_context {self.max_context}")
        return ids

    def prefill(self, token_ids: Sequence[int] | np.ndarray, *, all_logits: bool = False,
                images: Sequence = ()) -> np.ndarray:
        """Run ``token_ids`` [T] after the current position in chunks; logits [V] of the last token
        (float32), or [T, V] for every token when ``all_logits``. ``images``: one per run of image tokens
        (``<|image_pad|>``) in ``token_ids``, in order: paths, bytes, PIL images, numpy arrays or
        ``lily.images.PreparedImage`` (docs/model.md section 8)."""
        ids = self._new_ids(token_ids)
        extra, spans = self._core_images(ids, images)
        with self.model._lock:
            logits = self._core.prefill(ids, all_logits, *extra)
        self._advance(ids, spans)
        return logits

    def _core_images(self, ids: np.ndarray, images: Sequence) -> tuple[tuple, list]:
        """For prompt ``ids`` continuing this session: the core's extra prefill argument (none without
        images; else PromptImages: the vision tower's merged tokens, where they go, the (t, h, w) rope
        positions and the rope offset after), and the images' spans in the session's tokens."""
        if not len(images):
            return (), []
        from .images import prompt_layout
        from .multimodal import image_spans

        prepared = self.model.prepare_images(images)
        image_id = self.model.config.image_token_id
        layout = prompt_layout(ids, prepared, image_id, self.position, self.position + self._core.rope_delta)
        embeds = self.model.encode_images(prepared)
        spans = [(self.position + a, self.position + b, d) for a, b, d in image_spans(ids, prepared, image_id)]
        return ((embeds, layout.rows, layout.positions, layout.rope_delta),), spans

    def _advance(self, ids, spans: list) -> None:
        """Record prefilled ``ids`` and their image spans. Image tokens prefilled without images are
        text to the model; they stay identifiable as long as no image run continues across calls."""
        held = self._tokens
        if self._images is not None and held and len(ids) and held[-1] == ids[0] == self.model.config.image_token_id:
            self._images = None  # an image run split across calls: which images it holds is unclear
        held.extend(ids.tolist() if isinstance(ids, np.ndarray) else ids)
        if self._images is not None:
            self._images.extend(spans)

    def decode_step(self, token_id: int) -> np.ndarray:
        """Run one token; logits [V] float32 of the next position."""
        if isinstance(token_id, (bool, float)) or not isinstance(token_id, (int, np.integer)):
            raise LilyError(f"token id must be an integer, got {token_id!r}")
        self._new_ids([token_id])
        with self.model._lock:
            logits = self._core.decode_step(int(token_id))
        self._advance([int(token_id)], [])
        return logits

    def trace(self, token_ids: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """Debug: prefill ``token_ids`` [T] like ``prefill`` and also return named activations, each
        [T, H] float32: 'embedding', 'layers.{i}.mixer' (GDN/attention output), 'layers.{i}.moe',
        'layers.{i}.residual' (the stream after layer i), and 'logits' [T, V]."""
        ids = self._new_ids(token_ids)
        with self.model._lock:
            out = dict(self._core.trace(ids))
        self._advance(ids, [])
        return out

    def _check_idle(self, what: str) -> None:
        if self._busy:
            raise LilyError(f"{what}: this session is busy with a generation; finish or close that stream first")

    def snapshot(self) -> Snapshot:
        """A copy of the state; ``restore`` resumes from it exactly. Refused while a stream is open."""
        self._check_idle("snapshot()")
        return self._snapshot()

    def restore(self, snapshot: "Snapshot | str | os.PathLike") -> None:
        """Go back to ``snapshot`` (of a session of this model), or to the snapshot saved in a file
        (``Snapshot.save``; checked as ``Model.load_snapshot`` does, and against this session's
        max_context before anything is allocated). Refused while a stream is open."""
        self._check_idle("restore()")
        if isinstance(snapshot, (str, os.PathLike)):
            from .snapshot_file import SnapshotFileError

            if not Path(snapshot).expanduser().exists():
                raise SnapshotFileError(f"{snapshot}: no such snapshot file (restore takes a lily Snapshot or the "
                                        f"path of a file that Snapshot.save wrote)")
            snapshot = self.model.load_snapshot(snapshot, max_context=self.max_context)
        self._restore(snapshot)

    def reset(self) -> None:
        """Forget every token: position 0, zero recurrent and conv state (prefix snapshots stay).
        Refused while a stream is open."""
        self._check_idle("reset()")
        self._reset()

    # The unchecked forms, for the generation loop that holds the session.
    def _snapshot(self) -> Snapshot:
        with self.model._lock:
            return Snapshot(self._core.snapshot(), tuple(self._tokens), self.model, self.image_spans)

    def _restore(self, snapshot: Snapshot) -> None:
        if not isinstance(snapshot, Snapshot):
            raise LilyError(f"restore expects a lily Snapshot or a snapshot file's path, got "
                            f"{type(snapshot).__name__}")
        with self.model._lock:
            self._core.restore(snapshot._core)
        self._tokens = list(snapshot.tokens)
        self._images = None if snapshot.images is None else list(snapshot.images)

    def _reset(self) -> None:
        with self.model._lock:
            self._core.reset()
        self._tokens.clear()
        self._images = []

    def generate(self, prompt, params: SamplingParams | None = None, **kwargs):
        """``model.generate(prompt, params, session=this session, **kwargs)``."""
        return self.model.generate(prompt, params, session=self, **kwargs)

    def chat(self, messages, params: SamplingParams | None = None, **kwargs):
        """``model.chat(messages, params, session=this session, **kwargs)``."""
        return self.model.chat(messages, params, session=self, **kwargs)

    def state(self) -> dict[str, np.ndarray]:
        """Copies of the state tensors: per GDN layer conv_state [K-1, conv_dim] and recurrent_state
        [Hv, Dk, Dv]; per attention layer k_cache / v_cache [position, nKV, D]."""
        return dict(self._core.state())

    def __repr__(self) -> str:
        if isinstance(self._core, Closed):
            return "Session(closed)"
        return (f"Session(position={self.position}, max_context={self.max_context}, "
                f"prefix_snapshots={len(self._prefixes)}{', busy' if self._busy else ''})")
