"""Prefill and decode tok/s of a nanochat checkpoint in lmserve (the nanochat family, per
``--load-types``), side by side with nanochat's own engine on the same checkpoint and thread
count (pp512 / tg128 by default).

    python benchmarks/bench_nanochat.py [--depth 20] [--threads 2] [--prompt 512] [--gen 128]
        [--reps 3] [--rounds 2] [--load-types q8_0,bf16] [--no-nanochat] [--out DIR]

The checkpoint: random weights in nanochat's own layout, written once and cached under
``cache_dir() / "nanochat-bench"``: ``base_checkpoints/d{N}/model_000000.pt`` (the state
dict of the current ``gpt.py``, vendored under ``plugins/lmserve-nanochat/tests/reference``,
with the ``_orig_mod.`` prefix torch.compile leaves; ``wte`` and the value embeddings in
bfloat16, the rest float32, as nanochat's trainer saves them), ``meta_000000.json`` (its
``model_config``: ``scripts/base_train.py``'s geometry for ``--depth``, d20 by default:
20 layers of 1280, 10 heads of 128, vocabulary 32,768, context 2048, windows ``SSSL``) and
``tokenizer/tokenizer.pkl`` (a tiktoken encoding of 32,768 tokens trained by rustbpe on a
synthetic corpus, a few seconds; the prompts are token ids).

- lmserve: ``open_checkpoint`` (the plugin's reader and its in-memory GGUF view, matrices
  converted to the load type) and ``NanochatModel.load``, then ``bench_decode.py``'s timing:
  a prefill of ``--prompt`` random tokens, ``--gen`` greedy decode steps from position 0.
- nanochat: the vendored ``gpt.py`` loaded as ``checkpoint_manager.build_model`` does on CPU
  (bfloat16 tensors widened, so it computes in float32: nanochat's CPU path), driven as
  ``Engine.generate`` drives it: the prompt in one forward through ``engine.py``'s
  ``KVCache`` (copied below), then single-token forwards with the cache and a greedy argmax.
  ``torch.set_num_threads(--threads)``.

Each round runs every engine in a process of its own, one after the other, loading the
checkpoint afresh (the load time is reported); each figure is the median of ``--reps``
repetitions, the summary gives the median of the rounds' ratios and each engine's best
repetition. An engine's peak resident memory is its process's high-water mark (VmHWM: its
libraries, torch's for nanochat, among it; the records also hold the resident memory before
the load and just after it). Records and tables go to ``--out`` (``nanochat.json``, ``.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Only the engines' compute threads should run: OpenBLAS's pool (numpy's, idle here) spins
# on the same two cores after any use.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import random_tokens, time_model  # noqa: E402
from results import Report, add_output_options, cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "plugins" / "lmserve-nanochat"
REFERENCE = PLUGIN / "tests" / "reference"  # nanochat's gpt.py, vendored
CHECKPOINT_VERSION = "1"
STEP = 0
VOCAB_SIZE = 32768  # scripts/tok_train.py's default
SEQUENCE_LEN = 2048
ORIG_MOD = "_orig_mod."
RESULT = "result: "  # a child's line of figures


# -- the synthetic checkpoint ------------------------------------------------------------------


def model_config(depth: int) -> dict[str, Any]:
    """scripts/base_train.py's model for ``--depth``: width depth * 64 rounded up to heads of
    128, as many kv heads as heads."""
    head_dim = 128
    n_embd = -(-depth * 64 // head_dim) * head_dim
    return {
        "sequence_len": SEQUENCE_LEN,
        "vocab_size": VOCAB_SIZE,
        "n_layer": depth,
        "n_head": n_embd // head_dim,
        "n_kv_head": n_embd // head_dim,
        "n_embd": n_embd,
        "window_pattern": "SSSL",
    }


def gpt_module() -> Any:
    if str(REFERENCE) not in sys.path:
        sys.path.insert(0, str(REFERENCE))
    from nanochat import gpt

    return gpt


def random_state(config: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """A state dict of the current gpt.py, every parameter random at about its trained scale:
    matrices uniform with std 1 / sqrt(fan_in) (gpt.py's init for c_q; its zero-initialised
    projections get the same), wte ~ N(0, 0.8), value embeddings as c_v, lambdas and gates
    as init_weights sets them (smear_lambda 0.1 rather than 0)."""
    import torch

    gpt = gpt_module()
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in gpt.GPT(gpt.GPTConfig(**config)).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    n = config["n_layer"]
    out = {}
    for name, shape in shapes.items():
        if name == "transformer.wte.weight":
            v = torch.randn(shape, generator=g) * 0.8
        elif name == "resid_lambdas":
            v = 1.15 - 0.10 * torch.arange(n) / max(n - 1, 1)
        elif name == "x0_lambdas":
            v = 0.20 - 0.15 * torch.arange(n) / max(n - 1, 1)
        elif name == "smear_lambda":
            v = torch.full(shape, 0.1)
        elif name == "backout_lambda":
            v = torch.full(shape, 0.2)
        elif name.endswith(("smear_gate.weight", "ve_gate.weight")):
            v = torch.rand(shape, generator=g) * 0.02
        else:  # matrices, lm_head and the value embeddings
            s = 3**0.5 * shape[-1] ** -0.5
            v = (torch.rand(shape, generator=g) * 2 - 1) * s
        embedding = name == "transformer.wte.weight" or name.startswith("value_embeds.")
        out[name] = v.to(torch.bfloat16 if embedding else torch.float32).contiguous()
    return out


def synthetic_corpus(n_docs: int = 2000, seed: int = 0) -> Any:
    """Documents of made-up words (syllables of Latin letters): enough distinct pairs for
    32,768 tokens."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"] + list("abcdefghijklmnopqrstuvwxyz")
    for _ in range(n_docs):
        yield " ".join(
            "".join(rng.choices(syllables, k=rng.randint(1, 5))) for _ in range(200)
        )


def write_tokenizer(path: Path) -> None:
    """nanochat's ``tokenizer.pkl``: a tiktoken Encoding trained by rustbpe with nanochat's
    split pattern and special tokens, pickled as ``RustBPETokenizer.save`` does."""
    import rustbpe
    import tiktoken
    from lmserve_nanochat.vocab import SPECIAL_TOKENS, SPLIT_PATTERN

    trainer = rustbpe.Tokenizer()
    n_ranks = VOCAB_SIZE - len(SPECIAL_TOKENS)
    trainer.train_from_iterator(synthetic_corpus(), n_ranks, pattern=SPLIT_PATTERN)
    ranks = {bytes(k): v for k, v in trainer.get_mergeable_ranks()}
    if len(ranks) != n_ranks:
        raise SystemExit(f"the synthetic corpus gave {len(ranks)} tokens, not {n_ranks}")
    specials = {name: n_ranks + i for i, name in enumerate(SPECIAL_TOKENS)}
    enc = tiktoken.Encoding(name="rustbpe", pat_str=trainer.get_pattern(),
                            mergeable_ranks=ranks, special_tokens=specials)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(enc))


def synthetic_checkpoint(depth: int) -> Path:
    """The cached base directory of a random d{depth} run (module docstring); written once."""
    from lmserve_core.testing.assets import cache_dir

    base = cache_dir() / "nanochat-bench" / f"d{depth}-v{CHECKPOINT_VERSION}"
    if base.is_dir():
        return base
    import torch

    tmp = base.with_name(f"{base.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"writing a synthetic d{depth} checkpoint into {base}", flush=True)
    config = model_config(depth)
    write_tokenizer(tmp / "tokenizer" / "tokenizer.pkl")
    model_dir = tmp / "base_checkpoints" / f"d{depth}"
    model_dir.mkdir(parents=True)
    state = random_state(config)
    torch.save({ORIG_MOD + k: v for k, v in state.items()}, model_dir / f"model_{STEP:06d}.pt")
    del state
    meta = {"step": STEP, "val_bpb": None, "model_config": config, "max_seq_len": SEQUENCE_LEN,
            "synthetic": "random weights, benchmarks/bench_nanochat.py"}
    (model_dir / f"meta_{STEP:06d}.json").write_text(json.dumps(meta, indent=2))
    try:
        tmp.rename(base)
    except OSError:  # another run finished first: its checkpoint is the same
        shutil.rmtree(tmp, ignore_errors=True)
    return base


# -- memory ------------------------------------------------------------------------------------


def memory_mib() -> dict[str, float]:
    """VmRSS and VmHWM of this process, MiB."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out["rss_mib" if key == "VmRSS" else "peak_rss_mib"] = int(value.split()[0]) / 1024
    except OSError:
        pass
    return out


# -- lmserve -----------------------------------------------------------------------------------


def bench_lmserve(model_dir: Path, load_type: str, threads: int, n_prompt: int, n_gen: int,
                  reps: int) -> dict[str, float]:
    from lmserve_nanochat.model import NanochatModel
    from lmserve_nanochat.plugin import Options, open_checkpoint

    from lmserve_core.backend import ServerSettings

    before = memory_mib().get("rss_mib")
    started = time.perf_counter()
    settings = ServerSettings(threads=threads, options=Options(load_type=load_type))
    model = NanochatModel.load(open_checkpoint(str(model_dir), settings), n_threads=threads)
    out: dict[str, float] = {"load_s": time.perf_counter() - started}
    loaded = memory_mib().get("rss_mib")
    try:
        out.update(time_model(model, n_prompt, n_gen, reps))
    finally:
        model.close()
    out.update(memory_mib(), rss_mib=loaded, base_rss_mib=before)
    return out


# -- nanochat ----------------------------------------------------------------------------------


class KVCache:
    """nanochat/engine.py's KVCache at commit 92d63d4 (MIT License, Copyright (c) 2025 Andrej
    Karpathy; see plugins/lmserve-nanochat/tests/reference/LICENSE.nanochat), the parts a
    generation uses: (n_layers, B, T, H, D) tensors, filled in place by the SDPA fallback of
    flash_attn_with_kvcache, the position in ``cache_seqlens``, the smear's previous
    embedding."""

    def __init__(self, batch_size: int, num_heads: int, seq_len: int, head_dim: int,
                 num_layers: int, device: Any, dtype: Any) -> None:
        import torch

        self.batch_size = batch_size
        self.max_seq_len = seq_len
        self.n_layers = num_layers
        self.n_heads = num_heads
        self.head_dim = head_dim
        shape = (num_layers, batch_size, seq_len, num_heads, head_dim)
        self.k_cache = torch.zeros(*shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(*shape, device=device, dtype=dtype)
        self.cache_seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.prev_embedding = None

    def get_pos(self) -> int:
        return int(self.cache_seqlens[0].item())

    def get_layer_cache(self, layer_idx: int) -> tuple[Any, Any]:
        return self.k_cache[layer_idx], self.v_cache[layer_idx]

    def advance(self, num_tokens: int) -> None:
        self.cache_seqlens += num_tokens


def load_nanochat(model_dir: Path) -> Any:
    """checkpoint_manager.build_model on CPU: the state dict loaded, bfloat16 widened to float32,
    ``_orig_mod.`` dropped, the GPT built on the meta device and the weights assigned."""
    import torch

    gpt = gpt_module()
    meta = json.loads((model_dir / f"meta_{STEP:06d}.json").read_text())
    data = torch.load(model_dir / f"model_{STEP:06d}.pt", map_location="cpu")
    data = {k.removeprefix(ORIG_MOD): v.float() if v.dtype == torch.bfloat16 else v
            for k, v in data.items()}
    with torch.device("meta"):
        model = gpt.GPT(gpt.GPTConfig(**meta["model_config"]))
    model.to_empty(device="cpu")
    model.init_weights()  # the rotary tables (nanochat's loader does the same)
    model.load_state_dict(data, strict=True, assign=True)
    return model.eval()


def bench_nanochat(model_dir: Path, threads: int, n_prompt: int, n_gen: int,
                   reps: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(threads)
    before = memory_mib().get("rss_mib")
    started = time.perf_counter()
    model = load_nanochat(model_dir)
    out: dict[str, float] = {"load_s": time.perf_counter() - started}
    loaded = memory_mib().get("rss_mib")
    c = model.config
    dtype = model.cos.dtype  # COMPUTE_DTYPE: float32 on CPU

    def new_cache(n: int) -> KVCache:
        return KVCache(batch_size=1, num_heads=c.n_kv_head, seq_len=n,
                       head_dim=c.n_embd // c.n_head, num_layers=c.n_layer, device="cpu",
                       dtype=dtype)

    tokens = random_tokens(c.vocab_size, n_prompt)
    prefill, decode = [], []
    with torch.inference_mode():
        # warm up: torch's thread pool, and its kernels for both shapes
        warm = new_cache(n_prompt + 2)
        model.forward(torch.tensor([tokens]), kv_cache=warm)
        for token in tokens[:2]:
            model.forward(torch.tensor([[token]]), kv_cache=warm)
        for _ in range(reps):
            cache = new_cache(n_prompt)
            ids = torch.tensor([tokens], dtype=torch.long)
            begun = time.perf_counter()
            model.forward(ids, kv_cache=cache)
            prefill.append(n_prompt / (time.perf_counter() - begun))
            # Engine.generate's loop at temperature 0, from position 0 (llama-bench's tg)
            cache = new_cache(n_gen)
            column = [tokens[0]]
            begun = time.perf_counter()
            for _ in range(n_gen):
                ids = torch.tensor(column, dtype=torch.long).unsqueeze(1)
                logits = model.forward(ids, kv_cache=cache)[:, -1, :]
                column = torch.argmax(logits, dim=-1, keepdim=True)[:, 0].tolist()
            decode.append(n_gen / (time.perf_counter() - begun))
    del model
    out.update(pp=statistics.median(prefill), pp_best=max(prefill),
               tg=statistics.median(decode), tg_best=max(decode))
    out.update(memory_mib(), rss_mib=loaded, base_rss_mib=before)
    return out


# -- the run -----------------------------------------------------------------------------------


def run_engine(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    """One engine's load and figures, in a process of its own: each starts from the same
    memory (its peak is its own) and no engine's threads or heap outlive it."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", engine,
           "--depth", str(args.depth), "--threads", str(args.threads),
           "--prompt", str(args.prompt), "--gen", str(args.gen), "--reps", str(args.reps)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    for text in reversed(done.stdout.splitlines()):
        if text.startswith(RESULT):
            return json.loads(text.removeprefix(RESULT))
    raise SystemExit(f"{engine}: no result from {' '.join(cmd)}")


def child(args: argparse.Namespace) -> None:
    """``--child lmserve:TYPE`` or ``--child nanochat``: print the engine's result."""
    model_dir = synthetic_checkpoint(args.depth) / "base_checkpoints" / f"d{args.depth}"
    engine, _, load_type = args.child.partition(":")
    if engine == "lmserve":
        r = bench_lmserve(model_dir, load_type, args.threads, args.prompt, args.gen, args.reps)
    else:
        import torch

        r = bench_nanochat(model_dir, args.threads, args.prompt, args.gen, args.reps)
        r["torch"] = torch.__version__
    print(RESULT + json.dumps(r), flush=True)


# -- the tables --------------------------------------------------------------------------------


def line(label: str, r: dict[str, float], tests: dict[str, str]) -> str:
    mem = (f"  peak RSS {r['peak_rss_mib']:5.0f} MiB ({r['base_rss_mib']:.0f} before load)"
           if "peak_rss_mib" in r else "")
    return (f"{label:22s} load {r['load_s']:5.1f} s  {tests['pp']} {r['pp']:7.1f}  "
            f"{tests['tg']} {r['tg']:6.1f}{mem}")


def summary(records: list[dict[str, Any]], load_type: str) -> str:
    mine = [r for r in records if r["engine"] == "lmserve" and r["weights"] == load_type
            and r.get("ratio")]
    if not mine:
        return ""
    theirs_all = [r for r in records if r["engine"] == "nanochat"]
    parts = []
    for key in ("pp", "tg"):
        med = statistics.median(r["ratio"][key] for r in mine)
        ours = max(r[f"{key}_best"] for r in mine)
        theirs = max(r[f"{key}_best"] for r in theirs_all)
        parts.append(f"{key} median ratio {med:.2f}x, best {ours:.1f} vs {theirs:.1f} "
                     f"({ours / theirs:.2f}x)")
    return f"lmserve {load_type:5s} over {len(mine)} rounds: " + "; ".join(parts)


def table(records: list[dict[str, Any]], tests: dict[str, str]) -> list[str]:
    rows = [f"| round | engine | weights | load | {tests['pp']} | {tests['tg']} | peak RSS |",
            "|---|---|---|---|---|---|---|"]
    for r in records:
        ratio = r.get("ratio") or {}
        pp = f"{r['pp']:.1f}" + (f" ({ratio['pp']:.2f}x)" if ratio else "")
        tg = f"{r['tg']:.1f}" + (f" ({ratio['tg']:.2f}x)" if ratio else "")
        peak = f"{r['peak_rss_mib'] / 1024:.2f} GiB" if "peak_rss_mib" in r else ""
        rows.append(f"| {r['round']} | {r['engine']} | {r['weights']} | {r['load_s']:.1f} s "
                    f"| {pp} | {tg} | {peak} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--load-types", default="q8_0,bf16",
                        help="lmserve's --load-type of the matrices: f32, bf16, f16, q8_0")
    parser.add_argument("--nanochat", action=argparse.BooleanOptionalAction, default=True,
                        help="nanochat's own engine side by side (float32 on CPU; default on)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # run_engine's
    add_output_options(parser)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    load_types = [t.strip() for t in args.load_types.split(",") if t.strip()]
    base = synthetic_checkpoint(args.depth)
    model_dir = base / "base_checkpoints" / f"d{args.depth}"
    report = Report("nanochat", args, args.threads)
    c = model_config(args.depth)
    report.print(f"CPU: {cpu_model()}, {args.threads} threads")
    report.print(f"checkpoint: {model_dir} (random weights: {c['n_layer']} layers of "
                 f"{c['n_embd']}, {c['n_head']} heads, vocabulary {c['vocab_size']})")
    if args.nanochat:
        report.print("nanochat: its gpt.py and engine's KV cache in float32 on CPU (its CPU "
                     "path: bfloat16 tensors widened at load)")
    tests = {"pp": f"pp{args.prompt}", "tg": f"tg{args.gen}"}
    records: list[dict[str, Any]] = []
    for round_ in range(1, args.rounds + 1):
        ours = []
        for load_type in load_types:
            r = run_engine(f"lmserve:{load_type}", args)
            ours.append({"round": round_, "engine": "lmserve", "weights": load_type, **r})
            report.print(line(f"round {round_} lmserve {load_type}", r, tests))
        records += ours
        if args.nanochat:
            r = run_engine("nanochat", args)
            records.append({"round": round_, "engine": "nanochat", "weights": "f32", **r})
            if round_ == 1:
                report.print(f"nanochat on torch {r.get('torch')}")
            report.print(line(f"round {round_} nanochat f32", r, tests))
            for o in ours:
                o["ratio"] = {k: o[k] / r[k] for k in ("pp", "tg")}
            report.print(f"round {round_} ratios: " + "  ".join(
                f"{o['weights']} pp {o['ratio']['pp']:.2f}x tg {o['ratio']['tg']:.2f}x"
                for o in ours))
    report.print()
    for load_type in load_types:
        if text := summary(records, load_type):
            report.print(text)
    report.print()
    for row in table(records, tests):
        report.print(row)
    report.finish(depth=args.depth, model_config=c, prompt=args.prompt, gen=args.gen,
                  reps=args.reps, rounds=args.rounds, load_types=load_types, runs=records)


if __name__ == "__main__":
    main()
