"""Structured output on the CUDA backend (tiny built-in checkpoint): the token mask applied on the
device keeps every completed output valid, forced tool calls are typed calls, and the split step
(decode_launch + sample_next, which lets the host compute the next mask while the GPU runs) samples
exactly what decode_sample does."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

import lily
from lily import _core, constraints
from checks import token_mask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _core.backend_available("cuda"), reason="no CUDA backend on this machine"),
]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["ok", "n"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"]}}}]


@pytest.fixture(scope="module")
def model() -> lily.Model:
    return lily.load("tiny", "cuda", max_context=512)


def test_split_step_equals_decode_sample(model):
    ids = np.asarray(model.tokenizer.encode("Hello there"), np.int32)
    a, b = model.new_session()._core, model.new_session()._core
    out = []
    for core in (a, b):
        core.set_sampler(temperature=1.0, top_k=20, top_p=0.95, seed=3, prompt_ids=ids)
        toks = [core.prefill_sample(ids)]
        for _ in range(12):
            if core is a:
                toks.append(core.decode_sample(-1))
            else:
                core.decode_launch(-1)
                toks.append(core.sample_next(None))
        out.append(toks)
    assert out[0] == out[1]


def test_masked_decode_samples_only_allowed_ids(model):
    V = model.config.vocab_size
    allowed, mask = token_mask(V, [17, 4242, 100000, V - 1])
    core = model.new_session()._core
    ids = np.asarray(model.tokenizer.encode("Hi"), np.int32)
    core.set_sampler(temperature=1.5, seed=1, prompt_ids=ids)
    toks = [core.prefill_sample(ids, mask)] + [core.decode_sample(-1, mask) for _ in range(30)]
    assert all(allowed[t] for t in toks) and len(set(toks)) > 1


def test_completed_json_is_valid_on_cuda(model):
    done = 0
    for seed in range(8):
        r = model.generate("JSON:", json_schema=SCHEMA, temperature=1.0, seed=seed, max_tokens=40)
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), SCHEMA)
            done += 1
    assert done >= 6
    stream = list(model.generate("JSON:", json_schema=SCHEMA, temperature=1.0, seed=2, max_tokens=40, stream=True))
    blocking = model.generate("JSON:", json_schema=SCHEMA, temperature=1.0, seed=2, max_tokens=40)
    assert "".join(e.text for e in stream) == blocking.text


def test_forced_tool_call_on_cuda(model):
    for seed in range(4):
        r = model.chat([{"role": "user", "content": "Weather?"}], tools=TOOLS, seed=seed, max_tokens=64,
                       enable_thinking=False, constraint=constraints.tool_call(TOOLS, "get_weather"))
        assert r.finish_reason == "stop" and len(r.tool_calls) == 1
        jsonschema.validate(json.loads(r.tool_calls[0]["function"]["arguments"]),
                            TOOLS[0]["function"]["parameters"])
