"""What the Ray hop costs and what splitting the cores buys: ``lmserve cluster`` against
plain ``lmserve`` on the same cores.

    python benchmarks/bench_cluster.py [--model smollm2] [--chats 8] [--max-tokens 128]
        [--rounds 2] [--out DIR] [--json OUT]

Needs ``ray[serve]`` (``pip install lmserve-core[ray]``). Three servers, one after the
other, round after round so that each sees the machine's noise alike:

- ``plain``: ``lmserve --threads 2``;
- ``1x2``: ``lmserve cluster --replicas 1 --replica-cpus 2`` (one replica, two threads);
- ``2x1``: ``lmserve cluster --replicas 2 --replica-cpus 1`` (two replicas, a thread each).

All with ``--batch 8``. For each: N concurrent streaming chats of ``--max-tokens`` greedy
tokens (aggregate completion tok/s over the wall time, time to first token p50 / p95), and,
one request at a time, the latency of a one-token reply and the mean gap between the
tokens of one stream. The cost of the ingress is ``1x2`` minus ``plain`` on the last two:
the same engine on the same threads, with Ray's proxy, the ingress and the replica call in
between.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import httpx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import model_path  # noqa: E402
from bench_serve import chat, free_port, run_chats, serving  # noqa: E402
from results import Report, add_output_options, cpu_model, load_average  # noqa: E402

SETUPS = {
    "plain": [],
    "1x2": ["cluster", "--replicas", "1", "--replica-cpus", "2"],
    "2x1": ["cluster", "--replicas", "2", "--replica-cpus", "1"],
}


def command(setup: str, path: Path, port: int) -> list[str]:
    cluster = SETUPS[setup]
    threads = [] if cluster else ["--threads", "2"]
    return [sys.executable, "-m", "lmserve_core", *cluster, str(path), "--port", str(port),
            *threads, "--batch", "8", "--ctx", "4096", "--log-level", "warning"]


async def one_token_latency(url: str, n: int) -> float:
    """Median seconds of a non-streaming chat answered with one token."""
    times = []
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(n):
            started = time.perf_counter()
            r = await client.post(url + "/v1/chat/completions", json={
                "model": "m", "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": f"Say a number: {i}"}]})
            r.raise_for_status()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


async def token_gap(url: str, max_tokens: int, n: int) -> float:
    """Median over ``n`` streams of the mean gap between two streamed tokens."""
    gaps = []
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(n):
            stream = await chat(client, url, f"Write a story about the number {i}.", max_tokens)
            if stream.error or len(stream.tokens) < 2:
                raise SystemExit(f"stream failed: {stream.error}")
            t = stream.tokens
            gaps.append((t[-1] - t[0]) / (len(t) - 1))
    return statistics.median(gaps)


def measure(url: str, chats: int, max_tokens: int) -> dict[str, Any]:
    asyncio.run(run_chats(url, chats, 8))  # warm up every replica
    figures = asyncio.run(run_chats(url, chats, max_tokens))
    figures["one_token_s"] = asyncio.run(one_token_latency(url, 20))
    figures["token_gap_s"] = asyncio.run(token_gap(url, max_tokens, 3))
    figures["load"] = load_average()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    add_output_options(parser)
    args = parser.parse_args()
    path = model_path(args.model)
    report = Report("cluster", args, 2)
    report.print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; {args.model}, "
                 f"{args.chats} concurrent chats of {args.max_tokens} tokens, --batch 8")
    logs = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    records = []
    for round_ in range(1, args.rounds + 1):
        for setup in SETUPS:
            port = free_port()
            with serving(command(setup, path, port), port,
                         logs / f"{setup}-{round_}.log") as url:
                figures = measure(url, args.chats, args.max_tokens)
            if figures["errors"]:
                report.print(f"{setup}: errors {figures['errors'][:3]}")
            records.append({"setup": setup, "round": round_, **figures})
            report.print(
                f"round {round_} {setup:>5}: {figures['tok_s']:6.1f} tok/s, TTFT p50 "
                f"{figures['ttft_p50'] * 1000:6.0f} ms p95 {figures['ttft_p95'] * 1000:6.0f} ms;"
                f" one-token reply {figures['one_token_s'] * 1000:5.1f} ms, token gap "
                f"{figures['token_gap_s'] * 1000:5.2f} ms (load {figures['load']})")
    report.print("\nmedians over the rounds")
    by: dict[str, dict[str, float]] = {}
    for setup in SETUPS:
        mine = [r for r in records if r["setup"] == setup]
        by[setup] = {k: statistics.median(r[k] for r in mine)
                     for k in ("tok_s", "ttft_p50", "ttft_p95", "one_token_s", "token_gap_s")}
        m = by[setup]
        report.print(f"{setup:>5}: {m['tok_s']:6.1f} tok/s, TTFT p50 {m['ttft_p50'] * 1000:6.0f}"
                     f" ms p95 {m['ttft_p95'] * 1000:6.0f} ms")
    hop = by["1x2"]["one_token_s"] - by["plain"]["one_token_s"]
    gap = by["1x2"]["token_gap_s"] - by["plain"]["token_gap_s"]
    report.print(f"the ingress adds {hop * 1000:.1f} ms per request and {gap * 1000:.2f} ms "
                 f"per streamed token (1x2 minus plain)")
    report.finish(chats=args.chats, max_tokens=args.max_tokens, rounds=args.rounds,
                  records=records, medians=by, ingress_request_s=hop, ingress_token_s=gap)


if __name__ == "__main__":
    main()
