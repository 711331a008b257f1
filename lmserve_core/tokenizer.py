"""Tokenization from GGUF metadata, matching llama.cpp's ids.

The merge work runs in the ``tokenizers`` library (Rust). Around it this module reproduces
what llama.cpp does before and after the model: special tokens are split out of the text
first (longest first; user-defined tokens always, control tokens only when asked), byte-level
BPE vocabularies get the pre-tokenizer regexes that ``tokenizer.ggml.pre`` names, and
SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``) get a BPE whose merges are
ranked by the score of the merged piece, which is how llama.cpp's SPM tokenizer merges.
"""

from __future__ import annotations

import codecs
import os
import re
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

if TYPE_CHECKING:
    from lmserve_core.gguf_file import GGUFFile

__all__ = ["StreamDecoder", "Tokenizer", "TokenizerError", "TokenType"]


class TokenizerError(ValueError):
    """The GGUF's tokenizer metadata is missing, inconsistent or of an unsupported kind."""


class TokenType:
    """Values of ``tokenizer.ggml.token_type`` (llama.cpp's ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# -- pre-tokenizer regexes (llama.cpp llama-vocab.cpp, llm_tokenizer_bpe) ----------------------

# llama.cpp runs this one through a hand-written matcher that also ends in `|\s+`.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_REGEXES: dict[str, list[str]] = {
    "default": [
        r"[\p{P}\$\+<=>\^~\|]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"\p{N}+",
        r"[0-9][0-9][0-9]",
    ],
    "gpt2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "llama3": [_LLAMA3],
    "qwen2": [_QWEN2],
    "falcon": [
        r"[\p{P}\$\+<=>\^~\|`]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"[0-9][0-9][0-9]",
    ],
}
# tokenizer.ggml.pre value -> (regex family, ignore_merges, add_bos default)
_PRE_TYPES: dict[str, tuple[str, bool, bool]] = {
    "default": ("default", False, False),
    "dbrx": ("llama3", False, False),
    "smaug-bpe": ("llama3", False, False),
    "glm4": ("llama3", False, False),
    "chatglm-bpe": ("llama3", False, False),
    "falcon": ("falcon", False, False),
}
for _family, _ignore_merges, _add_bos, _names in (
    ("llama3", True, True, "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2"),
    (
        "gpt2",
        False,
        False,
        "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert "
        "mpt olmo jais trillion granite-docling exaone4",
    ),
    ("smollm", False, False, "smollm starcoder refact command-r codeshell exaone minerva-7b"),
    ("qwen2", False, False, "qwen2 deepseek-r1-qwen kormo f2llmv2 stablelm2 megrez hunyuan"),
):
    for _name in _names.split():
        _PRE_TYPES[_name] = (_family, _ignore_merges, _add_bos)

# Token texts llama.cpp treats as end-of-generation whatever their declared type.
_EOG_TEXTS = (
    *[
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
    ],
    *[
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
    ],
    *[
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    ],
)
# Texts llama.cpp picks the EOT token from when the file names none (in its preference order).
_EOT_TEXTS = (
    *["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>"],
    *["<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"],
)
_EOM_TEXTS = ("<|eom_id|>",)
# Rendered as user-defined text by llama.cpp (gpt-oss channel markup).
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
# End markers of vocabularies whose </s> is ordinary text (Gemma 4, PLaMo).
_NORMAL_S_MARKERS = ("<|tool_response>", "<|plamo:eos|>")
# Gemma 4's pre-tokenizer: runs of newlines apart from the rest.
_NEWLINE_RUNS = re.compile(r"[^\n]+|\n+")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_SURROGATES = re.compile("[\ud800-\udfff]")
_BYTE_DECODER: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}


_CACHE: dict[tuple[Any, ...], Tokenizer] = {}
_CACHE_SIZE = 4


class _SplitTable:
    """Special tokens in llama.cpp's partition order, with a quick test for which occur."""

    _KEY = 6

    def __init__(self, entries: list[tuple[str, int]]) -> None:
        self.entries = entries
        # Tokens grouped by their first characters: one substring test rules out a whole
        # group (Gemma has thousands of "<unused…>" tokens).
        self.groups: dict[str, list[int]] = {}
        for k, (text, _) in enumerate(entries):
            self.groups.setdefault(text[: self._KEY], []).append(k)

    def occurring_in(self, text: str) -> list[tuple[str, int]]:
        found = [
            k
            for key, members in self.groups.items()
            if key in text
            for k in members
            if self.entries[k][0] in text
        ]
        found.sort()
        return [self.entries[k] for k in found]


class StreamDecoder:
    """Turns generated token ids into text, emitting only complete UTF-8 characters."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (possibly "")."""
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End of the sequence: an incomplete character held back is dropped (a reply cut by
        the token budget inside a multi-byte character ends before it, not in U+FFFD)."""
        pending, _ = self._utf8.getstate()
        self._utf8.reset()
        return "" if pending else self._utf8.decode(b"", final=True)


class Tokenizer:
    """A GGUF vocabulary: ``encode``/``decode`` that agree with llama.cpp token for token.

    Build it with :meth:`from_gguf`.
    """

    def __init__(
        self,
        *,
        model: str,
        tokens: Sequence[str],
        token_types: Sequence[int] | None = None,
        scores: Sequence[float] | None = None,
        merges: Sequence[str] | None = None,
        pre: str | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        eot_id: int | None = None,
        eom_id: int | None = None,
        unk_id: int | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        add_space_prefix: bool | None = None,
    ) -> None:
        n = len(tokens)
        if n == 0:
            raise TokenizerError("the vocabulary is empty")
        if token_types is not None and len(token_types) < n:
            raise TokenizerError(f"token_type has {len(token_types)} entries for {n} tokens")
        if scores is not None and len(scores) < n:
            raise TokenizerError(f"scores has {len(scores)} entries for {n} tokens")
        # llama.cpp renames empty tokens so that every text maps to one id.
        texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = (
            [int(t) for t in token_types[:n]] if token_types is not None else [TokenType.NORMAL] * n
        )
        vocab: dict[str, int] = {}
        for i, t in enumerate(texts):
            vocab.setdefault(t, i)

        self.model = model
        self._texts = texts
        # text -> id: the dict while building, then the tokenizer library's own map (a
        # Python dict of a 262k-token vocabulary would hold ~15 MB for the server's life)
        self._lookup: Callable[[str], int | None] = vocab.get
        self._types = types
        self._bytes: list[bytes | None] = [None] * n

        def in_range(i: int | None) -> int | None:
            return i if i is not None and 0 <= i < n else None

        bos_default: int | None
        eos_default: int | None
        unk_default: int | None
        if model == "llama":
            self.pre = "default"
            bos_default, eos_default, unk_default = 1, 2, 0
            add_bos_default, space_prefix_default = True, True
            ignore_merges = False
        elif model == "gpt2":
            self.pre = pre or "default"
            if self.pre not in _PRE_TYPES:
                raise TokenizerError(f"unsupported pre-tokenizer {self.pre!r}")
            family, ignore_merges, add_bos_default = _PRE_TYPES[self.pre]
            bos_default = eos_default = 11
            unk_default = None
            space_prefix_default = False
        elif model == "gemma4":
            # Gemma 4: a BPE over raw UTF-8 with SentencePiece's escaped spaces; llama.cpp
            # always adds its BOS
            self.pre = "gemma4"
            bos_default = eos_default = unk_default = None
            add_bos_default, space_prefix_default = True, False
            add_bos = True
        else:
            raise TokenizerError(f"unsupported tokenizer model {model!r}")

        # An id outside the vocabulary is ignored in favour of the default, as in llama.cpp.
        self.bos_id = in_range(bos_id) if in_range(bos_id) is not None else in_range(bos_default)
        self.eos_id = in_range(eos_id) if in_range(eos_id) is not None else in_range(eos_default)
        self.unk_id = in_range(unk_id) if in_range(unk_id) is not None else in_range(unk_default)
        self.add_bos = add_bos_default if add_bos is None else bool(add_bos)
        self.add_eos = False if add_eos is None else bool(add_eos)
        # Only SentencePiece vocabularies prepend a space.
        self.add_space_prefix = model == "llama" and (
            space_prefix_default if add_space_prefix is None else bool(add_space_prefix)
        )
        if self.add_bos and self.bos_id is None:
            raise TokenizerError("add_bos_token is true but there is no BOS token")

        self.eot_id = in_range(eot_id) if eot_id is not None else self._find(_EOT_TEXTS)
        self.eom_id = in_range(eom_id) if eom_id is not None else self._find(_EOM_TEXTS)
        eog = {vocab[t] for t in _EOG_TEXTS if t in vocab}
        # llama.cpp forces these to control type whatever the file declares.
        for i in eog:
            types[i] = TokenType.CONTROL
        eog.update(i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None)
        # Gemma 4 (and PLaMo) have a </s> that is ordinary text: llama.cpp keeps it out of
        # the end-of-generation set when their own end markers are in it.
        s_id = vocab.get("</s>")
        if s_id in eog and any(texts[i] in _NORMAL_S_MARKERS for i in eog):
            eog.discard(s_id)
            types[s_id] = TokenType.NORMAL
        for text in _ALWAYS_USER_DEFINED:
            if text in vocab:
                types[vocab[text]] = TokenType.USER_DEFINED
        self.eog_ids: frozenset[int] = frozenset(eog)

        # Split-out tokens, longest first as llama.cpp orders them.
        special = [
            i
            for i, t in enumerate(types)
            if t in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
        ]
        special.sort(key=lambda i: -len(texts[i].encode("utf-8")))
        self._split_all = _SplitTable([(texts[i], i) for i in special])
        self._split_user = _SplitTable(
            [(texts[i], i) for i in special if types[i] == TokenType.USER_DEFINED]
        )

        if model == "llama":
            self._hf = _build_spm(texts, vocab, scores, self.unk_id)
        elif merges is None:
            raise TokenizerError(f"a {model} (BPE) vocabulary needs tokenizer.ggml.merges")
        elif model == "gemma4":
            self._hf = HFTokenizer(
                models.BPE(vocab=vocab, merges=_merge_pairs(vocab, merges), byte_fallback=True)
            )
        else:
            self._hf = _build_bpe(vocab, merges, _PRE_REGEXES[family], ignore_merges)
        self._lookup = self._hf.token_to_id

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf_file: GGUFFile) -> Tokenizer:
        """Build the tokenizer described by a GGUF's ``tokenizer.ggml.*`` metadata.

        Tokenizers are immutable, so one built from the same unchanged file is reused
        (a large SentencePiece vocabulary takes a few seconds to build).
        """
        try:
            st = os.stat(gguf_file.path)
            key: tuple[Any, ...] | None = (
                str(gguf_file.path),
                st.st_ino,
                st.st_size,
                st.st_mtime_ns,
            )
        except OSError:
            key = None
        if key is not None and key in _CACHE:
            return _CACHE[key]
        tokenizer = cls._from_metadata(gguf_file)
        if key is not None:
            while len(_CACHE) >= _CACHE_SIZE:
                _CACHE.pop(next(iter(_CACHE)))
            _CACHE[key] = tokenizer
        return tokenizer

    @classmethod
    def _from_metadata(cls, gguf_file: GGUFFile) -> Tokenizer:
        g = gguf_file.get
        model = g("tokenizer.ggml.model")
        tokens = g("tokenizer.ggml.tokens")
        if not isinstance(model, str):
            raise TokenizerError(f"{gguf_file.path}: tokenizer.ggml.model is missing")
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens[:1]):
            raise TokenizerError(f"{gguf_file.path}: tokenizer.ggml.tokens is missing")

        def opt_int(key: str) -> int | None:
            v = g(key)
            return int(v) if isinstance(v, int) and not isinstance(v, bool) else None

        def opt_bool(key: str) -> bool | None:
            v = g(key)
            return bool(v) if isinstance(v, bool | int) else None

        try:
            return cls(
                model=model,
                tokens=tokens,
                token_types=g("tokenizer.ggml.token_type"),
                scores=g("tokenizer.ggml.scores"),
                merges=g("tokenizer.ggml.merges"),
                pre=g("tokenizer.ggml.pre"),
                bos_id=opt_int("tokenizer.ggml.bos_token_id"),
                eos_id=opt_int("tokenizer.ggml.eos_token_id"),
                eot_id=opt_int("tokenizer.ggml.eot_token_id"),
                eom_id=opt_int("tokenizer.ggml.eom_token_id"),
                unk_id=opt_int("tokenizer.ggml.unknown_token_id"),
                add_bos=opt_bool("tokenizer.ggml.add_bos_token"),
                add_eos=opt_bool("tokenizer.ggml.add_eos_token"),
                add_space_prefix=opt_bool("tokenizer.ggml.add_space_prefix"),
            )
        except TokenizerError as exc:
            raise TokenizerError(f"{gguf_file.path}: {exc}") from None

    # -- queries ------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._texts)

    def token_id(self, text: str) -> int | None:
        """The id of the token whose text is exactly ``text``, if there is one."""
        return self._lookup(text)

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary."""
        return self._texts[token_id]

    def token_type(self, token_id: int) -> int:
        return self._types[token_id]

    def is_special(self, token_id: int) -> bool:
        """Control and unknown tokens: the ones ``decode(skip_special=True)`` drops."""
        return self._types[token_id] in (TokenType.CONTROL, TokenType.UNKNOWN)

    # -- encode -------------------------------------------------------------------------------

    def encode(
        self,
        text: str,
        *,
        add_special: bool = True,
        parse_special: bool = False,
        plain: Sequence[tuple[int, int]] = (),
    ) -> list[int]:
        """Token ids of ``text``.

        ``add_special`` adds BOS (and EOS) when the vocabulary asks for them;
        ``parse_special`` lets control-token texts such as ``<|im_start|>`` become their ids
        (user-defined tokens always do, as in llama.cpp), except inside the character spans
        ``plain`` (start, end), where they stay text: e.g. what a message supplied, in a
        rendered chat prompt.
        """
        out: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            out.append(self.bos_id)
        prev_special = True
        for frag in self._partition_spans(text, parse_special, plain):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.model == "llama":
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                frag = frag.replace(" ", "\u2581")
            if self.model == "gemma4":
                # split at newline runs; a run that is a token of its own is that token
                for word in _NEWLINE_RUNS.findall(frag.replace(" ", "\u2581")):
                    tid = self._lookup(word) if word[0] == "\n" else None
                    if tid is not None:
                        out.append(tid)
                    else:
                        out.extend(self._bpe(word))
            else:
                out.extend(self._bpe(frag))
            prev_special = False
        if add_special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _bpe(self, text: str) -> list[int]:
        try:
            return list(self._hf.encode(text, add_special_tokens=False).ids)
        except TypeError:
            # Lone surrogates (possible in JSON input) are not encodable text.
            text = _SURROGATES.sub("\ufffd", text)
            return list(self._hf.encode(text, add_special_tokens=False).ids)

    def control_texts_in(self, text: str) -> list[str]:
        """The texts of control tokens (those only ``parse_special`` splits out) that occur
        in ``text``, longest first."""
        user = {tok for tok, _ in self._split_user.occurring_in(text)}
        return [tok for tok, _ in self._split_all.occurring_in(text) if tok not in user]

    def _partition_spans(
        self, text: str, parse_special: bool, plain: Sequence[tuple[int, int]]
    ) -> list[str | int]:
        if not plain or not parse_special:
            return self._partition(text, parse_special)
        frags: list[str | int] = []
        pos = 0
        for start, end in sorted(plain):
            start, end = max(start, pos), min(end, len(text))
            if start >= end:
                continue
            frags += self._partition(text[pos:start], True)
            frags += self._partition(text[start:end], False)
            pos = end
        frags += self._partition(text[pos:], True)
        # text on both sides of a span is one fragment, tokenized as a whole
        merged: list[str | int] = []
        for f in frags:
            if isinstance(f, str) and merged and isinstance(merged[-1], str):
                merged[-1] += f
            else:
                merged.append(f)
        return merged

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        if not text:
            return []
        table = self._split_all if parse_special else self._split_user
        frags: list[str | int] = [text]
        for tok, tid in table.occurring_in(text):
            nxt: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    nxt.append(f)
                    continue
                parts = f.split(tok)
                for k, part in enumerate(parts):
                    if k:
                        nxt.append(tid)
                    if part:
                        nxt.append(part)
            frags = nxt
        return frags

    # -- decode -------------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (control tokens: their text)."""
        cached = self._bytes[token_id]
        if cached is None:
            cached = self._bytes[token_id] = self._piece(token_id)
        return cached

    def _piece(self, i: int) -> bytes:
        text, kind = self._texts[i], self._types[i]
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED):
            return text.encode("utf-8")
        if kind == TokenType.BYTE:
            return bytes([int(text[3:5], 16)])
        if kind != TokenType.NORMAL:
            return b""  # unused/undefined tokens print nothing in llama.cpp
        if self.model in ("llama", "gemma4"):
            return text.replace("\u2581", " ").encode("utf-8")
        try:
            return bytes(_BYTE_DECODER[c] for c in text)
        except KeyError:
            return text.encode("utf-8")

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD.

        As in llama.cpp, the space a SentencePiece vocabulary puts in front of the text is
        removed from the first token, unless that token is a BOS dropped by ``skip_special``.
        """
        ids = list(ids)
        strip_space = self.add_space_prefix
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            ids = ids[1:]
            strip_space = False
        parts: list[bytes] = []
        for n, tid in enumerate(ids):
            if skip_special and self.is_special(tid):
                continue
            piece = self.token_bytes(tid)
            if n == 0 and strip_space and piece.startswith(b" "):
                piece = piece[1:]
            parts.append(piece)
        return b"".join(parts).decode("utf-8", errors="replace")

    def stream_decoder(self, *, skip_special: bool = False) -> StreamDecoder:
        """A decoder for one generated sequence (see :class:`StreamDecoder`)."""
        return StreamDecoder(self, skip_special=skip_special)

    def _find(self, texts: Iterable[str]) -> int | None:
        for t in texts:
            i = self._lookup(t)
            if i is not None:
                return i
        return None

    def __repr__(self) -> str:
        return f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size})"


def _merge_pairs(vocab: dict[str, int], merge_lines: Sequence[str]) -> list[tuple[str, str]]:
    """The merges of a BPE vocabulary as pairs, in rank order."""
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for line in merge_lines:
        # Split at the first space after position 0, as llama.cpp does.
        pos = line.find(" ", 1)
        if pos < 0:
            continue
        pair = (line[:pos], line[pos + 1 :])
        # The first rank of a repeated pair wins; merges that make no known token would
        # only fall back to bytes in llama.cpp, which byte-level pieces give anyway.
        if pair in seen or pair[0] + pair[1] not in vocab:
            continue
        if pair[0] not in vocab or pair[1] not in vocab:
            continue
        seen.add(pair)
        merges.append(pair)
    return merges


def _build_bpe(
    vocab: dict[str, int], merge_lines: Sequence[str], regexes: list[str], ignore_merges: bool
) -> HFTokenizer:
    merges = _merge_pairs(vocab, merge_lines)
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges)
    tok = HFTokenizer(model)
    steps: list[Any] = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    return tok


def _build_spm(
    texts: list[str],
    vocab: dict[str, int],
    scores: Sequence[float] | None,
    unk_id: int | None,
) -> HFTokenizer:
    if scores is None:
        scores = [0.0] * len(texts)
    # llama.cpp's SPM tokenizer repeatedly merges the adjacent pair whose concatenation is
    # the highest-scoring vocabulary entry. A BPE whose merges are all such pairs, ranked by
    # that score, performs the same merges in the same order.
    # (A stable sort keeps equal scores in id order.)
    if isinstance(scores, np.ndarray):
        order = np.argsort(-scores[: len(texts)].astype(np.float64), kind="stable").tolist()
    else:
        order = sorted(range(len(texts)), key=scores.__getitem__, reverse=True)
    merges: list[tuple[str, str]] = []
    extend = merges.extend
    for i in order:
        t = texts[i]
        if len(t) < 2 or vocab[t] != i:
            continue
        extend([(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab])
    unk = texts[unk_id] if unk_id is not None else None
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True)
    return HFTokenizer(model)
