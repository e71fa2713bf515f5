"""lily.Tokenizer on the real Qwen3.6 vocabulary: ids, round trips, bytes, special tokens, loading."""
from __future__ import annotations

import json
import unicodedata

import pytest

from lily import CheckpointError, LilyError, Tokenizer
from lily.checkpoint.tiny import tiny_checkpoint

TEXTS = [
    "Hello, world",
    "The quick brown fox jumps over the lazy dog. I'm sure we'll see.",
    "你好，世界！这是一个测试。人力资源和社会保障部。",
    "日本語のテキスト：ひらがな、カタカナ、漢字。",
    "مرحبا بالعالم! العربية ١٢٣",
    "हिन्दी में लिखा गया पाठ। क्षत्रिय",
    "Русский текст: является документом.",
    "Ελληνικά, 한국어 욕실, עברית, Türkçe çeşitli, Tiếng Việt, ภาษาไทย",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵 ❤️ 𝄞 𠜎",
    "Cafe\u0301 de\u0301ja\u0300 vu",  # decomposed accents: NFC composes them
    "def f(x):\n\treturn {'a': [1, 2.5e-3]}  # ok\r\n",
    "   \n\n\t  ",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint())


def test_known_ids_and_no_bos(tok):
    assert tok.encode("Hello, world") == [9419, 11, 1814]
    assert tok.encode(" ") == [220] and tok.encode("\n") == [198] and tok.encode("\n\n") == [271]
    assert tok.encode("") == []
    assert tok.vocab_size == 248077


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    nfc = unicodedata.normalize("NFC", text)
    assert tok.decode(ids) == nfc
    # token_bytes is what streaming uses: the bytes of the ids are exactly the UTF-8 of the text.
    assert b"".join(tok.token_bytes(i) for i in ids) == nfc.encode("utf-8")


def test_added_tokens_are_recognised_in_text(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n<think>\n</think><tool_call>")
    assert ids == [248045, 846, 198, 5834, 248046, 198, 248068, 198, 248069, 248058]


def test_special_flags(tok):
    # ChatML and endoftext are special; think and tool tags are not (they carry the answer's structure).
    assert {248044, 248045, 248046} <= tok.special_ids
    assert not {248058, 248059, 248066, 248067, 248068, 248069} & tok.special_ids
    ids = tok.encode("<think>\nx\n</think>\n\nanswer<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nx\n</think>\n\nanswer"
    assert tok.decode(ids).endswith("<|im_end|>")
    assert tok.token_bytes(248046) == b"<|im_end|>"


def test_partial_character_tokens(tok):
    ids = tok.encode("𠜎")
    assert len(ids) == 4  # a rare 4-byte character: one byte-level token per byte
    assert tok.decode(ids[:1]) == "\ufffd"
    assert b"".join(tok.token_bytes(i) for i in ids) == "𠜎".encode("utf-8")


def test_ids_beyond_the_vocabulary_decode_to_nothing(tok):
    # Embedding rows 248077..248319 are padding: no text, as in tokenizer.decode.
    assert tok.token_bytes(248100) == b"" and tok.decode([248100]) == ""


def test_encode_rejects_non_text(tok):
    with pytest.raises(LilyError, match="must be a str"):
        tok.encode([1, 2])


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json: not found"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a valid tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def _with_config(tmp_path, config: dict) -> Tokenizer:
    (tmp_path / "tokenizer.json").symlink_to(tiny_checkpoint() / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(tmp_path)


def test_template_from_tokenizer_config(tmp_path):
    t = _with_config(tmp_path, {"chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}",
                                "bos_token": {"content": "<s>"}})
    assert t.apply_chat_template([{"role": "user", "content": "a"}]) == "<s>[a]"


def test_named_templates_use_default(tmp_path):
    t = _with_config(tmp_path, {"chat_template": [{"name": "tool_use", "template": "T"},
                                                  {"name": "default", "template": "D"}]})
    assert t.apply_chat_template([{"role": "user", "content": "a"}]) == "D"


def test_bad_template_entry_and_missing_template(tmp_path):
    with pytest.raises(CheckpointError, match="'chat_template' must be"):
        _with_config(tmp_path, {"chat_template": 3})
    t = Tokenizer(Tokenizer.from_dir(tiny_checkpoint()).backend, None, name="x")
    with pytest.raises(CheckpointError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "a"}])


def test_repr(tok):
    assert repr(tok).startswith("Tokenizer(") and "vocab=248077" in repr(tok) and "chat_template=yes" in repr(tok)
