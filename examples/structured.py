"""Structured output: a JSON schema (dict or pydantic model), a regex, a choice, a Lark grammar and a
forced tool call, with the Python API. With the tiny built-in model (random weights) the values are
nonsense, but every completed answer parses.

    python examples/structured.py [CHECKPOINT]
"""
import json
import sys

import pydantic

import lily
from lily.checkpoint.tiny import tiny_checkpoint

path = sys.argv[1] if len(sys.argv) > 1 else tiny_checkpoint()
model = lily.Model.load(path)
ask = [{"role": "user", "content": "Describe Paris as JSON with its name and population."}]


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0)


# With thinking on, the reasoning is free and the JSON starts after </think>; no thinking here.
r = model.chat(ask, json_schema=City, max_tokens=64, seed=1, enable_thinking=False)
if r.finish_reason == "stop":                      # "length": max_tokens cut the object
    print(City.model_validate_json(r.content))

schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
r = model.generate("JSON:", json_schema=schema, temperature=0.8, seed=2, max_tokens=32)
print(r.text, "->", json.loads(r.text) if r.finish_reason == "stop" else "(cut by max_tokens)")

print(model.generate("Date:", regex=r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", max_tokens=16).text)
print(model.chat(ask, choice=["yes", "no", "maybe"], enable_thinking=False).content)
print(model.generate("List:", grammar='start: "[" word ("," word)* "]"\nword: /[a-z]{1,6}/', max_tokens=24).text)

tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}]
r = model.chat([{"role": "user", "content": "Weather in Oslo?"}], tools=tools, enable_thinking=False,
               constraint=lily.constraints.tool_call(tools, "get_weather"), max_tokens=64)
print(r.finish_reason, r.tool_calls)

try:
    model.generate("x", json_schema={"type": "object", "not": {"required": ["a"]}})
except lily.LilyError as e:
    print("refused:", e)
