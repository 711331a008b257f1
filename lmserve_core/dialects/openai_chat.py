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
from ..events import (
    ErrorEvent,
    Event,
    Finish,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCallEvent,
    Usage,
)
from ..request import ToolCall
from ..server import Server, ServerDep
from ..wire_errors import openai_error
from .common import (
    Collected,
    collect_choices,
    content_logprobs,
    new_id,
    open_choices,
    sse_data,
    sse_response,
)
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


def total_usage(finishes: list[Finish]) -> Usage:
    """A request's usage over its choices: the prompt once, every choice's completion."""
    usages = [f.usage or Usage() for f in finishes]
    return Usage(
        prompt_tokens=usages[0].prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=usages[0].cached_tokens,
        reasoning_tokens=sum(u.reasoning_tokens for u in usages),
    )


class ChoicesEncoder:
    """What both OpenAI completion endpoints' encoders know of a reply: its id, model and
    choices, and whether usage and logprobs are sent."""

    def __init__(
        self,
        server: Server,
        completion_id: str,
        *,
        include_usage: bool = False,
        logprobs: bool = False,
        n: int = 1,
    ) -> None:
        self.id = completion_id
        self.created = int(time.time())
        self.model = server.model_id
        self.fingerprint = system_fingerprint(server)
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.n = n


class ChatEncoder(ChoicesEncoder):
    """Encodes a reply's choices as ``chat.completion`` or ``chat.completion.chunk``
    objects."""

    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"content": content_logprobs(entries), "refusal": None}

    def completion(self, replies: list[Collected]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [self._choice(i, reply) for i, reply in enumerate(replies)],
            "usage": usage_json(total_usage([reply.finish for reply in replies])),
        }

    def _choice(self, index: int, reply: Collected) -> dict[str, Any]:
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
            "index": index,
            "message": message,
            "finish_reason": finish_reason(reply.finish, bool(reply.tool_calls)),
            "logprobs": self._logprobs(reply.logprobs),
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

    def delta(
        self,
        delta: dict[str, Any],
        reason: str | None = None,
        index: int = 0,
        logprobs: list[TokenLogprob] | None = None,
    ) -> bytes:
        lp = self._logprobs(logprobs) if logprobs else None
        return self._frame(
            [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}]
        )

    async def frames(self, events: AsyncIterator[tuple[int, Event]]) -> AsyncIterator[bytes]:
        """The SSE body: each choice's role chunk, its deltas and its finish chunk (chunks
        of different choices interleave, each naming its ``index``), the usage chunk,
        [DONE]. A choice's token logprobs ride on its next delta."""
        for index in range(self.n):
            yield self.delta({"role": "assistant", "content": ""}, index=index)
        calls = [0] * self.n
        pending: list[list[TokenLogprob]] = [[] for _ in range(self.n)]
        finishes: list[Finish | None] = [None] * self.n
        async for index, event in events:
            lp = pending[index]
            if isinstance(event, TokenLogprob):
                lp.append(event)
                continue
            if isinstance(event, TextDelta):
                if event.text:
                    yield self.delta({"content": event.text}, index=index, logprobs=lp)
                    lp.clear()
            elif isinstance(event, ReasoningDelta):
                if event.text:
                    yield self.delta({"reasoning_content": event.text}, index=index)
            elif isinstance(event, ToolCallEvent):
                # One chunk per call, arguments complete (calls are emitted once closed).
                call = {"index": calls[index], **_tool_call_json(event.call)}
                calls[index] += 1
                yield self.delta({"tool_calls": [call]}, index=index, logprobs=lp)
                lp.clear()
            elif isinstance(event, ErrorEvent):
                yield error_frame(event)
                break
            elif isinstance(event, Finish):
                finishes[index] = event
                reason = finish_reason(event, calls[index] > 0)
                yield self.delta({}, reason, index=index, logprobs=lp)
                lp.clear()
                if all(f is not None for f in finishes):
                    if self.include_usage:
                        done = [f for f in finishes if f is not None]
                        yield self._frame([], total_usage(done))
                    break
        yield DONE


@post(["/v1/chat/completions", "/chat/completions"], status_code=200)
async def chat_completions(
    data: JSONBody[ChatCompletionRequest], request: Request[Any, Any, Any], server: ServerDep
) -> Response[Any]:
    """OpenAI Chat Completions, streaming (SSE) or not."""
    completion_id = new_id("chatcmpl-")
    normalized = chat_request(data, server.backend.capabilities, server.ctx, completion_id)
    encoder = ChatEncoder(
        server,
        completion_id,
        include_usage=normalized.include_usage,
        logprobs=normalized.logprobs is not None,
        n=normalized.n,
    )
    if not normalized.stream:
        replies = await collect_choices(server.engine, request, normalized)
        return Response(encoder.completion(replies))
    group, events = await open_choices(server.engine, normalized)
    return sse_response(group, encoder.frames(events))


routes = [chat_completions]
