"""Request bodies of the OpenAI Responses dialect (``POST /v1/responses``).

Fields are typed loosely where real clients send several shapes (string or item list,
string or object tool choice); unknown fields are ignored. Input items, their content
parts, tools and object tool choices are tagged unions on ``type``, as in the other
dialects; types the server cannot serve are declared so the translation can refuse them
by name. The body keeps them as JSON objects on the wire, because an item's ``type`` may be
absent (a bare ``{role, content}`` message; a namespace's function tools) and a hosted
tool may be of any type: :func:`input_items`, :func:`tools_of` and :func:`tool_choice_of`
give the typed values, with a 400 naming the field for what does not fit.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from ..errors import InvalidRequest

# ---------------------------------------------------------------- content parts


class InputTextPart(Struct, tag_field="type", tag="input_text", kw_only=True):
    text: str


class OutputTextPart(Struct, tag_field="type", tag="output_text", kw_only=True):
    text: str


class TextPart(Struct, tag_field="type", tag="text", kw_only=True):
    text: str


class RefusalPart(Struct, tag_field="type", tag="refusal", kw_only=True):
    refusal: str | None = None


class InputImagePart(Struct, tag_field="type", tag="input_image", kw_only=True):
    pass


class InputFilePart(Struct, tag_field="type", tag="input_file", kw_only=True):
    pass


class InputAudioPart(Struct, tag_field="type", tag="input_audio", kw_only=True):
    pass


class ImageUrlPart(Struct, tag_field="type", tag="image_url", kw_only=True):
    pass


class FilePart(Struct, tag_field="type", tag="file", kw_only=True):
    pass


TEXT_PARTS = (InputTextPart, OutputTextPart, TextPart)
UNSUPPORTED_PARTS = (InputImagePart, InputFilePart, InputAudioPart, ImageUrlPart, FilePart)
ContentPart = (
    InputTextPart
    | OutputTextPart
    | TextPart
    | RefusalPart
    | InputImagePart
    | InputFilePart
    | InputAudioPart
    | ImageUrlPart
    | FilePart
)
# a message's content, a function call's output: a string, or text parts (bare strings too)
Content = str | list[str | ContentPart] | None


class ReasoningTextPart(Struct, kw_only=True):
    """A part of a reasoning item's ``content``; only ``reasoning_text`` parts are read."""

    type: str | None = None
    text: str | None = None


# ---------------------------------------------------------------- input items


class MessageItem(Struct, tag_field="type", tag="message", kw_only=True):
    role: str | None = None
    content: Content = None


class FunctionCallItem(Struct, tag_field="type", tag="function_call", kw_only=True):
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None  # a namespaced tool's call (its name is the tool's own)
    arguments: Any = "{}"  # JSON text; an object is taken as the arguments themselves


class FunctionCallOutputItem(Struct, tag_field="type", tag="function_call_output", kw_only=True):
    call_id: str | None = None
    output: Content = None


class ReasoningItem(Struct, tag_field="type", tag="reasoning", kw_only=True):
    # summaries and encrypted_content carry nothing a chat template could use
    content: list[ReasoningTextPart] | None = None


class ItemReference(Struct, tag_field="type", tag="item_reference", kw_only=True):
    id: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | ItemReference
ITEM_TYPES = frozenset(
    str(t.__struct_config__.tag)
    for t in InputItem.__args__  # type: ignore[attr-defined]
)

# ---------------------------------------------------------------- tools


class FunctionTool(Struct, tag_field="type", tag="function", kw_only=True):
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(Struct, tag_field="type", tag="namespace", kw_only=True):
    """A group of function tools the client runs under one name (Codex CLI's sub-agent tools):
    its ``tools`` are the functions (a child without a ``type`` is one); :func:`tools_of`
    lists its other children as hosted tools named ``<namespace>/<type>``."""

    name: str
    tools: list[FunctionTool] = msgspec.field(default_factory=list)


class HostedTool(Struct, kw_only=True):
    """A tool the provider would run (web search, code interpreter, ...): any other type."""

    type: str | None = None


DeclaredTool = FunctionTool | NamespaceTool | HostedTool

# ---------------------------------------------------------------- tool choice


class FunctionChoice(Struct, tag_field="type", tag="function", kw_only=True):
    name: str | None = None


class AllowedTool(Struct, kw_only=True):
    type: str | None = None
    name: str | None = None


class AllowedToolsChoice(Struct, tag_field="type", tag="allowed_tools", kw_only=True):
    mode: str = "auto"
    tools: list[AllowedTool] = msgspec.field(default_factory=list)


class HostedChoice(Struct, kw_only=True):
    """A choice forcing a hosted tool (any other type)."""

    type: str | None = None


def _convert(raw: Any, kind: Any, where: str) -> Any:
    """``raw`` as ``kind``; a 400 naming the field that does not fit."""
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        detail, _, path = str(exc).partition(" - at `$")
        param = where + path.rstrip("`")
        missing = detail.partition("missing required field `")[2].rstrip("`")
        if missing:
            param = f"{param}.{missing}"
        raise InvalidRequest(f"invalid '{param}': {detail}", param=param) from None


def _typed(raw: Any, default: str | None) -> tuple[str | None, Any]:
    """An object's ``type`` (``default`` when absent or empty) and the object tagged so."""
    if not isinstance(raw, dict):
        return None, raw
    kind = raw.get("type") or default
    if kind is not None and raw.get("type") != kind:
        raw = {**raw, "type": kind}
    return (kind if isinstance(kind, str) else None), raw


def input_items(items: list[Any]) -> list[InputItem]:
    """The typed input items (an item without a ``type`` is a message). An item of a type the
    server does not know is a 400 naming ``input[i].type``."""
    out: list[InputItem] = []
    for i, raw in enumerate(items):
        where = f"input[{i}]"
        kind, raw = _typed(raw, "message")
        if kind is None:
            raise InvalidRequest(f"'{where}' must be an object", param=where)
        if kind not in ITEM_TYPES:
            raise InvalidRequest(
                f"'{where}' has unsupported item type {kind!r}", param=f"{where}.type"
            )
        out.append(_convert(raw, InputItem, where))
    return out


def tools_of(tools: list[Any] | None) -> list[DeclaredTool]:
    """The typed ``tools``: functions, namespaces of functions, and hosted tools."""
    out: list[DeclaredTool] = []
    for i, raw in enumerate(tools or []):
        where = f"tools[{i}]"
        kind, raw = _typed(raw, None)
        if kind == "namespace":
            children = raw.get("tools")
            namespace: NamespaceTool = _convert({**raw, "tools": []}, NamespaceTool, where)
            hosted = []
            for j, child in enumerate(children if isinstance(children, list) else []):
                child_kind, child = _typed(child, "function")
                if child_kind == "function":
                    namespace.tools.append(_convert(child, FunctionTool, f"{where}.tools[{j}]"))
                else:
                    hosted.append(HostedTool(type=f"{namespace.name}/{child_kind}"))
            out += [namespace, *hosted]
        elif kind == "function":
            out.append(_convert(raw, FunctionTool, where))
        else:
            out.append(HostedTool(type=kind))
    return out


def tool_choice_of(
    choice: str | dict[str, Any],
) -> str | FunctionChoice | AllowedToolsChoice | HostedChoice:
    """The typed ``tool_choice``: a mode, a function, allowed tools or a hosted tool."""
    if isinstance(choice, str):
        return choice
    kind, raw = _typed(choice, None)
    if kind == "function":
        return _convert(raw, FunctionChoice, "tool_choice")  # type: ignore[no-any-return]
    if kind == "allowed_tools":
        return _convert(raw, AllowedToolsChoice, "tool_choice")  # type: ignore[no-any-return]
    return HostedChoice(type=kind)


class ResponsesTextFormat(msgspec.Struct, kw_only=True):
    """``text.format``: ``text``, ``json_object`` or ``json_schema``."""

    type: str = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponsesTextConfig(msgspec.Struct, kw_only=True):
    """``text``: the output format (``verbosity`` is accepted and ignored)."""

    format: ResponsesTextFormat | None = None
    verbosity: str | None = None


class ResponsesReasoning(msgspec.Struct, kw_only=True):
    """``reasoning``: ``effort`` switches the reasoning channel; ``summary`` is ignored."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The body of ``POST /v1/responses``."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    stream: bool | None = None
    text: ResponsesTextConfig | None = None
    reasoning: ResponsesReasoning | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # extensions (llama.cpp precedent)
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    regex: str | None = None
    lark: str | None = None
    diffusion: Any = None  # a block-diffusion model's sampler overrides
    # rejected when set: the server is stateless and samples one reply without logprobs
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    truncation: str | None = None
    n: int | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    prompt: dict[str, Any] | str | None = None
    # bookkeeping: accepted and ignored
    store: bool | None = None
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = None
