"""What a model family supplies to the generic GGUF chat path (``lmserve_core.gguf_chat``).

A family provides a ``ForwardModel`` (its forward pass over a cache, usually native code)
and ``FamilyConventions`` (stop tokens, think markers, tool style, sampling defaults, a
fallback chat template). Its caches say what they can do (``KVCache``, ``CacheKind``), so
KV slot reuse works for attention rows, sliding windows and recurrent state alike. The
generic path does the rest: tokenize, KV slot reuse, prefill, the decode loop, sampling,
stop handling and event emission.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np

from .backend import Capabilities, SamplingDefaults, ThinkMarkers

if TYPE_CHECKING:
    from .tools import ToolConvention


@dataclass(frozen=True, slots=True)
class CacheKind:
    """What a family's cache can do besides appending positions.

    Slot reuse asks ``KVCache.reusable_prefix`` how far a cache can be cut back; the flags
    describe the kind as a whole.
    """

    name: str = "attention"
    truncate: bool = True  # can be cut back to any prefix it holds
    copy_prefix: bool = True  # a prefix it can continue from can be copied into another cache
    snapshot: bool = True  # its state for [0, n) can be saved and restored (disk tier)


ATTENTION = CacheKind()


class KVCache(Protocol):
    """One sequence's cache for positions [0, n_ctx): attention rows, a window or a state.

    How many positions it holds is tracked by its slot, which passes it in.
    """

    n_ctx: int

    @property
    def kind(self) -> CacheKind:
        """What this cache can do."""

    def reusable_prefix(self, held: int, wanted: int) -> int:
        """The longest prefix ``m <= min(held, wanted)`` this cache, holding ``held``
        positions, can continue from; 0 when it cannot keep any."""

    def truncate(self, n: int) -> None:
        """Forget positions ``>= n``; ``n`` is 0 or came from :meth:`reusable_prefix`."""


class AttentionCache:
    """``KVCache`` behaviour of plain attention rows, to mix into a native cache class.

    Any prefix can be kept and copied; rows past it are overwritten by the next forward.
    """

    __slots__ = ()
    kind: ClassVar[CacheKind] = ATTENTION

    def reusable_prefix(self, held: int, wanted: int) -> int:
        return min(held, wanted)

    def truncate(self, n: int) -> None:
        pass


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

    # Optional: ``forward_batch(rows) -> list[np.ndarray]`` runs several sequences in one
    # weight pass: ``rows`` of (cache, tokens, pos), each cache distinct, and each row's
    # logits ``(len(tokens), n_vocab)`` for every token; ``n_batch`` bounds its tokens.
    # Without it a batch runs as one ``forward`` per sequence.

    def copy_rows(self, src: KVCache, dst: KVCache, n: int) -> None:
        """Copy positions ``[0, n)`` of every layer from ``src`` into ``dst``.

        Called only when ``src.kind.copy_prefix`` and ``src`` can continue from ``n``.
        """


@dataclass(frozen=True, slots=True)
class FamilyConventions:
    """Per-family behaviour of the generic chat path."""

    capabilities: Capabilities = field(default_factory=Capabilities)
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    think: ThinkMarkers | None = None  # reasoning head markers, if the family has them
    extra_stop_tokens: tuple[str, ...] = ()  # token texts that also end a turn
    fallback_template: str | None = None  # jinja chat template when the GGUF has none
    # The template variable that switches the family's thinking on and off (templates
    # without it ignore it); set from the request's reasoning switch.
    thinking_switch: str | None = None
    # Recommended sampling while the reasoning channel is on (None: ``sampling`` always).
    thinking_sampling: SamplingDefaults | None = None
    # Finishes a chat prompt the template rendered with add_generation_prompt, before it is
    # tokenized (None: as rendered); e.g. opens the model's turn where a template leaves the
    # prompt at a closed turn.
    finish_prompt: Callable[[str], str] | None = None
    # A tool the model calls within its own sequence and that is answered in place (nanochat's
    # calculator): called with the reply's tokens after each sampled token, it returns the
    # tokens to write after it (none: nothing), which join the reply as the model's own and
    # are shown as text. Not called while a grammar governs the reply.
    continuation: Callable[[Sequence[int]], Sequence[int]] | None = None
    # Control tokens whose text stays in the reply's decoded text (llama.cpp's preserved
    # tokens): markers the think markers or the reply's reader must see. Other control tokens
    # are dropped from it.
    shown_tokens: tuple[str, ...] = ()
    # The convention whose parser reads every reply, tools or not: a family that frames its
    # reply's text in markers (None: the reply text is read only for calls, when tools are
    # in play). Its parser gets no tools.
    reply_reader: ToolConvention | None = None

    def sampling_for(self, reasoning: bool) -> SamplingDefaults:
        """The sampling defaults of a request with the reasoning channel on or off."""
        if reasoning and self.thinking_sampling is not None:
            return self.thinking_sampling
        return self.sampling
