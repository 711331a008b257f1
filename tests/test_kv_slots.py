"""KV slot reuse: continuation, prefix copy, LRU, and caches that are not plain rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lmserve_core.kv_slots import SlotPool, common_prefix_length
from lmserve_core.model import AttentionCache, CacheKind


class FakeCache(AttentionCache):
    """Rows are the token ids that were written, so a copy is checkable."""

    made = 0

    def __init__(self) -> None:
        FakeCache.made += 1
        self.n_ctx = 4096
        self.rows: dict[int, int] = {}

    def write(self, pos: int, token: int) -> None:
        self.rows[pos] = token

    def holds(self, tokens: list[int]) -> bool:
        return all(self.rows.get(i) == t for i, t in enumerate(tokens))

    def copy_to(self, dst: FakeCache, n: int) -> None:
        for i in range(n):
            dst.rows[i] = self.rows[i]


W, SLACK = 16, 4  # sliding window: a position attends to the W before it


class SlidingCache:
    """A ring of W + SLACK positions, each slot tagged with the position it holds."""

    kind = CacheKind("sliding_window", truncate=False, copy_prefix=False, snapshot=False)

    def __init__(self) -> None:
        self.n_ctx = 4096
        self.ring: list[tuple[int, int] | None] = [None] * (W + SLACK)
        self.held = 0
        self.cut_backs: list[int] = []

    def reusable_prefix(self, held: int, wanted: int) -> int:
        assert held == self.held, "the slot's shadow and the cache disagree"
        m = min(held, wanted)
        overwritten = max(0, held - len(self.ring))
        return m if max(0, m - W) >= overwritten else 0

    def truncate(self, n: int) -> None:
        assert n == 0 or self.reusable_prefix(self.held, n) == n, f"cannot cut back to {n}"
        self.ring = [e if e is not None and e[0] < n else None for e in self.ring]
        self.held = n
        self.cut_backs.append(n)

    def write(self, pos: int, token: int) -> None:
        assert pos == self.held, "a ring only appends"
        self.ring[pos % len(self.ring)] = (pos, token)
        self.held += 1

    def holds(self, tokens: list[int]) -> bool:
        n = len(tokens)
        window = range(max(0, n - W), n)
        return self.held == n and all(self.ring[p % len(self.ring)] == (p, tokens[p]) for p in window)

    def copy_to(self, dst: SlidingCache, n: int) -> None:
        raise AssertionError("a ring cannot give away a prefix")


EVERY = 16  # the recurrent fake saves a checkpoint every EVERY positions


class RecurrentCache:
    """A fixed-size state (here: what it has consumed) with periodic checkpoints."""

    kind = CacheKind("recurrent", truncate=False)

    def __init__(self) -> None:
        self.n_ctx = 4096
        self.state: tuple[int, ...] = ()
        self.checkpoints: dict[int, tuple[int, ...]] = {}
        self.cut_backs: list[int] = []

    def reusable_prefix(self, held: int, wanted: int) -> int:
        assert held == len(self.state), "the slot's shadow and the cache disagree"
        if wanted >= held:
            return held
        return max((n for n in self.checkpoints if n <= wanted), default=0)

    def truncate(self, n: int) -> None:
        self.state = self._state_at(n)
        self.checkpoints = {k: v for k, v in self.checkpoints.items() if k <= n}
        self.cut_backs.append(n)

    def write(self, pos: int, token: int) -> None:
        assert pos == len(self.state), "a state only advances"
        self.state += (token,)
        if len(self.state) % EVERY == 0:
            self.checkpoints[len(self.state)] = self.state

    def holds(self, tokens: list[int]) -> bool:
        return self.state == tuple(tokens)

    def copy_to(self, dst: RecurrentCache, n: int) -> None:
        dst.state = self._state_at(n)
        dst.checkpoints = {k: v for k, v in self.checkpoints.items() if k <= n}

    def _state_at(self, n: int) -> tuple[int, ...]:
        if n == 0:
            return ()
        if n == len(self.state):
            return self.state
        assert n in self.checkpoints, f"no checkpoint at {n}"
        return self.checkpoints[n]


def fill(slot, tokens: list[int]) -> None:  # type: ignore[no-untyped-def]
    """What the backend does after adopt: prefill the rest and grow the shadow."""
    for pos in range(len(slot.tokens), len(tokens)):
        slot.cache.write(pos, tokens[pos])
    slot.tokens[:] = tokens


class Pool:
    def __init__(self, n: int, make_cache: Callable[[], Any] = FakeCache) -> None:
        self.copies: list[tuple[int, int, int]] = []
        self.pool = SlotPool(n, make_cache, self.copy)

    def copy(self, src: Any, dst: Any, n: int) -> None:
        self.copies.append((id(src), id(dst), n))
        src.copy_to(dst, n)

    def run(self, prompt: list[int], reply: list[int] = ()):  # type: ignore[no-untyped-def,assignment]
        slot, n = self.pool.adopt(prompt)
        assert slot.tokens == prompt[:n]
        assert n < len(prompt), "at least one prompt token is left to prefill"
        assert slot.cache.holds(prompt[:n])
        fill(slot, prompt + list(reply))
        return slot, n


SYSTEM = list(range(100, 150))


def test_common_prefix_length() -> None:
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_length([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix_length([5], [6]) == 0


def test_caches_are_allocated_lazily() -> None:
    FakeCache.made = 0
    p = Pool(3)
    assert FakeCache.made == 0 and not any(s.allocated for s in p.pool.slots)
    p.run([1, 2, 3])
    assert FakeCache.made == 1


def test_continuation_adopts_the_slot_whole() -> None:
    p = Pool(2)
    first = SYSTEM + [1, 2, 3]
    slot_a, n = p.run(first, [7, 8])
    assert n == 0
    slot_b, n = p.run(first + [7, 8, 9, 10])
    assert slot_b is slot_a and n == len(first) + 2
    assert p.copies == []


def test_identical_prompt_leaves_one_token_to_prefill() -> None:
    p = Pool(1)
    prompt = SYSTEM + [1]
    p.run(prompt)
    _, n = p.run(prompt)
    assert n == len(prompt) - 1


def test_shared_prefix_copies_into_another_slot_and_keeps_the_donor() -> None:
    p = Pool(3)
    donor, _ = p.run(SYSTEM + [1, 2, 3], [4])
    donor_tokens = list(donor.tokens)
    other, n = p.run(SYSTEM + [9, 9])
    assert other is not donor and n == len(SYSTEM)
    assert p.copies == [(id(donor.cache), id(other.cache), len(SYSTEM))]
    assert donor.tokens == donor_tokens
    # the donor's own conversation continues warm
    again, n = p.run(donor_tokens + [5])
    assert again is donor and n == len(donor_tokens)


def test_shared_prefix_with_one_slot_cuts_the_slot_back() -> None:
    p = Pool(1)
    slot, _ = p.run(SYSTEM + [1, 2, 3], [4])
    again, n = p.run(SYSTEM + [9])
    assert again is slot and n == len(SYSTEM) and p.copies == []


def test_similarity_gate_rejects_short_shared_prefixes() -> None:
    p = Pool(2)
    a, _ = p.run([1, 2] + list(range(200, 240)))
    # 2 common tokens of a 42-token prompt: below 10%, so a fresh LRU slot
    b, n = p.run([1, 2] + list(range(300, 340)))
    assert n == 0 and b is not a and p.copies == []


def test_lru_slot_is_recycled() -> None:
    p = Pool(2)
    a, _ = p.run(list(range(10, 20)))
    b, _ = p.run(list(range(30, 40)))
    assert a is not b
    p.run(list(range(10, 20)) + [1])  # touches a
    c, n = p.run(list(range(50, 60)))
    assert c is b and n == 0


def test_regenerate_same_prompt_keeps_the_original_conversation() -> None:
    p = Pool(2)
    prompt = SYSTEM + [1, 2]
    first, _ = p.run(prompt, [3, 4, 5])
    regen, n = p.run(prompt)
    assert regen is not first and n == len(prompt) - 1
    assert first.tokens == prompt + [3, 4, 5]


def test_prefers_a_continuation_on_equal_prefixes() -> None:
    p = Pool(3)
    a, _ = p.run(SYSTEM + [1], [2, 3])  # shares SYSTEM+[1] with the next prompt, diverges
    b, _ = p.run(SYSTEM + [1])  # copy of that prefix: a continuation of SYSTEM+[1]
    assert b is not a
    c, n = p.run(SYSTEM + [1, 7, 7])
    assert n == len(SYSTEM) + 1 and c is b
    assert len(p.copies) == 1


def test_pool_needs_a_slot() -> None:
    with pytest.raises(ValueError):
        SlotPool(0, FakeCache)


# -- sliding window: cut back only near the end, never copied ---------------------------------


def test_sliding_window_continues_and_cuts_back_within_reach() -> None:
    p = Pool(1, SlidingCache)
    slot, _ = p.run(SYSTEM + [1, 2, 3], [4])
    again, n = p.run(SYSTEM + [1, 2, 3, 4, 5, 6])
    assert again is slot and n == len(SYSTEM) + 4 and slot.cache.cut_backs == []
    # the last turn edited: 55 of the 56 held positions, within the ring's slack
    edited, n = p.run(SYSTEM + [1, 2, 3, 4, 5, 9])
    assert edited is slot and n == len(SYSTEM) + 5 and slot.cache.cut_backs == [n]


def test_sliding_window_cut_back_out_of_reach_is_a_fresh_prefill() -> None:
    p = Pool(1, SlidingCache)
    slot, _ = p.run(SYSTEM + [1], list(range(1, 10)))  # 60 held: positions < 40 overwritten
    again, n = p.run(SYSTEM + [9])
    assert again is slot and n == 0 and slot.cache.cut_backs == [0]

    attention = Pool(1)
    attention.run(SYSTEM + [1], list(range(1, 10)))
    assert attention.run(SYSTEM + [9])[1] == len(SYSTEM)


def test_sliding_window_out_of_reach_leaves_the_slot_alone_when_another_is_free() -> None:
    p = Pool(2, SlidingCache)
    donor, _ = p.run(SYSTEM + [1], list(range(1, 10)))
    held = list(donor.tokens)
    other, n = p.run(SYSTEM + [9])
    assert other is not donor and n == 0
    assert donor.tokens == held and donor.cache.cut_backs == []


def test_sliding_window_prefix_is_not_copied_the_donor_is_cut_back() -> None:
    p = Pool(3, SlidingCache)
    donor, _ = p.run(SYSTEM + [1, 2, 3], [4])
    slot, n = p.run(SYSTEM + [9, 9])
    assert slot is donor and n == len(SYSTEM)
    assert p.copies == [] and donor.cache.cut_backs == [len(SYSTEM)]
    assert not any(s.allocated for s in p.pool.slots if s is not donor)


def test_slot_is_chosen_by_what_its_cache_can_reuse() -> None:
    p = Pool(2, SlidingCache)
    far, _ = p.run(SYSTEM + list(range(1, 11)))  # shares 50 with the last prompt, out of reach
    near, _ = p.run(SYSTEM[:30])  # shares 30, a continuation
    assert near is not far
    slot, n = p.run(SYSTEM + [77])
    assert slot is near and n == 30
    assert far.cache.cut_backs == [] and far.tokens == SYSTEM + list(range(1, 11))


# -- recurrent state: its own length or a checkpoint ------------------------------------------


def test_recurrent_continuation_keeps_the_state() -> None:
    p = Pool(1, RecurrentCache)
    slot, _ = p.run(SYSTEM + [1, 2, 3], [4])
    again, n = p.run(SYSTEM + [1, 2, 3, 4, 5])
    assert again is slot and n == len(SYSTEM) + 4 and slot.cache.cut_backs == []


def test_recurrent_cut_back_restores_the_nearest_checkpoint() -> None:
    p = Pool(1, RecurrentCache)
    slot, _ = p.run(SYSTEM + [1, 2, 3], [4])
    again, n = p.run(SYSTEM + [9])  # shares 50; checkpoints at 16, 32, 48
    assert again is slot and n == 48 and slot.cache.cut_backs == [48]
    # an identical prompt leaves a token to prefill, so it too goes back to a checkpoint
    prompt = SYSTEM + [9]
    assert p.run(prompt)[1] == 48 and p.run(prompt)[1] == 48


def test_recurrent_without_a_checkpoint_in_reach_starts_fresh() -> None:
    p = Pool(1, RecurrentCache)
    slot, _ = p.run(list(range(10)) + list(range(200, 230)))
    again, n = p.run(list(range(10)) + list(range(300, 330)))  # shares 10: above the gate
    assert again is slot and n == 0 and slot.cache.cut_backs == [0]


def test_recurrent_copies_a_checkpoint_and_keeps_the_donor() -> None:
    p = Pool(3, RecurrentCache)
    donor, _ = p.run(SYSTEM + [1, 2, 3], [4])
    donor_tokens, donor_state = list(donor.tokens), donor.cache.state
    other, n = p.run(SYSTEM + [9, 9])
    assert other is not donor and n == 48
    assert p.copies == [(id(donor.cache), id(other.cache), 48)]
    assert donor.tokens == donor_tokens and donor.cache.state == donor_state
    assert donor.cache.cut_backs == []
    again, n = p.run(donor_tokens + [5])
    assert again is donor and n == len(donor_tokens)
