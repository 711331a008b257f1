"""Fleets: one cartridge per document and an index that picks them per conversation.

A fleet directory holds ``fleet.json`` (the manifest), ``doc-NNN.safetensors`` (one
cartridge per document, in the manifest's order) and ``index.safetensors``, the retrieval
index: ``embeddings`` float32 ``[n_chunks, dim]``, ``centroid`` float32 ``[dim]`` and
``chunk_doc`` int64 ``[n_chunks]``.

The embedding is the model's own: a chunk's tokens (``embed_chunk`` of them, 256 by
default), then the tokens of :data:`EMBED_SUFFIX` (encoded apart and appended), through the
model; the final-norm hidden state of the last token is the vector. Rows are L2-normalised,
then centred (the mean of the unit rows, kept as ``centroid``, is subtracted and the rows
normalised again: raw last-token states share one dominant direction that would drown the
differences between documents). A query is embedded the same way from its text, normalised,
centred with the same centroid and normalised again; the score of a document is its best
chunk's cosine. This module needs numpy only: the serving side embeds queries with its own
forward pass (:func:`embed_tokens` gives the token ids) and calls :meth:`FleetIndex.top_docs`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FLEET_FORMAT = "lmserve-fleet/1"
MANIFEST = "fleet.json"
INDEX = "index.safetensors"
EMBED_SUFFIX = "\nIn one word, the main topic of the text above is:"
EMBED_CHUNK = 256
MIN_TAIL = 32  # a document's last chunk is indexed when it has this many tokens (or is its only one)
DOC_SUFFIXES = (".md", ".txt")


class FleetError(ValueError):
    """A fleet directory that is missing a file or holds one that does not fit."""


def doc_file(i: int) -> str:
    return f"doc-{i:03d}.safetensors"


def _unit(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, np.float32)
    norm = np.linalg.norm(v, axis=-1, keepdims=True)
    return np.where(norm > 0, v / np.where(norm > 0, norm, 1), v).astype(np.float32)


def embed_tokens(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """The token ids whose last hidden state embeds ``ids``: BOS when the vocabulary adds
    one, the ids, then :data:`EMBED_SUFFIX` encoded on its own."""
    bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None else []
    return bos + list(ids) + list(tokenizer.encode(EMBED_SUFFIX, add_special=False))


def query_text(messages: Sequence[dict[str, Any]]) -> str:
    """The text a conversation is retrieved by: its user messages, one per line."""
    parts = []
    for m in messages:
        if m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = " ".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
        parts.append(str(content or ""))
    return "\n".join(parts)


def chunks(ids: Sequence[int], size: int = EMBED_CHUNK) -> list[list[int]]:
    """A document's index chunks: consecutive spans of ``size`` tokens, the last one kept
    when it has :data:`MIN_TAIL` tokens or is the only one."""
    out = [list(ids[at : at + size]) for at in range(0, len(ids), size)]
    if len(out) > 1 and len(out[-1]) < MIN_TAIL:
        out.pop()
    return [c for c in out if c]


@dataclass
class FleetIndex:
    """Centred, normalised chunk embeddings and the document of each chunk."""

    embeddings: np.ndarray
    centroid: np.ndarray
    chunk_doc: np.ndarray

    @classmethod
    def build(cls, vectors: Sequence[np.ndarray], docs: Sequence[int]) -> FleetIndex:
        if not vectors or len(vectors) != len(docs):
            raise FleetError(f"{len(vectors)} chunk vectors for {len(docs)} chunk documents")
        rows = _unit(np.stack([np.asarray(v, np.float32) for v in vectors]))
        centroid = rows.mean(axis=0).astype(np.float32)
        return cls(_unit(rows - centroid), centroid, np.asarray(docs, np.int64))

    @property
    def dim(self) -> int:
        return int(self.embeddings.shape[1])

    def center(self, query: np.ndarray) -> np.ndarray:
        q = np.asarray(query, np.float32).reshape(-1)
        if q.shape[0] != self.dim:
            raise FleetError(f"a query of {q.shape[0]} dimensions for an index of {self.dim}")
        return _unit(_unit(q) - self.centroid)

    def doc_scores(self, query: np.ndarray, n_docs: int | None = None) -> np.ndarray:
        """Each document's best-chunk cosine with ``query`` (-1 for a document without
        chunks)."""
        sims = self.embeddings @ self.center(query)
        n = int(self.chunk_doc.max()) + 1 if n_docs is None else n_docs
        best = np.full(n, -1.0, np.float32)
        np.maximum.at(best, self.chunk_doc, sims)
        return best

    def top_docs(self, query: np.ndarray, k: int = 1, k_chunks: int = 8) -> list[tuple[int, float]]:
        """The documents of the ``k_chunks`` best chunks, best first, at most ``k`` of them,
        with their best-chunk cosine."""
        sims = self.embeddings @ self.center(query)
        order = np.argsort(-sims, kind="stable")[: max(1, k_chunks)]
        hits: list[tuple[int, float]] = []
        for c in order:
            doc = int(self.chunk_doc[c])
            if all(doc != d for d, _ in hits):
                hits.append((doc, float(sims[c])))
            if len(hits) == k:
                break
        return hits

    def save(self, path: str | os.PathLike[str]) -> None:
        from safetensors.numpy import save_file

        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            save_file(
                {
                    "embeddings": np.ascontiguousarray(self.embeddings, np.float32),
                    "centroid": np.ascontiguousarray(self.centroid, np.float32),
                    "chunk_doc": np.ascontiguousarray(self.chunk_doc, np.int64),
                },
                str(tmp),
            )
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> FleetIndex:
        from safetensors.numpy import load_file

        try:
            t = load_file(str(path))
        except Exception as e:  # the library's own error types
            raise FleetError(f"{path}: not a safetensors file ({e})") from e
        for name in ("embeddings", "centroid", "chunk_doc"):
            if name not in t:
                raise FleetError(f"{path}: no {name!r} tensor")
        emb, cen, doc = t["embeddings"], t["centroid"], t["chunk_doc"]
        if emb.ndim != 2 or cen.shape != (emb.shape[1],) or doc.shape != (emb.shape[0],):
            raise FleetError(
                f"{path}: embeddings {list(emb.shape)}, centroid {list(cen.shape)} and "
                f"chunk_doc {list(doc.shape)} do not fit together"
            )
        return cls(emb.astype(np.float32), cen.astype(np.float32), doc.astype(np.int64))


@dataclass
class FleetDoc:
    name: str
    cart_file: str
    tokens: int
    init: str


@dataclass
class Fleet:
    """An opened fleet directory: its manifest and index (cartridges are read on demand)."""

    path: Path
    p: int
    docs: list[FleetDoc]
    index: FleetIndex
    embed_chunk: int = EMBED_CHUNK
    embed_suffix: str = EMBED_SUFFIX
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Fleet:
        path = Path(path)
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise FleetError(f"{path}: no {MANIFEST} (not a fleet directory)")
        try:
            m = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as e:
            raise FleetError(f"{manifest_path}: not JSON ({e})") from e
        if m.get("format") != FLEET_FORMAT:
            raise FleetError(f"{manifest_path}: format {m.get('format')!r}, not {FLEET_FORMAT!r}")
        if m.get("embed_suffix", EMBED_SUFFIX) != EMBED_SUFFIX:
            raise FleetError(f"{manifest_path}: built with another embedding suffix")
        docs = [FleetDoc(d["name"], d["cart_file"], int(d["tokens"]), d.get("init", "")) for d in m["docs"]]
        for d in docs:
            if not (path / d.cart_file).is_file():
                raise FleetError(f"{path}: the cartridge of {d.name!r} ({d.cart_file}) is missing")
        index = FleetIndex.load(path / INDEX)
        if index.chunk_doc.size and (index.chunk_doc.min() < 0 or index.chunk_doc.max() >= len(docs)):
            raise FleetError(f"{path / INDEX}: a chunk of a document the manifest does not list")
        extra = {k: v for k, v in m.items() if k not in {"docs", "p", "embed_chunk", "embed_suffix"}}
        return cls(path, int(m["p"]), docs, index, int(m.get("embed_chunk", EMBED_CHUNK)), EMBED_SUFFIX, extra)

    def cartridge_path(self, doc: int) -> Path:
        return self.path / self.docs[doc].cart_file

    def select(
        self,
        embed: Callable[[list[int]], np.ndarray],
        tokenizer: Any,
        text: str,
        k: int = 1,
        k_chunks: int = 8,
    ) -> list[tuple[int, float]]:
        """The ``k`` documents for a conversation whose user messages are ``text``:
        ``embed`` maps token ids to the model's final-norm last hidden state."""
        ids = embed_tokens(tokenizer, tokenizer.encode(text, add_special=False))
        return self.index.top_docs(embed(ids), k, k_chunks)
