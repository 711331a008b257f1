"""Turning token bytes into text: llama_detokenize's clean-up of spaces, and the incremental
decoder of a generated sequence (:meth:`Tokenizer.stream_decoder
<lmserve_core.tokenizer.Tokenizer.stream_decoder>`).
"""

from __future__ import annotations

import codecs
from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmserve_core.tokenizer import Tokenizer

__all__ = ["StreamDecoder"]


class StreamDecoder:
    """Turns generated token ids into text, emitting only complete UTF-8 characters."""

    def __init__(
        self, tokenizer: Tokenizer, *, skip_special: bool = False, keep: Collection[int] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._keep = frozenset(keep)  # special tokens whose text is kept all the same
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (possibly "")."""
        if (
            self._skip_special
            and self._tokenizer.is_special(token_id)
            and token_id not in self._keep
        ):
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End of the sequence: an incomplete character held back is dropped (a reply cut by
        the token budget inside a multi-byte character ends before it, not in U+FFFD)."""
        pending, _ = self._utf8.getstate()
        self._utf8.reset()
        return "" if pending else self._utf8.decode(b"", final=True)


def _clean_up_spaces(text: bytes) -> bytes:
    """llama_detokenize's three clean-up passes (clean_up_tokenization_spaces), in place on
    the bytes as llama.cpp runs them."""
    buf = bytearray(text)
    # a space before ? ! . , goes
    n, total = len(buf), min(len(buf), 1)
    for i in range(1, n):
        x = buf[i]
        if buf[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        buf[total] = x
        total += 1
    # " ' " becomes "'"
    n, total, i = total, min(total, 1), 1
    while i < n:
        x = buf[i]
        if x == 0x27 and i + 1 < n and buf[i - 1] == 0x20 and buf[i + 1] == 0x20:
            total -= 1
            i += 1
            buf[i] = 0
        buf[total] = x
        total += 1
        i += 1
    # " 's" " 'm" " 're" " 've" lose the space
    n, total = total, min(total, 1)
    for i in range(1, n):
        x = buf[i]
        if buf[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            after = bytes(buf[i + 1 : min(i + 3, n)])
            if after[:1] in (b"s", b"m") or after in (b"re", b"ve"):
                total -= 1
        buf[total] = x
        total += 1
    return bytes(buf[:total])
