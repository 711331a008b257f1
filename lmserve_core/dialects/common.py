"""What every dialect controller shares: submission, collection, lazy streams, SSE."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from litestar import Request
from litestar.response import Stream

from ..engine import Engine, RequestStream
from ..errors import InvalidRequest, LmserveError
from ..events import (
    ErrorEvent,
    Event,
    Finish,
    ReasoningDelta,
    TextDelta,
    TokenAlternative,
    TokenLogprob,
    ToolCallEvent,
)
from ..request import (
    DEFAULT_MAX_TOKENS,
    DiffusionSampling,
    NormalizedRequest,
    ToolCall,
    choices_of,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def bounded_max_tokens(value: int | None, field_name: str, ctx: int) -> int:
    """The reply bound: default 1024, clamped to the context; must be positive."""
    if value is None:
        return min(DEFAULT_MAX_TOKENS, ctx)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"'{field_name}' must be a positive integer", param=field_name)
    return min(value, ctx)


def check_stop(stop: str | list[str] | None, field_name: str = "stop") -> list[str]:
    """Normalize ``stop``: a string or up to four non-empty strings."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else list(stop)
    if len(items) > 4:
        raise InvalidRequest(f"'{field_name}' takes at most 4 sequences", param=field_name)
    for item in items:
        if not isinstance(item, str) or not item:
            raise InvalidRequest(f"'{field_name}' entries must be non-empty strings", param=field_name)
    return items


def reject(param: str, why: str = "is not supported", *, status: int = 400) -> LmserveError:
    """The error for a field the server refuses (the message names the field)."""
    err = InvalidRequest(f"'{param}' {why}", param=param, code="unsupported_parameter")
    err.status = status
    return err


# The ``diffusion`` object: field -> (integer?, lowest, highest, lowest excluded?).
MAX_DIFFUSION_STEPS = 512
_DIFFUSION_FIELDS: dict[str, tuple[bool, float, float, bool]] = {
    "max_steps": (True, 1, MAX_DIFFUSION_STEPS, False),
    "t_min": (False, 0.0, 100.0, True),
    "t_max": (False, 0.0, 100.0, True),
    "entropy_bound": (False, 0.0, 1e6, True),
    "stability_threshold": (True, 0, MAX_DIFFUSION_STEPS, False),
    "confidence_threshold": (False, 0.0, 1e6, False),
}


def diffusion_from(raw: Any, field_name: str = "diffusion") -> DiffusionSampling | None:
    """The request's ``diffusion`` object: overrides of a block-diffusion model's sampler
    (same in every dialect). Unknown keys, wrong types and out-of-range values are a 400
    naming ``diffusion.<key>``; absent or null: the model's own parameters."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidRequest(f"'{field_name}' must be an object", param=field_name)
    values: dict[str, int | float] = {}
    for key, value in raw.items():
        name = f"{field_name}.{key}"
        spec = _DIFFUSION_FIELDS.get(key)
        if spec is None:
            known = ", ".join(_DIFFUSION_FIELDS)
            raise InvalidRequest(f"'{name}' is not a field of '{field_name}' ({known})",
                                 param=name)
        if value is None:
            continue
        integer, low, high, open_low = spec
        kind = "an integer" if integer else "a number"
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise InvalidRequest(f"'{name}' must be {kind}", param=name)
        if not math.isfinite(value) or value > high or value < low or (open_low and value == low):
            lower = f"> {low:g}" if open_low else f">= {low:g}"
            raise InvalidRequest(f"'{name}' must be {kind} {lower} and <= {high:g}", param=name)
        values[key] = int(value) if integer else float(value)
    return DiffusionSampling(**values) if values else None  # type: ignore[arg-type]


def json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _alternative_json(entry: TokenAlternative) -> dict[str, Any]:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": entry.bytes}


def content_logprobs(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI's token logprobs (chat's ``logprobs.content``, a Responses output text's
    ``logprobs``) of the reply's tokens, not of its reasoning."""
    return [
        {**_alternative_json(e.chosen), "top_logprobs": [_alternative_json(t) for t in e.top]}
        for e in entries
        if not e.reasoning
    ]


def error_from_event(event: ErrorEvent) -> LmserveError:
    """The HTTP error for an error that happened before any output was sent."""
    err = LmserveError(event.message, status=event.status)
    err.kind = event.kind
    return err


@dataclass(slots=True)
class Collected:
    """A whole reply gathered from a stream (non-streaming requests)."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: Finish = field(default_factory=lambda: Finish("error"))


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class StreamGroup:
    """The streams of one request's choices, cancelled together."""

    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams

    def cancel(self) -> None:
        for stream in self.streams:
            stream.cancel()


async def _watch_disconnect(request: Request[Any, Any, Any], stream: Cancellable) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            stream.cancel()
            return


async def collect(
    engine: Engine, request: Request[Any, Any, Any], normalized: NormalizedRequest
) -> Collected:
    """Submit and gather the whole reply; a client hang-up cancels the job.

    Raises the ``LmserveError`` of an ``ErrorEvent`` (it becomes the HTTP error).
    """
    return (await collect_choices(engine, request, normalized))[0]


def _choices(normalized: NormalizedRequest | list[NormalizedRequest]) -> list[NormalizedRequest]:
    """The generations of a request, or of several (the prompts of one legacy completion,
    prompt-major: each prompt's ``n`` choices together)."""
    requests = normalized if isinstance(normalized, list) else [normalized]
    return [choice for each in requests for choice in choices_of(each)]


async def collect_choices(
    engine: Engine,
    request: Request[Any, Any, Any],
    normalized: NormalizedRequest | list[NormalizedRequest],
) -> list[Collected]:
    """:func:`collect` for each of the request's ``n`` choices (of each request, given
    several)."""
    group = StreamGroup(await engine.submit_all(_choices(normalized)))
    watcher = asyncio.create_task(_watch_disconnect(request, group))
    try:
        return list(await asyncio.gather(*(_gather(stream) for stream in group.streams)))
    finally:
        group.cancel()  # a no-op once finished; stops the jobs if we left early
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _gather(stream: RequestStream) -> Collected:
    out = Collected()
    text: list[str] = []
    reasoning: list[str] = []
    async for event in stream:
        if isinstance(event, TextDelta):
            text.append(event.text)
        elif isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        elif isinstance(event, ToolCallEvent):
            out.tool_calls.append(event.call)
        elif isinstance(event, TokenLogprob):
            out.logprobs.append(event)
        elif isinstance(event, ErrorEvent):
            raise error_from_event(event)
        elif isinstance(event, Finish):
            out.finish = event
    out.text = "".join(text)
    out.reasoning = "".join(reasoning)
    return out


async def open_stream(
    engine: Engine, normalized: NormalizedRequest
) -> tuple[RequestStream, list[Event]]:
    """Submit and wait for the first event, so errors before any output are plain HTTP
    errors (streams start lazily). Returns the stream and the events read so far."""
    stream = await engine.submit(normalized)
    return stream, await _head(stream)


async def _head(stream: RequestStream) -> list[Event]:
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        return []
    except BaseException:
        stream.cancel()
        raise
    if isinstance(first, ErrorEvent):
        stream.cancel()
        raise error_from_event(first)
    return [first]


async def open_choices(
    engine: Engine, normalized: NormalizedRequest | list[NormalizedRequest]
) -> tuple[StreamGroup, AsyncIterator[tuple[int, Event]]]:
    """:func:`open_stream` for each of the request's ``n`` choices (of each request, given
    several): the group, and every choice's events tagged with its index, as they come.
    Waits for the first choice's first event; a later choice's error arrives in its
    stream."""
    group = StreamGroup(await engine.submit_all(_choices(normalized)))
    try:
        head = await _head(group.streams[0])
    except BaseException:
        group.cancel()
        raise
    if len(group.streams) == 1:
        return group, _indexed(replay(group.streams[0], head))
    return group, _merged(group.streams, head)


async def _indexed(events: AsyncIterator[Event]) -> AsyncIterator[tuple[int, Event]]:
    async for event in events:
        yield 0, event


async def _merged(
    streams: list[RequestStream], head: list[Event]
) -> AsyncIterator[tuple[int, Event]]:
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

    async def pump(index: int, events: AsyncIterator[Event]) -> None:
        try:
            async for event in events:
                await queue.put((index, event))
        finally:
            await queue.put((index, None))

    tasks = [
        asyncio.create_task(pump(i, replay(stream, head if i == 0 else [])))
        for i, stream in enumerate(streams)
    ]
    try:
        remaining = len(tasks)
        while remaining:
            index, event = await queue.get()
            if event is None:
                remaining -= 1
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()


async def replay(stream: RequestStream, head: list[Event]) -> AsyncIterator[Event]:
    """The events of ``open_stream``: the ones already read, then the rest."""
    for event in head:
        yield event
    async for event in stream:
        yield event


def sse_response(
    stream: Cancellable, frames: AsyncIterator[bytes], on_close: Callable[[], None] | None = None
) -> Stream:
    """A text/event-stream response; a dropped client cancels the generation."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for frame in frames:
                yield frame
        finally:
            stream.cancel()
            if on_close is not None:
                on_close()

    return Stream(content=body(), media_type="text/event-stream", headers=SSE_HEADERS)


def sse_data(payload: Any) -> bytes:
    """A data-only SSE frame (chat completions)."""
    return b"data: " + json_text(payload).encode() + b"\n\n"


def sse_event(event: str, payload: Any) -> bytes:
    """An ``event:`` + ``data:`` SSE frame (responses, messages)."""
    return b"event: " + event.encode() + b"\ndata: " + json_text(payload).encode() + b"\n\n"
