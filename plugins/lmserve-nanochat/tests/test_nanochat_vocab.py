"""vocab: nanochat's tokenizer files as lmserve's Tokenizer, token for token tiktoken's."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import pytest
import vocab_fixtures as vf
from lmserve_nanochat.config import CheckpointError
from lmserve_nanochat.vocab import (
    SPECIAL_TOKENS,
    Vocab,
    read_tokenizer_bin,
    read_tokenizer_pkl,
    read_vocab,
)

from lmserve_core.tokenizer import TokenType

TEXTS = [
    "Hello world! The cat sat on the mat.",
    "I'm sure you're right, we've seen it; they'll say he'd DON'T WE'VE It'S",
    "'s 't 're 've 'm 'll 'd 'S 'LL 'ſ 'K",  # (?i) folds ſ to s and the Kelvin sign to k
    "1 12 123 1234 12345 1234567890123 3.14159 1,000,000 x2 2x ٣٤٥ ⅷ ²³",
    "spaces    between\twords \t\t and\n\n\nnewlines\r\n\r\nend  \n  ",
    "   leading and trailing   ",
    "\n",
    "",
    " ",
    "日本語のテキスト、東京。 中文 한국어 텍스트",
    "emoji 😀👍🏽🎉 family 👨‍👩‍👧 flags 🇫🇷",
    "combining: e\u0301 n\u0303 a\u0308\u0304 Z\u0335\u0321",
    "naïve café résumé São Zürich Ωμέγα Привет мир مرحبا שלום नमस्ते ไทย",
    "<|bos|> <|user_start|>hi<|user_end|><|assistant_start|>",
    "code: def f(x):\n    return x**2 + 1  # comment\n\tprint(f'{x!r}')",
    "nbsp\u00a0and\u3000ideographic space\u2028line sep",
    "a" * 300,
    "!!!???...,,,;;;:::",
    "\x00\x01\x7f control",
    "𝕏 ﬁ Ⅻ ℃",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tok")
    return {
        "pkl": vf.make_tokenizer(d),
        "bin": vf.write_tokenizer_bin(d / "tokenizer.bin"),
        "json": vf.write_tokenizer_json(d / "tokenizer.json"),
    }


@pytest.fixture(scope="module")
def enc() -> object:
    return vf.encoding()


def _corpus() -> list[str]:
    return TEXTS + vf.corpus(seed=7, n=200)


@pytest.mark.parametrize("kind", ["pkl", "bin", "json"])
def test_ids_are_tiktoken_s(kind: str, files: dict[str, Path], enc: object) -> None:
    vocab = read_vocab(files[kind])
    tok = vocab.tokenizer()
    assert vocab.size == enc.n_vocab == tok.vocab_size
    for text in _corpus():
        want = enc.encode_ordinary(text)
        assert tok.encode(text, add_special=False) == want, text
        # special-token text stays text unless parsed
        assert tok.encode(text, add_special=False, parse_special=True) == enc.encode(
            text, allowed_special="all"
        ), text
        assert tok.decode(want) == enc.decode(want) == text


def test_the_three_files_agree(files: dict[str, Path]) -> None:
    vocabs = {k: read_vocab(p) for k, p in files.items()}
    pkl = vocabs["pkl"]
    for other in vocabs.values():
        assert other.pieces == pkl.pieces
        assert dict(other.specials) == dict(pkl.specials)
    # tokenizer.bin carries the merges derived from tokenizer.pkl's ranks; tokenizer.json
    # (transformers' converter) every split of a token, which gives the same ids
    assert vocabs["bin"].merges == pkl.merges
    assert set(pkl.merges) <= set(vocabs["json"].merges)
    text = " ".join(_corpus())
    ids = {k: v.tokenizer().encode(text, add_special=False) for k, v in vocabs.items()}
    assert ids["pkl"] == ids["bin"] == ids["json"]


def test_specials_and_metadata(files: dict[str, Path], enc: object) -> None:
    vocab = read_tokenizer_pkl(files["pkl"])
    meta = vocab.gguf_metadata()
    n = len(vocab.pieces)
    assert [vocab.special(t) for t in SPECIAL_TOKENS] == list(range(n, n + 9))
    assert vocab.bos_id == enc.encode_single_token("<|bos|>")
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "nanochat"
    assert meta["tokenizer.ggml.tokens"][n:] == list(SPECIAL_TOKENS)
    assert meta["tokenizer.ggml.token_type"][n:] == [TokenType.CONTROL] * 9
    assert set(meta["tokenizer.ggml.token_type"][:n]) == {TokenType.NORMAL}
    assert len(meta["tokenizer.ggml.merges"]) == n - 256
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.ggml.bos_token_id"] == meta["tokenizer.ggml.eos_token_id"] == n
    tok = vocab.tokenizer()
    assert not tok.add_bos and tok.bos_id == n
    assert tok.eog_ids == {n, vocab.special("<|assistant_end|>")}
    assert tok.encode("hi") == enc.encode_ordinary("hi")
    rendered = "<|bos|><|user_start|>2+2?<|user_end|><|assistant_start|>"
    ids = tok.encode(rendered, parse_special=True)
    assert ids[:2] == [n, n + 1] and ids[-1] == n + 3
    assert tok.decode(ids, skip_special=True) == "2+2?"


# -- broken and hostile files ------------------------------------------------------------------


def _refused(path: Path, *words: str) -> None:
    with pytest.raises(CheckpointError) as info:
        read_vocab(path)
    for word in (str(path), *words):
        assert word in str(info.value), str(info.value)


class _Call:
    def __init__(self, func: object, *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


def test_pkl_runs_nothing(tmp_path: Path) -> None:
    import os

    canary = tmp_path / "pwned"
    path = tmp_path / "tokenizer.pkl"
    path.write_bytes(pickle.dumps(_Call(os.system, f"touch {canary}")))
    _refused(path, "posix.system", "refused")
    path.write_bytes(pickle.dumps({"mergeable_ranks": _Call(os.system, f"touch {canary}")}))
    _refused(path, "posix.system")
    assert not canary.exists()


def test_pkl_errors(tmp_path: Path, files: dict[str, Path]) -> None:
    tiktoken = pytest.importorskip("tiktoken")
    enc = vf.encoding()
    path = tmp_path / "tokenizer.pkl"

    def dump(**change: object) -> Path:
        state = {
            "name": "x",
            "pat_str": enc._pat_str,
            "mergeable_ranks": dict(enc._mergeable_ranks),
            "special_tokens": dict(enc._special_tokens),
        }
        state.update(change)
        path.write_bytes(pickle.dumps(tiktoken.Encoding(**state)))
        return path

    _refused(dump(pat_str=r"\w+|\s+"), "not nanochat's SPLIT_PATTERN")
    specials = dict(enc._special_tokens)
    del specials["<|python_end|>"]
    specials["<|output_end|>"] -= 1
    specials["<|output_start|>"] -= 1
    _refused(dump(special_tokens=specials), "no special token <|python_end|>")
    ranks = dict(enc._mergeable_ranks)
    del ranks[b"A"]
    _refused(dump(mergeable_ranks=ranks), "ranks are not")
    # tiktoken pickles its registered encodings by name
    path.write_bytes(b"\x80\x02ctiktoken.core\nEncoding\n)\x81X\x04\x00\x00\x00gpt2b.")
    _refused(path, "registered encoding 'gpt2'")
    path.write_bytes(pickle.dumps(Path("x")))
    _refused(path, "refers to pathlib.PosixPath")
    path.write_bytes(pickle.dumps([1, 2]))
    _refused(path, "not a tiktoken Encoding")
    path.write_bytes(files["pkl"].read_bytes()[:-50])
    _refused(path, "not a readable pickle")


def _bin(path: Path, merges: list[tuple[int, int]], specials: list[tuple[int, bytes]],
         n_vocab: int | None = None, version: int = 1, tail: bytes = b"") -> Path:  # fmt: skip
    n_vocab = 256 + len(merges) + len(specials) if n_vocab is None else n_vocab
    out = [b"NCTOKz01", struct.pack("<4I", version, n_vocab, len(merges), len(specials))]
    out += [struct.pack("<II", a, b) for a, b in merges]
    out += [struct.pack("<IH", i, len(s)) + s for i, s in specials]
    path.write_bytes(b"".join(out) + tail)
    return path


def test_bin_errors(tmp_path: Path, files: dict[str, Path]) -> None:
    path = tmp_path / "tokenizer.bin"
    specials = [(257 + k, t.encode()) for k, t in enumerate(SPECIAL_TOKENS)]
    ok = _bin(path, [(97, 98)], specials)
    assert read_tokenizer_bin(ok).pieces[256] == b"ab"
    _refused(_bin(path, [(97, 98)], specials, n_vocab=300), "!= n_vocab 300")
    _refused(_bin(path, [(97, 98)], specials, version=2), "version 2")
    _refused(_bin(path, [(97, 256)], specials), "merge 0 uses a later token")
    bad = specials[:1] + [(999, specials[1][1])] + specials[2:]
    _refused(_bin(path, [(97, 98)], bad), "special token 1 has id 999")
    _refused(_bin(path, [(97, 98)], specials, tail=b"x"), "1 bytes after")
    _refused(_bin(path, [(97, 98)], specials[:8]), "no special token <|output_end|>")
    _refused(_bin(path, [(97, 98), (97, 98)], [(258 + k, s) for k, (_, s) in enumerate(specials)]),
             "same bytes")  # fmt: skip
    data = files["bin"].read_bytes()
    path.write_bytes(data[:-3])
    _refused(path, "truncated")
    path.write_bytes(b"NCTOKz02" + data[8:])
    _refused(path, "no NCTOKz01 magic")
    _refused(tmp_path / "absent.bin", "cannot be read")


def test_json_errors(tmp_path: Path, files: dict[str, Path]) -> None:
    doc = json.loads(files["json"].read_text())
    path = tmp_path / "tokenizer.json"

    def write(change: dict) -> Path:
        path.write_text(json.dumps({**doc, **change}))
        return path

    _refused(write({"model": {**doc["model"], "type": "WordPiece"}}), "not a BPE")
    _refused(write({"pre_tokenizer": None}), "not nanochat's SPLIT_PATTERN")
    pre = json.loads(json.dumps(doc["pre_tokenizer"]))
    pre["pretokenizers"][0]["pattern"]["Regex"] = r"\w+"
    _refused(write({"pre_tokenizer": pre}), "'\\\\w+'")
    _refused(write({"model": {**doc["model"], "merges": [["a", "zzz"]]}}), "is not of two tokens")
    vocab = {**doc["model"]["vocab"], "日本": 5000}
    _refused(write({"model": {**doc["model"], "vocab": vocab}}), "ids are not")
    path.write_text("{")
    _refused(path, "not JSON")


def test_unknown_file_kind(tmp_path: Path) -> None:
    _refused(tmp_path / "vocab.txt", "not a tokenizer.pkl")


def test_vocab_checks() -> None:
    pieces = tuple(bytes([b]) for b in range(256))
    specials = {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
    Vocab(pieces, (), specials, Path("x"))
    with pytest.raises(CheckpointError, match="no token for the byte 0x41"):
        Vocab(pieces[:65] + pieces[66:] + (b"AB",), (), specials, Path("x"))
    with pytest.raises(CheckpointError, match="do not follow"):
        Vocab(pieces, (), {**specials, "<|bos|>": 300}, Path("x"))
    with pytest.raises(CheckpointError, match="out of range"):
        Vocab(pieces, ((1, 999),), specials, Path("x"))
