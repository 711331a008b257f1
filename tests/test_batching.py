"""Continuous batching in the generic GGUF chat path and the engine.

The scripted forward pass (``scripted.py``) makes every reply exact: a generation in a batch
must give exactly the text, finish and usage it gives alone, whatever joins, leaves, fails
or is cancelled around it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from scripted import (  # noqa: F401  (the fixtures)
    IM_END,
    FakeCache,
    ListSink,
    ScriptedModel,
    _gguf,
    _one_tokenizer,
    _tokenizer,
    chat,
    check_shadow,
    ids,
    make_backend,
    run,
)

from lmserve_core import chat_schedule
from lmserve_core.engine import Engine
from lmserve_core.events import ErrorEvent, Finish, TextDelta
from lmserve_core.gguf_chat import Generation, GGUFChatBackend
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.request import Constraint, Message, NormalizedRequest, Sampling


class BatchModel(ScriptedModel):
    """The scripted model with a batch forward; records the size of every batch and fails
    any row whose cache is in ``broken``."""

    n_batch = 256

    def __init__(self, n_vocab: int, script: Sequence[int] = ()) -> None:
        super().__init__(n_vocab, script)
        self.batches: list[int] = []
        self.broken: set[int] = set()  # ids of caches whose forward fails

    def forward(
        self, cache: FakeCache, tokens: Sequence[int], pos: int, *, all_logits: bool = False
    ) -> np.ndarray:
        if id(cache) in self.broken:
            raise RuntimeError("kernel failure")
        return super().forward(cache, tokens, pos, all_logits=all_logits)

    def forward_batch(
        self, rows: Sequence[tuple[FakeCache, Sequence[int], int]]
    ) -> list[np.ndarray]:
        assert sum(len(t) for _, t, _ in rows) <= self.n_batch
        assert len({id(c) for c, _, _ in rows}) == len(rows)
        self.batches.append(len(rows))
        return [self.forward(c, t, p)[None, :] for c, t, p in rows]


def backend_for(gguf: GGUFFile, script: Sequence[int] = (), **kw: Any) -> GGUFChatBackend:
    kw.setdefault("batch", 4)
    kw.setdefault("slots", kw["batch"])
    return make_backend(gguf, model=BatchModel(49152, script), **kw)


def solo(gguf: GGUFFile, request: NormalizedRequest, script: Sequence[int] = ()) -> Any:
    """Finish and sink of ``request`` run alone on a fresh backend."""
    return run(backend_for(gguf, script, batch=1), _copy(request))


def _copy(request: NormalizedRequest) -> NormalizedRequest:
    return NormalizedRequest(
        id=request.id + "-solo",
        dialect=request.dialect,
        messages=list(request.messages),
        sampling=request.sampling,
        max_tokens=request.max_tokens,
        stop=list(request.stop),
        constraint=request.constraint,
    )


def assert_same(finish: Finish | None, alone: Finish) -> None:
    """The same ending as alone; only how much of the prompt was found cached may differ."""
    assert finish is not None
    assert (finish.reason, finish.stop_sequence) == (alone.reason, alone.stop_sequence)
    got, want = finish.usage, alone.usage
    assert (got.prompt_tokens, got.completion_tokens) == (want.prompt_tokens, want.completion_tokens)


def drive(
    backend: GGUFChatBackend,
    requests: Sequence[NormalizedRequest],
    sinks: Sequence[ListSink] | None = None,
    *,
    joins: Sequence[int] | None = None,
) -> list[Generation]:
    """Run ``requests`` through begin/step; request i joins before step ``joins[i]``."""
    sinks = sinks or [ListSink() for _ in requests]
    joins = joins or [0] * len(requests)
    for r in requests:
        backend.validate(r)
    gens: list[Generation | None] = [None] * len(requests)
    steps = 0
    while True:
        for i, r in enumerate(requests):
            if gens[i] is None and joins[i] <= steps:
                gens[i] = backend.begin(r, sinks[i])
        started = [g for g in gens if g is not None]
        running = [g for g in started if g.finish is None]
        if not running and len(started) == len(requests):
            return started
        if running:
            backend.step(running)
        steps += 1
        assert steps < 10_000


def noisy(n: int, **kw: Any) -> NormalizedRequest:
    """A greedy chat whose reply (the scripted model's noise) depends on its prompt length."""
    kw.setdefault("max_tokens", 12)
    kw.setdefault("sampling", Sampling(temperature=0.0))
    return NormalizedRequest(
        id=f"noisy-{n}-{id(kw)}",
        dialect="chat",
        messages=[Message(role="user", content="word " * n)],
        **kw,
    )


# ---------------------------------------------------------------------------- the batch


def test_each_generation_in_a_batch_gives_its_solo_reply(gguf: GGUFFile) -> None:
    backend = backend_for(gguf)
    requests = [noisy(n) for n in (3, 8, 20, 41)]
    sinks = [ListSink() for _ in requests]
    gens = drive(backend, requests, sinks)
    for request, gen, sink in zip(requests, gens, sinks, strict=True):
        finish, alone = solo(gguf, request)
        assert sink.text == alone.text and sink.text
        assert_same(gen.finish, finish)
    # once every prompt was read, one weight pass wrote the rows of all four
    assert max(backend.model.batches) == 4  # type: ignore[attr-defined]
    assert not any(slot.busy for slot in backend.slots.slots)
    check_shadow(backend)


def test_requests_join_between_steps_and_leave_at_their_end(gguf: GGUFFile) -> None:
    backend = backend_for(gguf)
    requests = [noisy(5, max_tokens=30), noisy(9, max_tokens=4), noisy(13, max_tokens=10)]
    sinks = [ListSink() for _ in requests]
    gens = drive(backend, requests, sinks, joins=[0, 6, 8])
    for request, gen, sink in zip(requests, gens, sinks, strict=True):
        finish, alone = solo(gguf, request)
        assert sink.text == alone.text
        assert_same(gen.finish, finish)
    batches = backend.model.batches  # type: ignore[attr-defined]
    # the first ran alone (no batch call), was joined by the others, and outlived them
    assert batches[0] == 2 and 3 in batches
    assert gens[1].finish is not None and gens[1].finish.usage.completion_tokens == 4
    check_shadow(backend)


def test_cancelling_one_generation_leaves_the_others_untouched(gguf: GGUFFile) -> None:
    b0 = make_backend(gguf)
    script = ids(b0, "one two three four five six seven") + [IM_END]
    backend = backend_for(gguf, script)
    requests = [chat("a"), chat("b", "x", "c"), chat("d", "y", "e", "z", "f")]
    sinks = [ListSink(), ListSink(cancel_after=2), ListSink()]
    gens = drive(backend, requests, sinks)
    assert gens[1].finish is not None and gens[1].finish.reason == "cancelled"
    assert sinks[1].text == "one two"
    for i in (0, 2):
        assert sinks[i].text == "one two three four five six seven"
        assert gens[i].finish is not None and gens[i].finish.reason == "stop"
    check_shadow(backend)


def test_grammar_and_stop_strings_are_per_generation(gguf: GGUFFile) -> None:
    pytest.importorskip("llguidance")
    backend = backend_for(gguf)
    requests = [
        noisy(4, max_tokens=60, constraint=Constraint(kind="regex", source=r"[a-c]{3}-[0-9]{2}")),
        noisy(
            7,
            max_tokens=80,
            constraint=Constraint(kind="json_object", source=""),
        ),
        noisy(11, max_tokens=40, stop=["e"]),
        noisy(16, max_tokens=40),
    ]
    sinks = [ListSink() for _ in requests]
    gens = drive(backend, requests, sinks)
    for request, gen, sink in zip(requests, gens, sinks, strict=True):
        finish, alone = solo(gguf, request)
        assert sink.text == alone.text
        assert_same(gen.finish, finish)
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", sinks[0].text)
    if gens[1].finish is not None and gens[1].finish.reason == "stop":
        assert isinstance(json.loads(sinks[1].text), dict)


def test_a_failing_generation_ends_alone_with_an_error(gguf: GGUFFile) -> None:
    backend = backend_for(gguf)
    requests = [noisy(3, max_tokens=20), noisy(8, max_tokens=20), noisy(13, max_tokens=20)]
    sinks = [ListSink() for _ in requests]
    for r in requests:
        backend.validate(r)
    gens = [backend.begin(r, s) for r, s in zip(requests, sinks, strict=True)]
    for _ in range(6):
        backend.step(gens)
    model: BatchModel = backend.model  # type: ignore[assignment]
    model.broken.add(id(gens[1].kv.cache))
    while any(g.finish is None for g in gens):
        backend.step(gens)
    assert gens[1].finish is not None and gens[1].finish.reason == "error"
    assert isinstance(sinks[1].events[-1], ErrorEvent)
    assert "kernel failure" in sinks[1].events[-1].message
    for i in (0, 2):
        finish, alone = solo(gguf, requests[i])
        assert sinks[i].text == alone.text
        assert_same(gens[i].finish, finish)
    assert not any(slot.busy for slot in backend.slots.slots)


def test_a_long_prompt_is_read_in_slices_while_others_decode(
    gguf: GGUFFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    class SlowPrefill(BatchModel):
        def forward(self, cache, tokens, pos, *, all_logits=False):  # type: ignore[no-untyped-def]
            time.sleep(1e-4 * len(tokens))  # 10k tokens/s
            return super().forward(cache, tokens, pos, all_logits=all_logits)

    monkeypatch.setattr(chat_schedule, "PREFILL_SLICE_S", 0.01)  # about 100 tokens a step
    backend = make_backend(gguf, model=SlowPrefill(49152), batch=2, slots=2)
    long = noisy(1500, max_tokens=4)
    requests = [noisy(3, max_tokens=60), long]
    sinks = [ListSink() for _ in requests]
    drive(backend, requests, sinks, joins=[0, 3])
    calls = backend.model.forward_calls  # type: ignore[attr-defined]
    n_long = long.prompt_tokens
    assert n_long is not None and n_long > 1500
    slices = [n for pos, n in calls if n > 1]
    assert sum(slices) >= n_long - 1  # (the first prompt was read in one call)
    # read in many small slices, each followed by a token of the other generation
    assert len(slices) > 5 and max(slices[1:]) <= 4 * 100
    finish, alone = solo(gguf, long)
    assert sinks[1].text == alone.text
    finish, alone = solo(gguf, requests[0])
    assert sinks[0].text == alone.text


def test_new_conversations_copy_a_shared_prefix_from_a_busy_or_resident_donor(
    gguf: GGUFFile,
) -> None:
    b0 = make_backend(gguf)
    backend = backend_for(gguf, ids(b0, "Sure, here it is.") + [IM_END], batch=3, slots=4)
    system = Message(role="system", content="You are a terse assistant. " * 20)

    def ask(text: str) -> NormalizedRequest:
        return NormalizedRequest(
            id=text,
            dialect="chat",
            messages=[system, Message(role="user", content=text)],
            sampling=Sampling(temperature=0.0),
        )

    run(backend, ask("zero"))  # resident donor
    requests = [ask("one"), ask("two"), ask("three")]
    gens = drive(backend, requests, joins=[0, 0, 2])
    for gen in gens:
        assert gen.finish is not None and gen.finish.usage.cached_tokens > 100
    assert len(backend.model.copies) == 3  # type: ignore[attr-defined]
    assert len({id(g.kv) for g in gens}) == 3
    check_shadow(backend)


def test_a_generation_without_a_free_slot_ends_with_an_error(gguf: GGUFFile) -> None:
    backend = backend_for(gguf, batch=2, slots=2)
    requests = [noisy(3), noisy(5), noisy(7)]
    for r in requests:
        backend.validate(r)
    sinks = [ListSink() for _ in requests]
    gens = [backend.begin(r, s) for r, s in zip(requests, sinks, strict=True)]
    for _ in range(3):
        backend.step(gens)
    assert gens[2].finish is not None and gens[2].finish.reason == "error"
    assert "in use" in sinks[2].events[-1].message  # type: ignore[union-attr]
    assert gens[0].finish is None and gens[1].finish is None


# ---------------------------------------------------------------------------- the engine


async def _collect(engine: Engine, request: NormalizedRequest) -> tuple[str, Finish]:
    stream = await engine.submit(request)
    text, finish = "", None
    async for event in stream:
        if isinstance(event, TextDelta):
            text += event.text
        elif isinstance(event, Finish):
            finish = event
    assert finish is not None
    return text, finish


def _serve(backend: GGUFChatBackend, requests: Sequence[NormalizedRequest]) -> list[Any]:
    engine = Engine(backend, queue_size=16)
    engine.start()

    async def main() -> list[Any]:
        return await asyncio.gather(*(_collect(engine, r) for r in requests))

    try:
        return asyncio.run(main())
    finally:
        engine.stop()


def test_engine_batches_concurrent_requests(gguf: GGUFFile) -> None:
    backend = backend_for(gguf, batch=3, slots=3)
    requests = [noisy(n, max_tokens=16) for n in (2, 6, 10, 14, 18)]
    results = _serve(backend, requests)
    for request, (text, finish) in zip(requests, results, strict=True):
        solo_finish, alone = solo(gguf, request)
        assert text == alone.text
        assert_same(finish, solo_finish)
    batches = backend.model.batches  # type: ignore[attr-defined]
    assert max(batches) == 3  # never more than --batch at once
    assert not any(slot.busy for slot in backend.slots.slots)


def test_engine_with_batch_one_generates_one_request_at_a_time(gguf: GGUFFile) -> None:
    backend = backend_for(gguf, batch=1, slots=1)
    requests = [noisy(n, max_tokens=8) for n in (2, 6, 10)]
    results = _serve(backend, requests)
    for request, (text, _) in zip(requests, results, strict=True):
        assert text == solo(gguf, request)[1].text
    model: BatchModel = backend.model  # type: ignore[assignment]
    assert model.batches == []
    # each prompt is read only after the previous reply ended: one long call per prompt
    # and single-token calls between them
    prefills = [i for i, (_, n) in enumerate(model.forward_calls) if n > 1]
    assert len(prefills) == 3
    assert all(b - a == 8 for a, b in zip(prefills, prefills[1:], strict=False))
