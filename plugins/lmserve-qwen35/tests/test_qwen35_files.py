"""GGUF files the family must read or refuse: multi-token-prediction layers (loaded, not run),
an explicit per-layer list of recurrent layers, and variants that must be refused with an
error naming what is wrong (a missing DeltaNet tensor, an older fused projection, sizes that
do not divide). The files are the synthetic f32 model rewritten (every tensor F32)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter
from lmserve_qwen35.model import Qwen35Model

from lmserve_core.gguf_file import GGUFError, GGUFFile
from lmserve_core.testing.gguf_writer import add_values
from lmserve_core.tokenizer import Tokenizer

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def rewrite(
    src: Path,
    dst: Path,
    *,
    meta: Mapping[str, Any] | None = None,
    drop: Callable[[str], bool] = lambda name: False,
    extra: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """``src`` (an all-F32 GGUF) written again to ``dst`` with metadata keys replaced or added
    (None removes one), tensors dropped and tensors added."""
    with GGUFFile.open(src) as gguf:
        arch = gguf.architecture
        writer = GGUFWriter(str(dst), arch)
        values = {k: v for k, v in gguf.metadata.items() if not k.startswith("general.architecture")}
        values.update(meta or {})
        add_values(writer, {k: v for k, v in values.items()
                            if v is not None and not k.startswith("GGUF.")})
        for name, info in gguf.tensors.items():
            if drop(name):
                continue
            assert info.type_name == "F32", name
            writer.add_tensor(name, info.data.view(np.float32).reshape(info.shape).copy())
        for name, array in (extra or {}).items():
            writer.add_tensor(name, np.ascontiguousarray(array, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return dst


@pytest.fixture(scope="module")
def tiny(synthetic: Any) -> Path:
    return Path(synthetic(kind="qwen35", type="f32")[0])


def logits(path: Path) -> np.ndarray:
    with GGUFFile.open(path) as gguf:
        model = Qwen35Model.load(gguf, n_threads=2, kv_type="f32")
        ids = Tokenizer.from_gguf(gguf).encode(PROMPT, add_special=True, parse_special=True)
        out = model.forward(model.new_cache(64), ids, 0, all_logits=True)
        model.close()
    return out


def test_mtp_layers_load_and_are_not_run(tiny: Path, tmp_path: Path) -> None:
    # llama.cpp's converter appends the MTP block after the decoder's layers, counts it in
    # block_count and writes nextn_predict_layers
    with GGUFFile.open(tiny) as gguf:
        arch, n_layer = gguf.architecture, int(gguf.metadata[f"{gguf.architecture}.block_count"])
        d = int(gguf.metadata[f"{arch}.embedding_length"])
        hd = int(gguf.metadata[f"{arch}.attention.key_length"])
        mtp = {
            name.replace("blk.3.", f"blk.{n_layer}."): info.data.view(np.float32).reshape(info.shape)
            for name, info in gguf.tensors.items() if name.startswith("blk.3.")
        }
    rng = np.random.default_rng(1)
    mtp[f"blk.{n_layer}.nextn.eh_proj.weight"] = rng.standard_normal((d, 2 * d))
    mtp[f"blk.{n_layer}.nextn.enorm.weight"] = np.ones(d)
    mtp[f"blk.{n_layer}.nextn.hnorm.weight"] = np.ones(d)
    with_mtp = rewrite(
        tiny, tmp_path / "mtp.gguf", extra=mtp,
        meta={f"{arch}.block_count": n_layer + 1, f"{arch}.nextn_predict_layers": 1,
              f"{arch}.attention.recurrent_layers": [True, True, True, False, False]},
    )
    assert hd > 0
    np.testing.assert_array_equal(logits(with_mtp), logits(tiny))


def test_recurrent_layers_follow_the_files_list(tiny: Path, tmp_path: Path) -> None:
    # the list, when present, decides; without it, full_attention_interval does
    listed = rewrite(tiny, tmp_path / "listed.gguf",
                     meta={"qwen35.full_attention_interval": None})
    np.testing.assert_array_equal(logits(listed), logits(tiny))
    interval = rewrite(tiny, tmp_path / "interval.gguf",
                       meta={"qwen35.attention.recurrent_layers": None})
    np.testing.assert_array_equal(logits(interval), logits(tiny))
    wrong = rewrite(tiny, tmp_path / "wrong.gguf",
                    meta={"qwen35.attention.recurrent_layers": [True, True, False]})
    with GGUFFile.open(wrong) as gguf, pytest.raises(GGUFError, match="recurrent_layers"):
        Qwen35Model.load(gguf, n_threads=1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"drop": lambda n: n == "blk.1.ssm_a"}, "blk.1.ssm_a"),
        ({"drop": lambda n: n == "blk.0.attn_gate.weight"}, "blk.0.attn_gate.weight"),
        ({"meta": {"qwen35.ssm.time_step_rank": 3}}, "time_step_rank"),
        ({"meta": {"qwen35.ssm.inner_size": 102}}, "inner_size"),
        ({"meta": {"qwen35.ssm.inner_size": 100}}, "attn_qkv.weight. has shape"),
        ({"extra": {"blk.0.ssm_in.weight": np.zeros((256, 64))}}, "ssm_in"),
        ({"extra": {"blk.0.attn_q.bias": np.zeros(256)}}, "unexpected tensors"),
    ],
    ids=["no-ssm_a", "no-attn_gate", "heads", "inner", "shapes", "legacy-ssm_in", "extra-tensor"],
)
def test_variants_are_refused_with_a_clear_error(
    tiny: Path, tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    bad = rewrite(tiny, tmp_path / "bad.gguf", **change)
    with GGUFFile.open(bad) as gguf, pytest.raises(GGUFError, match=message):
        Qwen35Model.load(gguf, n_threads=1)
