"""Qwen3.6 tool calls in generated text -> OpenAI ``tool_calls``, also while streaming.

The chat template tells the model to answer a function call with exactly::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

and renders an assistant's earlier calls the same way (``'<parameter=' + name + '>\\n' + value +
'\\n</parameter>\\n'``, strings as they are, other values as JSON). ``ToolCallParser`` turns that
back into calls: values lose the one newline the template puts on each side and are typed by the
tool's JSON schema (``convert_value``). Also understood: several ``<function=...>`` blocks in one
``<tool_call>``, a ``</parameter>`` left out (the value then ends at the next ``<parameter=`` or
``</function>``), and Qwen3's JSON form ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

While streaming, text that might be the start of ``<tool_call>`` is held back, as is whitespace
that might precede one (the template separates content from calls by a blank line), so the content
never shows part of a tag. A call's name is sent as soon as ``<function=NAME>`` is complete, its
arguments (one JSON text) once the call ends. A ``<tool_call>`` without any function or JSON
inside is returned as content, unchanged.
"""
from __future__ import annotations

import ast
import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .reasoning import partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_INTEGER = re.compile(r"-?\d+")
_TYPE_ORDER = ("null", "boolean", "integer", "number", "object", "array")
_MAX_SCHEMA_DEPTH = 8


@dataclass
class ToolDelta:
    """A piece of one call, as OpenAI streams it: the first delta of call ``index`` carries ``id`` and
    ``name``; ``arguments`` pieces concatenate to the call's JSON arguments."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = "{}"

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """``feed(delta) -> (content, [ToolDelta])``; ``flush()`` at the end; ``calls`` holds the complete
    calls. ``tools``: the request's OpenAI tool definitions, whose parameter schemas type the values."""

    def __init__(self, tools: Sequence[Mapping] | None = None):
        self.calls: list[ToolCall] = []
        self._schemas = _parameter_schemas(tools or ())
        self._buf = ""
        self._in_call = False
        self._gap = ""  # whitespace held back before the current <tool_call>
        self._searched = 0  # how far the current call's body was searched for </tool_call>
        self._open: ToolCall | None = None  # the call whose name was sent and arguments were not
        self._strip_leading = False  # whitespace right after a call is dropped

    # --- streaming ------------------------------------------------------------------------------

    def feed(self, delta: str) -> tuple[str, list[ToolDelta]]:
        self._buf += delta
        content: list[str] = []
        deltas: list[ToolDelta] = []
        while True:
            if not self._in_call:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = partial_suffix(self._buf, OPEN)
                    safe = self._buf[:len(self._buf) - keep]
                    shown = safe.rstrip()  # trailing whitespace waits: it may precede a call
                    content.append(self._text(shown))
                    self._buf = self._buf[len(shown):]
                    break
                before = self._buf[:at]
                shown = before.rstrip()
                content.append(self._text(shown))
                self._gap = before[len(shown):]  # shown after all if this turns out not to be a call
                self._buf, self._in_call, self._searched = self._buf[at + len(OPEN):], True, 0
            else:
                end = self._buf.find(CLOSE, max(0, self._searched - len(CLOSE) + 1))
                if end < 0:
                    self._searched = len(self._buf)
                    deltas += self._start_call(self._buf)
                    break
                body, self._buf = self._buf[:end], self._buf[end + len(CLOSE):]
                deltas += self._start_call(body)
                got, text = self._finish(body, closed=True)
                deltas += got
                content.append(self._text(text))
                self._in_call, self._strip_leading = False, True
        return "".join(content), deltas

    def flush(self) -> tuple[str, list[ToolDelta]]:
        """End of the text: an unterminated call is completed from what it has (or returned as text
        when it names no function); held text is released (trailing whitespace after calls dropped)."""
        buf, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            deltas = self._start_call(buf)
            got, text = self._finish(buf, closed=False)
            return self._text(text), deltas + got
        if self.calls and not buf.strip():
            return "", []
        return self._text(buf), []

    def _text(self, text: str) -> str:
        if self._strip_leading and text:
            text = text.lstrip()
            self._strip_leading = not text
        return text

    def _start_call(self, body: str) -> list[ToolDelta]:
        """Send the call's id and name once ``<function=NAME>`` is complete."""
        if self._open is not None:
            return []
        name = _function_name(body)
        if name is None:
            return []
        self._open = call = ToolCall(len(self.calls), new_call_id(), name)
        self.calls.append(call)
        return [ToolDelta(call.index, call.id, call.name, "")]

    def _finish(self, body: str, closed: bool) -> tuple[list[ToolDelta], str]:
        """The deltas that complete the calls of one ``<tool_call>`` body (``closed``: it ended with
        ``</tool_call>``), or, when it holds no call, the text to show instead."""
        parsed = parse_body(body, self._schemas)
        opened, self._open = self._open, None
        gap, self._gap = self._gap, ""
        if not parsed:
            if opened is not None:  # cannot happen: a named function always parses
                self.calls.remove(opened)
            text = gap + OPEN + body + (CLOSE if closed else "")
            if self._strip_leading:
                text = text.lstrip()
            return [], text
        deltas = []
        for k, (name, args) in enumerate(parsed):
            text = json.dumps(args, ensure_ascii=False)
            if k == 0 and opened is not None:
                opened.arguments = text
                deltas.append(ToolDelta(opened.index, arguments=text))
            else:
                call = ToolCall(len(self.calls), new_call_id(), name, text)
                self.calls.append(call)
                deltas.append(ToolDelta(call.index, call.id, call.name, text))
        return deltas, ""


def parse_tool_calls(text: str, tools: Sequence[Mapping] | None = None) -> tuple[str, list[ToolCall]]:
    """The content and the calls of a whole text (what streaming it in any pieces gives)."""
    parser = ToolCallParser(tools)
    content, _ = parser.feed(text)
    rest, _ = parser.flush()
    return content + rest, parser.calls


# --- one <tool_call> body --------------------------------------------------------------------------

def _function_name(body: str) -> str | None:
    at = body.find(FUNCTION)
    if at < 0:
        return None
    end = body.find(">", at)
    if end < 0:
        return None
    name = body[at + len(FUNCTION):end].strip()
    return name if name and "<" not in name and "\n" not in name else None


def parse_body(body: str, schemas: Mapping[str, Mapping]) -> list[tuple[str, dict]]:
    """[(function name, typed arguments)] of the text between ``<tool_call>`` and ``</tool_call>``:
    each ``<function=NAME>`` block, else Qwen3's JSON form; [] when it is neither."""
    calls = []
    pos = 0
    while True:
        at = body.find(FUNCTION, pos)
        if at < 0:
            break
        name = _function_name(body[at:])
        if name is None:
            break
        start = body.index(">", at) + 1
        end = body.find(FUNCTION_END, start)
        block = body[start:end if end >= 0 else len(body)]
        props = schemas.get(name, {})
        args = {k: convert_value(v, props.get(k)) for k, v in parse_parameters(block)}
        calls.append((name, args))
        if end < 0:
            break
        pos = end + len(FUNCTION_END)
    if calls:
        return calls
    return _json_call(body, schemas)


def parse_parameters(block: str) -> list[tuple[str, str]]:
    """(name, raw value) of each ``<parameter=NAME>value</parameter>`` in a function block. A value
    loses one newline on each side; a missing ``</parameter>`` ends it at the next parameter, at
    ``</function>`` or at the end."""
    out = []
    pos = 0
    while True:
        at = block.find(PARAMETER, pos)
        if at < 0:
            return out
        gt = block.find(">", at)
        if gt < 0:
            return out
        name = block[at + len(PARAMETER):gt].strip()
        start = gt + 1
        ends = [i for i in (block.find(PARAMETER_END, start), block.find(PARAMETER, start),
                            block.find(FUNCTION_END, start)) if i >= 0]
        end = min(ends) if ends else len(block)
        value = block[start:end]
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        if name:
            out.append((name, value))
        pos = end + (len(PARAMETER_END) if block.startswith(PARAMETER_END, end) else 0)
        if pos == at:  # cannot loop forever on a malformed block
            pos = at + len(PARAMETER)


def _json_call(body: str, schemas: Mapping[str, Mapping]) -> list[tuple[str, dict]]:
    try:
        obj = _loads(body.strip())
    except (ValueError, RecursionError):
        return []
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        return []
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = _loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            args = None
    if not isinstance(args, dict):
        return []
    return [(obj["name"].strip(), args)]


# --- typing values by the tool's JSON schema -------------------------------------------------------

def _parameter_schemas(tools: Sequence[Mapping]) -> dict[str, dict]:
    """{function name: {parameter name: its JSON schema}} of OpenAI tool definitions."""
    out = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


def schema_types(schema: Any, depth: int = 0) -> list[str]:
    """The JSON types a schema allows: its ``type`` (a name or a list), those of its ``anyOf`` /
    ``oneOf`` / ``allOf`` members, else what its ``enum`` values, ``properties`` or ``items`` imply."""
    if not isinstance(schema, Mapping) or depth > _MAX_SCHEMA_DEPTH:
        return []
    t = schema.get("type")
    out = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else []
    for key in ("anyOf", "oneOf", "allOf"):
        members = schema.get(key)
        if isinstance(members, list):
            for member in members:
                out += schema_types(member, depth + 1)
    if not out and isinstance(schema.get("enum"), list):
        out = [json_type(v) for v in schema["enum"]]
    if not out and "properties" in schema:
        out = ["object"]
    if not out and "items" in schema:
        out = ["array"]
    return list(dict.fromkeys(out))


def convert_value(raw: str, schema: Any) -> Any:
    """A raw parameter value typed by its JSON schema: null, boolean, integer, number, object and
    array values are parsed (in that order of preference when several types are allowed); strings,
    values without a schema, and values that do not parse as any allowed type stay text."""
    types = schema_types(schema)
    if not types or types == ["string"]:
        return raw
    text = raw.strip()
    for t in _TYPE_ORDER:
        if t in types:
            ok, value = _parse_as(t, text)
            if ok:
                return value
    return raw


def _parse_as(kind: str, text: str) -> tuple[bool, Any]:
    low = text.lower()
    if kind == "null":
        return (True, None) if low in ("null", "none") else (False, None)
    if kind == "boolean":
        return (True, low == "true") if low in ("true", "false") else (False, None)
    if kind in ("integer", "number"):
        if _INTEGER.fullmatch(text):
            try:
                return True, int(text)
            except ValueError:  # more digits than Python converts
                return False, None
        try:
            value = float(text)
        except ValueError:
            return False, None
        if not math.isfinite(value):
            return False, None
        if kind == "integer":
            return (True, int(value)) if value.is_integer() else (False, None)
        return True, value
    want = dict if kind == "object" else list
    try:
        value = _loads(text)
    except (ValueError, RecursionError):
        try:  # Python literal syntax (single quotes, True/None), which models sometimes write
            value = ast.literal_eval(text)
            if isinstance(value, tuple):
                value = list(value)
            json.dumps(value, allow_nan=False)
        except Exception:  # noqa: BLE001 - literal_eval raises many kinds; the value stays text
            return False, None
    return (True, value) if isinstance(value, want) else (False, None)


def _loads(text: str):
    """json.loads that refuses NaN and infinities (they cannot be sent back as JSON)."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite)


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"
