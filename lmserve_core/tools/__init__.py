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

from .convention import ToolCallParser, ToolConvention, call_id, forced_call_grammar
from .hermes import HERMES, HermesConvention, HermesParser, cut_json_call, tool_named
from .json_call import JSON_CALL, JsonCallConvention, JsonCallParser
from .regions import MarkerRegionParser
from .schema import closed_schema, json_type, resolve_ref
from .xml_calls import QwenXmlParser, cut_xml_call, parse_xml_call, xml_value
from .xml_grammar import QWEN_XML, QwenXmlConvention

__all__ = [
    "HERMES",
    "JSON_CALL",
    "QWEN_XML",
    "HermesConvention",
    "HermesParser",
    "JsonCallConvention",
    "JsonCallParser",
    "MarkerRegionParser",
    "QwenXmlConvention",
    "QwenXmlParser",
    "ToolCallParser",
    "ToolConvention",
    "call_id",
    "closed_schema",
    "cut_json_call",
    "cut_xml_call",
    "forced_call_grammar",
    "json_type",
    "parse_xml_call",
    "resolve_ref",
    "tool_named",
    "xml_value",
]
