"""Served prefill side by side: lmserve, llama.cpp's ``llama-server`` and ik_llama.cpp's
server on the same GGUF files, fresh prompts, one token of reply.

    python benchmarks/bench_prefill.py [--llama-server PATH] [--ik-server PATH] [--baseline DIR]
        [--models smollm2,gemma3-270m,qwen3-0.6b,qwen3-0.6b-q4_k_m,qwen3moe-1b]
        [--lengths 30,500,2000] [--rounds 3] [--threads 2] [--out DIR] [--json OUT]

Per model, every server is started on the same file with the same settings (``--threads``,
a context of 4096, batches of 512 tokens, one slot) and they stay up together. A round sends
each prompt length to each server in turn (the order rotated every round), so all of them
see the same machine noise. Every request is ``POST /v1/completions`` with a prompt never
seen before (a unique leading line, then text), ``max_tokens`` 1, greedy, and for the
llama.cpp servers ``cache_prompt: false``: what is timed is a cold read of the whole
prompt, from the request's sending to its answer. The figures are per server and length:
the median over the rounds of prompt tok/s (the server's own count of prompt tokens over
that time), the short prompt's time to first token, and lmserve's ratios against each
reference. ``--baseline DIR`` adds a second lmserve run from another checkout of the
repository (its own built kernels and plugins, e.g. a ``git worktree`` of an earlier commit):
a change's effect measured in the same run as the references.

The fraction of peak: before the servers start, the script times the shared kernels in this
process on the same threads: the float32 GEMM (Q8_0 weights, 512 tokens, prefill's path
under ``--prefill-precision f32`` and for the types without an interleaved layout) and the
integer products (int8 weights with int16 activations, ``vpdpwssd`` on AVX-512 VNNI: Q8_0 in
its interleaved layout where the CPU has it, 512 tokens, prefill's default path there), each
as multiply-adds x 2 per second. A model's prefill reaches ``2 x (weights a token multiplies)
x tok/s`` of them: attention and everything outside the products are left out of the
numerator, so the fraction is an upper bound of what the products achieve.

The records and the printed lines go to ``--out`` (``bench-results/prefill.json``, ``.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import httpx  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import model_path  # noqa: E402
from bench_serve import TOPICS, free_port, serving  # noqa: E402
from results import Report, add_output_options, cpu_model, llama_cpp_version, load_average  # noqa: E402

DEFAULT_MODELS = "smollm2,gemma3-270m,qwen3-0.6b,qwen3-0.6b-q4_k_m,qwen3moe-1b"
CTX = 4096
BATCH = 512  # lmserve's prefill chunk; llama.cpp's -b and -ub


def lmserve_cmd(path: Path, port: int, threads: int) -> list[str]:
    return [sys.executable, "-m", "lmserve_core", str(path), "--port", str(port),
            "--threads", str(threads), "--ctx", str(CTX), "--batch", "1", "--kv-slots", "1",
            "--log-level", "warning"]


def baseline_env(root: Path) -> dict[str, str]:
    """The environment of an lmserve run from the checkout at ``root``: its core and plugins
    first on the import path."""
    paths = [str(root), *sorted(str(p) for p in (root / "plugins").glob("lmserve-*"))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def llama_cmd(binary: str, path: Path, port: int, threads: int) -> list[str]:
    return [binary, "-m", str(path), "--port", str(port), "-t", str(threads), "-c", str(CTX),
            "-b", str(BATCH), "-ub", str(BATCH), "-np", "1", "--log-disable"]


def prompt_text(tokens: int, tag: str) -> str:
    """About ``tokens`` tokens of plain English with numbers (3 characters a token, roughly,
    on these vocabularies), led by a line no other request has: no server can have read its
    beginning before."""
    parts = [f"Request {tag}:"]
    i = 0
    while sum(len(p) + 1 for p in parts) < tokens * 3:
        topic = TOPICS[i % len(TOPICS)]
        parts.append(f"Note {i}: a few words about {topic}, item {i * 7 % 101}.")
        i += 1
    return " ".join(parts)[: max(tokens * 3, len(parts[0]))]


def complete(url: str, prompt: str, llama: bool) -> tuple[float, int]:
    """Seconds to the answer of a one-token completion, and its prompt tokens."""
    body: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if llama:
        body["cache_prompt"] = False
    sent = time.perf_counter()
    reply = httpx.post(url + "/v1/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - sent
    reply.raise_for_status()
    return elapsed, int(reply.json()["usage"]["prompt_tokens"])


def weights_per_token(path: Path) -> int:
    """Weights a token multiplies in the layers' products (a mixture: its chosen experts
    only); the embedding table and the output head are left out."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    used = n_expert = 0
    for field in reader.fields.values():
        if field.name.endswith(".expert_used_count"):
            used = int(field.parts[-1][0])
        elif field.name.endswith(".expert_count"):
            n_expert = int(field.parts[-1][0])
    total = 0
    for t in reader.tensors:
        if not t.name.startswith("blk.") or len(t.shape) < 2:
            continue
        n = int(np.prod([int(s) for s in t.shape]))
        if "_exps" in t.name and n_expert:
            n = n * used // n_expert
        total += n
    return total


def kernel_peaks(threads: int) -> dict[str, float]:
    """GFLOP/s (2 x multiply-adds per second) of the float32 GEMM and of the integer
    products, the best of a few timings each, on ``threads`` threads in this process."""
    from lmserve_core.native import kernels as K

    rng = np.random.default_rng(0)
    rows, cols = 3072, 1024
    nblocks = rows * cols // 32
    raw = rng.integers(-127, 128, (nblocks, 34), dtype=np.int16).astype(np.uint8)
    raw[:, 0:2] = rng.uniform(0.001, 0.02, nblocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    w = raw.reshape(rows, -1)
    qtype = int(K.QuantType.Q8_0)
    if "Q8_0_R16" in K.Interleaved.__members__ and K.isa_active().name == "AVX512":
        wi = K.repack_r16(K.QuantType.Q8_0, w, rows, cols)
        itype = int(K.Interleaved.Q8_0_R16)
    else:
        wi, itype = w, qtype
    out = {}
    ntok = 512
    with K.Pool(threads) as pool:
        for name, q, mat, precision in (("f32_gemm", qtype, w, K.PrefillPrecision.F32),
                                        ("int_products", itype, wi, K.PrefillPrecision.I16)):
            x = rng.standard_normal((ntok, cols), dtype=np.float32)
            K.select_prefill_precision(precision)
            K.matmul(q, mat, rows, cols, x, pool=pool)
            best = float("inf")
            for _ in range(5):
                n = max(1, 4096 // ntok)
                t0 = time.perf_counter()
                for _ in range(n):
                    K.matmul(q, mat, rows, cols, x, pool=pool)
                best = min(best, (time.perf_counter() - t0) / n)
            out[name] = 2.0 * rows * cols * ntok / best / 1e9
    K.select_prefill_precision(K.PrefillPrecision.I16)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--lengths", default="30,500,2000", help="prompt tokens, about")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", help="path of a built llama.cpp llama-server")
    parser.add_argument("--ik-server", help="path of a built ik_llama.cpp llama-server")
    parser.add_argument("--baseline", type=Path,
                        help="another checkout of lmserve (built) to run beside this one")
    parser.add_argument("--logs", type=Path, default=Path("/tmp"))
    add_output_options(parser)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",") if n.strip()]
    report = Report("prefill", args, args.threads, args.llama_server)
    report.meta["ik_llama.cpp"] = llama_cpp_version(args.ik_server)
    report.print(f"CPU: {cpu_model()}, {args.threads} threads, load average {load_average()}")
    peaks = kernel_peaks(args.threads)
    report.print(f"kernel peaks: float32 GEMM {peaks['f32_gemm']:.1f} GFLOP/s, integer "
                 f"products {peaks['int_products']:.1f} GOP/s")
    servers: dict[str, Any] = {"lmserve": (lmserve_cmd, False)}
    if args.baseline:
        servers["lmserve baseline"] = (lmserve_cmd, False)
    if args.llama_server:
        servers["llama.cpp"] = (lambda p, port, t: llama_cmd(args.llama_server, p, port, t), True)
    if args.ik_server:
        servers["ik_llama.cpp"] = (lambda p, port, t: llama_cmd(args.ik_server, p, port, t), True)
    records: list[dict[str, Any]] = []
    for name in [n.strip() for n in args.models.split(",") if n.strip()]:
        path = model_path(name)
        per_token = weights_per_token(path)
        with contextlib.ExitStack() as stack:
            urls = {}
            for server, (cmd, _) in servers.items():
                port = free_port()
                log = args.logs / f"bench_prefill_{server}_{name}.log"
                env = baseline_env(args.baseline) if server == "lmserve baseline" else None
                urls[server] = stack.enter_context(
                    serving(cmd(path, port, args.threads), port, log, env=env))
            # warm up (pages, pools, first-call costs) on the lengths up to one batch
            for server, url in urls.items():
                for n in [m for m in lengths if m <= BATCH] or lengths[:1]:
                    complete(url, prompt_text(n, uuid.uuid4().hex[:8]), servers[server][1])
            runs: dict[str, dict[int, list[tuple[float, int]]]] = {
                s: {n: [] for n in lengths} for s in servers}
            order = list(servers)
            for _ in range(args.rounds):
                for n in lengths:
                    for server in order:
                        tag = uuid.uuid4().hex[:8]
                        runs[server][n].append(
                            complete(urls[server], prompt_text(n, tag), servers[server][1]))
                order = order[1:] + order[:1]
        record = {"model": name, "file": path.name, "weights_per_token": per_token,
                  "load": load_average(), "servers": {}}
        for server in servers:
            record["servers"][server] = {
                str(n): {"seconds": [s for s, _ in runs[server][n]],
                         "prompt_tokens": [t for _, t in runs[server][n]],
                         "tok_s": statistics.median(t / s for s, t in runs[server][n]),
                         "seconds_median": statistics.median(s for s, _ in runs[server][n])}
                for n in lengths}
        records.append(record)
        print_model(report, record, lengths, peaks)
    # timed again at the end, the best of both kept: on a busy machine a single timing is low
    again = kernel_peaks(args.threads)
    peaks = {key: max(value, again[key]) for key, value in peaks.items()}
    report.print(f"\nkernel peaks at the end: float32 GEMM {again['f32_gemm']:.1f} GFLOP/s, "
                 f"integer products {again['int_products']:.1f} GOP/s; the shares above are "
                 "of the start's")
    report.finish(lengths=lengths, rounds=args.rounds, peaks=peaks, runs=records)


def print_model(report: Report, record: dict[str, Any], lengths: list[int],
                peaks: dict[str, float]) -> None:
    figures = record["servers"]
    refs = [s for s in figures if s != "lmserve"]
    report.print(f"\n{record['model']} ({record['file']}; load average {record['load']}): "
                 "prompt tok/s, median of the rounds")
    head = "| prompt | " + " | ".join(figures) + "".join(f" | vs {r}" for r in refs)
    report.print(head + " | lmserve: % of f32 GEMM / integer peak |")
    report.print("|---" * (2 + len(figures) + len(refs)) + "|")
    short = min(lengths)
    for n in lengths:
        cells = []
        for server in figures:
            f = figures[server][str(n)]
            toks = statistics.median(f["prompt_tokens"])
            cell = f"{f['tok_s']:.1f} ({toks:.0f} tok)"
            if n == short:
                cell += f", TTFT {f['seconds_median'] * 1e3:.0f} ms"
            cells.append(cell)
        ours = figures["lmserve"][str(n)]
        ratios = []
        for r in refs:
            theirs = figures[r][str(n)]
            ratio = f"{ours['tok_s'] / theirs['tok_s']:.2f}x"
            if n == short:
                ratio += f", TTFT {ours['seconds_median'] / theirs['seconds_median']:.2f}x"
            ratios.append(ratio)
        flops = 2.0 * record["weights_per_token"] * ours["tok_s"] / 1e9
        frac = f"{100 * flops / peaks['f32_gemm']:.0f}% / {100 * flops / peaks['int_products']:.0f}%"
        report.print(f"| ~{n} | " + " | ".join(cells + ratios) + f" | {frac} |")


if __name__ == "__main__":
    main()
