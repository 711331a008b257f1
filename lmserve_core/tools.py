"""Tool-call conventions: how a family's model writes function calls, and how we read them.

A convention is an object a family declares (``Capabilities.tools``): it parses calls out of
streamed reply text, writes the llguidance grammar that forces calls, and shapes tool
declarations and history for the family's chat template. Two ship in the core:

- :data:`HERMES` — ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` regions, the
  convention of Qwen, Hermes and several other families. Text around the regions is reply
  content; a region whose JSON does not parse passes through as content, markers included.
- :data:`QWEN_XML` — ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>…</function>
  </tool_call>`` regions (each part on its own line), the convention of Qwen3.5 and
  Qwen3-Coder. Values are bare text, typed by the declared parameter's schema; a region that
  is not such a call passes through as content.
- :data:`JSON_CALL` — a reply that is exactly one ``{"name": ..., "arguments": {...}}``
  object. Families without a convention of their own use it for forced calls: the grammar
  makes the model write the object, which becomes a tool call.

The region conventions share their streaming: :class:`MarkerRegionParser` finds the markers,
holds back only what may still become one, and hands each region's text to a subclass to
read (a plugin's convention of that shape subclasses it too).

A reply the token bound cuts off inside a call (:meth:`ToolCallParser.cut`) never hands the
call's notation on as text: the call comes back with ``partial`` set and the arguments
written so far as JSON text (maybe incomplete), or, when not even its tool can be told, not
at all.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

from .request import Tool, ToolCall

__all__ = [
    "HERMES",
    "JSON_CALL",
    "QWEN_XML",
    "HermesConvention",
    "HermesParser",
    "JsonCallConvention",
    "MarkerRegionParser",
    "QwenXmlConvention",
    "QwenXmlParser",
    "ToolCallParser",
    "ToolConvention",
    "call_id",
    "closed_schema",
    "forced_call_grammar",
    "parse_xml_call",
    "xml_value",
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


# ---------------------------------------------------------------------------- marker regions


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class MarkerRegionParser:
    """Streams reply text, lifting out calls written as ``OPEN…CLOSE`` regions.

    The streaming is this class's; a subclass says what a region holds by implementing
    :meth:`parse_region`, and may refine where a region ends with :meth:`close_at`.

    - Outside a region only text that may still become the opening marker is held back,
      plus trailing whitespace (it is content only if more text follows: whitespace that
      merely separates text from a call, or two calls, is dropped).
    - Inside a region everything waits for the closing marker; the text between the
      markers is given to :meth:`parse_region`. A call comes out as a call; a region that
      is not one passes through as content, markers included, with the whitespace that
      came before it.
    - A reply may hold any number of regions, with text before, between and after them.
    - :meth:`flush` at the end of the reply gives back what was held: trailing whitespace,
      a partial opening marker, or an unclosed region (as text, its marker included).
    - :meth:`cut`, when the token bound ended the reply, gives back trailing whitespace
      only: an unclosed region is a call (:meth:`cut_region`, partial unless all but its
      closing marker was written) or nothing, a partial opening marker is dropped.
    """

    def __init__(self, open_marker: str, close_marker: str) -> None:
        self.open = open_marker
        self.close = close_marker
        self._buf = ""  # outside: text not yet emitted; inside: the region so far
        self._inside = False
        self._space = ""  # trailing whitespace held back
        self._gap = ""  # whitespace before the open region: text again if it is no call
        self._scan = 0  # inside: where the search for the closing marker goes on
        self._in_span = False  # inside: within a span the closing marker may not end

    # ------------------------------------------------------------------ hooks

    def parse_region(self, body: str) -> ToolCall | None:
        """The call written between the markers (``body`` as it came, surrounding
        whitespace included), or None when it is not one: the region is then content."""
        raise NotImplementedError

    def close_at(self, region: str) -> int:
        """Where the closing marker starts in ``region``, the text after the opening
        marker so far, or -1 while it has not come. Called again, with the same text
        grown longer, as more arrives; :meth:`begin_region` starts each region afresh.
        This one takes the first closing marker; a subclass in whose regions the marker
        may be quoted text overrides it (and may keep its scan state between calls)."""
        at = region.find(self.close, self._scan)
        if at < 0:  # a marker that starts before this point would have been found whole
            self._scan = max(self._scan, len(region) - len(self.close) + 1)
        return at

    def cut_region(self, body: str) -> ToolCall | None:
        """The call begun in ``body``, an unclosed region the token bound cut off (the text
        after the opening marker, less any part of the closing one), as a partial call —
        ``partial`` set, the arguments written so far as JSON text — or None when not even
        the tool can be told. This one reads nothing; a subclass that can, overrides it."""
        return None

    def begin_region(self) -> None:
        """A region opened (or the reply ended): forget the previous one's scan state."""
        self._scan = 0
        self._in_span = False

    def close_outside(self, region: str, span_open: str, span_close: str) -> int:
        """:meth:`close_at` for regions whose spans from ``span_open`` to ``span_close``
        (quoted strings, parameter values) may hold the closing marker as text: the first
        closing marker outside every span."""
        i = self._scan
        while True:
            if self._in_span:
                j = region.find(span_close, i)
                if j < 0:
                    self._scan = max(i, len(region) - len(span_close) + 1)
                    return -1
                i, self._in_span = j + len(span_close), False
                continue
            start = region.find(span_open, i)
            close = region.find(self.close, i)
            if close >= 0 and (start < 0 or close < start):
                return close
            if start >= 0:
                i, self._in_span = start + len(span_open), True
                continue
            # a marker that starts before this point would have been found whole
            self._scan = max(i, len(region) - max(len(span_open), len(self.close)) + 1)
            return -1

    # ------------------------------------------------------------------ streaming

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._inside:
                end = self.close_at(self._buf)
                if end < 0:
                    break
                body = self._buf[:end]
                self._buf = self._buf[end + len(self.close) :]
                self._inside = False
                call = self.parse_region(body)
                if call is None:  # not a call: the model's text, markers and all
                    out.append(self._gap + self.open + body + self.close)
                else:
                    calls.append(call)
                self._space = self._gap = ""
                continue
            start = self._buf.find(self.open)
            if start >= 0:
                before = self._space + self._buf[:start]
                kept = before.rstrip()
                if kept:
                    out.append(kept)
                self._gap = before[len(kept) :]
                self._space = ""
                self._buf = self._buf[start + len(self.open) :]
                self._inside = True
                self.begin_region()
                continue
            keep = _partial_tail(self._buf, self.open)
            ready = self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep :]
            kept = ready.rstrip()
            if kept:
                out.append(self._space + kept)
                self._space = ready[len(kept) :]
            else:
                self._space += ready
            break
        return "".join(out), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        # an unclosed region is text, its marker included
        text = (self._gap + self.open if self._inside else self._space) + self._buf
        self._reset()
        return text, []

    def cut(self) -> tuple[str, list[ToolCall]]:
        if not self._inside:
            # whitespace held is the reply's; a marker begun is not
            text = "" if self._buf else self._space
            self._reset()
            return text, []
        body = self._buf[: len(self._buf) - _partial_tail(self._buf, self.close)]
        self._reset()
        call = self.parse_region(body) or self.cut_region(body)
        return "", [] if call is None else [call]

    def _reset(self) -> None:
        self._buf, self._inside, self._space, self._gap = "", False, "", ""
        self.begin_region()


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

    def __init__(self, open_marker: str = "<tool_call>", close_marker: str = "</tool_call>") -> None:
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
            f"call: {json.dumps(self.open)} \"\\n\" body \"\\n\" {json.dumps(self.close)}\n"
            f"body: {_json_rule(arguments, lenient)}\n"
        )


# ---------------------------------------------------------------------------- json object


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


# ---------------------------------------------------------------------------- qwen xml

XML_FUNCTION = "<function="
XML_FUNCTION_END = "</function>"
XML_PARAMETER = "<parameter="
XML_PARAMETER_END = "</parameter>"

_XML_NAME = re.compile(r"[^\s<>]+")  # a function name, as the opening tag can hold it
_XML_KEY = re.compile(r"[^<>\n]+")  # a parameter name
_JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
# the template writes a value that is not a string, list or mapping with Jinja's ``string``
# filter: Python's spelling of booleans and None
_PY_WORDS: dict[str, Any] = {"True": True, "False": False, "None": None}
_ANNOTATIONS = frozenset(
    {"type", "nullable", "description", "title", "default", "examples", "$comment", "deprecated"}
)
_NOT_JSON = object()


def json_type(value: Any, *, integral_floats: bool = False) -> str:
    """The JSON schema type of a parsed value; ``integral_floats``: a float with no fraction
    counts as an integer (JSON schema's own rule, which a schema check wants)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if integral_floats and value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list | tuple) else "object"


def _admits(types: Collection[str], value: Any) -> bool:
    """Whether a value of these JSON types may be ``value`` (an integral number is also
    an integer, any integer also a number)."""
    kind = json_type(value)
    if kind == "integer":
        return "integer" in types or "number" in types
    if kind == "number":
        return "number" in types or ("integer" in types and float(value).is_integer())
    return kind in types


def _resolve(root: Any, ref: str) -> Any:
    """The schema a local ``$ref`` (``#/...``) points to in ``root``, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _value_types(
    schema: Any, root: Any = None, seen: frozenset[str] = frozenset()
) -> frozenset[str]:
    """The JSON types a value of ``schema`` may have — every type when it does not say —
    looking through ``const``, ``enum``, ``anyOf``/``oneOf``, ``allOf`` and local ``$ref``s
    (those of ``root``, the tool's parameters schema)."""
    if not isinstance(schema, Mapping):
        return _JSON_TYPES
    if "const" in schema:
        return frozenset({json_type(schema["const"])})
    if isinstance(schema.get("enum"), list):
        return frozenset(json_type(v) for v in schema["enum"])
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = None if ref in seen else _resolve(root, ref)
        return _JSON_TYPES if target is None else _value_types(target, root, seen | {ref})
    for keyword in ("anyOf", "oneOf"):
        if isinstance(schema.get(keyword), list):
            return frozenset().union(*(_value_types(s, root, seen) for s in schema[keyword]))
    if isinstance(schema.get("allOf"), list):
        types = _JSON_TYPES
        for part in schema["allOf"]:
            types &= _value_types(part, root, seen)
        return types
    declared = schema.get("type")
    if isinstance(declared, str):
        kinds = {declared}
    elif isinstance(declared, list):
        kinds = {k for k in declared if isinstance(k, str)}
    elif "properties" in schema:
        kinds = {"object"}
    elif "items" in schema:
        kinds = {"array"}
    else:
        return _JSON_TYPES
    if schema.get("nullable") is True:
        kinds.add("null")
    if "number" in kinds:
        kinds.add("integer")
    return frozenset(kinds) & _JSON_TYPES


def _json_value(text: str) -> Any:
    """``text`` read as one JSON value (surrounding whitespace allowed), or ``_NOT_JSON``."""

    def no_constant(word: str) -> Any:
        raise ValueError(word)  # NaN and Infinity are no JSON

    try:
        return json.loads(text, parse_constant=no_constant)
    except (ValueError, RecursionError):
        return _NOT_JSON


def xml_value(text: str, types: Collection[str] = _JSON_TYPES) -> Any:
    """A parameter's value from the text between its tags (the newline after the opening
    tag and the one before the closing tag already taken off), typed by the JSON types its
    schema admits, as llama.cpp types it:

    - only strings: the text as it is;
    - no strings (numbers, booleans, objects, ...): the text read as JSON — and, for
      booleans and null, also as the template writes them from the history (``True``,
      ``False``, ``None``); text that is none of these stays a string;
    - strings and others (a schema that says nothing admits every type): a JSON value of
      one of the other types if the text is one, else the text (a JSON string literal,
      quotes and all, is text: the template writes strings bare).
    """
    if "string" in types and len(types) == 1:
        return text
    value = _json_value(text)
    if value is _NOT_JSON:
        word = _PY_WORDS.get(text.strip(), _NOT_JSON)
        if word is not _NOT_JSON and "string" not in types and _admits(types, word):
            return word
        return text
    if "string" in types and (isinstance(value, str) or not _admits(types, value)):
        return text
    return value


def parse_xml_call(body: str, tools: Mapping[str, Any] | None = None) -> ToolCall | None:
    """The call written between the ``<tool_call>`` markers — ``<function=NAME>``, its
    ``<parameter=KEY>…</parameter>`` blocks, ``</function>``, with whitespace around and
    between the parts — or None if the text is not one.

    ``tools`` maps each declared tool's name to its parameters' JSON schema: a call of a
    name not among them is then no call, and values are typed by their parameter's schema
    (:func:`xml_value`); without it any name is taken and every value is typed as a
    parameter whose schema says nothing. A parameter the schema does not declare is kept,
    typed likewise; one given twice keeps its last value; a required one missing is left
    to the caller to notice (the parser reads notation, it does not validate)."""
    text = body.strip()
    if not (text.startswith(XML_FUNCTION) and text.endswith(XML_FUNCTION_END)):
        return None
    end = len(text) - len(XML_FUNCTION_END)
    gt = text.find(">", len(XML_FUNCTION), end)
    if gt < 0:
        return None
    name = text[len(XML_FUNCTION) : gt]
    if not _XML_NAME.fullmatch(name) or (tools is not None and name not in tools):
        return None
    schema = tools.get(name) if tools is not None else None
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    if not isinstance(properties, Mapping):
        properties = {}
    arguments: dict[str, Any] = {}
    pos = gt + 1
    while True:
        while pos < end and text[pos] in " \t\r\n":
            pos += 1
        if pos == end:
            break
        if not text.startswith(XML_PARAMETER, pos):
            return None
        gt = text.find(">", pos + len(XML_PARAMETER), end)
        close = text.find(XML_PARAMETER_END, gt + 1, end) if gt >= 0 else -1
        if close < 0:
            return None
        key = text[pos + len(XML_PARAMETER) : gt]
        if not _XML_KEY.fullmatch(key):
            return None
        value = text[gt + 1 : close]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments.pop(key, None)  # a repeated parameter: the last one, in its place
        arguments[key] = xml_value(value, _value_types(properties.get(key, True), schema))
        pos = close + len(XML_PARAMETER_END)
    return ToolCall(id=call_id(), name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _cut_xml_value(text: str, types: frozenset[str]) -> str:
    """A parameter value cut off part way, as JSON text: an open string when the parameter
    may be one (the template writes strings bare), else the JSON written so far."""
    text = text[1:] if text.startswith("\n") else text
    text = text[: len(text) - _partial_tail(text, _XML_VALUE_END)]
    if "string" in types:
        return json.dumps(text, ensure_ascii=False)[:-1]
    return text


def cut_xml_call(body: str, tools: Mapping[str, Any] | None = None) -> ToolCall | None:
    """The partial call of an XML call cut off part way (what follows ``<tool_call>``): its
    tool (:func:`tool_named`) and its arguments as JSON text — the parameters written whole,
    typed as :func:`parse_xml_call` types them, then the one cut off (:func:`_cut_xml_value`),
    the object closed only once ``</function>`` was written. None when ``body`` does not begin
    such a call, or its tool cannot be told."""
    text = body.lstrip()
    if not text.startswith(XML_FUNCTION):
        if not XML_FUNCTION.startswith(text):
            return None
        text = XML_FUNCTION  # the tag itself is cut off
    gt = text.find(">", len(XML_FUNCTION))
    written = text[len(XML_FUNCTION) : gt if gt >= 0 else len(text)]
    name = tool_named(written, gt >= 0, None if tools is None else list(tools))
    if not name or not _XML_NAME.fullmatch(name) or (tools is not None and name not in tools):
        return None
    schema = tools.get(name) if tools is not None else None
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    if not isinstance(properties, Mapping):
        properties = {}
    members: list[str] = []
    closed = False
    pos = len(text) if gt < 0 else gt + 1
    while True:
        pos = _skip_space(text, pos)
        rest = text[pos:]
        if rest.startswith(XML_FUNCTION_END):
            closed = True
            break
        if not rest.startswith(XML_PARAMETER):
            if XML_PARAMETER.startswith(rest) or XML_FUNCTION_END.startswith(rest):
                break  # nothing more, or a tag cut off
            return None
        key_end = text.find(">", pos + len(XML_PARAMETER))
        if key_end < 0:
            break  # the parameter's name is cut off
        key = text[pos + len(XML_PARAMETER) : key_end]
        if not _XML_KEY.fullmatch(key):
            return None
        types = _value_types(properties.get(key, True), schema)
        close = text.find(XML_PARAMETER_END, key_end + 1)
        if close < 0:
            value = _cut_xml_value(text[key_end + 1 :], types)
            members.append(f"{json.dumps(key, ensure_ascii=False)}: {value}")
            break
        value = text[key_end + 1 : close]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        typed = json.dumps(xml_value(value, types), ensure_ascii=False)
        members.append(f"{json.dumps(key, ensure_ascii=False)}: {typed}")
        pos = close + len(XML_PARAMETER_END)
    arguments = "{" + ", ".join(members) + ("}" if closed else "") if gt >= 0 else ""
    return ToolCall(id=call_id(), name=name, arguments=arguments, partial=not closed)


class QwenXmlParser(MarkerRegionParser):
    """Streams reply text, lifting out calls in the XML notation of Qwen3.5 and Qwen3-Coder::

        <tool_call>
        <function=NAME>
        <parameter=KEY>
        VALUE
        </parameter>
        </function>
        </tool_call>

    (the streaming is :class:`MarkerRegionParser`'s, the reading :func:`parse_xml_call`'s).
    A value is the text between its tags less one newline at each end, typed by the
    parameter's schema in ``tools`` (:func:`xml_value`). Inside a ``<parameter=…>`` block
    everything up to ``</parameter>`` is the value, a ``</tool_call>`` in it included, as
    llama.cpp reads a value up to its closing tag.

    A call of a function ``tools`` does not declare is not a call: llama.cpp's parser only
    matches the declared names, and output it cannot match is no call there either; here,
    as for any malformed region, the region comes back as content, markers included. With
    no ``tools`` (None) every name is taken. A region the token bound cut off is a partial
    call (:func:`cut_xml_call`) or nothing. A ``<function=…>`` block outside
    ``<tool_call>`` markers (Qwen3-Coder sometimes leaves the opening marker out) is
    content.
    """

    def __init__(
        self,
        tools: Iterable[Tool] | None = None,
        open_marker: str = "<tool_call>",
        close_marker: str = "</tool_call>",
    ) -> None:
        super().__init__(open_marker, close_marker)
        self._tools = None if tools is None else {t.name: t.parameters or {} for t in tools}

    def parse_region(self, body: str) -> ToolCall | None:
        return parse_xml_call(body, self._tools)

    def cut_region(self, body: str) -> ToolCall | None:
        return cut_xml_call(body, self._tools)

    def close_at(self, region: str) -> int:
        # a parameter's value may hold the closing marker as text (code, for one)
        return self.close_outside(region, XML_PARAMETER, XML_PARAMETER_END)


# Free text for a string value: anything without the closing tag, then the closing tag.
_XML_TERMINALS = r"""
XTEXT: /(?s:.*)/ & ~/(?s:.*<\/parameter>.*)/
XSTR: XTEXT "\n</parameter>\n"
"""
_XML_VALUE_END = "\n" + XML_PARAMETER_END + "\n"
# Keywords on a tool's parameters object that the grammar does not express (it writes the
# declared parameters, required ones always, in their order).
_XML_OBJECT_UNSUPPORTED = (
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "not",
    "if",
    "patternProperties",
    "propertyNames",
    "minProperties",
    "maxProperties",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
)


def _lit(text: str) -> str:
    """A lark string literal (JSON syntax; the lark lexer also wants DEL escaped)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _bare(schema: Any, root: Any, seen: frozenset[str] = frozenset()) -> bool:
    """True when ``schema`` constrains nothing but a value's type (through ``anyOf``,
    ``oneOf`` and ``$ref``s too)."""
    if schema is True or schema == {}:
        return True
    if not isinstance(schema, Mapping):
        return False
    for key, sub in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key in ("anyOf", "oneOf") and isinstance(sub, list):
            if not all(_bare(s, root, seen) for s in sub):
                return False
        elif key == "$ref" and isinstance(sub, str) and sub not in seen:
            if not _bare(_resolve(root, sub), root, seen | {sub}):
                return False
        else:
            return False
    return True


class _XmlGrammar:
    """Writes the lark rules of calls in the XML notation."""

    def __init__(self, lenient: bool) -> None:
        self.lenient = lenient
        self.rules: list[str] = []
        self._count = 0

    def _rule(self, body: str) -> str:
        self._count += 1
        name = f"x{self._count}"
        self.rules.append(f"{name}: {body}")
        return name

    def _unsupported(self, what: str) -> None:
        if not self.lenient:
            raise ValueError(f"the grammar for XML tool calls cannot honour {what}")

    def function(self, name: str, schema: Any) -> str:
        """The rule for one tool's ``<function=NAME>…</function>\\n`` block: its declared
        parameters in their order, the required ones always, the others maybe."""
        if not _XML_NAME.fullmatch(name):
            raise ValueError(f"tool name {name!r} cannot be written in an XML tool call")
        if not isinstance(schema, Mapping):
            schema = {}
        declared = schema.get("type", "object")
        if declared != "object" and not (isinstance(declared, list) and "object" in declared):
            raise ValueError(f"the parameters of tool {name!r} are not an object")
        for keyword in _XML_OBJECT_UNSUPPORTED:
            if keyword in schema:
                self._unsupported(f"the {keyword!r} keyword on the parameters of {name!r}")
        properties = dict(schema.get("properties") or {})
        required = [r for r in schema.get("required") or [] if isinstance(r, str)]
        for key in required:
            properties.setdefault(key, True)
        parts = [_lit(f"{XML_FUNCTION}{name}>\n")]
        for key, sub in properties.items():
            needed = key in required
            if sub is False or not _XML_KEY.fullmatch(key):
                if needed:
                    raise ValueError(f"required parameter {key!r} cannot be written")
                continue
            opening = _lit(f"{XML_PARAMETER}{key}>\n")
            rule = self._rule(f"{opening} {self.value(sub, schema)}")
            parts.append(rule if needed else rule + "?")
        parts.append(_lit(XML_FUNCTION_END + "\n"))
        return self._rule(" ".join(parts))

    def value(self, schema: Any, root: Any) -> str:
        """What follows ``<parameter=KEY>\\n``: the value, then ``\\n</parameter>\\n``."""
        types = _value_types(schema, root)
        if isinstance(schema, Mapping) and (
            "const" in schema or isinstance(schema.get("enum"), list)
        ):
            return self._choices(schema, types)
        if "string" not in types:
            return f"{self._json(schema, root)} {_lit(_XML_VALUE_END)}"
        if len(types) > 1 or not isinstance(schema, Mapping) or schema.get("type") != "string":
            # Any text is a string, so the grammar leaves the value free, as llama.cpp's
            # does; the parser types it. Exact only if no type is constrained further.
            if not _bare(schema, root):
                self._unsupported("constraints beyond the type of a free-text parameter")
            return "XSTR"
        for keyword in ("pattern", "format"):
            if keyword in schema:
                self._unsupported(f"the {keyword!r} keyword on a string parameter")
        low, high = schema.get("minLength"), schema.get("maxLength")
        if low is None and high is None:
            return "XSTR"
        self._count += 1
        text, value = f"XTEXT{self._count}", f"XSTR{self._count}"
        span = f"{int(low or 0)},{'' if high is None else int(high)}"
        self.rules.append(f"{text}: /(?s:.{{{span}}})/ & ~/(?s:.*<\\/parameter>.*)/")
        self.rules.append(f"{value}: {text} {_lit(_XML_VALUE_END)}")
        return value

    def _choices(self, schema: Mapping[str, Any], types: frozenset[str]) -> str:
        """An enum or const: each value written as the template writes it (strings bare,
        others as JSON), those that read back as themselves."""
        values = [schema["const"]] if "const" in schema else list(schema["enum"])
        declared = _value_types({k: v for k, v in schema.items() if k not in ("const", "enum")})
        literals = []
        for v in values:
            if not _admits(declared, v):
                continue
            text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
            back = xml_value(text, types)
            if XML_PARAMETER_END not in text and json_type(back) == json_type(v) and back == v:
                literals.append(_lit(text + _XML_VALUE_END))
        if not literals:
            raise ValueError("no value of an enum can be written in an XML tool call")
        return "(" + " | ".join(dict.fromkeys(literals)) + ")"

    def _json(self, schema: Any, root: Any) -> str:
        """A value in JSON, as the template writes objects and arrays (and llguidance's
        JSON grammar checks it against the schema)."""
        body = dict(schema) if isinstance(schema, Mapping) else {}
        if isinstance(root, Mapping):
            for defs in ("$defs", "definitions"):  # local $refs point into the tool's schema
                if defs in root and defs not in body:
                    body[defs] = root[defs]
        options = {
            "whitespace_flexible": False,
            "item_separator": ", ",
            "key_separator": ": ",
            "lenient": self.lenient,
        }
        return self._rule(
            "%json " + json.dumps({**body, "x-guidance": options}, ensure_ascii=False)
        )


class QwenXmlConvention:
    """Qwen3.5's and Qwen3-Coder's XML calls (see :class:`QwenXmlParser`), written as their
    chat templates write them in the history::

        <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

    several calls one per line. The forced-call grammar writes each tool's declared
    parameters in the order of its schema's ``properties``, the required ones always; a
    string value is free text without ``</parameter>`` (an enum's values, or a length
    range, when the schema gives them), any other value JSON of its schema (llguidance's
    JSON grammar), a value that may be a string or more free text, as in llama.cpp."""

    name = "qwen_xml"

    def __init__(
        self, open_marker: str = "<tool_call>", close_marker: str = "</tool_call>"
    ) -> None:
        self.open = open_marker
        self.close = close_marker

    def parser(self, tools: Iterable[Tool] | None = None) -> QwenXmlParser:
        return QwenXmlParser(tools, self.open, self.close)

    def forced_grammar(
        self, arguments: Sequence[tuple[str, dict[str, Any]]], parallel: bool, lenient: bool
    ) -> str:
        if not arguments:
            raise ValueError("no tools to call")
        writer = _XmlGrammar(lenient)
        functions = [writer.function(name, schema) for name, schema in arguments]
        repeat = ' ("\\n" call)*' if parallel else ""
        opening = _lit(self.open + "\n")
        lines = [
            f"start: call{repeat}",
            f"call: {opening} ({' | '.join(functions)}) {_lit(self.close)}",
            *writer.rules,
        ]
        return "\n".join(lines) + "\n" + _XML_TERMINALS.lstrip()


HERMES = HermesConvention()
QWEN_XML = QwenXmlConvention()
JSON_CALL = JsonCallConvention()


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


# Where a JSON schema holds schemas: maps of them, single ones, lists of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONES = (
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def closed_schema(schema: Any, *, conjoined: bool = False) -> Any:
    """``schema`` with every object that lists its ``properties`` closed to others
    (``additionalProperties: false``) unless it says otherwise (``additionalProperties`` or
    ``unevaluatedProperties`` of its own): the declared properties are the keys an object
    has — OpenAI's strict mode requires exactly this — and a grammar left open lets a model
    invent keys, and repeat them, until the token bound. Objects that take part in an
    ``allOf`` (``conjoined``) stay as they are: each part names only some of the keys.
    Only schema positions are walked; ``const``, ``enum``, ``default`` and the like are
    values, left alone."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_ONES:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(sub, conjoined=key == "allOf") for sub in out[key]]
    if (
        "properties" in out
        and not conjoined
        and "allOf" not in out
        and "additionalProperties" not in out
        and "unevaluatedProperties" not in out
    ):
        out["additionalProperties"] = False
    return out
