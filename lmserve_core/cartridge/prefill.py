"""The prefill initialisation of a cartridge: the model's own K/V rows for a document's
first ``p`` tokens (the paper's best start; served untrained, it equals the document read as
the prompt's beginning)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .file import Cartridge, CartridgeError
from .serve import cartridge_geometry


def capture_rows(
    model: Any, tokens: Sequence[int], kv_type: str | None = None
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Run ``tokens`` at positions 0.. on a fresh cache of ``model`` (a kit model; its KV
    type unless ``kv_type``) and read every layer's rows back as ``[p, n_kv_heads,
    head_dim]`` float32: keys after the k-norm and RoPE, exactly as a prompt leaves them. The
    KV type matters: later layers read the earlier rows as the cache stores them, so rows
    read from an f16 cache are the ones a server with an f16 cache computes. A
    sliding-window layer keeps only its last rows; the ones it dropped (no later position
    sees them) are zeros."""
    heads, dims = cartridge_geometry(model)
    p = len(tokens)
    if p < 1:
        raise CartridgeError("a cartridge needs at least one token")
    cache = model.new_cache(p, kv_type)
    try:
        model.forward(cache, list(tokens), 0)
        native = cache.native
        ks, vs = [], []
        for layer, (h, d) in enumerate(zip(heads, dims, strict=True)):
            ring = native.rings[layer]
            n = min(p, ring) if ring else p
            k = np.zeros((p, h * d), np.float32)
            v = np.zeros((p, h * d), np.float32)
            k[p - n :], v[p - n :] = native.read(layer, p - n, n)
            ks.append(k.reshape(p, h, d))
            vs.append(v.reshape(p, h, d))
    finally:
        cache.close()
    return ks, vs


def document_tokens(tokenizer: Any, text: str) -> list[int]:
    """A document as a cartridge reads it: its text as text (control-token spellings in it
    are not control tokens), after the vocabulary's BOS when it adds one (the sink row)."""
    return list(tokenizer.encode(text, add_special=True, parse_special=False))


def prefill_cartridge(
    model: Any,
    tokenizer: Any,
    text: str,
    p: int,
    metadata: Mapping[str, str] | None = None,
) -> Cartridge:
    """The cartridge of a document's first ``p`` tokens (:func:`document_tokens`); its
    ``draft_reference`` holds those tokens."""
    tokens = document_tokens(tokenizer, text)
    if p < 2:
        raise CartridgeError(f"p must be at least 2 (a sink row and one more), got {p}")
    if len(tokens) < p:
        raise CartridgeError(f"the document has {len(tokens)} tokens, fewer than p = {p}")
    tokens = tokens[:p]
    k, v = capture_rows(model, tokens)
    meta = dict(metadata or {})
    meta["init"] = "prefill"
    return Cartridge(k=k, v=v, metadata=meta, draft_reference=np.asarray(tokens, np.int64))


def model_metadata(gguf: Any) -> dict[str, str]:
    """What a cartridge records of the model it was made with."""
    meta = {"architecture": str(gguf.architecture), "model": Path(gguf.path).name}
    if gguf.model_id:
        meta["model_id"] = str(gguf.model_id)
    return meta
