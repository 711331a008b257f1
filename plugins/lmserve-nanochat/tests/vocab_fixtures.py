"""A small nanochat tokenizer, trained as nanochat trains its own, in each of its files.

``make_tokenizer(dir) -> Path`` writes ``dir/tokenizer/tokenizer.pkl``: a ``tiktoken``
``Encoding`` trained by rustbpe with nanochat's ``SPLIT_PATTERN`` and its nine special tokens,
pickled as ``RustBPETokenizer.save`` does (``nanochat/tokenizer.py``). The training runs once
per process; later calls write the same bytes. ``write_tokenizer_bin`` and
``write_tokenizer_json`` write the same vocabulary as fucina's ``tokenizer.bin`` and as the
Hugging Face port's ``tokenizer.json`` (transformers' ``TikTokenConverter``).

Needs ``tiktoken`` and ``rustbpe`` (the plugin's test extra): the functions skip the calling
test without them.
"""

from __future__ import annotations

import functools
import pickle
import random
import struct
from pathlib import Path
from typing import Any

import pytest
from lmserve_nanochat.vocab import SPECIAL_TOKENS, SPLIT_PATTERN, derive_merges

VOCAB_SIZE = 1024

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "they",
    "this",
    "which",
    "we",
    "you",
    "can't",
    "don't",
    "I'm",
    "we've",
    "they're",
    "he'll",
    "she'd",
    "it's",
    "THE",
    "WE'VE",
    "Hello",
    "World",
    "model",
    "token",
    "count",
    "strawberry",
    "calculator",
    "python",
    "print",
    "return",
    "def",
    "class",
    "import",
    "naïve",
    "café",
    "résumé",
    "Zürich",
    "São",
    "Paulo",
    "Ωμέγα",
    "Привет",
    "мир",
    "東京",
    "北京",
    "日本語",
    "한국어",
    "مرحبا",
    "שלום",
    "नमस्ते",
    "ไทย",
    "😀",
    "👍🏽",
    "🎉",
    "é",
    "ñ",
]

_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "nu",
    "re",
    "sa",
    "ti",
    "vo",
    "ze",
    "an",
    "el",
    "in",
    "on",
    "ur",
    "str",
    "th",
    "ch",
    "ing",
    "ed",
    "ly",
    "ão",
    "ü",
    "ß",
    "語",
    "한",
]


def corpus(seed: int = 0, n: int = 4000) -> list[str]:
    """Training documents: words of several scripts, numbers, code, whitespace."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(5, 30)):
            r = rng.random()
            if r < 0.45:
                parts.append(rng.choice(_WORDS))
            elif r < 0.7:  # made-up words, for merges of every length
                syllables = rng.choices(_SYLLABLES, k=rng.randint(1, 4))
                parts.append("".join(syllables).capitalize() if r < 0.5 else "".join(syllables))
            elif r < 0.85:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
            elif r < 0.95:
                parts.append(rng.choice([",", ".", "!", "?", "(", ")", "=", "+", "'s", ":"]))
            else:
                parts.append(rng.choice(["\n", "\n\n", "\t", "    ", "  \n"]))
        docs.append(" ".join(parts))
    return docs


@functools.cache
def _trained() -> tuple[bytes, dict[bytes, int], dict[str, int]]:
    rustbpe = pytest.importorskip("rustbpe")
    tiktoken = pytest.importorskip("tiktoken")
    # RustBPETokenizer.train_from_iterator
    tokenizer = rustbpe.Tokenizer()
    tokenizer.train_from_iterator(
        iter(corpus()), VOCAB_SIZE - len(SPECIAL_TOKENS), pattern=SPLIT_PATTERN
    )
    ranks = {bytes(k): v for k, v in tokenizer.get_mergeable_ranks()}
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    enc = tiktoken.Encoding(
        name="rustbpe",
        pat_str=tokenizer.get_pattern(),
        mergeable_ranks=ranks,
        special_tokens=specials,
    )
    return pickle.dumps(enc), ranks, specials


def encoding() -> Any:
    """The trained ``tiktoken.Encoding`` (a fresh copy)."""
    pytest.importorskip("tiktoken")
    return pickle.loads(_trained()[0])


def make_tokenizer(dir: Path) -> Path:
    """Writes ``dir/tokenizer/tokenizer.pkl`` (nanochat's layout) and returns its path."""
    path = Path(dir) / "tokenizer" / "tokenizer.pkl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_trained()[0])
    return path


def write_tokenizer_bin(path: Path) -> Path:
    """The vocabulary as fucina's ``tokenizer.bin`` (FORMATS.md; its
    ``nanochat_export.py`` derives the merges from the ranks in the same way)."""
    _, ranks, specials = _trained()
    pieces = sorted(ranks, key=ranks.__getitem__)
    merges = derive_merges(pieces, ranks, path)
    out = [
        b"NCTOKz01",
        struct.pack("<4I", 1, len(ranks) + len(specials), len(merges), len(specials)),
    ]
    out += [struct.pack("<II", left, right) for left, right in merges]
    for name in SPECIAL_TOKENS:
        raw = name.encode()
        out.append(struct.pack("<IH", specials[name], len(raw)) + raw)
    path.write_bytes(b"".join(out))
    return path


def write_tokenizer_json(path: Path) -> Path:
    """The vocabulary as the Hugging Face port's ``tokenizer.json``, converted by
    transformers' ``TikTokenConverter``."""
    convert = pytest.importorskip("transformers.convert_slow_tokenizer")
    _, ranks, _ = _trained()

    class Converter(convert.TikTokenConverter):
        # the ranks themselves, not a file (tiktoken would cache a file by its path)
        def load_tiktoken_bpe(self, tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    converter = Converter(pattern=SPLIT_PATTERN, extra_special_tokens=SPECIAL_TOKENS)
    converter.converted().save(str(path))
    return path
