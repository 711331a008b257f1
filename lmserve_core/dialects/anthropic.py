"""The Anthropic Messages dialect: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

Translation (body → NormalizedRequest) lives here with the handlers; the Structs are in
``anthropic_models`` and the event encoding in ``anthropic_encoder``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import structlog
from litestar import MediaType, Request, Response, post
from litestar.params import JSONBody

from ..backend import Capabilities, CountsTokens
from ..errors import InvalidRequest
from ..request import (
    Constraint,
    Message,
    NormalizedRequest,
    Sampling,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)
from ..server import Server, ServerDep
from . import policy
from .anthropic_encoder import MessageStreamEncoder, message_body
from .anthropic_models import (
    ContentBlock,
    CountTokensRequest,
    DocumentBlock,
    InputMessage,
    MessagesRequest,
    OutputFormat,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolDefinition,
    ToolResultBlock,
    ToolResultContentBlock,
    ToolUseBlock,
)
from .common import (
    bounded_max_tokens,
    check_stop,
    collect,
    diffusion_from,
    json_text,
    new_id,
    open_stream,
    replay,
    sse_response,
)

log = structlog.get_logger("lmserve.messages")

THINKING_TYPES = {"enabled": True, "adaptive": True, "between_tools": True, "disabled": False}


# ---------------------------------------------------------------- translation


def _block_type(block: Any) -> str:
    return str(type(block).__struct_config__.tag)


def _unsupported_block(block: Any, where: str) -> InvalidRequest:
    kind = _block_type(block)
    return InvalidRequest(
        f"content block type '{kind}' is not supported by this server ({where}); "
        "only text, document (text sources), thinking, tool_use and tool_result blocks "
        "are accepted",
        param=where,
    )


_DOCUMENT_SOURCES = {
    "base64": "PDF documents are not supported (the model reads text only)",
    "url": "documents are not fetched from URLs",
    "file": "there is no Files API to read documents from",
}


def _document_text(block: DocumentBlock, where: str) -> str:
    """A document block as the text the model reads: a ``Document: <title>`` line (just
    ``Document`` without a title), a ``Context: <context>`` line when there is context, a
    blank line, then the document's text. Sources other than ``text`` and ``content`` are
    a 400 naming ``<where>.source.type``."""
    source = block.source
    if source is None:
        raise InvalidRequest(f"'{where}.source' is required", param=f"{where}.source")
    kind = source.get("type")
    if kind == "text":
        media = source.get("media_type", "text/plain")
        if media != "text/plain":
            raise InvalidRequest(
                f"'{where}.source.media_type' must be 'text/plain' for a text source "
                f"(got {media!r})",
                param=f"{where}.source.media_type",
            )
        text = source.get("data")
        if not isinstance(text, str):
            raise InvalidRequest(
                f"'{where}.source.data' must be a string", param=f"{where}.source.data"
            )
    elif kind == "content":
        text = _document_content(source.get("content"), f"{where}.source.content")
    else:
        why = _DOCUMENT_SOURCES.get(str(kind), "only text and content sources are served")
        raise InvalidRequest(
            f"'{where}.source.type' {kind!r} is not supported: {why}; send the document as "
            "a text source",
            param=f"{where}.source.type",
        )
    head = f"Document: {block.title}" if block.title else "Document"
    if block.context:
        head += f"\nContext: {block.context}"
    return f"{head}\n\n{text}"


def _document_content(content: Any, where: str) -> str:
    """A ``content`` source: a string, or text blocks joined with a blank line."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(
            f"'{where}' must be a string or a list of text blocks", param=where
        )
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise InvalidRequest(
                f"'{where}[{k}].type' {kind!r} is not supported in a document: only text "
                "blocks are",
                param=f"{where}[{k}].type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"'{where}[{k}].text' must be a string", param=f"{where}[{k}].text")
        parts.append(text)
    return "\n\n".join(parts)


def _system_text(system: str | list[TextBlock] | None) -> list[str]:
    if system is None:
        return []
    if isinstance(system, str):
        return [system] if system else []
    return [block.text for block in system if block.text]


def _tool_result_text(block: ToolResultBlock, where: str) -> str:
    content: str | list[ToolResultContentBlock] | None = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, TextBlock):
                parts.append(part.text)
            elif isinstance(part, DocumentBlock):
                parts.append(_document_text(part, f"{where}.content[{j}]"))
            else:
                raise _unsupported_block(part, f"{where}.content[{j}]")
        text = "\n".join(parts)
    # the model must see that the call failed; the template has no error flag of its own
    if block.is_error:
        text = f"Error: {text}" if text else "Error"
    return text


def _translate_messages(
    messages: list[InputMessage], system: list[str]
) -> tuple[list[str], list[Message]]:
    """History → normalized turns; ``system`` collects system text in order of appearance."""
    out: list[Message] = []
    call_names: dict[str, str] = {}
    for i, msg in enumerate(messages):
        blocks: list[ContentBlock] = (
            [TextBlock(text=msg.content)] if isinstance(msg.content, str) else msg.content
        )
        if msg.role == "system":
            for j, block in enumerate(blocks):
                if not isinstance(block, TextBlock):
                    raise _unsupported_block(block, f"messages[{i}].content[{j}]")
                if block.text:
                    system.append(block.text)
            continue
        if msg.role == "assistant":
            text: list[str] = []
            thinking: list[str] = []
            calls: list[ToolCall] = []
            for j, block in enumerate(blocks):
                if isinstance(block, TextBlock):
                    text.append(block.text)
                elif isinstance(block, ToolUseBlock):
                    arguments = block.input if block.input is not None else {}
                    calls.append(ToolCall(block.id, block.name, json_text(arguments)))
                    call_names[block.id] = block.name
                elif isinstance(block, ThinkingBlock):
                    # the turn's reasoning: the family's chat template decides whether to
                    # render it (Qwen3's does after the last user query, i.e. in a tool loop)
                    if block.thinking:
                        thinking.append(block.thinking)
                elif isinstance(block, RedactedThinkingBlock):
                    continue  # encrypted by Anthropic: no text to replay
                else:
                    raise _unsupported_block(block, f"messages[{i}].content[{j}]")
            # joined as generated, so the rendered history matches the tokens the model
            # produced (KV slot reuse compares token prefixes)
            out.append(
                Message(
                    "assistant",
                    "".join(text),
                    reasoning="\n\n".join(thinking) if thinking else None,
                    tool_calls=calls,
                )
            )
            continue
        # a user turn: tool results become tool turns, in order, around the user's text
        pending: list[str] = []
        for j, block in enumerate(blocks):
            if isinstance(block, TextBlock):
                pending.append(block.text)
            elif isinstance(block, DocumentBlock):
                pending.append(_document_text(block, f"messages[{i}].content[{j}]"))
            elif isinstance(block, ToolResultBlock):
                if pending:
                    out.append(Message("user", "\n\n".join(pending)))
                    pending = []
                out.append(
                    Message(
                        "tool",
                        _tool_result_text(block, f"messages[{i}].content[{j}]"),
                        tool_call_id=block.tool_use_id,
                        name=call_names.get(block.tool_use_id),
                    )
                )
            elif isinstance(block, ThinkingBlock | RedactedThinkingBlock):
                continue
            else:
                raise _unsupported_block(block, f"messages[{i}].content[{j}]")
        if pending or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append(Message("user", "\n\n".join(pending)))
    return system, out


def _tool_ask(body: CountTokensRequest) -> policy.ToolAsk:
    custom: list[ToolDefinition] = []
    hosted: list[str] = []
    for i, tool in enumerate(body.tools or []):
        if tool.type in (None, "custom"):
            if tool.input_schema is None:
                raise InvalidRequest(
                    f"'tools[{i}].input_schema' is required for custom tools",
                    param=f"tools[{i}].input_schema",
                )
            custom.append(tool)
        else:
            hosted.append(tool.type)
    if hosted:
        # server-side tools run on Anthropic's infrastructure; the rest of the request
        # is still servable, so clients that always declare them keep working
        log.warning("hosted_tools_dropped", types=hosted)
    tools = [
        Tool(
            name=t.name,
            description=t.description or "",
            parameters=t.input_schema or {},
            # input_schema is the wire contract: forced calls are always schema-enforced
            strict=True,
        )
        for t in custom
    ]
    choice = body.tool_choice
    if choice is None:
        return policy.ToolAsk(tools, ToolChoice())
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest(
                "'tool_choice.name' is required when tool_choice.type is 'tool'",
                param="tool_choice.name",
            )
        name = policy.declared_tool(choice.name, tools, "tool_choice.name").name
        return policy.ToolAsk(tools, ToolChoice(ToolChoiceMode.NAMED, name), parallel)
    mode = {"auto": ToolChoiceMode.AUTO, "any": ToolChoiceMode.REQUIRED}.get(
        choice.type, ToolChoiceMode.NONE
    )
    return policy.ToolAsk(tools, ToolChoice(mode), parallel)


def _constraint_sources(body: CountTokensRequest) -> list[tuple[str, Constraint]]:
    fmt: OutputFormat | None = None
    field = "output_config.format"
    if body.output_config is not None and body.output_config.format is not None:
        fmt = body.output_config.format
    elif body.output_format is not None:
        fmt, field = body.output_format, "output_format"
    if fmt is None:
        return []
    if fmt.type != "json_schema":
        raise InvalidRequest(
            f"'{field}.type' must be 'json_schema' (got '{fmt.type}')", param=f"{field}.type"
        )
    if not isinstance(fmt.schema, dict):
        raise InvalidRequest(f"'{field}.schema' is required", param=f"{field}.schema")
    return [(field, Constraint("json_schema", json_text(fmt.schema)))]


def _reasoning_ask(body: CountTokensRequest) -> policy.ReasoningAsk:
    thinking = body.thinking
    if thinking is None:
        return policy.ReasoningAsk(False, "thinking")
    if thinking.type not in THINKING_TYPES:
        raise InvalidRequest(
            f"'thinking.type' must be one of {', '.join(THINKING_TYPES)} (got '{thinking.type}')",
            param="thinking.type",
        )
    budget = thinking.budget_tokens
    if budget is not None and budget < 1:
        raise InvalidRequest(
            "'thinking.budget_tokens' must be a positive integer", param="thinking.budget_tokens"
        )
    # not strict: without a reasoning channel thinking is a no-op, so thinking-by-default
    # clients stay usable
    return policy.ReasoningAsk(THINKING_TYPES[thinking.type], "thinking", budget=budget)


def _unit_interval(value: float | None, name: str) -> float | None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise InvalidRequest(f"'{name}' must be between 0 and 1", param=name)
    return value


def translate(body: CountTokensRequest, server: Server) -> NormalizedRequest:
    """Translate a Messages body (or a count_tokens body) into a NormalizedRequest."""
    caps = server.backend.capabilities
    system, messages = _translate_messages(body.messages, _system_text(body.system))
    if not messages:
        raise InvalidRequest(
            "'messages' must contain at least one user or assistant turn", param="messages"
        )
    if system:
        policy.check_system_role("system", caps)
        messages.insert(0, Message("system", "\n\n".join(system)))
    decision = policy.decide(
        caps,
        tools=_tool_ask(body),
        constraints=_constraint_sources(body),
        reasoning=_reasoning_ask(body),
    )
    normalized = NormalizedRequest(
        id=new_id("msg_"), dialect="messages", messages=messages, model=body.model
    )
    decision.apply(normalized)
    if isinstance(body, MessagesRequest):
        _apply_generation_fields(body, normalized, server, caps)
    return normalized


def _apply_generation_fields(
    body: MessagesRequest, normalized: NormalizedRequest, server: Server, caps: Capabilities
) -> None:
    if body.max_tokens is None:
        raise InvalidRequest("'max_tokens' is required", param="max_tokens")
    normalized.max_tokens = bounded_max_tokens(body.max_tokens, "max_tokens", server.ctx)
    if body.top_k is not None and body.top_k < 0:
        raise InvalidRequest("'top_k' must be a non-negative integer", param="top_k")
    normalized.sampling = Sampling(
        temperature=_unit_interval(body.temperature, "temperature"),
        top_p=_unit_interval(body.top_p, "top_p"),
        top_k=body.top_k,
        diffusion=diffusion_from(body.diffusion),
    )
    normalized.stop = check_stop(body.stop_sequences, "stop_sequences")
    policy.check_stop_strings(normalized.stop, "stop_sequences", caps)
    if body.container:
        raise InvalidRequest(
            "'container' is not supported (no code-execution containers)", param="container"
        )
    if body.mcp_servers:
        raise InvalidRequest(
            "'mcp_servers' is not supported (no server-side MCP connector)", param="mcp_servers"
        )
    normalized.stream = bool(body.stream)


# ---------------------------------------------------------------- handlers


@post(["/v1/messages", "/messages"], status_code=200)
async def create_message(
    data: JSONBody[MessagesRequest], server: ServerDep, request: Request[Any, Any, Any]
) -> Response[Any]:
    """Anthropic Messages: generate the assistant's next message (JSON or SSE)."""
    normalized = translate(data, server)
    msg_id = normalized.id
    if not normalized.stream:
        out = await collect(server.engine, request, normalized)
        return Response(
            content=message_body(msg_id, server.model_id, out), media_type=MediaType.JSON
        )

    stream, head = await open_stream(server.engine, normalized)
    # open_stream ran the backend's validate, which counted the prompt
    encoder = MessageStreamEncoder(msg_id, server.model_id, input_tokens=normalized.prompt_tokens)

    async def frames() -> AsyncIterator[bytes]:
        yield encoder.start()
        async for event in replay(stream, head):
            for frame in encoder.encode(event):
                yield frame
            if encoder.done:
                return

    return sse_response(stream, frames())


def _render_for_count(normalized: NormalizedRequest) -> str:
    """A plain rendering of prompt, tools and history, close to what a chat template adds."""
    parts: list[str] = []
    for tool in normalized.tools:
        parts.append(
            json_text(
                {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
            )
        )
    for msg in normalized.messages:
        parts.append(f"{msg.role}\n{msg.content}")
        parts.extend(json_text({"name": c.name, "arguments": c.arguments}) for c in msg.tool_calls)
    return "\n".join(parts)


@post(["/v1/messages/count_tokens", "/messages/count_tokens"], status_code=200)
async def count_tokens(data: JSONBody[CountTokensRequest], server: ServerDep) -> dict[str, int]:
    """Anthropic token counting: the prompt's tokens under the loaded model's tokenizer."""
    normalized = translate(data, server)
    # Backends on the generic GGUF path count the prompt exactly as it will be fed
    # (chat template included); others get an estimate from a plain rendering.
    # Off the event loop, on the engine's preparation threads: a long prompt takes seconds.
    backend = server.backend
    if isinstance(backend, CountsTokens):
        count = await server.engine.prepare(backend.count_tokens, normalized)
        return {"input_tokens": int(count)}
    ids = await server.engine.prepare(_count_plain, backend, normalized)
    return {"input_tokens": len(ids)}


def _count_plain(backend: Any, normalized: NormalizedRequest) -> list[int]:
    return list(backend.tokenize(_render_for_count(normalized), add_special=True))


routes = [create_message, count_tokens]
