"""Regenerate a llama.cpp perplexity reference under tests/data/perplexity/.

Runs ``llama-perplexity`` on tests/data/perplexity/text.txt (context 256, batch 256, two
threads, the tool's per-chunk output with ``--ppl-output-type 1``) and ``llama-tokenize``
on the same text, and writes what the numerics tests compare against: the final and
running figures, the per-chunk figures and llama.cpp's own token ids.

    python benchmarks/record_llamacpp_perplexity.py --model MODEL.gguf \
        --bin /path/to/llama.cpp/build/bin --out tests/data/perplexity/x.json

Standard library only; the test suite reads the JSON files, never this script.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import subprocess
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "perplexity"
LLAMA_CPP_BUILD = "b11434"
CTX = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--bin", type=Path, required=True, help="llama.cpp's build/bin")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    text = DATA_DIR / "text.txt"
    cmd = [str(args.bin / "llama-perplexity"), "-m", str(args.model), "-c", str(CTX), "-b",
           str(CTX), "-t", "2", "-f", str(text)]
    final = subprocess.run(cmd, capture_output=True, text=True, check=True)
    per_chunk = subprocess.run([*cmd, "--ppl-output-type", "1"], capture_output=True,
                               text=True, check=True)
    ppl, stderr = map(float, re.search(r"PPL = ([\d.]+) \+/- ([\d.]+)",
                                       final.stderr + final.stdout).groups())  # type: ignore[union-attr]
    running = [float(v) for v in re.findall(r"\[\d+\]([\d.]+)", final.stderr + final.stdout)]
    # --ppl-output-type 1: "tokens ppl mean_nll stderr" per chunk
    rows = [line.split() for line in per_chunk.stdout.splitlines()
            if re.match(r"\s*\d+\s+[\d.]+\s+[\d.]+", line)]
    running_nll = [float(r[2]) for r in rows]
    chunk_nll = [running_nll[0]] + [
        (k + 1) * running_nll[k] - k * running_nll[k - 1] for k in range(1, len(running_nll))
    ]
    # llama-perplexity reads the file without its trailing newline
    ids = subprocess.run(
        [str(args.bin / "llama-tokenize"), "-m", str(args.model), "--stdin", "--ids",
         "--log-disable"],
        input=text.read_text(encoding="utf-8").removesuffix("\n"),
        capture_output=True, text=True, check=True,
    ).stdout
    tokens = ast.literal_eval(ids.strip().splitlines()[-1])
    n_chunks = len(tokens) // CTX
    record = {
        "model": args.model.name,
        "llama_cpp": LLAMA_CPP_BUILD,
        "command": f"llama-perplexity -m {args.model.name} -c {CTX} -b {CTX} -t 2 -f text.txt",
        "ctx": CTX,
        "n_chunks": n_chunks,
        "ppl": ppl,
        "ppl_stderr": stderr,
        "mean_nll": running_nll[-1],
        "tokens_total": len(tokens),
        "tokens_scored": n_chunks * (CTX // 2 - 1),
        "scored": "See smollm2_llamacpp.json: chunks of 256 tokens from an empty cache, the "
                  "logits at positions 128..254 score the next token. This vocabulary adds "
                  "a BOS, so the tool overwrites the first token of every chunk with BOS.",
        "running_ppl": running,
        "running_mean_nll": running_nll,
        "per_chunk": [round(math.exp(v), 3) for v in chunk_nll],
        "tokens": tokens,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
