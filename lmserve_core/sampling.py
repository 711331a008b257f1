"""Token sampling in numpy, in llama.cpp's order.

The request's logit bias (OpenAI's ``logit_bias``: a number added to the logits of given
token ids), then penalties (repeat over the last 64 tokens, OpenAI presence/frequency over
everything generated), then an optional allowed-token mask, then greedy when the
temperature is 0, else top-k -> top-p -> min-p -> temperature -> a draw from a seeded
generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .backend import SamplingDefaults
from .request import Sampling

REPEAT_LAST_N = 64


@dataclass(frozen=True, slots=True)
class ResolvedSampling:
    """Every sampling field with a value: the request's, else the family's default."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repeat_penalty: float
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), no id twice

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def resolve(
    sampling: Sampling, defaults: SamplingDefaults, *, seed: int | None = None
) -> ResolvedSampling:
    """Fill the fields ``sampling`` leaves out from ``defaults`` (``seed``: fallback seed)."""

    def pick(value: float | int | None, default: float | int) -> float | int:
        return default if value is None else value

    return ResolvedSampling(
        temperature=float(pick(sampling.temperature, defaults.temperature)),
        top_p=float(pick(sampling.top_p, defaults.top_p)),
        top_k=int(pick(sampling.top_k, defaults.top_k)),
        min_p=float(pick(sampling.min_p, defaults.min_p)),
        repeat_penalty=float(pick(sampling.repeat_penalty, defaults.repeat_penalty)),
        presence_penalty=float(pick(sampling.presence_penalty, 0.0)),
        frequency_penalty=float(pick(sampling.frequency_penalty, 0.0)),
        seed=sampling.seed if sampling.seed is not None else seed,
        logit_bias=tuple(
            (int(tok), float(bias)) for tok, bias in (sampling.logit_bias or {}).items() if bias
        ),
    )


class Sampler:
    """Picks the next token from one sequence's logits.

    One sampler serves one generation: it owns the random generator (seeded from
    ``resolved.seed``, so the same seed replays the same draws) and the running token
    counts of the presence/frequency penalties.
    """

    def __init__(self, resolved: ResolvedSampling, vocab_size: int) -> None:
        self.resolved = resolved
        self.vocab_size = vocab_size
        self._rng = np.random.default_rng(resolved.seed)
        self._penalize_counts = (
            resolved.presence_penalty != 0.0 or resolved.frequency_penalty != 0.0
        )
        self._penalize_recent = resolved.repeat_penalty not in (0.0, 1.0)
        self._bias: tuple[np.ndarray, np.ndarray] | None = None  # (ids, biases)
        if resolved.logit_bias:
            ids = np.array([tok for tok, _ in resolved.logit_bias], dtype=np.int64)
            if ids.min() < 0 or ids.max() >= vocab_size:
                raise ValueError(f"a logit bias names a token outside [0, {vocab_size})")
            biases = np.array([bias for _, bias in resolved.logit_bias], dtype=np.float32)
            self._bias = ids, biases
        # Running counts of generated tokens, updated from the tail of `recent` only, so a
        # long reply costs O(new tokens) per step instead of a recount.
        self._counts = np.zeros(vocab_size, dtype=np.float32) if self._penalize_counts else None
        self._seen: list[int] = []  # distinct token ids with a nonzero count
        self._n_counted = 0
        # (sampled id, its logprob, [(alternative id, logprob), ...]) of the last sample
        # that asked for them
        self.logprobs: tuple[int, float, list[tuple[int, float]]] | None = None

    # ------------------------------------------------------------------ penalties

    def _sync_counts(self, recent: Sequence[int]) -> None:
        assert self._counts is not None
        if len(recent) < self._n_counted:  # a different sequence: start over
            self._counts[self._seen] = 0.0
            self._seen.clear()
            self._n_counted = 0
        for tok in recent[self._n_counted :]:
            if self._counts[tok] == 0.0:
                self._seen.append(tok)
            self._counts[tok] += 1.0
        self._n_counted = len(recent)

    # ------------------------------------------------------------------ sampling

    def sample(
        self,
        logits: np.ndarray,
        recent: Sequence[int] = (),
        mask: np.ndarray | None = None,
        *,
        logprobs: int | None = None,
        draft: int | None = None,
    ) -> int:
        """The next token id.

        ``logits``: float scores of shape ``(n,)``, ``n >= vocab_size`` (rows past the
        vocabulary are ignored). ``recent``: the tokens generated so far, oldest first (the
        same growing list across calls). ``mask``: booleans, True where a token is allowed.
        ``logprobs``: also work out :attr:`logprobs` with that many alternatives.
        ``draft``: a token proposed for this position (speculative decoding). It is
        returned when accepted: greedy, when it is the best token; sampling, with the
        probability the request's distribution gives it, else the token is drawn from that
        distribution without it. Either way the token returned follows the same
        distribution as without a draft.
        """
        self.logprobs = None
        vals = logits[: self.vocab_size]
        window = recent[-REPEAT_LAST_N:] if self._penalize_recent else ()
        if not window and not self._penalize_counts and self._bias is None:
            return self._sample_and_score(vals, mask, logprobs, draft)
        if not vals.flags.writeable:
            vals = vals.copy()
        # Patch the few biased and penalised rows in place and restore them afterwards:
        # copying a 262k-entry vocabulary per token would cost more than all of them together.
        patches: list[tuple[np.ndarray, np.ndarray]] = []
        try:
            r = self.resolved
            if self._bias is not None:  # first, as llama.cpp's sampler chain does
                ids, biases = self._bias
                old = vals[ids]
                patches.append((ids, old))
                vals[ids] = old + biases
            if window:
                ids = np.fromiter(set(window), dtype=np.int64)
                old = vals[ids]
                patches.append((ids, old))
                vals[ids] = np.where(old <= 0.0, old * r.repeat_penalty, old / r.repeat_penalty)
            if self._penalize_counts:
                self._sync_counts(recent)
                if self._seen:
                    assert self._counts is not None
                    ids = np.asarray(self._seen, dtype=np.int64)
                    old = vals[ids]
                    patches.append((ids, old))
                    vals[ids] = old - (self._counts[ids] * r.frequency_penalty + r.presence_penalty)
            return self._sample_and_score(vals, mask, logprobs, draft)
        finally:
            for ids, old in reversed(patches):
                vals[ids] = old

    def _sample_and_score(
        self, vals: np.ndarray, mask: np.ndarray | None, top: int | None, draft: int | None
    ) -> int:
        tok = self._sample(vals, mask, draft)
        if top is not None:
            self.logprobs = token_logprobs(vals, mask, tok, top)
        return tok

    def _sample(self, vals: np.ndarray, mask: np.ndarray | None, draft: int | None = None) -> int:
        r = self.resolved
        ids: np.ndarray | None = None  # None: the candidates are the whole vocabulary
        if mask is not None:
            ids, vals = _apply_mask(vals, mask[: self.vocab_size])

        if r.greedy:
            top = int(np.argmax(vals))
            return int(ids[top]) if ids is not None else top

        if 0 < r.top_k < vals.size:
            keep = _top_k_indices(vals, r.top_k)
            ids = ids[keep] if ids is not None else keep
            vals = vals[keep]
        best = float(vals.max())

        # top-p normalises over everything top-k kept, so take the sum before min-p trims
        total = float(np.exp(vals - best).sum(dtype=np.float64)) if r.top_p < 1.0 else 0.0

        # min-p is relative to the best candidate: it keeps a prefix of the sorted order
        # and commutes with top-p, so applying it first only shrinks what top-p must sort.
        if r.min_p > 0.0:
            keep = np.flatnonzero(vals >= best + math.log(r.min_p))
            ids = ids[keep] if ids is not None else keep
            vals = vals[keep]

        if r.top_p < 1.0:
            if vals.size > _SORT_LIMIT:
                keep = _top_p_superset(vals, best, r.top_p * total)
                ids = ids[keep] if ids is not None else keep
                vals = vals[keep]
            order = np.argsort(-vals, kind="stable")
            ids = ids[order] if ids is not None else order
            vals = vals[order]
            cum = np.cumsum(np.exp(vals.astype(np.float64) - best))
            cut = int(np.searchsorted(cum, r.top_p * total, side="left")) + 1
            ids, vals = ids[:cut], vals[:cut]

        weights = np.exp((vals.astype(np.float64) - best) / r.temperature)
        if draft is not None:
            at = _position(ids, draft, vals.size)
            if at >= 0:
                # accept with the draft's probability; else draw from the others
                if self._rng.random() * weights.sum() < weights[at]:
                    return draft
                weights[at] = 0.0
                if not weights.any():
                    return draft
        if vals.size == 1:
            return int(ids[0]) if ids is not None else 0
        cum = np.cumsum(weights)
        pick = min(
            int(np.searchsorted(cum, self._rng.random() * cum[-1], side="right")), vals.size - 1
        )
        return int(ids[pick]) if ids is not None else pick


def _position(ids: np.ndarray | None, token: int, n: int) -> int:
    """Where ``token`` sits among the candidates (``ids``, None: all ``n``); -1: absent."""
    if ids is None:
        return token if 0 <= token < n else -1
    hits = np.flatnonzero(ids == token)
    return int(hits[0]) if hits.size else -1


def token_logprobs(
    vals: np.ndarray, mask: np.ndarray | None, tok: int, top: int
) -> tuple[int, float, list[tuple[int, float]]]:
    """Log-probabilities under the distribution the reported ``logprobs`` are taken from:
    the softmax of the logits after the logit bias, the penalties and the grammar's mask
    (disallowed tokens
    get -inf), before temperature and the top-k / top-p / min-p cut-offs, so they do not
    depend on how the token was drawn. Returns the sampled token's, and the ``top`` most
    likely tokens', most likely first."""
    scores = vals.astype(np.float64)
    if mask is not None:
        scores = np.where(mask[: scores.size], scores, -np.inf)
    best = float(scores.max())
    log_z = best + math.log(float(np.exp(scores - best).sum()))
    alts: list[tuple[int, float]] = []
    if top > 0:
        k = min(top, scores.size)
        ids = np.argpartition(-scores, k - 1)[:k]
        ids = ids[np.lexsort((ids, -scores[ids]))]
        alts = [(int(i), float(scores[i]) - log_z) for i in ids if np.isfinite(scores[i])]
    return tok, float(scores[tok]) - log_z, alts


# Above this many candidates a full sort costs more than narrowing first.
_SORT_LIMIT = 4096
_MASKED = np.float32(-1e30)


def _apply_mask(vals: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """Restrict ``vals`` to the allowed tokens: (ids or None for all, their logits)."""
    n_allowed = int(np.count_nonzero(mask))
    if n_allowed == 0:
        raise ValueError("the token mask allows no token")
    if vals.size <= _SORT_LIMIT or n_allowed * 8 < vals.size:
        ids = np.flatnonzero(mask)
        return ids, vals[ids]
    # A dense mask over a large vocabulary: an additive bias is branch-free and cheaper
    # than gathering; masked tokens sit at -1e30 and get zero weight in every later step.
    out = np.multiply(~mask, _MASKED, dtype=np.float32)
    out += vals
    return None, out


def _top_k_indices(vals: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest values (unordered)."""
    n = vals.size
    stride = n // (k * 64)
    if stride >= 4:
        # The k-th largest of a strided sample is a lower bound for the k-th largest of
        # all, so everything at or above it is a (small) exact superset of the top k.
        sample = vals[::stride]
        bound = np.partition(sample, sample.size - k)[sample.size - k]
        cand = np.flatnonzero(vals >= bound)
        if cand.size <= n // 4:
            part = np.argpartition(vals[cand], cand.size - k)[cand.size - k :]
            return cand[part]
    return np.argpartition(vals, n - k)[n - k :]


def _top_p_superset(vals: np.ndarray, best: float, mass: float) -> np.ndarray:
    """Indices of a set of the largest values whose weight reaches ``mass`` (a superset of
    the top-p prefix), found by widening a logit window instead of sorting everything."""
    for width in (2.0, 4.0, 8.0, 16.0, 32.0):
        keep = np.flatnonzero(vals >= best - width)
        if keep.size and float(np.exp(vals[keep] - best).sum(dtype=np.float64)) >= mass:
            return keep
    return np.arange(vals.size)
