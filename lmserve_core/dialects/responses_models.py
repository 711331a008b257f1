"""Request bodies of the OpenAI Responses dialect (``POST /v1/responses``).

Fields are typed loosely where real clients send several shapes (string or item list,
string or object tool choice); unknown fields are ignored. Input items and tools stay
plain mappings because their shape depends on their ``type``, and an item's ``type`` may
be absent (a bare ``{role, content}`` message).
"""

from __future__ import annotations

from typing import Any

import msgspec


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
