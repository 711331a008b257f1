"""Tiny nanochat runs on disk, as nanochat's trainer leaves them: a base directory with
``tokenizer/tokenizer.pkl`` and ``chatsft_checkpoints/d{N}/model_{step:06d}.pt`` +
``meta_{step:06d}.json``, the model a ``tiny_nanochat`` one whose vocabulary is the test
tokenizer's (``vocab_fixtures``). Written once per machine under ``cache_dir()``."""

from __future__ import annotations

import codecs
import json
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from tiny_nanochat import SPECS, TinyModel, native_config, tiny_model
from vocab_fixtures import VOCAB_SIZE, encoding, make_tokenizer

from lmserve_core.testing.assets import cache_dir

STEP = 5
RUNS_VERSION = "1"


def native_run(kind: str = "smear") -> tuple[Path, TinyModel]:
    """The base directory of a run whose sft checkpoint is the tiny ``kind`` model, and that
    model (its reference forward for comparisons)."""
    spec = replace(SPECS[kind], vocab_size=VOCAB_SIZE)
    model = tiny_model(kind, spec)
    base = cache_dir() / "nanochat-runs" / f"{kind}-{RUNS_VERSION}-{model.path.stem}"
    if not (base / "done").exists():
        import torch

        tmp = Path(tempfile.mkdtemp(dir=base.parent if base.parent.exists() else None))
        make_tokenizer(tmp)
        ckpt = tmp / "chatsft_checkpoints" / f"d{spec.n_layer}"
        ckpt.mkdir(parents=True)
        # torch.compile's prefix on every name, as nanochat's trainer saves them (f32 here,
        # so that the reference holds the same values: bf16 tensors are the reader's tests')
        state = {f"_orig_mod.{k}": torch.from_numpy(v.copy()) for k, v in model.tensors.items()}
        torch.save(state, ckpt / f"model_{STEP:06d}.pt")
        meta = {"step": STEP, "model_config": native_config(spec)}
        (ckpt / f"meta_{STEP:06d}.json").write_text(json.dumps(meta))
        (tmp / "done").touch()
        base.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(base)
        except OSError:  # written meanwhile by another run: the same files
            shutil.rmtree(tmp, ignore_errors=True)
    return base, model


TOOL_MARKERS = ("<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")


def reference_reply(model: TinyModel, turns: list[tuple[str, str]], max_tokens: int) -> str:
    """The reference's greedy reply to a conversation of (role, text) turns ("user" or
    "assistant"), rendered as nanochat renders it, as the client sees it: up to the end of
    the turn, control tokens hidden, the calculator's markers shown, and a character the
    token budget cut in two dropped (a random model's reply is seldom valid UTF-8)."""
    enc = encoding()
    special = enc._special_tokens  # noqa: SLF001 (tiktoken keeps them there)
    ids = [special["<|bos|>"]]
    for role, text in turns:
        ids += [special[f"<|{role}_start|>"], *enc.encode_ordinary(text), special[f"<|{role}_end|>"]]
    ids.append(special["<|assistant_start|>"])
    ends = {special["<|assistant_end|>"], special["<|bos|>"]}
    hidden = {i for name, i in special.items() if name not in TOOL_MARKERS}
    out = b""
    for t in model.greedy(ids, max_tokens):
        if t in ends:
            break
        if t not in hidden:
            out += enc.decode_single_token_bytes(t)
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(out)
