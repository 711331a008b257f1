"""Speculative decoding's pace on a busy machine: what a verify row costs (calibrated, then
checked against live passes read against their neighbours) and how many drafts to try
(estimates shared by a backend's generations, a margin, pauses that grow while drafts are
refused). Timings are fed in, or come from a fake clock: every figure here is
deterministic."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest

from lmserve_core import speculative
from lmserve_core.model import CacheKind
from lmserve_core.speculative import MAX_DRAFT, Acceptance, Pace, VerifyCost

STEP = 0.004  # a plain decode step, seconds


# ---------------------------------------------------------------------------- calibration


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Cache:
    def __init__(self, n_ctx: int, truncate: bool) -> None:
        self.n_ctx = n_ctx
        self.kind = CacheKind("attention" if truncate else "recurrent", truncate=truncate)
        self.pos = 0
        self.marked: int | None = None
        self.closed = False

    def mark(self) -> None:
        self.marked = self.pos

    def rewind(self) -> int:
        assert self.marked is not None
        self.pos, self.marked = self.marked, None
        return self.pos

    def close(self) -> None:
        self.closed = True


class TimedModel:
    """Passes of ``n`` rows that take ``STEP * (1 + row * (n - 1))`` on ``clock``, those
    that ``held(call)`` picks ten steps longer (something else ran)."""

    n_vocab = 64

    def __init__(self, clock: Clock, row: float, held: Callable[[int], bool],
                 truncate: bool = True) -> None:
        self.clock, self.row, self.held, self.truncate = clock, row, held, truncate
        self.calls = 0
        self.caches: list[_Cache] = []

    def new_cache(self, n_ctx: int) -> _Cache:
        self.caches.append(_Cache(n_ctx, self.truncate))
        return self.caches[-1]

    def forward(self, cache: _Cache, tokens: Sequence[int], pos: int, *,
                all_logits: bool = False) -> np.ndarray:
        self.calls += 1
        if not self.truncate:
            assert pos == cache.pos, "a recurrent state goes on only from where it is"
        cache.pos = pos + len(tokens)
        took = STEP * (1.0 + self.row * (len(tokens) - 1))
        self.clock.now += took + (10 * STEP if self.held(self.calls) else 0.0)
        shape = (len(tokens), self.n_vocab) if all_logits else (self.n_vocab,)
        return np.zeros(shape, np.float32)


@pytest.mark.parametrize("truncate", [True, False], ids=["attention", "recurrent"])
def test_calibration_is_not_fooled_by_held_up_passes(
    monkeypatch: pytest.MonkeyPatch, truncate: bool
) -> None:
    clock = Clock()
    monkeypatch.setattr(speculative, "time", clock)
    # one pass in nine held up ten steps, one-row passes and verify passes alike
    model = TimedModel(clock, 0.25, lambda call: call % 9 == 0, truncate)
    cost = VerifyCost()
    assert cost.calibrate(model) == pytest.approx(0.25, abs=0.02)  # type: ignore[arg-type]
    assert cost.calibrated == cost.row
    lo, hi = VerifyCost.CALIBRATION_PASSES
    assert 1 + len(VerifyCost.CALIBRATION_ROWS) + 1 + 2 * lo <= model.calls
    assert model.calls <= 1 + len(VerifyCost.CALIBRATION_ROWS) + 1 + 2 * hi
    [cache] = model.caches  # a cache of its own, released
    assert cache.closed


# ---------------------------------------------------------------------------- live passes


def chat_passes(n: int, row: float, rng: np.random.Generator, every: int = 5,
                slow: Callable[[int], float] = lambda i: 1.0) -> list[tuple[int, float]]:
    """Free chat's passes: one-row passes with a verify pass of 2 to 4 rows every
    ``every``; the machine ``slow(i)`` times slower at pass ``i``; 3% noise."""
    out = []
    for i in range(n):
        rows = int(rng.integers(2, 5)) if i % every == every - 1 else 1
        out.append((rows, STEP * slow(i) * (1 + row * (rows - 1)) * rng.uniform(0.97, 1.03)))
    return out


def test_live_passes_only_raise_the_calibration(rng: np.random.Generator) -> None:
    cost = VerifyCost(calibrated=0.3)
    for rows, seconds in chat_passes(200, 0.15, rng):  # rows cheaper than calibrated
        cost.observe(rows, seconds)
    assert cost.measured == pytest.approx(0.15, abs=0.03)
    assert cost.row == 0.3
    for rows, seconds in chat_passes(200, 0.6, rng):  # dearer: a long context, say
        cost.observe(rows, seconds)
    assert cost.row == pytest.approx(0.6, abs=0.05)


def test_slow_spells_read_neither_as_cheap_nor_as_dear_rows(rng: np.random.Generator) -> None:
    # the machine three times slower for 40 passes in every 100, in sudden steps: each
    # verify pass is read against the one-row passes of its own moment
    cost = VerifyCost()
    readings = []
    for rows, seconds in chat_passes(1000, 0.2, rng, slow=lambda i: 3.0 if i % 100 >= 60 else 1.0):
        cost.observe(rows, seconds)
        if cost.measured is not None:
            readings.append(cost.row)
    assert readings and all(0.15 <= r <= 0.25 for r in readings), (min(readings), max(readings))


def test_held_up_passes_move_no_reading(rng: np.random.Generator) -> None:
    cost = VerifyCost(calibrated=0.2)
    passes = chat_passes(600, 0.2, rng)
    for i, (rows, seconds) in enumerate(passes):
        if i % 13 == 0:
            seconds += 10 * STEP  # one pass in 13 held up, one-row or verify
        cost.observe(rows, seconds)
        if i > 100:
            assert cost.row == pytest.approx(0.2, abs=0.04)


def test_a_reading_nothing_corrects_ages_out(rng: np.random.Generator) -> None:
    cost = VerifyCost(calibrated=0.2)
    for rows, seconds in chat_passes(100, 1.2, rng):  # a spell when rows were very dear
        cost.observe(rows, seconds)
    assert cost.row == pytest.approx(1.2, abs=0.1)
    # no drafting after it, then only full verify passes: nothing to read them against
    for _ in range(VerifyCost.AGE // 2):
        cost.observe(1, STEP)
    for _ in range(VerifyCost.AGE // 2):
        cost.observe(1 + MAX_DRAFT, STEP * (1 + 0.2 * MAX_DRAFT))
    assert cost.row == pytest.approx(0.2)  # the calibration again (or readings of it)


# ---------------------------------------------------------------------------- the pace


def test_the_margin_keeps_break_even_drafts_out() -> None:
    # one draft right 40% of the time, a row at 0.35 of a step: 1.4 tokens for 1.35 steps
    assert Pace.best(0.4, MAX_DRAFT, 0.35, margin=0.0) == 1
    assert Pace.best(0.4, MAX_DRAFT, 0.35) == 0  # not by the margin
    assert Pace.best(0.4, MAX_DRAFT, 0.25) == 1
    assert Pace.best(0.95, MAX_DRAFT, 0.5) >= MAX_DRAFT - 1  # right drafts pay however dear


def refused(pace: Pace, chances: int, evidence: int) -> list[int]:
    """Drafts verified at each chance of a kind that is always refused."""
    out = []
    for _ in range(chances):
        k = pace.budget(MAX_DRAFT, evidence)
        if k:
            pace.update(k, 0, evidence)
        out.append(k)
    return out


def test_refused_drafts_stop_and_are_probed_ever_more_rarely() -> None:
    shared = Acceptance()
    pace = Pace(VerifyCost(calibrated=0.25), shared)
    drafted = refused(pace, 600, 2)
    tried = [i for i, k in enumerate(drafted) if k]
    # the prior's few passes, then probes of one draft after pauses that double
    assert sum(drafted[: tried[3]]) <= 8
    probes = [i for i in tried if drafted[i] == 1 and i > tried[3]]
    gaps = np.diff(probes).tolist()
    assert gaps == sorted(gaps) and gaps[-1] == (Pace.PAUSE_TOKENS << Pace.MAX_DOUBLINGS) + 2
    assert sum(drafted) <= 16  # rows verified over 600 chances
    # the next generation knows at once
    assert refused(Pace(pace.cost, shared), 1, 2) == [0]


def test_a_bad_spell_pauses_briefly_where_drafts_usually_pay() -> None:
    shared = Acceptance()
    for _ in range(20):  # earlier generations: long matches right
        shared.update(8, MAX_DRAFT, 0)
    pace = Pace(VerifyCost(calibrated=0.25), shared)
    assert pace.budget(MAX_DRAFT, 8) == MAX_DRAFT  # from the first chance
    drafted = refused(pace, 3, 8)  # this reply leaves the text it was quoting
    assert drafted[-1] == 0 or pace.budget(MAX_DRAFT, 8) == 0
    waited = 1
    while pace.budget(MAX_DRAFT, 8) == 0:
        waited += 1
    assert waited <= Pace.SHORT_PAUSE + 2  # and it quotes again


def test_each_kind_starts_from_what_the_backend_found() -> None:
    shared = Acceptance()
    first = Pace(VerifyCost(calibrated=0.25), shared)
    assert first.budget(MAX_DRAFT, 2) > 0  # nothing known: the prior says try
    for _ in range(30):
        if (k := first.budget(MAX_DRAFT, 2)) > 0:
            first.update(k, 0, 2)
        if (k := first.budget(MAX_DRAFT, 8)) > 0:
            first.update(k, k, 8)
    second = Pace(first.cost, shared)
    assert second.budget(MAX_DRAFT, 2) == 0
    assert second.budget(MAX_DRAFT, 8) == MAX_DRAFT
    assert second.rate(2) < 0.3 < 0.9 < second.rate(8)


def test_free_chat_on_a_busy_machine(rng: np.random.Generator) -> None:
    """A recorded-like reply of free text: short matches (2 and 3 tokens) right one time in
    five, eight-token matches nine in ten; one pass in eleven held up by ten steps. The
    drafting keeps to the long matches, and the row cost stays where it is."""
    cost = VerifyCost(calibrated=0.3)
    pace = Pace(cost, Acceptance())
    rows_by_kind = {2: 0, 3: 0, 8: 0}
    tokens = passes = 0
    while tokens < 2000:
        evidence = int(rng.choice([2, 3, 8], p=[0.5, 0.35, 0.15]))
        right = 0.2 if evidence < 8 else 0.9
        k = pace.budget(MAX_DRAFT, evidence)
        accepted = 0
        while accepted < k and rng.random() < right:
            accepted += 1
        seconds = STEP * (1 + 0.3 * k) * rng.uniform(0.97, 1.03)
        passes += 1
        if passes % 11 == 0:
            seconds += 10 * STEP
        cost.observe(1 + k, seconds)
        if k:
            pace.update(k, accepted, evidence)
        rows_by_kind[evidence] += k
        tokens += 1 + accepted
        assert cost.row == pytest.approx(0.3, abs=0.06)
    assert rows_by_kind[2] + rows_by_kind[3] < 0.05 * tokens  # refused kinds: rare probes
    assert rows_by_kind[8] > 0.05 * tokens  # the long matches are drafted
    # the steps the passes cost, against a plain step a token
    steps = passes + 0.3 * sum(rows_by_kind.values())
    assert tokens / steps > 1.0
