"""The machine's read bandwidth: what a decode step, which reads every weight once, can reach.

``read_bandwidth(threads)`` times ``threads`` threads each summing its share of a buffer far
larger than the caches (1 GiB by default) with the widest loads the compiler has for this
CPU, and returns the best of the repetitions in GB/s (1e9 bytes). The loop is compiled once
per run with cffi (the C compiler that builds the kernels). ``bench_decode.py`` divides a
decode step's weight bytes by its time by this figure.

    python benchmarks/bandwidth.py [--threads 2] [--mib 1024] [--reps 5]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from functools import cache
from typing import Any

_CDEF = "double lm_bench_read_gbs(int threads, size_t bytes, int reps);"

_SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef uint64_t v4u __attribute__((vector_size(32)));

typedef struct { const v4u *p; size_t n; v4u sum; } part_t;

/* four independent sums: one chain of adds would bound the loop by its latency */
static void *read_part(void *arg) {
    part_t *w = arg;
    v4u s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    for (size_t i = 0; i + 4 <= w->n; i += 4) {
        s0 += w->p[i]; s1 += w->p[i + 1]; s2 += w->p[i + 2]; s3 += w->p[i + 3];
    }
    w->sum = s0 + s1 + s2 + s3;
    return NULL;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

double lm_bench_read_gbs(int threads, size_t bytes, int reps) {
    if (threads < 1 || threads > 256) return -1.0;
    v4u *buf = aligned_alloc(4096, bytes);
    if (buf == NULL) return -1.0;
    memset(buf, 1, bytes); /* touch every page before timing */
    const size_t n = bytes / sizeof(v4u);
    part_t parts[256];
    pthread_t ids[256];
    int started[256];
    double best = 0.0;
    for (int r = 0; r < reps; r++) {
        const double t0 = now();
        for (int t = 0; t < threads; t++) {
            parts[t].p = buf + n * t / threads;
            parts[t].n = n * (t + 1) / threads - n * t / threads;
            started[t] = pthread_create(&ids[t], NULL, read_part, &parts[t]) == 0;
            if (!started[t]) read_part(&parts[t]); /* no thread: this one reads its share */
        }
        for (int t = 0; t < threads; t++)
            if (started[t]) pthread_join(ids[t], NULL);
        const double gbs = (double)bytes / (now() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    volatile uint64_t sink = parts[0].sum[0];
    (void)sink;
    free(buf);
    return best;
}
"""


@cache
def _library() -> Any:
    from cffi import FFI

    ffi = FFI()
    ffi.cdef(_CDEF)
    ffi.set_source("_lm_bench_bandwidth", _SOURCE, extra_compile_args=["-O3", "-march=native"],
                   extra_link_args=["-pthread"])
    folder = tempfile.mkdtemp(prefix="lm-bandwidth-")
    ffi.compile(tmpdir=folder, verbose=False)
    sys.path.insert(0, folder)
    try:
        return importlib.import_module("_lm_bench_bandwidth").lib
    finally:
        sys.path.remove(folder)


def read_bandwidth(threads: int, mib: int = 1024, reps: int = 5) -> float:
    """Best read bandwidth of ``threads`` threads over ``reps`` passes of ``mib`` MiB, GB/s."""
    gbs = float(_library().lm_bench_read_gbs(threads, mib << 20, reps))
    if gbs <= 0:
        raise RuntimeError(f"the bandwidth probe could not allocate {mib} MiB")
    return gbs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"read bandwidth, {args.threads} threads: "
          f"{read_bandwidth(args.threads, args.mib, args.reps):.1f} GB/s")


if __name__ == "__main__":
    main()
