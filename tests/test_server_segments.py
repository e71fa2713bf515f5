"""SegmentEncoder (issue 15, item 8): chat renderings encoded in pieces cut at special tokens, with
the pieces' ids cached, must equal the one-shot encoding token for token."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from lily import Tokenizer
from lily.checkpoint.tiny import tiny_checkpoint
from lily.errors import LilyError
from lily.server.prompt import PromptTooLong, SegmentEncoder, chat_prompt, separators

TOK = Tokenizer.from_dir(tiny_checkpoint())
SHARED = SegmentEncoder(TOK)  # one cache across examples: later examples hit pieces of earlier ones
TINY = SegmentEncoder(TOK, budget_bytes=2000)  # evicts all the time

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]

# Text made of pieces that stress the cut: special and other added tokens whole and broken, the
# template's own markup, whitespace runs (merged by the BPE), combining marks (NFC composes across
# what would be a cut), images as the template renders them, emoji, CJK, right-to-left.
FRAGMENTS = ["<|im_start|>", "<|im_end|>", "<|im_start|>user\n", "<|im_", "|>", "<|", "<think>", "</think>",
             "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<function=now>",
             "<parameter=city>", "<|vision_start|><|image_pad|><|vision_end|>", "Picture 1: ", "<|endoftext|>",
             "<|tts_pad|>", "<tts_text_bos_single>", "<tts_text_bos>", "\n", "\n\n", " ", "   ", "\t", "\r\n",
             "e", "\u0301", "\u00e9", "n\u0303", "Hello", " world", "'s", "123", "4567", "é€😀", "👩‍👩‍👧",
             "漢字かな", "مرحبا", "\u200b", "\ufeff", "\x00", "ﬁ", "Ａ", "’", "{\"a\": [1, 2]}"]
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=12)), max_size=14).map("".join)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(texts)
def test_pieces_encode_like_the_whole_text(text):
    expected = TOK.encode(text)
    assert SHARED.encode(text) == expected
    assert SHARED.encode(text) == expected  # now from the cache
    assert TINY.encode(text) == expected


def message(draw, role: str) -> dict:
    content = draw(texts)
    if role == "assistant":
        m = {"role": role, "content": draw(st.sampled_from([content, None, f"<think>\n{content}\n</think>\n\nok"]))}
        if draw(st.booleans()):
            m["reasoning_content"] = draw(texts)
        if draw(st.booleans()):
            m["tool_calls"] = [{"type": "function", "function": {"name": draw(st.sampled_from(["now", "get_weather"])),
                                                                 "arguments": draw(st.sampled_from(
                                                                     ["{}", '{"city": "Zürich", "days": 3}', {"city": content}]))}}
                               for _ in range(draw(st.integers(1, 2)))]
        return m
    if role == "tool":
        return {"role": "tool", "tool_call_id": "c1", "content": content}
    if role == "user" and draw(st.booleans()):  # content as text parts
        return {"role": "user", "content": [{"type": "text", "text": content}, {"type": "text", "text": draw(texts)}]}
    return {"role": role, "content": content}


@st.composite
def conversations(draw):
    msgs = [message(draw, "system")] if draw(st.booleans()) else []
    msgs.append(message(draw, "user"))
    for role in draw(st.lists(st.sampled_from(["user", "assistant", "tool"]), max_size=6)):
        msgs.append(message(draw, role))
    kwargs = draw(st.sampled_from([{}, {"enable_thinking": False}, {"preserve_thinking": True}]))
    return msgs, draw(st.sampled_from([None, TOOLS])), kwargs


@settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(conversations())
def test_chat_prompt_with_the_encoder_equals_the_one_shot_encoding(conv):
    msgs, tools, kwargs = conv
    try:
        want = chat_prompt(TOK, msgs, tools, kwargs)
    except LilyError as e:  # the template refuses it (e.g. no user query): the same error either way
        with pytest.raises(LilyError, match=str(e)[:40].replace("(", ".").replace(")", ".").replace("[", ".")):
            chat_prompt(TOK, msgs, tools, kwargs, encoder=SHARED)
        return
    for encoder in (SHARED, SHARED, TINY):
        got = chat_prompt(TOK, msgs, tools, kwargs, encoder=encoder)
        assert (got.ids, got.boundaries, got.thinking) == (want.ids, want.boundaries, want.thinking)
    assert want.ids == TOK.encode(TOK.apply_chat_template(msgs, tools=tools, **kwargs))


def test_a_follow_up_encodes_only_its_new_messages(monkeypatch):
    enc = SegmentEncoder(TOK)
    history = [{"role": "user", "content": "Read this. " + "lorem ipsum dolor " * 500}]
    first = chat_prompt(TOK, history, None, {}, 16384, enc)
    encoded: list[str] = []
    batch = TOK.backend.encode_batch

    def spy(pieces, **kw):
        encoded.extend(pieces)
        return batch(pieces, **kw)

    monkeypatch.setattr(TOK.backend, "encode_batch", spy, raising=False)
    follow = history + [{"role": "assistant", "content": "Understood."}, {"role": "user", "content": "Summarize."}]
    p = chat_prompt(TOK, follow, None, {}, 16384, enc)
    monkeypatch.undo()
    assert encoded == ["assistant\nUnderstood.", "user\nSummarize."]  # not the 1,500-word history
    assert p.ids == chat_prompt(TOK, follow, None, {}).ids and p.ids[:first.boundaries[0]] == first.ids[:first.boundaries[0]]
    assert enc.hits > 0 and enc.stats()["entries"] == len(enc)


def test_the_cache_stays_within_its_budget():
    enc = SegmentEncoder(TOK, budget_bytes=20_000)
    for i in range(50):
        text = f"<|im_start|>user\nmessage {i} " + "word " * (i * 40) + "<|im_end|>\n"
        assert enc.encode(text) == TOK.encode(text)
        assert enc.nbytes <= 20_000
    assert 0 < len(enc) < 50  # the large pieces evicted the old ones (or were not kept)
    big = "<|im_start|>" + "x y " * 20_000
    assert enc.encode(big) == TOK.encode(big) and ("x y " * 20_000) not in enc._entries
    off = SegmentEncoder(TOK, budget_bytes=0)
    assert off.encode(big) == TOK.encode(big) and len(off) == 0 and off.nbytes == 0
    enc.clear()
    assert len(enc) == 0 and enc.nbytes == 0
    with pytest.raises(ValueError):
        SegmentEncoder(TOK, budget_bytes=-1)


def test_a_long_prompt_is_still_refused_before_it_is_encoded_in_full():
    msgs = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(PromptTooLong):
        chat_prompt(TOK, msgs, None, {}, 100, SegmentEncoder(TOK))


def toy(*added: AddedToken) -> Tokenizer:
    backend = Backend(models.BPE(vocab={c: i for i, c in enumerate("abc<>|xyz ")}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    for t in added:
        (backend.add_special_tokens if t.special else backend.add_tokens)([t])
    return Tokenizer(backend)


def test_only_safe_special_tokens_are_cut_at():
    plain = toy(AddedToken("<|a|>", special=True, normalized=False), AddedToken("<b>", special=False, normalized=False))
    assert separators(plain) == {"<|a|>": plain.token_to_id("<|a|>")}  # <b> is not special: not cut at
    # Another added token contains or overlaps it: an occurrence may not be a split point.
    assert separators(toy(AddedToken("<|a|>", special=True, normalized=False),
                          AddedToken("x<|a", special=True, normalized=False))) == {}
    assert separators(toy(AddedToken("<|a|>", special=True, normalized=False),
                          AddedToken("<|a|>z", special=True, normalized=False))) == {"<|a|>z": 11}
    assert separators(toy(AddedToken("<a>", special=True, normalized=False))) == {"<a>": 10}
    assert separators(toy(AddedToken("|a|", special=True, normalized=False))) == {}  # "|a|a|" overlaps itself
    # Whitespace stripping moves the cut: no cuts at all, the encoder encodes in one shot.
    strip = toy(AddedToken("<|a|>", special=True, normalized=False), AddedToken("<s>", special=True, lstrip=True))
    assert separators(strip) == {}
    enc = SegmentEncoder(strip)
    assert enc.encode("x <|a|> y <s>") == strip.encode("x <|a|> y <s>") and len(enc) == 0
