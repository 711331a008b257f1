"""lmserve_core.testing: K-quant encoders, tensor encoding and GGUF tokenizer metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, TokenType
from gguf.quants import dequantize
from models import qwen3_vocab_path

from lmserve_core.gguf_file import GGUFFile
from lmserve_core.testing import kquants
from lmserve_core.testing.gguf_writer import (
    StreamingWriter,
    add_bpe_tokenizer,
    add_tensor,
    encode_tensor,
    load_bpe_vocab,
)
from lmserve_core.tokenizer import Tokenizer

# Relative RMS error of a N(0, 1) matrix after a round trip; llama.cpp's own quantizer
# reaches about 0.066 / 0.033 / 0.016 on such data.
K_ERRORS = {T.Q4_K: 0.08, T.Q5_K: 0.045, T.Q6_K: 0.022}


def _rel_rmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).mean() / (b**2).mean()))


@pytest.mark.parametrize("qtype", list(K_ERRORS), ids=lambda t: t.name)
def test_k_quants_round_trip(qtype: T) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 1024)).astype(np.float32) * 0.03
    x[3, :256] += 0.5  # an offset block: the Q4_K/Q5_K minimum must carry it
    raw = kquants.K_QUANTIZERS[qtype](x)
    assert raw.dtype == np.uint8 and raw.shape == (64, 4 * kquants.BLOCK_BYTES[qtype])
    y = dequantize(raw, qtype).reshape(x.shape)
    assert _rel_rmse(y, x) < K_ERRORS[qtype]
    # The same per 256-block (no block is badly off), 3-D input, and the fast mode.
    blocks = ((y - x) ** 2).reshape(-1, 256).mean(-1) / (x**2).reshape(-1, 256).mean(-1)
    assert np.sqrt(blocks.max()) < 2 * K_ERRORS[qtype]
    y3 = dequantize(kquants.K_QUANTIZERS[qtype](x.reshape(4, 16, 1024)), qtype)
    assert np.array_equal(y3.reshape(x.shape), y)
    fast = dequantize(kquants.K_QUANTIZERS[qtype](x, search=False), qtype).reshape(x.shape)
    assert _rel_rmse(fast, x) < 1.5 * K_ERRORS[qtype]


@pytest.mark.parametrize("qtype", list(K_ERRORS), ids=lambda t: t.name)
def test_k_quants_edge_blocks(qtype: T) -> None:
    rng = np.random.default_rng(1)
    rows = {
        "zero": np.zeros(256),
        "constant": np.full(256, 0.75),
        "negative constant": np.full(256, -0.75),
        "all negative": -np.abs(rng.standard_normal(256)),
        "all positive": np.abs(rng.standard_normal(256)) + 1.0,
        "one spike": np.where(np.arange(256) == 17, 3.0, 0.0),
        "wide range": rng.standard_normal(256) * np.logspace(-4, 1, 256),
    }
    x = np.stack(list(rows.values())).astype(np.float32)
    y = dequantize(kquants.K_QUANTIZERS[qtype](x), qtype).reshape(x.shape)
    assert np.isfinite(y).all()
    assert np.array_equal(y[0], x[0])
    tolerance = {T.Q4_K: 0.1, T.Q5_K: 0.05, T.Q6_K: 0.03}[qtype]
    for name, got, want in zip(rows, y, x, strict=True):
        scale = max(float(np.abs(want).max()), 1e-6)
        assert np.abs(got - want).max() <= tolerance * scale, name


def test_k_quants_reject_bad_rows() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        kquants.quantize_q4_k(np.zeros((2, 96), np.float32))


def test_k_quants_speed() -> None:
    import time

    x = np.random.default_rng(2).standard_normal((1024, 3072)).astype(np.float32)
    start = time.perf_counter()
    kquants.quantize_q4_k(x)
    assert time.perf_counter() - start < 10


def test_q4_k_m_policy() -> None:
    pick = kquants.q4_k_m_type
    assert pick("blk.0.attn_norm.weight", (1024,), 28) == T.F32
    assert pick("blk.0.ffn_gate_inp.weight", (64, 1024), 28, 64) == T.F32
    assert pick("token_embd.weight", (151936, 1024), 28) == T.Q6_K  # tied: it is the output
    assert pick("token_embd.weight", (151936, 1024), 28, tied=False) == T.Q4_K
    assert pick("token_embd.weight", (151936, 64), 2) == T.Q8_0
    assert pick("blk.0.attn_q.weight", (2048, 1024), 28) == T.Q4_K
    # use_more_bits on 28 layers: 0-2, 24-27 and every third from 5.
    more = [i for i in range(28) if pick(f"blk.{i}.attn_v.weight", (1024, 1024), 28) == T.Q6_K]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert pick("blk.5.ffn_down.weight", (1024, 3072), 28) == T.Q6_K
    assert pick("blk.4.ffn_down_exps.weight", (64, 1024, 512), 28, 64) == T.Q4_K
    # Exactly 8 experts: llama.cpp bumps attn_k/attn_v to Q8_0 and attn_output to Q5_K.
    assert pick("blk.3.attn_k.weight", (512, 1024), 28, 8) == T.Q8_0
    assert pick("blk.3.attn_output.weight", (1024, 2048), 28, 8) == T.Q5_K
    # Rows that no 256-block fits fall back as llama.cpp's tensor_type_fallback does.
    assert pick("blk.0.attn_q.weight", (256, 64), 2) == T.Q5_0
    assert pick("blk.1.attn_v.weight", (128, 64), 2) == T.Q8_0
    assert pick("blk.0.attn_q.weight", (256, 48), 2) == T.F16


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K, T.Q6_K])
def test_tensors_read_back_as_stored(tmp_path: Path, qtype: T) -> None:
    from gguf import GGUFReader

    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3, 512)).astype(np.float32)
    path = tmp_path / "t.gguf"
    writer = GGUFWriter(str(path), "test")
    stored = add_tensor(writer, "w", x, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = GGUFReader(str(path)).tensors
    assert tensor.tensor_type == qtype and list(tensor.shape) == [512, 3, 4]  # ggml's ne
    assert np.array_equal(dequantize(tensor.data, qtype).reshape(x.shape), stored)
    info = GGUFFile.open(path).tensors["w"]
    assert info.shape == (4, 3, 512) and info.type_name == qtype.name


def test_streaming_writer(tmp_path: Path) -> None:
    from gguf import GGUFReader

    x = np.random.default_rng(4).standard_normal((8, 256)).astype(np.float32)
    path = tmp_path / "s.gguf"
    out = StreamingWriter(path, "test")
    out.plan("a", (256,), T.F32)
    out.plan("b", (8, 256), T.Q6_K)
    with pytest.raises(ValueError, match="do not fit"):
        out.plan("c", (8, 100), T.Q4_K)
    out.begin()
    out.write("a", x[0])
    with pytest.raises(ValueError, match="expected b"):
        out.write("a", x)
    stored = out.write("b", x, dequantized=True)
    out.close()
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    assert np.array_equal(tensors["a"].data, x[0])
    assert stored is not None
    assert np.array_equal(dequantize(tensors["b"].data, T.Q6_K).reshape(x.shape), stored)
    assert np.array_equal(encode_tensor(x, T.Q6_K)[1], stored)


# -- tokenizer metadata ------------------------------------------------------------------------


def _tiny_bpe_dir(path: Path) -> Path:
    """A byte-level BPE tokenizer.json in the shape the Hugging Face files have."""
    from lmserve_core.tokenizer import _bytes_to_unicode

    alphabet = list(_bytes_to_unicode().values())
    vocab = {t: i for i, t in enumerate([*alphabet, "ab", "abc", "Ġa"])}
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    added = [
        {"id": 262, "content": "<|end|>", "special": True, **flags},
        {"id": 263, "content": "<|fim|>", "special": False, **flags},
        {"id": 264, "content": "<tool>", "special": False, **flags},
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": False}
    tokenizer = {
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level, "use_regex": True},
        "model": {"type": "BPE", "vocab": vocab, "merges": [["a", "b"], ["ab", "c"], ["Ġ", "a"]]},
    }
    config = {"eos_token": "<|end|>", "add_bos_token": False, "chat_template": "{{ x }}"}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_bpe_vocab_follows_the_converter(tmp_path: Path) -> None:
    vocab = load_bpe_vocab(_tiny_bpe_dir(tmp_path), vocab_size=270, config_ids={"bos": 262})
    assert len(vocab.tokens) == 270 and vocab.tokens[265:] == [f"[PAD{i}]" for i in range(265, 270)]
    assert vocab.token_types[0] == TokenType.NORMAL and vocab.token_types[269] == TokenType.UNUSED
    # Special, special-looking, and plain added tokens.
    assert vocab.token_types[262:265] == [
        TokenType.CONTROL,
        TokenType.CONTROL,
        TokenType.USER_DEFINED,
    ]
    assert vocab.merges == ["a b", "ab c", "Ġ a"]
    assert vocab.special_ids == {"eos": 262, "bos": 262}
    assert vocab.add_special == {"bos": False}
    assert vocab.chat_template == "{{ x }}"
    with pytest.raises(ValueError, match="does not fit"):
        load_bpe_vocab(tmp_path, vocab_size=100)

    path = tmp_path / "v.gguf"
    writer = GGUFWriter(str(path), "llama")
    add_bpe_tokenizer(writer, vocab, "gpt-2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    gf = GGUFFile.open(path)
    assert (
        gf.get("tokenizer.ggml.model") == "gpt2" and gf.get("tokenizer.chat_template") == "{{ x }}"
    )
    tok = Tokenizer.from_gguf(gf)
    assert [tok.token_text(i) for i in tok.encode("abc ab")] == ["abc", "Ġ", "ab"]  # "a b" first
    assert tok.encode("x<|end|>", parse_special=True)[-1] == 262
    assert tok.encode("<tool>") == [264]  # user-defined: split out without parse_special
    assert tok.eos_id == 262 and tok.add_bos is False


@pytest.fixture(scope="module")
def qwen3_vocab() -> Path:
    return qwen3_vocab_path()


def test_qwen3_vocab_gguf(qwen3_vocab: Path) -> None:
    gf = GGUFFile.open(qwen3_vocab)
    assert gf.architecture == "qwen3" and not gf.tensors
    assert gf.get("tokenizer.ggml.model") == "gpt2" and gf.get("tokenizer.ggml.pre") == "qwen2"
    assert len(gf.get("tokenizer.ggml.merges")) == 151387
    template = gf.get("tokenizer.chat_template")
    assert "<|im_start|>" in template and "enable_thinking" in template
    tok = Tokenizer.from_gguf(gf)
    assert tok.vocab_size == 151936
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (151643, 151645, False)
    assert gf.get("tokenizer.ggml.add_eos_token") is False  # a ByteLevel post-processor
    assert tok.token_text(151935) == "[PAD151935]" and tok.token_type(151935) == TokenType.UNUSED
    assert tok.token_type(151644) == TokenType.CONTROL  # <|im_start|>
    assert tok.token_type(151659) == TokenType.CONTROL  # <|fim_prefix|>: looks special
    assert tok.token_type(151667) == TokenType.USER_DEFINED  # <think>
    assert tok.encode("Hello world") == [9707, 1879]
