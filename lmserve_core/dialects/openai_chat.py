"""OpenAI Chat Completions: ``POST /v1/chat/completions`` (and ``/chat/completions``).

The body is translated by ``openai_translate``; this module encodes the engine's events
as a ``chat.completion`` object or as data-only SSE ``chat.completion.chunk`` frames.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response, post
from litestar.params import JSONBody

from .. import __version__
from ..events import ErrorEvent, Event, Finish, ReasoningDelta, TextDelta, ToolCallEvent, Usage
from ..request import ToolCall
from ..server import Server, ServerDep
from ..wire_errors import openai_error
from .common import Collected, collect, new_id, open_stream, replay, sse_data, sse_response
from .openai_chat_models import ChatCompletionRequest
from .openai_translate import chat_request

DONE = b"data: [DONE]\n\n"


def system_fingerprint(server: Server) -> str:
    return f"lmserve-{__version__}-{server.backend.name}"


def usage_json(usage: Usage) -> dict[str, Any]:
    """OpenAI's ``usage`` object (both endpoints); reused prefix tokens are ``cached_tokens``."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def finish_reason(finish: Finish, made_tool_calls: bool = False) -> str:
    """The wire ``finish_reason``: stop sequences are plain ``stop`` in OpenAI's API."""
    if finish.reason == "length":
        return "length"
    if finish.reason == "tool_calls" or made_tool_calls:
        return "tool_calls"
    return "stop"


def error_frame(event: ErrorEvent) -> bytes:
    """The in-band error of a started stream: a data frame with a top-level ``error``."""
    return sse_data(openai_error(event.status, event.message, kind=event.kind))


def _tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id or new_id("call_"),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


class ChatEncoder:
    """Encodes one reply as ``chat.completion`` or ``chat.completion.chunk`` objects."""

    def __init__(self, server: Server, completion_id: str, *, include_usage: bool = False) -> None:
        self.id = completion_id
        self.created = int(time.time())
        self.model = server.model_id
        self.fingerprint = system_fingerprint(server)
        self.include_usage = include_usage

    def completion(self, reply: Collected) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            # OpenAI sends null content for a reply that is only tool calls.
            "content": None if reply.tool_calls and not reply.text else reply.text,
            "refusal": None,
        }
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [_tool_call_json(c) for c in reply.tool_calls]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish_reason(reply.finish, bool(reply.tool_calls)),
                    "logprobs": None,
                }
            ],
            "usage": usage_json(reply.finish.usage),
        }

    def _frame(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = usage_json(usage) if usage is not None else None
        return sse_data(chunk)

    def delta(self, delta: dict[str, Any], reason: str | None = None) -> bytes:
        return self._frame(
            [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]
        )

    async def frames(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """The SSE body: role chunk, deltas, the finish chunk, the usage chunk, [DONE]."""
        yield self.delta({"role": "assistant", "content": ""})
        calls = 0
        async for event in events:
            if isinstance(event, TextDelta):
                if event.text:
                    yield self.delta({"content": event.text})
            elif isinstance(event, ReasoningDelta):
                if event.text:
                    yield self.delta({"reasoning_content": event.text})
            elif isinstance(event, ToolCallEvent):
                # One chunk per call, arguments complete (calls are emitted once closed).
                call = {"index": calls, **_tool_call_json(event.call)}
                calls += 1
                yield self.delta({"tool_calls": [call]})
            elif isinstance(event, ErrorEvent):
                yield error_frame(event)
                break
            elif isinstance(event, Finish):
                yield self.delta({}, finish_reason(event, calls > 0))
                if self.include_usage:
                    yield self._frame([], event.usage)
                break
        yield DONE


@post(["/v1/chat/completions", "/chat/completions"], status_code=200)
async def chat_completions(
    data: JSONBody[ChatCompletionRequest], request: Request[Any, Any, Any], server: ServerDep
) -> Response[Any]:
    """OpenAI Chat Completions, streaming (SSE) or not."""
    completion_id = new_id("chatcmpl-")
    normalized = chat_request(data, server.backend.capabilities, server.ctx, completion_id)
    encoder = ChatEncoder(server, completion_id, include_usage=normalized.include_usage)
    if not normalized.stream:
        reply = await collect(server.engine, request, normalized)
        return Response(encoder.completion(reply))
    stream, head = await open_stream(server.engine, normalized)
    return sse_response(stream, encoder.frames(replay(stream, head)))


routes = [chat_completions]
