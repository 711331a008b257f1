from __future__ import annotations

import pytest

from lmserve_core.kv_slots import SlotPool, common_prefix_length


class FakeCache:
    """Rows are the token ids that were written, so a copy is checkable."""

    made = 0

    def __init__(self) -> None:
        FakeCache.made += 1
        self.rows: dict[int, int] = {}


def fill(slot, tokens: list[int]) -> None:  # type: ignore[no-untyped-def]
    """What the backend does after adopt: prefill the rest and grow the shadow."""
    for pos in range(len(slot.tokens), len(tokens)):
        slot.cache.rows[pos] = tokens[pos]
    slot.tokens[:] = tokens


class Pool:
    def __init__(self, n: int) -> None:
        self.copies: list[tuple[int, int, int]] = []
        self.pool = SlotPool(n, FakeCache, self.copy)

    def copy(self, src: FakeCache, dst: FakeCache, n: int) -> None:
        self.copies.append((id(src), id(dst), n))
        for i in range(n):
            dst.rows[i] = src.rows[i]

    def run(self, prompt: list[int], reply: list[int] = ()):  # type: ignore[no-untyped-def,assignment]
        slot, n = self.pool.adopt(prompt)
        assert slot.tokens == prompt[:n]
        assert all(slot.cache.rows[i] == prompt[i] for i in range(n))
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
