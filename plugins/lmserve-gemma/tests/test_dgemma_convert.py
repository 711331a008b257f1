"""The DiffusionGemma converter (lmserve_gemma.convert_diffusion): the published layout's
tensors and keys on the synthetic model, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lmserve_gemma.convert_diffusion import ConvertError, convert, main

from lmserve_core.gguf_file import GGUFFile
from lmserve_core.testing.synthetic import gguf_state


def test_convert_refuses_other_architectures(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text"}))
    with pytest.raises(ConvertError, match="Gemma4ForCausalLM is not a DiffusionGemma"):
        convert(tmp_path, tmp_path / "out.gguf")
    with pytest.raises(ConvertError, match="outtype"):
        convert(tmp_path, tmp_path / "out.gguf", "q4_0")
    assert main([str(tmp_path), str(tmp_path / "out.gguf")]) == 2
    assert not (tmp_path / "out.gguf").exists()


def test_convert_layout(diffusion_gemma: Any) -> None:
    gguf = GGUFFile.open(diffusion_gemma.gguf)
    names = set(gguf.tensors)
    for name in ("self_cond_pre_norm", "self_cond_gate", "self_cond_up", "self_cond_down",
                 "token_embd", "output_norm", "rope_freqs"):
        assert f"{name}.weight" in names
    for il in range(4):
        assert {f"blk.{il}.enc_layer_output_scale.weight",
                f"blk.{il}.layer_output_scale.weight"} <= names
    assert "blk.1.attn_v.weight" not in names  # global layers: keys as values
    assert gguf.get("diffusion.canvas_length") == 16
    assert gguf.get("diffusion.eb_max_steps") == 48
    assert not any(n.startswith(("v.", "mm.", "output.")) for n in names)


def test_convert_keeps_every_weight(diffusion_gemma: Any) -> None:
    import torch

    model = diffusion_gemma.load_hf()
    state = gguf_state(diffusion_gemma.gguf)
    text = model.model.decoder
    np.testing.assert_array_equal(state["token_embd.weight"],
                                  text.embed_tokens.weight.detach().numpy())
    np.testing.assert_array_equal(state["self_cond_down.weight"],
                                  text.self_conditioning.down_proj.weight.detach().numpy())
    enc = model.model.encoder.language_model
    for il in range(4):
        assert state[f"blk.{il}.layer_output_scale.weight"] == pytest.approx(
            float(text.layers[il].layer_scalar))
        assert state[f"blk.{il}.enc_layer_output_scale.weight"] == pytest.approx(
            float(enc.layers[il].layer_scalar))
        assert float(enc.layers[il].layer_scalar) != float(text.layers[il].layer_scalar)
    gu = text.layers[0].experts.gate_up_proj.detach()
    np.testing.assert_array_equal(state["blk.0.ffn_gate_up_exps.weight"], gu.numpy())
    assert torch.equal(model.lm_head.weight, text.embed_tokens.weight)


def test_convert_quantized(diffusion_gemma: Any, tmp_path: Path) -> None:
    out = convert(diffusion_gemma.hf_dir, tmp_path / "m.gguf", "q8_0")
    gguf = GGUFFile.open(out)
    kinds = {gguf.tensors[n].type_name for n in gguf.tensors}
    assert kinds == {"Q8_0", "F32"}  # 1-D tensors stay f32
    assert gguf.tensors["blk.0.ffn_gate_inp.weight"].type_name == "F32"


def test_lmserve_convert_writes_the_file(diffusion_gemma: Any, tmp_path: Path) -> None:
    from lmserve_core import cli
    from lmserve_core.plugins import converters

    if "DiffusionGemmaForBlockDiffusion" not in converters():
        pytest.skip("lmserve-gemma is not installed (its entry point registers the converter)")
    out = tmp_path / "dgemma-f16.gguf"
    assert cli.main(["convert", str(diffusion_gemma.hf_dir), str(out), "--outtype", "f16"]) == 0
    with GGUFFile.open(out) as g:
        assert g.architecture == "diffusion-gemma"
        assert g.get("diffusion.canvas_length") == 16
        assert g.tensors["self_cond_gate.weight"].type_name == "F16"
