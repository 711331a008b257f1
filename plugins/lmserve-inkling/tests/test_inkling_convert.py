"""The converter: the llama.cpp ``inkling`` layout, exact f32 values, the other outtypes,
the tokenizer, and refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from lmserve_inkling.convert import ConvertError, convert


def _fields(path: Path) -> dict[str, object]:
    r = GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items()}


def _tensors(path: Path) -> dict[str, object]:
    return {t.name: t for t in GGUFReader(path).tensors}


def test_keys_follow_the_layout(gguf_f32: Path, checkpoint: Path) -> None:
    cfg = json.loads((checkpoint / "config.json").read_text())
    f = _fields(gguf_f32)
    assert f["general.architecture"] == "inkling"
    assert f["inkling.attention.sliding_window_pattern"] == [True, True, False, True]
    assert f["inkling.attention.head_count_kv"] == [2, 2, 1, 2]
    assert f["inkling.rel_extent"] == 12 and f["inkling.rel_extent_swa"] == 8
    assert f["inkling.dense_block_count"] == 1
    assert f["inkling.expert_shared_count"] == 2 and f["inkling.expert_gating_func"] == 2
    assert f["inkling.logit_scale_denom"] == pytest.approx(4.0)
    assert f["inkling.expert_weights_scale"] == pytest.approx(2.5)
    assert f["inkling.unpadded_vocab_size"] == cfg["unpadded_vocab_size"] < 384
    assert f["inkling.vocab_size"] == 384 and len(f["tokenizer.ggml.tokens"]) == 384
    assert f["tokenizer.ggml.pre"] == "inkling"
    eos = f["tokenizer.ggml.eos_token_id"]
    assert f["tokenizer.ggml.tokens"][eos] == "<|content_model_end_sampling|>"
    assert f["tokenizer.ggml.bos_token_id"] == eos and f["tokenizer.ggml.add_bos_token"] is False


def test_tensors_hold_the_checkpoint(gguf_f32: Path, checkpoint: Path) -> None:
    from safetensors.numpy import load_file

    sd = load_file(str(checkpoint / "model.safetensors"))
    t = _tensors(gguf_f32)

    def stored(name: str) -> np.ndarray:
        x = t[name]
        return np.asarray(x.data).reshape(list(reversed(x.shape.tolist())))

    L = "model.layers."
    np.testing.assert_array_equal(stored("token_embd_norm.weight"),
                                  sd["model.embed_tokens.embed_norm.weight"])
    np.testing.assert_array_equal(stored("output.weight"), sd["lm_head.weight"])
    np.testing.assert_array_equal(stored("blk.0.attn_rel_proj.weight"),
                                  sd[L + "0.self_attn.rel_logits_proj.proj"])
    assert stored("blk.2.attn_rel_proj.weight").shape == (4, 12)
    np.testing.assert_array_equal(stored("blk.3.shortconv_k.weight"),
                                  sd[L + "3.self_attn.k_sconv.conv1d.weight"][:, 0, :])
    np.testing.assert_array_equal(stored("blk.0.ffn_gscale.weight"), sd[L + "0.mlp.global_scale"])
    np.testing.assert_array_equal(stored("blk.1.ffn_gscale.weight"),
                                  sd[L + "1.mlp.gate.global_scale"])
    np.testing.assert_array_equal(stored("blk.1.exp_probs_b.bias"),
                                  sd[L + "1.mlp.gate.e_score_correction_bias"])
    gate_up = sd[L + "2.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(stored("blk.2.ffn_gate_exps.weight"), gate_up[:, :32])
    np.testing.assert_array_equal(stored("blk.2.ffn_up_exps.weight"), gate_up[:, 32:])
    np.testing.assert_array_equal(stored("blk.2.ffn_down_shexp.weight"),
                                  sd[L + "2.mlp.shared_experts.down_proj"])
    assert stored("blk.1.ffn_gate_inp.weight").shape == (10, 64)  # routed + shared rows
    assert "blk.0.ffn_gate_inp.weight" not in t and "blk.1.ffn_gate.weight" not in t
    assert len(t) == 4 + 18 + 3 * 23  # io, a dense block, 3 MoE blocks


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
def test_outtypes(checkpoint: Path, tmp_path: Path, outtype: str) -> None:
    t = _tensors(convert(checkpoint, tmp_path / f"t-{outtype}.gguf", outtype))
    want = {"f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[outtype]
    assert t["blk.0.attn_q.weight"].tensor_type.name == want
    assert t["blk.1.ffn_gate_exps.weight"].tensor_type.name == want
    # kept f32: vectors, convolutions, relative position banks, routers
    for name in ("blk.0.attn_rel_proj.weight", "blk.0.shortconv_v.weight",
                 "blk.1.ffn_gate_inp.weight", "blk.1.ffn_gscale.weight"):
        assert t[name].tensor_type.name == "F32", name
    assert t["token_embd.weight"].tensor_type.name == want


def test_refuses_other_architectures(checkpoint: Path, tmp_path: Path) -> None:
    other = tmp_path / "llama"
    shutil.copytree(checkpoint, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match="not an Inkling text checkpoint"):
        convert(other, tmp_path / "x.gguf")
    with pytest.raises(ConvertError, match="outtype"):
        convert(checkpoint, tmp_path / "x.gguf", "q4_0")
    assert not (tmp_path / "x.gguf").exists()


def test_lmserve_convert_writes_the_file(checkpoint: Path, tmp_path: Path) -> None:
    from lmserve_core import cli
    from lmserve_core.gguf_file import GGUFFile
    from lmserve_core.plugins import converters

    if "InklingForCausalLM" not in converters():
        pytest.skip("lmserve-inkling is not installed (its entry point registers the converter)")
    out = tmp_path / "inkling-f16.gguf"
    assert cli.main(["convert", str(checkpoint), str(out), "--outtype", "f16"]) == 0
    with GGUFFile.open(out) as g:
        assert g.architecture == "inkling"
        assert g.tensors["token_embd.weight"].type_name == "F16"
