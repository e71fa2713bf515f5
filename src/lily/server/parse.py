"""Validated request bodies -> what the engine runs: template-ready messages, tools, SamplingParams.

The JSON schemas (``schema.py``) check types and ranges; this module checks what they cannot say
and maps OpenAI fields onto lily's: ``max_completion_tokens`` (or ``max_tokens``), ``logprobs`` +
``top_logprobs``, ``stop``, ``seed`` (negative seeds modulo 2**64), ``top_k = -1`` (off),
``tool_choice`` (which tools are rendered and whether calls are parsed), ``chat_template_kwargs``, and
the structured-output constraint of ``response_format`` (json_object / json_schema) or of a forcing
``tool_choice`` ("required" or a named function: a call in Qwen's XML format), compiled here so that
a schema llguidance cannot use is a 400 naming the problem before the request is queued.
Fields a request leaves out take the checkpoint's recommended sampling (generation_config.json).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from .. import constraints
from ..constraints import Constraint
from ..errors import LilyError
from ..sampling import SamplingParams
from .errors import bad_request
from .schema import CHAT_REQUEST, COMPLETION_REQUEST, validate

COMPLETION_DEFAULT_MAX_TOKENS = 16
# Top-level fields that are not ignored although unknown: they would change the answer's meaning.
REFUSED_FIELDS = {"functions": "legacy 'functions' is not supported; use 'tools'",
                  "function_call": "legacy 'function_call' is not supported; use 'tool_choice'"}
MAX_LOGGED_FIELDS = 256  # distinct ignored names logged (then no more: the log stays bounded)
_logged: set[str] = set()
_logged_lock = threading.Lock()
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")


@dataclass
class Request:
    """One parsed request. ``max_tokens_field``: the field that set ``params.max_tokens`` (None when
    it is the default), named in context errors."""
    kind: str  # "chat" | "completion"
    model: str | None
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    max_tokens_field: str | None = None
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None  # what the template renders
    parse_tools: bool = False
    tool_defs: list[dict] = field(default_factory=list)  # what types the parsed arguments
    template_kwargs: dict = field(default_factory=dict)
    prompt: Any = None  # completion: text or token ids
    constraint: Constraint | None = None  # what the answer must match (structured output)
    image_pixels: tuple[int | None, int | None] = (None, None)  # chat: mm_processor_kwargs' (min, max) pixels


def drop_unknown_fields(body: Any, schema: dict, log=None) -> Any:
    """``body`` without the top-level fields ``schema`` does not know, as vLLM and most OpenAI-compatible
    servers do (clients send ``reasoning_effort``, ``user``, ``metadata``, ... freely); each ignored
    name is logged once (``log``: a function of one line; default stderr). Still refused with a 400:
    a name within a typo of a known field (``temprature``: "did you mean 'temperature'?") and the
    legacy ``functions`` / ``function_call``."""
    if not isinstance(body, dict):
        return body
    props = schema["properties"]
    unknown = [k for k in body if k not in props]
    if not unknown:
        return body
    for name in unknown:
        if name in REFUSED_FIELDS:
            raise bad_request(f"'{name}': {REFUSED_FIELDS[name]}", name, "unsupported_value")
        close = difflib.get_close_matches(name, list(props), n=1, cutoff=0.85)
        if close:
            raise bad_request(f"unrecognized request argument '{name}' (did you mean '{close[0]}'?)", name,
                              "unknown_parameter")
    with _logged_lock:
        new = [k for k in unknown if k not in _logged][:max(0, MAX_LOGGED_FIELDS - len(_logged))]
        _logged.update(new)
    for name in new:
        line = f"lily serve: ignoring the unknown request field {json.dumps(name)[:80]} (logged once)"
        if log is not None:
            log(line)
        else:
            print(line, file=sys.stderr, flush=True)
    return {k: v for k, v in body.items() if k in props}


def _several_prompts(prompt: Any) -> None:
    """A completion prompt that is a list of several prompts: say that one is supported."""
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request(f"'prompt': one prompt per request is supported, got {len(prompt)} prompts; send them "
                          f"as separate requests (a list holding one prompt is accepted)", "prompt",
                          "unsupported_value")


def parse_chat(body: Any, defaults: SamplingParams) -> Request:
    body = drop_unknown_fields(body, CHAT_REQUEST)
    _refuse_video(body)
    validate(body, CHAT_REQUEST)
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if top and not logprobs:
        raise bad_request("'top_logprobs': needs logprobs: true", "top_logprobs")
    max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else (
        "max_tokens" if body.get("max_tokens") is not None else None)
    params = _sampling(body, defaults, body.get(max_field) if max_field else None,
                       (top or True) if logprobs else None)
    tools, parse_tools, tool_defs = _tools(body)
    req = Request("chat", body.get("model"), params, bool(body.get("stream")), _include_usage(body), max_field,
                  messages=[_message(m, i) for i, m in enumerate(body["messages"])], tools=tools,
                  parse_tools=parse_tools, tool_defs=tool_defs, template_kwargs=_template_kwargs(body))
    pixels = body.get("mm_processor_kwargs") or {}
    req.image_pixels = (pixels.get("min_pixels"), pixels.get("max_pixels"))
    req.constraint = _response_format(body)
    forced = _forced_call(body, tool_defs)
    if forced is not None and req.constraint is not None:
        raise bad_request("'tool_choice' forces a tool call and 'response_format' a JSON answer; give one of them",
                          "response_format", "unsupported_value")
    req.constraint = req.constraint or forced
    return req


def parse_completion(body: Any, defaults: SamplingParams) -> Request:
    body = drop_unknown_fields(body, COMPLETION_REQUEST)
    if isinstance(body, dict):
        _several_prompts(body.get("prompt"))
    validate(body, COMPLETION_REQUEST)
    prompt = body["prompt"]
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    logprobs = body.get("logprobs")
    max_tokens = body.get("max_tokens")
    params = _sampling(body, defaults, max_tokens if max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS,
                       (logprobs or True) if logprobs is not None else None)
    return Request("completion", body.get("model"), params, bool(body.get("stream")), _include_usage(body),
                   "max_tokens" if max_tokens is not None else None, prompt=prompt,
                   constraint=_response_format(body))


def _response_format(body: dict) -> Constraint | None:
    """The constraint of ``response_format``: None for text, any JSON object for json_object, the
    schema of json_schema (OpenAI's ``{"name", "schema", "strict"}``; enforced whatever ``strict``)."""
    fmt = body.get("response_format")
    kind = fmt.get("type") if fmt else "text"
    if kind == "text":
        return None
    if kind == "json_object":
        return constraints.json_object()
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("'response_format.json_schema' is required for type json_schema: {\"name\": ..., "
                          "\"schema\": {...}, \"strict\": true}", "response_format.json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("'response_format.json_schema.schema' must be a JSON schema object",
                          "response_format.json_schema.schema")
    try:
        return constraints.json_schema(schema, "'response_format.json_schema.schema'")
    except LilyError as e:
        raise bad_request(str(e), "response_format.json_schema.schema", "unsupported_value") from None


def _forced_call(body: dict, tool_defs: list[dict]) -> Constraint | None:
    """``tool_choice`` "required" (one or more calls of the tools) or a named function (one call of
    it): a constraint in Qwen's XML tool-call format. "auto", "none" and no choice constrain nothing."""
    choice = body.get("tool_choice")
    if choice != "required" and not isinstance(choice, dict):
        return None
    name = choice["function"]["name"] if isinstance(choice, dict) else None
    try:
        return constraints.tool_call(tool_defs, name, "'tool_choice'")
    except LilyError as e:
        raise bad_request(str(e), "tools", "unsupported_value") from None


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    return bool(options.get("include_usage"))


def _sampling(body: dict, defaults: SamplingParams, max_tokens: int | None, logprobs) -> SamplingParams:
    kw: dict[str, Any] = {}
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "ignore_eos", "skip_special_tokens"):
        if body.get(name) is not None:
            kw[name] = body[name]
    if body.get("top_k") is not None:
        kw["top_k"] = max(0, body["top_k"])
    if body.get("seed") is not None:
        kw["seed"] = body["seed"] % 2**64
    stop = body.get("stop")
    kw["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
    kw["stop_token_ids"] = tuple(body.get("stop_token_ids") or ())
    kw["max_tokens"] = max_tokens
    kw["logprobs"] = logprobs
    try:
        return dataclasses.replace(defaults, **kw)
    except LilyError as e:  # the schema checks ranges first; this is a second line
        raise bad_request(str(e)) from None


def _template_kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs") or {}
    for name in RESERVED_TEMPLATE_KWARGS:
        if name in kwargs:
            raise bad_request(f"'chat_template_kwargs.{name}': chat_template_kwargs may not set '{name}' (it comes "
                              f"from the request itself)",
                              f"chat_template_kwargs.{name}")
    for name in ("enable_thinking", "preserve_thinking"):
        if kwargs.get(name) is not None and not isinstance(kwargs[name], bool):
            raise bad_request(f"'chat_template_kwargs.{name}': expected a boolean, got {json.dumps(kwargs[name])}",
                              f"chat_template_kwargs.{name}")
    return {k: v for k, v in kwargs.items() if v is not None}


def _tools(body: dict) -> tuple[list[dict] | None, bool, list[dict]]:
    """(tools the template renders, whether calls are parsed, tool definitions that type arguments)."""
    tools = body.get("tools") or []
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None, False, []
    if choice == "required" and not tools:
        raise bad_request("'tool_choice': 'required' needs tools", "tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise bad_request(f"'tool_choice.function.name': the function {name!r} is not among the tools",
                              "tool_choice.function.name")
        tools = chosen[:1]
    return (tools or None), bool(tools), tools


def _message(m: dict, i: int) -> dict:
    """An OpenAI message -> the dict the chat template takes."""
    role = "system" if m["role"] == "developer" else m["role"]
    out: dict[str, Any] = {"role": role, "content": _content(m.get("content"), f"messages[{i}].content")}
    if m.get("content") is None and role in ("system", "user", "tool"):
        raise bad_request(f"'messages[{i}].content' is required for {m['role']} messages", f"messages[{i}].content")
    if role == "assistant":
        reasoning = m.get("reasoning_content")
        if reasoning is None:
            reasoning = m.get("reasoning")
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if m.get("tool_calls"):
            out["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
    elif m.get("tool_calls"):
        raise bad_request(f"'messages[{i}].tool_calls' is only allowed in assistant messages",
                          f"messages[{i}].tool_calls")
    return out


def _content(content, path: str) -> str | list[dict]:
    """A message's content: its text, or with image parts the list of text and image parts (the images
    are read in app._prepare_chat, under the server's image URL policy)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise bad_request(f"'{path}[{j}].text' is required (a string) for a text part", f"{path}[{j}].text")
            parts.append({"type": "text", "text": part["text"]})
        else:
            url = part.get("image_url", part.get("image"))
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise bad_request(f"'{path}[{j}].image_url.url' is required (a data: URL) for an image part",
                                  f"{path}[{j}].image_url")
            parts.append({"type": "image_url", "image_url": {"url": url}})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def content_text(content) -> str:
    """The text of a parsed message content (its text parts joined)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content)
    return content or ""


def _refuse_video(body: Any) -> None:
    """Video and audio parts: a 400 that says so (the schema would only list the part types it knows)."""
    from ..multimodal import is_video_part

    messages = body.get("messages") if isinstance(body, dict) else None
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if is_video_part(part):
                raise bad_request(f"'messages[{i}].content[{j}]': video and audio input are not supported "
                                  f"(images only: image_url parts with data: URLs)", f"messages[{i}].content[{j}]",
                                  "unsupported_value")


def _tool_call(call: dict, path: str) -> dict:
    fn = call["function"]
    args = fn.get("arguments")
    if args is None:
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError) as e:
            raise bad_request(f"'{path}.function.arguments' is not valid JSON ({e})",
                              f"{path}.function.arguments") from None
    if not isinstance(args, dict):
        raise bad_request(f"'{path}.function.arguments' must be a JSON object", f"{path}.function.arguments")
    return {"id": call.get("id") or "", "type": "function", "function": {"name": fn["name"], "arguments": args}}
