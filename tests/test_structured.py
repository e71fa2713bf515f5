"""Structured output (lily.constraints, docs/generation.md) on the tiny random model: whatever the
seed and the schema, a completed output (finish_reason 'stop') parses and validates; a cut one says
'length'; streams equal blocking results; bad schemas and grammars are errors that name the problem.
The random weights make the model a fuzzer of the constraint: it would write garbage without one."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lily
from lily import LilyError, constraints
from lily.checkpoint.tiny import tiny_checkpoint
from checks import token_mask

SETTINGS = dict(max_examples=6, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
NO_THINK = dict(enable_thinking=False)
USER = [{"role": "user", "content": "Answer."}]


@pytest.fixture(scope="module")
def model() -> lily.Model:
    return lily.Model.load(tiny_checkpoint(), device="cpu", max_context=512)


# --- random schemas ----------------------------------------------------------------------------------

LEAVES = st.sampled_from([
    {"type": "integer"}, {"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}, {"type": "null"},
    {"type": "number"}, {"type": "string", "maxLength": 3}, {"enum": ["red", "green", 7]},
    {"type": "string", "enum": ["a", "b"]}, {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
    {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
])


@st.composite
def schemas(draw) -> dict:
    """An object schema of 1-3 properties (leaves or one nested object), some of them required."""
    names = draw(st.lists(st.sampled_from(["a", "b", "c", "name"]), min_size=1, max_size=3, unique=True))
    props = {}
    for n in names:
        leaf = draw(LEAVES)
        props[n] = {"type": "object", "properties": {"x": leaf}, "required": ["x"],
                    "additionalProperties": False} if draw(st.booleans()) and n == "c" else leaf
    required = [n for n in names if draw(st.booleans())]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@settings(**SETTINGS)
@given(schema=schemas(), seed=st.integers(0, 2**32))
def test_completed_json_validates_against_random_schemas(model, schema, seed):
    r = model.generate("JSON:", json_schema=schema, temperature=1.0, seed=seed, max_tokens=24)
    assert r.finish_reason in ("stop", "length")
    if r.finish_reason == "stop":
        jsonschema.validate(json.loads(r.text), schema)
        assert r.stop_reason is None or r.stop_reason in model.stop_token_ids()
    else:
        assert len(r.token_ids) == 24


def test_most_outputs_complete_and_the_stream_equals_blocking(model):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9,
                                                                                "minimum": 0}},
              "required": ["ok", "n"], "additionalProperties": False}
    done = 0
    for seed in range(4):
        r = model.generate("JSON:", json_schema=schema, temperature=1.0, seed=seed, max_tokens=20)
        if r.finish_reason == "stop":
            done += 1
            value = json.loads(r.text)
            jsonschema.validate(value, schema)
            assert set(value) == {"ok", "n"}
    assert done == 4  # at most 12 tokens: {"ok":false,"n":9}
    events = list(model.generate("JSON:", json_schema=schema, temperature=1.0, seed=3, max_tokens=20, stream=True))
    blocking = model.generate("JSON:", json_schema=schema, temperature=1.0, seed=3, max_tokens=20)
    assert "".join(e.text for e in events) == blocking.text
    assert [e.token_id for e in events] == blocking.token_ids and events[-1].finish_reason == "stop"


def test_a_pydantic_model_class_is_a_schema(model):
    class Point(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false
        x: int = pydantic.Field(ge=0, le=99)
        y: bool

    r = model.generate("Point:", json_schema=Point, temperature=0.7, seed=1, max_tokens=30)
    assert r.finish_reason == "stop"
    assert isinstance(Point.model_validate_json(r.text), Point)


def test_json_object_and_max_tokens_mid_structure(model):
    r = model.generate("JSON:", constraint=constraints.json_object(), seed=2, temperature=1.0, max_tokens=3)
    assert r.finish_reason == "length" and len(r.token_ids) == 3 and r.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):  # 'length' means incomplete: a complete object says 'stop'
        json.loads(r.text)


# --- regex, choice, grammar --------------------------------------------------------------------------

@settings(**SETTINGS)
@given(pattern=st.sampled_from([r"[0-9]{3}-[a-z]{2}", r"(yes|no|maybe)", r"[A-Z][a-z]{0,3}!", r"-?\d{1,4}(\.\d)?",
                                r"a+b?", r"(ab|cd){1,3}"]),
       seed=st.integers(0, 2**32))
def test_completed_text_matches_the_regex(model, pattern, seed):
    r = model.generate("Text:", regex=pattern, temperature=1.0, seed=seed, max_tokens=16)
    if r.finish_reason == "stop":
        assert re.fullmatch(pattern, r.text), (pattern, r.text)
    else:
        assert r.finish_reason == "length" and len(r.token_ids) == 16


def test_choice_and_grammar(model):
    options = ["alpha", "beta gamma", "delta"]
    for seed in range(3):
        r = model.chat(USER, choice=options, seed=seed, max_tokens=10, **NO_THINK)
        assert r.finish_reason == "stop" and r.content in options
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/\n'
    r = model.generate("Tuple:", grammar=lark, temperature=1.0, seed=4, max_tokens=24)
    if r.finish_reason == "stop":
        assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", r.text), r.text
    # A constraint that completes ends generation on its last token ('stop', no stop token needed).
    r = model.generate("x", choice=["done"], max_tokens=10)
    assert (r.text, r.finish_reason, r.stop_reason) == ("done", "stop", None)


# --- tool calls --------------------------------------------------------------------------------------

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                     "unit": {"type": "string", "enum": ["c", "f"]},
                                     "hourly": {"type": "boolean"}},
    "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER}


@settings(**SETTINGS)
@given(seed=st.integers(0, 2**32), name=st.sampled_from([None, "get_weather"]))
def test_a_forced_tool_call_is_always_a_valid_typed_call(model, seed, name):
    r = model.chat([{"role": "user", "content": "Weather in Oslo?"}], tools=WEATHER, seed=seed, max_tokens=64,
                   constraint=constraints.tool_call(WEATHER, name), **NO_THINK)
    assert r.finish_reason == "stop", r.text
    assert r.tool_calls and r.message["content"] == ""
    for call in r.tool_calls:
        fn = call["function"]
        assert name is None or fn["name"] == name
        jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])


# --- thinking: the reasoning is free, the constraint starts after </think> ---------------------------

def test_the_reasoning_is_unconstrained(model):
    free = model.chat(USER, temperature=0, max_tokens=12, ignore_eos=True)
    constrained = model.chat(USER, temperature=0, max_tokens=12, json_schema={"type": "object"})
    assert free.thinking and constrained.thinking
    assert "</think>" not in free.text  # (random weights: the reasoning does not end in 12 tokens)
    assert constrained.token_ids == free.token_ids and constrained.finish_reason == "length"


def test_the_guide_waits_for_think_end_then_allows_newlines(model):
    tok = model.tokenizer
    guide = constraints.Guide(model, constraints.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                                                "required": ["a"]}), thinking=True)

    def allowed(mask):
        return np.unpackbits(mask.view(np.uint8), bitorder="little")[:model.config.vocab_size].astype(bool)

    free = allowed(guide.mask())
    stops = sorted(model.stop_token_ids())
    assert not free[stops].any() and free.sum() == model.config.vocab_size - len(stops)
    for t in tok.encode("I think so. {") + tok.encode("</think>"):
        guide.advance(t)
    assert not guide.waiting
    after = allowed(guide.mask())
    assert after[tok.encode("\n\n")[0]] and after[tok.encode("{")[0]] and not after[tok.encode("I")[0]]
    for t in tok.encode('\n\n{"a":12}'):
        assert allowed(guide.mask())[t]
        guide.advance(t)
    assert guide.done


# --- errors ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    (dict(json_schema={"type": "object", "not": {}}), 'unsupported JSON schema keywords: ["not"]'),
    (dict(json_schema={"$ref": "#/$defs/nope"}), "does not exist"),
    (dict(json_schema="{not json"), "json_schema: not valid JSON"),
    (dict(json_schema=[1, 2]), "expected a JSON schema object"),
    (dict(json_schema=False), "the schema false accepts no value"),
    (dict(regex="[0-"), "unclosed character class"),
    (dict(regex=""), "non-empty regular expression"),
    (dict(grammar="start: missing_rule"), "missing_rule"),
    (dict(choice=[]), "non-empty list of strings"),
    (dict(choice="yes"), "non-empty list of strings"),
    (dict(choice=["ok", 3]), "every choice must be a non-empty string"),
    (dict(regex="a", choice=["a"]), "give at most one of"),
    (dict(constraint="json"), "constraint must be a lily.Constraint"),
])
def test_bad_constraints_are_errors_that_name_the_problem(model, kwargs, words):
    with pytest.raises(LilyError, match=re.escape(words)):
        model.generate("x", max_tokens=2, **kwargs)
    assert model.generate("x", max_tokens=1).finish_reason == "length"  # the model still works


def test_bad_tool_definitions_are_errors(model):
    with pytest.raises(LilyError, match="needs tools"):
        constraints.tool_call([])
    with pytest.raises(LilyError, match="'nope' is not among the tools"):
        constraints.tool_call(WEATHER, "nope")
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}}}]
    with pytest.raises(LilyError, match=r"function 'f', parameter 'n': unsupported JSON schema keywords"):
        constraints.tool_call(bad)


# --- the core's masked sampling ----------------------------------------------------------------------

def test_split_step_equals_decode_sample(model):
    """decode_launch + sample_next (the host computes the next mask between them) = decode_sample."""
    ids = np.asarray(model.tokenizer.encode("Hello there"), np.int32)
    out = []
    for split in (False, True):
        core = model.new_session()._core
        core.set_sampler(temperature=1.0, top_k=20, top_p=0.95, seed=3, prompt_ids=ids)
        toks = [core.prefill_sample(ids)]
        for _ in range(6):
            if split:
                core.decode_launch(-1)
                toks.append(core.sample_next(None))
            else:
                toks.append(core.decode_sample(-1))
        out.append(toks)
    assert out[0] == out[1]
    with pytest.raises(LilyError, match="sample_next needs a decode_launch first"):
        core.sample_next(None)


def test_masked_decode_samples_only_allowed_ids(model):
    V = model.config.vocab_size
    allowed, mask = token_mask(V, [17, 4242, 100000, V - 1])
    core = model.new_session()._core
    ids = np.asarray(model.tokenizer.encode("Hi"), np.int32)
    core.set_sampler(temperature=1.5, seed=1, prompt_ids=ids)
    toks = [core.prefill_sample(ids, mask)] + [core.decode_sample(-1, mask) for _ in range(8)]
    assert all(allowed[t] for t in toks) and len(set(toks)) > 1
    with pytest.raises(LilyError, match=f"token mask: expected {(V + 31) // 32} int32 words"):
        core.decode_sample(-1, mask[:-1])
