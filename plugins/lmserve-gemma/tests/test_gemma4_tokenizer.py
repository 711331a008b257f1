"""Gemma 4's tokenizer (``tokenizer.ggml.model`` "gemma4") against llama.cpp's ids.

``data/gemma4_tokenizer_llamacpp.json`` holds ``llama-tokenize``'s ids (llama.cpp b11434,
``benchmarks/record_llamacpp_tokens.py``) for the tokenizer corpus on the synthetic Gemma 4
vocabulary, with special-token parsing on and off, and the ids of "Hello" with BOS added.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from lmserve_core.gguf_file import GGUFFile
from lmserve_core.tokenizer import Tokenizer, TokenType

REFERENCE = json.loads(
    (Path(__file__).parent / "data" / "gemma4_tokenizer_llamacpp.json").read_text("utf-8")
)


def vocab_fingerprint(gguf: GGUFFile) -> str:
    h = hashlib.sha256()
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        for text in gguf.metadata[key]:
            h.update(text.encode() + b"\0")
    h.update(bytes(gguf.metadata["tokenizer.ggml.token_type"].astype("int32")))
    return h.hexdigest()


@pytest.fixture(scope="module")
def gemma4(synthetic: Any) -> Tokenizer:
    path, _ = synthetic(kind="gemma4", type="q8_0")
    gguf = GGUFFile.open(path)
    assert vocab_fingerprint(gguf) == REFERENCE["vocab_sha256"], (
        "the synthetic Gemma 4 vocabulary changed: record the llama.cpp ids again"
    )
    return Tokenizer.from_gguf(gguf)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=f"{'special' if c['parse_special'] else 'text'}-{i}")
        for i, c in enumerate(REFERENCE["cases"])
    ],
)
def test_matches_llama_cpp(gemma4: Tokenizer, case: dict[str, Any]) -> None:
    got = gemma4.encode(case["text"], add_special=False, parse_special=case["parse_special"])
    assert got == case["ids"]


def test_bos_always_added_and_round_trip(gemma4: Tokenizer) -> None:
    assert gemma4.encode("Hello") == REFERENCE["bos_ids"]
    for case in REFERENCE["cases"]:
        if not case["parse_special"]:
            ids = gemma4.encode(case["text"], add_special=False)
            assert gemma4.decode(ids) == case["text"]


def test_end_of_generation_and_plain_s(gemma4: Tokenizer) -> None:
    ends = {gemma4.token_text(i) for i in gemma4.eog_ids}
    assert {"<turn|>", "<|tool_response>", "<eos>"} <= ends
    # </s> is ordinary text in Gemma 4's vocabulary (llama.cpp drops it from the ends)
    s = gemma4.token_id("</s>")
    assert s is not None and s not in gemma4.eog_ids
    assert gemma4.token_type(s) == TokenType.NORMAL
    ids = gemma4.encode("a </s> b", add_special=False, parse_special=True)
    assert s not in ids and gemma4.decode(ids) == "a </s> b"  # text, not a marker
