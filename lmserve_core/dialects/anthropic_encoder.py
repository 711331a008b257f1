"""Backend events → Anthropic Messages JSON bodies and SSE frames."""

from __future__ import annotations

import json
from typing import Any

from ..events import ErrorEvent, Event, Finish, ReasoningDelta, TextDelta, ToolCallEvent, Usage
from ..request import ToolCall
from ..wire_errors import anthropic_error
from .common import Collected, sse_event

_DECODER = json.JSONDecoder()

STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "stop_sequence": "stop_sequence",
    "cancelled": "end_turn",
    "error": "end_turn",
}


def tool_use_id(call_id: str) -> str:
    """Anthropic-style id for a call; stable, so history round-trips match."""
    if call_id.startswith("toolu_"):
        return call_id
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(call: ToolCall) -> dict[str, Any] | None:
    """The call's arguments as a JSON object, or None when they are not one."""
    try:
        value = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def partial_input(text: str) -> dict[str, Any]:
    """The object a JSON text cut off part way had written so far, as a non-streaming
    ``tool_use`` block's ``input`` holds it: the members written whole, a string value cut
    off closed where it stops; a key, number or word cut off, and what is nested in it, left
    out. ``{}`` when not even the object was begun."""
    try:
        value = json.loads(text)
    except ValueError:
        pass
    else:
        return value if isinstance(value, dict) else {}
    stack: list[str] = []  # the open brackets' closers
    keyed: list[bool] = []  # per open container: True while an object expects a key
    best = ""  # the longest prefix that closes into valid JSON, closed
    pos, n = 0, len(text)
    while pos < n:
        ch = text[pos]
        if ch in " \t\r\n":
            pos += 1
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
            keyed.append(ch == "{")
            pos += 1
            best = text[:pos] + "".join(reversed(stack))
        elif ch in "}]":
            if not stack:
                break
            stack.pop()
            keyed.pop()
            pos += 1
            best = text[:pos] + "".join(reversed(stack))
        elif ch == ",":
            if keyed:
                keyed[-1] = stack[-1] == "}"
            pos += 1
        elif ch == ":":
            if keyed:
                keyed[-1] = False
            pos += 1
        elif ch == '"':
            try:
                _, end = _DECODER.raw_decode(text, pos)
            except ValueError:  # cut off inside the string
                if keyed and not keyed[-1]:  # a value: closed where it stops
                    for stop in range(n, max(n - 6, pos), -1):
                        closed = text[:stop] + '"' + "".join(reversed(stack))
                        try:
                            json.loads(closed)
                        except ValueError:
                            continue
                        best = closed
                        break
                break
            pos = end
            if keyed and not keyed[-1]:
                best = text[:pos] + "".join(reversed(stack))
        else:  # a number or a word: whole only when something follows it
            end = pos
            while end < n and text[end] not in " \t\r\n,:]}":
                end += 1
            if end == n:
                break
            pos = end
            best = text[:pos] + "".join(reversed(stack))
    try:
        value = json.loads(best) if best else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def usage_body(usage: Usage | None) -> dict[str, int]:
    """Anthropic counts input tokens EXCLUDING cache reads:
    total input = input_tokens + cache_read_input_tokens + cache_creation_input_tokens."""
    usage = usage or Usage()
    cached = min(usage.cached_tokens, usage.prompt_tokens)
    return {
        "input_tokens": usage.prompt_tokens - cached,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(finish: Finish, called_tool: bool) -> str:
    reason = STOP_REASONS.get(finish.reason, "end_turn")
    if called_tool and reason == "end_turn":
        return "tool_use"
    if reason == "tool_use" and not called_tool:
        return "end_turn"  # every call came back as text (unparseable arguments)
    return reason


def message_body(msg_id: str, model: str, out: Collected) -> dict[str, Any]:
    """The non-streaming ``message`` object."""
    content: list[dict[str, Any]] = []
    if out.reasoning:
        content.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    uses: list[dict[str, Any]] = []
    passthrough: list[str] = []
    for call in out.tool_calls:
        parsed = partial_input(call.arguments) if call.partial else tool_input(call)
        if parsed is None:
            passthrough.append(call.arguments)
        else:
            uses.append(
                {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": parsed}
            )
    # the text block is omitted only when it is empty and something else carries the reply
    if out.text or not (uses or passthrough):
        content.append({"type": "text", "text": out.text})
    content.extend({"type": "text", "text": text} for text in passthrough)
    content.extend(uses)
    finish = out.finish
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(finish, bool(uses)),
        "stop_sequence": finish.stop_sequence if finish.reason == "stop_sequence" else None,
        "usage": usage_body(finish.usage),
    }


class MessageStreamEncoder:
    """Turns one request's events into the Messages SSE event sequence.

    Blocks open lazily and close when an event of another kind arrives, so indexes
    increase from 0 in the order content was produced (thinking, text, tool_use ...).
    """

    def __init__(self, msg_id: str, model: str, *, input_tokens: int | None = None) -> None:
        self.msg_id = msg_id
        self.model = model
        # the prompt's tokens as the backend's validate counted them (None: not counted)
        self.input_tokens = input_tokens or 0
        self.index = -1
        self.open_kind: str | None = None  # "thinking" | "text" while a block is open
        self.called_tool = False
        self.done = False

    def start(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            # Known before generation; which of them the KV cache serves is decided when
            # generation starts, so cache reads are reported by message_delta.
            "usage": usage_body(Usage(prompt_tokens=self.input_tokens)),
        }
        return sse_event("message_start", {"type": "message_start", "message": message})

    def encode(self, event: Event) -> list[bytes]:
        if self.done:
            return []
        if isinstance(event, TextDelta):
            return self._delta("text", event.text) if event.text else []
        if isinstance(event, ReasoningDelta):
            return self._delta("thinking", event.text) if event.text else []
        if isinstance(event, ToolCallEvent):
            return self._tool_use(event.call)
        if isinstance(event, Finish):
            return self._finish(event)
        if isinstance(event, ErrorEvent):
            self.done = True
            return [sse_event("error", anthropic_error(event.status, event.message))]
        return []

    # -- blocks -----------------------------------------------------------------------

    def _open(self, block: dict[str, Any]) -> bytes:
        self.index += 1
        self.open_kind = block["type"]
        return sse_event(
            "content_block_start",
            {"type": "content_block_start", "index": self.index, "content_block": block},
        )

    def _close(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        frames = []
        if self.open_kind == "thinking":
            frames.append(self._block_delta({"type": "signature_delta", "signature": ""}))
        frames.append(
            sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        )
        self.open_kind = None
        return frames

    def _block_delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self.index, "delta": delta},
        )

    def _delta(self, kind: str, text: str) -> list[bytes]:
        frames: list[bytes] = []
        if self.open_kind != kind:
            frames += self._close()
            if kind == "thinking":
                frames.append(self._open({"type": "thinking", "thinking": "", "signature": ""}))
            else:
                frames.append(self._open({"type": "text", "text": ""}))
        if kind == "thinking":
            frames.append(self._block_delta({"type": "thinking_delta", "thinking": text}))
        else:
            frames.append(self._block_delta({"type": "text_delta", "text": text}))
        return frames

    def _tool_use(self, call: ToolCall) -> list[bytes]:
        if call.partial:
            # cut off by the token bound: the JSON written so far, as Anthropic streams it
            return self._tool_use_block(call, call.arguments)
        parsed = tool_input(call)
        if parsed is None:
            # unparseable arguments pass through as their own text block, as in the
            # non-streaming body
            if not call.arguments:
                return []
            return self._close() + self._delta("text", call.arguments)
        return self._tool_use_block(call, json.dumps(parsed, ensure_ascii=False))

    def _tool_use_block(self, call: ToolCall, arguments: str) -> list[bytes]:
        self.called_tool = True
        frames = self._close()
        frames.append(
            self._open(
                {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": {}}
            )
        )
        if arguments:
            frames.append(
                self._block_delta({"type": "input_json_delta", "partial_json": arguments})
            )
        frames.append(
            sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        )
        self.open_kind = None
        return frames

    def _finish(self, finish: Finish) -> list[bytes]:
        self.done = True
        frames = self._close()
        delta = {
            "stop_reason": stop_reason(finish, self.called_tool),
            "stop_sequence": finish.stop_sequence if finish.reason == "stop_sequence" else None,
        }
        frames.append(
            sse_event(
                "message_delta",
                {"type": "message_delta", "delta": delta, "usage": usage_body(finish.usage)},
            )
        )
        frames.append(sse_event("message_stop", {"type": "message_stop"}))
        return frames
