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
from .responses_models import ResponsesRequest

log = structlog.get_logger("lmserve.responses")

TEXT_PARTS = {"input_text", "output_text", "text"}
UNSUPPORTED_PARTS = {"input_image", "input_file", "input_audio", "image_url", "file"}
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


def _parts_text(content: Any, where: str) -> str:
    """The text of a string or a list of text content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"'{where}' must be a string or a list of parts", param=where)
    texts: list[str] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise InvalidRequest(f"'{at}' must be an object", param=at)
        kind = part.get("type")
        if kind in TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"'{at}.text' must be a string", param=f"{at}.text")
            texts.append(text)
        elif kind == "refusal":
            texts.append(str(part.get("refusal") or ""))
        elif kind in UNSUPPORTED_PARTS:
            raise reject(f"{at}", f"is an '{kind}' part; only text content is supported")
        else:
            raise InvalidRequest(f"'{at}' has unknown content part type {kind!r}", param=at)
    return "\n".join(texts)


def _messages(body: ResponsesRequest) -> list[Message]:
    messages: list[Message] = []
    if body.instructions:
        messages.append(Message("system", body.instructions))
    if body.input is None:
        raise InvalidRequest("'input' is required", param="input")
    if not body.input:
        raise InvalidRequest("'input' must not be empty", param="input")
    if isinstance(body.input, str):
        messages.append(Message("user", body.input))
        return messages
    call_names: dict[str, str] = {}
    # A replayed reasoning item opens the assistant turn whose message and calls follow it.
    reasoning: str | None = None
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type") or "message"
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise InvalidRequest(
                    f"'{where}.role' must be one of user, assistant, system, developer",
                    param=f"{where}.role",
                )
            text = _parts_text(item.get("content"), f"{where}.content")
            if ROLES[role] == "assistant":
                messages.append(Message("assistant", text, reasoning=reasoning))
            else:
                messages.append(Message(ROLES[role], text))
            reasoning = None
        elif kind == "function_call":
            call = _function_call(item, where)
            call_names[call.id] = call.name
            last = messages[-1] if messages else None
            # the calls of one turn follow its message item; they belong to that turn
            if last is not None and last.role == "assistant" and reasoning is None:
                last.tool_calls.append(call)
            else:
                messages.append(Message("assistant", "", reasoning=reasoning, tool_calls=[call]))
            reasoning = None
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequest(f"'{where}.call_id' is required", param=f"{where}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, f"{where}.output")
            messages.append(
                Message("tool", text, tool_call_id=call_id, name=call_names.get(call_id))
            )
            reasoning = None
        elif kind == "reasoning":
            # the family's chat template decides whether an earlier turn's reasoning is
            # rendered; encrypted_content and summaries carry nothing it could use
            text = _reasoning_text(item.get("content"))
            if text:
                reasoning = text if reasoning is None else reasoning + "\n\n" + text
        elif kind == "item_reference":
            raise reject(
                where, "is an item_reference; the server stores no items, send the item itself"
            )
        else:
            raise InvalidRequest(
                f"'{where}' has unsupported item type {kind!r}", param=f"{where}.type"
            )
    return messages


def _reasoning_text(content: Any) -> str:
    """The text of a reasoning item's ``reasoning_text`` parts."""
    if not isinstance(content, list):
        return ""
    return "\n".join(
        part["text"]
        for part in content
        if isinstance(part, dict)
        and part.get("type") == "reasoning_text"
        and isinstance(part.get("text"), str)
    )


def _check_system_role(body: ResponsesRequest, caps: Capabilities) -> None:
    if body.instructions:
        policy.check_system_role("instructions", caps)
    for i, item in enumerate(body.input if isinstance(body.input, list) else []):
        if (item.get("type") or "message") == "message" and item.get("role") in (
            "system",
            "developer",
        ):
            policy.check_system_role(f"input[{i}].role", caps)


def _function_call(item: dict[str, Any], where: str) -> ToolCall:
    call_id, name = item.get("call_id"), item.get("name")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(f"'{where}.call_id' is required", param=f"{where}.call_id")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"'{where}.name' is required", param=f"{where}.name")
    namespace = item.get("namespace")
    if isinstance(namespace, str) and namespace:
        name = f"{namespace}{NAMESPACE_SEP}{name}"  # the flat name the model saw
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json_text(arguments)
    return ToolCall(id=call_id, name=name, arguments=arguments)


# -- tools ---------------------------------------------------------------------------------


NAMESPACE_SEP = "."  # a namespaced tool's flat name: "<namespace>.<name>"


def _function_tool(spec: dict[str, Any], where: str, namespace: str | None = None) -> Tool:
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"'{where}.name' is required", param=f"{where}.name")
    params = spec.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidRequest(
            f"'{where}.parameters' must be a JSON schema object", param=f"{where}.parameters"
        )
    return Tool(
        name=f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name,
        description=str(spec.get("description") or ""),
        parameters=params or {"type": "object", "properties": {}},
        strict=bool(spec.get("strict")),
    )


def _function_tools(body: ResponsesRequest) -> list[Tool]:
    tools: list[Tool] = []
    hosted: list[str] = []
    for i, spec in enumerate(body.tools or []):
        kind = spec.get("type")
        if kind == "function":
            tools.append(_function_tool(spec, f"tools[{i}]"))
        elif kind == "namespace":
            # A group of function tools the client runs (Codex CLI's sub-agent tools): the
            # model sees them under flat names; calls come back with name and namespace apart.
            namespace = spec.get("name")
            if not isinstance(namespace, str) or not namespace:
                raise InvalidRequest(f"'tools[{i}].name' is required", param=f"tools[{i}].name")
            for j, child in enumerate(spec.get("tools") or []):
                kind = child.get("type", "function") if isinstance(child, dict) else None
                if kind == "function":
                    tools.append(_function_tool(child, f"tools[{i}].tools[{j}]", namespace))
                else:
                    hosted.append(f"{namespace}/{kind}")
        else:
            hosted.append(str(kind))
    if hosted:
        # agents such as Codex CLI always declare hosted tools; serving without them keeps
        # those agents usable, and the model only sees the function tools
        log.warning("hosted_tools_dropped", types=hosted)
    return tools


def namespaces(body: ResponsesRequest) -> dict[str, tuple[str, str]]:
    """Flat name -> (namespace, name) of the request's namespaced function tools."""
    out: dict[str, tuple[str, str]] = {}
    for spec in body.tools or []:
        namespace = spec.get("name")
        if spec.get("type") != "namespace" or not isinstance(namespace, str):
            continue
        for child in spec.get("tools") or []:
            if isinstance(child, dict) and child.get("type", "function") == "function":
                out[f"{namespace}{NAMESPACE_SEP}{child.get('name')}"] = (namespace, child["name"])
    return out


def _tool_choice(body: ResponsesRequest, tools: list[Tool]) -> tuple[ToolChoice, list[Tool]]:
    choice = body.tool_choice
    if choice is None or choice == "auto":
        return ToolChoice(), tools
    if choice == "none":
        return ToolChoice(ToolChoiceMode.NONE), tools
    if choice == "required":
        return ToolChoice(ToolChoiceMode.REQUIRED), tools
    if isinstance(choice, str):
        raise InvalidRequest(
            "'tool_choice' must be auto, none, required or a function", param="tool_choice"
        )
    kind = choice.get("type")
    if kind == "function":
        name = policy.declared_tool(str(choice.get("name")), tools, "tool_choice").name
        return ToolChoice(ToolChoiceMode.NAMED, name), tools
    if kind == "allowed_tools":
        return _allowed_tools(choice, tools)
    raise reject(
        "tool_choice", f"forces the hosted tool type {kind!r}, which this server cannot run"
    )


def _allowed_tools(choice: dict[str, Any], tools: list[Tool]) -> tuple[ToolChoice, list[Tool]]:
    allowed: list[str] = []
    for entry in choice.get("tools") or []:
        if not isinstance(entry, dict) or entry.get("type") != "function":
            kind = entry.get("type") if isinstance(entry, dict) else entry
            raise reject(
                "tool_choice", f"allows the hosted tool type {kind!r}, which this server cannot run"
            )
        allowed.append(str(entry.get("name")))
    kept = [policy.declared_tool(name, tools, "tool_choice") for name in dict.fromkeys(allowed)]
    mode = choice.get("mode", "auto")
    if mode == "required":
        if len(kept) == 1:
            return ToolChoice(ToolChoiceMode.NAMED, kept[0].name), kept
        return ToolChoice(ToolChoiceMode.REQUIRED), kept
    if mode != "auto":
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


def _echo(body: ResponsesRequest, tools: list[Tool], max_tokens: int) -> dict[str, Any]:
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
    grouped = namespaces(body)
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
    messages = _messages(body)
    _check_system_role(body, caps)
    choice, tools = _tool_choice(body, _function_tools(body))
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
    meta = ResponseMeta(
        id=response_id,
        model=server.model_id,
        echo=_echo(body, tools, max_tokens),
        namespaces=namespaces(body),
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
