"""The Qwen3.6 chat template as lily renders it: what docs/model.md section 6 shows, and what transformers
renders from the same template."""
from __future__ import annotations

import json

import pytest

from lily import LilyError, Tokenizer
from lily.checkpoint.tiny import tiny_checkpoint

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city (<= 10 days)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint())


def user(text):
    return {"role": "user", "content": text}


def test_generation_prompt_thinking_on_by_default(tok):
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, user("Hi")])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n")
    # Spec: the thinking-on prompt ends 248045, 74455 ("assistant"), 198, 248068, 198.
    assert tok.encode(text)[-5:] == [248045, 74455, 198, 248068, 198]
    assert tok.apply_chat_template([user("Hi")], enable_thinking=True) == tok.apply_chat_template([user("Hi")])


def test_generation_prompt_thinking_off(tok):
    text = tok.apply_chat_template([user("Hi")], enable_thinking=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.apply_chat_template([user("Hi")], add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_tools_system_block(tok):
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, user("Weather?")], tools=TOOLS)
    head = ("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
            + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>\n\nIf you choose to call a function")
    assert text.startswith(head)
    # Hugging Face's tojson does not HTML-escape ("<=" stays as is) and keeps key order.
    assert "(<= 10 days)" in text
    assert "</IMPORTANT>\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n" in text


def tool_conversation(arguments):
    return [user("Weather in Paris?"),
            {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "content": "sunny"},
            {"role": "tool", "content": "22 C"}]


def test_tool_call_and_tool_response_turns(tok):
    text = tok.apply_chat_template(tool_conversation({"city": "Paris", "days": 3}), tools=TOOLS)
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22 C\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n")
    # OpenAI clients send arguments as JSON text; it renders the same as a dict.
    as_json = tok.apply_chat_template(tool_conversation('{"city": "Paris", "days": 3}'), tools=TOOLS)
    assert as_json == text


def history(reasoning_in_content: bool):
    first = ({"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"} if reasoning_in_content
             else {"role": "assistant", "content": "4", "reasoning_content": "add them"})
    return [user("2+2?"), first, user("times 3?")]


@pytest.mark.parametrize("reasoning_in_content", [False, True])
def test_history_reasoning_stripped_or_preserved(tok, reasoning_in_content):
    msgs = history(reasoning_in_content)
    stripped = tok.apply_chat_template(msgs)
    assert stripped == ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
                        "<|im_start|>user\ntimes 3?<|im_end|>\n<|im_start|>assistant\n<think>\n")
    kept = tok.apply_chat_template(msgs, preserve_thinking=True)
    assert kept == ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4"
                    "<|im_end|>\n<|im_start|>user\ntimes 3?<|im_end|>\n<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([user("a"), {"role": "system", "content": "late"}], "System message must be at the beginning"),
    ([{"content": "x"}], r"messages\[0\] needs a 'role'"),
    ([user("a"), {"role": "robot", "content": "x"}], "Unexpected message role"),
    ([{"role": "assistant", "content": "only me"}], "No user query found"),
    ([user("a"), {"role": "assistant", "content": "",
                  "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}], "not valid JSON"),
    (["not a dict"], r"messages\[0\] must be a dict"),
])
def test_bad_conversations_are_clear_errors(tok, messages, match):
    with pytest.raises(LilyError, match=match):
        tok.apply_chat_template(messages)


def test_input_is_not_modified(tok):
    msgs = tool_conversation('{"city": "Paris"}')
    before = json.dumps(msgs)
    tok.apply_chat_template(msgs)
    assert json.dumps(msgs) == before


def test_hugging_face_helpers(tmp_path):
    (tmp_path / "tokenizer.json").symlink_to(tiny_checkpoint() / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% if loop.last %}{% break %}"
        "{% endif %}{% endfor %}|{{ strftime_now('%Y') | length }}|{{ {'a': '<b>'} | tojson }}"
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}")
    t = Tokenizer.from_dir(tmp_path)
    assert t.apply_chat_template([user("x")]) == 'x|4|{"a": "<b>"}'
    with pytest.raises(LilyError, match="chat template: one message only"):
        t.apply_chat_template([user("x"), user("y")])


def test_sandbox_blocks_attribute_escapes(tmp_path):
    (tmp_path / "tokenizer.json").symlink_to(tiny_checkpoint() / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(LilyError, match="chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([user("x")])


def test_matches_transformers_rendering(tok):
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    conversations = [
        [{"role": "system", "content": "sys"}] + tool_conversation({"city": "Paris", "days": 3})
        + [{"role": "assistant", "content": "It is sunny."}, user("And tomorrow?")],
        history(True),
        [user([{"type": "text", "text": "multi"}, {"type": "text", "text": "part"}])],
    ]
    for msgs in conversations:
        for kwargs in ({}, {"enable_thinking": False}, {"preserve_thinking": True}):
            ours = tok.apply_chat_template(msgs, tools=TOOLS, **kwargs)
            theirs = chat_utils.render_jinja_template(conversations=[msgs], tools=TOOLS,
                                                      chat_template=tok.chat_template,
                                                      add_generation_prompt=True, **kwargs)[0][0]
            assert ours == theirs
