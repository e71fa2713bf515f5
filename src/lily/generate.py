"""The generation loop: prompt ids in, events and a result out.

One request on one session: bring the session to the longest reusable prefix of the prompt (its
current tokens, or a snapshot taken at an earlier message boundary), prefill the rest and sample the
first token in the core, then per token: check the stop ids, detokenize, match stop strings, check
max_tokens and the context, and feed the token back while the core samples the next one. The
sampled token that ends generation is never fed, so the session then holds the prompt and every
returned token but the last.

Decoding is pipelined (docs/generation.md, "Pipelined decoding"): the step that feeds a token is
launched before the host looks at the token, so the device runs it while the host checks, detokenizes
and yields; when the token ends generation (or the stream is closed) that step is taken back
(decode_discard) and the session ends exactly where the one-step-at-a-time loop would leave it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from .detokenizer import StreamingDetokenizer
from .errors import LilyError
from .sampling import SamplingParams, StopMatcher

if TYPE_CHECKING:
    from .constraints import Guide
    from .session import Session
    from .tokenizer import Tokenizer

THINK_END = "</think>"


@dataclass(slots=True)
class TokenLogprob:
    """log p of a generated token under the raw model distribution, and the top alternatives
    [(token id, log p)], most likely first. ``token`` is the token's text and ``top_tokens`` the
    alternatives' texts (decoded on their own: a token holding part of a UTF-8 character shows
    U+FFFD), "" without a tokenizer."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    token: str = ""
    top_tokens: list[str] = field(default_factory=list)


@dataclass(slots=True)
class GenerationEvent:
    """One step of a stream: ``text`` is the new text (may be "" while a character or a possible
    stop string is incomplete), ``token_id`` the generated id (None on a final event that only
    closes the stream after a stop token), ``finish_reason`` is set on the last event only:
    'stop' (a stop token or string) or 'length' (max_tokens or the end of the context).

    ``reasoning`` / ``content``: the same text split at ``</think>`` (for prompts that open a think
    block; otherwise everything is content); they concatenate to ``Generation.reasoning`` /
    ``.content``, and a piece of the tag is never shown. ``channel`` is 'reasoning' or 'content'
    (where the stream is after this event). ``tokens``: tokens generated so far;
    ``tokens_per_second``: the decode speed so far (0 until the second token)."""
    text: str
    token_id: int | None
    logprobs: TokenLogprob | None = None
    finish_reason: str | None = None
    reasoning: str = ""
    content: str = ""
    channel: str = "content"
    tokens: int = 0
    tokens_per_second: float = 0.0


@dataclass
class Usage:
    """Token counts and timings of one request. ``cached_tokens``: prompt tokens the session
    already held (not prefilled again)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first one per second of decoding."""
        n = self.completion_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0

    def __repr__(self) -> str:
        return (f"Usage(prompt={self.prompt_tokens}, cached={self.cached_tokens}, completion="
                f"{self.completion_tokens}, prefill={self.prefill_seconds * 1e3:.1f} ms, "
                f"decode={self.decode_tokens_per_second:.1f} tok/s)")


@dataclass
class Generation:
    """The result of one request.

    ``text``: the generated text (stop strings and stop tokens excluded); ``token_ids``: the
    generated ids (a stop token excluded, the ids that spelled a stop string included);
    ``finish_reason``: 'stop', 'length', or 'cancelled' (the stream was closed early);
    ``stop_reason``: the stop token id or stop string that ended it (None otherwise);
    ``logprobs``: one TokenLogprob per token when requested.
    For chat prompts whose generation prompt opens a think block, ``reasoning`` and ``content``
    split the text at ``</think>``, and ``message`` is the assistant message to append to the
    conversation.
    """
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    stop_reason: int | str | None = None
    usage: Usage = field(default_factory=Usage)
    logprobs: list[TokenLogprob] | None = None
    thinking: bool = False
    tools: list | None = field(default=None, repr=False)  # the request's tool definitions (type the arguments)

    @property
    def tool_calls(self) -> list[dict]:
        """The tool calls in the answer, parsed as the server parses them (Qwen3.6's XML form and
        Qwen3's JSON form): OpenAI-style ``{'id', 'type': 'function', 'function': {'name',
        'arguments'}}`` with ``arguments`` JSON text typed by the tool's parameter schema. Empty when
        the request had no ``tools``."""
        return self._parsed()[1]

    def _parsed(self) -> tuple[str, list[dict]]:
        if not self.tools:
            return self.content, []
        cache = self.__dict__.get("_tool_cache")
        if cache is None or cache[0] != self.text:
            from .toolcalls import parse_tool_calls

            content, calls = parse_tool_calls(self.content, self.tools)
            cache = (self.text, (content, [c.to_openai() for c in calls]))
            self.__dict__["_tool_cache"] = cache
        return cache[1]

    @property
    def reasoning(self) -> str:
        """The text inside the think block ("" when the prompt did not open one)."""
        if not self.thinking:
            return ""
        return self.text.split(THINK_END, 1)[0].strip("\n")

    @property
    def content(self) -> str:
        """The answer after the think block (the whole text when the prompt did not open one)."""
        if not self.thinking:
            return self.text
        parts = self.text.split(THINK_END, 1)
        return parts[1].lstrip("\n") if len(parts) == 2 else ""

    @property
    def message(self) -> dict:
        """``{'role': 'assistant', 'content': ..., 'reasoning_content': ...}`` for the history."""
        content, calls = self._parsed()
        msg = {"role": "assistant", "content": content}
        if self.thinking:
            msg["reasoning_content"] = self.reasoning
        if calls:
            msg["tool_calls"] = calls
        return msg

    def __repr__(self) -> str:
        text = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        return (f"Generation(text={text!r}, tokens={len(self.token_ids)}, finish_reason={self.finish_reason!r}, "
                f"{self.usage!r})")


class GenerationStream:
    """An iterator of GenerationEvent for one request. The prompt is processed on the first
    ``next``; ``result()`` finishes the request (consuming what is left) and returns the
    Generation. ``close()`` (or leaving a ``with`` block) stops early and frees the session."""

    def __init__(self, events: Iterator[GenerationEvent], result: Generation):
        self._events = events
        self._result = result
        self._done = False
        self._split = None  # a ReasoningSplitter, made on the first event
        self._t0 = 0.0

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self) -> GenerationEvent:
        try:
            event = next(self._events)
        except StopIteration:
            self._done = True
            raise
        split = self._split
        if split is None:
            from .reasoning import ReasoningSplitter

            split = self._split = ReasoningSplitter(self._result.thinking)
            self._t0 = time.perf_counter()
        reasoning, content = split.feed(event.text)
        if event.finish_reason is not None:
            r2, c2 = split.flush()
            reasoning, content = reasoning + r2, content + c2
        event.reasoning, event.content = reasoning, content
        event.channel = "reasoning" if split._in_think else "content"
        n = event.tokens = len(self._result.token_ids)
        dt = time.perf_counter() - self._t0
        event.tokens_per_second = (n - 1) / dt if n > 1 and dt > 0 else 0.0
        return event

    @property
    def thinking(self) -> bool:
        """Whether the prompt leaves a think block open (the text starts with reasoning)."""
        return self._result.thinking

    def result(self) -> Generation:
        for _ in self:
            pass
        return self._result

    def close(self) -> None:
        self._events.close()
        self._done = True

    def __enter__(self) -> "GenerationStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        reason = self._result.finish_reason
        state = "running" if not self._done else "cancelled" if reason == "cancelled" else f"done, {reason}"
        return f"GenerationStream({state}, tokens so far={len(self._result.token_ids)})"


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading ids a and b share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


def resume(session: "Session", ids: list[int], spans: Sequence = ()) -> int:
    """Bring ``session`` to the longest prefix of ``ids`` it can reach without recomputation, and
    return its length (always < len(ids), so at least one token is left to prefill): the session's
    own tokens when they are a prefix of ids, else the longest saved prefix snapshot that is, else
    an empty session. ``spans``: the prompt's images (lily.multimodal); a prefix is reused only when
    it holds the same images at the same places (ids alone do not say which images they stood for)."""
    from .multimodal import same_images

    held = session._tokens
    # a list comparison at C speed (two numpy conversions of a 7,000-id prompt cost ~0.3 ms)
    if len(held) < len(ids) and list(ids[:len(held)]) == held and same_images(session.image_spans, spans, len(held)):
        return len(held)
    best = None
    for snap in session.prefix_snapshots:
        n = len(snap.tokens)
        if n < len(ids) and (best is None or n > len(best.tokens)) and snap.tokens == tuple(ids[:n]) \
                and same_images(snap.images, spans, n):
            best = snap
    if best is None:
        session._reset()
        return 0
    session._restore(best)
    session.remember_prefix(best)
    return len(best.tokens)


def run(session: "Session", ids: list[int], params: SamplingParams, tokenizer: "Tokenizer | None",
        stop_ids: frozenset[int], result: Generation, boundary: int | None = None,
        guide: "Guide | None" = None, images: Sequence = (),
        array: np.ndarray | None = None) -> Iterator[GenerationEvent]:
    """Generate on ``session`` after prompt ``ids`` [T] and yield one event per token; fills
    ``result`` as it goes. ``boundary``: a prompt length (e.g. the end of the last complete message)
    at which to keep a snapshot, so that a later prompt sharing that prefix resumes from it.
    ``guide``: a constraint's matcher (lily.constraints); its mask is applied before every sample.
    ``images``: lily.images.PreparedImage, one per run of image tokens in ``ids``, in order.
    ``array``: ``ids`` as an int32 array (the caller's copy, used as is), when there is one."""
    from .multimodal import image_spans, safe_cut, split_at

    model = session.model
    core, lock = session._core, model._lock
    spans = image_spans(ids, images, model.config.image_token_id) if images else ()
    session._acquire()
    try:
        t0 = time.perf_counter()
        cached = start = resume(session, ids, spans)
        if array is None:
            array = np.asarray(ids, dtype=np.int32)  # once: the parts below are views of it
        if boundary is not None:
            boundary = safe_cut(spans, boundary)
        if boundary is not None and cached < boundary < len(ids):
            part = array[cached:boundary]
            extra, new = session._core_images(part, split_at(spans, images, cached, boundary))
            with lock:
                core.prefill(part, False, *extra)
            session._advance(ids[cached:boundary], new)
            session.remember_prefix(session._snapshot())
            start = boundary
        params = params.with_seed()
        num_logprobs = params.num_logprobs
        rest = array[start:]
        extra, new = session._core_images(rest, split_at(spans, images, start, len(ids)))
        with lock:
            core.set_sampler(temperature=float(params.temperature), top_k=int(params.top_k),
                             top_p=float(params.top_p), min_p=float(params.min_p),
                             presence_penalty=float(params.presence_penalty),
                             frequency_penalty=float(params.frequency_penalty),
                             repetition_penalty=float(params.repetition_penalty), seed=int(params.seed),
                             num_logprobs=num_logprobs, prompt_ids=array)
            token = core.prefill_sample(rest, None if guide is None else guide.mask(), *extra)
        session._advance(ids[start:], new)
        usage = result.usage
        usage.prompt_tokens, usage.cached_tokens = len(ids), cached
        t1 = time.perf_counter()
        usage.prefill_seconds = t1 - t0
        yield from _decode(session, token, params, tokenizer, stop_ids, result, guide)
        usage.decode_seconds = time.perf_counter() - t1
    finally:
        session._release()


def _decode(session: "Session", token: int, params: SamplingParams, tokenizer: "Tokenizer | None",
            stop_ids: frozenset[int], result: Generation, guide: "Guide | None") -> Iterator[GenerationEvent]:
    # The per-token path: keep it to a few dict/list operations besides the core calls. The device runs
    # one step ahead: when the loop looks at `token`, the step that feeds it (decode_launch) is already
    # queued, and it is kept (sample_launch samples its logits) only once the token has passed every
    # check and been yielded; a token that ends generation leaves it to the `finally`, which takes it
    # back. A step is launched ahead only when the token could be fed at all (max_tokens, context).
    core, lock, tokens = session._core, session.model._lock, session._tokens
    detok = StreamingDetokenizer(tokenizer, params.skip_special_tokens) if tokenizer is not None else None
    stops = StopMatcher(params.stop) if params.stop else None
    out_ids, parts, usage = result.token_ids, [], result.usage
    num_logprobs = params.num_logprobs
    logprobs = result.logprobs = [] if num_logprobs >= 0 else None
    max_tokens = params.max_tokens if params.max_tokens is not None else float("inf")
    room = session.max_context
    result.finish_reason = "cancelled"  # until the loop decides; stays so when the stream is closed early
    try:
        with lock:
            if len(out_ids) + 1 < max_tokens and len(tokens) < room:
                core.decode_launch(-1)
        while True:
            if token in stop_ids:
                text, hit = _finish(detok, stops)
                parts.append(text)
                result.finish_reason, result.stop_reason = "stop", hit if hit is not None else token
                yield GenerationEvent(text, None, None, "stop")
                return
            out_ids.append(token)
            usage.completion_tokens += 1
            if guide is not None:
                guide.advance(token)
            lp = None
            if logprobs is not None:
                lp = _last_logprob(core, num_logprobs, tokenizer)
                logprobs.append(lp)
            text = detok.add(token) if detok is not None else ""
            if stops is not None:
                text, hit = stops.feed(text)
                if hit is not None:
                    parts.append(text)
                    result.finish_reason, result.stop_reason = "stop", hit
                    yield GenerationEvent(text, token, lp, "stop")
                    return
            # The sampled token can be fed only while the context has room for it. A complete
            # constraint ends generation as a stop token would ('stop'), also at max_tokens.
            done = guide is not None and guide.done
            if done or len(out_ids) >= max_tokens or len(tokens) >= room:
                tail, hit = _finish(detok, stops)
                text += tail
                parts.append(text)
                stopped = hit is not None or done
                result.finish_reason, result.stop_reason = ("stop", hit) if stopped else ("length", None)
                yield GenerationEvent(text, token, lp, result.finish_reason)
                return
            parts.append(text)
            yield GenerationEvent(text, token, lp, None)
            mask = guide.mask() if guide is not None else None  # while the step runs on the device
            with lock:
                core.sample_launch(mask)  # the step that fed `token` is kept
                tokens.append(token)
                if len(out_ids) + 1 < max_tokens and len(tokens) < room:
                    core.decode_launch(-1)  # the next step, fed the id the sampler is about to write
                token = core.sampled()
    finally:
        if core.launched:  # a step fed a token that ended generation, or the stream was closed
            with lock:
                core.decode_discard()
        result.text = "".join(parts)


def _finish(detok: StreamingDetokenizer | None, stops: StopMatcher | None) -> tuple[str, str | None]:
    """End of stream: flush the detokenizer through the stop matcher, then release held text."""
    text = detok.flush() if detok is not None else ""
    if stops is None:
        return text, None
    text, hit = stops.feed(text)
    return (text, hit) if hit is not None else (text + stops.flush(), None)


def _last_logprob(core, n: int, tokenizer: "Tokenizer | None" = None) -> TokenLogprob:
    ids, values = core.last_logprobs()
    ids, values = ids[:n + 1].tolist(), values[:n + 1].tolist()
    # Under a constraint the masked-out ids have log p = -inf: they are no alternatives.
    lp = TokenLogprob(ids[0], values[0], [(i, v) for i, v in zip(ids[1:], values[1:]) if v != -math.inf])
    if tokenizer is not None:
        text = tokenizer.token_bytes
        lp.token = text(ids[0]).decode("utf-8", errors="replace")
        lp.top_tokens = [text(i).decode("utf-8", errors="replace") for i in ids[1:]]
    return lp


def check_prompt(ids: list[int], session: "Session") -> None:
    """Raise LilyError when a prompt cannot run on ``session`` at all."""
    if not ids:
        raise LilyError("the prompt is empty (no tokens)")
    if len(ids) >= session.max_context:
        raise LilyError(f"the prompt has {len(ids)} tokens; the session's max_context is {session.max_context} "
                        f"and at least one token must be left to generate")
