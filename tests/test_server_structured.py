"""Structured output through lily serve (docs/server.md) on the tiny random model: response_format
json_object / json_schema on chat and completions, tool_choice required / named forcing a call in
Qwen's XML format (parsed into tool_calls, streaming too), and bad schemas answered 400 while the
server keeps serving."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

import lily
from lily.checkpoint.tiny import tiny_checkpoint
from lily.server import Server

KEY, NAME = "test-key", "tiny"
USER = [{"role": "user", "content": "Answer in JSON."}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def client():
    model = lily.Model.load(tiny_checkpoint(), device="cpu", max_context=512)
    with Server(model, port=0, api_key=KEY, model_name=NAME) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_on_chat_stream_equals_non_stream(client):
    for seed in range(3):
        kw = dict(model=NAME, messages=USER, seed=seed, max_tokens=24, response_format=json_format(SCHEMA),
                  extra_body=NO_THINK)
        r = client.chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        chunks = list(client.chat.completions.create(stream=True, **kw))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_on_completions_and_a_cut_says_length(client):
    r = client.completions.create(model=NAME, prompt="JSON:", max_tokens=40, seed=1,
                                  extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    r = client.completions.create(model=NAME, prompt="JSON:", max_tokens=2, seed=1,
                                  extra_body={"response_format": json_format(SCHEMA)})
    assert r.choices[0].finish_reason == "length" and r.choices[0].text.startswith("{")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_forces_a_typed_call(client, tool_choice):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER}
    for seed in (7,):  # (tests/test_structured.py runs more seeds through the Python API)
        kw = dict(model=NAME, messages=[{"role": "user", "content": "Weather?"}], tools=WEATHER,
                  tool_choice=tool_choice, seed=seed, max_tokens=64, extra_body=NO_THINK)
        r = client.chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and not choice.message.content
        for call in choice.message.tool_calls:
            assert tool_choice == "required" or call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        chunks = list(client.chat.completions.create(stream=True, **kw))
        calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        assert [c.function.name for c in calls if c.function.name] == \
               [c.function.name for c in choice.message.tool_calls]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": json_format({"type": "object", "not": {}})}, "response_format.json_schema.schema",
     "unsupported JSON schema keywords"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "is required"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "not": {"const": 1}}}}}}],
      "tool_choice": "required"}, "tools", "unsupported JSON schema keywords"),
])
def test_bad_schemas_are_400_and_the_server_keeps_serving(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=USER, max_tokens=2, extra_body=extra)
    err = e.value.body
    assert err["param"] == param and words in err["message"]
    r = client.chat.completions.create(model=NAME, messages=USER, max_tokens=2)
    assert r.choices[0].finish_reason == "length"
