"""Streaming detokenization: deltas concatenate to the full decode, characters are never split."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lily import Tokenizer
from lily.checkpoint.tiny import tiny_checkpoint
from lily.detokenizer import StreamingDetokenizer

NUM_IDS = 248077


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint())


def stream(tok, ids, skip=True) -> list[str]:
    d = StreamingDetokenizer(tok, skip_special_tokens=skip)
    return [d.add(i) for i in ids] + [d.flush()]


@pytest.mark.parametrize("text", [
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵 ❤️ 𝄞 𠜎 🫠",
    "你好，世界！人力资源和社会保障部。日本語のテキスト。한국어 욕실",
    "مرحبا بالعالم! हिन्दी में क्षत्रिय ภาษาไทย",
])
def test_multibyte_characters_arrive_whole(tok, text):
    deltas = stream(tok, tok.encode(text))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # Every character appears in exactly one delta: no character is split or repeated.
    assert sum(len(d) for d in deltas) == len(text)


def test_special_tokens(tok):
    ids = tok.encode("<think>\nhm\n</think>\n\nok<|im_end|><|endoftext|>")
    assert "".join(stream(tok, ids)) == "<think>\nhm\n</think>\n\nok"
    assert "".join(stream(tok, ids, skip=False)) == "<think>\nhm\n</think>\n\nok<|im_end|><|endoftext|>"


def test_incomplete_character_at_the_end_is_flushed_as_replacement(tok):
    ids = tok.encode("a𠜎")[:-1]
    deltas = stream(tok, ids)
    assert deltas[-1] == "\ufffd" and "".join(deltas) == tok.decode(ids) == "a\ufffd"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, NUM_IDS - 1), max_size=24), st.booleans(), st.integers(0, 2**32 - 1))
def test_deltas_equal_full_decode(tok, ids, skip, seed):
    # Mix in byte tokens (ids 0..255 are single bytes, often partial characters) and special ids.
    rng = random.Random(seed)
    ids = ids + [rng.randrange(256) for _ in range(rng.randrange(6))] + [rng.randrange(248044, NUM_IDS)]
    rng.shuffle(ids)
    assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)
