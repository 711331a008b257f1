"""Resident KV slots and prefix reuse across requests.

The API is stateless but the KV cache is not: each slot keeps a cache and the token shadow
its rows were computed from. A request adopts the slot sharing the longest token prefix with
its prompt, when that prefix passes a similarity gate (more than 10% of the prompt, as
llama.cpp does), and prefills only the rest:

* a continuation (the slot's whole shadow is a prefix of the prompt) takes the slot whole;
* a prompt that merely shares a prefix with a slot holding another conversation gets the
  least-recently-used other slot, with the common rows copied in, so the donor stays intact
  for its own continuation (with a single slot the slot is simply cut back);
* otherwise the least-recently-used slot starts from scratch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

C = TypeVar("C")

SIMILARITY_GATE = 0.1


@dataclass(slots=True)
class KVSlot(Generic[C]):
    """One resident cache and the tokens whose K/V rows it holds, in positions 0..n-1."""

    index: int
    make_cache: Callable[[], C] = field(repr=False)
    tokens: list[int] = field(default_factory=list)
    last_used: int = 0
    _cache: C | None = field(default=None, repr=False)

    @property
    def cache(self) -> C:
        """The slot's cache, allocated on first use."""
        if self._cache is None:
            self._cache = self.make_cache()
        return self._cache

    @property
    def allocated(self) -> bool:
        return self._cache is not None

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` rows as valid."""
        del self.tokens[n:]

    def release(self) -> None:
        """Drop the cache (it is reallocated empty on next use)."""
        self._cache = None
        self.tokens.clear()


class SlotPool(Generic[C]):
    """``n_slots`` KV slots; ``make_cache()`` allocates one cache and ``copy_rows(src, dst,
    n)`` copies rows ``[0, n)`` between caches (``ForwardModel.copy_rows``)."""

    def __init__(
        self,
        n_slots: int,
        make_cache: Callable[[], C],
        copy_rows: Callable[[C, C, int], None] | None = None,
    ) -> None:
        if n_slots < 1:
            raise ValueError("n_slots must be at least 1")
        self.slots: list[KVSlot[C]] = [KVSlot(i, make_cache) for i in range(n_slots)]
        self._copy_rows = copy_rows
        self._tick = 0

    def adopt(self, prompt: Sequence[int]) -> tuple[KVSlot[C], int]:
        """Pick the slot for ``prompt``; return it and how many leading tokens it reuses.

        On return the slot's ``tokens`` are exactly the reused prefix of the prompt; the
        caller appends every token whose K/V rows it then writes. At least one prompt token
        is always left to prefill (the next token's logits come from it).
        """
        self._tick += 1
        limit = max(len(prompt) - 1, 0)
        best: KVSlot[C] | None = None
        best_len = 0
        for slot in self.slots:
            n = common_prefix_length(slot.tokens, prompt)
            if n > best_len or (
                n == best_len and best is not None and n > 0 and _prefer(slot, best, n)
            ):
                best, best_len = slot, n

        if best is None or best_len <= SIMILARITY_GATE * len(prompt):
            slot = self._lru()
            slot.truncate(0)
            return self._touch(slot), 0

        n_reuse = min(best_len, limit)
        continuation = best_len == len(best.tokens)
        if continuation or len(self.slots) == 1 or self._copy_rows is None:
            best.truncate(n_reuse)
            return self._touch(best), n_reuse

        # Same prefix, different conversation: copy the shared rows so the donor survives.
        target = self._lru(exclude=best)
        if n_reuse > 0:
            self._copy_rows(best.cache, target.cache, n_reuse)
        target.tokens[:] = prompt[:n_reuse]
        return self._touch(target), n_reuse

    def _lru(self, exclude: KVSlot[C] | None = None) -> KVSlot[C]:
        return min((s for s in self.slots if s is not exclude), key=lambda s: s.last_used)

    def _touch(self, slot: KVSlot[C]) -> KVSlot[C]:
        slot.last_used = self._tick
        return slot

    def clear(self) -> None:
        """Release every cache."""
        for slot in self.slots:
            slot.release()


def _prefer(slot: KVSlot[C], current: KVSlot[C], n: int) -> bool:
    # Equal prefixes: a continuation needs no copy; otherwise the more recently used.
    slot_cont, cur_cont = len(slot.tokens) == n, len(current.tokens) == n
    if slot_cont != cur_cont:
        return slot_cont
    return slot.last_used > current.last_used


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    if list(a[:n]) == list(b[:n]):
        return n
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0])
