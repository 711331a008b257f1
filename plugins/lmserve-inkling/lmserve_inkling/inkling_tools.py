"""Inkling's reply blocks and its JSON tool invocation.

A reply is a run of blocks, each opened by ``<|message_model|>`` (the prompt wrote the first
one) and a content token, and closed by ``<|end_message|>``:

- ``<|content_text|>TEXT`` — visible text;
- ``<|content_thinking|>TEXT`` — reasoning (the leading one is routed by the think markers;
  one later in the reply passes as text, its marker included, as llama.cpp does when it
  does not extract reasoning);
- ``NAME<|content_invoke_tool_json|>{"name": NAME, "args": {...}}`` — a tool call.

``<|content_model_end_sampling|>`` ends the turn (a stop token: it never reaches the text).
:class:`InklingParser` reads the blocks while they stream: text blocks come out as text
without their markers, calls as calls; with ``calls`` off (no tools in play) a call block
passes as its name and JSON text. Text outside any block (a model that writes none) is text
as soon as it cannot be a tool's name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from lmserve_core.request import Tool, ToolCall
from lmserve_core.tools import call_id

MODEL = "<|message_model|>"
TEXT = "<|content_text|>"
THINKING = "<|content_thinking|>"
INVOKE = "<|content_invoke_tool_json|>"
END = "<|end_message|>"
END_SAMPLING = "<|content_model_end_sampling|>"
MARKERS = (MODEL, TEXT, THINKING, INVOKE, END)

_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
_OUT, _TEXT, _CALL = range(3)


def _held(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a marker."""
    start = text.rfind("<", max(0, len(text) - max(map(len, MARKERS))))
    while start >= 0:
        tail = text[start:]
        if any(m.startswith(tail) and m != tail for m in MARKERS):
            return len(tail)
        start = text.find("<", start + 1)
    return 0


def _first(text: str, markers: Sequence[str]) -> tuple[int, str]:
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else (-1, "")


def parse_invocation(name: str, body: str) -> ToolCall | None:
    """The call of a block ``NAME<|content_invoke_tool_json|>BODY``, or None when the body
    is not ``{"name": NAME, "args": {...}}``."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    called = data.get("name", name)
    args = data.get("args", data.get("arguments", {}))
    if not isinstance(called, str) or not called or not isinstance(args, dict):
        return None
    return ToolCall(id=call_id(), name=called, arguments=json.dumps(args, ensure_ascii=False))


class InklingParser:
    """Streams an Inkling reply's blocks (see the module's doc)."""

    def __init__(self, calls: bool = True) -> None:
        self.calls = calls
        self._buf = ""
        self._state = _OUT
        self._name = ""
        self._fresh = True  # between blocks: whitespace and opening markers are dropped

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        out: list[str] = []
        found: list[ToolCall] = []
        while True:
            if self._state == _TEXT:
                at, marker = _first(self._buf, (END, MODEL, THINKING))
                if at < 0:
                    keep = _held(self._buf)
                    out.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                out.append(self._buf[:at])
                self._buf = self._buf[at + (len(marker) if marker == END else 0) :]
                self._state, self._fresh = _OUT, True
                continue
            if self._state == _CALL:
                at = self._buf.find(END)
                if at < 0:
                    break
                body, self._buf = self._buf[:at], self._buf[at + len(END) :]
                self._state, self._fresh = _OUT, True
                self._invocation(body, out, found)
                continue
            # between blocks
            while self._fresh and (self._buf.startswith(MODEL) or self._buf[:1].isspace()):
                self._buf = self._buf[len(MODEL) if self._buf.startswith(MODEL) else 1 :]
            at, marker = _first(self._buf, MARKERS)
            head = self._buf[: len(self._buf) - _held(self._buf)] if at < 0 else self._buf[:at]
            if head and not _NAME.fullmatch(head):
                # not a tool's name: text outside a block, up to the next marker
                out.append(head)
                self._fresh = False
                self._buf = self._buf[len(head) :]
                continue
            if at < 0:
                break
            rest = self._buf[at + len(marker) :]
            if marker == INVOKE:
                self._name, self._buf, self._state = head, rest, _CALL
            elif marker == TEXT:
                out.append(head)
                self._buf, self._state = rest, _TEXT
            elif marker == THINKING:
                out.append(head + THINKING)
                self._buf, self._state = rest, _TEXT
            else:  # a stray end or opening marker
                out.append(head)
                self._buf, self._fresh = rest, True
        return "".join(out), found

    def _invocation(self, body: str, out: list[str], found: list[ToolCall]) -> None:
        call = parse_invocation(self._name, body.strip()) if self.calls else None
        if call is None:
            out.append(self._name + body)
        else:
            found.append(call)

    def flush(self) -> tuple[str, list[ToolCall]]:
        out: list[str] = []
        found: list[ToolCall] = []
        if self._state == _CALL:
            self._invocation(self._buf, out, found)
        elif self._state == _TEXT:
            out.append(self._buf)
        else:
            out.append(self._buf.strip() if self._fresh else self._buf)
        self._buf, self._state, self._fresh = "", _OUT, True
        return "".join(out), found

    def cut(self) -> tuple[str, list[ToolCall]]:
        if self._state != _CALL or not self.calls:
            self._buf = self._buf[: len(self._buf) - _held(self._buf)]  # a marker begun
            return self.flush()
        body, name = self._buf, self._name
        self._buf, self._state = "", _OUT
        whole = parse_invocation(name, body.strip())
        if whole is not None:
            return "", [whole]
        if not name:
            return "", []
        at = body.find('"args"')
        args = body[at + len('"args"') :].lstrip(" :") if at >= 0 else ""
        return "", [ToolCall(id=call_id(), name=name, arguments=args, partial=True)]


def _call_schema(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "args": arguments},
        "required": ["name", "args"],
        "additionalProperties": False,
    }


class InklingConvention:
    """``NAME<|content_invoke_tool_json|>{"name": NAME, "args": {...}}<|end_message|>``
    blocks; with ``calls`` off, a reader of the reply's blocks only."""

    name = "inkling"

    def __init__(self, calls: bool = True) -> None:
        self.calls = calls

    def parser(self, tools: Iterable[Tool] | None = None) -> InklingParser:
        return InklingParser(self.calls)

    def forced_grammar(
        self, arguments: Sequence[tuple[str, dict[str, Any]]], parallel: bool, lenient: bool
    ) -> str:
        """Exactly one call block (with ``parallel``, one or more, each later one opened by
        ``<|message_model|>``); the generation prompt opened the first. The JSON is written
        compact, as the chat template writes calls."""
        if not arguments:
            raise ValueError("no tools to call")
        options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":",
                   "lenient": lenient}
        calls = []
        rules = []
        for i, (name, schema) in enumerate(arguments):
            if not _NAME.fullmatch(name):
                raise ValueError(f"tool name {name!r} cannot be written in an Inkling call")
            body = {**_call_schema(name, schema), "x-guidance": options}
            rules.append(f"body{i}: %json {json.dumps(body, ensure_ascii=False)}")
            calls.append(f"{json.dumps(name)} {INVOKE} body{i} {END}")
        repeat = f" ({MODEL} call)*" if parallel else ""
        return "\n".join([f"start: call{repeat}", f"call: {' | '.join(calls)}", *rules]) + "\n"


INKLING_TOOLS = InklingConvention()
INKLING_BLOCKS = InklingConvention(calls=False)

if TYPE_CHECKING:
    from lmserve_core.tools import ToolConvention

    _CONVENTION: ToolConvention = INKLING_TOOLS
