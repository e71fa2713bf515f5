"""Splitting generated text into reasoning and content at ``</think>``, also while streaming.

When the prompt leaves a think block open (Qwen3.6's generation prompt with thinking on ends in
``<think>\\n``), the text up to ``</think>`` is the reasoning and the rest is the content, exactly as
``lily.Generation.reasoning`` / ``.content`` split it: newlines around the reasoning are dropped,
and so are newlines at the start of the content. The streaming form never shows part of the tag,
and never shows newlines that might turn out to be the ones before ``</think>``.
"""
from __future__ import annotations

THINK_END = "</think>"


class ReasoningSplitter:
    """``feed(delta) -> (reasoning, content)`` with the text safe to show now; ``flush()`` at the end.

    ``thinking``: whether the prompt opened a think block (otherwise everything is content). The
    concatenated pieces equal ``Generation(text, thinking=thinking).reasoning`` / ``.content``.
    """

    __slots__ = ("_in_think", "_held", "_reasoning_started", "_content_started")

    def __init__(self, thinking: bool):
        self._in_think = thinking
        self._held = ""
        self._reasoning_started = False  # a non-newline character of reasoning has been shown
        self._content_started = not thinking  # newlines at the start of the content are dropped

    def feed(self, delta: str) -> tuple[str, str]:
        if not self._in_think:
            return "", self._content(delta)
        text = self._held + delta
        end = text.find(THINK_END)
        if end >= 0:
            self._held, self._in_think = "", False
            return self._reasoning(text[:end].rstrip("\n")), self._content(text[end + len(THINK_END):])
        keep = partial_suffix(text, THINK_END)
        # Newlines just before a possible tag (or at the end) may be the ones dropped before </think>.
        body = text[:len(text) - keep]
        stripped = body.rstrip("\n")
        self._held = text[len(stripped):]
        return self._reasoning(stripped), ""

    def flush(self) -> tuple[str, str]:
        if not self._in_think:
            return "", ""
        text, self._held = self._held, ""
        return self._reasoning(text.rstrip("\n")), ""

    def _reasoning(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip("\n")
            self._reasoning_started = bool(text)
        return text

    def _content(self, text: str) -> str:
        if not self._content_started:
            text = text.lstrip("\n")
            self._content_started = bool(text)
        return text


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
