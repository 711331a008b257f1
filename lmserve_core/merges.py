"""The ``tokenizers`` models llama.cpp's vocabularies become: a BPE over the file's merges
(after the pre-tokenizer's steps), and for SentencePiece vocabularies a BPE whose merges are
ranked by the score of the merged piece, which is how llama.cpp's SPM tokenizer merges.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers


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
    vocab: dict[str, int],
    merge_lines: Sequence[str],
    steps: list[Any],
    ignore_merges: bool,
    byte_level: bool,
) -> HFTokenizer:
    """A BPE after the pre-tokenizer ``steps``: over GPT-2's byte characters, or over raw
    UTF-8 with ``<0xXX>`` tokens for what no token spells."""
    merges = _merge_pairs(vocab, merge_lines)
    model = models.BPE(
        vocab=vocab, merges=merges, ignore_merges=ignore_merges, byte_fallback=not byte_level
    )
    tok = HFTokenizer(model)
    if byte_level:
        steps = [*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
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
