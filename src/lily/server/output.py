"""Generation events -> OpenAI response objects: messages and deltas, logprobs, usage, finish reasons.

Streaming and non-streaming responses are built by the same code: ``ChatOutput.feed`` turns each
token's text through the reasoning splitter and (when the request has tools) the tool-call parser
into a delta; the non-streaming message is the sum of the deltas.
"""
from __future__ import annotations

from ..generate import Generation, GenerationEvent, TokenLogprob
from ..reasoning import ReasoningSplitter
from ..tokenizer import Tokenizer
from ..toolcalls import ToolCallParser, ToolDelta


class ChatOutput:
    """One chat request's output. ``feed(event)`` / ``finish()`` return a delta dict (possibly empty)
    with ``reasoning_content``, ``content`` and ``tool_calls``; ``message()`` is the whole answer."""

    def __init__(self, thinking: bool, tools: list[dict] | None):
        self._split = ReasoningSplitter(thinking)
        self._tools = ToolCallParser(tools) if tools is not None else None
        self.thinking = thinking
        self._reasoning: list[str] = []
        self._content: list[str] = []

    def feed(self, event: GenerationEvent) -> dict:
        return self._delta(*self._split.feed(event.text), final=False)

    def finish(self) -> dict:
        return self._delta(*self._split.flush(), final=True)

    def _delta(self, reasoning: str, content: str, final: bool) -> dict:
        calls: list[ToolDelta] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content)
            if final:
                rest, more = self._tools.flush()
                content, calls = content + rest, calls + more
        delta: dict = {}
        if reasoning:
            self._reasoning.append(reasoning)
            delta["reasoning_content"] = reasoning
        if content:
            self._content.append(content)
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [_tool_delta(c) for c in calls]
        return delta

    @property
    def tool_calls(self) -> list[dict]:
        return [c.to_openai() for c in self._tools.calls] if self._tools is not None else []

    def message(self) -> dict:
        calls = self.tool_calls
        content = "".join(self._content)
        msg = {"role": "assistant", "content": content if content or not calls else None,
               "reasoning_content": "".join(self._reasoning) if self.thinking else None}
        if calls:
            msg["tool_calls"] = calls
        return msg

    def finish_reason(self, result: Generation) -> str:
        if self.tool_calls and result.finish_reason == "stop":
            return "tool_calls"
        return result.finish_reason


def _tool_delta(d: ToolDelta) -> dict:
    out: dict = {"index": d.index}
    if d.id is not None:
        out.update(id=d.id, type="function")
    fn: dict = {"arguments": d.arguments}
    if d.name is not None:
        fn = {"name": d.name, **fn}
    out["function"] = fn
    return out


def usage(result: Generation) -> dict:
    u = result.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


# --- logprobs --------------------------------------------------------------------------------------

def _token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    b = tokenizer.token_bytes(token_id)
    return b.decode("utf-8", errors="replace"), list(b)


MIN_LOGPROB = -9999.0  # what a logprob of -inf (or NaN) is reported as: JSON has no infinities


def finite_logprob(value: float) -> float:
    """``value`` as JSON can carry it: -inf and NaN (logits the model made non-finite) -> MIN_LOGPROB,
    +inf -> 0 (a log-probability is at most 0)."""
    v = float(value)
    if v != v or v == float("-inf"):
        return MIN_LOGPROB
    return min(v, 0.0)


def chat_logprob(tokenizer: Tokenizer, lp: TokenLogprob) -> dict:
    """One token's entry of ``choices[0].logprobs.content``."""
    text, raw = _token_text(tokenizer, lp.token_id)
    top = []
    for tid, value in lp.top:
        t, r = _token_text(tokenizer, tid)
        top.append({"token": t, "logprob": finite_logprob(value), "bytes": r})
    return {"token": text, "logprob": finite_logprob(lp.logprob), "bytes": raw, "top_logprobs": top}


class CompletionLogprobs:
    """The legacy completions ``logprobs`` object, built token by token."""

    def __init__(self, tokenizer: Tokenizer, with_top: bool):
        self.tokenizer, self.with_top = tokenizer, with_top
        self.offset = 0

    def entry(self, lp: TokenLogprob) -> dict:
        text, _ = _token_text(self.tokenizer, lp.token_id)
        top = None
        if self.with_top:
            top = {}
            for tid, value in lp.top:
                top.setdefault(_token_text(self.tokenizer, tid)[0], finite_logprob(value))
        out = {"tokens": [text], "token_logprobs": [finite_logprob(lp.logprob)], "top_logprobs": [top] if self.with_top else None,
               "text_offset": [self.offset]}
        self.offset += len(text)
        return out

    @staticmethod
    def merge(entries: list[dict], with_top: bool) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [] if with_top else None, "text_offset": []}
        for e in entries:
            out["tokens"] += e["tokens"]
            out["token_logprobs"] += e["token_logprobs"]
            out["text_offset"] += e["text_offset"]
            if with_top:
                out["top_logprobs"] += e["top_logprobs"]
        return out
