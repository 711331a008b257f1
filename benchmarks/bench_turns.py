"""What a server reuses of earlier prompts, and what the user waits for: the second turn of a
long chat, and conversations sharing a system prompt. lmserve and llama.cpp's
``llama-server`` side by side.

    python benchmarks/bench_turns.py --models qwen35-0.8b --llama-server PATH [--threads 2]
        [--rounds 2] [--workloads turns,shared] [--out DIR] [--json OUT]

Per round, workload and server, a fresh server:

- ``turns``: turn 1 is a chat of about 2,000 prompt tokens (a document and a question), read
  cold; turn 2 sends the whole conversation back with turn 1's reply and a new question, as
  a client does.
- ``shared``: three conversations, one after another, with the same system prompt of about
  800 tokens and different questions (sub-agents, a chat app's fixed instructions): the
  second and third may reuse the first one's system prompt.

Every reply is streamed, greedy, 32 tokens, thinking off; the figures are each request's
time to first token and the prompt tokens the server says it reused (``cached_tokens``:
lmserve in every dialect; llama-server in ``prompt_tokens_details`` of the usage, or its
``timings.cache_n``).

For models whose layers keep a recurrent state (Qwen3.5), neither server can cut the state
back to a shorter prefix: what is reused is a checkpoint of it taken while an earlier prompt
was read (lmserve: at the end of the system prompt and of the last earlier messages, 4 and 1
tokens before the end, and every 1024 tokens; llama-server: its ``--ctx-checkpoints``).

The records and the printed lines go to ``--out`` (``bench-results/turns.json``, ``.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import httpx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import model_path  # noqa: E402
from bench_serve import TOPICS, free_port, llama_server_cmd, lmserve_cmd, serving  # noqa: E402
from results import Report, add_output_options, cpu_model  # noqa: E402

MAX_TOKENS = 32


def document(sections: int = 64) -> str:
    parts = [
        f"Section {i}: notes about {TOPICS[i % len(TOPICS)]}, with dates, places and names "
        f"to remember for later questions, such as item {i * 7 % 101} and code {i * 13 % 97}."
        for i in range(sections)
    ]
    return "Read these notes.\n" + "\n".join(parts)


def turn(url: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One streamed turn: its reply, time to first content and the usage it reports."""
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    sent = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    with httpx.Client(timeout=600) as client, client.stream(
        "POST", url + "/v1/chat/completions", json=body
    ) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", timings.get("cache_n"))
    return {
        "ttft": (first or time.perf_counter()) - sent,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": cached,
        "reply": "".join(text),
    }


def conversation(url: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": document() + "\nWhat is section 3 about?"}]
    first = turn(url, messages)
    messages += [
        {"role": "assistant", "content": first["reply"]},
        {"role": "user", "content": "And section 40? Answer in one sentence."},
    ]
    second = turn(url, messages)
    return {"turn1": first, "turn2": second, "ratio": second["ttft"] / first["ttft"]}


SHARED_QUESTIONS = ("What is section 3 about?", "Which code has section 11?", "Name two items.")


def shared_system(url: str) -> dict[str, Any]:
    system = "You answer from these notes, briefly.\n" + document(24)
    asked = [
        turn(url, [{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in SHARED_QUESTIONS
    ]
    later = statistics.median(a["ttft"] for a in asked[1:])
    return {"asked": asked, "ratio": later / asked[0]["ttft"]}


def describe(workload: str, result: dict[str, Any]) -> str:
    if workload == "turns":
        t1, t2 = result["turn1"], result["turn2"]
        return (
            f"turn 1: {t1['prompt_tokens']} prompt tokens, TTFT {t1['ttft']:.2f} s | turn 2: "
            f"{t2['prompt_tokens']} prompt tokens, {t2['cached_tokens']} reused, TTFT "
            f"{t2['ttft']:.2f} s | turn 2 / turn 1 {result['ratio']:.3f}"
        )
    return " | ".join(
        f"conversation {i + 1}: {a['prompt_tokens']} prompt tokens, {a['cached_tokens']} "
        f"reused, TTFT {a['ttft']:.2f} s"
        for i, a in enumerate(result["asked"])
    ) + f" | later / first {result['ratio']:.3f}"


WORKLOADS = {"turns": conversation, "shared": shared_system}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="qwen35-0.8b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--llama-server", help="path of a built llama.cpp llama-server")
    parser.add_argument("--workloads", default="turns,shared", help="of: turns, shared")
    parser.add_argument("--logs", type=Path, default=Path("/tmp"))
    add_output_options(parser)
    args = parser.parse_args()
    report = Report("turns", args, args.threads, args.llama_server)
    report.print(f"CPU: {cpu_model()}, {args.threads} threads")
    records: list[dict[str, Any]] = []
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    for name in [n.strip() for n in args.models.split(",") if n.strip()]:
        path = model_path(name)
        for round_ in range(1, args.rounds + 1):
            servers = {"lmserve": lmserve_cmd}
            if args.llama_server:
                servers["llama-server"] = lambda p, port, t, b: llama_server_cmd(
                    args.llama_server, p, port, t, b
                )
            for workload, server in [(w, s) for w in workloads for s in servers]:
                port = free_port()
                log = args.logs / f"bench_turns_{server}_{name}_{workload}_{round_}.log"
                with serving(servers[server](path, port, args.threads, 1), port, log) as url:
                    turn(url, [{"role": "user", "content": "Hello"}])  # warm up
                    result = WORKLOADS[workload](url)
                report.print(
                    f"{name} round {round_} {workload} {server:12s} {describe(workload, result)}"
                )
                records.append({"model": name, "round": round_, "workload": workload,
                                "server": server, **result})
    for workload, server in sorted({(r["workload"], r["server"]) for r in records}):
        ratios = [r["ratio"] for r in records if (r["workload"], r["server"]) == (workload, server)]
        report.print(f"{workload} {server}: median later / first TTFT {statistics.median(ratios):.3f}")
    report.finish(rounds=args.rounds, max_tokens=MAX_TOKENS, runs=records)


if __name__ == "__main__":
    main()
