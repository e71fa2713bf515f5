"""The host side of a request before the engine (issue 15, item 8): chat renderings encoded in pieces
cut at special tokens with the pieces' ids cached must equal the one-shot encoding token for token;
the prefix cache's hashed lookup must find what a comparison with every entry finds."""
from __future__ import annotations

import http.client
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

import lily
from lily import Tokenizer
from lily.checkpoint.tiny import tiny_checkpoint
from lily.errors import LilyError
import lily.server.cache as cache_module
from lily.server.cache import PrefixCache, prefix_hashes
from lily.server import Server
from lily.server.prompt import PromptTooLong, SegmentEncoder, chat_prompt, separators
from server_fakes import Slow

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
    for enc in (SHARED, TINY):  # the array joined from the pieces' arrays holds the same ids
        ids, array = enc.encode_array(text)
        assert ids == expected and array.dtype == np.int32 and array.tolist() == expected


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
        assert got.array.dtype == np.int32 and got.array.tolist() == want.ids  # joined from the pieces
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


# --- the prefix cache's lookup ----------------------------------------------------------------------------

class Snap:
    def __init__(self, tokens, nbytes=1):
        self.tokens, self.nbytes = tuple(tokens), nbytes


def brute_force(keys, ids, longer_than):
    fits = [k for k in keys if longer_than < len(k) < len(ids) and tuple(ids[:len(k)]) == k]
    return max(fits, key=len, default=None)


small_ids = st.lists(st.integers(0, 3), max_size=8)  # few values: many shared prefixes


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.lists(small_ids, max_size=12), small_ids, st.integers(0, 4), st.integers(1, 6))
def test_prefix_lookup_finds_the_longest_prefix(keys, ids, longer_than, max_entries):
    cache = PrefixCache(10**6, max_entries=max_entries)
    for k in keys:
        cache.add(Snap(k))
    kept = list(cache._entries)
    got = cache.longest_prefix(ids, longer_than)
    want = brute_force(kept, ids, longer_than)
    assert (got.tokens if got is not None else None) == want
    got = cache.longest_prefix(ids, longer_than, array=np.asarray(ids, dtype=np.int32))  # the worker's form
    assert (got.tokens if got is not None else None) == want
    assert cache.get(np.asarray(ids, dtype=np.int32)) is cache.get(ids)  # exact lookup, as an array too
    for k in kept:
        assert cache.get(np.asarray(k, dtype=np.int32)) is cache.get(k) is cache._entries[k]


def test_prefix_hashes_and_a_collision(monkeypatch):
    h = prefix_hashes([5, 6, 7])
    assert len(h) == 4 and h[0] == 0 and list(prefix_hashes([5, 6])) == list(h[:3])
    assert prefix_hashes([0])[1] != prefix_hashes([1])[1] and prefix_hashes([0, 0])[2] != prefix_hashes([0])[1]
    big = list(range(100_000))
    assert prefix_hashes(big)[50_000] == prefix_hashes(big[:50_000])[-1]  # the powers table grew
    cache = PrefixCache(10**6)
    a, b = Snap([1, 2, 3]), Snap([9, 9])
    cache.add(a), cache.add(b)
    # Every hash equal: the full comparison still decides.
    monkeypatch.setattr(cache_module, "prefix_hashes", lambda ids: np.zeros(len(ids) + 1, dtype=np.uint64))
    cache._hashes = dict.fromkeys(cache._hashes, 0)
    assert cache.longest_prefix([1, 2, 3, 4]) is a and cache.longest_prefix([9, 9, 1]) is b
    assert cache.longest_prefix([1, 2, 4, 4]) is None


def test_prefix_lookup_hashes_the_prompt_once_whatever_the_entries(monkeypatch):
    """One pass over the prompt per lookup (its prefix hashes), not a comparison per entry; the timing is
    benchmarks/bench_chat_prompt.py's job (5.2 -> 0.35 ms at 256 entries, docs/perf-notes.md)."""
    rng = np.random.default_rng(0)
    hist = rng.integers(1000, 200_000, 7000).tolist()
    ids = hist + rng.integers(1000, 200_000, 150).tolist()
    cache = PrefixCache(10**9)
    for i in range(256):  # other conversations, and this one's shorter prefixes
        cache.add(Snap(rng.integers(1000, 200_000, 7000).tolist() if i % 2 else hist[:7000 - i]))
    calls = []
    real = cache_module.prefix_hashes
    monkeypatch.setattr(cache_module, "prefix_hashes", lambda t: calls.append(len(t)) or real(t))
    for _ in range(3):
        assert cache.longest_prefix(ids).tokens == tuple(hist)
    assert calls == [len(hist)] * 3  # no hash beyond the longest candidate (7,000 of the 7,150 ids)
    # the caller's int32 array gives the same answer (the worker passes Prompt.array: no list conversion)
    assert cache.longest_prefix(ids, array=np.asarray(ids, dtype=np.int32)).tokens == tuple(hist)
    assert cache.longest_prefix(ids, longer_than=7000, array=np.asarray(ids, dtype=np.int32)) is None


# --- through the server ------------------------------------------------------------------------------------

def post(server, path, body):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("POST" if body is not None else "GET", path, body=json.dumps(body).encode() if body else None,
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    status, data = r.status, json.loads(r.read())
    conn.close()
    return status, data


def test_the_server_reuses_the_token_ids_of_earlier_messages():
    model = lily.Model.load(tiny_checkpoint(), device="cpu", max_context=4096)
    with pytest.raises(LilyError, match="token_cache_mib"):
        Server(model, port=0, token_cache_mib=-1)
    with Server(model, port=0, model_name="tiny", source=Slow()) as s:
        history = [{"role": "user", "content": "Read this. " + "lorem ipsum " * 300}]
        assert post(s, "/v1/chat/completions", {"messages": history})[0] == 200
        before = post(s, "/health", None)[1]["token_cache"]
        follow = history + [{"role": "assistant", "content": "Understood."}, {"role": "user", "content": "And?"}]
        assert post(s, "/v1/chat/completions", {"messages": follow})[0] == 200
        after = post(s, "/health", None)[1]["token_cache"]
        assert after["misses"] - before["misses"] == 2  # the reply and the question; the history was a hit
        assert after["hits"] > before["hits"] and 0 < after["bytes"] <= after["budget_bytes"] == 64 << 20
        assert s.worker.records[-1]["prompt_tokens"] == len(chat_prompt(TOK, follow, None, {}).ids)


def test_the_boundary_of_a_chat_costs_no_second_render(monkeypatch):
    """The head of a conversation (its rendering without the generation prompt) is the text less the
    generation prompt seen before for the same template arguments: one render per request, not two."""
    enc, calls = SegmentEncoder(TOK), []
    render = TOK.apply_chat_template
    monkeypatch.setattr(TOK, "apply_chat_template", lambda *a, **k: calls.append(k) or render(*a, **k))
    for i, kwargs in enumerate([{}, {}, {"enable_thinking": False}, {"enable_thinking": False}, {}]):
        msgs = [{"role": "user", "content": f"question {i}"}]
        before = len(calls)
        p = chat_prompt(TOK, msgs, None, kwargs, 1000, enc)
        assert len(calls) - before == (2 if i in (0, 2) else 1), i  # a new set of arguments renders twice once
        assert p.boundaries == (len(TOK.encode(render(msgs, add_generation_prompt=False, **kwargs))),)


def test_the_boundary_of_a_chat_costs_no_second_encoding(monkeypatch):
    """The last boundary is the prompt's token count less the generation prompt's (it starts at a
    separator): the conversation is encoded once, and the boundary equals the head's own encoding."""
    enc = SegmentEncoder(TOK)
    msgs = [{"role": "user", "content": "lorem ipsum dolor " * 200}, {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": "And then?"}]
    chat_prompt(TOK, msgs[:1], None, {}, 16384, enc)  # the generation prompt's suffix is known from here on
    encoded: list[int] = []
    real = enc.encode_array  # encode() goes through it too
    monkeypatch.setattr(enc, "encode_array", lambda text: encoded.append(len(text)) or real(text))
    p = chat_prompt(TOK, msgs, None, {}, 16384, enc)
    monkeypatch.undo()
    text = TOK.apply_chat_template(msgs)
    assert encoded[0] == len(text) and all(n < 40 for n in encoded[1:])  # then only the generation prompt
    assert p.boundaries == (len(TOK.encode(TOK.apply_chat_template(msgs, add_generation_prompt=False))),)
    assert p.ids == TOK.encode(text)


def test_a_follow_up_whose_history_changed_in_the_middle_reuses_nothing_stale():
    """The caches keyed by text (the encoder's pieces) and by tokens (the prefix snapshots, compared as
    arrays) must not hand a conversation whose middle message changed the ids or the snapshot of the old
    one: only what is still a prefix."""
    enc = SegmentEncoder(TOK)
    first = [{"role": "user", "content": "Read this. " + "lorem ipsum dolor " * 300},
             {"role": "assistant", "content": "Understood."}, {"role": "user", "content": "Now the second part."}]
    p1 = chat_prompt(TOK, first, None, {}, 16384, enc)
    cache = PrefixCache(10**9)
    for b in p1.boundaries + (len(p1.ids) - 1,):
        cache.add(Snap(p1.ids[:b]))
    edited = [first[0], {"role": "assistant", "content": "Understood!"}, first[2],
              {"role": "assistant", "content": "Done."}, {"role": "user", "content": "And now?"}]
    p2 = chat_prompt(TOK, edited, None, {}, 16384, enc)
    want = chat_prompt(TOK, edited, None, {})
    assert p2.ids == want.ids and p2.array.tolist() == want.ids and p2.boundaries == want.boundaries
    shared = next(i for i, (a, b) in enumerate(zip(p1.ids, p2.ids)) if a != b)  # inside the edited answer
    got = cache.longest_prefix(p2.ids, array=p2.array)
    assert got is None or (len(got.tokens) <= shared and got.tokens == tuple(p2.ids[:len(got.tokens)]))
    assert all(len(k) > shared for k in cache._entries)  # every kept boundary lies after the edit
    assert got is None
    assert all(cache.get(p2.array[:b]) is None for b in p2.boundaries)  # the worker's "lacks" check
