"""The hermes convention: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` regions,
and the reading of such JSON calls, whole or cut off."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from ..request import Tool, ToolCall
from .convention import call_id
from .regions import MarkerRegionParser


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


_ARGUMENT_KEYS = ("arguments", "parameters")
_DECODER = json.JSONDecoder()


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _open_string(text: str) -> str:
    """The characters of a JSON string cut off after its opening quote (``text`` holds what
    follows the quote; an escape cut in two is left out)."""
    for end in range(len(text), max(len(text) - 6, -1), -1):
        try:
            return str(json.loads('"' + text[:end] + '"'))
        except ValueError:
            continue
    return ""


def tool_named(written: str, complete: bool, names: Collection[str] | None) -> str | None:
    """The tool a cut-off call names: the name written, when it was written whole; else the
    one declared tool whose name starts with what was written (None when there is no such
    one, or the declared tools are not known)."""
    if complete:
        return written
    if names is None:
        return None
    found = [name for name in names if name.startswith(written)]
    return found[0] if len(found) == 1 else None


def cut_json_call(body: str, names: Collection[str] | None = None) -> ToolCall | None:
    """The call of a ``{"name": ..., "arguments": ...}`` object cut off part way (surrounding
    whitespace allowed; nothing written yet too): its tool (:func:`tool_named`; ``names`` are
    the declared tools' names) and the arguments' text as written so far ("" when not
    begun), ``partial`` unless they were written whole. None when ``body`` does not begin
    such an object, or its tool cannot be told."""
    text = body.strip()
    if text and not text.startswith("{"):
        return None
    name, whole, arguments, written = "", False, "", False
    pos = 1
    while True:
        pos = _skip_space(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_space(text, pos + 1)
        if pos >= len(text) or text[pos] == "}":
            break
        try:
            key, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            break  # the key is cut off
        pos = _skip_space(text, pos)
        if not isinstance(key, str) or (pos < len(text) and text[pos] != ":"):
            return None
        pos = _skip_space(text, pos + 1)
        if pos >= len(text):
            break
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except ValueError:  # the value is cut off: the last thing written
            if key == "name" and text[pos] == '"':
                name = _open_string(text[pos + 1 :])
            elif key in _ARGUMENT_KEYS:
                arguments = text[pos:]
            break
        if key == "name":
            if not isinstance(value, str):
                return None
            name, whole = value, True
        elif key in _ARGUMENT_KEYS:
            # (a string: a quoted object, as some models write it)
            arguments = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            written = True
        pos = end
    tool = tool_named(name, whole, names)
    if not tool:
        return None
    return ToolCall(id=call_id(), name=tool, arguments=arguments, partial=not written)


class HermesParser(MarkerRegionParser):
    """Streams reply text, lifting out ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
    regions (the streaming is :class:`MarkerRegionParser`'s). A region whose JSON is not a
    call passes through as content, markers included; so does an unclosed one when the reply
    ends — unless the token bound ended it: then it is a partial call (:func:`cut_json_call`,
    ``tools`` naming the declared tools) or nothing."""

    def __init__(
        self,
        open_marker: str = "<tool_call>",
        close_marker: str = "</tool_call>",
        tools: Iterable[Tool] | None = None,
    ) -> None:
        super().__init__(open_marker, close_marker)
        self._names = None if tools is None else [t.name for t in tools]

    def parse_region(self, body: str) -> ToolCall | None:
        return _parse_call(body.strip())

    def cut_region(self, body: str) -> ToolCall | None:
        return cut_json_call(body, self._names)


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

    def __init__(
        self, open_marker: str = "<tool_call>", close_marker: str = "</tool_call>"
    ) -> None:
        self.open = open_marker
        self.close = close_marker

    def parser(self, tools: Iterable[Tool] | None = None) -> HermesParser:
        return HermesParser(self.open, self.close, tools)

    def forced_grammar(
        self, arguments: Sequence[tuple[str, dict[str, Any]]], parallel: bool, lenient: bool
    ) -> str:
        repeat = ' ("\\n" call)*' if parallel else ""
        return (
            f"start: call{repeat}\n"
            f'call: {json.dumps(self.open)} "\\n" body "\\n" {json.dumps(self.close)}\n'
            f"body: {_json_rule(arguments, lenient)}\n"
        )


HERMES = HermesConvention()
