"""Q2_0 (GGML type 42) in both of its block layouts: llama.cpp's 64 elements in 18 bytes
(QuantType.Q2_0) and the 128 elements in 34 bytes of PrismML's Ternary-Bonsai files
(QuantType.Q2_0_128, lmserve's own id): the kernels on every ISA, the loader telling the two
apart by a tensor's bytes in the file, and a llama model whose matrices are Q2_0."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from lmserve_core import gguf_file
from lmserve_core.gguf_file import GGUFError, GGUFFile
from lmserve_core.native import kernels as K
from lmserve_core.testing import q2_0

pytestmark = pytest.mark.usefixtures("restore_isa")

QT = K.QuantType
LAYOUTS = [QT.Q2_0, QT.Q2_0_128]
F32 = 0


def layout_id(t: QT) -> str:
    return t.name


# ------------------------------------------------------------------ types
def test_type_ids_and_geometry() -> None:
    assert int(QT.Q2_0) == gguf_file.Q2_0 == q2_0.Q2_0 == 42
    assert int(QT.Q2_0_128) == gguf_file.Q2_0_128 == q2_0.Q2_0_128 == 142
    assert (K.block_elems(QT.Q2_0), K.block_bytes(QT.Q2_0)) == (64, 18) == q2_0.block(42)
    assert (K.block_elems(QT.Q2_0_128), K.block_bytes(QT.Q2_0_128)) == (128, 34)
    assert K.row_bytes(QT.Q2_0, 192) == 54 and K.row_bytes(QT.Q2_0_128, 256) == 68
    with pytest.raises(ValueError):
        K.row_bytes(QT.Q2_0_128, 192)  # not whole blocks of 128
    assert {int(QT.Q2_0), int(QT.Q2_0_128)} <= set(K.MATRIX_TYPES)
    # no interleaved copy of either (the kit keeps the file's blocks)
    for isa in K.available_isas():
        with K.use_isa(isa):
            assert K.interleaved_for(QT.Q2_0) is None and K.interleaved_for(QT.Q2_0_128) is None
    # nor is the own id ever an interleaved one (64 + a GGML id below 78)
    assert int(QT.Q2_0_128) not in {int(t) for t in K.Interleaved}


# ------------------------------------------------------------------ decoding
def all_codes_blocks(qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """Blocks whose code bytes take all 256 values, with special scales: 0, -0, the smallest
    subnormal, the largest half (2 * 65504 stays finite in f32), negative ones, random."""
    elems, nbytes = q2_0.block(int(qtype))
    per = nbytes - 2
    codes = np.concatenate(
        [np.arange(256, dtype=np.uint8)] * 2 + [rng.integers(0, 256, 4 * per, dtype=np.uint8)]
    )
    nblocks = -(-codes.size // per)
    nblocks += -nblocks % (512 // elems)  # whole rows of 512
    raw = np.zeros((nblocks, nbytes), np.uint8)
    raw[:, 2:].reshape(-1)[: codes.size] = codes
    d = rng.uniform(-2, 2, nblocks).astype(np.float16)
    d[:6] = np.array([0.0, -0.0, 6e-8, 65504.0, -65504.0, -1.5], np.float16)
    raw[:, :2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1, 512 // elems * nbytes)


def test_codes_mean_minus_one_zero_one_two() -> None:
    """llama.cpp's order: element j in byte j / 4 at bits 2 (j % 4); 00 -1, 01 0, 10 +1, 11 +2."""
    for qtype in LAYOUTS:
        elems, nbytes = q2_0.block(int(qtype))
        raw = np.zeros(nbytes, np.uint8)
        raw[:2] = np.array([0.5], np.float16).view(np.uint8)
        raw[2] = 0b11_10_01_00  # elements 0..3
        raw[3] = 0b00_00_00_11  # element 4 is +2, 5..7 are -1
        raw[4:] = 0b01_01_01_01  # zeros
        want = np.zeros(elems, np.float32)
        want[:8] = [-0.5, 0.0, 0.5, 1.0, 1.0, -0.5, -0.5, -0.5]
        np.testing.assert_array_equal(q2_0.decode(raw, int(qtype)), want)
        for isa in K.available_isas():
            with K.use_isa(isa):
                np.testing.assert_array_equal(K.dequantize_row(qtype, raw, elems), want)


@pytest.mark.parametrize("qtype", LAYOUTS, ids=layout_id)
def test_dequantize_is_the_numpy_decoder_bit_for_bit(qtype: QT, rng) -> None:
    raw = np.concatenate(
        [all_codes_blocks(qtype, rng), q2_0.random_blocks(rng, int(qtype), 5, 512)]
    )
    want = q2_0.decode(raw, int(qtype))
    assert want.shape == (raw.shape[0], 512)
    ids = np.arange(raw.shape[0], dtype=np.int32)[::-1]
    for isa in K.available_isas():
        with K.use_isa(isa):
            got = np.stack([K.dequantize_row(qtype, row, 512) for row in raw])
            np.testing.assert_array_equal(got, want, err_msg=isa.name)
            whole = K.dequantize_row(qtype, raw, want.size)  # every row as one
            np.testing.assert_array_equal(whole, want.reshape(-1), err_msg=isa.name)
            np.testing.assert_array_equal(
                K.get_rows(qtype, raw, raw.shape[0], 512, ids), want[ids], err_msg=isa.name
            )


@pytest.mark.parametrize("qtype", LAYOUTS, ids=layout_id)
def test_encoder_round_trip(qtype: QT, rng) -> None:
    """The test encoder (llama.cpp's reference quantizer): every block's largest weight comes
    back exactly up to f16, and the codes stay within -1 .. +1."""
    w = rng.standard_normal((3, 512)).astype(np.float32)
    raw = q2_0.encode(w, int(qtype))
    assert raw.shape == (3, K.row_bytes(qtype, 512))
    back = q2_0.decode(raw, int(qtype))
    elems = q2_0.block(int(qtype))[0]
    blocks, got = w.reshape(-1, elems), back.reshape(-1, elems)
    amax = np.abs(blocks).max(axis=1).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(np.abs(got).max(axis=1), amax)
    assert set(np.unique(np.round(got / amax[:, None]))) <= {-1.0, 0.0, 1.0}


# ------------------------------------------------------------------ products
def i16_bound(ref: np.ndarray, x: np.ndarray) -> np.ndarray:
    """What int16 activations may add: per group of 32, step / 2 times sum |w| (ntok, rows)."""
    x = np.asarray(x, np.float64)
    half_step = np.abs(x.reshape(x.shape[0], -1, 32)).max(axis=2) / 32767 / 2
    return half_step @ np.abs(ref).reshape(ref.shape[0], -1, 32).sum(axis=2).T


@pytest.mark.parametrize("cols", [512, 1408], ids=["512", "1408"])
@pytest.mark.parametrize("qtype", LAYOUTS, ids=layout_id)
def test_dot_products_on_every_isa(qtype: QT, cols: int, rng) -> None:
    """vec_dot (f32 activations) and vec_dot_i16 (the integer path) against the dequantized
    weights in float64, and every ISA against the portable kernels."""
    raw = q2_0.random_blocks(rng, int(qtype), 9, cols)
    ref = q2_0.decode(raw, int(qtype)).astype(np.float64)
    # groups of very different magnitudes: each has its own int16 step
    x = (rng.standard_normal(cols) * np.repeat(rng.uniform(0.01, 10, cols // 32), 32)).astype(
        np.float32
    )
    want = ref @ x.astype(np.float64)
    scale = np.abs(ref) @ np.abs(x.astype(np.float64))
    bound = i16_bound(ref, x[None])[0]
    results = {}
    for isa in K.available_isas():
        with K.use_isa(isa):
            dot = np.array([K.vec_dot(qtype, row, x) for row in raw])
            dotq = np.array([K.vec_dot_i16(qtype, row, x) for row in raw])
        assert np.all(np.abs(dot - want) <= 1e-5 * scale), isa.name
        assert np.all(np.abs(dotq - want) <= 1e-5 * scale + bound), isa.name
        results[isa] = dot, dotq
    dot0, dotq0 = results[K.Isa.PORTABLE]
    for isa, (dot, dotq) in results.items():
        assert np.all(np.abs(dot - dot0) <= 1e-5 * scale), isa.name
        # the same integers on every path: only the float sums may round differently
        assert np.all(np.abs(dotq - dotq0) <= 1e-5 * scale), isa.name


@pytest.mark.parametrize("precision", list(K.DecodePrecision), ids=lambda p: p.name)
@pytest.mark.parametrize("qtype", LAYOUTS, ids=layout_id)
def test_matmul_every_path(qtype: QT, precision: K.DecodePrecision, rng) -> None:
    """Decode's products (1 to 8 tokens a call, int16 or f32) and prefill's GEMM over decoded
    panels, inline and on a pool."""
    K.select_decode_precision(precision)
    rows, cols = 37, 640
    raw = q2_0.random_blocks(rng, int(qtype), rows, cols)
    ref = q2_0.decode(raw, int(qtype)).astype(np.float64)
    x = rng.standard_normal((40, cols), dtype=np.float32)
    with K.Pool(2) as pool:
        for isa in K.available_isas():
            with K.use_isa(isa):
                for ntok in (1, 2, 9, 40):
                    xs = x[:ntok].astype(np.float64)
                    for p in (None, pool):
                        got = K.matmul(qtype, raw, rows, cols, x[:ntok], pool=p)
                        extra = 0.0
                        if precision == K.DecodePrecision.I16 and ntok < 32:
                            extra = i16_bound(ref, xs) * 1.001
                        err = np.abs(got - xs @ ref.T)
                        assert np.all(err <= 1e-5 * (np.abs(xs) @ np.abs(ref).T) + extra), (
                            isa,
                            ntok,
                        )


@pytest.mark.parametrize("qtype", LAYOUTS, ids=layout_id)
def test_int16_rows_do_not_depend_on_the_batch(qtype: QT, rng) -> None:
    """A token's integer products have the same bits alone or among up to DECODE_MAX_ROWS
    tokens, at any thread count, on every ISA."""
    K.select_decode_precision(K.DecodePrecision.I16)
    rows, cols = 45, 1152
    raw = q2_0.random_blocks(rng, int(qtype), rows, cols)
    most = K.DECODE_MAX_ROWS
    x = rng.standard_normal((most, cols), dtype=np.float32)
    for isa in K.available_isas():
        with K.use_isa(isa):
            alone = np.stack(
                [K.matmul(qtype, raw, rows, cols, x[t : t + 1])[0] for t in range(most)]
            )
            for threads in (1, 2, 3):
                with K.Pool(threads) as pool:
                    for ntok in (2, 7, 8, 9, most):
                        got = K.matmul(qtype, raw, rows, cols, x[:ntok], pool=pool)
                        np.testing.assert_array_equal(
                            got, alone[:ntok], err_msg=f"{isa.name} {threads} {ntok}"
                        )


def test_int16_products_propagate_nan(rng) -> None:
    K.select_decode_precision(K.DecodePrecision.I16)
    for qtype in LAYOUTS:
        raw = q2_0.random_blocks(rng, int(qtype), 4, 256)
        x = np.ones((2, 256), np.float32)
        x[1, 200] = np.nan
        for isa in K.available_isas():
            with K.use_isa(isa):
                y = K.matmul(qtype, raw, 4, 256, x)
            assert np.isfinite(y[0]).all() and np.isnan(y[1]).all(), (qtype.name, isa.name)


# ------------------------------------------------------------------ the loader
def _str(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()


def gguf_bytes(
    tensors: list[tuple[str, tuple[int, ...], int, bytes]],
    *,
    alignment: int = 32,
    pad_last: bool = True,
    offsets: dict[str, int] | None = None,
) -> bytes:
    """A GGUF with the given tensors (name, ne in GGUF order, type id, data bytes), each
    placed at the next aligned offset (or ``offsets[name]``) and the data padded to the
    alignment (the last tensor's only when ``pad_last``)."""
    kvs = _str("general.architecture") + struct.pack("<I", 8) + _str("llama")
    kvs += _str("general.alignment") + struct.pack("<II", 4, alignment)  # uint32
    infos, data = b"", b""
    for i, (name, ne, ggml_type, payload) in enumerate(tensors):
        offset = offsets[name] if offsets and name in offsets else len(data)
        data = data.ljust(offset, b"\0")
        infos += (
            _str(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        )
        infos += struct.pack("<IQ", ggml_type, offset)
        data = data[:offset] + payload + data[offset + len(payload) :]
        if pad_last or i + 1 < len(tensors):
            data += b"\0" * (-len(data) % alignment)
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 2) + kvs + infos
    header += b"\0" * (-len(header) % alignment)
    return header + data


def q2_bytes(qtype: QT, ne: tuple[int, ...], rng) -> bytes:
    n = int(np.prod(ne))
    return q2_0.random_blocks(rng, int(qtype), n // ne[0], ne[0]).tobytes()


def open_file(tmp_path: Path, data: bytes) -> GGUFFile:
    path = tmp_path / "q2.gguf"
    path.write_bytes(data)
    return GGUFFile.open(path)


def open_error(tmp_path: Path, data: bytes) -> str:
    with pytest.raises(GGUFError) as info:
        open_file(tmp_path, data)
    return str(info.value)


F32_TAIL = ("norm.weight", (8,), F32, np.arange(8, dtype=np.float32).tobytes())


@pytest.mark.parametrize("last", [False, True], ids=["followed", "last"])
@pytest.mark.parametrize("pad_last", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("qtype", LAYOUTS, ids=layout_id)
def test_type_42_layout_is_told_by_its_bytes(
    qtype: QT, last: bool, pad_last: bool, tmp_path, rng
) -> None:
    """A type-42 tensor of 256 x 8 holds 576 bytes as Q2_0 and 544 as Q2_0_128: whichever
    the file gives it (to the next tensor, or to the end of the file, padded or not), the
    tensor comes out as that type with exactly those bytes."""
    ne = (256, 8)
    payload = q2_bytes(qtype, ne, rng)
    assert len(payload) == {QT.Q2_0: 576, QT.Q2_0_128: 544}[qtype]
    tensors = [("blk.0.w", ne, 42, payload)]
    tensors = tensors + [F32_TAIL] if not last else [F32_TAIL, *tensors]
    gf = open_file(tmp_path, gguf_bytes(tensors, pad_last=pad_last))
    info = gf.tensors["blk.0.w"]
    assert info.ggml_type == int(qtype) and info.type_name == qtype.name
    assert info.shape == (8, 256) and info.n_elements == 2048
    assert info.nbytes == len(payload) == info.data.nbytes and info.row_bytes == len(payload) // 8
    assert info.data.tobytes() == payload
    np.testing.assert_array_equal(gf.tensors["norm.weight"].data.view(np.float32), np.arange(8))
    got = K.dequantize_row(info.ggml_type, info.data, info.n_elements)
    np.testing.assert_array_equal(
        got, q2_0.decode(np.frombuffer(payload, np.uint8), int(qtype)).reshape(-1)
    )
    # families ask for MATRIX_TYPES: both layouts pass
    assert gf.require("blk.0.w", ggml_types=K.MATRIX_TYPES, shape=(8, 256)) is info


def test_padding_within_the_alignment_is_allowed(tmp_path, rng) -> None:
    """Rows of 64 (Q2_0 only): 3 blocks, 54 bytes, padded to 64 before the next tensor."""
    payload = q2_bytes(QT.Q2_0, (64, 3), rng)
    gf = open_file(tmp_path, gguf_bytes([("w", (64, 3), 42, payload), F32_TAIL]))
    assert gf.tensors["w"].ggml_type == int(QT.Q2_0) and gf.tensors["w"].nbytes == 54
    # with a 256-byte alignment the same tensor spans 256 bytes: still Q2_0 only
    gf = open_file(tmp_path, gguf_bytes([("w", (64, 3), 42, payload), F32_TAIL], alignment=256))
    assert gf.tensors["w"].ggml_type == int(QT.Q2_0)


@pytest.mark.parametrize("last", [False, True], ids=["followed", "last"])
def test_ambiguous_tiny_tensor_is_refused(last: bool, tmp_path, rng) -> None:
    """128 elements: 36 bytes as Q2_0, 34 as Q2_0_128, both padded to the same 64."""
    payload = q2_bytes(QT.Q2_0, (128, 1), rng)
    tensors = [("tiny.weight", (128, 1), 42, payload)]
    tensors = tensors + [F32_TAIL] if not last else [F32_TAIL, *tensors]
    message = open_error(tmp_path, gguf_bytes(tensors, pad_last=False))
    assert "tensor 'tiny.weight'" in message and "ambiguous" in message
    assert "36 bytes in blocks of 64" in message and "34 bytes in blocks of 128" in message


def test_truncated_or_odd_spans_are_refused(tmp_path, rng) -> None:
    ne = (256, 8)  # 576 bytes as Q2_0, 544 as Q2_0_128
    payload = q2_bytes(QT.Q2_0_128, ne, rng)
    data = gguf_bytes([F32_TAIL, ("blk.3.ffn_up.weight", ne, 42, payload)])
    message = open_error(tmp_path, data[:-10])  # the last tensor cut short
    assert "tensor 'blk.3.ffn_up.weight'" in message and "fits no block layout" in message
    assert "truncated or corrupt" in message and "534 bytes" in message
    # a span longer than either layout padded: the next tensor does not follow it
    gap = gguf_bytes([("w", ne, 42, payload), F32_TAIL], offsets={"norm.weight": 640})
    assert "tensor 'w'" in open_error(tmp_path, gap)
    # a span between the two: 560 bytes before the next tensor
    mid = gguf_bytes(
        [("w", ne, 42, payload + bytes(16)), ("x", (8,), F32, bytes(32))], alignment=16
    )
    assert "fits no block layout" in open_error(tmp_path, mid)
    # rows that are not whole blocks of 64
    rows32 = gguf_bytes([("w", (32, 2), 42, bytes(18))])
    assert "row length 32 is not a multiple of the Q2_0 block size 64" in open_error(
        tmp_path, rows32
    )


def test_own_id_in_a_file_is_the_128_layout(tmp_path, rng) -> None:
    """Type 142 (PrismML's later id for the 128-element layout) needs no detection; anything
    else the gguf package does not know is still refused by name."""
    payload = q2_bytes(QT.Q2_0_128, (128, 4), rng)
    gf = open_file(tmp_path, gguf_bytes([("w", (128, 4), 142, payload)]))
    assert gf.tensors["w"].ggml_type == int(QT.Q2_0_128) and gf.tensors["w"].nbytes == 136
    with pytest.raises(GGUFError, match="has type Q2_0_128, expected one of F32, Q2_0"):
        gf.require("w", ggml_types=(F32, 42))
    message = open_error(tmp_path, gguf_bytes([("w", (128, 4), 143, payload)]))
    assert "tensor 'w': unknown GGML type 143" in message


# ------------------------------------------------------------------ a model
N_EMBD, N_FF, N_HEAD, N_KV, N_VOCAB, N_LAYER = 128, 256, 4, 2, 160, 2
KEYS = {
    "block_count": N_LAYER,
    "context_length": 256,
    "embedding_length": N_EMBD,
    "feed_forward_length": N_FF,
    "attention.head_count": N_HEAD,
    "attention.head_count_kv": N_KV,
    "rope.freq_base": 10000.0,
    "rope.dimension_count": N_EMBD // N_HEAD,
    "attention.layer_norm_rms_epsilon": 1e-5,
    "vocab_size": N_VOCAB,
}


def llama_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    hd = N_EMBD // N_HEAD

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(N_EMBD)).astype(np.float32)

    w = {"token_embd.weight": rng.standard_normal((N_VOCAB, N_EMBD)).astype(np.float32)}
    for i in range(N_LAYER):
        w |= {
            f"blk.{i}.attn_norm.weight": norm(),
            f"blk.{i}.attn_q.weight": mat(N_HEAD * hd, N_EMBD),
            f"blk.{i}.attn_k.weight": mat(N_KV * hd, N_EMBD),
            f"blk.{i}.attn_v.weight": mat(N_KV * hd, N_EMBD),
            f"blk.{i}.attn_output.weight": mat(N_EMBD, N_HEAD * hd),
            f"blk.{i}.ffn_norm.weight": norm(),
            f"blk.{i}.ffn_gate.weight": mat(N_FF, N_EMBD),
            f"blk.{i}.ffn_up.weight": mat(N_FF, N_EMBD),
            f"blk.{i}.ffn_down.weight": mat(N_EMBD, N_FF),
        }
    w["output_norm.weight"] = norm()
    w["output.weight"] = mat(N_VOCAB, N_EMBD)
    return w


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same tiny llama three times: every matrix (the embeddings included) as type 42 in
    each layout, and as F32 holding exactly the values those blocks decode to (the two
    layouts' values differ: one scale per 64 or per 128 weights)."""
    root = tmp_path_factory.mktemp("q2_llama")
    weights = llama_weights(np.random.default_rng(7))
    paths = {}
    for qtype in LAYOUTS:
        quant, plain = [], []
        for name, w in weights.items():
            if w.ndim == 2:
                raw = q2_0.encode(w, int(qtype))
                quant.append((name, 42, w.shape, raw))
                plain.append((name, F32, w.shape, q2_0.decode(raw, int(qtype))))
            else:
                quant.append((name, F32, w.shape, w))
                plain.append((name, F32, w.shape, w))
        paths[qtype.name] = root / f"{qtype.name}.gguf"
        paths[f"{qtype.name}-f32"] = root / f"{qtype.name}-f32.gguf"
        q2_0.write_gguf(paths[qtype.name], "llama", KEYS, quant)
        q2_0.write_gguf(paths[f"{qtype.name}-f32"], "llama", KEYS, plain)
    return paths


@pytest.mark.parametrize("qtype", LAYOUTS, ids=layout_id)
def test_llama_with_q2_0_matrices_serves(qtype: QT, llama_files: dict[str, Path]) -> None:
    """Logits of the Q2_0 file equal those of the F32 file of its decoded weights to f32
    rounding, for a prompt in one pass (prefill's GEMM), token by token (decode's products)
    and on the default int16 decode within its rounding; batched decode gives each sequence
    the bits it gets alone."""
    llama_model = pytest.importorskip("lmserve_llama.model")
    from lmserve_core.testing.numerics import check_batched_decode, f32_products, stepped_logits

    gguf_q2 = GGUFFile.open(llama_files[qtype.name])
    assert {gguf_q2.tensors[n].ggml_type for n in gguf_q2.tensors if n.endswith("_q.weight")} == {
        int(qtype)
    }
    assert gguf_q2.tensors["token_embd.weight"].ggml_type == int(qtype)
    gguf_f32 = GGUFFile.open(llama_files[f"{qtype.name}-f32"])
    q2 = llama_model.LlamaModel.load(gguf_q2, n_threads=2, kv_type="f32")
    f32 = llama_model.LlamaModel.load(gguf_f32, n_threads=2, kv_type="f32")
    ids = [int(t) for t in np.random.default_rng(3).integers(0, N_VOCAB, 40)]
    with f32_products():
        want = f32.forward(f32.new_cache(48), ids, 0, all_logits=True)
        tol = 1e-4 * max(1.0, float(np.abs(want).max()))
        got = q2.forward(q2.new_cache(48), ids, 0, all_logits=True)  # 40 tokens: GEMM
        np.testing.assert_allclose(got, want, rtol=0, atol=tol)
        np.testing.assert_allclose(stepped_logits(q2, ids[:12]), want[:12], rtol=0, atol=tol)
    # int16 activations in decode's products: a few 1e-4 of a logit here
    stepped = stepped_logits(q2, ids[:12])
    np.testing.assert_allclose(stepped, want[:12], rtol=0, atol=1e-3 * np.abs(want).max())
    assert (stepped.argmax(axis=1) == want[:12].argmax(axis=1)).mean() >= 0.9
    check_batched_decode(q2, [ids[:5], ids[10:13], ids[20:27]], n_steps=4)
