"""Reading calls in the XML notation of Qwen3.5 and Qwen3-Coder: whole, cut off, and streamed."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from ..request import Tool, ToolCall
from .convention import call_id
from .hermes import _skip_space, tool_named
from .regions import MarkerRegionParser, _partial_tail
from .schema import _JSON_TYPES, _admits, _value_types

XML_FUNCTION = "<function="
XML_FUNCTION_END = "</function>"
XML_PARAMETER = "<parameter="
XML_PARAMETER_END = "</parameter>"

_XML_NAME = re.compile(r"[^\s<>]+")  # a function name, as the opening tag can hold it
_XML_KEY = re.compile(r"[^<>\n]+")  # a parameter name
_XML_VALUE_END = "\n" + XML_PARAMETER_END + "\n"
# the template writes a value that is not a string, list or mapping with Jinja's ``string``
# filter: Python's spelling of booleans and None
_PY_WORDS: dict[str, Any] = {"True": True, "False": False, "None": None}
_NOT_JSON = object()


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
