"""Serving a fleet (``--fleet DIR``): each conversation behind the cartridges of the
documents its user messages are about.

A conversation's selection is made once: its user messages are embedded by the model
itself (``NativeForwardModel.embed``, the final-norm hidden state of the last token, the
vector the fleet's index was built with), the index picks ``docs`` documents and their
cartridges, composed in the order picked, become the prefix its cache stands behind
(``PrefixRows.composed``). The selection is sticky: a conversation is known by its first
user message, and a later turn of it keeps the documents it started with, so its slot and
``cached_tokens`` carry over (re-retrieving every turn would wander between runner-up
documents and throw the cache away). With ``adaptive``, a follow-up turn is retrieved again
over all its user messages and the conversation moves only when a document outside its
selection beats every selected one's best chunk by ``margin``; the move puts the
conversation behind another prefix, so that turn reads its whole prompt again.

One :class:`PrefixRows` stands for each selection while any cache stands behind it (the
slot pool lends rows only between caches behind the very same object); parsed cartridges
sit in a small LRU, and rows are copied into each cache, so dropping one from the LRU
never touches a conversation.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from .file import Cartridge, CartridgeError, check_geometry, read_cartridge
from .fleet import Fleet, embed_tokens, query_text
from .serve import PrefixedModel, PrefixRows, cartridge_geometry

log = structlog.get_logger("lmserve.fleet")

CARTRIDGES_KEPT = 8  # parsed cartridges the LRU keeps
CONVERSATIONS_KEPT = 1024  # conversations whose selection is remembered
RECENT_PREFIXES = 4  # composed prefixes kept alive beyond those caches stand behind


@dataclass(frozen=True)
class Selection:
    """The documents a turn is served behind and how they were chosen: ``retrieved``
    (a conversation nobody remembers), ``kept`` (a follow-up, sticky), ``stayed`` (a
    follow-up re-retrieved under ``adaptive`` that did not move) or ``switched``."""

    docs: tuple[int, ...]
    scores: tuple[float, ...]
    how: str
    prefix: PrefixRows


class FleetRouter:
    """A fleet served by one kit model: retrieval, stickiness and the prefixes."""

    def __init__(
        self,
        fleet: Fleet,
        model: Any,
        tokenizer: Any,
        *,
        docs: int = 1,
        chunks: int = 8,
        adaptive: bool = False,
        margin: float = 0.05,
        what: str = "the model",
    ) -> None:
        if docs < 1 or chunks < 1 or margin < 0:
            raise ValueError("docs and chunks must be at least 1 and margin not negative")
        self.heads, self.dims = cartridge_geometry(model, what=what)
        self.fleet = fleet
        self.model = model
        self.tokenizer = tokenizer
        self.what = what
        self.k = min(docs, len(fleet.docs))
        self.chunks = chunks
        self.adaptive = adaptive
        self.margin = margin
        self._cartridges: OrderedDict[int, Cartridge] = OrderedDict()
        self._prefixes: weakref.WeakValueDictionary[tuple[int, ...], PrefixRows] = (
            weakref.WeakValueDictionary()
        )
        self._recent: OrderedDict[tuple[int, ...], PrefixRows] = OrderedDict()
        self._conversations: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        dim = int(getattr(model, "n_embd", 0) or 0) or self._embed_dim()
        if dim != fleet.index.dim:
            raise CartridgeError(
                f"{fleet.path}: an index of {fleet.index.dim}-dimensional vectors for a model "
                f"of {dim} (the fleet was built with another model)"
            )
        # every selection has k documents of p rows: the caches are sized for the first k
        self.default = self.prefix(tuple(range(self.k)))
        self.rows = self.default.p

    def _embed_dim(self) -> int:
        return int(self.model.embed([0]).shape[0])

    # ------------------------------------------------------------------ prefixes

    def cartridge(self, doc: int) -> Cartridge:
        """Document ``doc``'s cartridge, parsed and checked (the LRU's, when it has it)."""
        cart = self._cartridges.get(doc)
        if cart is not None:
            self._cartridges.move_to_end(doc)
            return cart
        path = self.fleet.cartridge_path(doc)
        cart = read_cartridge(path)
        check_geometry(cart, self.heads, self.dims, source=str(path), model=self.what)
        if cart.p != self.fleet.p:
            raise CartridgeError(f"{path}: {cart.p} rows, the fleet's cartridges have {self.fleet.p}")
        self._cartridges[doc] = cart
        while len(self._cartridges) > CARTRIDGES_KEPT:
            self._cartridges.popitem(last=False)
        return cart

    def prefix(self, docs: tuple[int, ...]) -> PrefixRows:
        """The one prefix of ``docs`` (composed in that order) while anything holds it."""
        rows = self._prefixes.get(docs)
        if rows is None:
            names = "+".join(self.fleet.docs[d].name for d in docs)
            rows = PrefixRows.composed([self.cartridge(d) for d in docs], source=f"fleet:{names}")
            self._prefixes[docs] = rows
        self._recent[docs] = rows
        self._recent.move_to_end(docs)
        while len(self._recent) > RECENT_PREFIXES:
            self._recent.popitem(last=False)
        return rows

    def wrap(self, model: Any) -> PrefixedModel:
        """``model`` with caches of ``rows`` prefix rows beyond each context."""
        return PrefixedModel(model, self.default)

    # ------------------------------------------------------------------ retrieval

    def embed(self, text: str) -> np.ndarray:
        """``text``'s query vector: its last ``embed_chunk`` tokens and the suffix."""
        ids = self.tokenizer.encode(text, add_special=False)[-self.fleet.embed_chunk :]
        return np.asarray(self.model.embed(embed_tokens(self.tokenizer, ids)), np.float32)

    def select(self, messages: Sequence[Any], prompt: str | None = None) -> Selection:
        """The documents a request is served behind (a chat's ``messages``, or a raw
        ``prompt``, which is retrieved by its text every time)."""
        if prompt is not None:
            return self._retrieve(prompt, "retrieved")
        turns = [{"role": m.role, "content": m.content} for m in messages]
        users = [t for t in turns if t["role"] == "user"]
        if not users:  # retrieved by whatever the turns say
            return self._retrieve("\n".join(str(t["content"]) for t in turns) or " ", "retrieved")
        key = hashlib.sha256(str(users[0]["content"]).encode()).hexdigest()
        known = self._conversations.get(key)
        text = query_text(turns)
        if known is None:
            chosen = self._retrieve(text, "retrieved")
        elif self.adaptive and len(users) > 1:
            chosen = self._reconsider(known, text)
        else:
            chosen = Selection(known, (), "kept", self.prefix(known))
        self._conversations[key] = chosen.docs
        self._conversations.move_to_end(key)
        while len(self._conversations) > CONVERSATIONS_KEPT:
            self._conversations.popitem(last=False)
        return chosen

    def _retrieve(self, text: str, how: str) -> Selection:
        hits = self.fleet.index.top_docs(self.embed(text), self.k, self.chunks)
        docs = self._fill(tuple(d for d, _ in hits))
        scores = tuple(s for _, s in hits)
        return Selection(docs, scores, how, self.prefix(docs))

    def _fill(self, docs: tuple[int, ...]) -> tuple[int, ...]:
        """``k`` documents: those the scanned chunks named, then the rest in order (every
        prefix has the same rows, so every conversation fits the same cache)."""
        rest = [d for d in range(len(self.fleet.docs)) if d not in docs]
        return docs + tuple(rest[: self.k - len(docs)])

    def _reconsider(self, known: tuple[int, ...], text: str) -> Selection:
        scores = self.fleet.index.doc_scores(self.embed(text), len(self.fleet.docs))
        held = max(float(scores[d]) for d in known)
        outside = [d for d in range(len(scores)) if d not in known]
        best = max(outside, key=lambda d: float(scores[d]), default=None)
        if best is not None and float(scores[best]) > held + self.margin:
            order = [int(d) for d in np.argsort(-scores, kind="stable")[: self.k]]
            docs = self._fill(tuple(order))
            return Selection(docs, tuple(float(scores[d]) for d in docs), "switched",
                             self.prefix(docs))
        return Selection(known, tuple(float(scores[d]) for d in known), "stayed",
                         self.prefix(known))

    def names(self, docs: Sequence[int]) -> list[str]:
        return [self.fleet.docs[d].name for d in docs]
