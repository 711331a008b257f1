"""JSON-schema helpers of the conventions: value types a schema admits, local ``$ref``s, and
the closing of objects a forced call's grammar wants (:func:`closed_schema`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

_JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
_ANNOTATIONS = frozenset(
    {"type", "nullable", "description", "title", "default", "examples", "$comment", "deprecated"}
)


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


def resolve_ref(root: Any, ref: str) -> Any:
    """The schema a local ``$ref`` (``#/...``, JSON Pointer escapes) points to in ``root``,
    or None."""
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
        target = None if ref in seen else resolve_ref(root, ref)
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
