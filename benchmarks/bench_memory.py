"""Resident memory of a served model with a full-context KV cache (f16 by default).

Builds the backend exactly as ``lmserve --ctx N`` does (the family's factory: model,
tokenizer, chat template, one KV slot) with the HTTP stack imported, writes every position
of every layer of the slot's cache (as a conversation that filled the context would), runs
a prefill chunk ending at the last position and a decode step there, and reports the
process's resident and peak memory against the weights' size. Filling through the forward
pass would take the better part of an hour at 32k positions; writing the rows commits the
same pages.

    python benchmarks/bench_memory.py [--model GGUF] [--ctx 32768] [--kv-type f16]

Without ``--model`` it uses the synthetic Qwen3-0.6B-geometry Q8_0 file of
``plugins/lmserve-qwen3/tests/synthetic.py`` (written once, cached).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def default_model() -> Path:
    sys.path.insert(0, str(ROOT / "plugins" / "lmserve-qwen3" / "tests"))
    from synthetic import synthetic_model

    return Path(synthetic_model("qwen3", "q8_0", "0.6b")[0])


def load(path: Path, ctx: int, kv_type: str):  # type: ignore[no-untyped-def]
    import lmserve_core.app  # noqa: F401  (the HTTP stack a server has loaded)
    from lmserve_core.backend import ServerSettings
    from lmserve_core.gguf_file import GGUFFile
    from lmserve_core.plugins import backend_for_architecture

    with GGUFFile.open(path) as gguf:
        spec = backend_for_architecture(gguf.architecture)
    if spec is None:
        raise SystemExit(f"no installed family serves {path}")
    return spec.factory(str(path), ServerSettings(ctx=ctx, threads=2, kv_type=kv_type))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--kv-type", default="f16", choices=["f16", "f32"])
    args = parser.parse_args()
    path = args.model or default_model()
    weights = path.stat().st_size
    backend = load(path, args.ctx, args.kv_type)
    model = backend.model
    rng = np.random.default_rng(0)
    model.forward(model.new_cache(64), [1, 2, 3, 4], 0)  # fault in weights and scratch
    base = status_kib("VmRSS") * 1024
    cache = backend.slots.slots[0].cache  # the slot's cache of --ctx positions
    per_pos = model.kv_bytes_per_pos
    started = time.perf_counter()
    step = 1024
    for layer, (heads, dk, dv, *_ring) in enumerate(model.cache_layers):
        k = rng.standard_normal((step, heads * dk)).astype(np.float32)
        v = rng.standard_normal((step, heads * dv)).astype(np.float32)
        for pos in range(0, args.ctx, step):
            n = min(step, args.ctx - pos)
            cache.native.write(layer, pos, k[:n], v[:n])
    filled = time.perf_counter() - started
    tokens = rng.integers(100, 1000, 256).tolist()
    model.forward(cache, tokens, args.ctx - 257)  # a prefill chunk over the full context
    model.forward(cache, [tokens[0]], args.ctx - 1)  # a decode step at the last position
    rss, peak = status_kib("VmRSS") * 1024, status_kib("VmHWM") * 1024
    gib = 2**30
    full = model.kv_bytes(args.ctx)
    print(f"model {path.name}: weights {weights / gib:.2f} GiB, KV {args.kv_type} "
          f"{per_pos} bytes/position ({full / gib:.2f} GiB at {args.ctx})")
    print(f"filled {args.ctx} positions in {filled:.1f} s")
    print(f"RSS before the cache {base / gib:.2f} GiB, after {rss / gib:.2f} GiB, "
          f"peak {peak / gib:.2f} GiB")
    print(f"peak - weights = {(peak - weights) / gib:.2f} GiB "
          f"({(peak - weights) / 1e9:.2f} GB; budget 3.8 GB)")
    os._exit(0)  # skip freeing 3.5 GiB of pages one by one


if __name__ == "__main__":
    main()
