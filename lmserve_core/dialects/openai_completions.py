"""The legacy OpenAI text-completion endpoint: ``POST /v1/completions`` (and ``/completions``).

The prompt is continued as raw text (no chat template); only backends whose
``capabilities.raw_completion`` is set serve it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response, post
from litestar.params import JSONBody

from ..events import ErrorEvent, Event, Finish, ReasoningDelta, TextDelta, Usage
from ..server import Server, ServerDep
from .common import collect, new_id, open_stream, replay, sse_data, sse_response
from .openai_chat import DONE, error_frame, system_fingerprint, usage_json
from .openai_chat_models import CompletionRequest
from .openai_translate import completion_request


def finish_reason(finish: Finish) -> str:
    """Legacy completions know only ``stop`` and ``length``."""
    return "length" if finish.reason == "length" else "stop"


class CompletionEncoder:
    """Encodes one reply as ``text_completion`` objects (whole, or one per SSE frame)."""

    def __init__(self, server: Server, completion_id: str, *, include_usage: bool = False) -> None:
        self.id = completion_id
        self.created = int(time.time())
        self.model = server.model_id
        self.fingerprint = system_fingerprint(server)
        self.include_usage = include_usage

    def _object(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }

    @staticmethod
    def _choice(text: str, reason: str | None) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": reason}

    def completion(self, text: str, finish: Finish) -> dict[str, Any]:
        body = self._object([self._choice(text, finish_reason(finish))])
        body["usage"] = usage_json(finish.usage)
        return body

    def _frame(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> bytes:
        body = self._object(choices)
        if self.include_usage:
            body["usage"] = usage_json(usage) if usage is not None else None
        return sse_data(body)

    async def frames(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """The SSE body: text chunks, the finish chunk, the usage chunk, [DONE]."""
        async for event in events:
            # A raw continuation has no reasoning channel; text a backend routed there is
            # still model output, so it is passed on as text rather than dropped.
            if isinstance(event, TextDelta | ReasoningDelta):
                if event.text:
                    yield self._frame([self._choice(event.text, None)])
            elif isinstance(event, ErrorEvent):
                yield error_frame(event)
                break
            elif isinstance(event, Finish):
                yield self._frame([self._choice("", finish_reason(event))])
                if self.include_usage:
                    yield self._frame([], event.usage)
                break
        yield DONE


@post(["/v1/completions", "/completions"], status_code=200)
async def completions(
    data: JSONBody[CompletionRequest], request: Request[Any, Any, Any], server: ServerDep
) -> Response[Any]:
    """Legacy text completion, streaming (SSE) or not."""
    completion_id = new_id("cmpl-")
    normalized = completion_request(data, server.backend.capabilities, server.ctx, completion_id)
    encoder = CompletionEncoder(server, completion_id, include_usage=normalized.include_usage)
    if not normalized.stream:
        reply = await collect(server.engine, request, normalized)
        return Response(encoder.completion(reply.reasoning + reply.text, reply.finish))
    stream, head = await open_stream(server.engine, normalized)
    return sse_response(stream, encoder.frames(replay(stream, head)))


routes = [completions]
