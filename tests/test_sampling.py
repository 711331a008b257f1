from __future__ import annotations

import collections
import math

import numpy as np
import pytest

from lmserve_core.backend import SamplingDefaults
from lmserve_core.request import Sampling
from lmserve_core.sampling import ResolvedSampling, Sampler, resolve


def rs(**kw: object) -> ResolvedSampling:
    base: dict[str, object] = dict(
        temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repeat_penalty=1.0, seed=0
    )
    base.update(kw)
    return ResolvedSampling(**base)  # type: ignore[arg-type]


def logits_of(probs: list[float]) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float32))


def histogram(resolved: ResolvedSampling, logits: np.ndarray, n: int = 4000) -> collections.Counter:
    sampler = Sampler(resolved, logits.size)
    return collections.Counter(sampler.sample(logits) for _ in range(n))


# a small hand-made distribution: token 0 is best, then 1, 2, 3, 4
PROBS = [0.5, 0.25, 0.15, 0.07, 0.03]


def test_resolve_takes_defaults_for_absent_fields() -> None:
    defaults = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, repeat_penalty=1.1)
    r = resolve(Sampling(temperature=0.2, seed=5), defaults)
    assert r == ResolvedSampling(
        temperature=0.2, top_p=0.8, top_k=20, min_p=0.0, repeat_penalty=1.1, seed=5
    )
    assert resolve(Sampling(), defaults, seed=9).seed == 9
    assert resolve(Sampling(top_k=0, presence_penalty=0.5), defaults).presence_penalty == 0.5


def test_greedy_is_argmax() -> None:
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    sampler = Sampler(rs(temperature=0.0), 4)
    assert [sampler.sample(logits) for _ in range(5)] == [1] * 5


def test_mask_applies_before_everything() -> None:
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    mask = np.array([True, False, False, True])
    assert Sampler(rs(temperature=0.0), 4).sample(logits, mask=mask) == 0
    hist = histogram(rs(), logits * 0, 200)
    assert set(hist) == {0, 1, 2, 3}
    sampler = Sampler(rs(), 4)
    assert {sampler.sample(logits * 0, mask=mask) for _ in range(200)} == {0, 3}
    with pytest.raises(ValueError):
        sampler.sample(logits, mask=np.zeros(4, dtype=bool))


def test_seeded_draws_repeat_and_unseeded_vary() -> None:
    logits = np.zeros(1000, dtype=np.float32)
    a = Sampler(rs(seed=42), 1000)
    b = Sampler(rs(seed=42), 1000)
    assert [a.sample(logits) for _ in range(50)] == [b.sample(logits) for _ in range(50)]
    c = Sampler(rs(seed=None), 1000)
    d = Sampler(rs(seed=None), 1000)
    assert [c.sample(logits) for _ in range(50)] != [d.sample(logits) for _ in range(50)]


def test_plain_draw_follows_the_distribution() -> None:
    hist = histogram(rs(), logits_of(PROBS), 20000)
    for tok, p in enumerate(PROBS):
        assert abs(hist[tok] / 20000 - p) < 0.02


def test_top_k_keeps_the_k_best() -> None:
    assert set(histogram(rs(top_k=2), logits_of(PROBS))) == {0, 1}
    assert set(histogram(rs(top_k=1), logits_of(PROBS), 50)) == {0}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    # cumulative: 0.5, 0.75, 0.90, 0.97, 1.0
    assert set(histogram(rs(top_p=0.75), logits_of(PROBS))) == {0, 1}
    assert set(histogram(rs(top_p=0.76), logits_of(PROBS))) == {0, 1, 2}
    assert set(histogram(rs(top_p=0.1), logits_of(PROBS), 50)) == {0}


def test_top_p_normalises_over_the_top_k_set() -> None:
    # within top-2: 0.5/0.75 = 0.667, so top_p=0.6 keeps only token 0
    assert set(histogram(rs(top_k=2, top_p=0.6), logits_of(PROBS))) == {0}


def test_min_p_is_relative_to_the_best() -> None:
    # 0.5 * 0.29 = 0.145: tokens 0, 1, 2 stay
    assert set(histogram(rs(min_p=0.29), logits_of(PROBS))) == {0, 1, 2}
    assert set(histogram(rs(min_p=0.31), logits_of(PROBS))) == {0, 1}


def test_temperature_sharpens_and_flattens() -> None:
    cold = histogram(rs(temperature=0.25), logits_of(PROBS), 4000)
    hot = histogram(rs(temperature=4.0), logits_of(PROBS), 4000)
    assert cold[0] / 4000 > 0.9
    # at T=4 token 4 gets 0.03^0.25 / sum(p^0.25) ~ 0.12
    expected = PROBS[4] ** 0.25 / sum(p**0.25 for p in PROBS)
    assert abs(hot[4] / 4000 - expected) < 0.03


def test_repeat_penalty_over_the_last_64() -> None:
    logits = np.array([2.0, 1.9, -1.0, -1.1], dtype=np.float32)
    sampler = Sampler(rs(temperature=0.0, repeat_penalty=1.5), 4)
    assert sampler.sample(logits, [0]) == 1  # 2.0 / 1.5 < 1.9
    assert sampler.sample(logits, [0] + [3] * 64) == 0  # token 0 left the window
    neg = np.array([-1.0, -1.2, -5.0], dtype=np.float32)
    # negative logits are multiplied: -1.0 * 1.5 = -1.5 < -1.2
    assert Sampler(rs(temperature=0.0, repeat_penalty=1.5), 3).sample(neg, [0]) == 1


def test_presence_and_frequency_penalties_count_generated_tokens() -> None:
    logits = np.array([3.0, 2.0, 0.0], dtype=np.float32)
    presence = Sampler(rs(temperature=0.0, presence_penalty=1.5), 3)
    assert presence.sample(logits, [0]) == 1
    assert presence.sample(logits, [0, 0, 0]) == 1  # presence does not grow with count

    freq = Sampler(rs(temperature=0.0, frequency_penalty=0.4), 3)
    recent: list[int] = []
    picks = []
    for _ in range(6):
        tok = freq.sample(logits, recent)
        picks.append(tok)
        recent.append(tok)
    # token 0 falls below token 1 once counted 3 times (3.0 - 1.2 < 2.0)
    assert picks[:3] == [0, 0, 0]
    assert picks[3] == 1
    # a shorter `recent` is a new sequence: counts restart
    assert freq.sample(logits, []) == 0


def test_large_vocab_paths_agree_with_small_ones() -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(262144).astype(np.float32) * 4
    best = int(np.argmax(logits))
    assert Sampler(rs(temperature=0.0), logits.size).sample(logits) == best
    assert Sampler(rs(top_k=1), logits.size).sample(logits) == best
    s = Sampler(rs(top_k=0, min_p=0.0, top_p=1e-6), logits.size)
    assert s.sample(logits) == best
    assert math.isfinite(float(logits[Sampler(rs(top_k=40), logits.size).sample(logits)]))


def test_penalties_leave_the_callers_logits_unchanged() -> None:
    logits = np.array([3.0, 2.0, -1.0, 0.5], dtype=np.float32)
    before = logits.copy()
    sampler = Sampler(rs(repeat_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2), 4)
    sampler.sample(logits, [0, 2, 2])
    assert np.array_equal(logits, before)
    frozen = before.copy()
    frozen.flags.writeable = False
    greedy = Sampler(rs(temperature=0.0, presence_penalty=5.0), 4)
    assert greedy.sample(frozen, [0]) == 1


def test_logprobs_are_the_softmax_after_penalties_and_mask() -> None:
    logits = logits_of(PROBS)
    plain = Sampler(rs(temperature=0.7, top_k=2), 5)
    tok = plain.sample(logits, logprobs=3)
    assert plain.logprobs is not None
    chosen, value, top = plain.logprobs
    # the model's distribution: neither temperature nor top-k changes it
    assert chosen == tok and value == pytest.approx(math.log(PROBS[tok]), abs=1e-6)
    assert [i for i, _ in top] == [0, 1, 2]
    assert [v for _, v in top] == pytest.approx([math.log(p) for p in PROBS[:3]], abs=1e-6)
    # a penalty moves the reported values; a mask renormalises over the allowed tokens
    penalised = Sampler(rs(temperature=0.0, presence_penalty=1.0), 5)
    penalised.sample(logits, [0], mask=np.array([True, True, False, True, True]), logprobs=5)
    assert penalised.logprobs is not None
    _, _, top = penalised.logprobs
    scores = np.log(np.asarray(PROBS, dtype=np.float64))
    scores[0] -= 1.0
    scores[2] = -np.inf
    want = scores - np.log(np.exp(scores).sum())
    assert [i for i, _ in top] == [1, 0, 3, 4]  # the disallowed token is not offered
    assert [v for _, v in top] == pytest.approx(list(want[[1, 0, 3, 4]]), abs=1e-6)
    assert penalised.sample(logits) == 0 and penalised.logprobs is None


def test_logit_bias_is_added_before_sampling() -> None:
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    before = logits.copy()
    # greedy honours it: -100 bans the best token, +100 forces another
    assert Sampler(rs(temperature=0.0, logit_bias=((1, -100.0),)), 4).sample(logits) == 2
    assert Sampler(rs(temperature=0.0, logit_bias=((3, 100.0),)), 4).sample(logits) == 3
    assert Sampler(rs(temperature=0.0, logit_bias=((2, 0.2),)), 4).sample(logits) == 2
    assert np.array_equal(logits, before)  # the caller's logits are restored
    frozen = before.copy()
    frozen.flags.writeable = False
    assert Sampler(rs(temperature=0.0, logit_bias=((0, 100.0),)), 4).sample(frozen) == 0
    # sampling: a banned token is never drawn, a forced one always is
    banned = Sampler(rs(logit_bias=((1, -100.0), (2, -100.0))), 4)
    assert {banned.sample(logits * 0) for _ in range(200)} == {0, 3}
    forced = Sampler(rs(temperature=2.0, logit_bias=((3, 100.0),)), 4)
    assert {forced.sample(logits) for _ in range(200)} == {3}
    # before the penalties (llama.cpp's order): the repeat penalty divides the biased logit
    both = Sampler(rs(temperature=0.0, repeat_penalty=2.0, logit_bias=((2, 3.0),)), 4)
    assert both.sample(logits, [2]) == 1  # (2.9 + 3) / 2 < 3.0
    with pytest.raises(ValueError):
        Sampler(rs(logit_bias=((4, 1.0),)), 4)


def test_logit_bias_from_the_request() -> None:
    r = resolve(Sampling(logit_bias={7: -100.0, 3: 0.0, 5: 2.5}), SamplingDefaults())
    assert r.logit_bias == ((7, -100.0), (5, 2.5))  # a zero bias changes nothing
    assert resolve(Sampling(), SamplingDefaults()).logit_bias == ()


def test_logit_bias_under_a_mask_and_with_drafts_and_logprobs() -> None:
    logits = logits_of(PROBS)
    # a grammar's mask wins: a banned token it alone allows is still the one taken
    only_banned = np.array([False, True, False, False, False])
    greedy = Sampler(rs(temperature=0.0, logit_bias=((1, -100.0),)), 5)
    assert greedy.sample(logits, mask=only_banned) == 1
    assert greedy.sample(logits, mask=~only_banned) == 0
    # a draft is checked against the biased logits
    biased = Sampler(rs(temperature=0.0, logit_bias=((0, -100.0),)), 5)
    assert biased.sample(logits, draft=0) == 1
    assert biased.sample(logits, draft=1) == 1
    # logprobs are those of the biased distribution
    scored = Sampler(rs(temperature=0.0, logit_bias=((4, 100.0),)), 5)
    assert scored.sample(logits, logprobs=2) == 4
    assert scored.logprobs is not None
    tok, value, top = scored.logprobs
    assert tok == 4 and value == pytest.approx(0.0, abs=1e-6)
    assert [i for i, _ in top] == [4, 0]
    assert top[1][1] == pytest.approx(math.log(PROBS[0]) - math.log(PROBS[4]) - 100, abs=1e-3)
