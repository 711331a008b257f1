"""Many users at once: lmserve and llama.cpp's ``llama-server`` side by side over HTTP.

    python benchmarks/bench_serve.py --llama-server PATH [--models smollm2,gemma3-270m]
        [--threads 2] [--concurrency 1,4,8,16] [--rounds 1] [--out DIR] [--json OUT]
    python benchmarks/bench_serve.py --spec [--models smollm2,gemma3-270m] [--rounds 1]
        [--spec-draft SMALL.gguf] [--out DIR] [--json OUT]

Both servers get the same GGUF and thread count; llama-server keeps its default parallel
slots, lmserve its defaults (``--batch 4``, raised to the largest concurrency measured so
the curve shows how a batch scales). Per model and server, in turns so both see the same
machine noise:

- ``chat xN``: N concurrent streaming chats of 128 greedy tokens each: aggregate
  completion tok/s over the wall time, and time to first token p50 / p95;
- ``long prompt``: 3 streams decoding when a prompt of about 3k tokens arrives; the
  longest gap between two tokens of the 3 streams from its arrival on, and its own time to
  first token.

With ``--spec``: one greedy stream of 256 tokens per workload (a code edit, a JSON
extraction, the same extraction under a JSON schema, a free chat), lmserve plain against
lmserve ``--spec`` (and ``--spec-draft``), the servers side by side taking each workload in
turns, round after round; median decode tok/s and the median of the rounds' ratios, and
whether every reply was byte-identical to plain decoding. No llama.cpp needed.

The CPU model is printed with the figures: ratios move between machines. The records, the
printed tables and a plot go to ``--out`` (``bench-results/serve.*``, or ``spec.*``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import httpx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import model_path  # noqa: E402
from results import Report, add_output_options, cpu_model  # noqa: E402

TOPICS = [
    "the history of the printing press",
    "how bees build their hives",
    "the water cycle",
    "a journey across a desert",
    "why the sky is blue",
    "the life of a lighthouse keeper",
    "how bread is made",
    "the first trip to the moon",
    "a city under the sea",
    "how a violin is built",
    "the migration of whales",
    "a day in a medieval market",
    "how volcanoes form",
    "the invention of the telescope",
    "a garden through the seasons",
    "the art of map making",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(cmd: list[str], port: int, log: Path, env: dict[str, str] | None = None
            ) -> Iterator[str]:
    """Run a server (in ``env``, else this process's environment) until /health answers;
    yield its base URL; stop it."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{cmd[0]} exited:\n{log.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"{cmd[0]} did not come up")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Stream:
    """One streamed reply's timing."""

    sent: float
    tokens: list[float] = field(default_factory=list)  # arrival time of each content chunk
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.tokens[0] - self.sent if self.tokens else float("inf")


async def chat(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
               extra: dict[str, Any] | None = None, stream: Stream | None = None) -> Stream:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    if stream is None:
        stream = Stream(sent=time.perf_counter())
    stream.sent = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                stream.error = f"{reply.status_code}: {(await reply.aread())[:200]!r}"
                return stream
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    stream.completion_tokens = int(chunk["usage"]["completion_tokens"])
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        stream.tokens.append(time.perf_counter())
    except httpx.HTTPError as exc:
        stream.error = repr(exc)
    if not stream.completion_tokens:
        stream.completion_tokens = len(stream.tokens)
    return stream


def story(i: int) -> str:
    return f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}."


async def run_chats(url: str, n: int, max_tokens: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        streams = await asyncio.gather(*(chat(client, url, story(i), max_tokens) for i in range(n)))
        wall = time.perf_counter() - started
    ttfts = sorted(s.ttft for s in streams)
    tokens = sum(s.completion_tokens for s in streams)
    return {
        "tok_s": tokens / wall,
        "tokens": tokens,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p95": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
        "errors": [s.error for s in streams if s.error],
    }


def long_prompt() -> str:
    parts = [f"Section {i}: notes about {TOPICS[i % len(TOPICS)]}, with dates, places and "
             f"names to remember for later questions." for i in range(120)]
    return "Read these notes.\n" + "\n".join(parts) + "\nSummarise the notes in one paragraph."


ARRIVE_AFTER = 16  # tokens each stream has streamed when the long prompt arrives


async def run_long_prompt(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as client:
        watched = [Stream(sent=time.perf_counter()) for _ in range(3)]
        running = [
            asyncio.create_task(chat(client, url, story(i), 384, stream=s))
            for i, s in enumerate(watched)
        ]
        # the long prompt arrives once the three are decoding (a fast server finishes 384
        # tokens within a couple of seconds: a fixed wait could miss them)
        deadline = time.perf_counter() + 60
        while (
            any(
                len(s.tokens) < ARRIVE_AFTER and not t.done()
                for s, t in zip(watched, running, strict=True)
            )
            and time.perf_counter() < deadline
        ):
            await asyncio.sleep(0.01)
        arrived = time.perf_counter()
        long = await chat(client, url, long_prompt(), 16)
        streams = await asyncio.gather(*running)
    gaps = [
        b - a
        for s in streams
        for a, b in zip(s.tokens, s.tokens[1:], strict=False)
        if b >= arrived
    ]
    return {
        "max_gap": max(gaps, default=float("nan")),
        "long_ttft": long.ttft,
        "errors": [s.error for s in [*streams, long] if s.error],
    }


CODE = """def parse_config(path):
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


def load_users(path):
    users = []
    with open(path) as handle:
        for line in handle:
            name, email, age = line.strip().split(",")
            users.append({"name": name, "email": email, "age": int(age)})
    return users
"""

ORDER = (
    "Order 4471 was placed by Maria Lopez (maria.lopez@example.com) on 2024-03-18 for 3 "
    "items: a blue kettle at 24.99, two ceramic mugs at 8.50 each, and a bag of coffee beans "
    "at 12.00. Shipping to 12 Harbour Street, Bristol, BS1 4QA. "
)
FIELDS = ("order_id, customer_name, customer_email, date, items (name, quantity, unit_price), "
          "and shipping_address")


def _object(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


ORDER_SCHEMA = _object(
    order_id={"type": "integer"}, customer_name={"type": "string"},
    customer_email={"type": "string"}, date={"type": "string"},
    items={"type": "array", "items": _object(
        name={"type": "string"}, quantity={"type": "integer"}, unit_price={"type": "number"})},
    shipping_address={"type": "string"},
)

# Each workload: its prompt, and what else its request carries.
SPEC_WORKLOADS: dict[str, dict[str, Any]] = {
    "code edit": {"prompt": "Here is a Python file:\n\n" + CODE + "\nRewrite the whole file "
                  "with the parameter `path` renamed to `filename` everywhere. Reply with the "
                  "complete code only."},
    "json extraction": {"prompt": ORDER + f"Extract the order as JSON with the fields {FIELDS}. "
                        "Reply with JSON only."},
    # the same extraction under a JSON schema (structured outputs): the grammar forces the
    # keys and the punctuation
    "json schema": {"prompt": ORDER + "Extract the order as JSON.", "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "order", "strict": True, "schema": ORDER_SCHEMA},
    }},
    "free chat": {"prompt": "Write a short story about a fox who learns to sail."},
}


async def run_spec_workload(url: str, workload: dict[str, Any], max_tokens: int
                            ) -> dict[str, Any]:
    prompt = workload["prompt"]
    extra = {k: v for k, v in workload.items() if k != "prompt"}
    async with httpx.AsyncClient(timeout=600) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0, **extra}
        started = time.perf_counter()
        reply = await client.post(url + "/v1/chat/completions", json=body)
        wall = time.perf_counter() - started
        data = reply.json()
        # a second, timed as a stream, for the decode rate
        stream = await chat(client, url, prompt, max_tokens, extra)
    span = stream.tokens[-1] - stream.tokens[0] if len(stream.tokens) > 1 else float("nan")
    return {
        "text": data["choices"][0]["message"]["content"],
        "tokens": data["usage"]["completion_tokens"],
        "wall": wall,
        "decode_tok_s": (stream.completion_tokens - 1) / span if span == span and span else 0.0,
    }


def spec_events(log: Path) -> tuple[dict[str, Any] | None, float | None]:
    """The last ``speculation`` event of a server's JSON log, and the row cost it calibrated
    at start-up (None when it logged none)."""
    events = [json.loads(line) for line in log.read_text(errors="replace").splitlines()
              if line.startswith("{")]
    spec = [e for e in events if e.get("event") == "speculation"]
    calibrated = [e["row_cost"] for e in events if e.get("event") == "spec_calibration"]
    return (spec[-1] if spec else None), (calibrated[0] if calibrated else None)


def bench_spec(path: Path, threads: int, max_tokens: int, logs: Path, draft: str | None,
               rounds: int, row_cost: float | None, report: Report) -> dict[str, Any]:
    """Single-stream greedy decode with and without speculative decoding: the servers run
    side by side and take each workload in turns (the order turning each round), round
    after round, so that the machine's noise falls on all; the ratio is the median of the
    rounds' ratios. The decode passes each run took are read from the servers' logs too:
    on a busy machine the tokens a run keeps per pass, and the steps its passes cost at the
    row cost the server calibrated (or ``row_cost``), say what the drafting did when the
    ratio of two runs' rates says mostly what else ran."""
    variants: dict[str, list[str]] = {"plain": [], "--spec": ["--spec"]}
    if draft:
        variants["--spec-draft"] = ["--spec-draft", draft]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {w: [] for w in SPEC_WORKLOADS} for name in variants
    }
    calibrated: dict[str, float | None] = {}
    with contextlib.ExitStack() as stack:
        urls, server_logs = {}, {}
        for name, extra in variants.items():
            port = free_port()
            cmd = lmserve_cmd(path, port, threads, 1) + extra + [
                "--log-level", "info", "--log-format", "json"]
            server_logs[name] = logs / f"spec-{path.stem}-{name.strip('-')}.log"
            urls[name] = stack.enter_context(serving(cmd, port, server_logs[name]))
            asyncio.run(run_chats(urls[name], 1, 8))
        names = list(variants)
        for round_ in range(rounds):
            order = names[round_ % len(names):] + names[: round_ % len(names)]
            for workload, spec in SPEC_WORKLOADS.items():
                for name in order:
                    run = asyncio.run(run_spec_workload(urls[name], spec, max_tokens))
                    run["spec"], calibrated[name] = spec_events(server_logs[name])
                    results[name][workload].append(run)
    report.print(f"\n{path.name}: single-stream greedy decode, median tok/s over {rounds} "
                 "round(s) (median ratio to plain)")
    others = names[1:]
    report.print("| workload | " + " | ".join(variants) + " | identical replies | "
                 + " | ".join(f"{name} each round" for name in others) + " |")
    report.print("|---" * (len(variants) + 2 + len(others)) + "|")
    workloads = {}
    for workload in SPEC_WORKLOADS:
        base = results["plain"][workload]
        cells, rounds_ = [], []
        figures = {}
        for name in variants:
            runs = results[name][workload]
            rate = statistics.median(r["decode_tok_s"] for r in runs)
            ratios = [
                r["decode_tok_s"] / b["decode_tok_s"] if b["decode_tok_s"] else 0.0
                for r, b in zip(runs, base, strict=True)
            ]
            ratio = statistics.median(ratios)
            cells.append(f"{rate:.1f} ({ratio:.2f}x)")
            figures[name] = {"tok_s": rate, "ratio": ratio,
                             "rounds": [r["decode_tok_s"] for r in runs]}
            if name != "plain":
                rounds_.append(" ".join(f"{x:.2f}" for x in ratios))
        same = all(r["text"] == base[0]["text"] for n in variants for r in results[n][workload])
        report.print(f"| {workload} ({base[0]['tokens']} tokens) | " + " | ".join(cells)
                     + f" | {'yes' if same else 'NO'} | " + " | ".join(rounds_) + " |")
        workloads[workload] = {"tokens": base[0]["tokens"], "identical": same,
                               "variants": figures}
    for name in others:
        row = row_cost if row_cost is not None else calibrated.get(name) or 0.25
        report.print(f"\n{name}, each round: drafts accepted / verified, and the decode steps "
                     f"of plain decoding per step its passes cost at a row cost of {row:.2f} "
                     "(tokens / (tokens - accepted + row x verified))")
        for workload in SPEC_WORKLOADS:
            cells = []
            for r in results[name][workload]:
                event, n = r["spec"], r["tokens"]
                if event is None:
                    cells.append("-")
                    continue
                got, tried = event["accepted"], event["proposed"]
                cells.append(f"{got}/{tried} {n / (n - got + row * tried):.2f}x")
            report.print(f"- {workload}: " + ", ".join(cells))
    return {"file": path.name, "workloads": workloads}


def lmserve_cmd(path: Path, port: int, threads: int, batch: int) -> list[str]:
    return [sys.executable, "-m", "lmserve_core", str(path), "--port", str(port),
            "--threads", str(threads), "--ctx", "4096", "--batch", str(batch),
            "--log-level", "warning"]


def llama_server_cmd(binary: str, path: Path, port: int, threads: int, batch: int) -> list[str]:
    # its default parallel slots share one context: give each the 4096 lmserve's slots get
    return [binary, "-m", str(path), "--port", str(port), "-t", str(threads),
            "-c", str(4096 * max(4, batch)), "--log-disable"]


def bench_server(url: str, concurrency: list[int], max_tokens: int) -> dict[str, Any]:
    asyncio.run(run_chats(url, 1, 8))  # warm up
    out: dict[str, Any] = {}
    for n in concurrency:
        out[f"chat x{n}"] = asyncio.run(run_chats(url, n, max_tokens))
    out["long prompt"] = asyncio.run(run_long_prompt(url))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="smollm2,gemma3-270m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--llama-server", help="path of a built llama.cpp llama-server")
    parser.add_argument("--spec", action="store_true",
                        help="measure speculative decoding (single stream) instead")
    parser.add_argument("--spec-draft", help="also measure --spec-draft with this GGUF")
    parser.add_argument("--row-cost", type=float,
                        help="--spec: the row cost to count steps at (default: the server's "
                        "calibration)")
    add_output_options(parser)
    args = parser.parse_args()
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    if args.spec or args.spec_draft:
        report = Report("spec", args, args.threads)
        report.print(f"CPU: {cpu_model()}, {args.threads} threads")
        logs = Path(tempfile.mkdtemp(prefix="bench-spec-"))
        models = [
            {"model": name, **bench_spec(model_path(name), args.threads,
                                         max(args.max_tokens, 256), logs, args.spec_draft,
                                         args.rounds, args.row_cost, report)}
            for name in names
        ]
        report.finish(rounds=args.rounds, max_tokens=max(args.max_tokens, 256), models=models)
        return
    concurrency = [int(n) for n in args.concurrency.split(",")]
    batch = max(4, *concurrency)
    report = Report("serve", args, args.threads, args.llama_server)
    report.print(f"CPU: {cpu_model()}, {args.threads} threads, lmserve --batch {batch}")
    logs = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    records = []
    for name in names:
        path = model_path(name)
        for round_ in range(1, args.rounds + 1):
            engines = {"lmserve": lmserve_cmd}
            if args.llama_server:
                engines["llama-server"] = lambda p, port, t, b: llama_server_cmd(
                    args.llama_server, p, port, t, b)
            figures = {}
            for engine, make in engines.items():
                port = free_port()
                with serving(make(path, port, args.threads, batch), port,
                             logs / f"{engine}-{name}-{round_}.log") as url:
                    figures[engine] = bench_server(url, concurrency, args.max_tokens)
            records.append({"model": name, "file": path.name, "round": round_, **figures})
            print_table(name, round_, figures, report)
    report.finish(concurrency=concurrency, max_tokens=args.max_tokens, batch=batch,
                  rounds=args.rounds, records=records)


def print_table(name: str, round_: int, figures: dict[str, dict[str, Any]], report: Report
                ) -> None:
    engines = list(figures)
    report.print(f"\n{name}, round {round_}")
    head = "| workload | " + " | ".join(engines) + (" | ratio |" if len(engines) == 2 else " |")
    report.print(head)
    report.print("|---" * (len(engines) + 1 + (len(engines) == 2)) + "|")
    for workload in figures[engines[0]]:
        cells = []
        values = []
        for engine in engines:
            f = figures[engine][workload]
            if workload.startswith("chat"):
                cells.append(f"{f['tok_s']:.1f} tok/s, ttft p50 {f['ttft_p50']:.2f} s "
                             f"p95 {f['ttft_p95']:.2f} s")
                values.append(f["tok_s"])
            else:
                cells.append(f"max gap {f['max_gap']:.2f} s, its ttft {f['long_ttft']:.2f} s")
                values.append(1.0 / f["max_gap"] if f["max_gap"] else 0.0)
            if f["errors"]:
                cells[-1] += f" ({len(f['errors'])} errors: {f['errors'][0]})"
        ratio = f" | {values[0] / values[1]:.2f}x" if len(values) == 2 and values[1] else ""
        report.print(f"| {workload} | " + " | ".join(cells) + ratio + " |")


if __name__ == "__main__":
    main()
