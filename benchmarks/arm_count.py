"""AArch64 instructions per token of the matrix products, lmserve against llama.cpp (ggml).

No Arm CPU needed: the two drivers under benchmarks/arm/ run under qemu-user, whose log
(``-d in_asm,exec,nochain``) prints each translated block once (``IN:`` then one line per
instruction) and one ``Trace`` line per execution of a block. The dynamic count of a stretch
of the program is the sum, over its Trace lines, of the instructions of the block executed.
Each driver calls ``lmcount_mark()`` before every product it times, so the count splits into
one segment per product; set-up is never counted. Only matrix products (x @ W^T, the output
head included) are counted: attention, norms, RoPE and the rest are not.

Per (engine, path, type, cols) a driver runs the products of SEGMENTS (rows, tokens). From
them: decode (1 token) costs ``d0 + d * rows``; a many-token call costs
``c0 + cr * rows + ct * tokens + b * rows * tokens``, fitted on the four 64/128-token points
and checked on the 192-token one. Models are sums over their matrices, prefill as one call
of 512 tokens per matrix for llama.cpp (n_ubatch), two of 256 for lmserve (its batch).

Reproduce (Debian: gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user-static cmake)::

    # lmserve (flags of lmserve_core.native.compile_args({}))
    aarch64-linux-gnu-gcc -std=gnu11 -Werror=implicit-function-declaration -ffp-contract=off \\
        -fno-math-errno -fvisibility=hidden -O3 -pthread -static \\
        -I lmserve_core/native/include benchmarks/arm/lmserve_count.c -o lmserve_count -lm
    # llama.cpp b11434, twice: ARCH=armv8.2-a+dotprod (B=build-dotprod) and
    # ARCH=armv8.6-a+dotprod+i8mm (B=build-i8mm)
    cmake -S $LLAMA -B $B -DCMAKE_BUILD_TYPE=Release -DCMAKE_SYSTEM_NAME=Linux \\
        -DCMAKE_SYSTEM_PROCESSOR=aarch64 -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc \\
        -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=$ARCH \\
        -DGGML_OPENMP=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_CCACHE=OFF -DLLAMA_CURL=OFF \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \\
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_COMMON=OFF
    cmake --build $B --target ggml ggml-cpu -j2
    aarch64-linux-gnu-g++ -O2 -x c benchmarks/arm/ggml_count.c -x none -I $LLAMA/ggml/include \\
        $B/ggml/src/libggml.a $B/ggml/src/libggml-cpu.a $B/ggml/src/libggml-base.a \\
        -static -pthread -lm -o ggml_count_$NAME        # NAME: dotprod, i8mm
    # count (about a quarter of an hour), then the tables
    python3 benchmarks/arm_count.py measure --lmserve lmserve_count \\
        --ggml-dotprod ggml_count_dotprod --ggml-i8mm ggml_count_i8mm -o counts.json
    python3 benchmarks/arm_count.py report counts.json

The dotprod paths run as ``-cpu neoverse-n1`` (FEAT_DotProd, no FEAT_I8MM), the i8mm ones as
``-cpu max``. llama.cpp's weights go to the CPU_REPACK buffer (interleaved at load, as
llama-server does) for the types ggml-cpu/repack.cpp interleaves on that CPU (Q8_0, Q4_K,
Q6_K), to the plain CPU buffer otherwise (Q4_1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable

QEMU = ["qemu-aarch64-static", "-L", "/usr/aarch64-linux-gnu"]
MARK = "lmcount_mark"
SEGMENTS = [(128, 1), (256, 1), (64, 64), (128, 64), (64, 128), (128, 128), (64, 192)]
TYPES = {"Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
PATHS = {"dotprod": ("neoverse-n1", 3), "i8mm": ("max", 4)}  # qemu cpu, lmserve ISA
REPACKED = {"Q8_0", "Q4_K", "Q6_K"}  # ggml-cpu/repack.cpp (b11434) on NEON with DotProd
PROMPT = 512
# tokens per product in a prompt: llama-server's n_ubatch, lmserve's DEFAULT_BATCH
CHUNK = {"llama.cpp": 512, "lmserve": 256}
ROWS = 1024  # rows of the matrix of the per-type table


# ------------------------------------------------------------------ models: (type, rows, cols, n)
def smollm2() -> list[tuple[str, int, int, int]]:
    """SmolLM2-135M-Instruct.Q4_1.gguf: 30 layers of Q4_1, the tied Q8_0 embedding as head."""
    d, kv, ff, n = 576, 192, 1536, 30
    return [("Q4_1", d, d, 2 * n), ("Q4_1", kv, d, 2 * n), ("Q4_1", ff, d, 2 * n),
            ("Q4_1", d, ff, n), ("Q8_0", 49152, d, 1)]


def qwen3(mix: str) -> list[tuple[str, int, int, int]]:
    """Qwen3-0.6B: 28 layers, hidden 1024, q 16x128, kv 8x128, FFN 3072, vocab 151936, tied.
    Q8_0 everywhere, or llama.cpp's Q4_K_M: attn_v and ffn_down Q6_K in 14 layers, the head
    Q6_K, the rest Q4_K."""
    n, d, q, kv, ff, vocab = 28, 1024, 2048, 1024, 3072, 151936
    if mix == "Q8_0":
        t = "Q8_0"
        return [(t, q, d, n), (t, kv, d, 2 * n), (t, d, q, n), (t, ff, d, 2 * n),
                (t, d, ff, n), (t, vocab, d, 1)]
    more = sum(i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2 for i in range(n))
    return [("Q4_K", q, d, n), ("Q4_K", kv, d, n), ("Q4_K", kv, d, n - more),
            ("Q6_K", kv, d, more), ("Q4_K", d, q, n), ("Q4_K", ff, d, 2 * n),
            ("Q4_K", d, ff, n - more), ("Q6_K", d, ff, more), ("Q6_K", vocab, d, 1)]


MODELS = {"SmolLM2-135M Q4_1": smollm2(), "Qwen3-0.6B Q8_0": qwen3("Q8_0"),
          "Qwen3-0.6B Q4_K_M": qwen3("Q4_K_M")}


# ------------------------------------------------------------------ counting
def count_segments(lines: Iterable[str]) -> list[int]:
    """Instructions executed after each call of MARK (the last segment, after the final mark,
    is dropped) in a qemu log of ``-d in_asm,exec,nochain``."""
    size: dict[int, int] = {}
    block, n = -1, 0
    counts: list[int] = []
    for line in lines:
        if line.startswith("Trace"):
            if block >= 0:
                size[block], block = n, -1
            pc = int(line.split("[", 1)[1].split("/", 2)[1], 16)
            if line.rstrip().endswith(" " + MARK):
                counts.append(0)
            elif counts:
                counts[-1] += size[pc]
        elif line.startswith("IN:"):
            if block >= 0:
                size[block] = n
            block, n = 0, 0
        elif line.startswith("0x") and block >= 0:
            if n == 0:
                block = int(line.split(":", 1)[0], 16)
            n += 1
    return counts[:-1]


def run_counted(cmd: list[str], cpu: str) -> list[int]:
    """Run cmd under qemu as cpu, its log streamed through a FIFO into count_segments."""
    with tempfile.TemporaryDirectory() as tmp:
        fifo = os.path.join(tmp, "log")
        os.mkfifo(fifo)
        qemu = [*QEMU, "-cpu", cpu, "-d", "in_asm,exec,nochain", "-D", fifo, *cmd]
        proc = subprocess.Popen(["nice", "-n", "19", *qemu], stdout=subprocess.PIPE, text=True)
        with open(fifo, encoding="utf-8", errors="replace") as log:
            counts = count_segments(log)
        out = proc.communicate()[0]
    if proc.returncode != 0 or "rc 0" not in out or len(counts) != len(SEGMENTS):
        raise RuntimeError(f"{cmd} on {cpu}: exit {proc.returncode}, {len(counts)} segments\n{out}")
    return counts


def needed() -> list[tuple[str, int]]:
    return sorted({(t, cols) for m in MODELS.values() for t, _, cols, _ in m})


def measure(args: argparse.Namespace) -> None:
    done: dict[str, list[int]] = {}
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as f:
            done = json.load(f)
    ggml = {"dotprod": args.ggml_dotprod, "i8mm": args.ggml_i8mm}
    for path, (cpu, isa) in PATHS.items():
        for t, cols in needed():
            for engine, cmd in (
                ("lmserve", [args.lmserve, str(TYPES[t]), str(cols), str(isa)]),
                ("llama.cpp", [ggml[path], str(TYPES[t]), str(cols), str(int(t in REPACKED))]),
            ):
                key = f"{engine} {path} {t} {cols}"
                if key in done:
                    continue
                done[key] = run_counted([os.path.abspath(cmd[0]), *cmd[1:]], cpu)
                print(key, done[key], file=sys.stderr, flush=True)
                with open(args.out, "w", encoding="utf-8") as f:
                    json.dump(done, f, indent=1)


# ------------------------------------------------------------------ fits and tables
def fit(c: list[int]) -> dict[str, float]:
    """Per-call model of one (engine, path, type, cols) from its SEGMENTS counts."""
    (r1, _), (r2, _), (r, t1), _, (_, t2), _, (_, t3) = SEGMENTS
    d = (c[1] - c[0]) / (r2 - r1)
    # c(R, T) = c0 + cr R + ct T + b R T on R in {r, 2r}, T in {t1, t2}, checked at (r, t3)
    b = ((c[5] - c[4]) - (c[3] - c[2])) / (r * (t2 - t1))
    cr = (c[3] - c[2]) / r - b * t1
    ct = (c[4] - c[2]) / (t2 - t1) - b * r
    c0 = c[2] - cr * r - ct * t1 - b * r * t1
    check = c0 + cr * r + ct * t3 + b * r * t3
    return {"d0": c[0] - d * r1, "d": d, "c0": c0, "cr": cr, "ct": ct, "b": b,
            "check": c[6] / check - 1}


def per_token(f: dict[str, float], rows: int, chunk: int) -> float:
    """Instructions per token of a rows-row product in calls of chunk tokens (1: decode)."""
    if chunk == 1:
        return f["d0"] + f["d"] * rows
    return (f["c0"] + f["cr"] * rows) / chunk + f["ct"] + f["b"] * rows


def report(args: argparse.Namespace) -> None:
    with open(args.counts, encoding="utf-8") as f:
        fits = {k: fit(v) for k, v in json.load(f).items()}
    engines = ("llama.cpp", "lmserve")
    print(f"Instructions per 1,000 weights per token, a {ROWS}-row matrix (per-call and per-token")
    print("costs included; prefill in each engine's chunks)\n")
    print("| type | cols | path | decode llama.cpp | decode lmserve | prefill llama.cpp "
          "| prefill lmserve | worst prefill fit error |")
    print("|---|---|---|---|---|---|---|---|")
    for t, cols in needed():
        for path in PATHS:
            fs = [fits[f"{e} {path} {t} {cols}"] for e in engines]
            dec = [f"{1000 * per_token(f, ROWS, 1) / (ROWS * cols):.0f}" for f in fs]
            pre = [f"{1000 * per_token(f, ROWS, CHUNK[e]) / (ROWS * cols):.0f}"
                   for e, f in zip(engines, fs, strict=True)]
            err = max(abs(f["check"]) for f in fs)
            print(f"| {t} | {cols} | {path} | {' | '.join(dec)} | {' | '.join(pre)} "
                  f"| {100 * err:.1f}% |")
    print(f"\nMillions of instructions per token (decode) and per prompt token ({PROMPT}-token "
          "prefill), matrix products only\n")
    print("| model | path | decode llama.cpp | decode lmserve | ratio "
          "| prefill llama.cpp | prefill lmserve | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name, mats in MODELS.items():
        for path in PATHS:
            cells = []
            for prefill in (False, True):
                tot = [sum(n * per_token(fits[f"{e} {path} {t} {cols}"], rows,
                                         CHUNK[e] if prefill else 1)
                           for t, rows, cols, n in mats) for e in engines]
                cells += [f"{tot[0] / 1e6:.2f}", f"{tot[1] / 1e6:.2f}", f"{tot[0] / tot[1]:.2f}"]
            print(f"| {name} | {path} | {' | '.join(cells)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="count every (engine, path, type, cols) under qemu")
    m.add_argument("--lmserve", required=True)
    m.add_argument("--ggml-dotprod", required=True)
    m.add_argument("--ggml-i8mm", required=True)
    m.add_argument("-o", "--out", required=True, help="JSON of segment counts (resumed)")
    r = sub.add_parser("report", help="markdown tables from the counts")
    r.add_argument("counts")
    a = ap.parse_args()
    measure(a) if a.cmd == "measure" else report(a)


if __name__ == "__main__":
    main()
