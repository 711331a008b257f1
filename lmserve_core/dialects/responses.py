"""The OpenAI Responses dialect: ``POST /v1/responses`` (and ``/responses``).

The server is stateless: every request carries its whole history as input items, so
the fields that refer to stored state (``previous_response_id``, ``conversation``,
``item_reference``, stored ``prompt`` templates, ``background``) are rejected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import structlog
from litestar import Request, Response, post
from litestar.params import JSONBody

from ..backend import Capabilities
from ..errors import BackendFailure, InvalidRequest
from ..request import (
    Constraint,
    Message,
    NormalizedRequest,
    Role,
    Sampling,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)
from ..server import Server, ServerDep
from . import policy
from .common import (
    bounded_max_tokens,
    check_stop,
    collect,
    diffusion_from,
    json_text,
    new_id,
    open_stream,
    reject,
    replay,
    sse_response,
)
from .responses_encoder import ResponseMeta, ResponsesStreamEncoder, encode_response
from .responses_models import (
    TEXT_PARTS,
    AllowedToolsChoice,
    Content,
    DeclaredTool,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    InputItem,
    MessageItem,
    NamespaceTool,
    ReasoningItem,
    RefusalPart,
    ResponsesRequest,
    input_items,
    tool_choice_of,
    tools_of,
)

log = structlog.get_logger("lmserve.responses")

ROLES: dict[str, Role] = {
    "user": "user",
    "assistant": "assistant",
    "system": "system",
    "developer": "system",
}


@dataclass(slots=True)
class Translated:
    """A request in normalized form plus what its response objects echo back."""

    normalized: NormalizedRequest
    meta: ResponseMeta


# -- rejected and range-checked fields -----------------------------------------------------


def _check_rejected(body: ResponsesRequest) -> None:
    if body.previous_response_id:
        raise reject(
            "previous_response_id",
            "is not supported: the server stores no "
            "responses; send the whole conversation as input items",
        )
    if body.conversation is not None:
        raise reject("conversation", "is not supported: the server stores no conversations")
    if body.background:
        raise reject("background", "is not supported: responses are generated in the request")
    if body.truncation not in (None, "disabled"):
        raise reject("truncation", "only 'disabled' is supported")
    if body.n is not None and body.n != 1:
        raise reject("n", "must be 1")
    if body.logprobs:
        raise reject("logprobs", "is not a Responses field: use include and top_logprobs")
    top = body.top_logprobs
    if top is not None and (isinstance(top, bool) or not 0 <= top <= 20):
        raise InvalidRequest("'top_logprobs' must be between 0 and 20", param="top_logprobs")
    if body.prompt is not None:
        raise reject("prompt", "is not supported: the server has no stored prompt templates")


def _check_range(name: str, value: float | None, low: float, high: float) -> None:
    if value is not None and not (math.isfinite(value) and low <= value <= high):
        raise InvalidRequest(f"'{name}' must be between {low:g} and {high:g}", param=name)


def _sampling(body: ResponsesRequest) -> Sampling:
    _check_range("temperature", body.temperature, 0.0, 2.0)
    _check_range("top_p", body.top_p, 0.0, 1.0)
    _check_range("min_p", body.min_p, 0.0, 1.0)
    _check_range("presence_penalty", body.presence_penalty, -2.0, 2.0)
    _check_range("frequency_penalty", body.frequency_penalty, -2.0, 2.0)
    if body.top_k is not None and body.top_k < 0:
        raise InvalidRequest("'top_k' must be >= 0", param="top_k")
    if body.repeat_penalty is not None and body.repeat_penalty <= 0:
        raise InvalidRequest("'repeat_penalty' must be positive", param="repeat_penalty")
    return Sampling(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repeat_penalty=body.repeat_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        # llama.cpp precedent: a negative seed asks for a random one
        seed=body.seed if body.seed is None or body.seed >= 0 else None,
        diffusion=diffusion_from(body.diffusion),
    )


# -- input items ---------------------------------------------------------------------------


def _parts_text(content: Content, where: str) -> str:
    """The text of a string or a list of text content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, TEXT_PARTS):
            texts.append(part.text)
        elif isinstance(part, RefusalPart):
            texts.append(part.refusal or "")
        else:
            kind = type(part).__struct_config__.tag
            raise reject(f"{where}[{j}]", f"is an '{kind}' part; only text content is supported")
    return "\n".join(texts)


def _items(body: ResponsesRequest) -> str | list[InputItem]:
    """The request's ``input``: a string, or its typed items."""
    if body.input is None:
        raise InvalidRequest("'input' is required", param="input")
    if not body.input:
        raise InvalidRequest("'input' must not be empty", param="input")
    return body.input if isinstance(body.input, str) else input_items(body.input)


def _messages(instructions: str | None, items: str | list[InputItem]) -> list[Message]:
    messages: list[Message] = []
    if instructions:
        messages.append(Message("system", instructions))
    if isinstance(items, str):
        messages.append(Message("user", items))
        return messages
    call_names: dict[str, str] = {}
    # A replayed reasoning item opens the assistant turn whose message and calls follow it.
    reasoning: str | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, MessageItem):
            if item.role not in ROLES:
                raise InvalidRequest(
                    f"'{where}.role' must be one of user, assistant, system, developer",
                    param=f"{where}.role",
                )
            role = ROLES[item.role]
            text = _parts_text(item.content, f"{where}.content")
            messages.append(
                Message(role, text, reasoning=reasoning if role == "assistant" else None)
            )
            reasoning = None
        elif isinstance(item, FunctionCallItem):
            call = _function_call(item, where)
            call_names[call.id] = call.name
            last = messages[-1] if messages else None
            # the calls of one turn follow its message item; they belong to that turn
            if last is not None and last.role == "assistant" and reasoning is None:
                last.tool_calls.append(call)
            else:
                messages.append(Message("assistant", "", reasoning=reasoning, tool_calls=[call]))
            reasoning = None
        elif isinstance(item, FunctionCallOutputItem):
            if not item.call_id:
                raise InvalidRequest(f"'{where}.call_id' is required", param=f"{where}.call_id")
            text = _parts_text(item.output, f"{where}.output")
            messages.append(
                Message("tool", text, tool_call_id=item.call_id, name=call_names.get(item.call_id))
            )
            reasoning = None
        elif isinstance(item, ReasoningItem):
            # the family's chat template decides whether an earlier turn's reasoning is
            # rendered; encrypted_content and summaries carry nothing it could use
            text = "\n".join(
                part.text
                for part in item.content or []
                if part.type == "reasoning_text" and part.text is not None
            )
            if text:
                reasoning = text if reasoning is None else reasoning + "\n\n" + text
        else:  # an item_reference
            raise reject(
                where, "is an item_reference; the server stores no items, send the item itself"
            )
    return messages


def _check_system_role(
    instructions: str | None, items: str | list[InputItem], caps: Capabilities
) -> None:
    if instructions:
        policy.check_system_role("instructions", caps)
    for i, item in enumerate(items if isinstance(items, list) else []):
        if isinstance(item, MessageItem) and item.role in ("system", "developer"):
            policy.check_system_role(f"input[{i}].role", caps)


def _function_call(item: FunctionCallItem, where: str) -> ToolCall:
    if not item.call_id:
        raise InvalidRequest(f"'{where}.call_id' is required", param=f"{where}.call_id")
    if not item.name:
        raise InvalidRequest(f"'{where}.name' is required", param=f"{where}.name")
    name = item.name
    if item.namespace:
        name = f"{item.namespace}{NAMESPACE_SEP}{name}"  # the flat name the model saw
    arguments = item.arguments
    if not isinstance(arguments, str):
        arguments = json_text(arguments)
    return ToolCall(id=item.call_id, name=name, arguments=arguments)


# -- tools ---------------------------------------------------------------------------------


NAMESPACE_SEP = "."  # a namespaced tool's flat name: "<namespace>.<name>"


def _function_tool(spec: FunctionTool, where: str, namespace: str | None = None) -> Tool:
    if not spec.name:
        raise InvalidRequest(f"'{where}.name' is required", param=f"{where}.name")
    return Tool(
        name=f"{namespace}{NAMESPACE_SEP}{spec.name}" if namespace else spec.name,
        description=spec.description or "",
        parameters=spec.parameters or {"type": "object", "properties": {}},
        strict=bool(spec.strict),
    )


def _function_tools(declared: list[DeclaredTool]) -> list[Tool]:
    tools: list[Tool] = []
    hosted: list[str] = []
    for i, spec in enumerate(declared):
        if isinstance(spec, FunctionTool):
            tools.append(_function_tool(spec, f"tools[{i}]"))
        elif isinstance(spec, NamespaceTool):
            # A group of function tools the client runs (Codex CLI's sub-agent tools): the
            # model sees them under flat names; calls come back with name and namespace apart.
            if not spec.name:
                raise InvalidRequest(f"'tools[{i}].name' is required", param=f"tools[{i}].name")
            for j, child in enumerate(spec.tools):
                tools.append(_function_tool(child, f"tools[{i}].tools[{j}]", spec.name))
        else:
            hosted.append(str(spec.type))
    if hosted:
        # agents such as Codex CLI always declare hosted tools; serving without them keeps
        # those agents usable, and the model only sees the function tools
        log.warning("hosted_tools_dropped", types=hosted)
    return tools


def namespaces(declared: list[DeclaredTool]) -> dict[str, tuple[str, str]]:
    """Flat name -> (namespace, name) of the request's namespaced function tools."""
    return {
        f"{spec.name}{NAMESPACE_SEP}{child.name}": (spec.name, str(child.name))
        for spec in declared
        if isinstance(spec, NamespaceTool)
        for child in spec.tools
    }


def _tool_choice(body: ResponsesRequest, tools: list[Tool]) -> tuple[ToolChoice, list[Tool]]:
    if body.tool_choice is None:
        return ToolChoice(), tools
    choice = tool_choice_of(body.tool_choice)
    if choice == "auto":
        return ToolChoice(), tools
    if choice == "none":
        return ToolChoice(ToolChoiceMode.NONE), tools
    if choice == "required":
        return ToolChoice(ToolChoiceMode.REQUIRED), tools
    if isinstance(choice, str):
        raise InvalidRequest(
            "'tool_choice' must be auto, none, required or a function", param="tool_choice"
        )
    if isinstance(choice, FunctionChoice):
        name = policy.declared_tool(str(choice.name), tools, "tool_choice").name
        return ToolChoice(ToolChoiceMode.NAMED, name), tools
    if isinstance(choice, AllowedToolsChoice):
        return _allowed_tools(choice, tools)
    raise reject(
        "tool_choice", f"forces the hosted tool type {choice.type!r}, which this server cannot run"
    )


def _allowed_tools(choice: AllowedToolsChoice, tools: list[Tool]) -> tuple[ToolChoice, list[Tool]]:
    allowed: list[str] = []
    for entry in choice.tools:
        if entry.type != "function":
            raise reject(
                "tool_choice",
                f"allows the hosted tool type {entry.type!r}, which this server cannot run",
            )
        allowed.append(str(entry.name))
    kept = [policy.declared_tool(name, tools, "tool_choice") for name in dict.fromkeys(allowed)]
    if choice.mode == "required":
        if len(kept) == 1:
            return ToolChoice(ToolChoiceMode.NAMED, kept[0].name), kept
        return ToolChoice(ToolChoiceMode.REQUIRED), kept
    if choice.mode != "auto":
        raise InvalidRequest("tool_choice mode must be auto or required", param="tool_choice")
    return ToolChoice(), kept


# -- output constraints and reasoning ------------------------------------------------------


def _constraint_sources(body: ResponsesRequest) -> list[tuple[str, Constraint]]:
    found: list[tuple[str, Constraint]] = []
    fmt = body.text.format if body.text is not None else None
    if fmt is not None:
        if fmt.type == "json_schema":
            if fmt.schema is None:
                raise InvalidRequest(
                    "'text.format.schema' is required for json_schema", param="text.format.schema"
                )
            strict = True if fmt.strict is None else fmt.strict
            found.append(
                (
                    "text.format",
                    Constraint("json_schema", json_text(fmt.schema), name=fmt.name, strict=strict),
                )
            )
        elif fmt.type == "json_object":
            found.append(("text.format", Constraint("json_object", "")))
        elif fmt.type != "text":
            raise InvalidRequest(
                f"'text.format.type' must be text, json_object or json_schema, not {fmt.type!r}",
                param="text.format.type",
            )
    if body.regex is not None:
        found.append(("regex", Constraint("regex", body.regex)))
    if body.lark is not None:
        found.append(("lark", Constraint("lark", body.lark)))
    return found


def _reasoning(body: ResponsesRequest) -> policy.ReasoningAsk:
    effort = body.reasoning.effort if body.reasoning is not None else None
    # not strict: agents (Codex CLI) send an effort on every request, so on a backend
    # without a reasoning channel it is a no-op
    switch = policy.effort_switch(effort, "reasoning.effort")
    return policy.ReasoningAsk(switch is True, "reasoning.effort")


# -- translation ---------------------------------------------------------------------------


def _echo(
    body: ResponsesRequest, tools: list[Tool], grouped: dict[str, tuple[str, str]], max_tokens: int
) -> dict[str, Any]:
    """The request fields the SDK's ``Response`` type expects back."""
    text: dict[str, Any] = {"format": {"type": "text"}}
    if body.text is not None and body.text.format is not None:
        fmt = body.text.format
        text = {
            "format": {
                key: value
                for key, value in (
                    ("type", fmt.type),
                    ("name", fmt.name),
                    ("schema", fmt.schema),
                    ("strict", fmt.strict),
                    ("description", fmt.description),
                )
                if value is not None
            }
        }
    reasoning = None
    if body.reasoning is not None:
        reasoning = {"effort": body.reasoning.effort, "summary": body.reasoning.summary}
    return {
        "instructions": body.instructions,
        "max_output_tokens": max_tokens,
        "max_tool_calls": body.max_tool_calls,
        "metadata": body.metadata or {},
        "parallel_tool_calls": True
        if body.parallel_tool_calls is None
        else body.parallel_tool_calls,
        "reasoning": reasoning,
        "service_tier": "default",
        "temperature": body.temperature,
        "text": text,
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": [
            {
                "type": "function",
                "name": tool.name,
                "description": tool.description or None,
                "parameters": tool.parameters,
                "strict": tool.strict,
            }
            for tool in tools
            if tool.name not in grouped  # namespaced tools: not a type the SDKs model here
        ],
        "top_logprobs": body.top_logprobs or 0,
        "top_p": body.top_p,
        "user": body.user,
    }


def translate(body: ResponsesRequest, server: Server) -> Translated:
    """The normalized request of a Responses body, or an ``LmserveError`` naming the field."""
    caps = server.backend.capabilities
    _check_rejected(body)
    sampling = _sampling(body)
    items = _items(body)
    messages = _messages(body.instructions, items)
    _check_system_role(body.instructions, items, caps)
    declared = tools_of(body.tools)
    choice, tools = _tool_choice(body, _function_tools(declared))
    decision = policy.decide(
        caps,
        tools=policy.ToolAsk(tools, choice, parallel=body.parallel_tool_calls is not False),
        constraints=_constraint_sources(body),
        reasoning=_reasoning(body),
    )
    stop = check_stop(body.stop)
    policy.check_stop_strings(stop, "stop", caps)
    max_tokens = bounded_max_tokens(body.max_output_tokens, "max_output_tokens", server.ctx)
    response_id = new_id("resp_")
    normalized = NormalizedRequest(
        id=response_id,
        dialect="responses",
        messages=messages,
        sampling=sampling,
        max_tokens=max_tokens,
        stop=stop,
        stream=bool(body.stream),
        logprobs=(
            (body.top_logprobs or 0)
            if body.include and "message.output_text.logprobs" in body.include
            else None
        ),
        model=body.model,
    )
    decision.apply(normalized)
    # the echo is the request's function tools, whatever this backend makes of them
    grouped = namespaces(declared)
    meta = ResponseMeta(
        id=response_id,
        model=server.model_id,
        echo=_echo(body, tools, grouped, max_tokens),
        namespaces=grouped,
    )
    return Translated(normalized, meta)


# -- the handler ---------------------------------------------------------------------------


@post(["/v1/responses", "/responses"], status_code=200)
async def create_response(
    data: JSONBody[ResponsesRequest], server: ServerDep, request: Request[Any, Any, Any]
) -> Response[Any]:
    """Create a model response (OpenAI Responses API), streamed or whole."""
    translated = translate(data, server)
    normalized = translated.normalized
    if normalized.stream:
        stream, head = await open_stream(server.engine, normalized)
        encoder = ResponsesStreamEncoder(translated.meta)
        return sse_response(stream, encoder.frames(replay(stream, head)))
    collected = await collect(server.engine, request, normalized)
    if collected.finish.reason == "error":
        raise BackendFailure("generation failed")
    return Response(encode_response(translated.meta, collected))


routes = [create_response]
