"""``POST /v1/embeddings`` (OpenAI's) and ``POST /v1/rerank`` (llama-server's, in the shape
Jina, Cohere and TEI clients read), over :mod:`lmserve_core.embeddings`.

Inputs are tokenized on the preparation threads and run on the engine's worker
(``Engine.call``), through the same bounded queue as generations. See
docs/api-embeddings.md.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any, Literal

import msgspec
import numpy as np
import structlog
from litestar import post
from litestar.params import JSONBody

from ..embeddings import Embedder, Pooled
from ..errors import InvalidRequest
from ..server import Server, ServerDep

log = structlog.get_logger("lmserve.requests")


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    """OpenAI's embeddings request; ``input``: a string, a list of strings, a list of token
    ids or a list of such lists."""

    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class RerankDocument(msgspec.Struct):
    """A document as an object (Jina's and Cohere's v1 clients may send these)."""

    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    """llama-server's rerank request: Jina's and Cohere's ``documents``, or TEI's ``texts``
    (then the answer is TEI's bare list)."""

    query: str
    documents: list[str | RerankDocument] | None = None
    texts: list[str] | None = None
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = False  # Jina, Cohere
    return_text: bool = False  # TEI


def _embedder(server: Server, *, rank: bool) -> Embedder:
    embedder: Embedder | None = getattr(server, "embedder", None)
    if embedder is None or (rank and not embedder.ranks):
        what = "reranking" if rank else "embeddings"
        hint = (
            "a reranking model (pooling rank)"
            if rank
            else "an embedding model, or start lmserve with --embeddings"
        )
        raise InvalidRequest(
            f"the model '{server.model_id}' does not serve {what}; serve {hint}",
            param="model",
            code="model_not_supported",
        )
    return embedder


def _inputs(embedder: Embedder, value: str | list[Any]) -> list[list[int]]:
    """Token ids of each input (OpenAI's four shapes)."""
    if isinstance(value, str):
        return [embedder.tokens(value)]
    if not value:
        raise InvalidRequest("'input' must not be empty", param="input")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return [list(value)]
    out: list[list[int]] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            out.append(embedder.tokens(item))
        elif isinstance(item, list) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in item
        ):
            out.append(list(item))
        else:
            raise InvalidRequest(
                f"'input[{i}]' must be a string or a list of token ids", param="input"
            )
    return out


def _vector(row: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":  # OpenAI's: the little-endian float32 bytes
        return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
    values: list[float] = row.tolist()
    return values


@post(["/v1/embeddings", "/embeddings"], status_code=200)
async def embeddings(data: JSONBody[EmbeddingsRequest], server: ServerDep) -> dict[str, Any]:
    """Embeddings of the inputs, L2-normalised (``dimensions``: the first N, renormalised)."""
    embedder = _embedder(server, rank=False)
    if data.dimensions is not None and not 1 <= data.dimensions <= embedder.n_embd:
        raise InvalidRequest(
            f"'dimensions' must be between 1 and {embedder.n_embd}, got {data.dimensions}",
            param="dimensions",
        )
    engine = server.engine
    inputs = await engine.prepare(_inputs, embedder, data.input)
    embedder.check(inputs, "input")
    start = time.perf_counter()
    pooled = await _pooled(server, embedder, inputs, rank=False)
    rows = pooled.rows
    if data.dimensions is not None and data.dimensions < rows.shape[1]:
        rows = rows[:, : data.dimensions]
        rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    _log(server, "embeddings", len(inputs), pooled.tokens, start)
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _vector(row, data.encoding_format)}
            for i, row in enumerate(rows)
        ],
        "model": server.model_id,
        "usage": {"prompt_tokens": pooled.tokens, "total_tokens": pooled.tokens},
    }


@post(["/v1/rerank", "/rerank", "/v1/reranking", "/reranking"], status_code=200)
async def rerank(data: JSONBody[RerankRequest], server: ServerDep) -> Any:
    """The documents by relevance to the query, best first (``top_n`` of them)."""
    embedder = _embedder(server, rank=True)
    tei = data.texts is not None and data.documents is None
    field = "texts" if tei else "documents"
    raw = data.texts if tei else data.documents
    texts = [d.text if isinstance(d, RerankDocument) else d for d in raw or []]
    if not texts:
        raise InvalidRequest(f"'{field}' must be a non-empty list of strings", param=field)
    if data.top_n is not None and data.top_n < 0:
        raise InvalidRequest("'top_n' must not be negative", param="top_n")
    engine = server.engine

    def prompts() -> list[list[int]]:
        return [embedder.rerank_tokens(data.query, text) for text in texts]

    inputs = await engine.prepare(prompts)
    embedder.check(inputs, field)
    start = time.perf_counter()
    pooled = await _pooled(server, embedder, inputs, rank=True)
    _log(server, "rerank", len(inputs), pooled.tokens, start)
    scores = [float(s) for s in pooled.rows]
    order = sorted(range(len(texts)), key=lambda i: scores[i], reverse=True)
    order = order[: data.top_n] if data.top_n is not None else order
    if tei:
        return [
            {"index": i, "score": scores[i], **({"text": texts[i]} if data.return_text else {})}
            for i in order
        ]
    results = [
        {
            "index": i,
            "relevance_score": scores[i],
            **({"document": {"text": texts[i]}} if data.return_documents else {}),
        }
        for i in order
    ]
    return {
        "model": server.model_id,
        "object": "list",
        "usage": {"prompt_tokens": pooled.tokens, "total_tokens": pooled.tokens},
        "results": results,
    }


async def _pooled(
    server: Server, embedder: Embedder, inputs: list[list[int]], *, rank: bool
) -> Pooled:
    """The request's inputs through the worker, with whatever other requests are queued."""
    future = embedder.queue(inputs, rank=rank)
    try:
        await server.engine.call(embedder.run_queued)
    except BaseException:
        embedder.withdraw(future)
        raise
    return await asyncio.wrap_future(future)


def _log(server: Server, dialect: str, inputs: int, tokens: int, start: float) -> None:
    server.engine.metrics.request(dialect, 200)
    seconds = time.perf_counter() - start
    log.info(
        "request",
        dialect=dialect,
        status=200,
        inputs=inputs,
        prompt_tokens=tokens,
        seconds=round(seconds, 4),
    )


routes = [embeddings, rerank]
