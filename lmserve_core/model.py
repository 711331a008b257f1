"""What a model family supplies to the generic GGUF chat path (``lmserve_core.gguf_chat``).

A family provides a ``ForwardModel`` (its forward pass over a KV cache, usually native
code) and ``FamilyConventions`` (stop tokens, think markers, tool style, sampling
defaults, a fallback chat template). The generic path does the rest: tokenize, KV slot
reuse, prefill, the decode loop, sampling, stop handling and event emission.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .backend import Capabilities, SamplingDefaults, ThinkMarkers


class KVCache(Protocol):
    """One sequence's KV cache: rows [0, n_ctx) of every layer's keys and values."""

    n_ctx: int


class ForwardModel(Protocol):
    """A family's forward pass."""

    n_vocab: int
    n_ctx_train: int

    def new_cache(self, n_ctx: int) -> KVCache:
        """Allocate an empty cache for ``n_ctx`` positions (pages commit lazily)."""

    def forward(
        self, cache: KVCache, tokens: Sequence[int], pos: int, *, all_logits: bool = False
    ) -> np.ndarray:
        """Run ``tokens`` at positions ``pos..pos+len-1``, writing their K/V rows.

        Returns float32 logits: shape ``(n_vocab,)`` for the last token, or
        ``(len(tokens), n_vocab)`` with ``all_logits``. Rows at ``>= pos`` of the cache
        are overwritten; rows below ``pos`` must already hold the prefix.
        """

    def copy_rows(self, src: KVCache, dst: KVCache, n: int) -> None:
        """Copy cache rows ``[0, n)`` of every layer from ``src`` into ``dst``."""


@dataclass(frozen=True, slots=True)
class FamilyConventions:
    """Per-family behaviour of the generic chat path."""

    capabilities: Capabilities = field(default_factory=Capabilities)
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    think: ThinkMarkers | None = None  # reasoning head markers, if the family has them
    extra_stop_tokens: tuple[str, ...] = ()  # token texts that also end a turn
    fallback_template: str | None = None  # jinja chat template when the GGUF has none
