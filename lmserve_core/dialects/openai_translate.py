"""OpenAI Chat Completions / Completions request bodies → ``NormalizedRequest``.

Every refusal names the offending field (``param``), so the SDKs' ``BadRequestError``
says what to change. Shared by ``openai_chat`` and ``openai_completions``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from ..backend import Capabilities
from ..errors import InvalidRequest, Unsupported
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
from . import policy
from .common import bounded_max_tokens, check_stop, diffusion_from, json_text, reject
from .openai_chat_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    ToolChoiceObject,
)

_ROLES: dict[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
_UNSUPPORTED_PARTS = {
    "image_url": "image content is not supported",
    "input_image": "image content is not supported",
    "input_audio": "audio content is not supported",
    "file": "file content is not supported",
}
_INT64_MAX = 2**63 - 1


# -- sampling and limits -------------------------------------------------------------------


def _in_range(value: float | None, name: str, lo: float, hi: float) -> float | None:
    if value is None:
        return None
    if not (math.isfinite(value) and lo <= value <= hi):
        raise InvalidRequest(f"'{name}' must be between {lo:g} and {hi:g}", param=name)
    return float(value)


def sampling_from(body: SamplingFields) -> Sampling:
    """Range-checked sampling fields (absent ones stay ``None``: the model's defaults)."""
    top_k = body.top_k
    if top_k is not None and top_k < 0:
        raise InvalidRequest("'top_k' must be >= 0 (0 disables it)", param="top_k")
    repeat_penalty = body.repeat_penalty
    if repeat_penalty is not None and not (math.isfinite(repeat_penalty) and repeat_penalty >= 0):
        raise InvalidRequest("'repeat_penalty' must be >= 0", param="repeat_penalty")
    seed = body.seed
    if seed is not None:
        if seed > _INT64_MAX or seed < -_INT64_MAX - 1:
            raise InvalidRequest("'seed' must fit in a signed 64-bit integer", param="seed")
        if seed < 0:  # llama.cpp precedent: a negative seed asks for a random one
            seed = None
    return Sampling(
        temperature=_in_range(body.temperature, "temperature", 0.0, 2.0),
        top_p=_in_range(body.top_p, "top_p", 0.0, 1.0),
        top_k=top_k,
        min_p=_in_range(body.min_p, "min_p", 0.0, 1.0),
        repeat_penalty=repeat_penalty,
        presence_penalty=_in_range(body.presence_penalty, "presence_penalty", -2.0, 2.0),
        frequency_penalty=_in_range(body.frequency_penalty, "frequency_penalty", -2.0, 2.0),
        seed=seed,
        diffusion=diffusion_from(body.diffusion),
    )


MAX_CHOICES = 16  # n
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def logit_bias_from(body: SamplingFields, caps: Capabilities) -> dict[int, float] | None:
    """``logit_bias``: token id (a decimal string) -> bias (-100 to 100), at most
    ``MAX_LOGIT_BIAS`` entries; each problem is a 400 naming ``logit_bias`` and the key.
    Whether the ids are in the model's vocabulary is the backend's check (``validate``).
    Zero biases are dropped; any other bias on a backend without biases is a 501."""
    raw = body.logit_bias
    if not raw:
        return None
    if len(raw) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries ({len(raw)} given)",
            param="logit_bias",
        )
    out: dict[int, float] = {}
    seen: set[int] = set()
    for key, value in raw.items():
        if not _TOKEN_ID.fullmatch(key):
            raise InvalidRequest(
                f"'logit_bias' key {key!r} is not a token id (a non-negative integer)",
                param="logit_bias",
            )
        token = int(key)
        if token in seen:
            raise InvalidRequest(
                f"'logit_bias' key {key!r} names token {token} again", param="logit_bias"
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (math.isfinite(value) and -100 <= value <= 100)
        ):
            raise InvalidRequest(
                f"'logit_bias' value of key {key!r} must be a number between -100 and 100, "
                f"not {value!r}",
                param="logit_bias",
            )
        seen.add(token)
        if value:
            out[token] = float(value)
    if out and not caps.logit_bias:
        raise Unsupported(
            "'logit_bias' needs token biases, which this model's backend lacks",
            param="logit_bias",
            code=policy.UNSUPPORTED,
        )
    return out or None


def choices_from(body: SamplingFields) -> int:
    """``n``: how many choices to generate, 1 to ``MAX_CHOICES``."""
    n = body.n
    if n is None:
        return 1
    if isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise InvalidRequest(f"'n' must be between 1 and {MAX_CHOICES}", param="n")
    return n


def _top_logprobs(value: int | None, param: str, most: int) -> int:
    if isinstance(value, bool) or value is None or not 0 <= value <= most:
        raise InvalidRequest(f"'{param}' must be between 0 and {most}", param=param)
    return value


def stop_from(body: SamplingFields, caps: Capabilities) -> list[str]:
    stop = check_stop(body.stop)
    policy.check_stop_strings(stop, "stop", caps)
    return stop


def constraint_sources(body: SamplingFields) -> list[tuple[str, Constraint]]:
    """The output constraints a request spells (response_format, regex, lark), each with
    its field; ``policy.pick_constraint`` allows one."""
    sources: list[tuple[str, Constraint]] = []
    fmt = body.response_format
    if fmt is not None:
        if fmt.type == "json_schema":
            spec = fmt.json_schema
            if spec is None:
                raise InvalidRequest(
                    "'response_format.json_schema' is required for type json_schema",
                    param="response_format.json_schema",
                )
            schema: Any = spec.schema if spec.schema is not None else {}
            sources.append(
                (
                    "response_format",
                    Constraint(
                        "json_schema",
                        json_text(schema),
                        name=spec.name,
                        strict=True if spec.strict is None else spec.strict,
                    ),
                )
            )
        elif fmt.type == "json_object":
            sources.append(("response_format", Constraint("json_object", "")))
        elif fmt.type != "text":
            raise InvalidRequest(
                "'response_format.type' must be text, json_object or json_schema, "
                f"not {fmt.type!r}",
                param="response_format.type",
            )
    for name in ("regex", "lark"):
        value = getattr(body, name)
        if value is None:
            continue
        if not value:
            raise InvalidRequest(f"'{name}' must be a non-empty string", param=name)
        sources.append((name, Constraint(name, value)))  # type: ignore[arg-type]
    return sources


def _one_constraint(body: SamplingFields, caps: Capabilities) -> Constraint | None:
    picked = policy.pick_constraint(constraint_sources(body), caps)
    return picked[1] if picked is not None else None


# -- chat messages -----------------------------------------------------------------------


def _content_text(msg: ChatMessage, i: int) -> str | None:
    content = msg.content
    if content is None or isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if part.type == "text":
            texts.append(part.text or "")
        elif part.type == "refusal" and msg.role == "assistant":
            texts.append(part.refusal or "")
        elif part.type in _UNSUPPORTED_PARTS:
            raise reject(f"{where}.type", _UNSUPPORTED_PARTS[part.type])
        else:
            raise reject(f"{where}.type", f"{part.type!r} is not a supported content part type")
    return "\n".join(texts)


def _tool_calls_of(msg: ChatMessage, i: int) -> list[ToolCall]:
    calls: list[ToolCall] = []
    for k, call in enumerate(msg.tool_calls or []):
        where = f"messages[{i}].tool_calls[{k}]"
        if call.type != "function":
            raise reject(f"{where}.type", f"{call.type!r} is not supported (only function)")
        if call.function is None:
            raise InvalidRequest(f"'{where}.function' is required", param=f"{where}.function")
        args = call.function.arguments
        calls.append(
            ToolCall(
                id=call.id,
                name=call.function.name,
                arguments=args if isinstance(args, str) else json_text(args),
            )
        )
    return calls


def messages_from(raw: list[ChatMessage], caps: Capabilities) -> list[Message]:
    """Translate ``messages``; tool turns get the name of the call they answer."""
    if not raw:
        raise InvalidRequest("'messages' must not be empty", param="messages")
    out: list[Message] = []
    call_names: dict[str, str] = {}
    for i, msg in enumerate(raw):
        role = _ROLES.get(msg.role)
        if role is None:
            why = (
                "the legacy function role is not supported; use tool messages"
                if msg.role == "function"
                else f"{msg.role!r} is not a valid role (system, developer, user, assistant, tool)"
            )
            raise InvalidRequest(f"'messages[{i}].role': {why}", param=f"messages[{i}].role")
        if role == "system":
            policy.check_system_role(f"messages[{i}].role", caps)
        if msg.function_call is not None:
            raise reject(f"messages[{i}].function_call", "(legacy functions API) is not supported")
        if msg.audio is not None:
            raise reject(f"messages[{i}].audio")
        text = _content_text(msg, i)
        if text is None:
            if role != "assistant":
                raise InvalidRequest(
                    f"'messages[{i}].content' is required for role {msg.role}",
                    param=f"messages[{i}].content",
                )
            text = ""
        message = Message(role=role, content=text)
        if role == "assistant":
            if msg.reasoning_content:
                message.reasoning = msg.reasoning_content
            message.tool_calls = _tool_calls_of(msg, i)
            for call in message.tool_calls:
                call_names[call.id] = call.name
        elif msg.tool_calls:
            raise InvalidRequest(
                f"'messages[{i}].tool_calls' is only valid on assistant messages",
                param=f"messages[{i}].tool_calls",
            )
        if role == "tool":
            if not msg.tool_call_id:
                raise InvalidRequest(
                    f"'messages[{i}].tool_call_id' is required for tool messages",
                    param=f"messages[{i}].tool_call_id",
                )
            message.tool_call_id = msg.tool_call_id
            message.name = call_names.get(msg.tool_call_id, msg.name)
        out.append(message)
    return out


# -- tools -----------------------------------------------------------------------------


def _allowed_tools(value: ToolChoiceObject, tools: list[Tool]) -> tuple[ToolChoice, list[Tool]]:
    """``{type: allowed_tools, allowed_tools: {mode, tools}}`` narrows the declared tools."""
    allowed = value.allowed_tools
    if allowed is None or allowed.mode not in ("auto", "required"):
        raise InvalidRequest(
            "'tool_choice.allowed_tools' needs mode auto or required and a list of tools",
            param="tool_choice",
        )
    names: list[str] = []
    for ref in allowed.tools:
        fn = ref.get("function") if isinstance(ref, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if ref.get("type") != "function" or not isinstance(name, str):
            raise reject("tool_choice", "may only allow function tools ({type, function: {name}})")
        names.append(name)
    narrowed = [policy.declared_tool(name, tools, "tool_choice") for name in dict.fromkeys(names)]
    if allowed.mode == "auto":
        return ToolChoice(), narrowed
    if len(narrowed) == 1:
        return ToolChoice(ToolChoiceMode.NAMED, narrowed[0].name), narrowed
    return ToolChoice(ToolChoiceMode.REQUIRED), narrowed


def _tool_choice_from(
    value: str | ToolChoiceObject | None, tools: list[Tool]
) -> tuple[ToolChoice, list[Tool]]:
    """The tool choice, and the tools it leaves the model."""
    if value is None:
        return ToolChoice(), tools
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise InvalidRequest(
                f"'tool_choice' must be auto, none, required or a function object, not {value!r}",
                param="tool_choice",
            )
        return ToolChoice(ToolChoiceMode(value)), tools
    if value.type == "allowed_tools":
        return _allowed_tools(value, tools)
    if value.type != "function" or value.function is None:
        raise reject("tool_choice", f"of type {value.type!r} is not supported (only function)")
    name = policy.declared_tool(value.function.name, tools, "tool_choice").name
    return ToolChoice(ToolChoiceMode.NAMED, name), tools


def tools_from(body: ChatCompletionRequest) -> list[Tool]:
    tools: list[Tool] = []
    for i, decl in enumerate(body.tools or []):
        if decl.type != "function":
            raise reject(
                f"tools[{i}].type", f"{decl.type!r} is not supported (only function tools)"
            )
        fn = decl.function
        if fn is None or not fn.name:
            raise InvalidRequest(
                f"'tools[{i}].function.name' is required", param=f"tools[{i}].function.name"
            )
        tools.append(
            Tool(
                name=fn.name,
                description=fn.description or "",
                parameters=fn.parameters or {"type": "object", "properties": {}},
                strict=bool(fn.strict),
            )
        )
    return tools


# -- whole requests ----------------------------------------------------------------------


def _reasoning_ask(effort: str | None, template_kwargs: dict[str, Any]) -> policy.ReasoningAsk:
    # llama.cpp precedent: chat_template_kwargs.enable_thinking switches thinking too. It is
    # taken out of the template's variables: the backend renders the policy's decision
    # through its family's own switch, so a constraint that turns reasoning off wins.
    thinking = template_kwargs.pop("enable_thinking", None)
    switch = policy.effort_switch(effort, "reasoning_effort")
    if switch is not None:
        # an explicit effort promises reasoning: refused where there is none
        return policy.ReasoningAsk(switch, "reasoning_effort", strict=True)
    return policy.ReasoningAsk(thinking is True, "chat_template_kwargs.enable_thinking")


def chat_request(
    body: ChatCompletionRequest, caps: Capabilities, ctx: int, request_id: str
) -> NormalizedRequest:
    """Translate a chat body; raises ``InvalidRequest``/``Unsupported`` naming the field."""
    if body.functions:
        raise reject("functions", "(legacy functions API) is not supported; use tools")
    if body.function_call is not None:
        raise reject("function_call", "(legacy functions API) is not supported; use tool_choice")
    logprobs: int | None = None
    if body.logprobs:
        logprobs = _top_logprobs(body.top_logprobs or 0, "top_logprobs", 20)
    elif body.top_logprobs is not None:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if body.modalities and any(m != "text" for m in body.modalities):
        raise reject("modalities", 'must be ["text"]: audio output is not supported')
    if body.audio is not None:
        raise reject("audio")
    if body.web_search_options is not None:
        raise reject("web_search_options", "(hosted web search) is not supported")
    if body.moderation is not None:
        raise reject("moderation")

    messages = messages_from(body.messages, caps)
    sampling = sampling_from(body)
    sampling.logit_bias = logit_bias_from(body, caps)
    if body.max_completion_tokens is not None:
        max_tokens = bounded_max_tokens(body.max_completion_tokens, "max_completion_tokens", ctx)
    else:
        max_tokens = bounded_max_tokens(body.max_tokens, "max_tokens", ctx)
    stop = stop_from(body, caps)
    choice, tools = _tool_choice_from(body.tool_choice, tools_from(body))
    template_kwargs = dict(body.chat_template_kwargs or {})
    decision = policy.decide(
        caps,
        tools=policy.ToolAsk(tools, choice, parallel=body.parallel_tool_calls is not False),
        constraints=constraint_sources(body),
        reasoning=_reasoning_ask(body.reasoning_effort, template_kwargs),
    )
    stream = bool(body.stream)
    request = NormalizedRequest(
        id=request_id,
        dialect="chat",
        messages=messages,
        sampling=sampling,
        max_tokens=max_tokens,
        logprobs=logprobs,
        n=choices_from(body),
        stop=stop,
        stream=stream,
        include_usage=stream and bool(body.stream_options and body.stream_options.include_usage),
        template_kwargs=template_kwargs,
        model=body.model,
    )
    decision.apply(request)
    return request


MAX_PROMPTS = 64  # prompts of one /v1/completions request


def completion_prompts(
    value: Any, caps: Capabilities, vocab_size: int | None = None
) -> list[str | list[int]]:
    """The prompts of a legacy completions body, in OpenAI's four forms: a string, a list
    of strings, a list of token ids, a list of token-id lists. Token ids need a backend
    that takes them and are checked against ``vocab_size`` (a 400 naming the index)."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequest(
            "'prompt' must be a string, a list of strings, a list of token ids or a list "
            "of token-id lists, and not empty",
            param="prompt",
        )
    if all(isinstance(item, str) for item in value):
        prompts: list[str | list[int]] = list(value)
    elif all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        prompts = [list(value)]
    elif all(isinstance(item, list) for item in value):
        prompts = list(value)
        for i, ids in enumerate(prompts):
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidRequest(
                    f"'prompt[{i}]' must be a non-empty list of token ids", param="prompt"
                )
    else:
        raise InvalidRequest(
            "'prompt' mixes kinds: a list must hold only strings, only token ids or only "
            "token-id lists",
            param="prompt",
        )
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"'prompt' holds at most {MAX_PROMPTS} prompts", param="prompt")
    nested = isinstance(value[0], list)
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            continue
        if not caps.token_prompts:
            raise Unsupported(
                "this model's backend does not take token-id prompts; send text", param="prompt"
            )
        for j, token in enumerate(prompt):
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                where = f"prompt[{i}][{j}]" if nested else f"prompt[{j}]"
                raise InvalidRequest(
                    f"'{where}': token id {token} is outside the vocabulary "
                    f"[0, {vocab_size if vocab_size is not None else '...'})",
                    param="prompt",
                )
    return prompts


def completion_request(
    body: CompletionRequest,
    caps: Capabilities,
    ctx: int,
    request_id: str,
    vocab_size: int | None = None,
) -> list[NormalizedRequest]:
    """Translate a legacy completions body (raw prompts, no chat template): one request
    per prompt, each generating ``n`` choices."""
    if not caps.raw_completion:
        raise Unsupported(
            "this model's backend does not serve raw text completions; use /v1/chat/completions",
            param="prompt",
        )
    prompts = completion_prompts(body.prompt, caps, vocab_size)
    if body.echo and body.logprobs is not None:
        raise reject("echo", "with 'logprobs' (the prompt's log-probabilities) is not supported")
    if body.suffix is not None:
        raise reject("suffix", "(insertion) is not supported")
    if body.best_of is not None and body.best_of != 1:
        raise reject("best_of", "must be 1")
    logprobs = None
    if body.logprobs is not None:
        logprobs = _top_logprobs(body.logprobs, "logprobs", 5)
    sampling = sampling_from(body)
    sampling.logit_bias = logit_bias_from(body, caps)
    stream = bool(body.stream)
    base = NormalizedRequest(
        id=request_id,
        dialect="completions",
        sampling=sampling,
        max_tokens=bounded_max_tokens(body.max_tokens, "max_tokens", ctx),
        logprobs=logprobs,
        n=choices_from(body),
        stop=stop_from(body, caps),
        constraint=_one_constraint(body, caps),
        stream=stream,
        include_usage=stream and bool(body.stream_options and body.stream_options.include_usage),
        model=body.model,
    )
    out = []
    for i, prompt in enumerate(prompts):
        text, ids = (prompt, None) if isinstance(prompt, str) else ("", list(prompt))
        # each prompt's requests need ids of their own (the backend keys its work by them)
        own_id = request_id if len(prompts) == 1 else f"{request_id}-p{i}"
        out.append(
            dataclasses.replace(
                base,
                id=own_id,
                prompt=text,
                prompt_ids=ids,
                sampling=dataclasses.replace(base.sampling),
            )
        )
    return out
