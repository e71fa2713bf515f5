"""Streaming detokenization: token ids in, text deltas out.

Byte-level BPE tokens are byte strings, and one UTF-8 character may be split across tokens (most
emoji, many CJK characters). ``StreamingDetokenizer`` feeds each token's bytes to an incremental
UTF-8 decoder, so a delta never holds half a character and never repeats one; whatever is still
incomplete at the end comes out of ``flush`` as U+FFFD, exactly as a one-shot decode would show it.
Hence, for any ids: ``"".join(add(i) for i in ids) + flush() == tokenizer.decode(ids, skip_special_tokens)``.
Per token this is one dict lookup and one small decode, with no re-decoding of earlier tokens.
"""
from __future__ import annotations

import codecs

from .tokenizer import Tokenizer


class StreamingDetokenizer:
    """Turns a stream of token ids into text deltas.

    ``skip_special_tokens``: drop tokens flagged special in tokenizer.json (``<|im_end|>``,
    ``<|endoftext|>``, ...) as ``Tokenizer.decode(..., skip_special_tokens=True)`` does. Qwen's think
    and tool-call tags are not special, so they stay in the text, where the chat format needs them.
    """

    __slots__ = ("_token_bytes", "_skip", "_decoder")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._token_bytes = tokenizer.token_bytes
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """The text that token ``token_id`` completes (possibly "")."""
        if token_id in self._skip:
            return ""
        return self._decoder.decode(self._token_bytes(token_id))

    def flush(self) -> str:
        """End of stream: U+FFFD for a trailing incomplete character, else ""."""
        return self._decoder.decode(b"", final=True)
