"""Gemma 4's tool-call convention: how its chat template declares tools and how the model
writes calls.

The template (llama.cpp's ``models/templates/google-gemma-4-31B-it.jinja``) writes, all with
no whitespace between the parts:

- declarations in the system turn:
  ``<|tool>declaration:NAME{description:…,parameters:…}<tool|>``;
- a call in a model turn: ``<|tool_call>call:NAME{key:value,…}<tool_call|>``, several calls
  back to back, keys in ``dictsort`` order (case-insensitive);
- a result after the calls: ``<|tool_response>response:NAME{value:…}<tool_response|>``.

The argument object is in Gemma's own notation (the template's ``format_argument`` with
``escape_keys=False``): keys bare, strings between ``<|"|>`` quotes with no escapes (a string
holds any text except the quote itself), numbers, ``true``, ``false`` and ``null`` bare,
objects ``{k:v,…}`` and arrays ``[v,…]`` nested. The template renders a ``None`` of the
history as ``None``; the parser reads it as null. A key may also be quoted (``<|"|>k<|"|>:``,
as the template writes keys with ``escape_keys=True``), and whitespace between the parts is
allowed, as llama.cpp's parser allows it.

``<|tool_call>``, ``<tool_call|>`` and ``<|"|>`` are single tokens of Gemma 4's vocabulary.
GGUF files store them as user-defined tokens (llama.cpp's converter makes them so, for the
text of a reply to keep them), so they decode as text and a grammar matches them as text:
the grammars below spell them as ordinary string literals. Where a grammar forces such a
literal, llguidance allows the vocabulary's tokenization of it, i.e. the marker token. The
model ends its turn after its calls with ``<|tool_response>``, a token that ends generation.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lmserve_core.request import ToolCall
from lmserve_core.tools import MarkerRegionParser, call_id, json_type, resolve_ref, tool_named

if TYPE_CHECKING:
    from lmserve_core.request import Tool
    from lmserve_core.tools import ToolConvention

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "GEMMA4_TOOLS",
    "QUOTE",
    "Gemma4Convention",
    "Gemma4Parser",
    "GemmaNotationError",
    "cut_call",
    "format_call",
    "format_value",
    "parse_call",
    "parse_value",
]

CALL_OPEN = "<|tool_call>"
CALL_CLOSE = "<tool_call|>"
QUOTE = '<|"|>'
_CALL = "call:"

# ---------------------------------------------------------------------------- notation


class GemmaNotationError(ValueError):
    """Text that is not a value in Gemma's argument notation."""


_SPACE = " \t\r\n"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_WORDS = (("true", True), ("false", False), ("null", None), ("None", None))
_KEY_END = re.compile(r"[:{}\[\],]")
_NAME = re.compile(r"[^\s{}\[\]<>,\"|]+")
# a bare key: no separator, bracket or double quote in it, no space around it
_BARE_KEY = re.compile(r'[^\s:{}\[\],"](?:[^:{}\[\],"]*[^\s:{}\[\],"])?')
_MAX_DEPTH = 256


class _Reader:
    """A recursive-descent reader of one value in Gemma's notation."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, what: str) -> GemmaNotationError:
        return GemmaNotationError(f"{what} at offset {self.pos}")

    def space(self) -> None:
        n = len(self.text)
        while self.pos < n and self.text[self.pos] in _SPACE:
            self.pos += 1

    def take(self, token: str) -> bool:
        if self.text.startswith(token, self.pos):
            self.pos += len(token)
            return True
        return False

    def string(self) -> str:
        # the opening quote was taken
        end = self.text.find(QUOTE, self.pos)
        if end < 0:
            raise self.fail("unterminated string")
        value = self.text[self.pos : end]
        self.pos = end + len(QUOTE)
        return value

    def value(self, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise self.fail("nesting too deep")
        self.space()
        if self.take(QUOTE):
            return self.string()
        if self.take("{"):
            return self.object(depth)
        if self.take("["):
            return self.array(depth)
        match = _NUMBER.match(self.text, self.pos)
        if match:
            self.pos = match.end()
            self.delimited()
            number = json.loads(match.group())
            if isinstance(number, float) and not math.isfinite(number):
                raise self.fail("number out of range")
            return number
        for word, value in _WORDS:
            if self.take(word):
                self.delimited()
                return value
        raise self.fail("expected a value")

    def delimited(self) -> None:
        """A bare number or word ends where a separator, a bracket or the text does."""
        if self.pos < len(self.text) and self.text[self.pos] not in _SPACE + ",}]":
            raise self.fail("unexpected character")

    def object(self, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self.space()
        if self.take("}"):
            return out
        while True:
            key = self.key()
            self.space()
            if not self.take(":"):
                raise self.fail("expected ':'")
            out[key] = self.value(depth + 1)
            self.space()
            if self.take("}"):
                return out
            if not self.take(","):
                raise self.fail("expected ',' or '}'")
            self.space()

    def key(self) -> str:
        if self.take(QUOTE):
            return self.string()
        match = _KEY_END.search(self.text, self.pos)
        end = match.start() if match else len(self.text)
        key = self.text[self.pos : end].strip(_SPACE)
        if not _bare(key) or match is None or match.group() != ":":
            raise self.fail("expected a key")
        self.pos = end
        return key

    def array(self, depth: int) -> list[Any]:
        out: list[Any] = []
        self.space()
        if self.take("]"):
            return out
        while True:
            out.append(self.value(depth + 1))
            self.space()
            if self.take("]"):
                return out
            if not self.take(","):
                raise self.fail("expected ',' or ']'")


def parse_value(text: str) -> Any:
    """The value ``text`` writes in Gemma's notation (surrounding whitespace allowed)."""
    reader = _Reader(text)
    try:
        value = reader.value()
    except RecursionError:
        raise reader.fail("nesting too deep") from None
    reader.space()
    if reader.pos != len(text):
        raise reader.fail("text after the value")
    return value


def parse_call(body: str) -> ToolCall | None:
    """The call written between the markers (``call:NAME{…}``), or None if it is not one."""
    if not body.startswith(_CALL):
        return None
    brace = body.find("{", len(_CALL))
    if brace < 0:
        return None
    name = body[len(_CALL) : brace]
    if not _NAME.fullmatch(name):
        return None
    try:
        arguments = parse_value(body[brace:])
    except GemmaNotationError:
        return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=call_id(), name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _json_prefix(text: str) -> str:
    """The JSON that a value in Gemma's notation cut off part way had written so far: token
    by token, a string (a key, quoted or bare, too) left open where it stops."""
    out: list[str] = []
    stack: list[str] = []  # the open brackets
    keyed: list[bool] = []  # per open bracket: True while an object expects a key
    pos, n = 0, len(text)
    while pos < n:
        ch = text[pos]
        if ch in _SPACE:
            pos += 1
        elif text.startswith(QUOTE, pos):
            end = text.find(QUOTE, pos + len(QUOTE))
            quoted = json.dumps(text[pos + len(QUOTE) : n if end < 0 else end], ensure_ascii=False)
            out.append(quoted if end >= 0 else quoted[:-1])
            pos = n if end < 0 else end + len(QUOTE)
        elif ch in "{[":
            out.append(ch)
            stack.append(ch)
            keyed.append(ch == "{")
            pos += 1
        elif ch in "}]":
            out.append(ch)
            if stack:
                stack.pop()
                keyed.pop()
            pos += 1
        elif ch in ",:":
            out.append(ch + " ")
            if stack:
                keyed[-1] = ch == "," and stack[-1] == "{"
            pos += 1
        elif keyed and keyed[-1]:  # a bare key
            match = _KEY_END.search(text, pos)
            end = match.start() if match else n
            key = json.dumps(text[pos:end].strip(_SPACE), ensure_ascii=False)
            out.append(key if match else key[:-1])
            pos = end
        else:  # a number or a word
            end = pos
            while end < n and text[end] not in _SPACE + ",}]":
                end += 1
            out.append("null" if text[pos:end] == "None" else text[pos:end])
            pos = end
    return "".join(out)


def cut_call(body: str, names: Sequence[str] | None = None) -> ToolCall | None:
    """The partial call of a ``call:NAME{…}`` cut off part way: its tool (``tool_named``,
    ``names`` the declared tools' names) and its arguments as the JSON written so far
    (:func:`_json_prefix`; "" before the ``{``). None when ``body`` does not begin such a
    call, or its tool cannot be told."""
    if not body.startswith(_CALL):
        if not _CALL.startswith(body):
            return None
        body = _CALL
    brace = body.find("{", len(_CALL))
    written = body[len(_CALL) : brace if brace >= 0 else len(body)]
    name = tool_named(written, brace >= 0, names)
    if not name or not _NAME.fullmatch(name):
        return None
    arguments = _json_prefix(body[brace:]) if brace >= 0 else ""
    return ToolCall(id=call_id(), name=name, arguments=arguments, partial=True)


def _dictsort(items: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Jinja's ``dictsort``: by key, case-insensitively, ties in their given order."""
    return sorted(items, key=lambda item: item[0].lower() if isinstance(item[0], str) else item[0])


def format_value(value: Any) -> str:
    """``value`` in Gemma's notation, as the template's ``format_argument`` writes it in a call
    (keys bare and in ``dictsort`` order; ``null`` for None)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{format_value(v)}" for k, v in _dictsort(value.items())) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if isinstance(value, int | float):
        return json.dumps(value)
    raise TypeError(f"no Gemma notation for {type(value).__name__}")


def format_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The call as the template writes it in a model turn, markers included."""
    return f"{CALL_OPEN}{_CALL}{name}{format_value(dict(arguments))}{CALL_CLOSE}"


# ---------------------------------------------------------------------------- streaming


class Gemma4Parser(MarkerRegionParser):
    """Streams reply text, lifting out ``<|tool_call>call:NAME{…}<tool_call|>`` regions (the
    streaming is :class:`~lmserve_core.tools.MarkerRegionParser`'s: text outside the regions
    is content, only what may still become the opening marker held back). Inside a region a
    closing marker within a ``<|"|>`` string is string text. A region that is not a call
    passes through as content, markers included; so does an unclosed one when the reply
    ends — unless the token bound ended it: then it is a partial call (:func:`cut_call`,
    ``tools`` naming the declared tools) or nothing.
    """

    def __init__(self, tools: Iterable[Tool] | None = None) -> None:
        super().__init__(CALL_OPEN, CALL_CLOSE)
        self._names = None if tools is None else [t.name for t in tools]

    def parse_region(self, body: str) -> ToolCall | None:
        return parse_call(body.strip())

    def cut_region(self, body: str) -> ToolCall | None:
        return cut_call(body.strip(), self._names)

    def close_at(self, region: str) -> int:
        # a quoted string may hold the closing marker as text
        return self.close_outside(region, QUOTE, QUOTE)


# ---------------------------------------------------------------------------- grammar

# Keywords that constrain values in ways the notation grammar does not express. A strict
# declaration using one cannot be honoured (an error); a non-strict one has it skipped.
_UNSUPPORTED = frozenset(
    {
        "pattern",
        "format",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "prefixItems",
        "not",
        "if",
        "then",
        "else",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedProperties",
        "unevaluatedItems",
    }
)
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")

# The generic value: any value in the notation, keys of a plain identifier form. Numbers
# have bounded digits: every one is a finite double (and a model cannot write digits forever).
_GENERIC = r"""
gvalue: GSTR | GNUM | "true" | "false" | "null" | gobject | garray
gobject: "{" (gpair ("," gpair)*)? "}"
gpair: GKEY ":" gvalue
garray: "[" (gvalue ("," gvalue)*)? "]"
GKEY: /[A-Za-z_$][A-Za-z0-9_$.\-]*/
"""
_TERMINALS = r"""
GSTR: GQUOTE GTEXT GQUOTE
GTEXT: /(?s:.*)/ & ~/(?s:.*<\|"\|>.*)/
GQUOTE: /<\|"\|>/
GNUM: /-?(?:0|[1-9][0-9]{0,15})(?:\.[0-9]{1,16})?(?:[eE][+-]?[0-9]{1,2})?/
GINT: /-?(?:0|[1-9][0-9]{0,18})/
"""


def _lit(text: str) -> str:
    """A lark string literal (JSON syntax; the lark lexer also wants DEL escaped)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")




def _has_type(value: Any, types: Sequence[str]) -> bool:
    kind = json_type(value, integral_floats=True)
    return kind in types or (kind == "integer" and "number" in types)


def _representable(value: Any) -> bool:
    if isinstance(value, str):
        return QUOTE not in value
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _bare(k) and _representable(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(_representable(v) for v in value)
    return value is None or isinstance(value, bool | int)


def _bare(key: str) -> bool:
    """True when ``key`` reads back as itself written bare (``key:``)."""
    return bool(_BARE_KEY.fullmatch(key))


def _key(name: str) -> str | None:
    """The literal that writes a declared property's key: bare as the template writes keys,
    quoted when bare would not read back; None when neither would."""
    if _bare(name):
        return _lit(name + ":")
    if QUOTE not in name:
        return _lit(QUOTE + name + QUOTE + ":")
    return None


def _merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Two schemas that both apply, as one: properties joined, required lists united, other
    keywords of ``extra`` over those of ``base``."""
    out = dict(base)
    for key, value in extra.items():
        if key == "properties" and isinstance(out.get(key), Mapping) and isinstance(value, Mapping):
            out[key] = {**out[key], **value}
        elif key == "required" and isinstance(out.get(key), list) and isinstance(value, list):
            out[key] = list(dict.fromkeys([*out[key], *value]))
        else:
            out[key] = value
    return out


class _GrammarWriter:
    """Writes lark rules for values of JSON schemas in Gemma's notation."""

    def __init__(self, lenient: bool) -> None:
        self.lenient = lenient
        self.rules: list[str] = []
        self._memo: dict[str, str] = {}
        self._root: Any = None
        self._tool = 0
        self._count = 0

    def arguments(self, index: int, schema: Any) -> str:
        """The rule for one tool's argument object."""
        self._tool, self._root = index, schema
        if isinstance(schema, Mapping) and not any(
            k in schema for k in ("type", "anyOf", "oneOf", "allOf", "$ref", "enum", "const")
        ):
            schema = {**schema, "type": "object"}
        return self.value(schema)

    def _name(self) -> str:
        self._count += 1
        return f"v{self._count}"

    def _rule(self, body: str) -> str:
        name = self._name()
        self.rules.append(f"{name}: {body}")
        return name

    def _unsupported(self, what: str) -> None:
        if not self.lenient:
            raise ValueError(f"the grammar for Gemma 4 calls cannot honour {what}")

    def value(self, schema: Any) -> str:
        """A rule (or terminal) whose sentences are the values ``schema`` admits."""
        if schema is True or schema == {}:
            return "gvalue"
        if schema is False:
            raise ValueError("a schema admits no value (false)")
        if not isinstance(schema, Mapping):
            raise ValueError(f"not a JSON schema: {schema!r}")
        key = f"{self._tool}:" + json.dumps(schema, sort_keys=True, default=repr)
        if key in self._memo:
            return self._memo[key]
        name = self._name()
        self._memo[key] = name  # before the body: a $ref may come back here
        self.rules.append(f"{name}: {self._body(schema)}")
        return name

    def _body(self, schema: Mapping[str, Any]) -> str:
        for keyword in schema:
            if keyword in _UNSUPPORTED:
                self._unsupported(f"the {keyword!r} keyword")
        if "$ref" in schema:
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            target = self._resolve(schema["$ref"])
            if target is None:
                return "gvalue"
            if not any(k not in ("description", "title", "$defs", "definitions") for k in rest):
                return self.value(target)
            return self.value(_merge(target, rest) if isinstance(target, Mapping) else rest)
        if "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                if isinstance(part, Mapping) and "$ref" in part:
                    resolved = self._resolve(part["$ref"])
                    part = resolved if isinstance(resolved, Mapping) else {}
                if isinstance(part, Mapping):
                    merged = _merge(merged, part)
            return self._body(merged)
        for keyword in ("anyOf", "oneOf"):
            if keyword in schema:
                rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
                branches = [
                    self.value(_merge(rest, branch) if isinstance(branch, Mapping) else branch)
                    for branch in schema[keyword]
                    if branch is not False
                ]
                if not branches:
                    raise ValueError(f"an empty {keyword}")
                return " | ".join(branches)
        types = schema.get("type")
        type_list = [types] if isinstance(types, str) else list(types or [])
        if schema.get("nullable") is True and type_list and "null" not in type_list:
            type_list.append("null")
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else list(schema["enum"])
            if type_list:
                values = [v for v in values if _has_type(v, type_list)]
            literals = [_lit(format_value(v)) for v in values if _representable(v)]
            if not literals:
                raise ValueError("no value of the enum can be written in Gemma's notation")
            return " | ".join(dict.fromkeys(literals))
        if not type_list:
            if any(k in schema for k in ("properties", "required", "additionalProperties")):
                type_list = ["object"]
            elif any(k in schema for k in ("items", "minItems", "maxItems")):
                type_list = ["array"]
            else:
                return "gvalue"
        if len(type_list) > 1:
            return " | ".join(
                self.value({**schema, "type": t, "nullable": False}) for t in type_list
            )
        kind = type_list[0]
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            return self._array(schema)
        if kind == "string":
            return self._string(schema)
        if kind in ("number", "integer"):
            bounds = {k: schema[k] for k in _NUMBER_BOUNDS if k in schema}
            if not bounds:
                return "GINT" if kind == "integer" else "GNUM"
            # JSON and Gemma's notation write numbers alike
            options = {"whitespace_flexible": False, "lenient": self.lenient}
            body = {"type": kind, **bounds, "x-guidance": options}
            return self._rule("%json " + json.dumps(body))
        if kind == "boolean":
            return '"true" | "false"'
        if kind == "null":
            return '"null"'
        raise ValueError(f"unknown type {kind!r} (one of {', '.join(_TYPES)})")

    def _resolve(self, ref: Any) -> Any:
        node = resolve_ref(self._root, ref) if isinstance(ref, str) else None
        if node is None:
            self._unsupported(f"the reference {ref!r}")
        return node

    def _object(self, schema: Mapping[str, Any]) -> str:
        props = dict(schema.get("properties") or {})
        required = [r for r in schema.get("required") or [] if isinstance(r, str)]
        for name in required:
            props.setdefault(name, {})
        extra = schema.get("additionalProperties", True)
        if not props:
            if "properties" in schema or extra is False:
                return '"{}"'
            if isinstance(extra, Mapping) and extra:
                pair = f'GKEY ":" {self.value(extra)}'
                return f'"{{" ({pair} ("," {pair})*)? "}}"'
            return "gobject"
        # A fixed order, the one the template writes arguments in; keys besides the declared
        # ones are never written (the grammar admits fewer objects, never a wrong one).
        items: list[tuple[str, bool]] = []
        for name, sub in _dictsort(props.items()):
            key = _key(name)
            if sub is False or key is None:
                if name in required:
                    raise ValueError(f"required property {name!r} cannot be written")
                continue
            items.append((f"{key} {self.value(sub)}", name in required))
        if not items:
            return '"{}"'
        tails: dict[int, str] = {len(items): ""}

        def tail(i: int) -> str:
            """The properties from the i-th on, after one was written."""
            if i not in tails:
                item, needed = items[i]
                step = f'"," {item}' if needed else f'("," {item})?'
                tails[i] = self._rule(f"{step} {tail(i + 1)}".rstrip())
            return tails[i]

        # the first property written: a required one, or an optional one before it
        firsts: list[str] = []
        for i, (item, needed) in enumerate(items):
            firsts.append(f"{item} {tail(i + 1)}".rstrip())
            if needed:
                return f'"{{" ({" | ".join(firsts)}) "}}"'
        return f'"{{" ({" | ".join(firsts)})? "}}"'

    def _array(self, schema: Mapping[str, Any]) -> str:
        items = schema.get("items", True)
        if isinstance(items, list):  # the old tuple form
            self._unsupported("'items' as a list")
            items = True
        low = int(schema.get("minItems", 0) or 0)
        high = schema.get("maxItems")
        high = None if high is None else int(high)
        if items is False or high == 0:
            if low > 0:
                raise ValueError("an array that needs items but admits none")
            return '"[]"'
        if high is not None and high < low:
            raise ValueError(f"minItems {low} is above maxItems {high}")
        item = self.value(items)
        more_low = max(low - 1, 0)
        more = (
            f'("," {item})*'
            if high is None and more_low == 0
            else f'("," {item}){{{more_low},{"" if high is None else high - 1}}}'
        )
        elements = f"{item} {more}"
        return f'"[" {elements} "]"' if low > 0 else f'"[" ({elements})? "]"'

    def _string(self, schema: Mapping[str, Any]) -> str:
        low = schema.get("minLength")
        high = schema.get("maxLength")
        if low is None and high is None:
            return "GSTR"
        span = f"{int(low or 0)},{'' if high is None else int(high)}"
        self._count += 1
        text, name = f"GTEXT{self._count}", f"GSTR{self._count}"
        self.rules.append(f'{text}: /(?s:.{{{span}}})/ & ~/(?s:.*<\\|"\\|>.*)/')
        self.rules.append(f"{name}: GQUOTE {text} GQUOTE")
        return name


class Gemma4Convention:
    """Gemma 4's ``<|tool_call>call:NAME{key:value,…}<tool_call|>`` calls."""

    name = "gemma4"

    def parser(self, tools: Iterable[Tool] | None = None) -> Gemma4Parser:
        return Gemma4Parser(tools)

    def forced_grammar(
        self, arguments: Sequence[tuple[str, dict[str, Any]]], parallel: bool, lenient: bool
    ) -> str:
        """Exactly one call — with ``parallel``, one or more back to back, as the template
        writes them — of the named tools, in the template's layout: no whitespace, declared
        properties in ``dictsort`` order, required ones always and optional ones maybe."""
        if not arguments:
            raise ValueError("no tools to call")
        writer = _GrammarWriter(lenient)
        tools = []
        for index, (name, schema) in enumerate(arguments):
            if not _NAME.fullmatch(name):
                raise ValueError(f"tool name {name!r} cannot be written in a Gemma 4 call")
            tools.append(f"{_lit(name)} {writer.arguments(index, schema)}")
        lines = [
            f"start: call{'+' if parallel else ''}",
            f"call: {_lit(CALL_OPEN + _CALL)} ({' | '.join(tools)}) {_lit(CALL_CLOSE)}",
            *writer.rules,
        ]
        return "\n".join(lines) + "\n" + _GENERIC.strip() + "\n" + _TERMINALS.strip() + "\n"


GEMMA4_TOOLS = Gemma4Convention()

if TYPE_CHECKING:
    _CONVENTION: ToolConvention = GEMMA4_TOOLS
