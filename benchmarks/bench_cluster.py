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

``--burst 8,16,32`` adds the burst workload on ``1x2`` and ``2x1``: that many two-turn
conversations at once, each with a system prompt of its own (about 330 tokens); all first
turns together, then all second turns (the whole conversation sent back). Per burst: how the
first turns spread over the replicas, how many second turns reach their first turn's
replica, the replicas' KV slots (from ``/metrics``), the second turns' share of cached
prompt tokens, TTFT p50 / p95 over every turn and aggregate completion tok/s. A refused turn
(429) is sent again after its ``retry-after``, as the OpenAI and Anthropic SDKs do, and its
TTFT counts from the first attempt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


BURST_TOKENS = 32  # completion tokens of each burst turn
MAX_RETRIES = 10  # of a refused (429) turn, as a client would


def burst_system(i: int, burst: int) -> str:
    """Conversation ``i``'s system prompt in a burst of ``burst``: every burst's are new."""
    notes = [f"Note {j}: the parcel {i * 31 + j} left depot {(i + j * 7) % 53} on day "
             f"{(i * 3 + j) % 29}, insured for {(i + 1) * (j + 2)} coins." for j in range(12)]
    return (f"You are the clerk of office {i} of {burst}. Answer from these records.\n"
            + "\n".join(notes))


async def burst_turn(client: httpx.AsyncClient, url: str,
                     messages: list[dict[str, str]]) -> dict[str, Any]:
    """One streamed turn: its replica, TTFT, cached and completion tokens, reply text."""
    body = {"model": "m", "messages": messages, "max_tokens": BURST_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    out: dict[str, Any] = {"ttft": None, "text": "", "cached": 0, "prompt": 0, "tokens": 0,
                           "retries": 0}
    while True:  # a refusal (429) is retried after its retry-after, as the SDKs do
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as reply:
            if reply.status_code == 429 and out["retries"] < MAX_RETRIES:
                out["retries"] += 1
                await asyncio.sleep(float(reply.headers.get("retry-after") or 1))
                continue
            await read_turn(reply, out, sent)
            return out


async def read_turn(reply: httpx.Response, out: dict[str, Any], sent: float) -> None:
    """Fill ``out`` from a streamed reply; TTFT counts from the first attempt (``sent``)."""
    out["replica"] = reply.headers.get("x-lmserve-replica")
    if reply.status_code != 200:
        out["error"] = f"{reply.status_code}: {(await reply.aread())[:200]!r}"
        return
    async for line in reply.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage")
        if usage:
            out["tokens"] = int(usage["completion_tokens"])
            out["prompt"] = int(usage["prompt_tokens"])
            out["cached"] = int((usage.get("prompt_tokens_details") or {})
                                .get("cached_tokens") or 0)
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                out["ttft"] = out["ttft"] or time.perf_counter() - sent
                out["text"] += piece
    out["ttft"] = out["ttft"] or time.perf_counter() - sent


async def run_burst(url: str, n: int) -> dict[str, Any]:
    chats = [[{"role": "system", "content": burst_system(i, n)},
              {"role": "user", "content": "Which parcel left first?"}] for i in range(n)]
    async with httpx.AsyncClient(timeout=900) as client:
        started = time.perf_counter()
        first = await asyncio.gather(*(burst_turn(client, url, c) for c in chats))
        for c, t in zip(chats, first, strict=True):
            c += [{"role": "assistant", "content": t["text"]},
                  {"role": "user", "content": "And which one was insured for the most?"}]
        second = await asyncio.gather(*(burst_turn(client, url, c) for c in chats))
        wall = time.perf_counter() - started
    turns = [t for t in first + second if "error" not in t]
    ttfts = sorted(t["ttft"] for t in turns) or [float("nan")]
    spread: dict[str, int] = {}
    for t in first:
        spread[str(t.get("replica"))] = spread.get(str(t.get("replica")), 0) + 1
    return {
        "conversations": n,
        "first_spread": sorted(spread.values(), reverse=True),
        "stayed": sum(a.get("replica") == b.get("replica") for a, b in zip(first, second, strict=True)),
        "cached_share": statistics.mean(
            [t["cached"] / max(1, t["prompt"]) for t in second if "error" not in t] or [0.0]),
        "ttft_p50": statistics.median(ttfts),
        "ttft_p95": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
        "tok_s": sum(t["tokens"] for t in turns) / wall,
        "errors": [t["error"] for t in first + second if "error" in t],
        "retries": sum(t["retries"] for t in first + second),
    }


def replica_slots(url: str) -> list[int]:
    """Each replica's KV slots, from the ingress's merged ``/metrics``: what a burst's
    conversations have to fit in (``--kv-slots auto`` sizes them from free memory)."""
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return []
    slots: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("lmserve_kv_slots{") and 'replica="ingress"' not in line:
            labels, value = line.rsplit(" ", 1)
            replica = labels.split('replica="', 1)[-1].split('"', 1)[0]
            slots[replica] = slots.get(replica, 0.0) + float(value)
    return sorted((int(n) for n in slots.values()), reverse=True)


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
    parser.add_argument("--burst", default="", help="conversations of the burst workload, "
                        "e.g. 8,16,32 (on 1x2 and 2x1); none by default")
    parser.add_argument("--setups", default=",".join(SETUPS), help="of: plain, 1x2, 2x1")
    add_output_options(parser)
    args = parser.parse_args()
    path = model_path(args.model)
    report = Report("cluster", args, 2)
    report.print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; {args.model}, "
                 f"{args.chats} concurrent chats of {args.max_tokens} tokens, --batch 8")
    logs = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    bursts = [int(n) for n in args.burst.split(",") if n.strip()]
    records = []
    bursts_done: list[dict[str, Any]] = []
    for round_ in range(1, args.rounds + 1):
        for setup in setups:
            port = free_port()
            with serving(command(setup, path, port), port,
                         logs / f"{setup}-{round_}.log") as url:
                figures = measure(url, args.chats, args.max_tokens)
                for n in bursts if setup != "plain" else []:
                    done = asyncio.run(run_burst(url, n))
                    done["slots"] = replica_slots(url)
                    bursts_done.append({"setup": setup, "round": round_, **done})
                    report.print(
                        f"round {round_} {setup:>5} burst of {n}: first turns "
                        f"{done['first_spread']} (KV slots {done['slots']}), {done['stayed']}/{n}"
                        f" second turns on their replica, cached share "
                        f"{done['cached_share']:.2f}, TTFT p50 "
                        f"{done['ttft_p50'] * 1000:.0f} ms p95 {done['ttft_p95'] * 1000:.0f} ms,"
                        f" {done['tok_s']:.1f} tok/s, retried 429s {done['retries']}, errors "
                        f"{len(done['errors'])}")
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
    for setup in setups:
        mine = [r for r in records if r["setup"] == setup]
        by[setup] = {k: statistics.median(r[k] for r in mine)
                     for k in ("tok_s", "ttft_p50", "ttft_p95", "one_token_s", "token_gap_s")}
        m = by[setup]
        report.print(f"{setup:>5}: {m['tok_s']:6.1f} tok/s, TTFT p50 {m['ttft_p50'] * 1000:6.0f}"
                     f" ms p95 {m['ttft_p95'] * 1000:6.0f} ms")
    hop = gap = None
    if "1x2" in by and "plain" in by:
        hop = by["1x2"]["one_token_s"] - by["plain"]["one_token_s"]
        gap = by["1x2"]["token_gap_s"] - by["plain"]["token_gap_s"]
        report.print(f"the ingress adds {hop * 1000:.1f} ms per request and {gap * 1000:.2f} ms "
                     f"per streamed token (1x2 minus plain)")
    report.finish(chats=args.chats, max_tokens=args.max_tokens, rounds=args.rounds,
                  records=records, medians=by, ingress_request_s=hop, ingress_token_s=gap,
                  bursts=bursts_done)


if __name__ == "__main__":
    main()
