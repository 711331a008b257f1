"""Helpers of the families' numerical tests: greedy decoding on both sides of a comparison
and llama-perplexity's scoring rule. torch is imported only by the functions that run a
transformers reference."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def chunk_nll(logits: np.ndarray, ids: Sequence[int], first: int) -> tuple[float, int]:
    """Summed NLL of ids[j + 1] given logits[j] for j in [first, len(ids) - 1), in float64,
    and how many tokens it scored (llama-perplexity's rule scores the second half of each
    chunk: ``first = n_ctx // 2``)."""
    scored = logits[first:-1].astype(np.float64)
    targets = np.asarray(ids[first + 1 :])
    top = scored.max(axis=1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(scored - top).sum(axis=1))
    nll = log_z - scored[np.arange(len(targets)), targets]
    return float(nll.sum()), len(targets)


def greedy(model: Any, ids: Sequence[int], n_new: int) -> list[int]:
    """``n_new`` greedy tokens of a ``ForwardModel`` after ``ids`` (prefill, then one token
    per forward)."""
    cache = model.new_cache(len(ids) + n_new)
    logits = model.forward(cache, list(ids), 0)
    out: list[int] = []
    for step in range(n_new):
        out.append(int(np.argmax(logits)))
        if step + 1 < n_new:
            logits = model.forward(cache, [out[-1]], len(ids) + step)
    return out


def reference_greedy(reference: Any, ids: Sequence[int], n_new: int, *, exact: bool = False) -> list[int]:
    """A transformers model's greedy continuation of ``ids``: ``n_new`` tokens, or fewer
    when it ends with its EOS (``exact`` forces all ``n_new``)."""
    import torch

    with torch.no_grad():
        out = reference.generate(
            torch.tensor([list(ids)]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n_new,
            min_new_tokens=n_new if exact else None,
            do_sample=False,
            num_beams=1,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(ids) :].tolist()]


def gguf_reference(path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """transformers' float32 model of a GGUF, read by transformers itself (its own
    dequantization and modelling code), in eval mode. torch runs on one thread: on a busy
    2-core machine its OpenMP barriers stall whenever the other core is taken."""
    import torch
    import transformers

    torch.set_num_threads(1)
    directory, name = os.path.split(os.fspath(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, **kwargs
    )
    return model.eval()


def load_json(path: Path) -> dict[str, Any]:
    """A recorded reference run (e.g. llama-perplexity's); the test skips when it is missing."""
    import pytest

    if not path.exists():
        pytest.skip(f"{path.name} (a recorded reference run) is missing")
    return dict(json.loads(path.read_text(encoding="utf-8")))
