"""LlamaConfig, weight validation and LlamaModel on tiny written GGUFs (no torch needed)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from lmserve_llama.config import LlamaConfig
from lmserve_llama.model import LlamaModel
from tiny_llama import TinySpec, reference_forward, write_tiny_llama

from lmserve_core import memory
from lmserve_core.gguf_file import GGUFError, GGUFFile
from lmserve_core.native import kernels as K


def open_tiny(tmp_path: Path, spec: TinySpec) -> tuple[GGUFFile, dict[str, np.ndarray]]:
    path = tmp_path / "tiny.gguf"
    weights = write_tiny_llama(path, spec)
    return GGUFFile.open(path), weights


# ---------------------------------------------------------------------------- config


def test_config_reads_llama_keys(tmp_path: Path) -> None:
    gguf, _ = open_tiny(tmp_path, TinySpec(metadata={"some.future_key": 7}))
    cfg = LlamaConfig.from_gguf(gguf)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_ff, cfg.n_head, cfg.n_kv_head) == (2, 64, 96, 4, 2)
    assert (cfg.head_dim, cfg.n_vocab, cfg.n_ctx_train) == (16, 128, 256)
    assert cfg.rms_eps == pytest.approx(1e-5)
    rope = LlamaModel.load(gguf, n_threads=1).rope
    assert rope.n_rot == 16 and rope.mscale == 1.0 and rope.mode == 0
    np.testing.assert_allclose(rope.inv_freq, 10000.0 ** (-np.arange(0, 16, 2) / 16), rtol=1e-6)


def test_config_defaults_for_optional_keys(tmp_path: Path) -> None:
    spec = TinySpec(
        drop_metadata=(
            "attention.head_count_kv",
            "rope.dimension_count",
            "rope.freq_base",
            "vocab_size",
        )
    )
    gguf, _ = open_tiny(tmp_path, spec)
    cfg = LlamaConfig.from_gguf(gguf)
    assert cfg.n_kv_head == 4
    assert cfg.n_vocab == 128  # from token_embd's rows
    gguf, _ = open_tiny(tmp_path, TinySpec(drop_metadata=("rope.dimension_count", "rope.freq_base")))
    rope = LlamaModel.load(gguf, n_threads=1).rope
    assert rope.n_rot == 16 and rope.inv_freq[1] == pytest.approx(10000.0 ** (-2 / 16))


def test_mistral_alias_maps_to_llama(tmp_path: Path) -> None:
    gguf, _ = open_tiny(tmp_path, TinySpec(arch="mistral"))
    assert LlamaConfig.from_gguf(gguf).architecture == "mistral"


def test_linear_rope_scaling_divides_the_frequencies(tmp_path: Path) -> None:
    gguf, _ = open_tiny(tmp_path, TinySpec(rope_scaling=("linear", 4.0)))
    rope = LlamaModel.load(gguf, n_threads=1).rope
    np.testing.assert_allclose(rope.inv_freq, 10000.0 ** (-np.arange(0, 16, 2) / 16) / 4, rtol=1e-6)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (TinySpec(arch="gemma3"), "not served by the llama family"),
        (TinySpec(drop_metadata=("block_count",)), "block_count"),
        (TinySpec(metadata={"block_count": 0}), "block_count 0 is outside"),
        (TinySpec(metadata={"expert_count": 8}), "mixture-of-experts"),
        (TinySpec(metadata={"attention.head_count_kv": 3}), "not a multiple"),
        (TinySpec(metadata={"embedding_length": "wide"}), "embedding_length expected an integer"),
    ],
)
def test_config_rejects(tmp_path: Path, spec: TinySpec, message: str) -> None:
    gguf, _ = open_tiny(tmp_path, spec)
    with pytest.raises(GGUFError, match=message):
        LlamaConfig.from_gguf(gguf)


# ---------------------------------------------------------------------------- weights


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (TinySpec(tensors={"blk.1.attn_k.weight": np.zeros((32, 48), np.float32)}), "shape"),
        (TinySpec(tensors={"blk.0.ffn_norm.weight": np.ones(64, np.int32)}), "type I32"),
        (TinySpec(drop_tensors=("blk.1.ffn_up.weight",)), "missing"),
        (TinySpec(tensors={"blk.0.attn_q.bias": np.zeros(64, np.float32)}), "unexpected"),
        (TinySpec(tensors={"rope_freqs.weight": np.ones(5, np.float32)}), "rope_freqs"),
        (TinySpec(rope_scaling=("longrope", 4.0)), "rope scaling 'longrope'"),
        (TinySpec(rope_scaling=("yarn", 4.0)), "original_context_length"),
        (TinySpec(metadata={"rope.dimension_count": 18}), "does not fit head_dim"),
    ],
)
def test_weights_rejected_before_native_code(tmp_path: Path, spec: TinySpec, message: str) -> None:
    gguf, _ = open_tiny(tmp_path, spec)
    with pytest.raises(GGUFError, match=message):
        LlamaModel.load(gguf, n_threads=1)


# ---------------------------------------------------------------------------- forward


@pytest.mark.parametrize(
    "spec",
    [
        TinySpec(),
        TinySpec(tied=False, matrix_type=GGMLQuantizationType.Q4_1, seed=1),
        TinySpec(n_rot=8, rope_scaling=("linear", 2.0), n_kv_head=1, seed=2),
        TinySpec(matrix_type=GGMLQuantizationType.F16, n_kv_head=4, seed=3),
    ],
    ids=["q8_0-tied", "q4_1-untied", "partial-rope-linear-mqa", "f16-mha"],
)
def test_forward_matches_numpy_reference(tmp_path: Path, spec: TinySpec) -> None:
    gguf, weights = open_tiny(tmp_path, spec)
    # 8: the prompt spans 3 chunks; an f32 cache keeps the comparison at f32 rounding
    model = LlamaModel.load(gguf, n_threads=2, n_batch=8, kv_type="f32")
    ids = list(np.random.default_rng(spec.seed).integers(0, spec.n_vocab, 20))
    scale = 1.0 / spec.rope_scaling[1] if spec.rope_scaling else 1.0
    want = reference_forward(weights, spec, ids, scale)
    got = model.forward(model.new_cache(32), ids, 0, all_logits=True)
    assert got.dtype == np.float32 and got.shape == (20, spec.n_vocab)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
    last = model.forward(model.new_cache(32), ids, 0)
    assert last.shape == (spec.n_vocab,)
    np.testing.assert_allclose(last, got[-1], rtol=0, atol=1e-5 * np.abs(want).max())


def test_rope_freqs_tensor_scales_the_frequencies(tmp_path: Path) -> None:
    factors = np.array([1.0, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0], np.float32)
    spec = TinySpec(tensors={"rope_freqs.weight": factors}, seed=4)
    gguf, weights = open_tiny(tmp_path, spec)
    model = LlamaModel.load(gguf, n_threads=2, kv_type="f32")
    ids = [7, 3, 99, 12, 5, 60, 2, 81, 44, 9]
    want = reference_forward(weights, spec, ids, freq_factors=factors.astype(np.float64))
    got = model.forward(model.new_cache(16), ids, 0, all_logits=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
    plain = reference_forward(weights, spec, ids)
    assert np.abs(plain - want).max() > 100 * 2e-4 * np.abs(want).max()  # the factors matter


def test_f16_cache_stays_close(tmp_path: Path) -> None:
    spec = TinySpec(seed=5)
    gguf, weights = open_tiny(tmp_path, spec)
    model = LlamaModel.load(gguf, n_threads=2)
    assert model.kv_type == "f16"
    ids = list(np.random.default_rng(5).integers(0, spec.n_vocab, 24))
    want = reference_forward(weights, spec, ids)
    got = model.forward(model.new_cache(32), ids, 0, all_logits=True)
    # K and V rounded to half precision: relative error 2^-11 on each, a few 1e-4 on logits
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
    assert model.kv_bytes_per_pos == 2 * 2 * spec.n_layer * spec.n_kv_head * 16


def test_decode_and_copy_rows_continue_a_prefix(tmp_path: Path) -> None:
    spec = TinySpec()
    gguf, weights = open_tiny(tmp_path, spec)
    model = LlamaModel.load(gguf, n_threads=2, kv_type="f32")
    ids = [5, 17, 99, 3, 64, 1, 127, 40]
    want = reference_forward(weights, spec, ids)
    donor = model.new_cache(16)
    model.forward(donor, ids[:5], 0)
    cache = model.new_cache(12)
    model.copy_rows(donor, cache, 5)
    for pos in range(5, len(ids)):
        logits = model.forward(cache, [ids[pos]], pos)
        np.testing.assert_allclose(logits, want[pos], rtol=0, atol=2e-4 * np.abs(want).max())


def test_forward_validates_in_python(tmp_path: Path) -> None:
    gguf, _ = open_tiny(tmp_path, TinySpec())
    model = LlamaModel.load(gguf, n_threads=1)
    cache = model.new_cache(8)
    with pytest.raises(ValueError, match="do not fit"):
        model.forward(cache, [1, 2, 3], 6)
    with pytest.raises(ValueError, match="token id"):
        model.forward(cache, [1, 128], 0)
    with pytest.raises(ValueError, match="token id"):
        model.forward(cache, [-1], 0)
    with pytest.raises(ValueError, match="at least one token"):
        model.forward(cache, [], 0)
    with pytest.raises(ValueError, match="cache_copy"):
        model.copy_rows(cache, model.new_cache(4), 5)
    other = LlamaModel.load(gguf, n_threads=1)
    with pytest.raises(ValueError, match="not made by this model"):
        other.forward(cache, [1], 0)
    with pytest.raises(ValueError):
        model.new_cache(0)
    cache.close()
    with pytest.raises(ValueError, match="closed"):
        model.forward(cache, [1], 0)


def test_model_reports_its_sizes(tmp_path: Path) -> None:
    gguf, _ = open_tiny(tmp_path, TinySpec())
    model = LlamaModel.load(gguf, n_threads=2)
    assert (model.n_vocab, model.n_ctx_train, model.n_threads) == (128, 256, 2)
    cache = model.new_cache(4)
    model.close()
    with pytest.raises(RuntimeError, match="closed"):
        model.forward(cache, [1], 0)
    with pytest.raises(RuntimeError, match="closed"):
        model.new_cache(4)


@pytest.fixture
def weights_mode() -> Iterator[Callable[[str], None]]:
    yield memory.set_weights_mode
    memory.set_weights_mode("auto")


@pytest.mark.parametrize(
    "matrix_type", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0], ids=["q8_0", "q5_0"]
)
def test_weights_copied_or_mapped_give_the_same_logits(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    weights_mode: Callable[[str], None],
    matrix_type: GGMLQuantizationType,
) -> None:
    """``--weights``: the matrices read from copies in the process's memory, from the mapped
    file, or some from each when the memory available holds only some copies: the same
    bytes (Q5_0 relaid as Q8_0 either way), the same logits bit for bit. (Copies in the
    interleaved layouts: the next test.)"""
    monkeypatch.setattr(K, "interleaved_for", lambda qtype: None)
    gguf, _ = open_tiny(tmp_path, TinySpec(tied=False, matrix_type=matrix_type, seed=5))
    ids = [int(t) for t in np.random.default_rng(5).integers(0, 128, 12)]
    runs: dict[str, LlamaModel] = {}
    for mode, avail in (("map", None), ("copy", None), ("auto", None), ("auto", 4 * 40_000)):
        weights_mode(mode)
        if avail is not None:
            monkeypatch.setattr(memory, "available", lambda avail=avail: avail)
        runs[f"{mode} {avail}"] = LlamaModel.load(gguf, n_threads=2)
    mapped = runs["map None"]
    logits = mapped.forward(mapped.new_cache(16), ids, 0, all_logits=True)
    for model in runs.values():
        np.testing.assert_array_equal(
            model.forward(model.new_cache(16), ids, 0, all_logits=True), logits
        )
    relaid = mapped.relaid_bytes
    assert (relaid > 0) == (matrix_type == GGMLQuantizationType.Q5_0)
    assert mapped.copied_bytes == 0
    for name in ("copy None", "auto None"):  # auto: the tiny model fits many times over
        model = runs[name]
        assert model.mapped_bytes == 0 and model.relaid_bytes == relaid
        assert model.copied_bytes == mapped.mapped_bytes  # each matrix once, tied or not
    # a quarter of the memory available: 40,000 bytes of copies; an eighth: 20,000 bytes
    # more for Q5_0 relaid, whose other matrices are then copied or read from the file
    short = runs[f"auto {4 * 40_000}"]
    assert 0 < short.copied_bytes <= 40_000
    if relaid:
        assert 0 < short.relaid_bytes < relaid
    else:
        assert short.mapped_bytes > 0
    for model in runs.values():
        model.close()


@pytest.mark.parametrize(
    "matrix_type",
    [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0],
    ids=["q8_0", "q4_1", "q5_0"],
)
def test_interleaved_copies_give_the_values_of_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, matrix_type: GGMLQuantizationType
) -> None:
    """Copies in the interleaved layouts (what AVX-512 VNNI machines read; forced here on
    every machine, through the portable products where need be): an f32 prefill, which
    decodes the weights to floats, gives the logits of the file's layout bit for bit
    (embeddings tied, so the table is read from the interleaved copy too); an int16 one
    (the default, where the CPU multiplies the layout faster that way) and decode's integer
    products give them within their float rounding, and a token's logits do not depend on
    how many rows its pass has."""
    gguf, _ = open_tiny(tmp_path, TinySpec(matrix_type=matrix_type, seed=7))
    ids = [int(t) for t in np.random.default_rng(7).integers(0, 128, 40)]
    monkeypatch.setattr(K, "interleaved_for", lambda qtype: None)
    plain = LlamaModel.load(gguf, n_threads=2)
    monkeypatch.setattr(K, "interleaved_for", lambda qtype: K._R16_TYPE.get(int(qtype)))
    packed = LlamaModel.load(gguf, n_threads=2)
    assert plain.interleaved_bytes == 0 and packed.interleaved_bytes > 0
    assert packed.interleaved_bytes == plain.copied_bytes + plain.relaid_bytes
    want = plain.forward(plain.new_cache(64), ids, 0, all_logits=True)
    with K.use_prefill_precision(K.PrefillPrecision.F32):
        np.testing.assert_array_equal(
            packed.forward(packed.new_cache(64), ids, 0, all_logits=True), want
        )
        assert np.array_equal(plain.forward(plain.new_cache(64), ids, 0, all_logits=True), want)
    got = packed.forward(packed.new_cache(64), ids, 0, all_logits=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
    caches = {m: m.new_cache(64) for m in (plain, packed)}
    for m, cache in caches.items():
        m.forward(cache, ids[:32], 0)
    one_pass = packed.new_cache(64)
    packed.forward(one_pass, ids[:32], 0)
    rows = packed.forward(one_pass, ids[32:39], 32, all_logits=True)
    for i, tok in enumerate(ids[32:39]):  # decoded one at a time
        want = plain.forward(caches[plain], [tok], 32 + i)
        got = packed.forward(caches[packed], [tok], 32 + i)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
        np.testing.assert_array_equal(rows[i], got)
    for m in (plain, packed):
        m.close()
