"""Tokenization from GGUF metadata, matching llama.cpp's ids.

The merge work runs in the ``tokenizers`` library (Rust). Around it this module reproduces
what llama.cpp does before and after the model: special tokens are split out of the text
first (longest first; user-defined tokens always, control tokens only when asked), BPE
vocabularies get the pre-tokenizer that ``tokenizer.ggml.pre`` names (every name llama.cpp
knows, with the regexes and settings llama.cpp gives it: docs/tokenizers.md), and
SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``) get a BPE whose merges are
ranked by the score of the merged piece, which is how llama.cpp's SPM tokenizer merges.
The parts live apart: the pre-tokenizer table in :mod:`lmserve_core.pretokenize`, special
tokens in :mod:`lmserve_core.special_tokens`, the ``tokenizers`` models in
:mod:`lmserve_core.merges`, the clean-up of decoded text and the streaming decoder in
:mod:`lmserve_core.detokenize`.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from tokenizers import Regex, pre_tokenizers

from .detokenize import StreamDecoder, _clean_up_spaces
from .merges import _build_bpe, _build_spm
from .pretokenize import (
    _MASK_LSTRIP_PRES,
    _PRE_NAMES,
    _RAW_UTF8,
    PRE_TOKENIZER_NAMES,
    _PreTokenizer,
    _split_steps,
)
from .special_tokens import _EOM_TEXTS, _EOT_TEXTS, TokenType, _end_of_generation, _SpecialSplitter

if TYPE_CHECKING:
    from lmserve_core.gguf_file import GGUFFile

__all__ = [
    "PRE_TOKENIZER_NAMES",
    "StreamDecoder",
    "Tokenizer",
    "TokenizerError",
    "TokenType",
    "TooManyTokens",
]

log = structlog.get_logger("lmserve.tokenizer")


class TokenizerError(ValueError):
    """The GGUF's tokenizer metadata is missing, inconsistent or of an unsupported kind."""


class TooManyTokens(ValueError):
    """:meth:`Tokenizer.encode_within` stopped: the text has more tokens than allowed.
    ``at_least`` is a lower bound of its token count (more than ``most``)."""

    def __init__(self, at_least: int, most: int, *, exact: bool = False) -> None:
        super().__init__(f"at least {at_least} tokens, more than the {most} allowed")
        self.at_least = at_least
        self.most = most
        self.exact = exact  # at_least is the count itself (the whole text was encoded)


# Gemma 4's pre-tokenizer: runs of newlines apart from the rest.
_NEWLINE_RUNS = re.compile(r"[^\n]+|\n+")


class _Lowercase(dict[int, str]):
    """str.translate table of llama.cpp's unicode_tolower: one code point for one (a simple
    case mapping: no final sigma, U+0130 to "i"), filled as characters are seen."""

    def __missing__(self, cpt: int) -> str:
        lower = chr(cpt).lower()
        self[cpt] = value = lower if len(lower) == 1 else lower[0]
        return value


_LOWERCASE = _Lowercase()
# encode_within: a text of at most this many characters a token allowed is encoded whole;
# a longer one in pieces of about this many characters per token still allowed (at least
# _PIECE_CHARS), each cut after a letter before a space or newline (``_CUT``).
_WHOLE_CHARS_PER_TOKEN = 8
_PIECE_CHARS_PER_TOKEN = 4
_PIECE_CHARS = 2048
_CUT = re.compile("[^\\W\\d_](?=[ \n\u2581])")


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
_BYTE_ENCODER: dict[int, str] = _bytes_to_unicode()


def _symbol_pair(byte_level: bool, left: str, right: str) -> str:
    """Two adjacent characters of a text as the vocabulary's tokens spell them where they
    meet: byte-level vocabularies spell bytes (the last of ``left``, the first of
    ``right``); the others spell characters."""
    if not byte_level:
        return left + right
    return (
        _BYTE_ENCODER[left.encode("utf-8", "surrogatepass")[-1]]
        + _BYTE_ENCODER[right.encode("utf-8", "surrogatepass")[0]]
    )


_CACHE: dict[tuple[Any, ...], Tokenizer] = {}
_CACHE_SIZE = 4


def _token_piece(text: str, kind: int, escaped_spaces: bool, byte_level: bool) -> bytes:
    """The bytes a token of this text and type stands for: SentencePiece (and escaped)
    vocabularies spell spaces as U+2581, byte-level ones bytes as GPT-2's characters."""
    if kind in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED):
        return text.encode("utf-8")
    if kind == TokenType.BYTE:
        return bytes([int(text[3:5], 16)])
    if kind != TokenType.NORMAL:
        return b""  # unused/undefined tokens print nothing in llama.cpp
    if escaped_spaces:
        return text.replace("\u2581", " ").encode("utf-8")
    if not byte_level:
        # (llama.cpp would read GPT-2 byte characters here and garble the text)
        return text.encode("utf-8")
    try:
        return bytes(_BYTE_DECODER[c] for c in text)
    except KeyError:
        return text.encode("utf-8")


def _metadata_arguments(gguf_file: GGUFFile) -> dict[str, Any]:
    """The :class:`Tokenizer` arguments a GGUF's ``tokenizer.ggml.*`` metadata gives."""
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

    pre = g("tokenizer.ggml.pre")
    if pre is not None and not isinstance(pre, str):
        raise TokenizerError(f"{gguf_file.path}: tokenizer.ggml.pre is not a string")
    return {
        "model": model,
        "tokens": tokens,
        "token_types": g("tokenizer.ggml.token_type"),
        "scores": g("tokenizer.ggml.scores"),
        "merges": g("tokenizer.ggml.merges"),
        "pre": pre,
        "bos_id": opt_int("tokenizer.ggml.bos_token_id"),
        "eos_id": opt_int("tokenizer.ggml.eos_token_id"),
        "eot_id": opt_int("tokenizer.ggml.eot_token_id"),
        "eom_id": opt_int("tokenizer.ggml.eom_token_id"),
        "unk_id": opt_int("tokenizer.ggml.unknown_token_id"),
        "add_bos": opt_bool("tokenizer.ggml.add_bos_token"),
        "add_eos": opt_bool("tokenizer.ggml.add_eos_token"),
        "add_space_prefix": opt_bool("tokenizer.ggml.add_space_prefix"),
        "lowercase": opt_bool("tokenizer.ggml.normalizer.lowercase"),
    }


@dataclass(frozen=True)
class _Defaults:
    """What llama.cpp sets for a vocabulary before the file's own settings count."""

    pre: str  # the pre-tokenizer name in force
    spec: _PreTokenizer | None  # its settings (None: SentencePiece)
    bos: int | None
    eos: int | None
    unk: int | None
    add_bos: bool
    space_prefix: bool


def _model_defaults(model: str, pre: str | None) -> _Defaults:
    """The defaults of a ``tokenizer.ggml.model`` vocabulary whose ``tokenizer.ggml.pre`` is
    ``pre``, as llama_vocab::impl::load sets them."""
    bos_default: int | None
    eos_default: int | None
    unk_default: int | None
    spec: _PreTokenizer | None = None
    if model == "llama":
        name = "default"
        bos_default, eos_default, unk_default = 1, 2, 0
        add_bos_default, space_prefix_default = True, True
    elif model in ("gpt2", "whitespace", "gemma4"):
        # BPE vocabularies: byte-level, or raw UTF-8 (gemma4, and the whitespace-split
        # vocabularies of jina-embeddings-v2-base-zh). llama.cpp reads no pre-tokenizer
        # name from a gemma4 file.
        if model == "gemma4":
            name = "gemma4"
        elif pre:
            name = pre
        else:
            log.warning(
                "pre_tokenizer_missing",
                using="default",
                detail="tokenizer.ggml.pre is missing or empty: generation quality may "
                "suffer; regenerate the GGUF with a recent llama.cpp converter",
            )
            name = "default"
        spec = _PRE_NAMES.get(name)
        if spec is None:
            raise TokenizerError(
                f"unknown pre-tokenizer type {name!r} (llama.cpp refuses it too; the "
                "names it knows are listed in docs/tokenizers.md and in "
                "lmserve_core.tokenizer.PRE_TOKENIZER_NAMES)"
            )
        add_bos_default, space_prefix_default = spec.add_bos, False
        if model == "gemma4":
            bos_default = eos_default = unk_default = None
        else:
            bos_default, eos_default, unk_default = 11 if spec.bos else None, 11, None
    else:
        raise TokenizerError(f"unsupported tokenizer model {model!r}")
    return _Defaults(
        name, spec, bos_default, eos_default, unk_default, add_bos_default, space_prefix_default
    )


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
        lowercase: bool | None = None,
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

        d = _model_defaults(model, pre)
        self.pre, spec = d.pre, d.spec
        bos_default, eos_default, unk_default = d.bos, d.eos, d.unk
        add_bos_default, space_prefix_default = d.add_bos, d.space_prefix
        if merges is None and spec is not None and spec.type == "kimi_k2":
            merges = []  # llama.cpp loads Kimi K2's vocabulary without merges

        # An id outside the vocabulary is ignored in favour of the default, as in llama.cpp.
        self.bos_id = in_range(bos_id) if in_range(bos_id) is not None else in_range(bos_default)
        self.eos_id = in_range(eos_id) if in_range(eos_id) is not None else in_range(eos_default)
        self.unk_id = in_range(unk_id) if in_range(unk_id) is not None else in_range(unk_default)
        self.add_bos = add_bos_default if add_bos is None else bool(add_bos)
        if spec is not None and spec.type == "gemma4":
            self.add_bos = True  # llama.cpp overrides the file for Gemma 4's pre-tokenizer
        self.add_eos = False if add_eos is None else bool(add_eos)
        # Only SentencePiece vocabularies prepend a space; decode() removes it (whatever the
        # model, as llama_detokenize does).
        self.add_space_prefix = (
            space_prefix_default if add_space_prefix is None else bool(add_space_prefix)
        )
        # llama_detokenize's clean-up of spaces before punctuation (decode(clean_spaces=True))
        # and llama.cpp's add_sep, as llama.cpp sets them for this vocabulary.
        self.clean_spaces = spec.clean_spaces if spec is not None else False
        self.add_sep = spec.add_sep if spec is not None else False
        self._escape = spec is not None and spec.escape_whitespaces
        self._byte_level = spec is not None and spec.type not in _RAW_UTF8
        self._newline_tokens = spec is not None and spec.type == "gemma4"
        # The whitespace model lowercases unless told not to; its own pre-tokenizer says not to.
        self._lowercase = model == "whitespace" and (
            self.pre != "whitespace" if lowercase is None else bool(lowercase)
        )
        if self.add_bos and self.bos_id is None:
            raise TokenizerError("add_bos_token is true but there is no BOS token")

        self.eot_id = in_range(eot_id) if eot_id is not None else self._find(_EOT_TEXTS)
        self.eom_id = in_range(eom_id) if eom_id is not None else self._find(_EOM_TEXTS)
        self.eog_ids: frozenset[int] = _end_of_generation(
            vocab, texts, types, (self.eos_id, self.eot_id, self.eom_id)
        )
        # Tokens that take the whitespace before them when split out (llama.cpp's lstrip).
        lstrip = isinstance(pre, str) and any(name in pre for name in _MASK_LSTRIP_PRES)
        self._lstrip = frozenset([vocab["<mask>"]] if lstrip and "<mask>" in vocab else [])
        self._specials = _SpecialSplitter(texts, types, self._lstrip)

        if spec is None:
            self._hf = _build_spm(texts, vocab, scores, self.unk_id)
        elif merges is None:
            raise TokenizerError(f"a {model} (BPE) vocabulary needs tokenizer.ggml.merges")
        else:
            steps = _split_steps(spec.type)
            if model == "whitespace":
                # llama.cpp's whitespace session: words between whitespace, which is dropped
                steps.insert(0, pre_tokenizers.Split(Regex(r"\s+"), behavior="removed"))
            self._hf = _build_bpe(vocab, merges, steps, spec.ignore_merges, self._byte_level)
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
        arguments = _metadata_arguments(gguf_file)
        try:
            return cls(**arguments)
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
        return self._encode(text, add_special, parse_special, plain, None)

    def encode_within(
        self,
        text: str,
        most: int,
        *,
        add_special: bool = True,
        parse_special: bool = False,
        plain: Sequence[tuple[int, int]] = (),
    ) -> list[int]:
        """:meth:`encode`, for a text that may be far longer than ``most`` tokens: the same
        ids when there are at most ``most`` of them, else :class:`TooManyTokens` with a lower
        bound of their count. The work is bounded by ``most``, not by the length of the text.

        No token stands for more bytes than the vocabulary's longest, so a text of more
        than ``most`` times as many bytes is refused before any tokenization. A text of up
        to ``_WHOLE_CHARS_PER_TOKEN`` characters a token allowed is encoded whole; a longer
        one in pieces, counting as it goes and stopping once the count passes ``most``. A
        piece ends after a letter followed by a space or a newline that no token of the
        vocabulary joins: every pre-tokenizer splits there (a letter run ends, and no
        pattern carries a letter on into whitespace), so the pieces' ids are the whole
        text's ids. Special-token texts are split out first, never cut.
        """
        added = self._added(add_special)
        # bytes >= characters: the cheap bound first, the exact byte count when it matters
        at_least = added + self.fewest_tokens(len(text))
        if at_least <= most and not text.isascii():
            at_least = added + self.fewest_tokens(len(text.encode("utf-8", "surrogatepass")))
        if at_least > most:
            raise TooManyTokens(at_least, most)
        if len(text) <= _WHOLE_CHARS_PER_TOKEN * max(most, 1):
            ids = self._encode(text, add_special, parse_special, plain, None)
            if len(ids) > most:
                raise TooManyTokens(len(ids), most, exact=True)
            return ids
        return self._encode(text, add_special, parse_special, plain, most)

    @functools.cached_property
    def longest_token(self) -> int:
        """At least as many bytes as any token stands for (and 1). A byte-level token
        stands for the bytes it decodes to; any other for at most its text's UTF-8 (an
        escaped space "\u2581" may stand for a typed "\u2581" as well as for a space).
        Tokens that decode to nothing (unused, undefined) count their text."""
        utf8 = [len(t.encode("utf-8", "surrogatepass")) for t in self._texts]
        if self._byte_level:
            return max(1, max(len(self._piece(i)) or n for i, n in enumerate(utf8)))
        return max(1, max(max(len(self._piece(i)), n) for i, n in enumerate(utf8)))

    def fewest_tokens(self, size: int) -> int:
        """A lower bound of the tokens of any text of ``size`` bytes (or characters, which
        are no more): none stands for more than :attr:`longest_token` bytes. 0 where text
        may be dropped instead of tokenized (whitespace of the whitespace model, before an
        lstrip token)."""
        if self.model == "whitespace" or self._lstrip:
            return 0
        return -(-size // self.longest_token)

    def _added(self, add_special: bool) -> int:
        """How many tokens ``add_special`` adds (BOS, EOS)."""
        if not add_special:
            return 0
        return int(self.add_bos and self.bos_id is not None) + int(
            self.add_eos and self.eos_id is not None
        )

    def _encode(
        self,
        text: str,
        add_special: bool,
        parse_special: bool,
        plain: Sequence[tuple[int, int]],
        most: int | None,
    ) -> list[int]:
        """:meth:`encode`; with ``most``, raising :class:`TooManyTokens` as soon as more
        than ``most`` ids are out (:meth:`encode_within`)."""
        out: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            out.append(self.bos_id)
        prev_special = True
        for frag in self._specials.partition_spans(text, parse_special, plain):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                if most is not None and len(out) > most:
                    raise TooManyTokens(len(out), most)
                continue
            if self.model == "llama":
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                frag = frag.replace(" ", "\u2581")
            elif self._escape:
                frag = frag.replace(" ", "\u2581")
            elif self._lowercase:
                frag = frag.translate(_LOWERCASE)
            if self._newline_tokens:
                # Gemma 4: split at newline runs; a run that is a token of its own is that token
                for match in _NEWLINE_RUNS.finditer(frag):
                    word = match.group()
                    tid = self._lookup(word) if word[0] == "\n" else None
                    if tid is not None:
                        out.append(tid)
                    else:
                        self._extend(out, word, most)
            else:
                self._extend(out, frag, most)
            prev_special = False
        if add_special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        if most is not None and len(out) > most:
            raise TooManyTokens(len(out), most)
        return out

    def _extend(self, out: list[int], text: str, most: int | None) -> None:
        """Append the ids of ``text`` (one fragment, as the model's merges read it) to
        ``out``; with ``most``, in pieces, stopping once more than ``most`` ids are out."""
        if most is None or len(text) <= _PIECE_CHARS:
            out.extend(self._bpe(text))
            if most is not None and len(out) > most:
                raise TooManyTokens(len(out), most)
            return
        pos = 0
        while pos < len(text):
            want = max(_PIECE_CHARS, _PIECE_CHARS_PER_TOKEN * (most + 1 - len(out)))
            end = self._cut(text, pos + want)
            out.extend(self._bpe(text[pos:end]))
            if len(out) > most:
                raise TooManyTokens(len(out), most)
            pos = end

    def _cut(self, text: str, start: int) -> int:
        """The first place at or after ``start`` where ``text`` can be cut without changing
        its ids (see :meth:`encode_within`), else its end."""
        joined = self._joined_before_space
        for match in _CUT.finditer(text, max(0, start - 1)):
            end = match.end()
            if _symbol_pair(self._byte_level, text[end - 1], text[end]) not in joined:
                return end
        return len(text)

    @functools.cached_property
    def _joined_before_space(self) -> frozenset[str]:
        """The symbol pairs (a character, then a space, newline or "\u2581" as the
        vocabulary spells them) that some token holds: cuts between them are not safe."""
        after = "".join(sorted({_symbol_pair(self._byte_level, "a", c)[1] for c in " \n\u2581"}))
        blob = "\x00".join(self._texts)
        return frozenset(re.findall(f"(?=([^\x00][{re.escape(after)}]))", blob))

    def _bpe(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode holds it throughout): a long text does not
        # stall the other threads (the inference worker, the event loop).
        try:
            return self._hf.encode_batch([text], add_special_tokens=False)[0].ids
        except TypeError:
            # Lone surrogates (possible in JSON input) are not encodable text.
            text = _SURROGATES.sub("\ufffd", text)
            return self._hf.encode_batch([text], add_special_tokens=False)[0].ids

    def control_texts_in(self, text: str) -> list[str]:
        """The texts of control tokens (those only ``parse_special`` splits out) that occur
        in ``text``, longest first."""
        return self._specials.control_texts_in(text)

    # -- decode -------------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (control tokens: their text)."""
        cached = self._bytes[token_id]
        if cached is None:
            cached = self._bytes[token_id] = self._piece(token_id)
        return cached

    def _piece(self, i: int) -> bytes:
        escaped = self.model == "llama" or self._escape
        return _token_piece(self._texts[i], self._types[i], escaped, self._byte_level)

    def decode(
        self, ids: Iterable[int], *, skip_special: bool = False, clean_spaces: bool = False
    ) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD.

        As in llama.cpp, the space a SentencePiece vocabulary (or any with add_space_prefix)
        puts in front of the text is removed from the first token, unless that token is a
        BOS dropped by ``skip_special``.
        ``clean_spaces`` applies llama_detokenize's clean-up (" ." to ".", " 's" to "'s", ...)
        where llama.cpp does it for this vocabulary (:attr:`clean_spaces`); the text no longer
        tokenizes back to ``ids`` then.
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
        text = b"".join(parts)
        if clean_spaces and self.clean_spaces:
            text = _clean_up_spaces(text)
        return text.decode("utf-8", errors="replace")

    def stream_decoder(
        self, *, skip_special: bool = False, keep: Collection[int] = ()
    ) -> StreamDecoder:
        """A decoder for one generated sequence (see :class:`StreamDecoder`); ``keep``: special
        tokens whose text it keeps when it skips the others."""
        return StreamDecoder(self, skip_special=skip_special, keep=keep)

    def _find(self, texts: Iterable[str]) -> int | None:
        for t in texts:
            i = self._lookup(t)
            if i is not None:
                return i
        return None

    def __repr__(self) -> str:
        return f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size})"
