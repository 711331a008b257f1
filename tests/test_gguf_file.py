"""GGUF loading: the real SmolLM2 file, zero-copy views, and malformed files."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from models import smollm2_path

from lmserve_core.gguf_file import GGUFError, GGUFFile

Q8_0 = int(GGMLQuantizationType.Q8_0)
F32 = int(GGMLQuantizationType.F32)


# -- a minimal GGUF writer, so tests control every byte -----------------------------------------


def _str(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _nbytes(ggml_type: int, ne: tuple[int, ...]) -> int:
    """Data size of a tensor; 0 for the impossible ones the tests declare."""
    if ggml_type not in set(GGMLQuantizationType):
        return 0
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    n = 1
    for d in ne:
        n *= d
    return n // block * size if n < 1 << 20 else 0


def build_gguf(
    tensors: list[tuple[str, tuple[int, ...], int]],
    *,
    kvs: list[bytes] | None = None,
    magic: bytes = b"GGUF",
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    offsets: dict[str, int] | None = None,
    alignment: int = 32,
) -> bytes:
    """GGUF bytes with the given tensors (name, ne in GGUF order, type), data filled in."""
    kvs = kvs if kvs is not None else [_kv("general.architecture", 8, _str("llama"))]
    infos = b""
    data = b""
    for name, ne, ggml_type in tensors:
        offset = len(data)
        if offsets and name in offsets:
            offset = offsets[name]
        infos += _str(name) + struct.pack("<I", len(ne))
        infos += b"".join(struct.pack("<Q", d) for d in ne)
        infos += struct.pack("<IQ", ggml_type, offset)
        chunk = bytes(range(256)) * (_nbytes(ggml_type, ne) // 256 + 1)
        data += chunk[: _nbytes(ggml_type, ne)]
        data += b"\0" * (-len(data) % alignment)
    header = magic + struct.pack("<I", version)
    header += struct.pack(
        "<QQ", len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv
    )
    header += b"".join(kvs) + infos
    header += b"\0" * (-len(header) % alignment)
    return header + data


GOOD_TENSORS = [("a.weight", (32, 4), Q8_0), ("b.weight", (8,), F32)]


def write(tmp_path: Path, data: bytes, name: str = "model.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def open_error(path: Path) -> str:
    with pytest.raises(GGUFError) as info:
        GGUFFile.open(path)
    message = str(info.value)
    assert str(path) in message
    return message


# -- the real file --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> GGUFFile:
    return GGUFFile.open(smollm2_path())


def test_smollm2_loads(smollm2: GGUFFile) -> None:
    assert smollm2.architecture == "llama"
    assert len(smollm2.tensors) == 272
    emb = smollm2.tensors["token_embd.weight"]
    assert emb.ggml_type == Q8_0
    assert emb.type_name == "Q8_0"
    assert emb.shape == (49152, 576)
    assert emb.n_elements == 49152 * 576
    assert emb.row_bytes == 576 // 32 * 34
    assert emb.nbytes == emb.row_bytes * 49152 == emb.data.nbytes
    assert emb.data.dtype == np.uint8


def test_smollm2_metadata(smollm2: GGUFFile) -> None:
    assert smollm2.arch_get("block_count") == 30
    assert smollm2.arch_get("embedding_length") == 576
    assert smollm2.arch_get("missing.key", "dflt") == "dflt"
    assert smollm2.get("general.architecture") == "llama"
    assert isinstance(smollm2.get("llama.rope.freq_base"), float)
    tokens = smollm2.get("tokenizer.ggml.tokens")
    assert isinstance(tokens, list) and len(tokens) == 49152
    assert tokens[1] == "<|im_start|>"
    # long numeric arrays stay read-only views of the mapped file
    types = smollm2.get("tokenizer.ggml.token_type")
    assert isinstance(types, np.ndarray) and not types.flags.writeable
    assert types[:3].tolist() == [3, 3, 3] and len(types) == 49152
    assert smollm2.get("tokenizer.ggml.merges")[0] == "Ġ t"
    assert smollm2.get("tokenizer.ggml.add_bos_token") is False
    assert "<|im_start|>" in smollm2.get("tokenizer.chat_template")


def test_tensor_views_are_zero_copy(smollm2: GGUFFile) -> None:
    info = smollm2.tensors["blk.0.attn_q.weight"]
    assert not info.data.flags.owndata
    assert not info.data.flags.writeable
    owner = info.data
    while isinstance(owner, np.ndarray):
        owner = owner.base
    if isinstance(owner, memoryview):
        owner = owner.obj
    assert isinstance(owner, mmap.mmap)
    with open(smollm2.path, "rb") as fh:
        fh.seek(info.offset)
        assert fh.read(64) == info.data[:64].tobytes()


def test_views_outlive_close(smollm2: GGUFFile) -> None:
    gf = GGUFFile.open(smollm2.path)
    with gf:
        view = gf.tensors["output_norm.weight"].data
    assert gf.tensors == {}
    # The mapping stays alive while a view references it.
    assert view.view(np.float32).shape == (576,)
    assert np.isfinite(view.view(np.float32)).all()


def test_require(smollm2: GGUFFile) -> None:
    info = smollm2.require("token_embd.weight", ggml_types=[Q8_0], shape=(49152, -1))
    assert info.shape == (49152, 576)
    with pytest.raises(GGUFError, match="'nope.weight' is missing"):
        smollm2.require("nope.weight")
    with pytest.raises(GGUFError, match="'token_embd.weight' has type Q8_0, expected one of F32"):
        smollm2.require("token_embd.weight", ggml_types=[F32])
    with pytest.raises(GGUFError, match=r"'token_embd.weight' has shape \(49152, 576\)"):
        smollm2.require("token_embd.weight", shape=(576, 49152))


def test_gguf_writer_output_loads(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "w.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_uint32("qwen3.block_count", 2)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "ab"])
    writer.add_tensor("t.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gf = GGUFFile.open(path)
    assert gf.architecture == "qwen3"
    assert gf.arch_get("block_count") == 2
    assert gf.get("tokenizer.ggml.tokens") == ["a", "b", "ab"]
    t = gf.tensors["t.weight"]
    assert t.shape == (3, 4) and t.ggml_type == F32
    assert t.data.view(np.float32).tolist() == list(range(12))


def test_small_file_loads(tmp_path: Path) -> None:
    gf = GGUFFile.open(write(tmp_path, build_gguf(GOOD_TENSORS)))
    assert gf.tensors["a.weight"].shape == (4, 32)
    assert gf.tensors["a.weight"].nbytes == 4 * 34
    assert gf.tensors["b.weight"].shape == (8,)
    assert gf.tensors["b.weight"].row_bytes == 32


# -- malformed files ------------------------------------------------------------------------


def test_empty_file(tmp_path: Path) -> None:
    assert "empty" in open_error(write(tmp_path, b""))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFFile.open(tmp_path / "absent.gguf")


def test_bad_magic(tmp_path: Path) -> None:
    assert "not a GGUF file" in open_error(write(tmp_path, build_gguf(GOOD_TENSORS, magic=b"GGML")))


def test_text_file(tmp_path: Path) -> None:
    assert "not a GGUF file" in open_error(write(tmp_path, b"hello, this is not a model\n" * 4))


@pytest.mark.parametrize("version", [1, 99])
def test_unsupported_version(tmp_path: Path, version: int) -> None:
    message = open_error(write(tmp_path, build_gguf(GOOD_TENSORS, version=version)))
    assert f"unsupported GGUF version {version}" in message


def test_truncated_header_of_real_file(tmp_path: Path) -> None:
    with open(smollm2_path(), "rb") as fh:
        head = fh.read(2 * 1024 * 1024)
    # The header ends before 2 MB, so the first tensor's data runs past the end.
    message = open_error(write(tmp_path, head))
    assert "beyond the end of the file" in message and "tensor 'token_embd.weight'" in message
    # Cut inside the metadata: the token list is incomplete.
    message = open_error(write(tmp_path, head[:300_000], "cut.gguf"))
    assert "truncated header" in message and "tokenizer.ggml.tokens" in message


def test_truncated_tensor_data(tmp_path: Path) -> None:
    data = build_gguf(GOOD_TENSORS)
    message = open_error(write(tmp_path, data[:-40]))
    assert "tensor 'b.weight'" in message and "truncated" in message


def test_offset_beyond_eof(tmp_path: Path) -> None:
    data = build_gguf(GOOD_TENSORS, offsets={"b.weight": 1 << 40})
    assert "tensor 'b.weight'" in open_error(write(tmp_path, data))


def test_misaligned_offset(tmp_path: Path) -> None:
    data = build_gguf(GOOD_TENSORS, offsets={"b.weight": 3})
    assert "not 32-byte aligned" in open_error(write(tmp_path, data))


def test_overlapping_tensors(tmp_path: Path) -> None:
    data = build_gguf(GOOD_TENSORS, offsets={"b.weight": 64})
    assert "overlaps" in open_error(write(tmp_path, data))


@pytest.mark.parametrize(
    "field", ["n_tensors", "n_kv"], ids=["absurd tensor count", "absurd metadata count"]
)
def test_absurd_counts(tmp_path: Path, field: str) -> None:
    data = build_gguf(GOOD_TENSORS, **{field: 1 << 60})
    assert "impossible" in open_error(write(tmp_path, data))


def test_absurd_array_length(tmp_path: Path) -> None:
    for itype in (GGUFValueType.UINT8, GGUFValueType.STRING, GGUFValueType.ARRAY):
        kv = _kv("x.big", GGUFValueType.ARRAY, struct.pack("<IQ", itype, 1 << 60))
        message = open_error(write(tmp_path, build_gguf(GOOD_TENSORS, kvs=[kv])))
        assert "'x.big'" in message and "truncated" in message


def test_absurd_string_length(tmp_path: Path) -> None:
    kv = _kv("x.str", GGUFValueType.STRING, struct.pack("<Q", 1 << 62) + b"abc")
    assert "'x.str'" in open_error(write(tmp_path, build_gguf(GOOD_TENSORS, kvs=[kv])))


def test_unknown_value_type(tmp_path: Path) -> None:
    kv = _kv("x.odd", 77, b"\0" * 8)
    assert "unknown value type 77" in open_error(
        write(tmp_path, build_gguf(GOOD_TENSORS, kvs=[kv]))
    )


def test_duplicate_tensor_names(tmp_path: Path) -> None:
    tensors = [("a.weight", (8,), F32), ("a.weight", (8,), F32)]
    assert "duplicate tensor name 'a.weight'" in open_error(write(tmp_path, build_gguf(tensors)))


def test_duplicate_metadata_keys(tmp_path: Path) -> None:
    kv = _kv("general.architecture", 8, _str("llama"))
    message = open_error(write(tmp_path, build_gguf(GOOD_TENSORS, kvs=[kv, kv])))
    assert "duplicate metadata key" in message


def test_row_not_multiple_of_block(tmp_path: Path) -> None:
    message = open_error(write(tmp_path, build_gguf([("q.weight", (33, 2), Q8_0)])))
    assert "tensor 'q.weight'" in message and "block size 32" in message


def test_unknown_tensor_type(tmp_path: Path) -> None:
    message = open_error(write(tmp_path, build_gguf([("z.weight", (8,), 250)])))
    assert "tensor 'z.weight': unknown GGML type 250" in message


def test_too_many_dimensions(tmp_path: Path) -> None:
    message = open_error(write(tmp_path, build_gguf([("d.weight", (1,) * 9, F32)])))
    assert "tensor 'd.weight': 9 dimensions" in message


def test_bad_alignment(tmp_path: Path) -> None:
    kvs = [_kv("general.alignment", GGUFValueType.UINT32, struct.pack("<I", 3))]
    assert "invalid general.alignment" in open_error(write(tmp_path, build_gguf([], kvs=kvs)))


def test_element_count_overflow(tmp_path: Path) -> None:
    message = open_error(write(tmp_path, build_gguf([("h.weight", (1 << 32, 1 << 32), F32)])))
    assert "tensor 'h.weight'" in message
