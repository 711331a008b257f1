"""Encoding generation events as Responses objects and Responses SSE streams."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

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
from .common import Collected, content_logprobs, new_id, sse_event


@dataclass(slots=True)
class ResponseMeta:
    """What every response object of one request carries: identity and request echoes."""

    id: str
    model: str
    echo: dict[str, Any] = field(default_factory=dict)
    created_at: int = field(default_factory=lambda: int(time.time()))
    # flat tool name -> (namespace, name) of the request's namespaced tools
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)


def usage_object(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def response_object(
    meta: ResponseMeta,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``response`` object in the shape ``openai.types.responses.Response`` reads."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": meta.id,
        "object": "response",
        "created_at": meta.created_at,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "background": False,
        "error": error,
        "incomplete_details": incomplete,
        "model": meta.model,
        "output": output,
        "previous_response_id": None,
        "store": False,
        "truncation": "disabled",
        "usage": usage_object(usage) if usage is not None else None,
        **meta.echo,
    }


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def output_text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(
    item_id: str, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    content = [] if text is None else [output_text_part(text, logprobs)]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def function_call_item(
    item_id: str,
    call: ToolCall,
    arguments: str,
    status: str,
    namespaces: dict[str, tuple[str, str]] | None = None,
) -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id or new_id("call_"),
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }
    if namespaces and call.name in namespaces:
        item["namespace"], item["name"] = namespaces[call.name]
    return item


def finish_status(finish: Finish) -> str:
    return "incomplete" if finish.reason == "length" else "completed"


def call_status(call: ToolCall) -> str:
    """A ``function_call`` item's status: ``incomplete`` when the token bound cut it off."""
    return "incomplete" if call.partial else "completed"


def error_code(status: int) -> str:
    # ResponseError.code is an enumeration; these are the ones that describe our failures
    # (a 4xx after output started: the request's own grammar gave out, docs/limits.md)
    if status == 429:
        return "rate_limit_exceeded"
    return "invalid_prompt" if 400 <= status < 500 else "server_error"


def encode_response(meta: ResponseMeta, collected: Collected) -> dict[str, Any]:
    """The whole response of a non-streaming request."""
    status = finish_status(collected.finish)
    output: list[dict[str, Any]] = []
    if collected.reasoning:
        output.append(reasoning_item(new_id("rs_"), collected.reasoning, "completed"))
    # a turn that only calls functions has no message item, as on the OpenAI API
    if collected.text or not collected.tool_calls:
        logprobs = content_logprobs(collected.logprobs)
        output.append(message_item(new_id("msg_"), collected.text, status, logprobs))
    for call in collected.tool_calls:
        output.append(
            function_call_item(
                new_id("fc_"), call, call.arguments, call_status(call), meta.namespaces
            )
        )
    return response_object(meta, status=status, output=output, usage=collected.finish.usage)


class ResponsesStreamEncoder:
    """Turns one request's events into the Responses SSE event sequence.

    Every frame carries ``type`` and a ``sequence_number`` counting from 0. Reasoning and
    reply text each stream as their own output item; function calls are buffered and
    streamed as items after the message item once generation finishes.
    """

    def __init__(self, meta: ResponseMeta) -> None:
        self.meta = meta
        self._seq = 0
        self._output: list[dict[str, Any]] = []  # closed items, by output_index
        self._open: dict[str, Any] | None = None  # the item currently streaming
        self._open_text: list[str] = []
        self._calls: list[ToolCall] = []
        self._saw_message = False
        self._pending: list[TokenLogprob] = []  # logprobs of tokens whose text is to come
        self._open_logprobs: list[dict[str, Any]] = []  # of the open message item

    def _frame(self, kind: str, payload: dict[str, Any]) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **payload}
        self._seq += 1
        return sse_event(kind, data)

    async def frames(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """The SSE frames of the whole stream."""
        skeleton = response_object(self.meta, status="in_progress", output=[])
        yield self._frame("response.created", {"response": skeleton})
        yield self._frame("response.in_progress", {"response": skeleton})
        async for event in events:
            if isinstance(event, TextDelta):
                for frame in self._text(event.text):
                    yield frame
            elif isinstance(event, ReasoningDelta):
                for frame in self._reasoning(event.text):
                    yield frame
            elif isinstance(event, ToolCallEvent):
                self._calls.append(event.call)
            elif isinstance(event, TokenLogprob):
                if not event.reasoning:
                    self._pending.append(event)
            elif isinstance(event, ErrorEvent):
                for frame in self._failed(event):
                    yield frame
                return
            elif isinstance(event, Finish):
                if event.reason == "cancelled":
                    return  # the client is gone or the server is stopping
                if event.reason == "error":  # a failure that sent no ErrorEvent of its own
                    for frame in self._failed(ErrorEvent("generation failed")):
                        yield frame
                    return
                for frame in self._finish(event):
                    yield frame
                return

    # -- items ----------------------------------------------------------------------------

    def _open_item(self, item: dict[str, Any], part: dict[str, Any]) -> list[bytes]:
        self._open = item
        self._open_text = []
        index = len(self._output)
        return [
            self._frame("response.output_item.added", {"output_index": index, "item": item}),
            self._frame(
                "response.content_part.added",
                {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part},
            ),
        ]

    def _close_item(self, status: str = "completed") -> list[bytes]:
        item = self._open
        if item is None:
            return []
        self._open = None
        text = "".join(self._open_text)
        index = len(self._output)
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], text, "completed")
            frames = [
                self._frame("response.reasoning_text.done", {**ids, "text": text}),
                self._frame(
                    "response.content_part.done",
                    {**ids, "part": {"type": "reasoning_text", "text": text}},
                ),
            ]
        else:
            logprobs = self._open_logprobs
            done = message_item(item["id"], text, status, logprobs)
            frames = [
                self._frame(
                    "response.output_text.done", {**ids, "text": text, "logprobs": logprobs}
                ),
                self._frame(
                    "response.content_part.done",
                    {**ids, "part": output_text_part(text, logprobs)},
                ),
            ]
        self._output.append(done)
        frames.append(
            self._frame("response.output_item.done", {"output_index": index, "item": done})
        )
        return frames

    def _reasoning(self, text: str) -> list[bytes]:
        if not text:
            return []
        frames: list[bytes] = []
        if self._open is None or self._open["type"] != "reasoning":
            frames += self._close_item()
            item = reasoning_item(new_id("rs_"), None, "in_progress")
            frames += self._open_item(item, {"type": "reasoning_text", "text": ""})
        assert self._open is not None
        self._open_text.append(text)
        frames.append(
            self._frame(
                "response.reasoning_text.delta",
                {
                    "item_id": self._open["id"],
                    "output_index": len(self._output),
                    "content_index": 0,
                    "delta": text,
                },
            )
        )
        return frames

    def _text(self, text: str) -> list[bytes]:
        if not text:
            return []
        frames: list[bytes] = []
        if self._open is None or self._open["type"] != "message":
            frames += self._close_item()
            frames += self._open_message()
        assert self._open is not None
        self._open_text.append(text)
        logprobs = content_logprobs(self._pending)
        self._pending.clear()
        self._open_logprobs += logprobs
        frames.append(
            self._frame(
                "response.output_text.delta",
                {
                    "item_id": self._open["id"],
                    "output_index": len(self._output),
                    "content_index": 0,
                    "delta": text,
                    "logprobs": logprobs,
                },
            )
        )
        return frames

    def _open_message(self) -> list[bytes]:
        self._saw_message = True
        item = message_item(new_id("msg_"), None, "in_progress")
        self._open_logprobs = []
        return self._open_item(item, output_text_part(""))

    def _call_frames(self, call: ToolCall) -> list[bytes]:
        index = len(self._output)
        item_id = new_id("fc_")
        added = function_call_item(item_id, call, "", "in_progress", self.meta.namespaces)
        done = {**added, "arguments": call.arguments, "status": call_status(call)}
        ids = {"item_id": item_id, "output_index": index}
        self._output.append(done)
        return [
            self._frame("response.output_item.added", {"output_index": index, "item": added}),
            self._frame("response.function_call_arguments.delta", {**ids, "delta": call.arguments}),
            self._frame(
                "response.function_call_arguments.done",
                {**ids, "name": added["name"], "arguments": call.arguments},
            ),
            self._frame("response.output_item.done", {"output_index": index, "item": done}),
        ]

    # -- the end --------------------------------------------------------------------------

    def _finish(self, finish: Finish) -> list[bytes]:
        status = finish_status(finish)
        frames: list[bytes] = []
        if self._open is not None and self._open["type"] == "reasoning":
            frames += self._close_item()
        # the SDK's output_text reads the message item, so an empty reply still gets one
        if self._open is None and not self._saw_message and not self._calls:
            frames += self._open_message()
        frames += self._close_item(status)
        for call in self._calls:
            frames += self._call_frames(call)
        response = response_object(
            self.meta, status=status, output=list(self._output), usage=finish.usage
        )
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        frames.append(self._frame(kind, {"response": response}))
        return frames

    def _failed(self, event: ErrorEvent) -> list[bytes]:
        output = list(self._output)
        if self._open is not None:
            text = "".join(self._open_text)
            if self._open["type"] == "reasoning":
                output.append(reasoning_item(self._open["id"], text, "incomplete"))
            else:
                output.append(message_item(self._open["id"], text, "incomplete"))
        code = error_code(event.status)
        error = {"code": code, "message": event.message}
        response = response_object(self.meta, status="failed", output=output, error=error)
        return [
            self._frame("error", {"code": code, "message": event.message, "param": None}),
            self._frame("response.failed", {"response": response}),
        ]
