"""DiffusionGemma's sampler (lmserve_gemma.dgemma_sampler) against transformers' pieces
(generation_diffusion_gemma.py) on the synthetic model's recorded denoiser logits: the
temperature schedule, the entropy-bound acceptance, the re-noised positions, the
stable-and-confident stop and the end-of-sequence trim; a seeded block is reproducible."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from lmserve_gemma.dgemma_config import EntropyBound
from lmserve_gemma.dgemma_sampler import (
    BlockDenoiser,
    StableAndConfident,
    accept_mask,
    temperature,
    trim_at_eos,
)

torch = pytest.importorskip("torch")
gen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")


@pytest.fixture(scope="module")
def logits(diffusion_gemma: Any) -> np.ndarray:
    """Recorded denoiser logits (their first 8192 ids, to keep the tests quick), each row
    sharpened by its own factor: their entropies spread from near 0 to near log(8192),
    around every bound below."""
    rec = diffusion_gemma.recorded()
    rows = np.concatenate([rec["denoise_first"], rec["denoise_second"], rec["denoise_third"]])
    rows = rows[:, :8192]
    factors = np.geomspace(0.3, 40.0, len(rows)).astype(np.float32)
    np.random.default_rng(3).shuffle(factors)
    return (rows * factors[:, None]).astype(np.float32)


def test_temperature_schedule_is_the_reference_one(logits: np.ndarray) -> None:
    params = EntropyBound(max_denoising_steps=7, t_min=0.3, t_max=0.9)
    proc = gen.LinearTemperatureScheduleLogitsProcessor(0.3, 0.9, 7)
    x = torch.from_numpy(logits[:4])
    for step in range(7, 0, -1):
        want = proc(None, x, cur_step=torch.tensor(step)).numpy()
        np.testing.assert_allclose(logits[:4] / np.float32(temperature(params, step)), want,
                                   rtol=1e-6)


@pytest.mark.parametrize("bound", [0.01, 0.1, 1.0, 5.0, 40.0])
def test_accept_and_renoise_decisions_equal_the_reference(logits: np.ndarray,
                                                          bound: float) -> None:
    canvas = 16
    sampler = gen.EntropyBoundSampler(gen.EntropyBoundSamplerConfig(entropy_bound=bound),
                                      canvas, logits.shape[1], 48)
    rng = np.random.default_rng(5)
    decided = 0
    for c0 in range(0, len(logits), canvas):
        block = logits[c0 : c0 + canvas]
        current = torch.from_numpy(rng.integers(0, logits.shape[1], (1, canvas)))
        denoised = torch.from_numpy(rng.integers(0, logits.shape[1], (1, canvas)))
        accepted = sampler.accept_canvas(current, denoised, torch.from_numpy(block)[None], 1)
        want = sampler.accepted_token_mask[0].numpy()
        mine = accept_mask(block, bound)
        np.testing.assert_array_equal(mine, want)
        np.testing.assert_array_equal(accepted[0].numpy(),
                                      np.where(mine, denoised[0].numpy(), current[0].numpy()))
        renoised = sampler.renoise_canvas(accepted, 1)[0].numpy()
        kept = renoised == accepted[0].numpy()
        assert kept[mine].all()  # the accepted positions stay; the others are drawn afresh
        decided += int(mine.sum())
    assert decided > 0  # some rows accepted at every bound
    if bound <= 0.1:
        assert decided < len(logits)  # ... and some rejected at the small ones


def test_stop_decisions_equal_the_reference(logits: np.ndarray) -> None:
    seen = set()
    for threshold, confidence in [(1, 0.005), (2, 0.5), (0, 3.0), (3, 12.0)]:
        ref = gen.StableAndConfidentStoppingCriteria(threshold, confidence)
        mine = StableAndConfident(threshold, confidence)
        argmaxes = [np.arange(16), np.arange(16), np.arange(16), np.arange(16) + 1,
                    np.arange(16) + 1, np.arange(16) + 1, np.arange(16) + 1]
        for i, am in enumerate(argmaxes):
            block = logits[16 * (i % 3) : 16 * (i % 3) + 16] * (1 + 10 * (i % 2))
            want = bool(ref(torch.from_numpy(am)[None], torch.from_numpy(block)[None])[0])
            assert mine(am, block) == want, (threshold, confidence, i)
            seen.add(want)
    assert seen == {True, False}


def test_eos_trim_keeps_what_the_reference_keeps() -> None:
    block = [5, 9, 106, 7, 1, 8]
    ids = torch.tensor([[3, 4, *block]])
    out, finished = gen.DiffusionGemmaGenerationMixin._finalize_canvas(
        ids, torch.zeros(1, dtype=torch.bool), gen.DiffusionGemmaGenerationConfig(
            eos_token_id=[1, 106], pad_token_id=0), gen.StoppingCriteriaList(
            [gen.EosTokenCriteria([1, 106])]), 6, torch.tensor([1, 106]))
    assert bool(finished[0])
    kept = [t for t in out[0, -6:].tolist() if t != 0]
    assert trim_at_eos(block, {1, 106}) == (kept[:-1], True)  # the reply ends before eos
    assert trim_at_eos([5, 9], {1}) == ([5, 9], False)


def test_a_seeded_block_is_reproducible(logits: np.ndarray) -> None:
    def denoise(canvas: np.ndarray, sc: np.ndarray | None) -> np.ndarray:
        base = logits[:16] * 8  # a fixed, fairly confident denoiser
        return base if sc is None else base + 0.01 * sc

    params = EntropyBound(max_denoising_steps=6)
    runs = []
    for seed in (11, 11, 12):
        block = BlockDenoiser(denoise, params, 16, logits.shape[1], np.random.default_rng(seed))
        while not block.step():
            pass
        runs.append((block.tokens, block.steps, block.canvas.tolist()))
    assert runs[0] == runs[1]
    assert runs[0][2] != runs[2][2]  # another seed draws other ids
    assert 1 <= runs[0][1] <= 6
