"""DiffusionGemma's block sampler, as transformers' ``DiffusionGemmaGenerationMixin`` runs it
(generation_diffusion_gemma.py), over the model's logits in numpy.

A block starts from a canvas of uniform random ids. Each denoising step ``n`` (counting
down from ``max_denoising_steps`` to 1):

1. the denoiser's logits over the canvas, self-conditioned on the previous step's processed
   logits (none on the first step), are divided by the temperature
   ``t_min + (t_max - t_min) * n / max_denoising_steps`` (``LinearTemperatureSchedule``);
2. a candidate id is drawn for every position from the softmax of the processed logits, and
   the argmax canvas is taken;
3. ``EntropyBoundSampler.accept_canvas``: the positions sorted by the entropy of their
   processed distribution, the k lowest are accepted while the sum of their entropies less
   the largest of them stays within ``entropy_bound``; accepted positions take the drawn id;
4. ``renoise_canvas``: every other position takes a fresh uniform random id;
5. ``StableAndConfidentStoppingCriteria``: the block is done when the argmax canvas equals
   each of the last ``stability_threshold`` ones and the mean entropy of the processed
   distributions is below ``confidence_threshold``.

The committed block is the last argmax canvas; a block holding an end-of-sequence id ends
the reply there (the reference pads what follows it). Every draw comes from one
``numpy.random.Generator``: a seeded block is reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np

from .dgemma_config import EntropyBound

# denoise(canvas, self_conditioning_logits or None) -> raw logits (canvas, n_vocab)
Denoiser = Callable[[np.ndarray, "np.ndarray | None"], np.ndarray]


def temperature(params: EntropyBound, step: int) -> float:
    """The temperature of denoising step ``step`` (``max_denoising_steps`` first, 1 last)."""
    return params.t_min + (params.t_max - params.t_min) * (step / params.max_denoising_steps)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def entropy(logits: np.ndarray) -> np.ndarray:
    """The entropy (nats) of softmax(logits) of every row."""
    lp = log_softmax(logits.astype(np.float64))
    return -(np.exp(lp) * lp).sum(axis=-1)


def accept_mask(logits: np.ndarray, entropy_bound: float) -> np.ndarray:
    """The positions ``EntropyBoundSampler.accept_canvas`` accepts for processed ``logits``
    (canvas, n_vocab): the lowest-entropy ones while sum - max of their entropies stays
    within the bound (the lowest is always accepted)."""
    h = entropy(logits)
    order = np.argsort(h, kind="stable")
    sorted_h = h[order]
    chosen = np.cumsum(sorted_h) - sorted_h <= entropy_bound
    mask = np.zeros(h.shape, bool)
    mask[order] = chosen
    return mask


def draw(logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One id per row from softmax(logits) (the reference's ``torch.multinomial``)."""
    p = np.exp(log_softmax(logits.astype(np.float64)))
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(len(p)) * cdf[:, -1]
    ids = np.array([np.searchsorted(row, x, side="right") for row, x in zip(cdf, u,
                                                                            strict=True)])
    return np.minimum(ids, p.shape[-1] - 1).astype(np.int64)


@dataclass
class StableAndConfident:
    """``StableAndConfidentStoppingCriteria`` of one block (stateful: the argmax history)."""

    stability_threshold: int
    confidence_threshold: float
    history: list[np.ndarray] = field(default_factory=list)

    def __call__(self, argmax_canvas: np.ndarray, logits: np.ndarray) -> bool:
        n = self.stability_threshold
        if n == 0:
            stable = True
        else:
            # the reference's history starts as n canvases of -1, which nothing equals
            stable = len(self.history) == n and all(
                np.array_equal(h, argmax_canvas) for h in self.history
            )
            self.history = [*self.history, argmax_canvas.copy()][-n:]
        confident = float(entropy(logits).mean()) < self.confidence_threshold
        return stable and confident


@dataclass
class StepRecord:
    """What one denoising step decided (for tests and traces)."""

    step: int  # the reference's cur_step: max_denoising_steps .. 1
    accepted: np.ndarray  # bool per position
    argmax: np.ndarray
    stop: bool


class BlockDenoiser:
    """One block's denoising loop: :meth:`step` until :attr:`done`, then :attr:`tokens`."""

    def __init__(self, denoise: Denoiser, params: EntropyBound, canvas_length: int,
                 n_vocab: int, rng: np.random.Generator, canvas: np.ndarray | None = None) -> None:
        """``canvas``: the starting canvas (the reference's ``decoder_input_ids``); by
        default uniform random ids."""
        self.denoise = denoise
        self.params = params
        self.n_vocab = n_vocab
        self.rng = rng
        self.canvas = (
            rng.integers(0, n_vocab, size=canvas_length, dtype=np.int64)
            if canvas is None
            else np.asarray(canvas, np.int64).copy()
        )
        self.argmax = self.canvas.copy()
        self.self_conditioning: np.ndarray | None = None
        self.stopping = StableAndConfident(params.stability_threshold,
                                           params.confidence_threshold)
        self.next_step = params.max_denoising_steps
        self.done = False
        self.records: list[StepRecord] = []

    @property
    def steps(self) -> int:
        """Denoiser passes run so far."""
        return self.params.max_denoising_steps - self.next_step

    @property
    def tokens(self) -> list[int]:
        """The block as it stands: the last argmax canvas."""
        return self.argmax.tolist()

    def step(self) -> bool:
        """Run one denoising step; True when the block is done."""
        if self.done:
            return True
        n = self.next_step
        raw = self.denoise(self.canvas, self.self_conditioning)
        processed = (raw / np.float32(temperature(self.params, n))).astype(np.float32)
        candidates = draw(processed, self.rng)
        self.argmax = processed.argmax(axis=-1).astype(np.int64)
        accepted = accept_mask(processed, self.params.entropy_bound)
        canvas = np.where(accepted, candidates, self.canvas)
        noise = self.rng.integers(0, self.n_vocab, size=canvas.shape, dtype=np.int64)
        self.canvas = np.where(accepted, canvas, noise)
        stop = self.stopping(self.argmax, processed)
        self.self_conditioning = processed
        self.records.append(StepRecord(n, accepted, self.argmax.copy(), stop))
        self.next_step -= 1
        self.done = stop or self.next_step == 0
        return self.done


def trim_at_eos(block: list[int], eos_ids: Collection[int]) -> tuple[list[int], bool]:
    """The block's ids before its first end-of-sequence id, and whether it had one."""
    for i, tok in enumerate(block):
        if tok in eos_ids:
            return block[:i], True
    return block, False
