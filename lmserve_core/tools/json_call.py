"""The JSON-object convention: a reply that is exactly one ``{"name", "arguments"}`` object."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..request import Tool, ToolCall
from .hermes import _json_rule, _parse_call, cut_json_call


class JsonCallParser:
    """A reply that is one ``{"name", "arguments"}`` object (a forced call's grammar wrote
    it); anything else is content. Cut off by the token bound, it is a partial call
    (:func:`cut_json_call`), never content."""

    def __init__(self, tools: Iterable[Tool] | None = None) -> None:
        self._buf = ""
        self._names = None if tools is None else [t.name for t in tools]

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        return "", []

    def flush(self) -> tuple[str, list[ToolCall]]:
        text, self._buf = self._buf, ""
        call = _parse_call(text.strip())
        return ("", [call]) if call is not None else (text, [])

    def cut(self) -> tuple[str, list[ToolCall]]:
        text, self._buf = self._buf, ""
        call = _parse_call(text.strip()) or cut_json_call(text, self._names)
        return "", [] if call is None else [call]


class JsonCallConvention:
    """Calls as a bare JSON object: forced calls on families without a convention."""

    name = "json"

    def parser(self, tools: Iterable[Tool] | None = None) -> JsonCallParser:
        return JsonCallParser(tools)

    def forced_grammar(
        self, arguments: Sequence[tuple[str, dict[str, Any]]], parallel: bool, lenient: bool
    ) -> str:
        # one object: a reply that is a bare object has no place for a second call
        return f"start: body\nbody: {_json_rule(arguments, lenient)}\n"


JSON_CALL = JsonCallConvention()
