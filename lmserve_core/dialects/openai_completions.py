"""The legacy OpenAI text-completion endpoint: ``POST /v1/completions`` (and ``/completions``).

The prompt is continued as raw text (no chat template); only backends whose
``capabilities.raw_completion`` is set serve it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response, post
from litestar.params import JSONBody

from ..events import ErrorEvent, Event, Finish, ReasoningDelta, TextDelta, TokenLogprob, Usage
from ..server import ServerDep
from .common import Collected, collect_choices, new_id, open_choices, sse_data, sse_response
from .openai_chat import DONE, ChoicesEncoder, error_frame, total_usage, usage_json
from .openai_chat_models import CompletionRequest
from .openai_translate import completion_request


def finish_reason(finish: Finish) -> str:
    """Legacy completions know only ``stop`` and ``length``."""
    return "length" if finish.reason == "length" else "stop"


def legacy_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """The legacy ``logprobs`` object: tokens, their logprobs, the alternatives as
    {token: logprob}, and each token's offset in the completion text from ``offset``."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.chosen.token)
    return {
        "tokens": [e.chosen.token for e in entries],
        "token_logprobs": [e.chosen.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


class CompletionEncoder(ChoicesEncoder):
    """Encodes a reply's choices as ``text_completion`` objects (whole, or one per SSE
    frame)."""

    def _object(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }

    def _choice(
        self,
        text: str,
        reason: str | None,
        index: int = 0,
        logprobs: list[TokenLogprob] | None = None,
        offset: int = 0,
    ) -> dict[str, Any]:
        lp = legacy_logprobs(logprobs or [], offset) if self.logprobs else None
        return {"text": text, "index": index, "logprobs": lp, "finish_reason": reason}

    def completion(self, replies: list[Collected]) -> dict[str, Any]:
        body = self._object(
            [
                self._choice(r.reasoning + r.text, finish_reason(r.finish), i, r.logprobs)
                for i, r in enumerate(replies)
            ]
        )
        body["usage"] = usage_json(total_usage([r.finish for r in replies]))
        return body

    def _frame(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> bytes:
        body = self._object(choices)
        if self.include_usage:
            body["usage"] = usage_json(usage) if usage is not None else None
        return sse_data(body)

    async def frames(self, events: AsyncIterator[tuple[int, Event]]) -> AsyncIterator[bytes]:
        """The SSE body: text chunks of every choice (each naming its ``index``), each
        choice's finish chunk, the usage chunk, [DONE]."""
        pending: list[list[TokenLogprob]] = [[] for _ in range(self.n)]
        offsets = [0] * self.n
        finishes: list[Finish | None] = [None] * self.n
        async for index, event in events:
            lp = pending[index]
            if isinstance(event, TokenLogprob):
                lp.append(event)
            # A raw continuation has no reasoning channel; text a backend routed there is
            # still model output, so it is passed on as text rather than dropped.
            elif isinstance(event, TextDelta | ReasoningDelta):
                if event.text:
                    yield self._frame([self._choice(event.text, None, index, lp, offsets[index])])
                    offsets[index] += sum(len(e.chosen.token) for e in lp)
                    lp.clear()
            elif isinstance(event, ErrorEvent):
                yield error_frame(event)
                break
            elif isinstance(event, Finish):
                finishes[index] = event
                reason = finish_reason(event)
                yield self._frame([self._choice("", reason, index, lp, offsets[index])])
                lp.clear()
                if all(f is not None for f in finishes):
                    if self.include_usage:
                        yield self._frame([], total_usage([f for f in finishes if f]))
                    break
        yield DONE


@post(["/v1/completions", "/completions"], status_code=200)
async def completions(
    data: JSONBody[CompletionRequest], request: Request[Any, Any, Any], server: ServerDep
) -> Response[Any]:
    """Legacy text completion, streaming (SSE) or not."""
    completion_id = new_id("cmpl-")
    normalized = completion_request(data, server.backend.capabilities, server.ctx, completion_id)
    encoder = CompletionEncoder(
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


routes = [completions]
