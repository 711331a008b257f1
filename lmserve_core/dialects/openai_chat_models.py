"""Request bodies of the OpenAI Chat Completions and legacy Completions endpoints.

Fields are typed loosely enough to take what real clients send (string-or-parts content,
JSON schemas as plain dicts); range checks and rejections happen in the translation step
so that the error names the offending field. Unknown fields are ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ContentPart(msgspec.Struct):
    """One element of an array ``content``; only ``text`` (and ``refusal``) parts carry text."""

    type: str
    text: str | None = None
    refusal: str | None = None


class FunctionCallIn(msgspec.Struct):
    name: str
    # JSON text per the API; some clients send the object itself.
    arguments: str | dict[str, Any] = ""


class ToolCallIn(msgspec.Struct):
    """A tool call of an earlier assistant turn."""

    id: str = ""
    type: str = "function"
    function: FunctionCallIn | None = None


class ChatMessage(msgspec.Struct):
    """One message of ``messages``; ``role`` is checked by the translator."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    function_call: Any = None  # legacy functions API: rejected
    audio: Any = None  # audio replies: rejected


class FunctionDecl(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDecl(msgspec.Struct):
    """An entry of ``tools``; only ``type: "function"`` is served."""

    type: str
    function: FunctionDecl | None = None


class NamedFunction(msgspec.Struct):
    name: str


class AllowedTools(msgspec.Struct):
    mode: str
    tools: list[dict[str, Any]] = []


class ToolChoiceObject(msgspec.Struct):
    """``{"type": "function", "function": {"name": ...}}`` or
    ``{"type": "allowed_tools", "allowed_tools": {"mode": ..., "tools": [...]}}``."""

    type: str
    function: NamedFunction | None = None
    allowed_tools: AllowedTools | None = None


class JsonSchemaFormat(msgspec.Struct):
    name: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints (OpenAI's and the llama.cpp extensions)."""

    model: str | None = None  # accepted and ignored: one process serves one model
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: ResponseFormat | None = None
    n: int | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    # llama.cpp extensions
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    regex: str | None = None
    lark: str | None = None
    # a block-diffusion model's sampler overrides (checked by dialects.common.diffusion_from)
    diffusion: Any = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    reasoning_effort: str | None = None
    tools: list[ToolDecl] | None = None
    tool_choice: str | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    web_search_options: Any = None
    moderation: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    # bookkeeping, accepted and ignored
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    verbosity: str | None = None
    prediction: Any = None


class CompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/completions`` (the legacy text-completion endpoint)."""

    prompt: str | list[Any]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None
