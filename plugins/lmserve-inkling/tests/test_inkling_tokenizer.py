"""The ``inkling`` pre-tokenizer: a converted file tokenizes as the checkpoint's own
``tokenizers`` tokenizer does."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve_core.gguf_file import GGUFFile
from lmserve_core.tokenizer import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Cafe\u0301 cre\u0300me bru\u0302le\u0301e, nai\u0308ve",  # decomposed accents: marks stay
    "hindi \u0939\u093f\u0928\u094d\u0926\u0940 \u0935\u093f\u0915\u093f\u092a\u0940\u0921\u093f\u092f\u093e",
    "ti\u1ebfng Vi\u1ec7t, \u0627\u0644\u0652\u0639\u064e\u0631\u064e\u0628\u0650\u064a\u0651\u064e\u0629",
    "\u0301leading mark, a\u0301\u0301 two marks, x \u20dd enclosed",
    "Numbers 0123456789 1,234,567.89 and 42nd 3.14159",
    "spaces   between\twords \t\n\n  and\r\n\r\ntrailing   ",
    "camelCaseWords HTTPServer don't I'LL we've THEY'RE",
    "path/to/file +-*/=<>()[]{}\n/* c */\n",
    "def add(a, b):\n    return a + b\n",
    "\u4f60\u597d\u4e16\u754c \U0001f600 \u00e9\u00e8 Stra\u00dfe \u0399\u03b8\u03ac\u03ba\u03b7",
    '{"name": "get_weather", "args": {"city": "Paris"}}',
]


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> object:
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_file(str(checkpoint / "tokenizer.json"))


@pytest.mark.parametrize("text", CORPUS)
def test_tokens_equal_the_checkpoint_tokenizer(gguf_f32: Path, reference: object, text: str
                                               ) -> None:
    tok = Tokenizer.from_gguf(GGUFFile.open(gguf_f32))
    want = reference.encode(text, add_special_tokens=False).ids  # type: ignore[attr-defined]
    assert tok.encode(text, add_special=False) == want
    assert tok.decode(want) == text


def test_the_corpus_needs_the_marks_in_the_split(gguf_f32: Path, reference: object) -> None:
    # gpt-4o's split (the same without marks in the letter classes) differs on the mark lines
    g = GGUFFile.open(gguf_f32)
    tok = Tokenizer.from_gguf(g)
    assert tok.pre == "inkling" and not tok.add_bos
    gpt4o = Tokenizer(model="gpt2", tokens=g.get("tokenizer.ggml.tokens"),
                      merges=g.get("tokenizer.ggml.merges"), pre="gpt-4o")
    differ = [t for t in CORPUS if gpt4o.encode(t, add_special=False)
              != reference.encode(t, add_special_tokens=False).ids]  # type: ignore[attr-defined]
    assert CORPUS[1] in differ  # "Cafe" + U+0301 is one token: its merge needs the mark


def test_special_tokens_are_single_ids(gguf_f32: Path) -> None:
    tok = Tokenizer.from_gguf(GGUFFile.open(gguf_f32))
    text = "<|message_user|><|content_text|>Hi<|end_message|><|message_model|>"
    ids = tok.encode(text, add_special=False, parse_special=True)
    assert [tok.token_text(i) for i in ids][:2] == ["<|message_user|>", "<|content_text|>"]
    assert tok.eos_id == tok.token_id("<|content_model_end_sampling|>")
