"""The public entry point: Model.load, prefill / decode_step, generate and chat.

A Model is one loaded checkpoint on one device; its conversations are Sessions (lily.session).
``Model.generate`` / ``Model.chat`` resume from the longest prefix of the new prompt that the session
holds (or has a snapshot of, taken at the last message boundary), so a multi-turn chat prefills only
its new tokens. ``Model.prefill`` / ``Model.decode_step`` drive a default session, and
``Model.prefill`` starts it afresh. Prompts are prepared in lily.prompts, the token loop runs in
lily.generate, the checkpoint is read by lily.checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from . import _core, constraints
from .checkpoint.config import TextConfig, load_config
from .checkpoint.hub import BUILTIN_NAMES, resolve_path
from .checkpoint.weights import load_weights
from .constraints import Constraint
from .device import resolve_device
from .errors import CheckpointError, LilyError
from .generate import Generation, GenerationStream, check_prompt, common_prefix_length, run
from .prompts import is_batch, is_messages, prepare, sampling_params
from .sampling import SamplingParams
from .session import Closed, Session, Snapshot, check_context, check_size
from .tokenizer import Tokenizer

DEFAULT_MAX_CONTEXT = 16384
# max_tokens when neither the request nor generation_config.json's max_new_tokens sets it: Qwen's
# recommended output length for Qwen3.6 (thinking included), so a real model's reasoning is not cut
# short; the session's context usually ends generation first (finish_reason "length" either way).
DEFAULT_MAX_TOKENS = 32768
DEFAULT_PREFILL_CHUNK = {"cpu": 128, "cuda": 8192}


class Model:
    """A loaded Qwen3.5/3.6 MoE checkpoint on one device."""

    def __init__(self, path: Path, config: TextConfig, raw_config: dict, engine, device: str, layout: str,
                 max_context: int, prefill_chunk: int):
        self.path, self.config, self.raw_config = path, config, raw_config
        self._engine, self.device, self.layout = engine, device, layout
        self.max_context, self.prefill_chunk = max_context, prefill_chunk
        self._tokenizer: Tokenizer | None = None
        self._image_processor = None
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
        if str(path_or_repo) in BUILTIN_NAMES and not Path(path_or_repo).expanduser().exists():
            from .checkpoint.tiny import tiny_checkpoint

            path = tiny_checkpoint()
        else:
            path = resolve_path(path_or_repo, revision)
        config, raw = load_config(path)
        ctx = check_context(min(config.max_position_embeddings, DEFAULT_MAX_CONTEXT)
                             if max_context is None else max_context, config)
        chunk = check_size("prefill_chunk", DEFAULT_PREFILL_CHUNK.get(dev, 256) if prefill_chunk is None
                            else prefill_chunk)
        if progress is None:
            progress = sum(f.stat().st_size for f in path.glob("*.safetensors")) > (1 << 30)
        store = _core.WeightStore(dev)
        layout, config = load_weights(path, config, raw, store, progress=progress, quantize=quantize,
                              check_weights=check_weights)
        engine = _core.Engine.create(config.to_core(), store)
        return cls(path, config, raw, engine, dev, layout, ctx, chunk)

    @property
    def image_processor(self):
        """The checkpoint's preprocessor_config.json (lily.images.ImageProcessorConfig)."""
        if self._image_processor is None:
            from .images import load_processor_config

            self._image_processor = load_processor_config(self.path)
        return self._image_processor

    def prepare_images(self, images, *, min_pixels: int | None = None, max_pixels: int | None = None) -> list:
        """Images (paths, bytes, PIL images, numpy arrays, or lily.images.PreparedImage passed through)
        as the vision tower reads them; ``min_pixels`` / ``max_pixels`` override the checkpoint's bounds."""
        from .images import PreparedImage, prepare_image

        cfg = self.image_processor.with_pixels(min_pixels, max_pixels)
        return [im if isinstance(im, PreparedImage) else prepare_image(im, cfg) for im in images]

    def check_images(self) -> None:
        """Raise LilyError unless this model can read images: the checkpoint has a vision tower
        (docs/vision.md; both backends run it)."""
        if self.config.vision is None:
            raise LilyError(f"{self.path.name}: this checkpoint has no vision tower (no vision_config in "
                            f"config.json, or no model.visual.* tensors in its files), so it cannot read images")

    def encode_images(self, prepared) -> np.ndarray:
        """The vision tower's merged tokens [sum of num_tokens, hidden_size] float32 of prepared images, in
        order (docs/model.md section 8); raises when the checkpoint has no vision tower."""
        self.check_images()
        pixels = prepared[0].pixels if len(prepared) == 1 else np.concatenate([p.pixels for p in prepared])
        grids = np.array([p.grid for p in prepared], np.int32)
        with self._lock:
            return self._engine.encode_images(pixels, grids)

    def new_session(self, max_context: int | None = None, *, use_graph: bool = True) -> Session:
        """A fresh, independent conversation state."""
        if self.closed:
            raise LilyError("this model is closed (Model.close() released its memory)")
        ctx = self.max_context if max_context is None else check_context(max_context, self.config)
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
        core, tokens, images = snapshot_file.load(self, path, max_context)
        return Snapshot(core, tokens, self, images)

    @property
    def closed(self) -> bool:
        return isinstance(self._engine, Closed)

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
            self._engine = Closed("this model")

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
                 chat_template_kwargs: Mapping | None = None, progress: bool | None = None,
                 json_schema=None, regex: str | None = None, grammar: str | None = None,
                 choice: Sequence[str] | None = None, constraint: Constraint | None = None,
                 images: Sequence | None = None, **sampling):
        """Generate from one prompt or a list of prompts.

        ``prompt``: text (encoded without BOS), token ids (a list or 1-D integer array), chat
        messages (a list of {'role', 'content'} dicts, rendered with the chat template and a
        generation prompt), or a list of such prompts (run one after another; prompts that share a
        prefix prefill it once). ``params``: a SamplingParams (default greedy); keyword arguments
        (``max_tokens=16``, ``temperature=0.7``, ``stop=[...]``, ...) override its fields.
        ``session``: the Session to run on (default: the model's default session); it resumes from
        the longest prefix of the prompt it already holds. ``tools``, ``enable_thinking``,
        ``preserve_thinking``, ``chat_template_kwargs``: passed to the chat template for messages;
        ``tools`` also types the parsed ``Generation.tool_calls``. Images (docs/vision.md): chat messages carry them as content parts, ``{'type': 'image', 'image': path |
        bytes | PIL image | numpy array}`` or ``{'type': 'image_url', 'image_url': {'url': 'data:...'}}``;
        a text or token-id prompt takes ``images``, one per ``<|image_pad|>`` run. ``max_tokens`` left out (None):
        ``model.default_max_tokens``, capped by the context; given, prompt + max_tokens must fit the
        session's context (LilyError otherwise, as the server answers 400). ``progress``: a
        progress bar on stderr for a list of prompts (default: when stderr is a terminal).

        Structured output (at most one): ``json_schema`` (a dict, JSON text or pydantic model
        class), ``regex``, ``grammar`` (llguidance's Lark syntax), ``choice`` (a list of strings), or
        a prebuilt ``constraint`` (lily.constraints). The text then matches it; when the prompt
        opens a think block, the reasoning is free and the constraint applies after ``</think>``.
        Generation ends ('stop') as soon as the constraint is complete; a cut by max_tokens says
        'length'. A schema or grammar llguidance cannot use is a LilyError naming the problem.

        Returns a Generation; with ``stream=True`` a GenerationStream, an iterator of
        GenerationEvent (text delta, token id, logprobs, finish reason) whose ``result()`` is the
        Generation. For a list of prompts: a list of Generation, or with ``stream=True`` an iterator
        that yields each prompt's Generation as soon as it is done (all prompts are checked first).
        """
        params = sampling_params(params, sampling)
        wanted = constraints.from_arguments(json_schema, regex, grammar, choice, constraint)
        session = session if session is not None else self.session
        if not isinstance(session, Session) or session.model is not self:
            raise LilyError("session must be a Session of this model (model.new_session())")
        template = dict(chat_template_kwargs or {}, tools=tools, enable_thinking=enable_thinking,
                        preserve_thinking=preserve_thinking)
        if is_batch(prompt):
            if images is not None:
                raise LilyError("images= is for one prompt; in a list of conversations put images in the messages")
            prepared = [prepare(self, p, template) for p in prompt]
            for ids, *_ in prepared:
                check_prompt(ids, session)
            for ids, *_ in prepared:
                self._check_max_tokens(ids, params, session)
            results = self._generate_each(prepared, params, session, tools, progress, wanted)
            return results if stream else list(results)
        ids, boundary, thinking, pictures = prepare(self, prompt, template, images)
        # An integer array prompt (the server's) is already the engine's input: run copies it (~2 us)
        # instead of converting the id list back (~0.1 ms for 7,000 ids). With images, ids have grown.
        array = np.array(prompt, dtype=np.int32) if isinstance(prompt, np.ndarray) and not pictures else None
        out = self._start(session, ids, params, boundary, thinking, tools, wanted, pictures, array)
        return out if stream else out.result()

    def chat(self, messages: Sequence[Mapping], params: SamplingParams | None = None, **kwargs):
        """``generate`` for one conversation, or for a list of conversations (as vLLM's
        ``LLM.chat``): ``messages`` is a list of {'role', 'content'} dicts (system, user, assistant
        with optional 'reasoning_content' / 'tool_calls', tool). Append ``result.message`` and the
        next user message to continue; the session then prefills only what is new since the last
        message boundary. ``params`` defaults to the checkpoint's recommended sampling
        (``default_sampling()``, as ``lily chat`` and ``lily serve`` use); ``temperature=0`` is greedy."""
        if not (is_messages(messages) or (isinstance(messages, (list, tuple)) and messages
                                           and all(is_messages(c) for c in messages))):
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
                       progress: bool | None, constraint: Constraint | None = None) -> Iterator[Generation]:
        import sys

        from tqdm.auto import tqdm

        if progress is None:
            progress = len(prepared) > 1 and sys.stderr.isatty()
        with tqdm(total=len(prepared), desc="generate", unit="prompt", disable=not progress, file=sys.stderr) as bar:
            for i, (ids, boundary, thinking, images) in enumerate(prepared):
                if i + 1 < len(prepared):
                    # Snapshot where the next prompt diverges, so that it prefills only its own part
                    # (at most one token before this prompt's end: one is needed to sample from).
                    boundary = min(common_prefix_length(ids, prepared[i + 1][0]), len(ids) - 1) or boundary
                result = self._start(session, ids, params, boundary, thinking, tools, constraint, images).result()
                bar.update(1)
                yield result

    def _check_max_tokens(self, ids: list[int], params: SamplingParams, session: Session) -> None:
        """An explicit max_tokens must fit the context with the prompt (the server's rule: 400)."""
        n, room = len(ids), session.max_context
        if params.max_tokens is not None and n + params.max_tokens > room:
            raise LilyError(f"max_tokens={params.max_tokens} with a {n}-token prompt exceeds the session's "
                            f"max_context of {room} tokens; at most {room - n} tokens can be generated "
                            f"(leave max_tokens out to generate until the context is full)")

    def _start(self, session: Session, ids: list[int], params: SamplingParams, boundary: int | None,
               thinking: bool, tools=None, constraint: Constraint | None = None, images=(),
               array: np.ndarray | None = None) -> GenerationStream:
        check_prompt(ids, session)
        self._check_max_tokens(ids, params, session)
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=self.default_max_tokens)
        tokenizer = self.tokenizer if self.has_tokenizer else None
        if params.stop and tokenizer is None:
            raise LilyError("stop strings need the checkpoint's tokenizer (tokenizer.json); use stop_token_ids")
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.stop_token_ids())
        guide = None
        if constraint is not None:
            if tokenizer is None:
                raise LilyError("structured output needs the checkpoint's tokenizer (tokenizer.json)")
            guide = constraints.Guide(self, constraint, thinking)
        result = Generation(text="", thinking=thinking, tools=list(tools) if tools else None)
        return GenerationStream(run(session, ids, params, tokenizer, stop_ids, result, boundary, guide, images, array),
                                result)

    def __repr__(self) -> str:
        c = self.config
        if self.closed:
            return f"Model('{self.path}', device={self.device}, closed)"
        return (f"Model('{self.path}', device={self.device}, layout={self.layout}, layers={c.num_hidden_layers}, "
                f"hidden={c.hidden_size}, experts={c.num_experts}x top-{c.num_experts_per_tok}, "
                f"weights={self._engine.weight_bytes / 2**20:.1f} MiB)")
