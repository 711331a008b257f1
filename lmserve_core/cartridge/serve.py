"""Serving a KV prefix: every cache starts with the same ``p`` rows no token produced.

:class:`PrefixedModel` wraps a kit model (``NativeForwardModel``): its caches
(:class:`PrefixedCache`) hold the prefix in rows ``[0, p)`` and count positions from ``p``,
so everything above them (the slot pool, prefix copies, ``cached_tokens``, the disk tier,
batching, speculative decoding) sees an ordinary cache whose position 0 is the first
request token. A truncate, copy, snapshot or restore of ``n`` positions is one of ``p + n``
rows; a cut back to 0 keeps the prefix, so no rewind reaches into it.

Which models can serve one: a kit model whose class says so (``serves_prefix_rows``: plain
attention rows, the same keys a prompt would leave there) and whose layers keep no
recurrent state; the cartridge's geometry is checked layer by layer against the cache's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

from ..model import CacheKind
from .file import Cartridge, CartridgeError, check_geometry, read_cartridge

log = structlog.get_logger("lmserve.cartridge")


class PrefixRows:
    """The rows a prefix writes into every cache: per layer, K and V ``(p, kv_dim)`` f32.

    Several cartridges compose by concatenation (:meth:`composed`): each keeps the rows it
    was made with (keys rotated at its own positions 0..p_i-1), one after the other, as the
    reference design composes a fleet's documents."""

    def __init__(self, cartridge: Cartridge, source: str = "cartridge") -> None:
        self.cartridge = cartridge
        self.source = source
        self.p = cartridge.p
        self.k = [np.ascontiguousarray(k.reshape(k.shape[0], -1)) for k in cartridge.k]
        self.v = [np.ascontiguousarray(v.reshape(v.shape[0], -1)) for v in cartridge.v]
        h = hashlib.sha256(f"{self.p}:".encode())
        for k, v in zip(self.k, self.v, strict=True):
            h.update(k.tobytes())
            h.update(v.tobytes())
        self.digest = h.hexdigest()

    @classmethod
    def composed(cls, cartridges: Sequence[Cartridge], source: str = "composed") -> PrefixRows:
        """One prefix of ``cartridges`` in order (the same geometry each)."""
        if not cartridges:
            raise CartridgeError("nothing to compose")
        first = cartridges[0]
        for c in cartridges[1:]:
            if c.n_kv_heads != first.n_kv_heads or c.head_dim != first.head_dim:
                raise CartridgeError("cartridges of different geometry do not compose")
        joined = Cartridge(
            k=[np.concatenate([c.k[i] for c in cartridges]) for i in range(first.n_layer)],
            v=[np.concatenate([c.v[i] for c in cartridges]) for i in range(first.n_layer)],
            metadata={"composed": str(len(cartridges))},
            frozen_prefix=first.frozen_prefix,
        )
        return cls(joined, source)

    def record(self) -> dict[str, Any]:
        """What the disk tier's files say about the prefix under their rows (a file is
        restored only under the same prefix: the same rows, wherever the file came from)."""
        return {
            "rows": self.p,
            "n_kv_heads": self.cartridge.n_kv_heads,
            "head_dim": self.cartridge.head_dim,
            "sha256": self.digest,
        }

    def write(self, native: Any) -> None:
        """Rows ``[0, p)`` of every layer of a kit cache (``lmserve_core.native.cache.Cache``)."""
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            native.write(layer, 0, k, v)


class PrefixedCache:
    """A kit cache behind a prefix: position ``i`` is row ``p + i``."""

    def __init__(self, inner: Any, prefix: PrefixRows) -> None:
        self.inner = inner
        self._rings = any(inner.native.rings)
        self._behind(prefix)
        prefix.write(inner.native)

    def _behind(self, prefix: PrefixRows) -> None:
        self.prefix = prefix
        self.n_ctx = int(self.inner.n_ctx) - prefix.p  # positions after the prefix

    @property
    def kind(self) -> CacheKind:
        return self.inner.kind  # type: ignore[no-any-return]

    @property
    def native(self) -> Any:
        return self.inner.native

    def reusable_prefix(self, held: int, wanted: int) -> int:
        p = self.prefix.p
        return max(int(self.inner.reusable_prefix(held + p, wanted + p)) - p, 0)

    def truncate(self, n: int) -> None:
        p = self.prefix.p
        self.inner.truncate(n + p)
        if n == 0 and self._rings:
            # a ring may have written over the prefix's rows since: back to the start
            self.prefix.write(self.inner.native)

    def snapshot(self, n: int) -> Any:
        """The rows of the prefix and of positions [0, n)."""
        return self.inner.snapshot(n + self.prefix.p)

    def restore(self, n: int, state: Any) -> None:
        """Load what :meth:`snapshot` saved: the prefix comes from the state too."""
        try:
            self.inner.restore(n + self.prefix.p, state)
        except BaseException:
            self.prefix.write(self.inner.native)  # whatever a refused state left there
            raise

    def stand_behind(self, prefix: PrefixRows) -> None:
        """Put ``prefix`` under this cache instead (a fleet's per-conversation choice): its
        rows written, and every position after it forgotten (the caller's slot holds
        none)."""
        if prefix.p >= int(self.inner.n_ctx):
            raise CartridgeError(f"a prefix of {prefix.p} rows does not fit {self.inner.n_ctx}")
        self.inner.truncate(0)
        self._behind(prefix)
        prefix.write(self.inner.native)

    def close(self) -> None:
        self.inner.close()


class PrefixedModel:
    """A ``ForwardModel`` whose caches start with a prefix (``prefix`` unless
    :meth:`new_cache` is given another); everything else is the wrapped model's (its
    attributes read through). Positions are counted from each cache's own prefix, so caches
    behind different prefixes share one model."""

    def __init__(self, model: Any, prefix: PrefixRows) -> None:
        self.model = model
        self.prefix = prefix

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def kv_bytes(self, n_ctx: int) -> int:
        return int(self.model.kv_bytes(n_ctx + self.prefix.p))

    def new_cache(
        self, n_ctx: int, kv_type: str | None = None, *, prefix: PrefixRows | None = None
    ) -> Any:
        """A cache of ``n_ctx`` positions after the prefix (``p + n_ctx`` rows)."""
        prefix = prefix or self.prefix
        return PrefixedCache(self.model.new_cache(n_ctx + prefix.p, kv_type), prefix)

    def forward(
        self, cache: Any, tokens: Sequence[int], pos: int, *, all_logits: bool = False
    ) -> np.ndarray:
        inner, p = _inner(cache)
        return self.model.forward(inner, tokens, pos + p, all_logits=all_logits)  # type: ignore[no-any-return]

    def forward_batch(self, rows: Sequence[tuple[Any, Sequence[int], int]]) -> list[np.ndarray]:
        moved = []
        for cache, tokens, pos in rows:
            inner, p = _inner(cache)
            moved.append((inner, tokens, pos + p))
        return self.model.forward_batch(moved)  # type: ignore[no-any-return]

    def forward_traced(self, cache: Any, tokens: Sequence[int], pos: int) -> Any:
        inner, p = _inner(cache)
        return self.model.forward_traced(inner, tokens, pos + p)

    def forward_bidirectional(self, cache: Any, tokens: Sequence[int], pos: int) -> np.ndarray:
        raise ValueError("a prefixed model has no bidirectional pass")

    def copy_rows(self, src: Any, dst: Any, n: int) -> None:
        """Positions ``[0, n)`` and the prefix under them (``dst`` then stands behind
        ``src``'s prefix)."""
        inner, p = _inner(src)
        self.model.copy_rows(inner, _inner(dst)[0], n + p)
        dst._behind(src.prefix)


def _inner(cache: Any) -> tuple[Any, int]:
    if not isinstance(cache, PrefixedCache):
        raise ValueError("the cache was not made by a prefixed model")
    return cache.inner, cache.prefix.p


def cartridge_geometry(model: Any, *, what: str = "the model") -> tuple[list[int], list[int]]:
    """The per-layer ``(n_kv_heads, head_dim)`` a cartridge of ``model`` has; a
    :class:`CartridgeError` when the model cannot hold one (not a kit model of plain
    attention rows)."""
    if not getattr(type(model), "serves_prefix_rows", False):
        raise CartridgeError(
            f"{what} cannot serve a cartridge: its family ({type(model).__name__}) does not "
            "keep plain attention rows a prefix can stand for"
        )
    layers = list(model.cache_layers or [])
    for i, (heads, dim_k, dim_v, _ring, state) in enumerate(layers):
        if state or not heads:
            raise CartridgeError(f"{what} cannot serve a cartridge: layer {i} is recurrent")
        if dim_k != dim_v:
            raise CartridgeError(
                f"{what} cannot serve a cartridge: layer {i} has keys of {dim_k} and values "
                f"of {dim_v} per head"
            )
    return [layer[0] for layer in layers], [layer[1] for layer in layers]


def prefixed(
    model: Any, cartridge: Cartridge, *, source: str = "cartridge", what: str = "the model"
) -> PrefixedModel:
    """``model`` serving ``cartridge`` behind every conversation, once its geometry is
    checked (:class:`CartridgeError` naming the layer and shape that do not fit)."""
    heads, dims = cartridge_geometry(model, what=what)
    check_geometry(cartridge, heads, dims, source=source, model=what)
    return PrefixedModel(model, PrefixRows(cartridge, source))


def prefixed_model(model: Any, cartridge: str | Cartridge, gguf: Any, model_id: str) -> PrefixedModel:
    """The chat path's ``--cartridge``: ``cartridge`` (a file, or one already read) checked
    against ``model`` and served behind every conversation. A cartridge made from another
    model of the same geometry serves with a warning (its rows may mean nothing to this one)."""
    cart = cartridge if isinstance(cartridge, Cartridge) else read_cartridge(cartridge)
    source = cart.path or "cartridge"
    wrapped = prefixed(model, cart, source=source, what=model_id)
    mine = {"architecture": gguf.architecture, "model_id": gguf.model_id}
    for key, value in mine.items():
        made_for = cart.metadata.get(key)
        if made_for and value and made_for != value:
            log.warning("cartridge_other_model", key=key, cartridge=made_for, model=value,
                        source=source)
    log.info("cartridge", source=source, rows=cart.p, layers=cart.n_layer,
             init=cart.metadata.get("init"), bytes=cart.nbytes, sha256=wrapped.prefix.digest[:16])
    return wrapped
