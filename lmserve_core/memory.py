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

:class:`WeightArena` holds copies of a model's weights in the process's own memory, and
:func:`set_weights_mode` (``--weights``) says when models make them.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import mmap
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

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
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
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


#: ``--kv-slots auto``: the slots at full context may take this share of the available
#: memory (an eighth: two replicas of ``lmserve cluster`` on one node take a quarter, four
#: take half, the guard's limit), at most this many.
AUTO_SLOTS_SHARE = 8
AUTO_SLOTS_MAX = 64


def auto_kv_slots(per_slot: int | None, avail: int | None, least: int) -> int:
    """How many slots ``--kv-slots auto`` keeps: as many conversations as the memory share
    holds (caches commit lazily, so slots nobody uses cost nothing), at least ``least``."""
    if avail is None or not per_slot or per_slot <= 0:
        return least
    return max(least, min(AUTO_SLOTS_MAX, avail // AUTO_SLOTS_SHARE // per_slot))


# ------------------------------------------------------------------ weights
#: How models hold their weight matrices (``--weights``): "auto" copies them into the
#: process's memory while the copies stay within a quarter of the memory available at load
#: (the rest is read from the mapped file); "copy" copies all of them; "map" reads the mapped
#: file in place.
WEIGHT_MODES = ("auto", "copy", "map")
_weights_mode = "auto"


def set_weights_mode(mode: str) -> None:
    """Choose how models loaded from now on hold their weights (one of WEIGHT_MODES)."""
    global _weights_mode
    if mode not in WEIGHT_MODES:
        raise ValueError(f"weights mode must be one of {', '.join(WEIGHT_MODES)}, got {mode!r}")
    _weights_mode = mode


def weights_mode() -> str:
    """The mode set by :func:`set_weights_mode` ("auto" until then)."""
    return _weights_mode


def release_pages(data: npt.NDArray[Any]) -> bool:
    """Drop the pages of ``data``, a view of a read-only file mapping, from the process's
    resident set (Linux ``MADV_DONTNEED``; the pages whole inside it). They stay in the
    system's page cache and fault back in if read again. True when the system took it.
    Writable arrays are refused: on the process's own memory the call would zero it."""
    libc = _libc()
    if libc is None or not hasattr(mmap, "MADV_DONTNEED") or data.nbytes == 0:
        return False
    if data.flags.writeable:
        return False
    page = mmap.PAGESIZE
    addr = int(data.ctypes.data)
    start = -(-addr // page) * page
    end = (addr + data.nbytes) // page * page
    if end <= start:
        return False
    return bool(libc.madvise(start, end - start, mmap.MADV_DONTNEED) == 0)


class WeightArena:
    """Anonymous memory for copies of a model's weights.

    A decode step streams every weight once. Read through the file's mapping, in 4 KiB
    pages, that is a TLB miss every 4 KiB; anonymous mappings advised ``MADV_HUGEPAGE`` are
    backed by 2 MiB pages where the system allows it (Linux's transparent huge pages set to
    "madvise" or "always"). Matrices are placed 64-byte aligned in mappings of ``CHUNK``
    bytes, each started on a 2 MiB boundary; a matrix over a quarter of a chunk gets a
    mapping of its own. Where anonymous mappings are not available, numpy allocates."""

    CHUNK = 32 << 20
    HUGE = 2 << 20
    ALIGN = 64

    def __init__(self) -> None:
        self._maps: list[Any] = []  # the mappings every array views
        self._chunk: npt.NDArray[np.uint8] | None = None
        self._used = 0
        self.bytes = 0  # bytes handed out

    def _mapping(self, nbytes: int) -> npt.NDArray[np.uint8]:
        private: int | None = getattr(mmap, "MAP_PRIVATE", None)
        anonymous: int | None = getattr(mmap, "MAP_ANONYMOUS", None)
        if private is None or anonymous is None:
            return np.empty(nbytes, np.uint8)
        # private: a shared anonymous mapping is shmem, which follows other huge-page rules
        m = mmap.mmap(-1, nbytes + self.HUGE, flags=private | anonymous)
        self._maps.append(m)
        view = np.frombuffer(m, np.uint8)
        start = -view.ctypes.data % self.HUGE
        if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            # a kernel without transparent huge pages refuses: 4 KiB pages then
            with contextlib.suppress(OSError):
                m.madvise(mmap.MADV_HUGEPAGE, start, nbytes)  # start: a page boundary
        return view[start : start + nbytes]

    def alloc(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """``nbytes`` writable bytes, 64-byte aligned, alive as long as the arena."""
        nbytes = int(nbytes)
        if nbytes > self.CHUNK // 4:
            out = self._mapping(nbytes)
        else:
            if self._chunk is None or self._used + nbytes > self.CHUNK:
                self._chunk, self._used = self._mapping(self.CHUNK), 0
            out = self._chunk[self._used : self._used + nbytes]
            self._used += -(-nbytes // self.ALIGN) * self.ALIGN
        self.bytes += nbytes
        return out

    def copy(self, data: npt.ArrayLike) -> npt.NDArray[np.uint8]:
        """A copy of ``data``'s bytes in the arena."""
        src = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        out = self.alloc(src.nbytes)
        out[:] = src
        return out
