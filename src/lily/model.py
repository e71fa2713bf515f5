"""The public entry point: Model.load, sessions, prefill / decode_step, generate and chat.

A Session holds one conversation's state (KV cache, conv state, fp32 recurrent state, position) and
the token ids it has processed. ``Session.prefill(ids)`` continues from the session's position;
``Model.generate`` / ``Model.chat`` resume from the longest prefix of the new prompt that the session
holds (or has a snapshot of, taken at the last message boundary), so a multi-turn chat prefills only
its new tokens. ``Model.prefill`` / ``Model.decode_step`` drive a default session, and
``Model.prefill`` starts it afresh.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
import os
import re
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from . import _core
from .config import TextConfig, load_config
from .errors import CheckpointError, DeviceError, LilyError
from .generate import Generation, GenerationStream, check_prompt, common_prefix_length, run
from .sampling import SamplingParams
from .tokenizer import Tokenizer
from .weights import load_weights

DEFAULT_MAX_CONTEXT = 16384
# max_tokens when neither the request nor generation_config.json's max_new_tokens sets it: Qwen's
# recommended output length for Qwen3.6 (thinking included), so a real model's reasoning is not cut
# short; the session's context usually ends generation first (finish_reason "length" either way).
DEFAULT_MAX_TOKENS = 32768
# Names Model.load accepts for the tiny built-in synthetic checkpoint (random weights, real tokenizer).
BUILTIN_NAMES = ("tiny", "lily-tiny")
DEFAULT_PREFILL_CHUNK = {"cpu": 128, "cuda": 2048}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Prefix snapshots a session keeps for reuse (each holds the full state: KV cache up to its position
# plus every GDN layer's recurrent state, ~60 MB + 20 KB/token for Qwen3.6-35B-A3B).
MAX_PREFIX_SNAPSHOTS = 4


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
    if not p.exists() and str(path_or_repo) in BUILTIN_NAMES:
        from .cli import tiny_checkpoint

        return tiny_checkpoint()
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
    """A saved session state and the token ids it holds; ``Session.restore`` resumes from it exactly.
    ``save(path)`` writes it to a file that ``Model.load_snapshot`` / ``Session.restore(path)`` read."""

    def __init__(self, core: _core.Snapshot, tokens: tuple[int, ...], model: "Model | None" = None):
        self._core = core
        self.tokens = tokens
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


class _Closed:
    """Stands in for a released core object: any use names the problem."""

    def __init__(self, what: str):
        self._what = what

    def __getattr__(self, name: str):
        raise LilyError(f"{self._what} is closed (Model.close() released its memory)")


MAX_SIZE = 2**31 - 1  # max_context and prefill_chunk: positions are int32 on the device


def _check_size(name: str, value) -> int:
    """A positive int32 session size, checked before anything is allocated from it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 < value <= MAX_SIZE:
        raise LilyError(f"{name} must be an integer in [1, {MAX_SIZE}], got {value!r}")
    return int(value)


def _check_context(value, config: TextConfig) -> int:
    """A session size: a positive integer no larger than the model's max_position_embeddings."""
    ctx = _check_size("max_context", value)
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
        self._prefixes: list[Snapshot] = []
        self._busy = False
        self._core = _core.Session(model._engine, int(max_context), int(prefill_chunk), bool(use_graph))

    def _close(self) -> None:
        """Release the caches and state (Model.close)."""
        self._core = _Closed("this session's model")
        self._prefixes.clear()
        self._tokens.clear()

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
    def prefix_snapshots(self) -> tuple[Snapshot, ...]:
        """Snapshots kept for prefix reuse, least recently used first."""
        return tuple(self._prefixes)

    def remember_prefix(self, snapshot: Snapshot) -> None:
        """Keep ``snapshot`` for prefix reuse by generate/chat (the least recently used one beyond
        MAX_PREFIX_SNAPSHOTS is dropped)."""
        self._prefixes = [s for s in self._prefixes if s is not snapshot and s.tokens != snapshot.tokens]
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
        ids = _token_array(token_ids, self.model.config.vocab_size)
        if self.position + ids.size > self.max_context:
            raise LilyError(f"context overflow: {self.position} tokens in the session + {ids.size} new exceed "
                            f"max_context {self.max_context}")
        return ids

    def prefill(self, token_ids: Sequence[int] | np.ndarray, *, all_logits: bool = False) -> np.ndarray:
        """Run ``token_ids`` [T] after the current position in chunks; logits [V] of the last token
        (float32), or [T, V] for every token when ``all_logits``."""
        ids = self._new_ids(token_ids)
        with self.model._lock:
            logits = self._core.prefill(ids, all_logits)
        self._tokens.extend(ids.tolist())
        return logits

    def decode_step(self, token_id: int) -> np.ndarray:
        """Run one token; logits [V] float32 of the next position."""
        if isinstance(token_id, (bool, float)) or not isinstance(token_id, (int, np.integer)):
            raise LilyError(f"token id must be an integer, got {token_id!r}")
        self._new_ids([token_id])
        with self.model._lock:
            logits = self._core.decode_step(int(token_id))
        self._tokens.append(int(token_id))
        return logits

    def trace(self, token_ids: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """Debug: prefill ``token_ids`` [T] like ``prefill`` and also return named activations, each
        [T, H] float32: 'embedding', 'layers.{i}.mixer' (GDN/attention output), 'layers.{i}.moe',
        'layers.{i}.residual' (the stream after layer i), and 'logits' [T, V]."""
        ids = self._new_ids(token_ids)
        with self.model._lock:
            out = dict(self._core.trace(ids))
        self._tokens.extend(ids.tolist())
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
            return Snapshot(self._core.snapshot(), tuple(self._tokens), self.model)

    def _restore(self, snapshot: Snapshot) -> None:
        if not isinstance(snapshot, Snapshot):
            raise LilyError(f"restore expects a lily Snapshot or a snapshot file's path, got "
                            f"{type(snapshot).__name__}")
        with self.model._lock:
            self._core.restore(snapshot._core)
        self._tokens = list(snapshot.tokens)

    def _reset(self) -> None:
        with self.model._lock:
            self._core.reset()
        self._tokens.clear()

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
        if isinstance(self._core, _Closed):
            return "Session(closed)"
        return (f"Session(position={self.position}, max_context={self.max_context}, "
                f"prefix_snapshots={len(self._prefixes)}{', busy' if self._busy else ''})")


class Model:
    """A loaded Qwen3.5/3.6 MoE checkpoint on one device."""

    def __init__(self, path: Path, config: TextConfig, raw_config: dict, engine, device: str, layout: str,
                 max_context: int, prefill_chunk: int):
        self.path, self.config, self.raw_config = path, config, raw_config
        self._engine, self.device, self.layout = engine, device, layout
        self.max_context, self.prefill_chunk = max_context, prefill_chunk
        self._tokenizer: Tokenizer | None = None
        self._session: Session | None = None
        self._stop_ids: frozenset[int] | None = None
        # One core call at a time: sessions share the engine's weights and scratch buffers.
        self._lock = threading.Lock()
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()

    @classmethod
    def load(cls, path_or_repo: str | os.PathLike, device: str = "auto", *, max_context: int | None = None,
             prefill_chunk: int | None = None, progress: bool | None = None, revision: str | None = None,
             quantize: int | None = None, check_weights: bool = True) -> "Model":
        """Load a checkpoint folder (MLX or Hugging Face layout) or a Hugging Face repo id.

        ``device``: 'auto' (CUDA when available, else CPU), 'cpu' or 'cuda'. ``max_context``: the
        default session size in tokens. ``progress``: show a progress bar (default: for big checkpoints).
        ``quantize``: 4 or 8 quantizes a float (Hugging Face) checkpoint's matrices while loading, to the
        MLX affine form ``lily convert`` writes (group 64, router gates 8-bit), so the GPU runs its fast
        quantized kernels; None (default) runs the stored floats. ``check_weights`` (default True):
        refuse a checkpoint whose float tensors hold NaN or infinity (one vectorised pass over the
        bits as each tensor is read; False skips it).
        """
        if quantize is not None and (isinstance(quantize, bool) or quantize not in (4, 8)):
            raise LilyError(f"quantize must be 4, 8 or None, got {quantize!r}")
        dev = resolve_device(device)
        path = resolve_path(path_or_repo, revision)
        config, raw = load_config(path)
        ctx = _check_context(min(config.max_position_embeddings, DEFAULT_MAX_CONTEXT)
                             if max_context is None else max_context, config)
        chunk = _check_size("prefill_chunk", DEFAULT_PREFILL_CHUNK.get(dev, 256) if prefill_chunk is None
                            else prefill_chunk)
        if progress is None:
            progress = sum(f.stat().st_size for f in path.glob("*.safetensors")) > (1 << 30)
        store = _core.WeightStore(dev)
        layout = load_weights(path, config, raw, store, progress=progress, quantize=quantize,
                              check_weights=check_weights)
        engine = _core.Engine.create(config.to_core(), store)
        return cls(path, config, raw, engine, dev, layout, ctx, chunk)

    def new_session(self, max_context: int | None = None, *, use_graph: bool = True) -> Session:
        """A fresh, independent conversation state."""
        if self.closed:
            raise LilyError("this model is closed (Model.close() released its memory)")
        ctx = self.max_context if max_context is None else _check_context(max_context, self.config)
        try:
            session = Session(self, ctx, self.prefill_chunk, use_graph)
        except MemoryError:
            raise LilyError(f"max_context {ctx}: not enough memory for a session of that size") from None
        self._sessions.add(session)
        return session

    def load_snapshot(self, path: str | os.PathLike, *, max_context: int | None = None) -> Snapshot:
        """The snapshot saved at ``path`` by ``Snapshot.save``, on this model's device, for
        ``Session.restore``. Refused with a LilyError naming the problem when the file is not a lily
        snapshot, of another format version, of another model (config or weights), truncated or
        corrupt (per-blob crc32), saved on a device that keeps the state in other dtypes (a CUDA
        session's bf16 KV cache does not load into a CPU session's fp32 one, nor the reverse), or
        longer than ``max_context`` tokens (default: the model's max_position_embeddings)."""
        from . import snapshot_file

        if self.closed:
            raise LilyError("this model is closed (Model.close() released its memory)")
        return snapshot_file.load(self, path, max_context)

    @property
    def closed(self) -> bool:
        return isinstance(self._engine, _Closed)

    def close(self) -> None:
        """Release the weights and every session's caches (device memory is freed once no snapshot
        or array you hold refers to it). Later calls on the model or its sessions raise LilyError.
        Refused while a generation is running. Idempotent; ``with Model.load(...) as m:`` closes on exit."""
        if self.closed:
            return
        with self._lock:
            busy = [s for s in self._sessions if s._busy]
            if busy:
                raise LilyError("Model.close(): a generation is still running (finish or close its stream first)")
            for s in list(self._sessions):
                s._close()
            self._session = None
            self._engine = _Closed("this model")

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer and chat template (lily.tokenizer.Tokenizer)."""
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_dir(self.path)
        return self._tokenizer

    @property
    def has_tokenizer(self) -> bool:
        """Whether the checkpoint has a tokenizer.json (without one, prompts must be token ids)."""
        return self._tokenizer is not None or (self.path / "tokenizer.json").is_file()

    @property
    def generation_config(self) -> dict:
        """generation_config.json ({} when the checkpoint has none)."""
        gen = self.path / "generation_config.json"
        if not gen.is_file():
            return {}
        try:
            return json.loads(gen.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{gen}: invalid JSON ({e})") from None

    def stop_token_ids(self) -> frozenset[int]:
        """The ids that end a generation: generation_config.json's eos ids, else the config's
        (Qwen3.6: <|im_end|> 248046 and <|endoftext|> 248044)."""
        if self._stop_ids is None:
            eos = self.generation_config.get("eos_token_id", self.config.eos_token_id)
            eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
            self._stop_ids = frozenset(int(i) for i in eos if i is not None)
        return self._stop_ids

    @property
    def default_max_tokens(self) -> int:
        """max_tokens when a request leaves it out: generation_config.json's ``max_new_tokens`` (the
        synthetic checkpoints set 32: random weights rarely sample an end token), else
        DEFAULT_MAX_TOKENS (32768, Qwen's recommended output length). The session's context caps it;
        either way the result says finish_reason 'length'."""
        n = self.generation_config.get("max_new_tokens")
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
        return DEFAULT_MAX_TOKENS

    def default_sampling(self, **overrides) -> SamplingParams:
        """The checkpoint's recommended sampling (generation_config.json; Qwen3.6: temperature 1.0,
        top_k 20, top_p 0.95), with ``overrides``."""
        return SamplingParams.from_generation_config(self.generation_config, **overrides)

    def generate(self, prompt, params: SamplingParams | None = None, *, stream: bool = False,
                 session: Session | None = None, tools: Sequence[Mapping] | None = None,
                 enable_thinking: bool | None = None, preserve_thinking: bool | None = None,
                 chat_template_kwargs: Mapping | None = None, progress: bool | None = None, **sampling):
        """Generate from one prompt or a list of prompts.

        ``prompt``: text (encoded without BOS), token ids (a list or 1-D integer array), chat
        messages (a list of {'role', 'content'} dicts, rendered with the chat template and a
        generation prompt), or a list of such prompts (run one after another; prompts that share a
        prefix prefill it once). ``params``: a SamplingParams (default greedy); keyword arguments
        (``max_tokens=16``, ``temperature=0.7``, ``stop=[...]``, ...) override its fields.
        ``session``: the Session to run on (default: the model's default session); it resumes from
        the longest prefix of the prompt it already holds. ``tools``, ``enable_thinking``,
        ``preserve_thinking``, ``chat_template_kwargs``: passed to the chat template for messages;
        ``tools`` also types the parsed ``Generation.tool_calls``. ``max_tokens`` left out (None):
        ``model.default_max_tokens``, capped by the context; given, prompt + max_tokens must fit the
        session's context (LilyError otherwise, as the server answers 400). ``progress``: a
        progress bar on stderr for a list of prompts (default: when stderr is a terminal).

        Returns a Generation; with ``stream=True`` a GenerationStream, an iterator of
        GenerationEvent (text delta, token id, logprobs, finish reason) whose ``result()`` is the
        Generation. For a list of prompts: a list of Generation, or with ``stream=True`` an iterator
        that yields each prompt's Generation as soon as it is done (all prompts are checked first).
        """
        params = _sampling_params(params, sampling)
        session = session if session is not None else self.session
        if not isinstance(session, Session) or session.model is not self:
            raise LilyError("session must be a Session of this model (model.new_session())")
        template = dict(chat_template_kwargs or {}, tools=tools, enable_thinking=enable_thinking,
                        preserve_thinking=preserve_thinking)
        if _is_batch(prompt):
            prepared = [self._prepare(p, template) for p in prompt]
            for ids, _, _ in prepared:
                check_prompt(ids, session)
            for ids, _, _ in prepared:
                self._check_max_tokens(ids, params, session)
            results = self._generate_each(prepared, params, session, tools, progress)
            return results if stream else list(results)
        ids, boundary, thinking = self._prepare(prompt, template)
        out = self._start(session, ids, params, boundary, thinking, tools)
        return out if stream else out.result()

    def chat(self, messages: Sequence[Mapping], params: SamplingParams | None = None, **kwargs):
        """``generate`` for one conversation, or for a list of conversations (as vLLM's
        ``LLM.chat``): ``messages`` is a list of {'role', 'content'} dicts (system, user, assistant
        with optional 'reasoning_content' / 'tool_calls', tool). Append ``result.message`` and the
        next user message to continue; the session then prefills only what is new since the last
        message boundary. ``params`` defaults to the checkpoint's recommended sampling
        (``default_sampling()``, as ``lily chat`` and ``lily serve`` use); ``temperature=0`` is greedy."""
        if not (_is_messages(messages) or (isinstance(messages, (list, tuple)) and messages
                                           and all(_is_messages(c) for c in messages))):
            raise LilyError("chat takes a list of messages: [{'role': 'user', 'content': '...'}, ...], or a list "
                            "of such conversations")
        if params is None:
            params = self.default_sampling()
        return self.generate(messages, params, **kwargs)

    def stream_generate(self, prompt, params: SamplingParams | None = None, **kwargs) -> GenerationStream:
        """``generate(prompt, params, stream=True, **kwargs)`` (mlx-lm's name): an iterator of
        GenerationEvent with ``text``, ``reasoning`` / ``content``, ``tokens_per_second``."""
        return self.generate(prompt, params, stream=True, **kwargs)

    def _generate_each(self, prepared: list, params: SamplingParams, session: Session, tools,
                       progress: bool | None) -> Iterator[Generation]:
        import sys

        from tqdm.auto import tqdm

        if progress is None:
            progress = len(prepared) > 1 and sys.stderr.isatty()
        with tqdm(total=len(prepared), desc="generate", unit="prompt", disable=not progress, file=sys.stderr) as bar:
            for i, (ids, boundary, thinking) in enumerate(prepared):
                if i + 1 < len(prepared):
                    # Snapshot where the next prompt diverges, so that it prefills only its own part
                    # (at most one token before this prompt's end: one is needed to sample from).
                    boundary = min(common_prefix_length(ids, prepared[i + 1][0]), len(ids) - 1) or boundary
                result = self._start(session, ids, params, boundary, thinking, tools).result()
                bar.update(1)
                yield result

    def _check_max_tokens(self, ids: list[int], params: SamplingParams, session: Session) -> None:
        """An explicit max_tokens must fit the context with the prompt (the server's rule: 400)."""
        n, room = len(ids), session.max_context
        if params.max_tokens is not None and n + params.max_tokens > room:
            raise LilyError(f"max_tokens={params.max_tokens} with a {n}-token prompt exceeds the session's "
                            f"max_context of {room} tokens; at most {room - n} tokens can be generated "
                            f"(leave max_tokens out to generate until the context is full)")

    def _prepare(self, prompt, template: dict) -> tuple[list[int], int | None, bool]:
        """(prompt ids, message boundary or None, whether the prompt leaves a think block open)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), None, _opens_think(prompt)
        if _is_messages(prompt):
            tok = self.tokenizer
            text = tok.apply_chat_template(prompt, add_generation_prompt=True, **template)
            ids = tok.encode(text)
            history = tok.encode(tok.apply_chat_template(prompt, add_generation_prompt=False, **template))
            boundary = len(history) if ids[:len(history)] == history else None
            return ids, boundary, _opens_think(text)
        if isinstance(prompt, np.ndarray) or (isinstance(prompt, Sequence) and not isinstance(prompt, bytes)):
            return _token_array(prompt, self.config.vocab_size).tolist(), None, False
        raise LilyError(f"prompt must be text, token ids, chat messages or a list of those, "
                        f"got {type(prompt).__name__}")

    def _start(self, session: Session, ids: list[int], params: SamplingParams, boundary: int | None,
               thinking: bool, tools=None) -> GenerationStream:
        check_prompt(ids, session)
        self._check_max_tokens(ids, params, session)
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=self.default_max_tokens)
        tokenizer = self.tokenizer if self.has_tokenizer else None
        if params.stop and tokenizer is None:
            raise LilyError("stop strings need the checkpoint's tokenizer (tokenizer.json); use stop_token_ids")
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.stop_token_ids())
        result = Generation(text="", thinking=thinking, tools=list(tools) if tools else None)
        return GenerationStream(run(session, ids, params, tokenizer, stop_ids, result, boundary), result)

    def __repr__(self) -> str:
        c = self.config
        if self.closed:
            return f"Model('{self.path}', device={self.device}, closed)"
        return (f"Model('{self.path}', device={self.device}, layout={self.layout}, layers={c.num_hidden_layers}, "
                f"hidden={c.hidden_size}, experts={c.num_experts}x top-{c.num_experts_per_tok}, "
                f"weights={self._engine.weight_bytes / 2**20:.1f} MiB)")


def _sampling_params(params: SamplingParams | None, overrides: dict) -> SamplingParams:
    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        raise LilyError(f"params must be a lily.SamplingParams, got {type(params).__name__}")
    if overrides:
        names = [f.name for f in dataclasses.fields(SamplingParams)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise LilyError(f"unknown generation argument(s) {', '.join(unknown)}; sampling parameters are "
                            f"{', '.join(names)}")
        params = dataclasses.replace(params, **overrides)
    return params


def _is_messages(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, Mapping) for m in prompt)


def _is_batch(prompt) -> bool:
    """A list of prompts (texts, id lists or conversations), as opposed to one id list or conversation."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(p, (str, np.ndarray)) or (isinstance(p, Sequence) and not isinstance(p, bytes))
                    for p in prompt))


def _opens_think(text: str) -> bool:
    """Whether the prompt ends inside a think block (Qwen3.6's generation prompt with thinking on)."""
    return text.rfind("<think>") > text.rfind("</think>")
