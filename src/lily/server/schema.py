"""The request schemas (JSON Schema, as served in the OpenAPI document) and the validator that checks
request bodies against them, naming the field at fault.

One set of schema objects serves three purposes: ``validate`` checks each request body against it,
``openapi()`` publishes it at ``GET /openapi.json``, and the fuzz test generates requests from it.
Only the JSON Schema subset used here is understood: ``type`` (a name or a list), ``properties``,
``required``, ``additionalProperties``, ``items``, ``enum``, ``minimum``, ``maximum``,
``exclusiveMinimum``, ``minLength``, ``maxLength``, ``minItems``, ``maxItems``, ``maxProperties``,
``anyOf`` and ``$ref`` to ``#/components/schemas/*``. What a schema cannot say (n must be 1, only
text parts, ...) is checked in ``parse.py``.
"""
from __future__ import annotations

import json
import math

from ..sampling import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, MIN_TOP_P
from ..toolcalls import json_type
from .errors import bad_request

MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_INT32 = 2**31 - 1

_REF = "#/components/schemas/"


def _ref(name: str) -> dict:
    return {"$ref": _REF + name}


def _num(lo=None, hi=None, *, lo_open=False, nullable=True, integer=False, doc=""):
    s: dict = {"type": ["integer" if integer else "number"] + (["null"] if nullable else [])}
    if lo is not None:
        s["exclusiveMinimum" if lo_open else "minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    if doc:
        s["description"] = doc
    return s


def _int(lo=None, hi=None, doc=""):
    return _num(lo, hi, integer=True, doc=doc)


def _typed(t: str, doc: str = "", nullable: bool = True) -> dict:
    s: dict = {"type": [t, "null"] if nullable else t}
    if doc:
        s["description"] = doc
    return s


_STOP = {"anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                   {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                    "maxItems": MAX_STOP},
                   {"type": "null"}],
         "description": f"Up to {MAX_STOP} strings of up to {MAX_STOP_CHARS} characters; generation ends before "
                        f"the first one that appears."}

# Sampling fields shared by both endpoints. Unset fields take the checkpoint's generation_config.json.
_SAMPLING = {
    "temperature": _num(0, 2, doc="0 = greedy. Default: the checkpoint's generation_config (Qwen3.6: 1.0)."),
    "top_p": _num(MIN_TOP_P, 1, doc=f"In [{MIN_TOP_P:g}, 1]; 1 = off."),
    "top_k": _int(-1, MAX_INT32, doc="lily extension: keep the k most likely tokens; 0 or -1 = off."),
    "min_p": _num(0, 1, doc="lily extension."),
    "presence_penalty": _num(-2, 2),
    "frequency_penalty": _num(-2, 2),
    "repetition_penalty": _num(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY,
                               doc=f"lily extension: 1 = off; in [{MIN_REPETITION_PENALTY:g}, "
                                   f"{MAX_REPETITION_PENALTY:g}]."),
    "seed": _int(-2**63, 2**64 - 1, doc="Same seed, prompt and parameters give the same tokens. "
                                        "Negative seeds are taken modulo 2**64."),
    "stop": _STOP,
    "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0, "maximum": MAX_INT32},
                       "maxItems": 256,
                       "description": "lily extension: token ids that end generation."},
    "ignore_eos": _typed("boolean", "lily extension: do not stop at the checkpoint's end-of-turn tokens."),
    "skip_special_tokens": _typed("boolean", "lily extension (default true)."),
    "stream": _typed("boolean"),
    "stream_options": {"type": ["object", "null"], "additionalProperties": False,
                       "properties": {"include_usage": _typed("boolean"),
                                      "include_obfuscation": _typed("boolean", "Accepted and ignored.")}},
    "n": _int(1, 1, doc="Only 1 is supported."),
    "logit_bias": {"type": ["object", "null"], "additionalProperties": {"type": "number"},
                   "maxProperties": 0, "description": "Not supported: only null or {} is accepted."},
    "user": _typed("string", "Accepted and ignored."),
    "model": {"type": "string", "description": "The served model name (GET /v1/models). Optional."},
}

_TEXT_PART = {
    "type": "object", "required": ["type"], "additionalProperties": True,
    "properties": {"type": {"type": "string", "enum": ["text", "image_url", "image"],
                            "description": "Text and image parts (images: a checkpoint with a vision tower, "
                                           "device cpu; docs/vision.md). Video and audio parts are refused."},
                   "text": {"type": "string"},
                   "image_url": {"anyOf": [{"type": "string"},
                                           {"type": "object", "required": ["url"], "additionalProperties": True,
                                            "properties": {"url": {"type": "string", "minLength": 1},
                                                           "detail": {"type": "string",
                                                                      "description": "Accepted and ignored."}}}],
                                 "description": "A data: URL (base64); http(s):// and file:// only where the "
                                                "operator allows them (--allow-image-urls, --allow-image-dir)."},
                   "image": {"type": "string", "description": "Alias: the URL of an 'image' part."}},
}

_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _ref("ContentPart")}, {"type": "null"}]}

_TOOL_CALL = {
    "type": "object", "required": ["function"], "additionalProperties": True,
    "properties": {
        "id": {"type": "string"},
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "additionalProperties": True,
                     "properties": {"name": {"type": "string", "minLength": 1},
                                    "arguments": {"anyOf": [{"type": "string"}, {"type": "object"}],
                                                  "description": "JSON text (or an object)."}}},
    },
}

_MESSAGE = {
    "type": "object", "required": ["role"], "additionalProperties": True,
    "description": "Fields not listed here (refusal, annotations, audio, ...) are accepted and ignored.",
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"],
                 "description": "'developer' is treated as 'system'."},
        "content": _CONTENT,
        "name": _typed("string", "Accepted and ignored."),
        "tool_calls": {"type": ["array", "null"], "items": _ref("ToolCall")},
        "tool_call_id": _typed("string"),
        "reasoning_content": _typed("string", "An assistant message's reasoning (dropped by the template "
                                              "for turns before the last user message)."),
        "reasoning": _typed("string", "Alias of reasoning_content."),
    },
}

_TOOL = {
    "type": "object", "required": ["type", "function"], "additionalProperties": False,
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "additionalProperties": False,
                     "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 256},
                                    "description": {"type": "string"},
                                    "parameters": {"type": "object",
                                                   "description": "JSON Schema of the arguments; its property "
                                                                  "types decide how argument values are typed."},
                                    "strict": _typed("boolean", "Accepted; not enforced.")}},
    },
}

_TOOL_CHOICE = {
    "anyOf": [{"type": "string", "enum": ["none", "auto", "required"]},
              {"type": "object", "required": ["type", "function"], "additionalProperties": False,
               "properties": {"type": {"type": "string", "enum": ["function"]},
                              "function": {"type": "object", "required": ["name"], "additionalProperties": False,
                                           "properties": {"name": {"type": "string", "minLength": 1}}}}},
              {"type": "null"}],
    "description": "none: tools are neither rendered nor parsed (no call can be returned); auto: all tools "
                   "rendered, calls parsed; required: the answer is one or more calls (decoding constrained to "
                   "Qwen's XML call format, arguments typed by each tool's schema); a named function: only that "
                   "tool rendered and the answer is one call of it.",
}

_RESPONSE_FORMAT = {
    "type": ["object", "null"], "required": ["type"], "additionalProperties": True,
    "properties": {"type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                   "json_schema": {"type": "object", "required": ["schema"], "additionalProperties": True,
                                   "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                                  "strict": {"type": ["boolean", "null"]}}}},
    "description": "text (default); json_object: the answer is a JSON object; json_schema: {'name', 'schema', "
                   "'strict'}: the answer is JSON valid under 'schema' (enforced by constrained decoding, "
                   "strict or not; unsupported schema keywords are a 400 naming them).",
}

CHAT_REQUEST = {
    "type": "object", "required": ["messages"], "additionalProperties": False,
    "properties": {
        **_SAMPLING,
        "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
        "max_tokens": _int(1, doc="Deprecated alias of max_completion_tokens."),
        "max_completion_tokens": _int(1, doc="Default: the rest of the context."),
        "logprobs": _typed("boolean"),
        "top_logprobs": _int(0, MAX_LOGPROBS, doc="Needs logprobs: true."),
        "tools": {"type": ["array", "null"], "items": _ref("Tool"), "maxItems": 128},
        "tool_choice": _TOOL_CHOICE,
        "parallel_tool_calls": _typed("boolean", "Accepted and ignored (every parsed call is returned)."),
        "response_format": _RESPONSE_FORMAT,
        "chat_template_kwargs": {"type": ["object", "null"],
                                 "description": "Passed to the chat template, e.g. {'enable_thinking': false} or "
                                                "{'preserve_thinking': true}."},
        "mm_processor_kwargs": {"type": ["object", "null"], "additionalProperties": False,
                                "properties": {"min_pixels": _int(1, doc="The fewest pixels an image is resized to."),
                                               "max_pixels": _int(1, doc="The most pixels an image is resized to.")},
                                "description": "The image resize bounds of this request's images (vLLM's field; "
                                               "default: the server's --image-min-pixels / --image-max-pixels, else "
                                               "the checkpoint's preprocessor_config.json). An image of more pixels "
                                               "costs more prompt tokens (one per 32 x 32 pixels)."},
        "metadata": {"type": ["object", "null"], "description": "Accepted and ignored."},
        "store": _typed("boolean", "Accepted and ignored."),
        "service_tier": _typed("string", "Accepted and ignored."),
        "prompt_cache_key": _typed("string", "Accepted and ignored (the prefix cache is automatic)."),
        "safety_identifier": _typed("string", "Accepted and ignored."),
    },
}

COMPLETION_REQUEST = {
    "type": "object", "required": ["prompt"], "additionalProperties": False,
    "properties": {
        **_SAMPLING,
        "prompt": {"anyOf": [{"type": "string"},
                             {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"}},
                             {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                             {"type": "array", "minItems": 1, "maxItems": 1,
                              "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}}],
                   "description": "One prompt: text or token ids (a list holding one of those is accepted)."},
        "max_tokens": _int(1, doc="Default 16, as OpenAI's."),
        "logprobs": _int(0, MAX_LOGPROBS, doc="The chosen token's logprob and this many alternatives."),
        "echo": {"type": ["boolean", "null"], "enum": [False, None], "description": "Only false."},
        "best_of": _int(1, 1, doc="Only 1."),
        "suffix": {"type": "null", "description": "Not supported."},
        "response_format": _RESPONSE_FORMAT,
    },
}

COMPONENTS = {
    "ChatCompletionRequest": CHAT_REQUEST,
    "CompletionRequest": COMPLETION_REQUEST,
    "ChatMessage": _MESSAGE,
    "ContentPart": _TEXT_PART,
    "ToolCall": _TOOL_CALL,
    "Tool": _TOOL,
    "Error": {"type": "object", "required": ["error"],
              "properties": {"error": {"type": "object", "required": ["message", "type"],
                                       "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                                      "param": {"type": ["string", "null"]},
                                                      "code": {"type": ["string", "null"]}}}}},
    "Usage": {"type": "object",
              "properties": {"prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
                             "total_tokens": {"type": "integer"},
                             "prompt_tokens_details": {"type": "object",
                                                       "properties": {"cached_tokens": {"type": "integer"}}}}},
    "ChatCompletion": {"type": "object", "description": "object 'chat.completion'; with stream: true, "
                                                        "server-sent events of 'chat.completion.chunk' objects "
                                                        "and 'data: [DONE]'.",
                       "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                      "created": {"type": "integer"}, "model": {"type": "string"},
                                      "choices": {"type": "array"}, "usage": _ref("Usage")}},
    "Completion": {"type": "object", "description": "object 'text_completion' (also the stream's chunks).",
                   "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                  "created": {"type": "integer"}, "model": {"type": "string"},
                                  "choices": {"type": "array"}, "usage": _ref("Usage")}},
    "ModelList": {"type": "object", "properties": {"object": {"type": "string"}, "data": {"type": "array"}}},
}


# --- validation ------------------------------------------------------------------------------------

_JSON_TYPE_NAMES = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
                    "null": "null", "array": "an array", "object": "an object"}


def _resolve(schema: dict) -> dict:
    ref = schema.get("$ref")
    return COMPONENTS[ref[len(_REF):]] if ref else schema


def describe(schema: dict) -> str:
    """What a value of ``schema`` is, in words ("a string or an array of ContentPart objects")."""
    ref = schema.get("$ref")
    if ref:
        return f"a {ref[len(_REF):]} object"
    if "anyOf" in schema:
        return " or ".join(dict.fromkeys(describe(s) for s in schema["anyOf"]))
    if "enum" in schema and "type" in schema and not isinstance(schema["type"], list):
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    types = schema.get("type", [])
    types = [types] if isinstance(types, str) else list(types)
    words = []
    for t in types:
        w = _JSON_TYPE_NAMES[t]
        if t == "array" and "items" in schema:
            w += " of " + _plural(describe(schema["items"]))
        words.append(w)
    return " or ".join(words) or "any JSON value"


def _plural(phrase: str) -> str:
    """"a string or an array of integers" -> "strings or arrays of integers"."""
    out = []
    for part in phrase.split(" or "):
        for article in ("an ", "a "):
            if part.startswith(article):
                part = part[len(article):]
                break
        if part.startswith("array"):
            part = "arrays" + part[len("array"):]
        elif part != "null" and not part.startswith("one of"):
            part += "s"
        out.append(part)
    return " or ".join(out)


def short(value, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _fail(path: str, message: str, type_error: bool = False):
    error = bad_request(f"'{path}': {message}" if path else message, param=path or None)
    error.type_error = type_error  # a value of the wrong JSON type (else: a wrong value of the right type)
    raise error


def validate(value, schema: dict, path: str = "") -> None:
    """Raise a 400 APIError naming the first field of ``value`` that ``schema`` rejects."""
    named, schema = schema, _resolve(schema)
    if "anyOf" in schema:
        options = [_resolve(s) for s in schema["anyOf"]]
        errors = []
        for option in options:
            try:
                validate(value, option, path)
                return
            except Exception as e:  # noqa: BLE001 - an APIError from the nested check
                errors.append((option, e))
        # When exactly one alternative has the value's JSON type (or, among those that have it,
        # exactly one fails on a value rather than on a type), its own error is the precise one.
        kind = json_type(value)
        same = [e for o, e in errors if kind in _types(o) or (kind == "integer" and "number" in _types(o))]
        if len(same) > 1:
            same = [e for e in same if not getattr(e, "type_error", False)] or same
        if len(same) == 1:
            raise same[0]
        _fail(path, f"expected {describe(schema)}, got {short(value)}", type_error=True)
    types = _types(schema)
    kind = json_type(value)
    if types and kind not in types and not (kind == "integer" and "number" in types):
        _fail(path, f"expected {describe(named)}, got {short(value)}", type_error=True)
    if kind == "number" and not math.isfinite(value):
        _fail(path, f"must be a finite number, got {short(value)}")
    if "enum" in schema and value not in schema["enum"]:
        _fail(path, f"must be one of {', '.join(json.dumps(v) for v in schema['enum'])}, got {short(value)}")
    if kind in ("integer", "number"):
        _check_range(value, schema, path)
    elif kind == "string":
        if len(value) < schema.get("minLength", 0):
            _fail(path, "must not be empty" if schema["minLength"] == 1 else
                  f"must have at least {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            _fail(path, f"must have at most {schema['maxLength']} characters")
    elif kind == "array":
        if len(value) < schema.get("minItems", 0):
            _fail(path, "must not be empty" if schema["minItems"] == 1 else
                  f"must have at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            _fail(path, f"must have at most {schema['maxItems']} item{'s' if schema['maxItems'] != 1 else ''}, "
                        f"got {len(value)}")
        if "items" in schema:
            for i, item in enumerate(value):
                validate(item, schema["items"], f"{path}[{i}]")
    elif kind == "object":
        _check_object(value, schema, path)


def _types(schema: dict) -> list[str]:
    t = schema.get("type", [])
    return [t] if isinstance(t, str) else list(t)


def _check_range(value, schema: dict, path: str) -> None:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    lo_open = schema.get("exclusiveMinimum")
    if lo_open is not None and value <= lo_open:
        _fail(path, f"must be > {lo_open}" + (f" and <= {hi}" if hi is not None else "") + f", got {short(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if lo is not None and hi is not None:
            rng = f"must be {lo}" if lo == hi else f"must be between {lo} and {hi}"
        else:
            rng = f"must be >= {lo}" if lo is not None else f"must be <= {hi}"
        _fail(path, f"{rng}, got {short(value)}")


def _check_object(value: dict, schema: dict, path: str) -> None:
    props = schema.get("properties", {})
    for name in schema.get("required", ()):
        if name not in value:
            _fail(_join(path, name), "is required")
    extra = schema.get("additionalProperties", True)
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        _fail(path, "is not supported; only null or {} is accepted" if schema["maxProperties"] == 0 else
              f"must have at most {schema['maxProperties']} entries")
    for name, item in value.items():
        sub = _join(path, name)
        if name in props:
            validate(item, props[name], sub)
        elif extra is False:
            known = ", ".join(sorted(props))
            raise bad_request(f"unrecognized request argument '{sub}'" +
                              (f"; the accepted fields are: {known}" if not path else ""),
                              param=sub, code="unknown_parameter")
        elif isinstance(extra, dict):
            validate(item, extra, sub)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# --- the OpenAPI document --------------------------------------------------------------------------

def openapi(version: str = "0.1.0") -> dict:
    """The OpenAPI 3.1 description of the server (served at GET /openapi.json)."""
    error = {"description": "An OpenAI error object.",
             "content": {"application/json": {"schema": _ref("Error")}}}

    def post(summary: str, request: str, response: str) -> dict:
        return {"post": {
            "summary": summary, "security": [{"bearer": []}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {"200": {"description": "The result; with stream: true, server-sent events.",
                                  "content": {"application/json": {"schema": _ref(response)},
                                              "text/event-stream": {"schema": {"type": "string"}}}},
                          "400": error, "401": error, "404": error, "413": error, "429": error}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "lily OpenAI-compatible server", "version": version,
                 "description": "One model, one request at a time; see docs/server.md."},
        "paths": {
            "/v1/chat/completions": post("Chat completion", "ChatCompletionRequest", "ChatCompletion"),
            "/v1/completions": post("Text completion", "CompletionRequest", "Completion"),
            "/v1/models": {"get": {"summary": "The served model", "security": [{"bearer": []}],
                                   "responses": {"200": {"description": "A list with the one model.",
                                                         "content": {"application/json":
                                                                     {"schema": _ref("ModelList")}}},
                                                 "401": error}}},
            "/v1/models/{model}": {"get": {"summary": "One model", "security": [{"bearer": []}],
                                           "parameters": [{"name": "model", "in": "path", "required": True,
                                                           "schema": {"type": "string"}}],
                                           "responses": {"200": {"description": "The model object."},
                                                         "401": error, "404": error}}},
            "/health": {"get": {"summary": "Liveness and queue state (no API key needed)",
                                "responses": {"200": {"description": "{'status': 'ok', ...}"}}}},
            "/openapi.json": {"get": {"summary": "This document",
                                      "responses": {"200": {"description": "OpenAPI 3.1"}}}},
        },
        "components": {"schemas": COMPONENTS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "Needed when the server has an API key."}}},
    }
