"""The caches of a family's native forward pass: :class:`NativeCache` (attention rows, and
sliding windows) and :class:`RecurrentCache` (recurrent states with the checkpoints it keeps
to resume from), over the core's ``lm_cache``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from lmserve_core.model import ATTENTION, AttentionCache, CacheKind
from lmserve_core.native import cache as native_cache

if TYPE_CHECKING:
    from .forward import NativeForwardModel

SLIDING = CacheKind(name="sliding")
# A cache with recurrent layers: their state stands for every position written and cannot be
# cut back, so the cache resumes only from its end or from a checkpoint it kept.
RECURRENT = CacheKind(name="recurrent", truncate=False)

# Checkpoints of the recurrent state a cache keeps at most (each is the states' bytes: the
# RAM guard prices them, ``kv_bytes``), and the spacing of the evenly spaced ones in a long
# prompt.
MAX_CHECKPOINTS = 8
CHECKPOINT_EVERY = 1024
# Checkpoints this many positions before the end of a prompt: a chat's next turn renders
# the previous turn's opener again, but not always what followed it (a think block the
# template drops from history), so the next prompt usually leaves the old one a few tokens
# before its end; the same prompt again (another choice, a retry) reuses all of it but the
# token whose logits it needs.
CHECKPOINTS_BEFORE_END = (4, 1)


class NativeCache(AttentionCache):
    """A KV cache of one model: attention rows, f16 or f32, committed lazily.

    Sliding-window layers may keep a ring of rows (the geometry's ``ring``): the cache is then
    of kind ``sliding``, and a prefix can be continued from only while the ring still holds
    the keys its next chunk sees (see :meth:`reusable_prefix`).
    """

    def __init__(self, model: NativeForwardModel, n_ctx: int, kv_type: str) -> None:
        self.model = model  # the cache's geometry belongs to this model
        self.native = native_cache.Cache(model.cache_layers, n_ctx, kv_type, n_layer=model.n_layer)
        self.n_ctx = n_ctx
        self.kv_type = kv_type
        rings = [r for r in self.native.rings if r > 0]
        # A ring of R rows serves a window of at most R - n_batch (the chunk is written
        # before it is attended): the smallest ring bounds what the cache can reuse.
        self._ring = min(rings, default=0)
        self._batch = model.n_batch

    @property
    def kind(self) -> CacheKind:  # type: ignore[override]
        return SLIDING if self._ring else ATTENTION

    def reusable_prefix(self, held: int, wanted: int) -> int:
        """Any prefix of a cache without rings; with rings, ``wanted`` while every ring
        still holds the window before it (the positions since ``held - ring`` are
        resident), else nothing."""
        n = min(held, wanted)
        ring = self._ring
        if ring == 0 or held <= ring:
            return n
        # query n needs keys from n - window + 1 >= n - (ring - n_batch) + 1
        return n if n - (ring - self._batch) + 1 >= held - ring else 0

    def snapshot(self, n: int) -> npt.NDArray[np.uint8]:
        """The state of positions [0, n) as bytes."""
        return self.native.state(n)

    def restore(self, n: int, state: npt.ArrayLike) -> None:
        """Load positions [0, n) from :meth:`snapshot`'s bytes."""
        self.native.load(n, state)

    def close(self) -> None:
        """Release the memory now instead of at garbage collection."""
        self.native.close()


class RecurrentCache(NativeCache):
    """A cache with recurrent layers (and maybe attention layers): kind ``recurrent``.

    ``pos`` is the number of positions written: the recurrent state stands for all of them,
    so the next forward continues at ``pos``. A state cannot be cut back, so the cache keeps
    checkpoints (the states' bytes at chosen positions: :meth:`plan` marks them before a
    prompt is read, and the forward pass stops there to take them) and can continue from
    ``pos`` or from any checkpoint; attention rows keep any prefix. Checkpoints where other
    prompts may share the prefix (``plan``'s ``shared``: a system prompt's end) are the last
    to give way when there are too many.
    """

    def __init__(self, model: NativeForwardModel, n_ctx: int, kv_type: str) -> None:
        super().__init__(model, n_ctx, kv_type)
        self.pos = 0
        self.checkpoints: dict[int, npt.NDArray[np.uint8]] = {}  # position: states' bytes
        self.planned: set[int] = set()  # positions to take a checkpoint at when reached
        self.shared: set[int] = set()  # positions other prompts may share the prefix up to
        self._mark: tuple[int, npt.NDArray[np.uint8]] | None = None

    @property
    def kind(self) -> CacheKind:  # type: ignore[override]
        return RECURRENT

    def reusable_prefix(self, held: int, wanted: int) -> int:
        """``held`` (its end) when ``wanted`` reaches it, else the latest checkpoint at or
        before ``wanted``; 0 when there is none."""
        if held != self.pos:
            return 0
        if wanted >= held:
            return held
        return max((p for p in self.checkpoints if p <= wanted), default=0)

    def truncate(self, n: int) -> None:
        """Go back to position ``n``: 0, the end, or a checkpoint (loaded)."""
        if n == self.pos:
            return
        if n == 0:
            self.pos = 0  # the forward pass at position 0 starts from a zero state
            self.checkpoints.clear()
            self.shared.clear()
            return
        state = self.checkpoints.get(n)
        if state is None:
            raise ValueError(f"a recurrent cache cannot go back to position {n}: no checkpoint")
        self.native.load_recurrent(state)
        self.pos = n
        self.checkpoints = {p: s for p, s in self.checkpoints.items() if p <= n}

    def plan(self, end: int, shared: Iterable[int] = ()) -> None:
        """Mark the checkpoints to take while a prompt of ``end`` positions is read from
        ``pos``: 4 and 1 positions before its end, every ``CHECKPOINT_EVERY`` positions of a
        long one, and at ``shared``, where other prompts may leave this one (the end of its
        system prompt, of its earlier messages). (Its end needs none: the state is there
        when the reply starts.)"""
        shared = {p for p in shared if self.pos < p < end}
        marks = set(range(CHECKPOINT_EVERY, end, CHECKPOINT_EVERY))
        marks |= {end - k for k in CHECKPOINTS_BEFORE_END}
        self.planned = {p for p in marks | shared if self.pos < p <= end}
        self.shared = {p for p in self.shared if p <= self.pos} | shared

    def stops(self, pos: int, n: int) -> list[int]:
        """Where a forward of ``n`` tokens from ``pos`` must stop for a checkpoint."""
        return sorted(p for p in self.planned if pos < p < pos + n)

    def wrote(self, end: int, state: Any = None) -> None:
        """Positions up to ``end`` are written; take its checkpoint when one is planned
        (``state``: the state at ``end`` kept during a pass that went further)."""
        self.pos = end
        if end in self.planned:
            self.planned.discard(end)
            self.checkpoints[end] = self.native.recurrent_state() if state is None else state
            while len(self.checkpoints) > MAX_CHECKPOINTS:
                del self.checkpoints[min(self.checkpoints, key=self._keep_rank)]

    def _keep_rank(self, p: int) -> tuple[int, int]:
        """What losing checkpoint ``p`` costs, least first: the earliest ordinary ones, then
        shared prefixes, and last the earliest of those (the prefix most prompts share)."""
        shared = p in self.shared
        first = shared and p == min(self.shared & self.checkpoints.keys())
        return int(shared) + int(first), p

    def mark(self) -> None:
        """Remember the present state (:meth:`rewind` returns to it): before a verify pass
        whose rows may not all be kept."""
        self._mark = (self.pos, self.native.recurrent_state())

    def rewind(self) -> int:
        """Return to the state :meth:`mark` remembered; its position."""
        assert self._mark is not None
        self.pos, state = self._mark
        self.native.load_recurrent(state)
        self._mark = None
        self.checkpoints = {p: s for p, s in self.checkpoints.items() if p <= self.pos}
        return self.pos

    def adopt_from(self, src: RecurrentCache, n: int) -> None:
        """After the rows [0, n) were copied from ``src``: its state at ``n`` too."""
        if n == src.pos:
            src.native.copy_recurrent_to(self.native)
        else:
            self.native.load_recurrent(src.checkpoints[n])
        self.pos = n
        self.checkpoints = {p: s for p, s in src.checkpoints.items() if p <= n}
        self.shared = {p for p in src.shared if p <= n}

    def snapshot(self, n: int) -> npt.NDArray[np.uint8]:
        """The state of positions [0, n) (n == ``pos``) and the checkpoints before it, as
        bytes: the rows and states, then each checkpoint's states, then their positions and
        how many there are (int64)."""
        if n != self.pos:
            raise ValueError(f"a recurrent cache at {self.pos} has no state for {n}")
        marks = sorted(p for p in self.checkpoints if p < n)
        tail = np.array([*marks, len(marks)], np.int64).view(np.uint8)
        return np.concatenate([self.native.state(n), *(self.checkpoints[p] for p in marks), tail])

    def restore(self, n: int, state: npt.ArrayLike) -> None:
        """Load what :meth:`snapshot` saved."""
        raw = np.frombuffer(np.asarray(state, np.uint8).tobytes(), np.uint8)
        size = self.native.recurrent_bytes
        if raw.size < 8:
            raise ValueError("a recurrent cache state too short")
        k = int(raw[-8:].view(np.int64)[0])
        body = raw.size - 8 * (k + 1) - k * size
        if k < 0 or k > MAX_CHECKPOINTS or body < 0:
            raise ValueError("a recurrent cache state of another layout")
        marks = raw[body + k * size : raw.size - 8].view(np.int64).tolist()
        if any(not 0 < p < n for p in marks):
            raise ValueError("a recurrent cache state with checkpoints out of place")
        self.native.load(n, raw[:body])
        self.pos = n
        self.checkpoints = {
            p: raw[body + i * size : body + (i + 1) * size].copy() for i, p in enumerate(marks)
        }
        self.planned = set()
        self.shared = set()
