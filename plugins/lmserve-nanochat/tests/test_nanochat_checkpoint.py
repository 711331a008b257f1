"""checkpoint: every layout of a nanochat checkpoint, and every way one can be wrong."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import vocab_fixtures as vf
from lmserve_nanochat.checkpoint import load_checkpoint, looks_like_nanochat
from lmserve_nanochat.config import CheckpointError, has_ve, padded_vocab

torch = pytest.importorskip("torch")

VOCAB = vf.VOCAB_SIZE


def state_dict(
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 2,
    n_kv_head: int = 2,
    *,
    generation: str = "plain",
    dtype: object = None,
    prefix: str = "_orig_mod.",
    seed: int = 0,
) -> dict[str, object]:
    """Random weights under nanochat's gpt.py names (bfloat16, as its trainers save)."""
    g = torch.Generator().manual_seed(seed)
    head = n_embd // n_head
    kv = n_kv_head * head
    rows = padded_vocab(VOCAB)

    def w(*shape: int) -> object:
        return torch.randn(*shape, generator=g).to(dtype or torch.bfloat16)

    sd = {"transformer.wte.weight": w(rows, n_embd), "lm_head.weight": w(rows, n_embd)}
    for i in range(n_layer):
        h = f"transformer.h.{i}"
        sd |= {
            f"{h}.attn.c_q.weight": w(n_embd, n_embd),
            f"{h}.attn.c_k.weight": w(kv, n_embd),
            f"{h}.attn.c_v.weight": w(kv, n_embd),
            f"{h}.attn.c_proj.weight": w(n_embd, n_embd),
            f"{h}.mlp.c_fc.weight": w(4 * n_embd, n_embd),
            f"{h}.mlp.c_proj.weight": w(n_embd, 4 * n_embd),
        }
        if generation == "ve12" and has_ve(i, n_layer):
            sd[f"{h}.attn.ve_gate.weight"] = w(n_kv_head, 12)
            sd[f"value_embeds.{i}.weight"] = w(rows, kv)
    if generation != "plain":
        sd["resid_lambdas"] = w(n_layer)
        sd["x0_lambdas"] = w(n_layer)
    return {prefix + k: v for k, v in sd.items()}


def model_config(n_layer: int = 2, n_embd: int = 64, n_head: int = 2, n_kv_head: int = 2) -> dict:
    return {
        "sequence_len": 256,
        "vocab_size": VOCAB,
        "n_layer": n_layer,
        "n_head": n_head,
        "n_kv_head": n_kv_head,
        "n_embd": n_embd,
    }


def save_native(
    model_dir: Path, step: int, sd: dict | None = None, meta: dict | None = None
) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / f"model_{step:06d}.pt"
    torch.save(state_dict() if sd is None else sd, path)
    meta = {"step": step, "model_config": model_config()} if meta is None else meta
    (model_dir / f"meta_{step:06d}.json").write_text(json.dumps(meta))
    return path


def _f32(t: object) -> np.ndarray:
    return t.float().numpy()


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """nanochat's base directory: a tokenizer, base d1 and d2, sft d2 at steps 5 and 7."""
    root = tmp_path / "nanochat"
    vf.make_tokenizer(root)
    save_native(root / "base_checkpoints" / "d2", 10)
    save_native(root / "base_checkpoints" / "d1", 20)
    save_native(root / "chatsft_checkpoints" / "d2", 5, state_dict(seed=5))
    save_native(root / "chatsft_checkpoints" / "d2", 7, state_dict(seed=7))
    return root


def test_base_dir_prefers_sft_latest_largest(base: Path) -> None:
    ck = load_checkpoint(base)
    assert ck.model_file == base / "chatsft_checkpoints" / "d2" / "model_000007.pt"
    assert "sft d2 step 7" in ck.description
    want = state_dict(seed=7)
    for name, t in want.items():
        np.testing.assert_array_equal(ck.tensors[name.removeprefix("_orig_mod.")], _f32(t))
    assert ck.tensors["resid_lambdas"].tolist() == [1.0, 1.0]  # patched, as nanochat does
    assert ck.tensors["x0_lambdas"].tolist() == [0.0, 0.0]
    assert ck.config.generation == "plain" and ck.config.n_layer == 2
    assert ck.config.vocab_size == ck.vocab.size == VOCAB
    assert all(a.dtype == np.float32 for a in ck.tensors.values())
    assert not any(k.startswith("_orig_mod.") for k in ck.tensors)


def test_choosing_source_step_and_directory(base: Path) -> None:
    assert load_checkpoint(base, source="base").model_file.name == "model_000010.pt"
    assert load_checkpoint(base, step=5).model_file.name == "model_000005.pt"
    sft = base / "chatsft_checkpoints"
    assert load_checkpoint(sft).model_file == sft / "d2" / "model_000007.pt"
    assert load_checkpoint(sft / "d2", step=5).model_file.name == "model_000005.pt"
    model = sft / "d2" / "model_000005.pt"
    assert load_checkpoint(model).model_file == model
    # rl comes before base when there is no sft
    shutil.rmtree(sft)
    save_native(base / "chatrl_checkpoints" / "d2", 3)
    assert load_checkpoint(base).model_file.parent.parent.name == "chatrl_checkpoints"
    # d<N> tags win over a newer directory of another name
    save_native(base / "base_checkpoints" / "custom", 1)
    os.utime(base / "base_checkpoints" / "d1", (1, 1))
    os.utime(base / "base_checkpoints" / "d2", (1, 1))
    assert load_checkpoint(base, source="base").model_file.parent.name == "d2"


def test_window_pattern_and_generation(tmp_path: Path) -> None:
    vf.make_tokenizer(tmp_path)
    meta = {"model_config": {**model_config(n_layer=4), "window_pattern": "SSSL"}}
    save_native(tmp_path / "d4", 1, state_dict(n_layer=4, generation="ve12"), meta)
    config = load_checkpoint(tmp_path / "d4").config
    assert config.generation == "ve12" and config.ve_layers == (1, 3)
    assert config.windows == (129, 129, 129, 257)


def test_native_errors(base: Path, tmp_path: Path) -> None:
    d2 = base / "chatsft_checkpoints" / "d2"

    def refused(*words: str, **kw: object) -> None:
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(kw.pop("path", base), **kw)
        for word in words:
            assert word in str(info.value), str(info.value)

    refused("no model_000006.pt (steps: 5, 7)", step=6)
    refused("source 'chat'", source="chat")
    refused("no model in chatrl_checkpoints", source="rl")
    refused("is step 5, not 7", path=d2 / "model_000005.pt", step=7)
    (d2 / "meta_000007.json").unlink()
    refused("meta_000007.json: missing")
    (d2 / "meta_000007.json").write_text("{nope")
    refused("meta_000007.json: not JSON")
    (d2 / "meta_000007.json").write_text(json.dumps({"step": 7}))
    refused("meta_000007.json: no model_config")
    cfg = model_config()
    save_native(d2, 7, meta={"model_config": {**cfg, "vocab_size": 999}})
    refused("a vocabulary of 999, the tokenizer", "tokenizer.pkl of 1024")
    save_native(d2, 7, meta={"model_config": {**cfg, "n_head": 3}})
    refused("do not divide")
    sd = state_dict()
    sd["_orig_mod.transformer.h.0.attn.rotary.inv_freq"] = torch.ones(4)
    save_native(d2, 7, sd)
    refused("unexpected tensor transformer.h.0.attn.rotary.inv_freq")
    sd = state_dict()
    del sd["_orig_mod.transformer.h.1.mlp.c_fc.weight"]
    save_native(d2, 7, sd)
    refused("no tensor transformer.h.1.mlp.c_fc.weight")
    sd = state_dict()
    sd["_orig_mod.transformer.h.1.attn.c_k.weight"] = torch.ones(32, 64)
    save_native(d2, 7, sd)
    refused("transformer.h.1.attn.c_k.weight is (32, 64), the config makes it (64, 64)")
    save_native(d2, 7, state_dict(n_layer=3))
    refused("layer 2 is beyond the config's 2 layers")
    sd = state_dict()
    sd["_orig_mod.lm_head.weight"] = torch.ones(512, 64)
    save_native(d2, 7, sd)
    refused("lm_head.weight is (512, 64)")
    sd = state_dict()
    sd["_orig_mod.x0_lambdas"] = torch.arange(2)
    save_native(d2, 7, sd)
    refused("x0_lambdas is int64")
    save_native(d2, 7)
    # the tokenizer: none above the model, or given
    moved = tmp_path / "elsewhere"
    shutil.move(base / "tokenizer", moved)
    refused("no tokenizer/tokenizer.pkl in it or any directory above", "tokenizer=")
    assert load_checkpoint(base, tokenizer=moved).vocab.size == VOCAB
    assert load_checkpoint(base, tokenizer=moved / "tokenizer.pkl").vocab.size == VOCAB
    refused("no tokenizer.pkl", tokenizer=tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    refused("not a nanochat checkpoint", path=empty)
    refused("no such directory", path=tmp_path / "absent")
    refused("model_<step>.pt", path=moved / "tokenizer.pkl")


# -- model.safetensors + tokenizer.bin -------------------------------------------------------


def save_safetensors(directory: Path, sd: dict) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    vf.write_tokenizer_bin(directory / "tokenizer.bin")
    save_file({k: v.contiguous() for k, v in sd.items()}, directory / "model.safetensors")
    return directory


def test_safetensors_inferred(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    sd = state_dict(n_embd=256, n_head=2, n_kv_head=1, prefix="")
    sd["lm_head.weight"] = sd["lm_head.weight"].float()  # mixed dtypes
    ck = load_checkpoint(save_safetensors(tmp_path / "m", sd))
    c = ck.config
    assert (c.n_layer, c.n_embd, c.n_head, c.n_kv_head) == (2, 256, 2, 1)  # head size 128
    assert c.sequence_len == 2048 and c.windows == (2049, 2049)
    assert "inferred" in ck.description
    for name, t in sd.items():
        np.testing.assert_array_equal(ck.tensors[name], _f32(t))
    # a value-embedding gate gives n_kv_head, whatever the head size
    sd = state_dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, generation="ve12", prefix="")
    c = load_checkpoint(save_safetensors(tmp_path / "ve", sd)).config
    assert (c.n_head, c.n_kv_head, c.head_dim, c.generation) == (4, 2, 16, "ve12")


def test_safetensors_config_beside(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    d = save_safetensors(tmp_path / "m", state_dict(n_embd=64, n_head=4, n_kv_head=4))
    with pytest.raises(CheckpointError, match="cannot tell the heads.*model.config.json"):
        load_checkpoint(d)
    (d / "model.config.json").write_text(json.dumps(model_config(n_head=4, n_kv_head=4)))
    ck = load_checkpoint(d)
    assert ck.config.n_head == 4 and "model.config.json" in ck.description
    (d / "model.config.json").unlink()
    (d / "meta.json").write_text(json.dumps({"model_config": model_config(n_head=4, n_kv_head=4)}))
    assert load_checkpoint(d).config.sequence_len == 256
    (d / "tokenizer.bin").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.bin: missing"):
        load_checkpoint(d)
    (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    vf.write_tokenizer_bin(d / "tokenizer.bin")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(d)


# -- the Hugging Face port -------------------------------------------------------------------


def test_hugging_face_port(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.NanoChatConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = transformers.NanoChatForCausalLM(config).to(torch.bfloat16)
    d = tmp_path / "hf"
    model.save_pretrained(d)
    vf.write_tokenizer_json(d / "tokenizer.json")
    assert looks_like_nanochat(d)
    ck = load_checkpoint(d)
    c = ck.config
    assert (c.n_layer, c.n_head, c.n_kv_head, c.n_embd, c.n_ff) == (2, 4, 2, 64, 256)
    sd = model.state_dict()
    assert set(ck.tensors) == {
        "transformer.wte.weight", "lm_head.weight", "resid_lambdas", "x0_lambdas",
        *(f"transformer.h.{i}.{m}.weight" for i in range(2) for m in (
            "attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")),
    }  # fmt: skip
    np.testing.assert_array_equal(
        ck.tensors["transformer.wte.weight"], _f32(sd["model.embed_tokens.weight"])
    )
    np.testing.assert_array_equal(
        ck.tensors["transformer.h.1.attn.c_k.weight"],
        _f32(sd["model.layers.1.self_attn.k_proj.weight"]),
    )
    np.testing.assert_array_equal(
        ck.tensors["transformer.h.0.mlp.c_proj.weight"], _f32(sd["model.layers.0.mlp.fc2.weight"])
    )
    np.testing.assert_array_equal(ck.tensors["lm_head.weight"], _f32(sd["lm_head.weight"]))
    assert ck.vocab.tokenizer().encode("hello world") == vf.encoding().encode_ordinary(
        "hello world"
    )
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json: missing"):
        load_checkpoint(d)


def test_looks_like_nanochat(base: Path, tmp_path: Path) -> None:
    assert looks_like_nanochat(base)
    assert looks_like_nanochat(base / "chatsft_checkpoints")
    assert looks_like_nanochat(base / "chatsft_checkpoints" / "d2")
    assert looks_like_nanochat(base / "chatsft_checkpoints" / "d2" / "model_000007.pt")
    assert not looks_like_nanochat(base / "tokenizer")
    assert not looks_like_nanochat(base / "tokenizer" / "tokenizer.pkl")
    assert not looks_like_nanochat(tmp_path / "absent")
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (other / "model.safetensors").write_bytes(b"")
    assert not looks_like_nanochat(other)
    (other / "tokenizer.bin").write_bytes(b"")
    assert looks_like_nanochat(other)
