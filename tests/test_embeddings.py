"""Embeddings outside the model: how inputs are packed into passes and pooled, the engine's
``call`` (the worker, the bounded queue), and the endpoints of a server that does not embed.
The numerics against transformers and the client checks are the Qwen3 plugin's
(``test_qwen3_embeddings.py``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np
import pytest
from fake_backend import ScriptedBackend
from processes import API_KEY

from lmserve_core.backend import ServerSettings
from lmserve_core.embeddings import Embedder
from lmserve_core.engine import Engine
from lmserve_core.errors import InvalidRequest, QueueFull, ShuttingDown

AUTH = {"Authorization": f"Bearer {API_KEY}"}


class Cache:
    def __init__(self, n: int) -> None:
        self.n = n
        self.closed = False

    def close(self) -> None:
        self.closed = True


class HiddenModel:
    """A forward pass whose state of a token is (token, position, 1): pooling is exact."""

    n_vocab = 100

    def __init__(self, n_batch: int) -> None:
        self.n_batch = n_batch
        self.passes: list[list[tuple[int, int]]] = []  # (tokens, pos) of each row of a pass
        self.caches: list[Cache] = []

    def new_cache(self, n: int) -> Cache:
        self.caches.append(Cache(n))
        return self.caches[-1]

    def hidden_batch(self, rows: Sequence[tuple[Any, Sequence[int], int]]) -> list[np.ndarray]:
        assert sum(len(t) for _, t, _ in rows) <= self.n_batch
        assert len({id(c) for c, _, _ in rows}) == len(rows)
        assert all(not c.closed and pos + len(t) <= c.n for c, t, pos in rows)
        self.passes.append([(len(t), pos) for _, t, pos in rows])
        return [
            np.array([[tok, pos + i, 1.0] for i, tok in enumerate(t)], np.float32)
            for _, t, pos in rows
        ]


class Tokens:
    eos_id = 2

    def encode(self, text: str, **_: Any) -> list[int]:
        return [ord(c) % 50 + 3 for c in text]


class File:
    """The metadata an Embedder reads."""

    architecture = "test"
    tensors: dict[str, Any] = {}

    def arch_get(self, key: str, default: Any = None) -> Any:
        return {"embedding_length": 3}.get(key, default)

    def get(self, key: str, default: Any = None) -> Any:
        return default


def normed(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


INPUTS = [[5, 6, 7], [8, 9, 10], [11, 12, 13], list(range(20, 30))]


@pytest.mark.parametrize(
    ("pooling", "expected"),
    [
        ("last", lambda ids: [ids[-1], len(ids) - 1, 1]),
        ("cls", lambda ids: [ids[0], 0, 1]),
        ("mean", lambda ids: [np.mean(ids), (len(ids) - 1) / 2, 1]),
    ],
)
def test_inputs_share_passes_and_pool_exactly(pooling: str, expected: Any) -> None:
    model = HiddenModel(n_batch=8)
    embedder = Embedder(model, Tokens(), File(), pooling, max_tokens=64)  # type: ignore[arg-type]
    pooled = embedder.embed(INPUTS)
    # 19 tokens in passes of 8: three short inputs share the first; the long one continues
    assert model.passes == [[(3, 0), (3, 0), (2, 0)], [(1, 2), (7, 0)], [(3, 7)]]
    assert pooled.tokens == 19
    for ids, row in zip(INPUTS, pooled.rows, strict=True):
        assert np.allclose(row, normed(np.array(expected(ids), np.float64)), atol=1e-6)
    assert all(cache.closed for cache in model.caches) and len(model.caches) == 4


def test_queued_requests_share_the_passes() -> None:
    model = HiddenModel(n_batch=8)
    embedder = Embedder(model, Tokens(), File(), "last", max_tokens=64)  # type: ignore[arg-type]
    first = embedder.queue(INPUTS[:2], rank=False)
    dropped = embedder.queue([[1, 2]], rank=False)
    second = embedder.queue(INPUTS[2:], rank=False)
    embedder.withdraw(dropped)  # its call was refused: it never runs
    embedder.run_queued()
    assert model.passes == [[(3, 0), (3, 0), (2, 0)], [(1, 2), (7, 0)], [(3, 7)]]
    alone = Embedder(HiddenModel(8), Tokens(), File(), "last", max_tokens=64)  # type: ignore[arg-type]
    assert np.allclose(first.result(0).rows, alone.embed(INPUTS[:2]).rows)
    assert np.allclose(second.result(0).rows, alone.embed(INPUTS[2:]).rows)
    assert first.result(0).tokens == 6 and second.result(0).tokens == 13
    assert not dropped.done()
    embedder.run_queued()  # nothing left: a later call returns at once
    assert len(model.passes) == 3

    def broken(rows: Any) -> Any:
        raise RuntimeError("kernel failure")

    model.hidden_batch = broken  # type: ignore[method-assign]
    futures = [embedder.queue([[5]], rank=False), embedder.queue([[6]], rank=False)]
    embedder.run_queued()
    for future in futures:
        with pytest.raises(RuntimeError, match="kernel failure"):
            future.result(0)


def test_inputs_are_checked_naming_the_index() -> None:
    embedder = Embedder(HiddenModel(8), Tokens(), File(), "last", max_tokens=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match=r"'input' must not be empty"):
        embedder.check([], "input")
    with pytest.raises(InvalidRequest, match=r"'input\[1\]' is empty"):
        embedder.check([[1], []], "input")
    with pytest.raises(InvalidRequest, match=r"'input\[1\]': token id 100 is outside"):
        embedder.check([[1], [3, 100]], "input")
    with pytest.raises(InvalidRequest, match=r"'input\[0\]' has 6 tokens") as info:
        embedder.check([[1] * 6], "input")
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    # without a rerank template: query, EOS, document, EOS
    assert embedder.rerank_tokens("a", "b") == [*Tokens().encode("a"), 2, *Tokens().encode("b"), 2]


def test_engine_call_runs_on_the_worker_through_the_bounded_queue() -> None:
    engine = Engine(ScriptedBackend(ServerSettings()), queue_size=2)

    async def main() -> None:  # the worker is not started: calls wait in the queue
        first = asyncio.ensure_future(engine.call(lambda: 1))
        second = asyncio.ensure_future(engine.call(lambda: 2))
        await asyncio.sleep(0.05)
        assert engine.queued == 2
        with pytest.raises(QueueFull):
            await engine.call(lambda: 3)
        engine.begin_shutdown()
        for waiting in (first, second):
            with pytest.raises(ShuttingDown):
                await waiting
        with pytest.raises(ShuttingDown):
            await engine.call(lambda: 4)

    asyncio.run(main())
    engine.stop()

    engine = Engine(ScriptedBackend(ServerSettings()))
    engine.start()

    async def run() -> None:
        name = await engine.call(lambda: threading.current_thread().name)
        assert name == "lmserve-worker"
        with pytest.raises(ZeroDivisionError):
            await engine.call(lambda: 1 / 0)
        assert await engine.call(sum, [1, 2]) == 3  # the worker lives on

    asyncio.run(run())
    engine.stop()


def test_a_model_that_does_not_embed_answers_400(server: Any) -> None:
    for path, body in (
        ("/v1/embeddings", {"input": "hello", "model": "m"}),
        ("/embeddings", {"input": ["a"]}),
        ("/v1/rerank", {"query": "q", "documents": ["a"]}),
    ):
        reply = httpx.post(server.base_url + path, json=body, headers=AUTH, timeout=30)
        assert reply.status_code == 400, (path, reply.text)
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "model"
        assert "does not serve" in error["message"]
    meta = httpx.get(server.base_url + "/v1/models", headers=AUTH, timeout=30).json()
    assert meta["data"][0]["meta"]["embeddings"] is False
    assert meta["data"][0]["meta"]["rerank"] is False
