"""The qwen_xml convention: the lark grammar that forces calls in the XML notation, and the
convention tying it to :class:`~lmserve_core.tools.xml_calls.QwenXmlParser`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..request import Tool
from .schema import _ANNOTATIONS, _admits, _value_types, json_type, resolve_ref
from .xml_calls import (
    _XML_KEY,
    _XML_NAME,
    _XML_VALUE_END,
    XML_FUNCTION,
    XML_FUNCTION_END,
    XML_PARAMETER,
    XML_PARAMETER_END,
    QwenXmlParser,
    xml_value,
)

# Free text for a string value: anything without the closing tag, then the closing tag.
_XML_TERMINALS = r"""
XTEXT: /(?s:.*)/ & ~/(?s:.*<\/parameter>.*)/
XSTR: XTEXT "\n</parameter>\n"
"""
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
            if not _bare(resolve_ref(root, sub), root, seen | {sub}):
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


QWEN_XML = QwenXmlConvention()
