"""The process's C heap: keep what the server holds close to what it uses.

Two glibc behaviours cost a server like this one memory it never gives back:

- The mmap threshold adapts upwards: once a large block (a 1 MiB logits row of a 262k-token
  vocabulary, a sampling buffer) is freed, blocks of that size come from the heap instead of
  their own mapping, and the heap of the inference thread's arena keeps growing with
  fragmentation (measured: +60 MiB over a 4k-token conversation on Gemma-3-270M). A fixed
  threshold keeps large blocks in mappings that are returned when freed.
- Building a tokenizer of a large vocabulary leaves tens of MiB of freed heap that is only
  returned to the system by ``malloc_trim``.

Elsewhere (another C library, another OS) both calls do nothing.

:func:`available` and :func:`plan_kv_slots` are the RAM guard: the KV slots a server is
asked for, priced at start-up against the memory the system has available.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from pathlib import Path
from typing import Any, NamedTuple

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 256 * 1024  # blocks from this size get their own mapping


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt  # noqa: B018 - glibc only
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Make blocks of ``threshold`` bytes and more always come from their own mapping (a
    fixed threshold, so it no longer adapts upwards). True when the C library took it."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1)


def trim() -> bool:
    """Return freed heap memory of every arena to the system. True when some was."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0) == 1)


def available() -> int | None:
    """Bytes of memory available for new allocations (``MemAvailable``), or None where
    the system does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class SlotPlan(NamedTuple):
    """How many KV slots to keep, and why."""

    slots: int
    verdict: str  # "fits", "warn" (over half of available), "clamped", "forced", "unknown"


def plan_kv_slots(per_slot: int, wanted: int, avail: int | None, *, force: bool) -> SlotPlan:
    """The RAM guard's decision for ``wanted`` slots of ``per_slot`` bytes (each once every
    position is written: caches commit lazily, so an overcommit would otherwise show up
    mid-serving as the system evicting the mapped weights). Over half of ``avail``: keep
    them and warn. Over all of it: as many as fit in half (at least one), unless ``force``."""
    if avail is None or per_slot <= 0:
        return SlotPlan(wanted, "unknown")
    total = per_slot * wanted
    if total <= avail // 2:
        return SlotPlan(wanted, "fits")
    if total <= avail:
        return SlotPlan(wanted, "warn")
    if force:
        return SlotPlan(wanted, "forced")
    return SlotPlan(max(1, min(wanted, (avail // 2) // per_slot)), "clamped")
