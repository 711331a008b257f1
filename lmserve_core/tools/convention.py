"""What a tool-call convention is: a parser of streamed reply text and a writer of the
grammar that forces calls (:func:`forced_call_grammar` asks it for one)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from ..request import Tool, ToolCall
from .schema import closed_schema


def call_id() -> str:
    """A fresh id for a call the model made (the dialects' encoders keep it)."""
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser(Protocol):
    """Reads one reply's calls out of its streamed text."""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Add text; return the content that is safe to emit now and the calls completed."""

    def flush(self) -> tuple[str, list[ToolCall]]:
        """The reply ended: return what was held back (content) and any last calls."""

    def cut(self) -> tuple[str, list[ToolCall]]:
        """The token bound cut the reply off: :meth:`flush`, except that a call being written
        comes back as a call with ``partial`` set (its arguments the JSON written so far),
        and its notation, or a marker begun, is never content."""


class ToolConvention(Protocol):
    """A family's way of writing function calls."""

    name: str

    def parser(self, tools: Iterable[Tool] | None = None) -> ToolCallParser:
        """A parser for one reply. ``tools`` are the request's declared tools, for a
        convention whose reading of a call depends on their schemas (:data:`QWEN_XML`
        types argument values by them); None when they are not known."""

    def forced_grammar(
        self, arguments: Sequence[tuple[str, dict[str, Any]]], parallel: bool, lenient: bool
    ) -> str:
        """A lark grammar (llguidance) whose sentences are exactly one call — or, with
        ``parallel``, one or more — of the named tools, each with arguments matching its
        JSON schema. ``arguments`` pairs each allowed tool's name with that schema;
        ``lenient`` skips schema keywords the grammar engine does not implement."""


def forced_call_grammar(
    convention: ToolConvention,
    tools: Iterable[Any],
    *,
    only: str | None = None,
    parallel: bool = True,
    lenient: bool | None = None,
) -> str:
    """The grammar forcing a call of ``tools`` (``lmserve_core.request.Tool``), or of the one
    named ``only``, with arguments that validate against each tool's schema, its objects
    closed (:func:`closed_schema`). Strict declarations are compiled as they are (a schema
    the grammar engine cannot honour is an error); for the others, keywords it does not
    implement are skipped, since non-strict semantics promise no more. ``lenient`` True
    skips them for every tool."""
    allowed = [t for t in tools if only is None or t.name == only]
    if not allowed:
        raise ValueError(f"no declared tool named {only!r}" if only else "no tools to call")
    arguments = [(t.name, closed_schema(t.parameters or {"type": "object"})) for t in allowed]
    if lenient is None:
        lenient = not all(t.strict for t in allowed)
    return convention.forced_grammar(arguments, parallel, lenient)
