"""Request bodies of the Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``).

Fields are typed as loosely as real clients need; unknown fields (``cache_control``,
``citations``, ``defer_loading``, ...) are ignored. Content blocks are a tagged union on
``type``: block types the server cannot serve (images, search results, server-tool results)
are still declared so the translation can reject them with a message naming the block type.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

# ---------------------------------------------------------------- content blocks


class TextBlock(Struct, tag_field="type", tag="text", kw_only=True):
    text: str


class ImageBlock(Struct, tag_field="type", tag="image", kw_only=True):
    source: dict[str, Any] | None = None


class DocumentBlock(Struct, tag_field="type", tag="document", kw_only=True):
    """A document: ``source`` is checked by the translation, which serves the ``text`` and
    ``content`` sources and names the field of any other."""

    source: dict[str, Any] | None = None
    title: str | None = None
    context: str | None = None


class SearchResultBlock(Struct, tag_field="type", tag="search_result", kw_only=True):
    source: str | None = None


class ToolReferenceBlock(Struct, tag_field="type", tag="tool_reference", kw_only=True):
    tool_name: str | None = None


class ThinkingBlock(Struct, tag_field="type", tag="thinking", kw_only=True):
    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlock(Struct, tag_field="type", tag="redacted_thinking", kw_only=True):
    data: str = ""


class ToolUseBlock(Struct, tag_field="type", tag="tool_use", kw_only=True):
    id: str
    name: str
    input: Any = None


ToolResultContentBlock = (
    TextBlock | ImageBlock | DocumentBlock | SearchResultBlock | ToolReferenceBlock
)


class ToolResultBlock(Struct, tag_field="type", tag="tool_result", kw_only=True):
    tool_use_id: str
    content: str | list[ToolResultContentBlock] | None = None
    is_error: bool | None = None


class ServerToolUseBlock(Struct, tag_field="type", tag="server_tool_use", kw_only=True):
    id: str | None = None
    name: str | None = None


class WebSearchToolResultBlock(
    Struct, tag_field="type", tag="web_search_tool_result", kw_only=True
):
    tool_use_id: str | None = None


class WebFetchToolResultBlock(Struct, tag_field="type", tag="web_fetch_tool_result", kw_only=True):
    tool_use_id: str | None = None


class CodeExecutionToolResultBlock(
    Struct, tag_field="type", tag="code_execution_tool_result", kw_only=True
):
    tool_use_id: str | None = None


class BashCodeExecutionToolResultBlock(
    Struct, tag_field="type", tag="bash_code_execution_tool_result", kw_only=True
):
    tool_use_id: str | None = None


class TextEditorCodeExecutionToolResultBlock(
    Struct, tag_field="type", tag="text_editor_code_execution_tool_result", kw_only=True
):
    tool_use_id: str | None = None


class ToolSearchToolResultBlock(
    Struct, tag_field="type", tag="tool_search_tool_result", kw_only=True
):
    tool_use_id: str | None = None


class ContainerUploadBlock(Struct, tag_field="type", tag="container_upload", kw_only=True):
    file_id: str | None = None


ContentBlock = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | SearchResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
    | ToolUseBlock
    | ToolResultBlock
    | ServerToolUseBlock
    | WebSearchToolResultBlock
    | WebFetchToolResultBlock
    | CodeExecutionToolResultBlock
    | BashCodeExecutionToolResultBlock
    | TextEditorCodeExecutionToolResultBlock
    | ToolSearchToolResultBlock
    | ContainerUploadBlock
)


# ---------------------------------------------------------------- request parts


class InputMessage(Struct, kw_only=True):
    """One turn; ``system`` entries (as Claude Code sends them) fold into the system prompt."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class ToolDefinition(Struct, kw_only=True):
    """A custom tool (``type`` absent or ``custom``) or a server tool (``web_search_20250305``, ...)."""

    name: str
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Struct, kw_only=True):
    """``enabled`` (with ``budget_tokens``), ``adaptive``, ``disabled``."""

    type: str
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(Struct, kw_only=True):
    type: str
    schema: dict[str, Any] | None = None


class OutputConfig(Struct, kw_only=True):
    format: OutputFormat | None = None
    effort: str | None = None


class CountTokensRequest(Struct, kw_only=True):
    """Body of ``POST /v1/messages/count_tokens``."""

    messages: list[InputMessage]
    model: str | None = None
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # The structured-outputs beta spelled the format at the top level.
    output_format: OutputFormat | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """Body of ``POST /v1/messages``."""

    max_tokens: int | None = None  # required by the API; checked with a message naming it
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    context_management: dict[str, Any] | None = None
    container: Any = None
    mcp_servers: list[Any] | None = None
    # extension: a block-diffusion model's sampler overrides
    diffusion: Any = None
