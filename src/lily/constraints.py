"""Constrained decoding (structured output): what the generated text must match, as an llguidance
grammar, and the per-request guide that turns it into a token mask for each step.

A ``Constraint`` is built once per request from a JSON schema (a dict, JSON text or a pydantic model
class), a regular expression, a grammar in llguidance's Lark syntax, a list of choices, or tool
definitions (a forced call in Qwen3.6's XML tool-call format); building it checks the grammar and
raises LilyError naming what is wrong or unsupported. ``Guide`` follows one generation: before each
sample it gives the mask of allowed ids (int32 words, bit v of word v // 32 = id v, llguidance's
layout, which ``ops.apply_token_mask`` applies on the session's device), and after each sampled id
it advances the matcher. With ``after_think`` the text is free until the ``</think>`` token (only the
stop ids are masked out, so the answer cannot end inside the reasoning); the constraint applies
from the next token on, after optional newlines. The guide reports ``done`` once the matcher can
accept nothing more, which ends generation with finish_reason 'stop'.

llguidance (pip ``llguidance``) is used rather than xgrammar: it builds masks into numpy arrays with
no torch at run time, compiles schemas lazily (no per-schema precompilation pause), reports
unsupported JSON schema keywords by name, and handles Lark grammars with special tokens and lazy
lexemes, which the Qwen XML tool-call format needs.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import LilyError
from .toolcalls import schema_types

if TYPE_CHECKING:
    from .model import Model

THINK_END = "</think>"
KINDS = ("json_schema", "regex", "grammar", "choice")


@dataclass(frozen=True)
class Constraint:
    """What the generated text (the answer after ``</think>`` when ``after_think``) must match.
    ``kind``: 'json_schema', 'json_object', 'regex', 'grammar', 'choice' or 'tool_call';
    ``grammar``: the llguidance grammar (JSON text); ``after_think``: None = decided by the prompt
    (a prompt that leaves a think block open), True / False force it."""
    kind: str
    grammar: str
    after_think: bool | None = None

    def with_think(self, after_think: bool | None) -> "Constraint":
        return Constraint(self.kind, self.grammar, after_think)


def _llg():
    try:
        import llguidance
    except ImportError as e:  # a dependency of lily; only a broken install lacks it
        raise LilyError(f"structured output needs the llguidance package (pip install llguidance): {e}") from None
    return llguidance


def _checked(kind: str, entry: dict, what: str) -> Constraint:
    """A Constraint of one llguidance grammar entry, refused with a LilyError naming ``what`` when
    llguidance reports an error (unsupported schema keywords are listed by name)."""
    llg = _llg()
    grammar = json.dumps({"grammars": [entry]})
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise LilyError(f"{what}: {_clean(messages[0]) if messages else 'invalid'}")
    return Constraint(kind, grammar)


def _clean(message: str) -> str:
    return message.strip().replace("Unimplemented keys", "unsupported JSON schema keywords")


def json_schema(schema: Any, what: str = "json_schema") -> Constraint:
    """Text that is one JSON value valid under ``schema``: a dict, JSON text, or a pydantic model
    class (its ``model_json_schema()``)."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    elif isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise LilyError(f"{what}: not valid JSON ({e})") from None
    if schema is True:
        schema = {}
    elif schema is False:
        raise LilyError(f"{what}: the schema false accepts no value")
    if not isinstance(schema, Mapping):
        raise LilyError(f"{what}: expected a JSON schema object (a dict, JSON text or a pydantic model class), "
                        f"got {type(schema).__name__}")
    return _checked("json_schema", {"json_schema": _compact(schema, what)}, what)


# JSON layout: llguidance's separators (", " and ": ") and no other whitespace, so a model cannot
# spend its tokens on blank space inside a value; a schema's own "x-guidance" options win.
JSON_OPTIONS = {"whitespace_flexible": False}


def _compact(schema: Mapping, what: str) -> dict:
    """A copy of ``schema`` (checked to be JSON) with JSON_OPTIONS as its default layout."""
    try:
        out = json.loads(json.dumps(schema))
    except (TypeError, ValueError, RecursionError) as e:
        raise LilyError(f"{what}: not JSON-serialisable ({e})") from None
    out["x-guidance"] = {**JSON_OPTIONS, **(out.get("x-guidance") or {})}
    return out


def json_object() -> Constraint:
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    return Constraint("json_object", json_schema({"type": "object"}).grammar)


def regex(pattern: str, what: str = "regex") -> Constraint:
    """Text that matches ``pattern`` as a whole (Rust regex syntax, as Python's for common patterns)."""
    if not isinstance(pattern, str) or not pattern:
        raise LilyError(f"{what}: expected a non-empty regular expression string, got {pattern!r}")
    return _checked("regex", {"lark_grammar": "start: " + _lark_regex(pattern)}, what)


def grammar(text: str, what: str = "grammar") -> Constraint:
    """Text derived from the Lark grammar ``text`` (llguidance's syntax: a ``start`` rule; ``%json
    {...}`` embeds a JSON schema; ``/.../`` regexes; docs/generation.md)."""
    if not isinstance(text, str) or not text.strip():
        raise LilyError(f"{what}: expected a non-empty Lark grammar string, got {text!r}")
    return _checked("grammar", {"lark_grammar": text}, what)


def choice(options: Sequence[str], what: str = "choice") -> Constraint:
    """Exactly one of ``options`` (strings)."""
    if isinstance(options, str) or not isinstance(options, Sequence) or not options:
        raise LilyError(f"{what}: expected a non-empty list of strings, got {options!r}")
    bad = [o for o in options if not isinstance(o, str) or not o]
    if bad:
        raise LilyError(f"{what}: every choice must be a non-empty string, got {bad[0]!r}")
    return _checked("choice", {"lark_grammar": "start: " + " | ".join(_lark_string(o) for o in options)}, what)


def tool_call(tools: Sequence[Mapping], name: str | None = None, what: str = "tool_choice") -> Constraint:
    """One or more calls of ``tools`` (OpenAI function definitions) in Qwen3.6's XML format, and
    nothing else (``name``: exactly one call of that function). Each call lists the function's
    parameters in schema order, the required ones always; string values are free text (up to
    ``\\n</parameter>``, within minLength / maxLength), enums one of their values, other types
    JSON valid under the parameter's schema, so the parsed ``tool_calls`` arguments are typed by
    the tool's schema."""
    fns = _functions(tools, what)
    if name is not None:
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise LilyError(f"{what}: the function {name!r} is not among the tools")
    rules = []
    calls = []
    for i, fn in enumerate(fns):
        params = fn.get("parameters") if isinstance(fn.get("parameters"), Mapping) else {}
        props = params.get("properties") if isinstance(params.get("properties"), Mapping) else {}
        required = params.get("required") if isinstance(params.get("required"), list) else []
        parts = []
        for j, (pname, pschema) in enumerate(props.items()):
            rule = f"f{i}_p{j}"
            value = _value_rule(f"{rule}_v", pschema, rules, f"{what}: function {fn['name']!r}, parameter {pname!r}")
            rules.append(f"{rule}: {_lark_string('<parameter=' + pname + '>' + chr(10))} {value}")
            parts.append(rule if pname in required else rule + "?")
        rules.append(f"f{i}: <tool_call> {_lark_string(chr(10) + '<function=' + fn['name'] + '>' + chr(10))} "
                     f"{' '.join(parts)} {_lark_string('</function>' + chr(10))} </tool_call>")
        calls.append(f"f{i}")
    body = ["start: call", 'call: ' + " | ".join(calls)] if name is not None else \
        ["start: call (\"\\n\" call)*", 'call: ' + " | ".join(calls)]
    return _checked("tool_call", {"lark_grammar": "\n".join(body + rules) + "\n"}, what)


def _functions(tools: Sequence[Mapping], what: str) -> list[dict]:
    if not isinstance(tools, Sequence) or not tools:
        raise LilyError(f"{what}: a forced tool call needs tools")
    out = []
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise LilyError(f"{what}: tools[{k}] is not a function definition with a name")
        if any(c in fn["name"] for c in "<>\n"):
            raise LilyError(f"{what}: tools[{k}]: the function name {fn['name']!r} cannot be written in Qwen's "
                            f"tool-call format (it holds '<', '>' or a newline)")
        out.append(dict(fn))
    return out


def _value_rule(rule: str, schema: Any, rules: list[str], what: str) -> str:
    """The Lark rule of one parameter value followed by ``\\n</parameter>\\n``; returns the rule name."""
    end = _lark_string("\n</parameter>\n")
    types = schema_types(schema)
    if isinstance(schema, Mapping) and isinstance(schema.get("enum"), list) and schema["enum"] and \
            all(isinstance(v, str) and v for v in schema["enum"]):
        rules.append(f"{rule}: ({' | '.join(_lark_string(v) for v in schema['enum'])}) {end}")
    elif types and "string" not in types:
        sub = json.dumps(_compact(schema, what))
        is_error, messages = _llg().LLMatcher.validate_grammar_with_warnings(
            json.dumps({"grammars": [{"json_schema": json.loads(sub)}]}))
        if is_error:
            raise LilyError(f"{what}: {_clean(messages[0]) if messages else 'invalid schema'}")
        rules.append(f"{rule}: {rule}_json {end}")
        rules.append(f"{rule}_json: %json {sub}")
    else:  # free text up to the first "\n</parameter>\n" (a lazy lexeme), within min/maxLength
        lo, hi = _length_bounds(schema)
        rules.append(f"{rule}[lazy]: /(.|\\n){{{lo},{hi}}}\\n<\\/parameter>\\n/")
    return rule


def _length_bounds(schema: Any) -> tuple[int, str]:
    """(minLength, maxLength or "") of a string schema, for a regex repetition."""
    lo = schema.get("minLength", 0) if isinstance(schema, Mapping) else 0
    hi = schema.get("maxLength") if isinstance(schema, Mapping) else None
    lo = lo if isinstance(lo, int) and not isinstance(lo, bool) and lo >= 0 else 0
    hi = hi if isinstance(hi, int) and not isinstance(hi, bool) and hi >= lo else None
    return lo, "" if hi is None else str(hi)


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _lark_regex(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"


def from_arguments(json_schema_: Any = None, regex_: str | None = None, grammar_: str | None = None,
                   choice_: Sequence[str] | None = None, constraint: Constraint | None = None) -> Constraint | None:
    """The one Constraint of generate()'s ``json_schema`` / ``regex`` / ``grammar`` / ``choice`` /
    ``constraint`` arguments (None when none is given; LilyError when several are)."""
    given = {k: v for k, v in zip(KINDS + ("constraint",), (json_schema_, regex_, grammar_, choice_, constraint))
             if v is not None}
    if len(given) > 1:
        raise LilyError(f"give at most one of json_schema, regex, grammar, choice, constraint; got {', '.join(given)}")
    if not given:
        return None
    (kind, value), = given.items()
    if kind == "constraint":
        if not isinstance(value, Constraint):
            raise LilyError(f"constraint must be a lily.Constraint, got {type(value).__name__}")
        return value
    return {"json_schema": json_schema, "regex": regex, "grammar": grammar, "choice": choice}[kind](value)


def ll_tokenizer(model: "Model"):
    """llguidance's view of the model's tokenizer (built once per model: ~1 s for Qwen3.6's 248K
    tokens); the stop ids are its end-of-sequence tokens, allowed wherever the grammar may end."""
    cached = model.__dict__.get("_ll_tokenizer")
    if cached is None:
        llg = _llg()
        cached = llg.LLTokenizer(model.tokenizer.backend.to_str(), n_vocab=model.config.vocab_size,
                                 eos_token=sorted(model.stop_token_ids()))
        model.__dict__["_ll_tokenizer"] = cached
    return cached


class Guide:
    """One request's matcher. ``mask()`` -> the int32 words for the next sample, or None for an
    unconstrained one; ``advance(token)`` after each sampled id that is output; ``done``: the
    constraint is complete and accepts nothing more."""

    def __init__(self, model: "Model", constraint: Constraint, thinking: bool):
        llg = _llg()
        lltok = ll_tokenizer(model)
        after_think = thinking if constraint.after_think is None else constraint.after_think
        grammar = constraint.grammar
        if after_think:  # newlines may follow </think> (Qwen's template writes "</think>\n\n")
            inner = dict(json.loads(grammar)["grammars"][0], name="answer")
            grammar = json.dumps({"grammars": [{"lark_grammar": "start: /\\n*/ @answer"}, inner]})
        self.matcher = llg.LLMatcher(lltok, grammar, log_level=0)
        if self.matcher.is_error():
            raise LilyError(f"{constraint.kind}: {_clean(self.matcher.get_error())}")
        self.words = (model.config.vocab_size + 31) // 32
        self._mask = np.full(self.words, -1, dtype=np.int32)
        self._fill = self.matcher.unsafe_compute_mask_ptr
        self.waiting = after_think  # for </think>
        self.done = False
        if after_think:
            ids = model.tokenizer.encode(THINK_END)
            if len(ids) != 1:
                raise LilyError(f"this tokenizer spells {THINK_END} with {len(ids)} tokens; a constraint after the "
                                f"reasoning needs it as one token (use enable_thinking=False)")
            self.think_end = ids[0]
            free = np.full(self.words, 0xFFFFFFFF, dtype=np.uint32)  # everything but the stop ids
            for i in model.stop_token_ids():
                free[i >> 5] &= ~np.uint32(1 << (i & 31))
            self._free = free.view(np.int32)
        self.kind = constraint.kind

    def mask(self) -> np.ndarray:
        """The allowed ids of the next sample, as int32 words (a view that the next call overwrites)."""
        if self.waiting:
            return self._free
        m = self._mask
        self._fill(m.ctypes.data, m.nbytes)
        if self.matcher.is_error():
            raise LilyError(f"{self.kind}: the constraint failed: {self.matcher.get_error()}")
        return m

    def advance(self, token: int) -> None:
        """Account for a sampled id that is output (stop ids are never passed here)."""
        if self.waiting:
            self.waiting = token != self.think_end
            return
        if not self.matcher.consume_token(token):
            raise LilyError(f"{self.kind}: token {token} was sampled outside the constraint "
                            f"({self.matcher.get_error()})")
        self.done = self.matcher.is_stopped()
