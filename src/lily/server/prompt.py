"""Request prompts as token ids, and the message boundaries where the engine keeps snapshots.

A chat prompt is the conversation rendered by the checkpoint's template with a generation prompt.
The boundaries are prompt lengths that a later request of the same conversation will share, so a
snapshot there can be resumed from:

- the end of the rendered messages (before ``<|im_start|>assistant``): the next turn appends the
  answer and a new message after it. The generated tokens themselves are not reusable, because
  Qwen3.6's template re-renders an earlier answer without its reasoning.
- the end of the last user query (the last user message that is not only tool results), when
  messages follow it (an agent's tool calls and results): the template keeps the reasoning of the
  assistant messages after the last query, and drops it once a new query comes, so only the
  part up to the query survives a new user message.

Each candidate is kept only where its rendering is a token prefix of the prompt.

Renderings are encoded by a ``SegmentEncoder``: in pieces cut at the template's special tokens, with
the ids of pieces seen before cached, so a follow-up turn encodes only its new messages.
"""
from __future__ import annotations

import re
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Sequence

import numpy as np

from ..errors import LilyError
from ..tokenizer import Tokenizer


PROBE_CHARS_PER_TOKEN = 4  # a long text's first (4 x limit) characters are encoded first, as a probe


class PromptTooLong(LilyError):
    """The prompt cannot fit the context; ``tokens`` is a lower bound of its length (None: only its
    characters were counted)."""

    def __init__(self, message: str, tokens: int | None = None):
        super().__init__(message)
        self.tokens = tokens


def encode_bounded(tokenizer: Tokenizer, text: str, limit: int | None) -> list[int]:
    """``tokenizer.encode(text)``, but a text longer than ``PROBE_CHARS_PER_TOKEN * limit`` characters
    is first encoded in growing prefixes (x4 limit, x8, ...): once one makes more than ``limit``
    tokens, PromptTooLong is raised without encoding the rest (cost bounded by the limit, not by the
    text's length)."""
    if limit is not None:
        probe = PROBE_CHARS_PER_TOKEN * limit
        while probe < len(text):  # doubling probes: at most ~4x the characters that make `limit` tokens
            head = len(tokenizer.encode(text[:probe]))
            if head > limit + 1:  # a cut may merge at most its last token with the next characters
                raise PromptTooLong(f"the prompt has more than {head - 1} tokens", head - 1)
            probe *= 2
    return tokenizer.encode(text)


DEFAULT_SEGMENT_CACHE_MIB = 64
ENTRY_OVERHEAD = 320  # bytes counted per cached piece besides its text and ids (dict, tuple and array headers)
ID_BYTES = 40  # per cached id: a tuple slot, an int object and an int32 in the piece's array
MAX_SUFFIXES = 64  # template-argument sets whose generation-prompt suffix SegmentEncoder.head keeps


def _overlap(a: str, b: str) -> bool:
    """Whether a proper suffix of ``a`` is a proper prefix of ``b`` (an occurrence of one could start
    inside the other)."""
    return any(a.endswith(b[:k]) for k in range(1, min(len(a), len(b))))


def separators(tokenizer: Tokenizer) -> dict[str, int]:
    """The special added tokens at which a text can be cut and encoded piece by piece with the
    one-shot result: the tokenizer splits its input at added tokens before it normalizes or merges
    anything, so no token crosses one. Kept are special tokens that match as written (not
    normalized) and that no added token contains or overlaps, so that every occurrence in a text
    is one the tokenizer splits at; none when an added token strips whitespace or matches single
    words (the cut would then move)."""
    added = tokenizer.backend.get_added_tokens_decoder()
    if any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
        return {}
    contents = {t.content for t in added.values()}
    out = {}
    for i, t in added.items():
        s = t.content
        if not t.special or t.normalized or not s:
            continue
        if _overlap(s, s) or any(o != s and (s in o or _overlap(o, s) or _overlap(s, o)) for o in contents):
            continue
        out[s] = i
    return out


class SegmentEncoder:
    """``tokenizer.encode(text)`` for chat renderings, piece by piece, with the pieces' ids cached.

    The text is cut at the special tokens ``separators`` finds (Qwen's ``<|im_start|>`` and
    ``<|im_end|>`` around every message); each piece encodes on its own exactly as inside the whole
    text. Pieces are looked up by their exact text in an LRU bounded by ``budget_bytes`` (text, ids
    and a fixed overhead per entry; 0 keeps nothing); the missing ones are encoded in one batch
    (without holding the GIL). Each piece's ids are kept as a tuple and as an int32 array, so that
    ``encode_array`` joins the prompt's array from a few pieces instead of converting a long id list
    (~0.1 ms for 7,000 ids). Thread-safe. Without separators it is the one-shot encoding."""

    def __init__(self, tokenizer: Tokenizer, budget_bytes: int = DEFAULT_SEGMENT_CACHE_MIB << 20):
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.tokenizer, self.budget_bytes = tokenizer, int(budget_bytes)
        self._ids = separators(tokenizer)
        names = sorted(self._ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")").split if names else None
        self._arrays = {s: np.array([i], dtype=np.int32) for s, i in self._ids.items()}
        self._entries: OrderedDict[str, tuple[tuple[int, ...], np.ndarray]] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self.nbytes = 0
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        # The text a generation prompt appends to a rendering, per template arguments (head()).
        self._suffixes: dict[str, str] = {}

    def head(self, text: str, key: str, render) -> str:
        """The rendering without its generation prompt of the messages whose rendering with one is
        ``text``: ``text`` less the suffix that the generation prompt appended the last time for these
        template arguments (``key``), when ``text`` ends with it; else ``render()``, and its suffix is
        kept. A head found this way only places a boundary: the prefix cache reuses a snapshot only
        for the exact tokens it holds, so a wrong one would cost reuse, never correctness."""
        suffix = self._suffixes.get(key)
        if suffix and text.endswith(suffix):
            return text[:-len(suffix)]
        head = render()
        if head and text.startswith(head) and len(head) < len(text):
            with self._lock:
                if len(self._suffixes) >= MAX_SUFFIXES:
                    self._suffixes.clear()
                self._suffixes[key] = text[len(head):]
        return head

    def __len__(self) -> int:
        return len(self._entries)

    def starts_at_cut(self, text: str) -> bool:
        """Whether ``text`` begins with a separator, so that for any ``head``, ``encode(head + text)``
        is ``encode(head) + encode(text)`` (the tokenizer splits at every occurrence of a separator, so
        no token crosses the seam)."""
        return self._split is not None and self._split(text, 1)[0] == "" and len(text) > 0

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self.tokenizer.encode(text)
        return self.encode_array(text)[0]

    def encode_array(self, text: str) -> tuple[list[int], np.ndarray]:
        """``encode(text)``, and the same ids as an int32 array."""
        if self._split is None:
            ids = self.tokenizer.encode(text)
            return ids, np.asarray(ids, dtype=np.int32)
        parts = self._split(text)  # [piece, separator, piece, ..., piece]
        found = self._lookup(parts[::2])
        ids: list[int] = []
        arrays = []
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self._ids[part])
                arrays.append(self._arrays[part])
            elif part:
                piece_ids, piece_array = found[part]
                ids.extend(piece_ids)
                arrays.append(piece_array)
        return ids, (np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32))

    def _lookup(self, pieces: list[str]) -> dict[str, tuple[tuple[int, ...], np.ndarray]]:
        found, missing = {}, []
        with self._lock:
            for piece in pieces:
                if piece and piece not in found:
                    entry = self._entries.get(piece)
                    if entry is None:
                        missing.append(piece)
                        found[piece] = None
                    else:
                        self._entries.move_to_end(piece)
                        found[piece] = entry
            self.hits += len(found) - len(missing)
            self.misses += len(missing)
        if missing:
            encoded = self.tokenizer.backend.encode_batch(missing, add_special_tokens=False)
            for piece, e in zip(missing, encoded):
                ids = tuple(e.ids)
                found[piece] = (ids, np.array(ids, dtype=np.int32))
            self._store(missing, found)
        return found

    def _store(self, pieces: list[str], found: dict[str, tuple[tuple[int, ...], np.ndarray]]) -> None:
        with self._lock:
            for piece in pieces:
                entry = found[piece]
                size = sys.getsizeof(piece) + ID_BYTES * len(entry[0]) + ENTRY_OVERHEAD
                if size > self.budget_bytes or piece in self._entries:
                    continue
                self._entries[piece], self._sizes[piece] = entry, size
                self.nbytes += size
                while self.nbytes > self.budget_bytes:
                    old, _ = self._entries.popitem(last=False)
                    self.nbytes -= self._sizes.pop(old)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._sizes.clear()
            self.nbytes = 0

    def stats(self) -> dict:
        return {"entries": len(self._entries), "bytes": self.nbytes, "budget_bytes": self.budget_bytes,
                "hits": self.hits, "misses": self.misses}


@dataclass
class Prompt:
    """Token ids to run, the boundaries (prompt lengths) to keep snapshots at, and whether the prompt
    leaves a think block open (the output then starts with reasoning)."""
    ids: list[int]
    boundaries: tuple[int, ...] = ()
    thinking: bool = False
    images: tuple = ()  # lily.images.PreparedImage, one per run of image tokens in ids

    @cached_property
    def array(self) -> np.ndarray:
        """``ids`` as int32, converted once: the worker's prefix lookup and the engine call share it
        (a 7,000-id list costs ~0.1 ms a conversion on the host; ``chat_prompt`` sets it from the
        encoder's piece arrays instead)."""
        return np.asarray(self.ids, dtype=np.int32)


def opens_think(text: str) -> bool:
    return text.rfind("<think>") > text.rfind("</think>")


def last_query_index(messages: Sequence[Mapping]) -> int | None:
    """The index of the last user message that is not only tool results (as Qwen's template finds it)."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.get("role") != "user":
            continue
        content = m.get("content")
        text = (content if isinstance(content, str) else "").strip()
        if not (text.startswith("<tool_response>") and text.endswith("</tool_response>")):
            return i
    return None


def chat_prompt(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None,
                template_kwargs: Mapping, limit: int | None = None, encoder: SegmentEncoder | None = None) -> Prompt:
    """Render ``messages`` (template-ready dicts) with a generation prompt; LilyError when the
    template refuses them, PromptTooLong when the prompt surely has more than ``limit`` tokens.
    ``encoder``: encodes the renderings (reusing the ids of pieces it has seen); None: one shot."""
    kw = dict(template_kwargs)
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **kw)
    pieces = encoder is not None and not (limit is not None and len(text) > PROBE_CHARS_PER_TOKEN * limit)
    if not pieces:
        encode = tokenizer.encode
        ids = encode_bounded(tokenizer, text, limit)  # a long text is probed first
    else:
        encode = encoder.encode
        ids, array = encoder.encode_array(text)
    if limit is not None and len(ids) > limit:
        return Prompt(ids, (), opens_think(text))  # fit_context refuses it: no boundaries needed
    cuts = [len(messages)]
    query = last_query_index(messages)
    if query is not None and query + 1 < len(messages):
        cuts.append(query + 1)
    boundaries = set()
    suffix_key = repr((bool(tools), sorted(kw.items())))
    for cut in cuts:
        def render(cut=cut):
            return tokenizer.apply_chat_template(messages[:cut], tools=tools, add_generation_prompt=False, **kw)
        try:
            # the whole conversation's head is the text less its generation prompt (one render fewer)
            head = encoder.head(text, suffix_key, render) if encoder is not None and cut == len(messages) \
                else render()
        except LilyError:
            continue
        if not head or not text.startswith(head):
            continue
        if pieces and encoder.starts_at_cut(text[len(head):]):
            # the head's ids are the text's less the tail's (the generation prompt, a few cached pieces):
            # no second encoding of the whole conversation, no comparison of the two
            n = len(ids) - len(encode(text[len(head):]))
            if 0 < n < len(ids):
                boundaries.add(n)
            continue
        head_ids = encode(head)
        if 0 < len(head_ids) < len(ids) and ids[:len(head_ids)] == head_ids:
            boundaries.add(len(head_ids))
    prompt = Prompt(ids, tuple(sorted(boundaries)), opens_think(text))
    if pieces:
        prompt.__dict__["array"] = array  # Prompt.array's cached value, joined from the pieces' arrays
    return prompt


def text_prompt(tokenizer: Tokenizer, prompt: str | list[int], vocab_size: int, limit: int | None = None) -> Prompt:
    """A completion prompt: text (encoded without BOS) or token ids (checked against the vocabulary)."""
    if isinstance(prompt, str):
        return Prompt(encode_bounded(tokenizer, prompt, limit), (), False)
    for i, t in enumerate(prompt):
        if not 0 <= t < vocab_size:
            raise LilyError(f"token id {t} at index {i} is outside the vocabulary [0, {vocab_size})")
    return Prompt(list(prompt), (), False)
