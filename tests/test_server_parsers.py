"""The server's pure parts, without a server: the <think> split, Qwen XML tool calls (whole and at
every split of a stream), argument typing, the prefix-snapshot LRU, request validation."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lily import Generation, SamplingParams, Tokenizer
from lily.checkpoint.tiny import tiny_checkpoint
from lily.server.cache import PrefixCache
from lily.server.errors import APIError
from lily.server.parse import parse_chat, parse_completion
from lily.server.prompt import chat_prompt, last_query_index
from lily.reasoning import ReasoningSplitter
from lily.server.schema import CHAT_REQUEST, COMPONENTS, openapi, validate
from lily.toolcalls import ToolCallParser, convert_value, parse_tool_calls

# --- reasoning ---------------------------------------------------------------------------------------

REASONING_CASES = [
    "plan\n</think>\n\nanswer",
    "\n\nplan a\n\nplan b\n\n</think>\n\n\nanswer\n\nmore\n",
    "no end tag, all reasoning\n",
    "</think>answer only",
    "a</thinking>b</think>c</think>d",
    "\n\n\n",
    "x\n</th",
    "",
]


def split_stream(text: str, cuts: list[int], thinking: bool) -> tuple[list[str], list[str]]:
    s = ReasoningSplitter(thinking)
    reasoning, content = [], []
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        r, c = s.feed(text[a:b])
        reasoning.append(r)
        content.append(c)
    r, c = s.flush()
    return reasoning + [r], content + [c]


@pytest.mark.parametrize("text", REASONING_CASES)
@pytest.mark.parametrize("thinking", [True, False])
def test_reasoning_split_matches_generation_at_every_cut(text, thinking):
    g = Generation(text=text, thinking=thinking)
    for cuts in [[i] for i in range(len(text) + 1)] + [list(range(1, len(text)))]:
        reasoning, content = split_stream(text, cuts, thinking)
        assert ("".join(reasoning), "".join(content)) == (g.reasoning, g.content), cuts
        if "<" not in g.reasoning:  # the tag never shows, not even in part
            assert not any("<" in piece for piece in reasoning), cuts


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b ", "\n", "</think>", "</th", "ink>", "<think>", "<", "/"]), max_size=12),
       st.lists(st.integers(0, 40), max_size=4), st.booleans())
def test_reasoning_split_random(pieces, cuts, thinking):
    text = "".join(pieces)
    cuts = sorted(c for c in set(cuts) if c <= len(text))
    g = Generation(text=text, thinking=thinking)
    reasoning, content = split_stream(text, cuts, thinking)
    assert ("".join(reasoning), "".join(content)) == (g.reasoning, g.content)


# --- tool calls --------------------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "scale": {"type": "number"}, "options": {"type": "object"}, "hours": {"type": "array"},
        "zip": {"type": "string"}, "maybe": {"type": ["integer", "null"]},
        "choice": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "write", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "text": {"type": "string"}}}}},
]

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
PARIS = ("get_weather", {"city": "Paris", "days": 3})

# (model output, expected content, expected [(name, arguments)])
TOOL_CASES = [
    (CALL, "", [PARIS]),
    ("Let me check the weather.\n\n" + CALL, "Let me check the weather.", [PARIS]),
    (CALL + "\n" + CALL.replace("Paris", "Oslo").replace("\n3\n", "\n-2\n"), "",
     [PARIS, ("get_weather", {"city": "Oslo", "days": -2})]),
    ("<tool_call>\n<function=now>\n</function>\n</tool_call>", "", [("now", {})]),
    ("<tool_call>\n<function=write>\n<parameter=path>\n/tmp/a.py\n</parameter>\n<parameter=text>\n"
     "def f(x):\n    return x < 2\n\n</parameter>\n</function>\n</tool_call>", "",
     [("write", {"path": "/tmp/a.py", "text": "def f(x):\n    return x < 2\n"})]),
    # Every typed parameter, and a string that looks like a number.
    ("<tool_call>\n<function=get_weather>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=scale>\n1.5\n"
     "</parameter>\n<parameter=options>\n{\"unit\": \"C\", \"n\": [1, 2]}\n</parameter>\n<parameter=hours>\n"
     "[6, 12]\n</parameter>\n<parameter=zip>\n01234\n</parameter>\n<parameter=maybe>\nnull\n</parameter>\n"
     "<parameter=choice>\n7\n</parameter>\n</function>\n</tool_call>", "",
     [("get_weather", {"metric": True, "scale": 1.5, "options": {"unit": "C", "n": [1, 2]}, "hours": [6, 12],
                       "zip": "01234", "maybe": None, "choice": 7})]),
    # </parameter> left out: the value ends at the next parameter or at </function>.
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</function>\n</tool_call>",
     "", [("get_weather", {"city": "Rome", "days": 2})]),
    # No newlines around the values.
    ("<tool_call><function=get_weather><parameter=city>Lima</parameter><parameter=days>4</parameter></function>"
     "</tool_call>", "", [("get_weather", {"city": "Lima", "days": 4})]),
    # Two functions in one <tool_call>.
    ("<tool_call>\n<function=now>\n</function>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n"
     "</function>\n</tool_call>", "", [("now", {}), ("get_weather", {"city": "Bern"})]),
    # Qwen3's JSON form.
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>', "", [PARIS]),
    # Text after the calls is content; a tool not among the tools keeps its values as text.
    (CALL + "\n\nDone.", "Done.", [PARIS]),
    ("<tool_call>\n<function=unknown_tool>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>", "",
     [("unknown_tool", {"n": "5"})]),
    # Not calls: left as content, unchanged.
    ("<tool_call>\nnot a call\n</tool_call>", "<tool_call>\nnot a call\n</tool_call>", []),
    ("a < b, and <tool_cal is not a tag; <tool_call", "a < b, and <tool_cal is not a tag; <tool_call", []),
    ("plain answer\n", "plain answer\n", []),
    # Cut short (max_tokens): the call is completed from what is there.
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", "", [("get_weather", {"city": "Par"})]),
    ("Checking.\n\n<tool_call>\n<func", "Checking.\n\n<tool_call>\n<func", []),
]


def stream_tools(text: str, cuts: list[int]) -> tuple[list[str], list]:
    parser = ToolCallParser(TOOLS)
    contents, deltas = [], []
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        c, d = parser.feed(text[a:b])
        contents.append(c)
        deltas += d
    c, d = parser.flush()
    return contents + [c], deltas + d


def assemble(deltas) -> list[tuple[str, dict]]:
    """OpenAI-style accumulation of streamed tool-call deltas."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id is not None and d.name is not None, "a call's first delta carries its id and name"
            calls[d.index] = {"name": d.name, "arguments": ""}
        else:
            assert d.id is None and d.name is None
        calls[d.index]["arguments"] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("text, content, calls", TOOL_CASES)
def test_tool_calls_whole_and_at_every_split(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, TOOLS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(calls) and all(c.id.startswith("call_") for c in got_calls)
    splits = [[i] for i in range(len(text) + 1)] + [[i, i + 3] for i in range(len(text) - 3)]
    for cuts in splits + [list(range(1, len(text)))]:
        contents, deltas = stream_tools(text, cuts)
        assert "".join(contents) == content, cuts
        assert assemble(deltas) == calls, cuts
        if "<" not in content:  # no piece of a tag ever reaches the content
            assert not any("<" in c for c in contents), cuts


def test_tool_call_name_streams_before_arguments():
    parser = ToolCallParser(TOOLS)
    _, d1 = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa")
    assert [(d.name, d.arguments) for d in d1] == [("get_weather", "")]
    _, d2 = parser.feed("ris\n</parameter>\n</function>\n</tool_call>")
    assert [(d.index, d.name, json.loads(d.arguments)) for d in d2] == [(0, None, {"city": "Paris"})]


def test_tool_calls_round_trip_through_the_chat_template():
    """What the template renders for an assistant's tool calls parses back to the same calls."""
    tok = Tokenizer.from_dir(tiny_checkpoint())
    args = [{"city": "Paris", "days": 3, "metric": False, "options": {"a": [1, "x"]}, "zip": "007"},
            {"city": "two\nlines\n"}]
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": json.dumps(a)}} for a in args]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Checking both.", "tool_calls": calls}]
    text = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=False)
    # What the model would have generated after the generation prompt '<|im_start|>assistant\n<think>\n'.
    turn = text.rsplit("<|im_start|>assistant\n<think>\n", 1)[1].split("<|im_end|>")[0]
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in turn
    got_content, got = parse_tool_calls(Generation(text=turn, thinking=True).content, TOOLS)
    assert got_content == "Checking both."
    assert [json.loads(c.arguments) for c in got] == args


@pytest.mark.parametrize("raw, schema, expected", [
    ("42", {"type": "integer"}, 42),
    (" 42\n", {"type": "integer"}, 42),
    ("4.0", {"type": "integer"}, 4),
    ("4.5", {"type": "integer"}, "4.5"),  # not an integer: kept as text, never an error
    ("forty", {"type": "integer"}, "forty"),
    ("1e3", {"type": "number"}, 1000.0),
    ("nan", {"type": "number"}, "nan"),
    ("1e999", {"type": "number"}, "1e999"),
    ("9" * 5000, {"type": "integer"}, "9" * 5000),
    ("True", {"type": "boolean"}, True),
    ("yes", {"type": "boolean"}, "yes"),
    ("{'a': 1, 'b': None}", {"type": "object"}, {"a": 1, "b": None}),
    ('{"a": NaN}', {"type": "object"}, '{"a": NaN}'),
    ("[1, 2", {"type": "array"}, "[1, 2"),
    ("(1, 2)", {"type": "array"}, [1, 2]),
    ("{1, 2}", {"type": "array"}, "{1, 2}"),
    ("null", {"type": ["string", "null"]}, None),
    ("12", {"type": ["string", "integer"]}, 12),
    ("12", {"type": "string"}, "12"),
    ("12", None, "12"),
    ("12", {}, "12"),
    ("3", {"enum": [1, 2, 3]}, 3),
    ("{}", {"properties": {}}, {}),
    ("x", {"type": 5}, "x"),
    ("x", {"anyOf": "bad"}, "x"),
    ("x", [1], "x"),
])
def test_argument_values_are_typed_by_the_schema(raw, schema, expected):
    assert convert_value(raw, schema) == expected


# --- the prefix cache --------------------------------------------------------------------------------

class FakeSnap:
    def __init__(self, tokens, nbytes):
        self.tokens, self.nbytes = tuple(tokens), nbytes


def test_prefix_cache_lru_under_a_byte_budget():
    cache = PrefixCache(budget_bytes=100)
    a, b, c = FakeSnap([1, 2], 40), FakeSnap([1, 2, 3, 4], 40), FakeSnap([9], 40)
    assert cache.add(a) and cache.add(b)
    assert cache.longest_prefix([1, 2, 3, 4, 5]) is b
    assert cache.longest_prefix([1, 2, 3, 4]) is a  # a proper prefix: one id must be left to run
    assert cache.longest_prefix([1, 2, 3, 4, 5], longer_than=4) is None
    assert cache.longest_prefix([7, 1, 2]) is None
    assert cache.add(c)  # over budget: the least recently used (b) goes
    assert [1, 2] in cache and [1, 2, 3, 4] not in cache and [9] in cache and cache.nbytes == 80
    assert not cache.add(FakeSnap([5], 101)) and len(cache) == 2  # larger than the budget: not kept
    cache.add(FakeSnap([1, 2], 10))  # same tokens: replaced
    assert cache.nbytes == 50 and cache.stats()["evictions"] == 1
    assert not PrefixCache(0).add(a)
    small = PrefixCache(10**6, max_entries=2)
    for i in range(5):
        small.add(FakeSnap([i], 1))
    assert len(small) == 2 and [4] in small


# --- request validation ------------------------------------------------------------------------------

DEFAULTS = SamplingParams(temperature=1.0, top_k=20, top_p=0.95)
USER = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body, param, words", [
    ({}, "messages", "is required"),
    ({"messages": []}, "messages", "must not be empty"),
    ({"messages": "Hi"}, "messages", "expected an array of ChatMessage objects"),
    ({"messages": [{"content": "Hi"}]}, "messages[0].role", "is required"),
    ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role", 'one of "system"'),
    ({"messages": [{"role": "user", "content": 42}]}, "messages[0].content", "a string or an array"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].image_url.url", "is required"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]},
     "messages[0].content[0].type", 'one of "text", "image_url", "image"'),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]},
     "messages[0].content[0]", "video and audio input are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text", "required"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "required for user messages"),
    ({"messages": USER, "temperature": "hot"}, "temperature", "expected a number or null"),
    ({"messages": USER, "temperature": -0.1}, "temperature", "between 0 and 2"),
    ({"messages": USER, "top_p": 0}, "top_p", "must be between 1e-06 and 1"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"messages": USER, "max_completion_tokens": 2.5}, "max_completion_tokens", "an integer"),
    ({"messages": USER, "n": 2}, "n", "must be 1"),
    ({"messages": USER, "seed": 2**64}, "seed", "between"),
    ({"messages": USER, "stop": ""}, "stop", "must not be empty"),
    ({"messages": USER, "stop": ["a"] * 17}, "stop", "at most 16"),
    ({"messages": USER, "top_logprobs": 21, "logprobs": True}, "top_logprobs", "between 0 and 20"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"messages": USER, "logit_bias": {"1": 5}}, "logit_bias", "not supported"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "not": {"required": ["a"]}}}}}, "response_format.json_schema.schema",
     'unsupported JSON schema keywords: ["not"]'),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "#/$defs/missing"}}}}, "response_format.json_schema.schema", "does not exist"),
    ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema", "is required"),
    ({"messages": USER, "response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "give one of them"),
    ({"messages": USER, "temprature": 0.5}, "temprature", "unrecognized request argument"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0].function", "is required"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "not among the tools"),
    ({"messages": USER, "chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking",
     "boolean"),
    ({"messages": USER, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages", "may not set"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
    ({"messages": USER, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "a boolean"),
])
def test_bad_chat_requests_name_the_field(body, param, words):
    with pytest.raises(APIError) as e:
        parse_chat(body, DEFAULTS)
    assert e.value.status == 400 and e.value.param == param
    assert words in e.value.message and param in e.value.message


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1], [2]]}, "prompt"),
    ({"prompt": [-1]}, "prompt[0]"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
])
def test_bad_completion_requests_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        parse_completion(body, DEFAULTS)
    assert e.value.status == 400 and e.value.param == param


def test_chat_requests_map_onto_lily():
    body = {"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be "},
                                                                        {"type": "text", "text": "brief."}]},
                                       {"role": "user", "content": "Hi"},
                                       {"role": "assistant", "content": None, "reasoning": "r",
                                        "tool_calls": [{"id": "c1", "type": "function",
                                                        "function": {"name": "now", "arguments": ""}}]},
                                       {"role": "tool", "tool_call_id": "c1", "content": "12:00"}],
            "max_tokens": 5, "max_completion_tokens": 7, "seed": -1, "top_k": -1, "stop": "END", "logprobs": True,
            "top_logprobs": 3, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}},
            "stream": True, "stream_options": {"include_usage": True}, "user": "u", "parallel_tool_calls": False}
    req = parse_chat(body, DEFAULTS)
    p = req.params
    assert (p.max_tokens, p.seed, p.top_k, p.stop, p.logprobs, p.temperature, p.top_p) == \
           (7, 2**64 - 1, 0, ("END",), 3, 1.0, 0.95)
    assert req.max_tokens_field == "max_completion_tokens" and req.stream and req.include_usage
    assert req.messages[0] == {"role": "system", "content": "Be brief."}
    assert req.messages[2]["reasoning_content"] == "r"
    assert req.messages[2]["tool_calls"][0]["function"]["arguments"] == {}
    assert [t["function"]["name"] for t in req.tools] == ["now"] and req.parse_tools
    none = parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": "none"}, DEFAULTS)
    assert none.tools is None and not none.parse_tools
    assert parse_completion({"prompt": [[5, 6]]}, DEFAULTS).prompt == [5, 6]
    assert parse_completion({"prompt": "x"}, DEFAULTS).params.max_tokens == 16


def test_snapshot_boundaries_survive_re_rendering():
    tok = Tokenizer.from_dir(tiny_checkpoint())
    turn1 = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}]
    p1 = chat_prompt(tok, turn1, None, {})
    assert p1.thinking and p1.boundaries == (len(tok.encode_chat(turn1, add_generation_prompt=False)),)
    # The next turn re-renders the answer without its reasoning, after the boundary.
    turn2 = turn1 + [{"role": "assistant", "content": "A1", "reasoning_content": "R1"},
                     {"role": "user", "content": "Q2"}]
    p2 = chat_prompt(tok, turn2, None, {})
    assert p2.ids[:p1.boundaries[0]] == p1.ids[:p1.boundaries[0]] and "R1" not in tok.decode(p2.ids)
    # An agent turn: tool results after the last query; the query's end is a second boundary, the
    # one a new user message keeps (the template then drops the tool turn's reasoning).
    agent = turn1 + [{"role": "assistant", "content": "", "reasoning_content": "think",
                      "tool_calls": [{"function": {"name": "now", "arguments": {}}}]},
                     {"role": "tool", "content": "12:00"}]
    assert last_query_index(agent) == 1
    pa = chat_prompt(tok, agent, TOOLS, {})
    query_end = len(tok.encode_chat(turn1, tools=TOOLS, add_generation_prompt=False))
    assert pa.boundaries == (query_end, len(tok.encode_chat(agent, tools=TOOLS, add_generation_prompt=False)))
    later = chat_prompt(tok, agent + [{"role": "assistant", "content": "It is noon."},
                                      {"role": "user", "content": "Thanks"}], TOOLS, {})
    assert later.ids[:query_end] == pa.ids[:query_end] and later.ids[:pa.boundaries[1]] != pa.ids[:pa.boundaries[1]]


def test_openapi_document_describes_the_schemas():
    doc = openapi()
    assert set(doc["paths"]) >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"}
    assert doc["components"]["schemas"]["ChatCompletionRequest"] is CHAT_REQUEST
    json.dumps(doc)  # serialisable
    validate({"messages": USER, "temperature": 0, "tools": TOOLS, "tool_choice": "auto"},
             COMPONENTS["ChatCompletionRequest"])
