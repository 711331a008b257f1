"""DiffusionGemma's two passes against transformers on the synthetic model (dgemma_synthetic.py):
the causal pass over the prompt and over a committed block, and the denoiser over fixed
canvases with and without self-conditioning; the conformance suite's cache checks on the
causal pass."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from lmserve_gemma.dgemma_config import DiffusionGemmaConfig, EntropyBound
from lmserve_gemma.dgemma_model import DiffusionGemmaModel

from lmserve_core.gguf_file import GGUFFile
from lmserve_core.testing.conformance import CacheConformance, Subject
from lmserve_core.testing.numerics import f32_reference_path as f32_reference_path
from lmserve_core.tokenizer import Tokenizer

pytestmark = pytest.mark.reference

# Gemma 4's bound with an f32 cache (test_gemma_numerics.LOGIT_ATOL["f32"]).
LOGIT_ATOL = 1e-3
TEMPERATURE = 0.6  # dgemma_synthetic.TEMPERATURE


@pytest.fixture(scope="module")
def model(diffusion_gemma: Any) -> DiffusionGemmaModel:
    return DiffusionGemmaModel.load(GGUFFile.open(diffusion_gemma.gguf), n_threads=2,
                                    kv_type="f32")


@pytest.fixture(scope="module")
def recorded(diffusion_gemma: Any) -> dict[str, np.ndarray]:
    return diffusion_gemma.recorded()


def test_config_reads_the_diffusion_keys(model: DiffusionGemmaModel) -> None:
    c = model.config
    assert isinstance(c, DiffusionGemmaConfig)
    assert c.canvas_length == 16 and c.n_expert == 4 and c.n_swa == 8
    assert c.swa_layers == (True, False, True, False)
    assert c.sampler == EntropyBound()  # the reference defaults, written by the converter
    assert model.gguf.get("diffusion-gemma.attention.causal") is False


def test_passes_match_transformers(model: DiffusionGemmaModel, recorded: dict) -> None:
    prompt, canvases = recorded["prompt"].tolist(), recorded["canvases"].tolist()
    p, c = len(prompt), len(canvases[0])
    cache = model.new_cache(128)
    causal = model.forward(cache, prompt, 0, all_logits=True)
    diffs = {"causal": np.abs(causal - recorded["causal"]).max()}
    first = model.denoise(cache, canvases[0], p, None)
    diffs["denoise"] = np.abs(first - recorded["denoise_first"]).max()
    second = model.denoise(cache, canvases[1], p, recorded["denoise_first"] / TEMPERATURE)
    diffs["self-conditioned"] = np.abs(second - recorded["denoise_second"]).max()
    committed = model.forward(cache, canvases[0], p, all_logits=True)
    diffs["committed"] = np.abs(committed - recorded["causal_committed"]).max()
    third = model.denoise(cache, canvases[2], p + c, None)
    diffs["after a block"] = np.abs(third - recorded["denoise_third"]).max()
    spread = float(np.ptp(recorded["denoise_first"]))
    assert spread > 1.0, spread  # the logits are not flat
    assert max(diffs.values()) <= LOGIT_ATOL, diffs
    # a wrong self-conditioning input moves the logits far past the bound
    assert np.abs(second - recorded["denoise_first"]).max() > 100 * LOGIT_ATOL


def test_canvas_pass_does_not_disturb_the_prefix(model: DiffusionGemmaModel,
                                                 recorded: dict) -> None:
    prompt, canvas = recorded["prompt"].tolist(), recorded["canvases"][0].tolist()
    cache = model.new_cache(64)
    model.forward(cache, prompt, 0)
    a = model.denoise(cache, canvas, len(prompt), None)
    b = model.denoise(cache, canvas, len(prompt), None)
    np.testing.assert_array_equal(a, b)


def test_soft_embeddings_by_slices_equal_the_kept_embedding(
    model: DiffusionGemmaModel, recorded: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmserve_gemma import dgemma_model

    logits = recorded["denoise_first"][:4] * 3
    kept = model.soft_embeddings(logits)
    monkeypatch.setattr(dgemma_model, "EMBEDDING_KEPT", 0)
    np.testing.assert_allclose(model.soft_embeddings(logits), kept, rtol=0, atol=1e-6)


def test_a_block_equals_the_references_generate(model: DiffusionGemmaModel, recorded: dict,
                                                diffusion_gemma: Any) -> None:
    # The whole loop against DiffusionGemmaForBlockDiffusion.generate on the same starting
    # canvas, made deterministic: every position accepted (a huge entropy bound, so nothing
    # is re-noised) at a temperature so low that each draw is the argmax. The steps then
    # differ only through the denoiser, its self-conditioning and the stop. (The random
    # model's argmax canvas moves on every step: both run every step.)
    import torch
    from lmserve_gemma.dgemma_sampler import BlockDenoiser
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSamplerConfig,
    )

    prompt, canvas = recorded["prompt"].tolist(), recorded["canvases"][1]
    params = EntropyBound(max_denoising_steps=3, t_min=1e-3, t_max=2e-3, entropy_bound=1e6,
                          stability_threshold=1, confidence_threshold=0.5)
    hf = diffusion_gemma.load_hf()
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor([prompt]), decoder_input_ids=torch.tensor([canvas]),
            max_new_tokens=len(canvas), max_denoising_steps=params.max_denoising_steps,
            t_min=params.t_min, t_max=params.t_max,
            sampler_config=EntropyBoundSamplerConfig(entropy_bound=params.entropy_bound),
            stability_threshold=params.stability_threshold,
            confidence_threshold=params.confidence_threshold, eos_token_id=None,
            return_dict_in_generate=True,
        )
    want = out.sequences[0, len(prompt):].tolist()
    cache = model.new_cache(64)
    model.forward(cache, prompt, 0)
    block = BlockDenoiser(lambda c, sc: model.denoise(cache, c.tolist(), len(prompt), sc),
                          params, len(canvas), model.n_vocab, np.random.default_rng(0),
                          canvas=canvas)
    while not block.step():
        pass
    assert block.tokens == want
    passes = round(len(canvas) / float(out.tokens_per_forward[0]))
    assert block.steps == passes, (block.steps, passes)  # the same stop decisions


class TestDiffusionGemmaCausalPass(CacheConformance):
    """The suite's cache checks on the causal pass, which builds the prefix that slots
    reuse, copy and restore from the disk tier: prefill equals token-by-token passes, a batch
    equals each sequence alone, resumed and restored caches equal cold ones. Its logits
    against transformers are :func:`test_passes_match_transformers` (recorded); the suite's
    greedy and served parts do not apply, as a reply is denoised a block at a time
    (test_dgemma_backend.py serves it)."""

    # a diffusion cache keeps a canvas's margin (16 rows) in its rings beside the batch
    RESUME_BATCH = 32
    _subjects: dict[str, Subject] = {}

    @pytest.fixture
    def subject(self, diffusion_gemma: Any) -> Subject:
        path = str(diffusion_gemma.gguf)
        if path not in self._subjects:
            gguf = GGUFFile.open(path)
            self._subjects[path] = Subject(
                path=path,
                load=lambda kv_type="f16", n_batch=256: DiffusionGemmaModel.load(
                    gguf, n_threads=2, kv_type=kv_type, n_batch=n_batch),
                hf=None,
                tokenizer=Tokenizer.from_gguf(gguf),
            )
        return self._subjects[path]
