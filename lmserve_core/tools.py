"""Tool-call conventions: how a family's model writes function calls, and how we read them.

A convention is an object a family declares (``Capabilities.tools``): it parses calls out of
streamed reply text, writes the llguidance grammar that forces calls, and shapes tool
declarations and history for the family's chat template. Two ship in the core:

- :data:`HERMES` — ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` regions, the
  convention of Qwen, Hermes and several other families. Text around the regions is reply
  content; a region whose JSON does not parse passes through as content, markers included.
- :data:`JSON_CALL` — a reply that is exactly one ``{"name": ..., "arguments": {...}}``
  object. Families without a convention of their own use it for forced calls: the grammar
  makes the model write the object, which becomes a tool call.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from .request import ToolCall

__all__ = [
    "HERMES",
    "JSON_CALL",
    "HermesConvention",
    "JsonCallConvention",
    "ToolCallParser",
    "ToolConvention",
    "call_id",
    "forced_call_grammar",
]


def call_id() -> str:
    """A fresh id for a call the model made (the dialects' encoders keep it)."""
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser(Protocol):
    """Reads one reply's calls out of its streamed text."""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Add text; return the content that is safe to emit now and the calls completed."""

    def flush(self) -> tuple[str, list[ToolCall]]:
        """The reply ended: return what was held back (content) and any last calls."""


class ToolConvention(Protocol):
    """A family's way of writing function calls."""

    name: str

    def parser(self) -> ToolCallParser:
        """A parser for one reply."""

    def forced_grammar(
        self, arguments: Sequence[tuple[str, dict[str, Any]]], parallel: bool, lenient: bool
    ) -> str:
        """A lark grammar (llguidance) whose sentences are exactly one call — or, with
        ``parallel``, one or more — of the named tools, each with arguments matching its
        JSON schema. ``arguments`` pairs each allowed tool's name with that schema;
        ``lenient`` skips schema keywords the grammar engine does not implement."""


# ---------------------------------------------------------------------------- hermes


def _parse_call(body: str) -> ToolCall | None:
    """A call from the JSON between the markers, or None when it is not one."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):  # some models quote the object; keep it if it is one
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(id=call_id(), name=data["name"], arguments=json.dumps(args, ensure_ascii=False))


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesParser:
    """Streams reply text, lifting out ``<tool_call>…</tool_call>`` regions.

    Only text that may still be the start of an opening marker is held back, plus trailing
    whitespace (it is content only if more text follows: whitespace that merely separates
    text from a call, or two calls, is dropped). Inside a region everything waits for the
    closing marker.
    """

    def __init__(self, open_marker: str = "<tool_call>", close_marker: str = "</tool_call>") -> None:
        self.open = open_marker
        self.close = close_marker
        self._buf = ""
        self._inside = False
        self._space = ""  # trailing whitespace held back
        self._gap = ""  # whitespace before the open region: text again if it is no call

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._inside:
                end = self._buf.find(self.close)
                if end < 0:
                    break
                body = self._buf[:end]
                self._buf = self._buf[end + len(self.close) :]
                self._inside = False
                call = _parse_call(body.strip())
                if call is None:  # not a call: the model's text, markers and all
                    out.append(self._gap + self.open + body + self.close)
                else:
                    calls.append(call)
                self._space = self._gap = ""
                continue
            start = self._buf.find(self.open)
            if start >= 0:
                before = self._space + self._buf[:start]
                text = before.rstrip()
                if text:
                    out.append(text)
                self._gap = before[len(text) :]
                self._space = ""
                self._buf = self._buf[start + len(self.open) :]
                self._inside = True
                continue
            keep = _partial_tail(self._buf, self.open)
            ready = self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep :]
            body = ready.rstrip()
            if body:
                out.append(self._space + body)
                self._space = ready[len(body) :]
            else:
                self._space += ready
            break
        return "".join(out), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        # an unclosed region is text, its marker included
        text = (self._gap + self.open if self._inside else self._space) + self._buf
        self._buf, self._inside, self._space, self._gap = "", False, "", ""
        return text, []


def _call_schema(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _json_rule(tools: Sequence[tuple[str, dict[str, Any]]], lenient: bool) -> str:
    schemas = [_call_schema(name, args) for name, args in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    # one fixed, readable layout: free whitespace lets small models pad forever
    options = {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
        "lenient": lenient,
    }
    return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


class HermesConvention:
    """``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` regions."""

    name = "hermes"

    def __init__(self, open_marker: str = "<tool_call>", close_marker: str = "</tool_call>") -> None:
        self.open = open_marker
        self.close = close_marker

    def parser(self) -> HermesParser:
        return HermesParser(self.open, self.close)

    def forced_grammar(
        self, arguments: Sequence[tuple[str, dict[str, Any]]], parallel: bool, lenient: bool
    ) -> str:
        repeat = ' ("\\n" call)*' if parallel else ""
        return (
            f"start: call{repeat}\n"
            f"call: {json.dumps(self.open)} \"\\n\" body \"\\n\" {json.dumps(self.close)}\n"
            f"body: {_json_rule(arguments, lenient)}\n"
        )


# ---------------------------------------------------------------------------- json object


class JsonCallParser:
    """A reply that is one ``{"name", "arguments"}`` object (a forced call's grammar wrote
    it); anything else is content."""

    def __init__(self) -> None:
        self._buf = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        return "", []

    def flush(self) -> tuple[str, list[ToolCall]]:
        text, self._buf = self._buf, ""
        call = _parse_call(text.strip())
        return ("", [call]) if call is not None else (text, [])


class JsonCallConvention:
    """Calls as a bare JSON object: forced calls on families without a convention."""

    name = "json"

    def parser(self) -> JsonCallParser:
        return JsonCallParser()

    def forced_grammar(
        self, arguments: Sequence[tuple[str, dict[str, Any]]], parallel: bool, lenient: bool
    ) -> str:
        # one object: a reply that is a bare object has no place for a second call
        return f"start: body\nbody: {_json_rule(arguments, lenient)}\n"


HERMES = HermesConvention()
JSON_CALL = JsonCallConvention()


def forced_call_grammar(
    convention: ToolConvention,
    tools: Iterable[Any],
    *,
    only: str | None = None,
    parallel: bool = True,
) -> str:
    """The grammar forcing a call of ``tools`` (``lmserve_core.request.Tool``), or of the one
    named ``only``, with arguments that validate against each tool's schema. Strict
    declarations are compiled as they are (a schema the grammar engine cannot honour is an
    error); for the others, keywords it does not implement are skipped, since non-strict
    semantics promise no more."""
    allowed = [t for t in tools if only is None or t.name == only]
    if not allowed:
        raise ValueError(f"no declared tool named {only!r}" if only else "no tools to call")
    arguments = [(t.name, _closed(t.parameters or {"type": "object"})) for t in allowed]
    return convention.forced_grammar(arguments, parallel, not all(t.strict for t in allowed))


def _closed(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others, unless it
    says otherwise: a tool's declared parameters are the arguments it takes (OpenAI's strict
    mode requires exactly this), and a grammar left open lets a model invent keys."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _closed(value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
