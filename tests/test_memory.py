"""The C heap settings of the server process (glibc)."""

from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest

from lmserve_core import memory

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)


def _anon_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1])
    raise AssertionError("no Anonymous line")


@glibc
def test_large_blocks_keep_their_own_mappings() -> None:
    assert memory.fix_mmap_threshold()
    # Blocks above the threshold are mapped and unmapped as they come and go: freeing
    # a few hundred MiB of 1 MiB blocks gives the memory back at once.
    before = _anon_kib()
    blocks = [np.ones(2**18, np.float32) for _ in range(300)]  # 300 x 1 MiB
    grown = _anon_kib() - before
    del blocks
    assert grown > 250 * 1024
    assert _anon_kib() - before < 16 * 1024


@glibc
def test_trim_returns_freed_heap() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    small = [libc.malloc(1024) for _ in range(50_000)]  # 50 MB below the threshold
    for p in small:
        libc.free(p)
    before = _anon_kib()
    memory.trim()
    assert _anon_kib() <= before
