"""Special tokens: which texts llama.cpp marks as control or end of generation, and how they
are split out of a text before any merge (longest first; user-defined tokens always, control
tokens only when asked).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence

__all__ = ["TokenType"]


class TokenType:
    """Values of ``tokenizer.ggml.token_type`` (llama.cpp's ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


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
# C's isspace: what an lstrip token strips.
_C_SPACE = " \t\n\v\f\r"


class _SplitTable:
    """Special tokens in llama.cpp's partition order, with a quick test for which occur."""

    _KEY = 6
    _MANY = 16  # a group larger than this is looked for where its key occurs

    def __init__(self, entries: list[tuple[str, int]]) -> None:
        self.entries = entries
        # Tokens grouped by their first characters: one substring test rules out a whole
        # group (Gemma has thousands of "<unused…>" tokens).
        self.groups: dict[str, list[int]] = {}
        for k, (text, _) in enumerate(entries):
            self.groups.setdefault(text[: self._KEY], []).append(k)
        # the groups by the first character of their key: a text without "<" is done in one
        # pass, whatever the number of groups
        self.firsts: dict[str, list[str]] = {}
        for key in self.groups:
            self.firsts.setdefault(key[:1], []).append(key)
        # a large group: the texts following each occurrence of its key, looked up in a
        # dict, instead of one pass over the text per token
        self.windows: dict[str, tuple[re.Pattern[str], dict[str, list[int]], list[int]]] = {}
        for key, members in self.groups.items():
            if len(members) > self._MANY:
                texts: dict[str, list[int]] = {}
                for k in members:
                    texts.setdefault(entries[k][0], []).append(k)
                longest = max(map(len, texts))
                window = re.compile(f"(?=({re.escape(key)}.{{0,{longest - len(key)}}}))", re.S)
                self.windows[key] = (window, texts, sorted({len(t) for t in texts}))

    def occurring_in(self, text: str) -> list[tuple[str, int]]:
        found: list[int] = []
        for first, keys in self.firsts.items():
            if first not in text:
                continue
            for key in keys:
                if key not in text:
                    continue
                if key not in self.windows:
                    found += [k for k in self.groups[key] if self.entries[k][0] in text]
                    continue
                window, texts, lengths = self.windows[key]
                seen = set(window.findall(text))
                found += {k for w in seen for n in lengths for k in texts.get(w[:n], ())}
        found.sort()
        return [self.entries[k] for k in found]


class _SpecialSplitter:
    """Cuts a text into runs of text and the ids of the special tokens in it, as llama.cpp's
    tokenizer_st_partition does: over every control, user-defined and unknown token with
    ``parse_special``, over user-defined tokens alone without it."""

    def __init__(self, texts: Sequence[str], types: Sequence[int], lstrip: Collection[int]) -> None:
        # Split-out tokens, longest first as llama.cpp orders them.
        special = [
            i
            for i, t in enumerate(types)
            if t in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
        ]
        special.sort(key=lambda i: -len(texts[i].encode("utf-8")))
        self.all = _SplitTable([(texts[i], i) for i in special])
        self.user = _SplitTable(
            [(texts[i], i) for i in special if types[i] == TokenType.USER_DEFINED]
        )
        # Tokens that take the whitespace before them when split out (llama.cpp's lstrip).
        self.lstrip = frozenset(lstrip)

    def control_texts_in(self, text: str) -> list[str]:
        """The texts of control tokens (those only ``parse_special`` splits out) that occur
        in ``text``, longest first."""
        user = {tok for tok, _ in self.user.occurring_in(text)}
        return [tok for tok, _ in self.all.occurring_in(text) if tok not in user]

    def partition_spans(
        self, text: str, parse_special: bool, plain: Sequence[tuple[int, int]]
    ) -> list[str | int]:
        if not plain or not parse_special:
            return self.partition(text, parse_special)
        frags: list[str | int] = []
        pos = 0
        for start, end in sorted(plain):
            start, end = max(start, pos), min(end, len(text))
            if start >= end:
                continue
            frags += self.partition(text[pos:start], True)
            frags += self.partition(text[start:end], False)
            pos = end
        frags += self.partition(text[pos:], True)
        # text on both sides of a span is one fragment, tokenized as a whole (joined once:
        # a prompt of many spans must not copy its text again for each one)
        merged: list[str | int] = []
        run: list[str] = []
        for f in frags:
            if isinstance(f, str):
                run.append(f)
                continue
            if run:
                merged.append("".join(run))
                run = []
            merged.append(f)
        if run:
            merged.append("".join(run))
        return merged

    def partition(self, text: str, parse_special: bool) -> list[str | int]:
        if not text:
            return []
        table = self.all if parse_special else self.user
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
                    if tid in self.lstrip and k < len(parts) - 1:
                        part = part.rstrip(_C_SPACE)
                    if part:
                        nxt.append(part)
            frags = nxt
        return frags


def _end_of_generation(
    vocab: Mapping[str, int], texts: Sequence[str], types: list[int], ends: Sequence[int | None]
) -> frozenset[int]:
    """The end-of-generation ids: the known end texts and ``ends`` (EOS, EOT, EOM). Updates
    ``types`` as llama.cpp does: end texts become control tokens, a </s> that is ordinary
    text becomes normal again, and gpt-oss's channel markup user-defined."""
    eog = {vocab[t] for t in _EOG_TEXTS if t in vocab}
    # llama.cpp forces these to control type whatever the file declares.
    for i in eog:
        types[i] = TokenType.CONTROL
    eog.update(i for i in ends if i is not None)
    # Gemma 4 (and PLaMo) have a </s> that is ordinary text: llama.cpp keeps it out of
    # the end-of-generation set when their own end markers are in it.
    s_id = vocab.get("</s>")
    if s_id in eog and any(texts[i] in _NORMAL_S_MARKERS for i in eog):
        eog.discard(s_id)
        types[s_id] = TokenType.NORMAL
    for text in _ALWAYS_USER_DEFINED:
        if text in vocab:
            types[vocab[text]] = TokenType.USER_DEFINED
    return frozenset(eog)
