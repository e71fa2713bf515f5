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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

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


@dataclass
class Prompt:
    """Token ids to run, the boundaries (prompt lengths) to keep snapshots at, and whether the prompt
    leaves a think block open (the output then starts with reasoning)."""
    ids: list[int]
    boundaries: tuple[int, ...] = ()
    thinking: bool = False


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
                template_kwargs: Mapping, limit: int | None = None) -> Prompt:
    """Render ``messages`` (template-ready dicts) with a generation prompt; LilyError when the
    template refuses them, PromptTooLong when the prompt surely has more than ``limit`` tokens."""
    kw = dict(template_kwargs)
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **kw)
    ids = encode_bounded(tokenizer, text, limit)
    if limit is not None and len(ids) > limit:
        return Prompt(ids, (), opens_think(text))  # fit_context refuses it: no boundaries needed
    cuts = [len(messages)]
    query = last_query_index(messages)
    if query is not None and query + 1 < len(messages):
        cuts.append(query + 1)
    boundaries = set()
    for cut in cuts:
        try:
            head = tokenizer.apply_chat_template(messages[:cut], tools=tools, add_generation_prompt=False, **kw)
        except LilyError:
            continue
        if not head or not text.startswith(head):
            continue
        head_ids = tokenizer.encode(head)
        if 0 < len(head_ids) < len(ids) and ids[:len(head_ids)] == head_ids:
            boundaries.add(len(head_ids))
    return Prompt(ids, tuple(sorted(boundaries)), opens_think(text))


def text_prompt(tokenizer: Tokenizer, prompt: str | list[int], vocab_size: int, limit: int | None = None) -> Prompt:
    """A completion prompt: text (encoded without BOS) or token ids (checked against the vocabulary)."""
    if isinstance(prompt, str):
        return Prompt(encode_bounded(tokenizer, prompt, limit), (), False)
    for i, t in enumerate(prompt):
        if not 0 <= t < vocab_size:
            raise LilyError(f"token id {t} at index {i} is outside the vocabulary [0, {vocab_size})")
    return Prompt(list(prompt), (), False)
