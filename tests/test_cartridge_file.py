"""The cartridge file format (lmserve_core/cartridge/file.py): layout, dtypes, errors."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lmserve_core.cartridge import (
    FORMAT,
    Cartridge,
    CartridgeError,
    check_geometry,
    read_cartridge,
    write_cartridge,
)


def _cartridge(p: int = 5, heads: tuple[int, ...] = (2, 2, 1), dims=(4, 4, 8)) -> Cartridge:
    rng = np.random.default_rng(0)
    shapes = [(p, h, d) for h, d in zip(heads, dims, strict=True)]
    return Cartridge(
        k=[rng.standard_normal(s).astype(np.float32) for s in shapes],
        v=[rng.standard_normal(s).astype(np.float32) for s in shapes],
        metadata={"architecture": "llama", "model": "m.gguf", "init": "prefill"},
    )


def test_round_trip_and_reference_layout(tmp_path):
    c = _cartridge()
    path = tmp_path / "c.safetensors"
    write_cartridge(path, c)
    raw = load_file(str(path))
    assert raw["layers.0.k"].shape == (4, 2, 4)
    assert raw["layers.0.k_sink"].shape == (1, 2, 4)
    assert raw["layers.2.v"].shape == (4, 1, 8)
    assert all(a.dtype == np.float32 for a in raw.values())
    r = read_cartridge(path)
    assert r.p == 5 and r.n_layer == 3 and r.frozen_prefix == 1
    assert r.n_kv_heads == [2, 2, 1] and r.head_dim == [4, 4, 8]
    assert r.metadata["format"] == FORMAT and r.metadata["n_kv_heads"] == "2,2,1"
    assert r.metadata["architecture"] == "llama" and r.metadata["p"] == "5"
    for a, b in zip(c.k + c.v, r.k + r.v, strict=True):
        np.testing.assert_array_equal(a, b)


def test_half_precision_reads_and_metadata_free_files(tmp_path):
    c = _cartridge()
    write_cartridge(tmp_path / "c.safetensors", c)
    raw = load_file(str(tmp_path / "c.safetensors"))
    save_file({k: v.astype(np.float16) for k, v in raw.items()}, str(tmp_path / "h.safetensors"))
    r = read_cartridge(tmp_path / "h.safetensors")  # no metadata: the reference's own files
    np.testing.assert_allclose(r.k[1], c.k[1], atol=5e-3)
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch

    bf = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in raw.items()}
    save_torch(bf, str(tmp_path / "b.safetensors"))
    r = read_cartridge(tmp_path / "b.safetensors")
    np.testing.assert_allclose(r.v[2], c.v[2], atol=3e-2)


def test_errors_name_the_layer_and_shape(tmp_path):
    write_cartridge(tmp_path / "c.safetensors", _cartridge())
    raw = load_file(str(tmp_path / "c.safetensors"))
    missing = dict(raw)
    del missing["layers.1.v"]
    save_file(missing, str(tmp_path / "m.safetensors"))
    with pytest.raises(CartridgeError, match=r"layer 1 of 3: missing layers\.1\.v"):
        read_cartridge(tmp_path / "m.safetensors")
    bad = dict(raw, **{"layers.2.v": np.zeros((3, 1, 8), np.float32)})
    save_file(bad, str(tmp_path / "s.safetensors"))
    with pytest.raises(
        CartridgeError, match=r"layers\.2\.k \[4, 1, 8\] and layers\.2\.v \[3, 1, 8\]"
    ):
        read_cartridge(tmp_path / "s.safetensors")
    save_file({"weight": np.zeros(3, np.float32)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(CartridgeError, match="unexpected tensor 'weight'"):
        read_cartridge(tmp_path / "w.safetensors")
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(CartridgeError, match="not a safetensors file"):
        read_cartridge(tmp_path / "t.txt")
    with pytest.raises(CartridgeError, match="no such file"):
        read_cartridge(tmp_path / "absent.safetensors")


def test_geometry_check_names_layer_and_shape():
    c = _cartridge()
    check_geometry(c, [2, 2, 1], [4, 4, 8])
    with pytest.raises(
        CartridgeError, match=r"layers\.2\.k has shape \[4, 1, 8\].*needs \[4, 2, 8\]"
    ):
        check_geometry(c, [2, 2, 2], [4, 4, 8])
    with pytest.raises(CartridgeError, match="3 layers, the model has 30"):
        check_geometry(c, [2] * 30, [4] * 30)
