"""The legacy OpenAI text-completion endpoint: ``POST /v1/completions`` (and ``/completions``).

The prompt is continued as raw text (no chat template); only backends whose
``capabilities.raw_completion`` is set serve it. A prompt may be given as token ids (read
verbatim) and a request may hold several prompts (one choice each, ``n`` each).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from anyio import to_thread
from litestar import Request, Response, post
from litestar.params import JSONBody

from ..backend import HasVocabulary
from ..errors import InvalidRequest
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


def prompts_usage(finishes: list[Finish], per_prompt: int) -> Usage:
    """The usage of several prompts' choices (prompt-major, ``per_prompt`` each): every
    prompt once, every choice's completion."""
    usages = [
        total_usage(finishes[i : i + per_prompt]) for i in range(0, len(finishes), per_prompt)
    ]
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=sum(u.cached_tokens for u in usages),
        reasoning_tokens=sum(u.reasoning_tokens for u in usages),
    )


class CompletionEncoder(ChoicesEncoder):
    """Encodes a reply's choices as ``text_completion`` objects (whole, or one per SSE
    frame). With several prompts the choices are prompt-major (``index`` = prompt × n +
    choice, as OpenAI numbers them); ``echo`` holds each choice's prompt text to put
    before its completion."""

    def __init__(
        self, *args: Any, per_prompt: int = 1, echo: list[str] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.per_prompt = per_prompt
        self.echo = echo or [""] * self.n

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
                self._choice(
                    self.echo[i] + r.reasoning + r.text, finish_reason(r.finish), i, r.logprobs
                )
                for i, r in enumerate(replies)
            ]
        )
        body["usage"] = usage_json(prompts_usage([r.finish for r in replies], self.per_prompt))
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
        echo = list(self.echo)  # each choice's prompt text, sent with its first chunk
        async for index, event in events:
            lp = pending[index]
            if isinstance(event, TokenLogprob):
                lp.append(event)
            # A raw continuation has no reasoning channel; text a backend routed there is
            # still model output, so it is passed on as text rather than dropped.
            elif isinstance(event, TextDelta | ReasoningDelta):
                if event.text:
                    text, echo[index] = echo[index] + event.text, ""
                    yield self._frame([self._choice(text, None, index, lp, offsets[index])])
                    offsets[index] += sum(len(e.chosen.token) for e in lp)
                    lp.clear()
            elif isinstance(event, ErrorEvent):
                yield error_frame(event)
                break
            elif isinstance(event, Finish):
                finishes[index] = event
                reason = finish_reason(event)
                text, echo[index] = echo[index], ""
                yield self._frame([self._choice(text, reason, index, lp, offsets[index])])
                lp.clear()
                if all(f is not None for f in finishes):
                    if self.include_usage:
                        done = [f for f in finishes if f]
                        yield self._frame([], prompts_usage(done, self.per_prompt))
                    break
        yield DONE


@post(["/v1/completions", "/completions"], status_code=200)
async def completions(
    data: JSONBody[CompletionRequest], request: Request[Any, Any, Any], server: ServerDep
) -> Response[Any]:
    """Legacy text completion, streaming (SSE) or not."""
    completion_id = new_id("cmpl-")
    backend = server.backend
    vocab = backend.vocab_size if isinstance(backend, HasVocabulary) else None
    prompts = completion_request(
        data,
        backend.capabilities,
        server.ctx,
        completion_id,
        vocab if isinstance(vocab, int) else None,
    )
    normalized = prompts[0]
    queue = server.engine.queue_size
    if len(prompts) > 1 and len(prompts) * normalized.n > queue:
        # a 429 would tell the client to retry what can never fit
        raise InvalidRequest(
            f"{len(prompts)} prompts x n={normalized.n} make {len(prompts) * normalized.n} "
            f"generations; this server queues at most {queue} (--queue)",
            param="prompt",
        )
    echo = None
    if data.echo:
        texts = [
            p.prompt
            if p.prompt_ids is None
            else await to_thread.run_sync(backend.detokenize, p.prompt_ids)
            for p in prompts
        ]
        echo = [text or "" for text in texts for _ in range(normalized.n)]
    encoder = CompletionEncoder(
        server,
        completion_id,
        include_usage=normalized.include_usage,
        logprobs=normalized.logprobs is not None,
        n=len(prompts) * normalized.n,
        per_prompt=normalized.n,
        echo=echo,
    )
    if not normalized.stream:
        replies = await collect_choices(server.engine, request, prompts)
        return Response(encoder.completion(replies))
    group, events = await open_choices(server.engine, prompts)
    return sse_response(group, encoder.frames(events))


routes = [completions]
