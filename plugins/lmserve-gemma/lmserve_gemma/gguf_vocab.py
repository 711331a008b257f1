"""Gemma tokenizers as GGUF metadata, the way llama.cpp's ``convert_hf_to_gguf.py`` writes them.

:func:`gemma4_vocab` reads a Gemma 4 tokenizer directory (``tokenizer.json`` +
``tokenizer_config.json``: DiffusionGemma's too) as ``Gemma4Model.set_vocab`` does;
:func:`add_vocab` writes a :class:`Vocab` with gguf-py's ``GGUFWriter``. The special ids,
``add_*_token`` flags, merges and chat template come from gguf-py's ``SpecialVocab``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUFWriter, TokenType

# Gemma4Model.set_vocab writes these USER_DEFINED, so that llama.cpp always renders them.
GEMMA4_VISIBLE = frozenset(
    {
        "<|channel>",
        "<channel|>",
        "<|tool_call>",
        "<tool_call|>",
        "<|tool_response>",
        "<tool_response|>",
        '<|"|>',
    }
)

BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass
class Vocab:
    """What a GGUF carries of a tokenizer, in the order convert_hf_to_gguf.py writes it."""

    model: str  # tokenizer.ggml.model
    pre: str | None
    tokens: list[str]
    scores: list[float]
    token_types: list[int]
    merges: list[str] = field(default_factory=list)
    special_ids: dict[str, int] = field(default_factory=dict)
    add_special: dict[str, bool] = field(default_factory=dict)
    chat_template: str | None = None


def load_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def special_vocab(path: Path, vocab: Vocab, *, merges: bool) -> None:
    """Special ids, add_bos/add_eos/add_sep, merges and template: gguf's SpecialVocab."""
    from gguf.vocab import SpecialVocab

    special = SpecialVocab(path, load_merges=merges, n_vocab=len(vocab.tokens))
    vocab.special_ids = dict(special.special_token_ids)
    vocab.add_special = dict(special.add_special_token)
    vocab.merges = list(special.merges)
    template = special.chat_template
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}: only a single chat template is supported")
    vocab.chat_template = template


def gemma4_vocab(path: Path) -> Vocab:
    """Gemma 4's vocabulary as Gemma4Model.set_vocab writes it (gguf's LlamaHfVocab).

    Every score is -1000; ``<0xXX>`` pieces are BYTE; the tokenizer's special tokens (bos,
    eos, unk, pad, mask and the ``extra_special_tokens``) CONTROL, but for
    :data:`GEMMA4_VISIBLE` (USER_DEFINED); the rest NORMAL. Merges are written, and
    add_bos_token is always true.
    """
    data = load_json(path / "tokenizer.json")
    config = load_json(path / "tokenizer_config.json")
    pieces = {i: t for t, i in data["model"]["vocab"].items()}
    n_vocab = len(pieces)
    if sorted(pieces) != list(range(n_vocab)) or any(
        a["id"] >= n_vocab for a in data.get("added_tokens", [])
    ):
        raise ValueError(f"{path}: expected a dense vocabulary without tokens past it")
    by_text = {t: i for i, t in pieces.items()}
    names = [config.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")]
    names.append(config.get("mask_token", "<mask>"))  # GemmaTokenizer's default mask
    names += list(config.get("extra_special_tokens", {}).values())
    special = {by_text[n] for n in names if isinstance(n, str) and n in by_text}
    tokens = [pieces[i] for i in range(n_vocab)]
    types: list[int] = []
    for i, text in enumerate(tokens):
        if text in GEMMA4_VISIBLE:
            types.append(TokenType.USER_DEFINED)
        elif BYTE_TOKEN.fullmatch(text):
            types.append(TokenType.BYTE)
        elif i in special:
            types.append(TokenType.CONTROL)
        else:
            types.append(TokenType.NORMAL)
    vocab = Vocab("gemma4", None, tokens, [-1000.0] * n_vocab, [int(t) for t in types])
    special_vocab(path, vocab, merges=True)
    vocab.add_special["space_prefix"] = False
    vocab.add_special["bos"] = True
    return vocab


def add_vocab(writer: GGUFWriter, vocab: Vocab) -> None:
    """Write ``vocab``'s ``tokenizer.*`` keys."""
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.token_types)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    for kind, tid in vocab.special_ids.items():
        add = getattr(writer, f"add_{kind}_token_id", None)
        if add is not None:
            add(tid)
    for kind, value in vocab.add_special.items():
        if kind != "space_prefix":
            getattr(writer, f"add_add_{kind}_token")(value)
    if vocab.chat_template is not None:
        writer.add_chat_template(vocab.chat_template)
    if "space_prefix" in vocab.add_special:
        writer.add_add_space_prefix(vocab.add_special["space_prefix"])
