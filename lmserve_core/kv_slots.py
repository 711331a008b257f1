"""Resident KV slots and prefix reuse across requests.

The API is stateless but the KV cache is not: each slot keeps a cache and the token shadow
of the positions it holds. A request adopts the slot that can reuse the longest prefix of
its prompt, when that prefix passes a similarity gate (more than 10% of the prompt, as
llama.cpp does), and prefills only the rest. How much of a shared token prefix a slot can
reuse is the cache's answer (``KVCache.reusable_prefix``): attention rows keep any prefix, a
sliding window only one near its end, a recurrent state its own length or a checkpoint.

* a continuation (the slot's whole shadow is a prefix of the prompt) takes the slot whole;
* a prompt that merely shares a prefix with a slot holding another conversation gets the
  least-recently-used other slot, with that prefix copied in, so the donor stays intact for
  its own continuation. When the donor's cache cannot copy (``CacheKind.copy_prefix`` is
  false), or there is a single slot, the donor itself is cut back: reusing the prefix now
  is worth more than the chance that its conversation continues;
* otherwise the least-recently-used slot starts from scratch.

Slots of sequences being generated are ``busy``: they are never handed out or cut back, but
they still lend a prefix by copy (the rows a busy slot holds only ever grow).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import structlog

from .kv_disk import DiskTier, StoredPrefix
from .model import KVCache

log = structlog.get_logger("lmserve.kv_slots")

C = TypeVar("C", bound=KVCache)

SIMILARITY_GATE = 0.1


@dataclass(slots=True)
class KVSlot(Generic[C]):
    """One resident cache and the tokens of the positions it holds, 0..n-1."""

    index: int
    make_cache: Callable[[], C] = field(repr=False)
    tokens: list[int] = field(default_factory=list)
    last_used: int = 0
    busy: bool = False  # a sequence is being generated in it
    stored: int = 0  # how many of its tokens a disk-tier file holds
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
        """Keep only the first ``n`` positions (0, or what the cache can reuse)."""
        if n < len(self.tokens) and self._cache is not None:
            self._cache.truncate(n)
        del self.tokens[n:]
        self.stored = min(self.stored, n)

    def release(self) -> None:
        """Drop the cache (it is reallocated empty on next use)."""
        self._cache = None
        self.tokens.clear()
        self.stored = 0


@dataclass(slots=True)
class _Match(Generic[C]):
    slot: KVSlot[C]
    reusable: int  # prompt tokens the slot's cache can continue from
    continuation: bool


class SlotPool(Generic[C]):
    """``n_slots`` KV slots; ``make_cache()`` allocates one cache and ``copy_rows(src, dst,
    n)`` copies positions ``[0, n)`` between caches (``ForwardModel.copy_rows``)."""

    def __init__(
        self,
        n_slots: int,
        make_cache: Callable[[], C],
        copy_rows: Callable[[C, C, int], None] | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        if n_slots < 1:
            raise ValueError("n_slots must be at least 1")
        self.slots: list[KVSlot[C]] = [KVSlot(i, make_cache) for i in range(n_slots)]
        self._copy_rows = copy_rows
        self._tick = 0
        self.disk = disk
        self.last_tier = "none"  # where the last adopt found its prefix: resident, disk, none

    def adopt(self, prompt: Sequence[int], behind: Any = None) -> tuple[KVSlot[C], int]:
        """Pick a slot that is not busy for ``prompt``; return it and how many leading tokens
        it reuses.

        On return the slot's ``tokens`` are exactly the reused prefix of the prompt; the
        caller appends every token whose positions it then writes. At least one prompt token
        is always left to prefill (the next token's logits come from it). Raises
        ``RuntimeError`` when every slot is busy.

        ``behind`` is the KV prefix the conversation stands behind when caches may stand
        behind different ones (``lmserve_core.cartridge.serve.PrefixRows``, a fleet's
        choice): only slots behind the same prefix lend theirs, the slot returned stands
        behind it (``cache.stand_behind``), and the disk tier is not consulted. None: every
        cache stands behind the same prefix, or none.
        """
        free = [slot for slot in self.slots if not slot.busy]
        if not free:
            raise RuntimeError("every KV slot is in use")
        self._tick += 1
        limit = max(len(prompt) - 1, 0)
        copy = self._copy_rows
        matches = [
            self._match(slot, prompt, limit)
            for slot in self.slots
            if slot.tokens and (not slot.busy or (copy is not None and slot.cache.kind.copy_prefix))
            and (behind is None or getattr(slot.cache, "prefix", None) is behind)
        ]
        slot, n = self._adopt(prompt, limit, free, matches, behind is None)
        if behind is not None and slot.cache.prefix is not behind:  # type: ignore[attr-defined]
            assert n == 0
            slot.cache.stand_behind(behind)  # type: ignore[attr-defined]
        return slot, n

    def _adopt(
        self, prompt: Sequence[int], limit: int, free: list[KVSlot[C]],
        matches: list[_Match[C]], disk: bool,
    ) -> tuple[KVSlot[C], int]:
        copy = self._copy_rows
        best = max(
            matches,
            key=lambda m: (m.reusable, m.continuation, m.slot.last_used),
            default=None,
        )
        gate = SIMILARITY_GATE * len(prompt)
        resident = best.reusable if best is not None else 0
        if self.disk is not None and disk:
            restored = self._restore(prompt, limit, free, max(resident, gate))
            if restored is not None:
                return restored
            self.disk.stats.misses += 1
        if best is None or best.reusable <= gate:
            slot = self._lru(free)
            self._cut(slot, 0)
            self.last_tier = "none"
            return self._touch(slot), 0

        self.last_tier = "resident"
        donor, n = best.slot, best.reusable
        others = [slot for slot in free if slot is not donor]
        if not donor.busy and (
            best.continuation or copy is None or not others or not donor.cache.kind.copy_prefix
        ):
            self._cut(donor, n)
            return self._touch(donor), n

        # Same prefix, different conversation (or one still being generated): copy it so
        # the donor survives.
        assert copy is not None
        target = self._lru(others)
        self._cut(target, 0)
        copy(donor.cache, target.cache, n)
        target.tokens[:] = prompt[:n]
        return self._touch(target), n

    # ------------------------------------------------------------------ the disk tier

    def _restore(
        self, prompt: Sequence[int], limit: int, free: list[KVSlot[C]], beat: float
    ) -> tuple[KVSlot[C], int] | None:
        """Restore the disk tier's best file for ``prompt`` into a free slot when it reuses
        more than ``beat`` tokens; None otherwise."""
        assert self.disk is not None
        target = self._lru(free)
        for entry, common in self.disk.matches(prompt, limit)[:3]:
            if common <= beat:
                return None
            n = int(entry.tokens.size)
            if n > target.cache.n_ctx or not target.cache.kind.snapshot:
                continue
            state = self.disk.load(entry)  # None: a file that turned out bad (dropped)
            if state is not None:
                return self._restore_into(target, entry, common, state, beat)
        return None

    def _restore_into(
        self, target: KVSlot[C], entry: StoredPrefix, common: int, state: Any, beat: float
    ) -> tuple[KVSlot[C], int] | None:
        assert self.disk is not None
        n = int(entry.tokens.size)
        self._cut(target, 0)
        try:
            target.cache.restore(n, state)  # type: ignore[attr-defined]
        except (ValueError, RuntimeError) as exc:  # a state the cache refuses
            self.disk._drop(entry)
            self.disk.stats.skipped += 1
            log.warning("kv_disk_skipped", path=str(entry.path), reason=str(exc))
            target.truncate(0)
            return None
        target.tokens[:] = entry.tokens.tolist()
        target.stored = n
        reusable = target.cache.reusable_prefix(n, common)
        target.truncate(reusable)
        if reusable <= beat:  # e.g. a window that cannot continue from so early
            return None
        self.disk.stats.hits += 1
        self.last_tier = "disk"
        return self._touch(target), reusable

    def _cut(self, slot: KVSlot[C], n: int) -> None:
        """Cut ``slot`` back to ``n`` tokens; when that drops more than half of what it
        holds and no file has it yet, it is spilled to the disk tier first."""
        held = len(slot.tokens)
        if self.disk is not None and n < held / 2:
            self.spill(slot)
        slot.truncate(n)

    def spill(self, slot: KVSlot[C]) -> bool:
        """Store ``slot``'s tokens and cache state in the disk tier, unless a file has
        them; True when a file was written."""
        held = len(slot.tokens)
        if self.disk is None or held == 0 or slot.stored >= held or not slot.allocated:
            return False
        if not slot.cache.kind.snapshot:
            return False
        written = self.disk.store(slot.tokens, slot.cache.snapshot(held))  # type: ignore[attr-defined]
        slot.stored = held
        return written

    def flush(self) -> int:
        """Spill every resident slot no file holds yet (a graceful stop); the files written."""
        return sum(self.spill(slot) for slot in self.slots)

    @staticmethod
    def _match(slot: KVSlot[C], prompt: Sequence[int], limit: int) -> _Match[C]:
        held = len(slot.tokens)
        common = common_prefix_length(slot.tokens, prompt)
        wanted = min(common, limit)
        reusable = slot.cache.reusable_prefix(held, wanted) if wanted > 0 else 0
        return _Match(slot, reusable, continuation=common == held)

    @staticmethod
    def _lru(slots: list[KVSlot[C]]) -> KVSlot[C]:
        return min(slots, key=lambda s: s.last_used)

    def _touch(self, slot: KVSlot[C]) -> KVSlot[C]:
        slot.last_used = self._tick
        return slot

    def clear(self) -> None:
        """Release every cache."""
        for slot in self.slots:
            slot.release()


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    if list(a[:n]) == list(b[:n]):
        return n
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0])
