"""The family kit: caches, threaded row ops, metadata and RoPE helpers, each against an
independent reference (numpy, and transformers' own RoPE initialisers where installed)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter

from lmserve_core.backend import Capabilities, ServerSettings
from lmserve_core.gguf_file import GGUFError, GGUFFile
from lmserve_core.kit import (
    DecoderConfig,
    HParams,
    base_inv_freq,
    experts_hparams,
    llama3_inv_freq,
    rope_from_gguf,
    yarn_inv_freq,
)
from lmserve_core.kit.family import BackendSpec, Family
from lmserve_core.model import FamilyConventions
from lmserve_core.native import cache as cache_mod
from lmserve_core.native import kernels as K
from lmserve_core.testing.gguf_writer import add_arch_metadata

ISAS = K.available_isas()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


@pytest.fixture(params=ISAS, ids=lambda i: i.name)
def isa(request: pytest.FixtureRequest) -> Any:
    with K.use_isa(request.param):
        yield request.param


# ---------------------------------------------------------------------------- f16 storage


def test_f16_rounding_matches_ieee_nearest_even(isa: Any, rng: np.random.Generator) -> None:
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    edge = np.array(
        [0.0, -0.0, 65504, 65519.99, 65520, -65520, 2**-24, 2**-25, 3 * 2**-26, 2**-14,
         2**-14 - 2**-25, 1 + 2**-11, 1 + 3 * 2**-11, np.inf, -np.inf],
        np.float32,
    )
    x = np.concatenate([edge, x, rng.standard_normal(10_000).astype(np.float32)])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    got = cache_mod.f32_to_f16(x)
    assert (got.view(np.uint16) == want.view(np.uint16)).all()
    assert np.isnan(cache_mod.f32_to_f16(np.array([np.nan], np.float32))).all()


# ---------------------------------------------------------------------------- caches


GEOMETRY = [(2, 16, 16), (1, 32, 32), (2, 16, 16)]


def kv_rows(rng: np.random.Generator, layer: tuple[int, int, int], n: int) -> tuple[Any, Any]:
    heads, dk, dv = layer
    return (
        rng.standard_normal((n, heads * dk)).astype(np.float32),
        rng.standard_normal((n, heads * dv)).astype(np.float32),
    )


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_cache_rows_round_trip(kv_type: str, rng: np.random.Generator) -> None:
    cache = cache_mod.Cache(GEOMETRY, 64, kv_type)
    assert cache.bytes_per_pos == sum(h * (dk + dv) for h, dk, dv in GEOMETRY) * (
        2 if kv_type == "f16" else 4
    )
    rows = [kv_rows(rng, g, 10) for g in GEOMETRY]
    for layer, (k, v) in enumerate(rows):
        cache.write(layer, 5, k, v)
    for layer, (k, v) in enumerate(rows):
        got_k, got_v = cache.read(layer, 5, 10)
        cast = (lambda a: a.astype(np.float16).astype(np.float32)) if kv_type == "f16" else (
            lambda a: a
        )
        np.testing.assert_array_equal(got_k, cast(k))
        np.testing.assert_array_equal(got_v, cast(v))
    with pytest.raises(K.KernelValueError):
        cache.write(0, 60, *kv_rows(rng, GEOMETRY[0], 5))  # past n_ctx
    with pytest.raises(K.KernelValueError):
        cache.read(3, 0, 1)


def test_cache_copy_and_state_keep_exact_rows(rng: np.random.Generator) -> None:
    src = cache_mod.Cache(GEOMETRY, 32, "f16")
    for layer, g in enumerate(GEOMETRY):
        src.write(layer, 0, *kv_rows(rng, g, 20))
    dst = cache_mod.Cache(GEOMETRY, 24, "f16")
    src.copy_to(dst, 12)
    state = src.state(12)
    assert state.nbytes == 12 * src.bytes_per_pos
    np.testing.assert_array_equal(dst.state(12), state)
    restored = cache_mod.Cache(GEOMETRY, 16, "f16")
    restored.load(12, state)
    for layer in range(len(GEOMETRY)):
        for a, b in zip(restored.read(layer, 0, 12), src.read(layer, 0, 12), strict=True):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(K.KernelMismatchError):
        src.copy_to(cache_mod.Cache(GEOMETRY, 32, "f32"), 4)
    with pytest.raises(K.KernelMismatchError):
        src.copy_to(cache_mod.Cache(GEOMETRY[:2], 32, "f16"), 4)
    with pytest.raises(K.KernelValueError):
        src.copy_to(dst, 25)
    with pytest.raises(K.KernelValueError):
        restored.load(12, state[:-1])


def test_cache_rejects_absurd_geometry() -> None:
    with pytest.raises(K.KernelValueError):
        cache_mod.Cache([(0, 16, 16)], 8)
    with pytest.raises(K.KernelValueError):
        cache_mod.Cache([(1, 16, 16)], 8, "q8_0")
    with pytest.raises(K.KernelValueError):
        cache_mod.Cache([(1 << 17, 16, 16)], 8)


@pytest.mark.parametrize("ntok", [1, 3, 24])  # decode path, few tokens, tiled prefill path
def test_attention_over_f16_cache_equals_f32_attention_on_rounded_rows(
    ntok: int, isa: Any, rng: np.random.Generator
) -> None:
    n_ctx, heads, kv_heads, hd = 48, 4, 2, 32
    pos0 = n_ctx - ntok
    k, v = kv_rows(rng, (kv_heads, hd, hd), n_ctx)
    q = rng.standard_normal((ntok, heads, hd)).astype(np.float32)
    cache = cache_mod.Cache([(kv_heads, hd, hd)], n_ctx, "f16")
    cache.write(0, 0, k, v)
    rk, rv = (a.astype(np.float16).astype(np.float32).reshape(n_ctx, kv_heads, hd) for a in (k, v))
    with K.Pool(2) as pool:
        for window, softcap in [(0, 0.0), (7, 0.0), (0, 5.0)]:
            want = K.attention(q, rk, rv, pos0, 0.2, window, softcap, pool)
            got = cache.attention(0, q, pos0, 0.2, window, softcap, pool)
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("chunk", [1, 3, 8, 13, 20])  # decode path, few tokens, tiled prefill
def test_ring_cache_attends_like_full_rows(
    kv_type: str, chunk: int, isa: Any, rng: np.random.Generator
) -> None:
    # A sliding-window layer keeps a ring of window + chunk rows: fed chunk by chunk over a
    # context several rings long, its attention equals windowed attention over every row.
    n_ctx, heads, kv_heads, hd, window = 96, 4, 2, 32, 9
    ring = window + chunk
    k, v = kv_rows(rng, (kv_heads, hd, hd), n_ctx)
    q = rng.standard_normal((n_ctx, heads, hd)).astype(np.float32)
    cache = cache_mod.Cache([(kv_heads, hd, hd, ring), (kv_heads, hd, hd)], n_ctx, kv_type)
    assert cache.rings == [ring, 0]
    row = 2 * kv_heads * hd * (2 if kv_type == "f16" else 4)
    assert cache.bytes_per_pos == row  # only the full layer grows with the context
    assert cache.bytes == (ring + n_ctx) * row == cache_mod.cache_bytes(
        [(kv_heads, hd, hd, ring), (kv_heads, hd, hd)], n_ctx, kv_type
    )
    rounded = (lambda a: a.astype(np.float16).astype(np.float32)) if kv_type == "f16" else (
        lambda a: a
    )
    rk, rv = (rounded(a).reshape(n_ctx, kv_heads, hd) for a in (k, v))
    with K.Pool(2) as pool:
        for pos in range(0, n_ctx, chunk):
            n = min(chunk, n_ctx - pos)
            for layer in range(2):
                cache.write(layer, pos, k[pos : pos + n], v[pos : pos + n])
            want = K.attention(q[: pos + n], rk[: pos + n], rv[: pos + n], 0, 0.2, window,
                               3.0, pool)[pos:]
            for layer in range(2):
                got = cache.attention(layer, q[pos : pos + n], pos, 0.2, window, 3.0, pool)
                np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
        # the ring holds the last `ring` positions; older ones are gone
        got_k, _ = cache.read(0, n_ctx - ring, ring)
        np.testing.assert_array_equal(got_k, rounded(k[n_ctx - ring :]))
        with pytest.raises(K.KernelValueError):
            cache.read(0, 0, ring + 1)
        # a chunk whose first query's window no longer fits in the ring is refused
        with pytest.raises(K.KernelValueError):
            cache.attention(0, q[: chunk + 2], n_ctx - chunk - 2, 0.2, window, 0.0, pool)
        with pytest.raises(K.KernelValueError):
            cache.attention(0, q[:1], n_ctx - 1, 0.2, 0, 0.0, pool)  # no window at all


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(4, 2, 32), (9, 3, 64), (4, 1, 256)])
def test_decode_attention_of_a_token_does_not_depend_on_its_neighbours(
    kv_type: str, heads: int, kv_heads: int, hd: int, isa: Any, rng: np.random.Generator
) -> None:
    # A verify pass or a small prefill chunk attends several tokens together (the rows of a
    # chunk read once for the queries that see the same keys); each token must get exactly
    # the bits it gets alone: greedy speculative decoding relies on it. Windowed layers on a
    # ring that wraps inside chunks, full layers over several chunks.
    n_ctx, window, ntok = 700, 300, K.DECODE_MAX_ROWS  # the most a verify pass may have
    ring = window + ntok - 1
    geometry = [(kv_heads, hd, hd, ring), (kv_heads, hd, hd)]
    k, v = kv_rows(rng, (kv_heads, hd, hd), n_ctx)
    q = rng.standard_normal((ntok, heads, hd)).astype(np.float32)
    pos0 = n_ctx - ntok
    cache = cache_mod.Cache(geometry, n_ctx, kv_type)
    for layer in range(2):
        for pos in range(0, n_ctx, ntok):
            cache.write(layer, pos, k[pos : pos + ntok], v[pos : pos + ntok])
    with K.Pool(2) as pool:
        for layer, win in ((0, window), (1, 0), (1, 40)):
            for p in (None, pool):
                together = cache.attention(layer, q, pos0, 0.125, win, 0.0, p)
                for first, n in ((0, 1), (0, 3), (2, 5), (6, 1), (7, 8), (ntok - 1, 1)):
                    part = cache.attention(layer, q[first : first + n], pos0 + first, 0.125,
                                           win, 0.0, p)
                    np.testing.assert_array_equal(part, together[first : first + n])


def test_ring_cache_copy_and_state_keep_resident_rows(rng: np.random.Generator) -> None:
    geometry = [(1, 16, 16, 6), (2, 8, 8)]
    rows = [kv_rows(rng, g[:3], 20) for g in geometry]
    # held 5 (the ring not yet wrapped) and held 20 (wrapped: positions 14..19 resident)
    for held, n in ((5, 4), (20, 20)):
        src = cache_mod.Cache(geometry, 32, "f32")
        for layer, (k, v) in enumerate(rows):
            src.write(layer, 0, k[:held], v[:held])
        state = src.state(n)
        # a state of n positions holds min(n, ring) rows of a ring layer
        assert state.nbytes == (min(n, 6) * 2 * 16 + n * 2 * 16) * 4
        dst = cache_mod.Cache(geometry, 32, "f32")
        dst.load(n, state)
        copied = cache_mod.Cache(geometry, 32, "f32")
        src.copy_to(copied, n)
        lo = max(0, n - 6)
        for cache in (dst, copied):
            got_k, got_v = cache.read(0, lo, n - lo)
            np.testing.assert_array_equal(got_k, rows[0][0][lo:n])
            np.testing.assert_array_equal(got_v, rows[0][1][lo:n])
            np.testing.assert_array_equal(cache.read(1, 0, n)[0], rows[1][0][:n])
    with pytest.raises(K.KernelMismatchError):  # rings of another size
        src.copy_to(cache_mod.Cache([(1, 16, 16, 7), (2, 8, 8)], 32, "f32"), 10)


# ---------------------------------------------------------------------------- row ops


def test_rmsnorm_rows_per_head(isa: Any, rng: np.random.Generator) -> None:
    x = rng.standard_normal((40, 8, 64)).astype(np.float32)  # (ntok, heads, head_dim)
    w = rng.standard_normal(64).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * w
    with K.Pool(2) as pool:
        got = K.rmsnorm_rows(x, w, 1e-6, pool)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("mode", [K.RopeMode.NORMAL, K.RopeMode.NEOX], ids=lambda m: m.name)
def test_rope_rows_match_reference(mode: Any, rng: np.random.Generator) -> None:
    ntok, heads, hd, n_rot, pos0 = 9, 3, 16, 12, 100
    x = rng.standard_normal((ntok, heads, hd)).astype(np.float32)
    inv = (rng.uniform(0.01, 1.0, n_rot // 2)).astype(np.float32)
    with K.Pool(2) as pool:
        got = K.rope_rows(x, pos0, inv, mode, mscale=1.25, pool=pool)
    theta = (np.arange(pos0, pos0 + ntok)[:, None] * inv[None, :].astype(np.float64))[:, None, :]
    cos, sin = 1.25 * np.cos(theta), 1.25 * np.sin(theta)
    want = x.astype(np.float64).copy()
    if mode == K.RopeMode.NEOX:
        a, b = x[..., : n_rot // 2], x[..., n_rot // 2 : n_rot]
        want[..., : n_rot // 2] = a * cos - b * sin
        want[..., n_rot // 2 : n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        want[..., 0:n_rot:2] = a * cos - b * sin
        want[..., 1:n_rot:2] = a * sin + b * cos
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)  # float angles at pos ~100
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])


@pytest.mark.parametrize("act", list(K.Activation), ids=lambda a: a.name)
def test_glu_rows_match_single_thread_op(act: Any, rng: np.random.Generator) -> None:
    gate, up = (rng.standard_normal(50_001).astype(np.float32) for _ in range(2))
    if act == K.Activation.RELU2:
        single = np.square(np.maximum(gate, 0)) * up
    else:
        single = K.silu_mul(gate, up) if act == K.Activation.SILU else K.gelu_mul(gate, up)
    with K.Pool(2) as pool:
        np.testing.assert_array_equal(K.glu_rows(gate, up, act, pool), single)


@pytest.mark.parametrize("ntok", [1, 5, 40])
def test_matmuls_equal_separate_products(ntok: int, rng: np.random.Generator) -> None:
    from gguf.quants import quantize

    shapes = [(96, 64), (40, 64), (200, 32)]
    products = []
    for rows, cols in shapes:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        raw = quantize(w, K.QuantType.Q8_0)  # type: ignore[arg-type]
        x = rng.standard_normal((ntok, cols)).astype(np.float32)
        products.append((int(K.QuantType.Q8_0), raw, rows, cols, x))
    with K.Pool(2) as pool:
        together = K.matmuls(products, pool)
        for (qtype, raw, rows, cols, x), got in zip(products, together, strict=True):
            np.testing.assert_array_equal(got, K.matmul(qtype, raw, rows, cols, x, pool))


# ---------------------------------------------------------------------------- experts


@contextlib.contextmanager
def layer_base(n_embd: int, n_batch: int) -> Iterator[Any]:
    """An lm_base for the layer helpers alone (its chunk function is never run)."""
    from lmserve_core._kernels import ffi, lib

    chunk = ffi.callback("lm_chunk_fn", lambda *args: -1)
    layer = ffi.new("lm_cache_layer *", {"n_kv_head": 1, "head_dim_k": 8, "head_dim_v": 8})
    base = ffi.new("lm_base *")
    assert lib.lm_base_init(base, 2, n_batch, 16, n_embd, 1, layer, chunk, ffi.NULL) == 0
    try:
        yield base
    finally:
        lib.lm_base_free(base)


@pytest.mark.parametrize("ntok", [1, 6])
def test_moe_experts_split_and_fused_match_reference(ntok: int, rng: np.random.Generator) -> None:
    from lmserve_core._kernels import ffi, lib

    E, K_used, D, FF = 5, 2, 32, 24
    gate, up = (rng.standard_normal((E, FF, D)).astype(np.float32) / 4 for _ in range(2))
    down = rng.standard_normal((E, D, FF)).astype(np.float32) / 4
    fused = np.ascontiguousarray(np.concatenate([gate, up], axis=1))  # per expert: gate, up
    x = rng.standard_normal((ntok, D)).astype(np.float32)
    ids = np.stack([rng.choice(E, K_used, replace=False) for _ in range(ntok)]).astype(np.int32)
    w = rng.random((ntok, K_used)).astype(np.float32)
    want = np.zeros((ntok, D), np.float32)
    for t in range(ntok):
        for e, wt in zip(ids[t], w[t], strict=True):
            g, u = gate[e] @ x[t], up[e] @ x[t]
            want[t] += wt * (down[e] @ (g / (1 + np.exp(-g)) * u))

    def matrix(a: K.F32Array) -> dict[str, Any]:
        return {"data": ffi.from_buffer(a), "type": int(K.QuantType.F32)}

    sizes = {"n_expert": E, "n_used": K_used, "n_ff": FF, "act": int(K.Activation.SILU)}
    split = ffi.new("lm_moe *", {"gate_exps": matrix(gate), "up_exps": matrix(up),
                                 "down_exps": matrix(down), **sizes})
    one = ffi.new("lm_moe *", {"gate_up_exps": matrix(fused), "down_exps": matrix(down), **sizes})
    ids_p, w_p = ffi.from_buffer("int32_t[]", ids), ffi.from_buffer("float[]", w)

    def run(base: Any, m: Any, ids: Any, w: Any, x: K.F32Array, y: K.F32Array) -> int:
        xp, yp = ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", y)
        return int(lib.lm_moe_experts(base, m, xp, ntok, ids, w, yp))

    with layer_base(D, 8) as base:
        got = np.empty((ntok, D), np.float32)
        assert run(base, split, ids_p, w_p, x, got) == 0
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        y = np.empty_like(got)
        assert run(base, one, ids_p, w_p, x, y) == 0
        np.testing.assert_array_equal(y, got)
        xy = x.copy()  # y may be x
        assert lib.lm_moe_experts(base, one, ffi.from_buffer("float[]", xy), ntok, ids_p, w_p,
                                  ffi.from_buffer("float[]", xy)) == 0
        np.testing.assert_array_equal(xy, got)
        bad = ids.copy()
        bad[-1, -1] = E
        assert run(base, split, ffi.from_buffer("int32_t[]", bad), w_p, x, y) == lib.LM_EINVAL

    with layer_base(D, 8) as base:
        # a routing in the base's scratch is kept while the experts' scratch grows past it
        tmp = lib.lm_base_tmp(base, 64 + w.nbytes)
        ids_t, w_t = ffi.cast("int32_t *", tmp), ffi.cast("float *", ffi.cast("char *", tmp) + 64)
        ffi.memmove(ids_t, ids.tobytes(), ids.nbytes)
        ffi.memmove(w_t, w.tobytes(), w.nbytes)
        y = np.empty_like(got)
        assert run(base, split, ids_t, w_t, x, y) == 0
        assert base.tmp != tmp
        np.testing.assert_array_equal(y, got)


# ---------------------------------------------------------------------------- metadata


def write_meta(path: Path, keys: dict[str, Any], arch: str = "testarch") -> GGUFFile:
    writer = GGUFWriter(str(path), arch)
    add_arch_metadata(writer, arch, keys)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile.open(path)


def test_hparams_read_and_reject(tmp_path: Path) -> None:
    gguf = write_meta(
        tmp_path / "m.gguf",
        {"block_count": 4, "embedding_length": 64, "rope.freq_base": 5e5, "name": "x",
         "head_count_kv": [2, 2, 1, 1], "huge": 1 << 30, "zero": 0},
    )
    hp = HParams(gguf)
    assert hp.block_count() == 4 and hp.integer("embedding_length") == 64
    assert hp.number("rope.freq_base") == 5e5 and hp.text("name") == "x"
    assert hp.integer("missing", 7) == 7 and not hp.has("missing")
    assert hp.per_layer("head_count_kv", 4) == [2, 2, 1, 1]
    assert hp.per_layer("embedding_length", 3) == [64, 64, 64]
    for call, message in [
        (lambda: hp.integer("missing"), "testarch.missing is missing"),
        (lambda: hp.integer("huge"), "outside"),
        (lambda: hp.integer("zero"), "outside"),
        (lambda: hp.integer("name"), "expected an integer"),
        (lambda: hp.number("zero"), "finite number > 0"),
        (lambda: hp.per_layer("head_count_kv", 5), "4 values for 5 layers"),
    ]:
        with pytest.raises(GGUFError, match=message):
            call()


def test_served_and_experts_hparams(tmp_path: Path) -> None:
    moe = write_meta(tmp_path / "moe.gguf", {"expert_count": 8, "expert_used_count": 2},
                     arch="fammoe")
    hp = HParams.served(moe, ("fam", "fammoe"), "fam")
    assert experts_hparams(hp, moe=True, moe_architecture="fammoe") == {
        "n_expert": 8, "n_expert_used": 2, "expert_weights_scale": 1.0,
    }
    with pytest.raises(GGUFError, match="architecture 'fammoe' is not served by the x family"):
        HParams.served(moe, ("fam",), "x")
    dense = HParams(write_meta(tmp_path / "dense.gguf", {"expert_count": 8}, arch="fam"))
    with pytest.raises(GGUFError, match="a fam GGUF with experts: .* should be fammoe"):
        experts_hparams(dense, moe=False, moe_architecture="fammoe")
    empty = HParams(write_meta(tmp_path / "empty.gguf", {"expert_count": 0}, arch="fammoe"))
    with pytest.raises(GGUFError, match="fammoe.expert_count must be at least 1"):
        experts_hparams(empty, moe=True, moe_architecture="fammoe")


def test_family_declares_its_backends(tmp_path: Path) -> None:
    conventions = FamilyConventions(capabilities=Capabilities())
    backends = [BackendSpec("fam", ("fam", "fammoe"), "a family")]
    family = Family("fam", model={"fam": "lmserve_core.kit:NativeForwardModel",
                                  "fammoe": "lmserve_core.kit:DecoderConfig"},
                    conventions=conventions, backends=backends)
    assert family.model_class("fammoe") is DecoderConfig
    calls: list[tuple[Any, ...]] = []
    family.register_backends(lambda *args, **kwargs: calls.append((*args, kwargs)))
    # one factory object, which a plugin module hands out as its own create_backend
    assert calls == [("fam", family.create_backend,
                      {"architectures": ("fam", "fammoe"), "description": "a family"})]
    assert family.create_backend is family.create_backend
    with pytest.raises(FileNotFoundError, match="lmserve --backend fam model.gguf"):
        family.create_backend(None, ServerSettings())
    other = write_meta(tmp_path / "other.gguf", {}, arch="other")
    with pytest.raises(GGUFError, match=r"'other' is not served by the fam family \(fam, fammoe\)"):
        family.create_backend(str(other.path), ServerSettings())
    with pytest.raises(ValueError, match="no model class"):
        Family("fam", model={"fam": "x:Y"}, conventions=conventions, backends=backends)


# ---------------------------------------------------------------------------- rope


def test_rope_from_gguf_schemes(tmp_path: Path) -> None:
    plain = rope_from_gguf(HParams(write_meta(tmp_path / "a.gguf", {})), head_dim=64, mode=2)
    assert plain.n_rot == 64 and plain.mscale == 1.0
    np.testing.assert_allclose(plain.inv_freq, 10000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-6)
    linear = rope_from_gguf(
        HParams(write_meta(tmp_path / "b.gguf", {"rope.scaling.type": "linear",
                                                  "rope.scaling.factor": 4.0})),
        head_dim=64, mode=2,
    )
    np.testing.assert_allclose(linear.inv_freq, plain.inv_freq / 4, rtol=1e-6)
    yarn = rope_from_gguf(
        HParams(write_meta(tmp_path / "c.gguf", {
            "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.freq_base": 1e6,
            "rope.scaling.original_context_length": 32768})),
        head_dim=128, mode=2,
    )
    assert yarn.mscale == pytest.approx(0.1 * math.log(4) + 1)
    with pytest.raises(GGUFError, match="not supported"):
        rope_from_gguf(
            HParams(write_meta(tmp_path / "d.gguf", {"rope.scaling.type": "su",
                                                      "rope.scaling.factor": 2.0})),
            head_dim=64, mode=2,
        )


def test_rope_scalings_match_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def reference(rope_type: str, **params: Any) -> tuple[np.ndarray, float]:
        config = transformers.PretrainedConfig()
        config.hidden_size, config.num_attention_heads, config.head_dim = 1024, 8, 128
        config.max_position_embeddings = 131072
        config.rope_theta = 1e6
        config.rope_parameters = {"rope_type": rope_type, "rope_theta": 1e6, **params}
        inv, factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        return inv.numpy(), float(factor)

    inv, factor = reference(
        "yarn", factor=4.0, original_max_position_embeddings=32768, beta_fast=32.0, beta_slow=1.0
    )
    ours, mscale = yarn_inv_freq(1e6, 128, 4.0, 32768)
    np.testing.assert_allclose(ours, inv, rtol=1e-6)
    assert mscale == pytest.approx(factor)
    inv, _ = reference(
        "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    np.testing.assert_allclose(llama3_inv_freq(1e6, 128, 8.0, 1.0, 4.0, 8192), inv, rtol=1e-6)
    inv, _ = reference("linear", factor=2.0)
    np.testing.assert_allclose(base_inv_freq(1e6, 128) / 2, inv, rtol=1e-6)


@pytest.mark.parametrize("ntok", [1, 3, 24])  # decode path, few tokens, tiled prefill path
def test_attention_with_a_distance_bias(ntok: int, isa: Any, rng: np.random.Generator) -> None:
    # bias[t, h, d] joins the scaled score of query (t, h) and the key d positions back, for d
    # below the extent (a learned relative position bias); farther keys take none
    n_ctx, heads, kv_heads, hd, extent = 40, 4, 2, 16, 6
    pos0 = n_ctx - ntok
    k, v = kv_rows(rng, (kv_heads, hd, hd), n_ctx)
    q = rng.standard_normal((ntok, heads, hd)).astype(np.float32)
    bias = rng.standard_normal((ntok, heads, extent)).astype(np.float32)
    cache = cache_mod.Cache([(kv_heads, hd, hd)], n_ctx, "f32")
    cache.write(0, 0, k, v)
    kr, vr = (a.reshape(n_ctx, kv_heads, hd).astype(np.float64) for a in (k, v))
    with K.Pool(2) as pool:
        for window in (0, 4, 9):
            want = np.zeros((ntok, heads, hd))
            for t in range(ntok):
                pos = pos0 + t
                lo = max(0, pos - window + 1) if window else 0
                for h in range(heads):
                    s = kr[lo : pos + 1, h // 2] @ q[t, h].astype(np.float64) * 0.3
                    d = pos - np.arange(lo, pos + 1)
                    s[d < extent] += bias[t, h, d[d < extent]]
                    p = np.exp(s - s.max())
                    want[t, h] = p / p.sum() @ vr[lo : pos + 1, h // 2]
            got = cache.attention(0, q, pos0, 0.3, window, 0.0, pool, bias=bias)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
            plain = cache.attention(0, q, pos0, 0.3, window, 0.0, pool)
            zero = cache.attention(0, q, pos0, 0.3, window, 0.0, pool, bias=0 * bias)
            np.testing.assert_array_equal(zero, plain)


def _bidirectional_reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, scale: float, window: int
) -> np.ndarray:
    """Every query of the chunk over keys [window start of pos0, pos0 + ntok)."""
    ntok, heads, _ = q.shape
    group = heads // k.shape[1]
    lo = max(0, pos0 - window + 1) if window else 0
    keys, vals = k[lo : pos0 + ntok], v[lo : pos0 + ntok]
    out = np.empty_like(q)
    for h in range(heads):
        s = q[:, h] @ keys[:, h // group].T * scale
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ vals[:, h // group]
    return out


@pytest.mark.parametrize("ntok", [1, 5, 24])  # decode path, few tokens, tiled
def test_bidirectional_chunk_attends_to_the_whole_chunk(
    ntok: int, isa: Any, rng: np.random.Generator
) -> None:
    # A block-diffusion canvas: every query sees the prefix (the window before the chunk's
    # first position on a sliding layer, kept in its ring) and every row of the chunk.
    n_ctx, heads, kv_heads, hd, window = 64, 4, 2, 32, 9
    pos0 = n_ctx - ntok
    k, v = kv_rows(rng, (kv_heads, hd, hd), n_ctx)
    rk, rv = (a.reshape(n_ctx, kv_heads, hd) for a in (k, v))
    q = rng.standard_normal((ntok, heads, hd)).astype(np.float32)
    cache = cache_mod.Cache([(kv_heads, hd, hd, window + ntok), (kv_heads, hd, hd)], n_ctx, "f32")
    for pos in range(0, n_ctx, ntok):
        for layer in range(2):
            cache.write(layer, pos, k[pos : pos + ntok], v[pos : pos + ntok])
    with K.Pool(2) as pool:
        for layer, win in ((0, window), (1, 0), (1, 5)):
            got = cache.attention(layer, q, pos0, 0.2, win, 0.0, pool, bidirectional=True)
            want = _bidirectional_reference(q, rk, rv, pos0, 0.2, win)
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
            if win == 0:  # the chunk's last query sees what it sees causally
                causal = cache.attention(layer, q, pos0, 0.2, win, 0.0, pool)
                np.testing.assert_allclose(got[-1], causal[-1], rtol=0, atol=1e-6)
