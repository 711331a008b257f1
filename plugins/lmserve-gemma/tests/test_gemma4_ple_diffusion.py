"""Gemma 4's per-layer inputs and DiffusionGemma's passes in one model: the synthetic
DiffusionGemma (dgemma_synthetic.py) with per-layer input tensors added. transformers has no
such model (DiffusionGemmaConfig drops ``hidden_size_per_layer_input``), so the reference is
its DiffusionGemma with Gemma 4's per-layer inputs put in by hooks, as Gemma4TextModel
computes them: projected from the embeddings its layers receive (the canvas pass's
self-conditioned ones), each layer's added to its output before the layer scalar. And each
pass is held to a path it must agree with:

* the causal pass equals Gemma 4's forward (``gemma4``, per-layer inputs, the causal pass's
  layer scalars as its output scales) over the same tensors, bit for bit;
* with every per-layer input's output norm zero (so each adds exactly 0), both passes equal
  DiffusionGemma's alone, bit for bit, which test_dgemma_numerics.py holds to transformers;
* with the inputs live, the canvas pass moves far from DiffusionGemma's alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter
from lmserve_gemma.dgemma_model import DiffusionGemmaModel
from lmserve_gemma.gemma4_model import Gemma4Model

from lmserve_core.gguf_file import GGUFFile
from lmserve_core.testing.gguf_writer import add_values

pytestmark = pytest.mark.reference

P = 8  # embedding_length_per_layer_input
LOGIT_ATOL = 1e-3  # test_dgemma_numerics.LOGIT_ATOL
TEMPERATURE = 0.6  # dgemma_synthetic.TEMPERATURE


def rewrite(
    src: Path,
    dst: Path,
    *,
    arch: str,
    meta: Mapping[str, Any],
    keep: Callable[[str], bool],
    tensors: Mapping[str, np.ndarray],
) -> Path:
    """``src`` (an all-F32 GGUF) again as ``dst`` of architecture ``arch`` (its keys renamed),
    with ``meta`` keys set, the tensors ``keep`` refuses dropped and ``tensors`` put in."""
    with GGUFFile.open(src) as gguf:
        old = gguf.architecture
        writer = GGUFWriter(str(dst), arch)
        values = {
            k.replace(f"{old}.", f"{arch}.", 1): v
            for k, v in gguf.metadata.items()
            if not k.startswith(("general.architecture", "GGUF."))
        }
        values.update(meta)
        add_values(writer, {k: v for k, v in values.items() if v is not None})
        for name, info in gguf.tensors.items():
            if keep(name) and name not in tensors:
                writer.add_tensor(name, info.data.view(np.float32).reshape(info.shape).copy())
        for name, array in tensors.items():
            writer.add_tensor(name, np.ascontiguousarray(array))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return dst


def geometry(path: Path) -> tuple[int, int, int]:
    """n_layer, n_embd and n_vocab of a GGUF."""
    with GGUFFile.open(path) as gguf:
        arch = gguf.architecture
        n_layer = int(gguf.metadata[f"{arch}.block_count"])
        d = int(gguf.metadata[f"{arch}.embedding_length"])
        return n_layer, d, gguf.tensors["token_embd.weight"].shape[0]


@pytest.fixture(scope="module")
def ple(diffusion_gemma: Any) -> dict[str, np.ndarray]:
    """Random per-layer input tensors for the synthetic model, under llama.cpp's names."""
    n_layer, d, n_vocab = geometry(Path(diffusion_gemma.gguf))
    rng = np.random.default_rng(7)
    ple: dict[str, np.ndarray] = {
        # F16 keeps the file small (the vocabulary is Gemma 4's 262144 ids)
        "per_layer_token_embd.weight": rng.normal(0, 0.5, (n_vocab, n_layer * P)).astype(
            np.float16
        ),
        "per_layer_model_proj.weight": rng.normal(0, 0.25, (n_layer * P, d)).astype(np.float32),
        "per_layer_proj_norm.weight": rng.uniform(0.5, 1.5, P).astype(np.float32),
    }
    for il in range(n_layer):
        ple[f"blk.{il}.inp_gate.weight"] = rng.normal(0, 0.25, (P, d)).astype(np.float32)
        ple[f"blk.{il}.proj.weight"] = rng.normal(0, 0.25, (d, P)).astype(np.float32)
        ple[f"blk.{il}.post_norm.weight"] = rng.uniform(0.5, 1.5, d).astype(np.float32)
    return ple


@pytest.fixture(scope="module")
def files(
    diffusion_gemma: Any, ple: dict[str, np.ndarray], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    src = Path(diffusion_gemma.gguf)
    out = tmp_path_factory.mktemp("ple-diffusion")
    n_layer, d, _ = geometry(src)
    with GGUFFile.open(src) as gguf:
        arch = gguf.architecture
        enc_scales = {
            f"blk.{il}.layer_output_scale.weight": gguf.tensors[
                f"blk.{il}.enc_layer_output_scale.weight"
            ]
            .data.view(np.float32)
            .copy()
            for il in range(n_layer)
        }
    silent = dict(ple)
    for il in range(n_layer):
        silent[f"blk.{il}.post_norm.weight"] = np.zeros(d, np.float32)
    key = f"{arch}.embedding_length_per_layer_input"
    every: Callable[[str], bool] = lambda name: True  # noqa: E731
    return {
        "plain": src,
        "composed": rewrite(
            src, out / "composed.gguf", arch=arch, meta={key: P}, keep=every, tensors=ple
        ),
        "silent": rewrite(
            src, out / "silent.gguf", arch=arch, meta={key: P}, keep=every, tensors=silent
        ),
        # Gemma 4 with the causal pass's scalars as its output scales, no self-conditioning
        "gemma4": rewrite(
            src,
            out / "gemma4.gguf",
            arch="gemma4",
            meta={"gemma4.embedding_length_per_layer_input": P, "gemma4.attention.causal": None},
            keep=lambda name: not name.startswith("self_cond_") and "enc_layer" not in name,
            tensors={**ple, **enc_scales},
        ),
    }


def load(path: Path, cls: type = DiffusionGemmaModel) -> Any:
    return cls.load(GGUFFile.open(path), n_threads=2, kv_type="f32")


@pytest.fixture(scope="module")
def recorded(diffusion_gemma: Any) -> dict[str, np.ndarray]:
    return diffusion_gemma.recorded()


def test_causal_pass_is_gemma4s_with_per_layer_inputs(
    files: dict[str, Path], recorded: dict
) -> None:
    prompt = recorded["prompt"].tolist()
    composed, gemma4, plain = (
        load(files["composed"]),
        load(files["gemma4"], Gemma4Model),
        load(files["plain"]),
    )
    assert composed.config.n_embd_per_layer == P
    assert type(gemma4) is Gemma4Model
    got = composed.forward(composed.new_cache(64), prompt, 0, all_logits=True)
    want = gemma4.forward(gemma4.new_cache(64), prompt, 0, all_logits=True)
    np.testing.assert_array_equal(got, want)
    # the per-layer inputs count: without them the logits are far away
    alone = plain.forward(plain.new_cache(64), prompt, 0, all_logits=True)
    assert np.abs(got - alone).max() > 100 * LOGIT_ATOL


def test_silent_inputs_leave_both_passes_as_diffusion_alone(
    files: dict[str, Path], recorded: dict
) -> None:
    prompt, canvases = recorded["prompt"].tolist(), recorded["canvases"].tolist()
    runs = []
    for name in ("silent", "plain"):
        model = load(files[name])
        cache = model.new_cache(128)
        causal = model.forward(cache, prompt, 0, all_logits=True)
        first = model.denoise(cache, canvases[0], len(prompt), None)
        second = model.denoise(
            cache, canvases[1], len(prompt), recorded["denoise_first"] / TEMPERATURE
        )
        runs.append((causal, first, second))
    for got, want in zip(*runs, strict=True):
        np.testing.assert_array_equal(got, want)
    assert np.abs(runs[0][1] - recorded["denoise_first"]).max() <= LOGIT_ATOL
    assert np.abs(runs[0][2] - recorded["denoise_second"]).max() <= LOGIT_ATOL


def test_canvas_pass_takes_the_per_layer_inputs(files: dict[str, Path], recorded: dict) -> None:
    prompt, canvas = recorded["prompt"].tolist(), recorded["canvases"][0].tolist()
    outs = []
    for name in ("composed", "plain"):
        model = load(files[name])
        cache = model.new_cache(64)
        model.forward(cache, prompt, 0)
        outs.append(model.denoise(cache, canvas, len(prompt), None))
        # the same canvas again: the pass leaves the prefix as it was
        np.testing.assert_array_equal(model.denoise(cache, canvas, len(prompt), None), outs[-1])
    assert np.isfinite(outs[0]).all()
    assert np.abs(outs[0] - outs[1]).max() > 100 * LOGIT_ATOL


@contextlib.contextmanager
def per_layer_inputs(
    hf: Any, ple: dict[str, np.ndarray], tokens: list[list[int]]
) -> Iterator[None]:
    """transformers' DiffusionGemma with Gemma 4's per-layer inputs added to both stacks
    (Gemma4TextModel.project_per_layer_inputs and Gemma4TextDecoderLayer's per-layer step):
    each stack's run takes its ids from ``tokens[0]``."""
    import torch
    import torch.nn.functional as F

    eps = 1e-6
    t = {k: torch.from_numpy(v.astype(np.float32)) for k, v in ple.items()}

    def rms(x: Any, w: Any) -> Any:
        return x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5) * w

    stacks = [
        [m for m in hf.modules() if type(m).__name__ == name]
        for name in ("DiffusionGemmaEncoderTextLayer", "DiffusionGemmaDecoderTextLayer")
    ]
    n_layer, state, handles = len(stacks[0]), {}, []
    scalars = [layer.layer_scalar.clone() for stack in stacks for layer in stack]

    def begin(module: Any, args: tuple[Any, ...]) -> None:
        x = args[0]  # (1, n, D): the embeddings the layers receive
        ids = torch.tensor(tokens[0])
        tok = t["per_layer_token_embd.weight"][ids].reshape(len(ids), n_layer, P) * P**0.5
        proj = (x[0] @ t["per_layer_model_proj.weight"].T) * x.shape[-1] ** -0.5
        proj = rms(proj.reshape(len(ids), n_layer, P), t["per_layer_proj_norm.weight"])
        state["ple"] = (proj + tok) * 2**-0.5

    def after(il: int, scale: Any) -> Callable[..., Any]:
        def hook(module: Any, args: tuple[Any, ...], out: Any) -> Any:
            g = F.gelu(out @ t[f"blk.{il}.inp_gate.weight"].T, approximate="tanh")
            y = (g * state["ple"][:, il]) @ t[f"blk.{il}.proj.weight"].T
            return (out + rms(y, t[f"blk.{il}.post_norm.weight"])) * scale

        return hook

    try:
        i = 0
        for stack in stacks:
            assert len(stack) == n_layer
            handles.append(stack[0].register_forward_pre_hook(begin))
            for il, layer in enumerate(stack):
                layer.layer_scalar.fill_(1.0)  # the hook scales, after the per-layer input
                handles.append(layer.register_forward_hook(after(il, scalars[i])))
                i += 1
        yield
    finally:
        for h in handles:
            h.remove()
        layers = [layer for stack in stacks for layer in stack]
        for layer, scale in zip(layers, scalars, strict=True):
            layer.layer_scalar.copy_(scale)


def test_both_passes_match_transformers_with_per_layer_inputs(
    files: dict[str, Path], ple: dict[str, np.ndarray], recorded: dict, diffusion_gemma: Any
) -> None:
    import torch
    from dgemma_synthetic import causal_logits, denoiser_logits
    from transformers import DynamicCache

    prompt, canvases = recorded["prompt"].tolist(), recorded["canvases"].tolist()
    hf = diffusion_gemma.load_hf()
    tokens = [prompt]
    want = {}
    with torch.no_grad(), per_layer_inputs(hf, ple, tokens):
        cache = DynamicCache(config=hf.config.text_config)
        want["causal"] = causal_logits(hf, prompt, cache)
        tokens[0] = canvases[0]
        want["denoise"] = denoiser_logits(hf, canvases[0], cache, None)
        tokens[0] = canvases[1]
        sc = want["denoise"] / TEMPERATURE
        want["self-conditioned"] = denoiser_logits(hf, canvases[1], cache, sc)
    model = load(files["composed"])
    cache = model.new_cache(128)
    got = {
        "causal": model.forward(cache, prompt, 0, all_logits=True),
        "denoise": model.denoise(cache, canvases[0], len(prompt), None),
        "self-conditioned": model.denoise(cache, canvases[1], len(prompt), sc),
    }
    diffs = {k: float(np.abs(got[k] - want[k]).max()) for k in want}
    assert max(diffs.values()) <= LOGIT_ATOL, diffs
    # the per-layer inputs count in the reference too
    assert np.abs(want["denoise"] - recorded["denoise_first"]).max() > 100 * LOGIT_ATOL
