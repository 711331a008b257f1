"""Tool calls and reasoning on a synthetic Qwen3 model, end to end in the three dialects.

The model has random weights and Qwen3's real tokenizer and chat template. Prompts are
compared with what transformers renders from the same template. Replies are steered
(steering.Steer): the model "says" a script, and the server's parsers, grammars and encoders
see the tokens a real Qwen3 would write.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from steering import Steer

from lmserve_core.backend import ServerSettings
from lmserve_core.testing.serving import (
    record_prompts,
    reference_prompt,
    reference_tokenizer,
    serve,
)

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx2 = pytest.importorskip("httpx2", reason="the anthropic SDK talks httpx2")

DIALECTS = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
# the dialects' finish of a reply that called tools / of one that did not
CALLED = {"chat": "tool_calls", "responses": "completed", "messages": "tool_use"}
ANSWERED = {"chat": "stop", "responses": "completed", "messages": "end_turn"}
# the stream events that carry a call's arguments / reasoning text
CALL_EVENTS = {
    "chat": {"delta.tool_calls"},
    "responses": {
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    },
    "messages": {"input_json_delta"},
}
REASONING_EVENTS = {
    "chat": {"delta.reasoning_content"},
    "responses": {"response.reasoning_text.delta"},
    "messages": {"thinking_delta", "signature_delta"},
}

# Enums keep a forced call short: a random model under the grammar finishes it in a few tokens.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Zürich", "Lima"]},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
DESCRIPTIONS = {"get_weather": "Current weather in a city.", "get_time": "Current time in a zone."}

SYSTEM = "You are a terse assistant."
ASK = "What is the weather in Paris and Zürich?"
PREAMBLE = "Let me check both."
CALLS = [
    ("call_1", "get_weather", {"city": "Paris", "unit": "c"}),
    ("call_2", "get_weather", {"city": "Zürich", "unit": "c"}),
]
FOLLOW_UP = "Thanks. Which one is warmer?"

THOUGHT = "<think>\nsome reasoning\n</think>\n\nthe answer"
BAD_CALL = "<tool_call>\n{not json}\n</tool_call>"
TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "unit": "f"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
)
TWO_CALLS_PARSED = [
    ("get_weather", {"city": "Lima", "unit": "f"}),
    ("get_time", {"zone": "UTC"}),
]


# ---------------------------------------------------------------------------- serving


class _Bridge(httpx2.BaseTransport):
    """The anthropic SDK speaks httpx2 and refuses httpx clients such as litestar's
    TestClient: this transport hands its requests to the TestClient."""

    _HOP = {"content-length", "content-encoding", "transfer-encoding", "host"}

    def __init__(self, client: Any) -> None:
        self._client = client

    def handle_request(self, request: Any) -> Any:
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in self._HOP]
        reply = self._client.request(
            request.method, str(request.url), headers=headers, content=request.read()
        )
        kept = [(k, v) for k, v in reply.headers.multi_items() if k.lower() not in self._HOP]
        return httpx2.Response(
            reply.status_code, headers=kept, content=reply.content, request=request
        )


@dataclass
class Reply:
    """One reply, read the same way in every dialect."""

    text: str = ""
    reasoning: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    finish: str | None = None  # finish_reason / status / stop_reason
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None  # None where the dialect does not report them
    signatures: list[Any] = field(default_factory=list)  # thinking blocks' signature fields
    events: set[str] = field(default_factory=set)  # stream event kinds seen


@dataclass
class Served:
    http: Any  # litestar TestClient (an httpx.Client)
    steer: Steer
    prompts: list[tuple[str, list[int]]]  # (text, tokens) of every rendered prompt
    openai: Any
    anthropic: Any

    @property
    def prompt(self) -> str:
        return self.prompts[-1][0]

    def post(self, dialect: str, body: dict[str, Any]) -> Any:
        reply = self.http.post(PATHS[dialect], json=body)
        assert reply.status_code == 200, reply.text
        return reply

    def ask(self, dialect: str, **kwargs: Any) -> Reply:
        body = request_body(dialect, **kwargs)
        reply = self.post(dialect, body)
        if body.get("stream"):
            return STREAM_READERS[dialect](list(sse(reply.text)))
        return READERS[dialect](reply.json())


@pytest.fixture(scope="module")
def served(synthetic: Any) -> Iterator[Served]:
    from lmserve_qwen3.plugin import create_backend

    path, _ = synthetic(kind="qwen3", type="q8_0")
    settings = ServerSettings(ctx=2048, threads=2)
    backend = create_backend(str(path), settings)
    steer = Steer(backend)
    prompts = record_prompts(backend)
    with serve(backend, settings) as client, httpx2.Client(transport=_Bridge(client)) as bridge:
        yield Served(
            http=client,
            steer=steer,
            prompts=prompts,
            openai=openai.OpenAI(
                base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0
            ),
            anthropic=anthropic.Anthropic(
                base_url="http://testserver",
                api_key="x",
                http_client=bridge,
                max_retries=0,
            ),
        )


@pytest.fixture
def srv(served: Served) -> Served:
    served.steer.reset()
    served.prompts.clear()
    return served


@pytest.fixture(scope="module")
def hf_tokenizer(synthetic: Any) -> Any:
    return reference_tokenizer(synthetic(kind="qwen3", type="q8_0").hf_dir)


# ---------------------------------------------------------------------------- request bodies


def request_body(
    dialect: str,
    *,
    tools: Sequence[str] = (),
    choice: str = "auto",  # auto, required, or the name of the tool to call
    parallel: bool = True,
    thinking: bool | None = None,
    budget: int = 1024,
    max_tokens: int = 64,
    stream: bool = False,
    schema: dict[str, Any] | None = None,  # an output schema
) -> dict[str, Any]:
    """A request of ``dialect`` spelling the same things in its own fields."""
    body: dict[str, Any] = {"model": "qwen3", "temperature": 0, "stream": stream}
    if schema is not None:
        body.update({
            "chat": {"response_format": {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": schema}}},
            "responses": {"text": {"format": {
                "type": "json_schema", "name": "answer", "schema": schema}}},
            "messages": {"output_config": {"format": {"type": "json_schema", "schema": schema}}},
        }[dialect])
    if dialect == "chat":
        body.update(messages=[{"role": "user", "content": ASK}], max_tokens=max_tokens)
        if stream:
            body["stream_options"] = {"include_usage": True}
        if thinking is not None:
            body["reasoning_effort"] = "high" if thinking else "none"
        if tools:
            body["tools"] = [chat_tool(name) for name in tools]
            body["tool_choice"] = (
                choice
                if choice in ("auto", "required")
                else {"type": "function", "function": {"name": choice}}
            )
            body["parallel_tool_calls"] = parallel
    elif dialect == "responses":
        body.update(input=ASK, max_output_tokens=max_tokens)
        if thinking is not None:
            body["reasoning"] = {"effort": "high" if thinking else "none"}
        if tools:
            body["tools"] = [responses_tool(name) for name in tools]
            body["tool_choice"] = (
                choice if choice in ("auto", "required") else {"type": "function", "name": choice}
            )
            body["parallel_tool_calls"] = parallel
    else:
        body.update(messages=[{"role": "user", "content": ASK}], max_tokens=max_tokens)
        if thinking is not None:
            body["thinking"] = (
                {"type": "enabled", "budget_tokens": budget} if thinking else {"type": "disabled"}
            )
        if tools:
            body["tools"] = [messages_tool(name) for name in tools]
            kind = {"auto": {"type": "auto"}, "required": {"type": "any"}}
            body["tool_choice"] = {
                **kind.get(choice, {"type": "tool", "name": choice}),
                "disable_parallel_tool_use": not parallel,
            }
    return body


def chat_tool(name: str, **extra: Any) -> dict[str, Any]:
    fn = {"name": name, "description": DESCRIPTIONS[name], "parameters": SCHEMAS[name], **extra}
    return {"type": "function", "function": fn}


def responses_tool(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "type": "function",
        "name": name,
        "description": DESCRIPTIONS[name],
        "parameters": SCHEMAS[name],
        **extra,
    }


def messages_tool(name: str) -> dict[str, Any]:
    return {"name": name, "description": DESCRIPTIONS[name], "input_schema": SCHEMAS[name]}


# ---------------------------------------------------------------------------- reading replies


def sse(text: str) -> Iterator[tuple[str | None, dict[str, Any]]]:
    """(event name, data) of each SSE frame; the chat stream's [DONE] is left out."""
    for block in text.split("\n\n"):
        event = data = None
        for line in block.splitlines():
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                data = line[len("data: ") :]
        if data is not None and data != "[DONE]":
            yield event, json.loads(data)


def arguments_of(text: str) -> Any:
    """A call's arguments: the object, or the text when it is no JSON (a call cut off)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def read_chat(body: dict[str, Any]) -> Reply:
    choice = body["choices"][0]
    message = choice["message"]
    usage = body["usage"]
    return Reply(
        text=message["content"] or "",
        reasoning=message.get("reasoning_content") or "",
        calls=[
            (c["function"]["name"], arguments_of(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []
        ],
        finish=choice["finish_reason"],
        completion_tokens=usage["completion_tokens"],
        reasoning_tokens=usage["completion_tokens_details"]["reasoning_tokens"],
    )


def read_chat_stream(frames: list[tuple[str | None, dict[str, Any]]]) -> Reply:
    reply = Reply()
    calls: dict[int, list[str]] = {}
    for _, chunk in frames:
        if chunk.get("usage"):
            reply.completion_tokens = chunk["usage"]["completion_tokens"]
            reply.reasoning_tokens = chunk["usage"]["completion_tokens_details"]["reasoning_tokens"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            reply.events |= {f"delta.{key}" for key, value in delta.items() if value}
            reply.text += delta.get("content") or ""
            reply.reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                name, args = calls.setdefault(call["index"], ["", ""])
                fn = call.get("function") or {}
                calls[call["index"]] = [
                    name + (fn.get("name") or ""),
                    args + fn.get("arguments", ""),
                ]
            if choice["finish_reason"] is not None:
                reply.finish = choice["finish_reason"]
    reply.calls = [(name, arguments_of(args)) for name, args in (calls[i] for i in sorted(calls))]
    return reply


def read_responses(body: dict[str, Any]) -> Reply:
    reply = Reply(finish=body["status"])
    for item in body["output"]:
        if item["type"] == "reasoning":
            reply.reasoning += "".join(part["text"] for part in item["content"])
        elif item["type"] == "message":
            reply.text += "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            reply.calls.append((item["name"], arguments_of(item["arguments"])))
    reply.completion_tokens = body["usage"]["output_tokens"]
    reply.reasoning_tokens = body["usage"]["output_tokens_details"]["reasoning_tokens"]
    return reply


def read_responses_stream(frames: list[tuple[str | None, dict[str, Any]]]) -> Reply:
    reply = Reply()
    arguments: dict[str, str] = {}
    for event, data in frames:
        assert event == data["type"]
        reply.events.add(event)
        if event == "response.output_text.delta":
            reply.text += data["delta"]
        elif event == "response.reasoning_text.delta":
            reply.reasoning += data["delta"]
        elif event == "response.function_call_arguments.delta":
            arguments[data["item_id"]] = arguments.get(data["item_id"], "") + data["delta"]
        elif event == "response.function_call_arguments.done":
            assert arguments[data["item_id"]] == data["arguments"]  # the deltas add up
            reply.calls.append((data["name"], arguments_of(data["arguments"])))
        elif event in ("response.completed", "response.incomplete"):
            final = read_responses(data["response"])
            # the closing response object says what the events said
            assert (final.text, final.reasoning, final.calls) == (
                reply.text,
                reply.reasoning,
                reply.calls,
            )
            reply.finish = final.finish
            reply.completion_tokens = final.completion_tokens
            reply.reasoning_tokens = final.reasoning_tokens
    return reply


def read_messages(body: dict[str, Any]) -> Reply:
    reply = Reply(finish=body["stop_reason"], completion_tokens=body["usage"]["output_tokens"])
    for block in body["content"]:
        if block["type"] == "thinking":
            reply.reasoning += block["thinking"]
            reply.signatures.append(block.get("signature"))
        elif block["type"] == "text":
            reply.text += block["text"]
        elif block["type"] == "tool_use":
            reply.calls.append((block["name"], block["input"]))
    return reply


def read_messages_stream(frames: list[tuple[str | None, dict[str, Any]]]) -> Reply:
    reply = Reply()
    blocks: dict[int, dict[str, Any]] = {}
    for event, data in frames:
        assert event == data["type"]
        if event == "content_block_start":
            blocks[data["index"]] = {**data["content_block"], "json": ""}
        elif event == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            reply.events.add(delta["type"])
            if delta["type"] == "text_delta":
                reply.text += delta["text"]
            elif delta["type"] == "thinking_delta":
                reply.reasoning += delta["thinking"]
            elif delta["type"] == "signature_delta":
                reply.signatures.append(delta["signature"])
            elif delta["type"] == "input_json_delta":
                block["json"] += delta["partial_json"]
        elif event == "content_block_stop":
            block = blocks[data["index"]]
            if block["type"] == "tool_use":
                reply.calls.append((block["name"], arguments_of(block["json"])))
        elif event == "message_delta":
            reply.finish = data["delta"]["stop_reason"]
            reply.completion_tokens = data["usage"]["output_tokens"]
    return reply


READERS = {"chat": read_chat, "responses": read_responses, "messages": read_messages}
STREAM_READERS = {
    "chat": read_chat_stream,
    "responses": read_responses_stream,
    "messages": read_messages_stream,
}


def conforms(value: Any, schema: dict[str, Any]) -> bool:
    """Validation for the small schemas above: closed objects of enum-valued strings."""
    if not isinstance(value, dict):
        return False
    props = schema["properties"]
    return set(schema["required"]) <= set(value) <= set(props) and all(
        value[key] in props[key]["enum"] for key in value
    )


# ---------------------------------------------------------------------------- 1. prompts

# The conversation every dialect spells: a system prompt, a question, an assistant turn
# with text and two calls, both results, then either a follow-up question or nothing more
# (a tool loop: the template then renders the assistant turn's replayed reasoning).
REASONING = "Both cities: two calls."
RESULTS = {"chat": ["21 C, sunny", "8 C, rain"], "responses": ["21 C, sunny", "8 C, rain"]}
# Anthropic's first result is a list of text blocks, which docs/api-messages.md says are
# joined with newlines; its second has is_error, which has no chat equivalent: the docs
# say the text is prefixed with "Error: ".
RESULTS["messages"] = ["21 C\nsunny", "Error: station offline"]


def arguments_text(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


def chat_conversation(loop: bool) -> list[dict[str, Any]]:
    assistant: dict[str, Any] = {
        "role": "assistant",
        "content": PREAMBLE,
        "tool_calls": [
            {
                "id": cid,
                "type": "function",
                "function": {"name": name, "arguments": arguments_text(args)},
            }
            for cid, name, args in CALLS
        ],
    }
    if loop:
        assistant["reasoning_content"] = REASONING
    results = [
        {"role": "tool", "tool_call_id": cid, "content": text}
        for (cid, _, _), text in zip(CALLS, RESULTS["chat"], strict=True)
    ]
    follow_up = [] if loop else [{"role": "user", "content": FOLLOW_UP}]
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": ASK},
        assistant,
        *results,
        *follow_up,
    ]


def responses_input(loop: bool) -> list[dict[str, Any]]:
    reasoning = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": REASONING}],
    }
    follow_up = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": FOLLOW_UP}],
    }
    return [
        {"type": "message", "role": "user", "content": ASK},
        *([reasoning] if loop else []),
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": PREAMBLE}],
        },
        *(
            {
                "type": "function_call",
                "call_id": cid,
                "name": name,
                "arguments": arguments_text(args),
            }
            for cid, name, args in CALLS
        ),
        *(
            {"type": "function_call_output", "call_id": cid, "output": text}
            for (cid, _, _), text in zip(CALLS, RESULTS["responses"], strict=True)
        ),
        *([] if loop else [follow_up]),
    ]


def messages_conversation(loop: bool) -> list[dict[str, Any]]:
    thinking = {"type": "thinking", "thinking": REASONING, "signature": ""}
    uses = [
        {"type": "tool_use", "id": cid, "name": name, "input": args} for cid, name, args in CALLS
    ]
    results = [
        {
            "type": "tool_result",
            "tool_use_id": CALLS[0][0],
            "content": [{"type": "text", "text": "21 C"}, {"type": "text", "text": "sunny"}],
        },
        {
            "type": "tool_result",
            "tool_use_id": CALLS[1][0],
            "content": "station offline",
            "is_error": True,
        },
    ]
    return [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": [*([thinking] if loop else []), {"type": "text", "text": PREAMBLE}, *uses],
        },
        {
            "role": "user",
            "content": [*results, *([] if loop else [{"type": "text", "text": FOLLOW_UP}])],
        },
    ]


def reference_messages(dialect: str, loop: bool) -> list[dict[str, Any]]:
    """The conversation as OpenAI-shaped messages for transformers: call arguments as
    objects, results as tool messages holding what the dialect's docs say they become."""
    assistant: dict[str, Any] = {
        "role": "assistant",
        "content": PREAMBLE,
        "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            for cid, name, args in CALLS
        ],
    }
    if loop:
        assistant["reasoning_content"] = REASONING
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": ASK},
        assistant,
        *(
            {"role": "tool", "tool_call_id": cid, "content": text}
            for (cid, _, _), text in zip(CALLS, RESULTS[dialect], strict=True)
        ),
        *([] if loop else [{"role": "user", "content": FOLLOW_UP}]),
    ]


def history_body(dialect: str, switch: str, on: bool, loop: bool) -> dict[str, Any]:
    names = list(SCHEMAS)
    if dialect == "chat":
        body: dict[str, Any] = {
            "messages": chat_conversation(loop),
            "tools": [chat_tool(name) for name in names],
            "max_tokens": 1,
        }
        if switch == "effort":
            body["reasoning_effort"] = "low" if on else "minimal"
        else:
            body["chat_template_kwargs"] = {"enable_thinking": on}
    elif dialect == "responses":
        body = {
            "instructions": SYSTEM,
            "input": responses_input(loop),
            "tools": [responses_tool(name) for name in names],
            "max_output_tokens": 1,
            "reasoning": {"effort": "medium" if on else "none"},
        }
    else:
        body = {
            "system": SYSTEM,
            "messages": messages_conversation(loop),
            "tools": [messages_tool(name) for name in names],
            "max_tokens": 1,
            "thinking": {"type": "enabled", "budget_tokens": 512} if on else {"type": "disabled"},
        }
    return {"model": "qwen3", **body}


@pytest.mark.reference
@pytest.mark.parametrize("loop", [False, True], ids=["follow-up", "tool-loop"])
@pytest.mark.parametrize("on", [True, False], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize(
    ("dialect", "switch"),
    [
        ("chat", "effort"),
        ("chat", "enable_thinking"),
        ("responses", "effort"),
        ("messages", "thinking"),
    ],
)
def test_prompt_with_tool_history_is_what_transformers_renders(
    srv: Served, hf_tokenizer: Any, dialect: str, switch: str, on: bool, loop: bool
) -> None:
    srv.post(dialect, history_body(dialect, switch, on, loop))
    ((text, tokens),) = srv.prompts
    expected = reference_prompt(
        hf_tokenizer,
        reference_messages(dialect, loop),
        tools=[chat_tool(name) for name in SCHEMAS],
        thinking=on,
    )
    assert text == expected
    assert tokens == hf_tokenizer.encode(expected, add_special_tokens=False)
    primed = "<think>\n\n</think>\n\n"
    assert text.endswith("<|im_start|>assistant\n" + ("" if on else primed))
    # only inside a tool loop does Qwen3's template replay the turn's reasoning
    assert (f"<think>\n{REASONING}\n</think>" in text) == loop


@pytest.mark.parametrize("loop", [False, True], ids=["follow-up", "tool-loop"])
@pytest.mark.parametrize("on", [True, False], ids=["thinking", "no-thinking"])
def test_count_tokens_counts_thinking_history_as_the_template_renders_it(
    srv: Served, on: bool, loop: bool
) -> None:
    body = history_body("messages", "thinking", on, loop)
    counted = srv.http.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == 200, counted.text
    srv.post("messages", body)
    assert counted.json()["input_tokens"] == len(srv.prompts[-1][1])
    # a thinking block of the history counts only where the template replays it
    def count(with_thinking: bool) -> int:
        messages = messages_conversation(loop)
        blocks = [b for b in messages[1]["content"] if b["type"] != "thinking"]
        if with_thinking:
            blocks.insert(0, {"type": "thinking", "thinking": REASONING, "signature": ""})
        reply = srv.http.post("/v1/messages/count_tokens", json={**body, "messages": [
            messages[0], {**messages[1], "content": blocks}, messages[2]]})
        assert reply.status_code == 200, reply.text
        return int(reply.json()["input_tokens"])

    assert (count(True) > count(False)) == loop


# ---------------------------------------------------------------------------- 2. forced calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("choice", ["required", "get_time"])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_forced_call_is_a_valid_call_of_an_allowed_tool(
    srv: Served, dialect: str, choice: str, stream: bool
) -> None:
    # The model is pushed towards <|im_end|> at every step: only the grammar keeps it
    # writing, and once the first call is complete it stops there.
    srv.steer.always = srv.steer.ids("<|im_end|>")[0]
    reply = srv.ask(dialect, tools=list(SCHEMAS), choice=choice, max_tokens=80, stream=stream)
    allowed = set(SCHEMAS) if choice == "required" else {choice}
    assert len(reply.calls) == 1, reply
    name, arguments = reply.calls[0]
    assert name in allowed
    assert conforms(arguments, SCHEMAS[name]), arguments
    assert reply.text == "" and reply.reasoning == ""
    assert reply.finish == CALLED[dialect]
    if stream:
        assert CALL_EVENTS[dialect] <= reply.events


@pytest.mark.parametrize("dialect", DIALECTS)
def test_forced_call_switches_reasoning_off(srv: Served, dialect: str) -> None:
    srv.steer.always = srv.steer.ids("<|im_end|>")[0]
    reply = srv.ask(dialect, tools=list(SCHEMAS), choice="required", thinking=True, max_tokens=80)
    # the grammar governs the reply from its first token: the prompt is the non-thinking one
    assert srv.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert reply.reasoning == "" and len(reply.calls) == 1
    assert reply.finish == CALLED[dialect]


def test_forced_call_through_the_openai_chat_stream_helper(srv: Served) -> None:
    srv.steer.always = srv.steer.ids("<|im_end|>")[0]
    with srv.openai.chat.completions.stream(
        model="qwen3",
        messages=[{"role": "user", "content": ASK}],
        # the helper parses arguments of strict tools only
        tools=[chat_tool(name, strict=True) for name in SCHEMAS],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        temperature=0,
    ) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert conforms(call.function.parsed_arguments, WEATHER)
    assert json.loads(call.function.arguments) == call.function.parsed_arguments


def test_forced_call_through_the_openai_responses_stream_helper(srv: Served) -> None:
    srv.steer.always = srv.steer.ids("<|im_end|>")[0]
    with srv.openai.responses.stream(
        model="qwen3",
        input=ASK,
        tools=[responses_tool(name) for name in SCHEMAS],
        tool_choice="required",
        max_output_tokens=80,
        temperature=0,
    ) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_response()
    assert {
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    } <= kinds
    assert final.status == "completed"
    (call,) = final.output
    assert call.type == "function_call" and call.name in SCHEMAS
    assert conforms(json.loads(call.arguments), SCHEMAS[call.name])


def test_forced_call_through_the_anthropic_stream_helper(srv: Served) -> None:
    srv.steer.always = srv.steer.ids("<|im_end|>")[0]
    with srv.anthropic.messages.stream(
        model="qwen3",
        max_tokens=80,
        messages=[{"role": "user", "content": ASK}],
        tools=[messages_tool(name) for name in SCHEMAS],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},  # this SDK has no temperature argument
    ) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_message()
    assert "input_json" in kinds  # the helper's event for input_json_delta
    assert final.stop_reason == "tool_use"
    (use,) = final.content
    assert use.type == "tool_use" and use.name in SCHEMAS
    assert conforms(use.input, SCHEMAS[use.name])


# ---------------------------------------------------------------------------- parallel calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "single"])
@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_two_call_regions_are_two_calls_unless_parallel_calls_are_off(
    srv: Served, dialect: str, choice: str, parallel: bool, stream: bool
) -> None:
    srv.steer.say(TWO_CALLS + "<|im_end|>")
    reply = srv.ask(
        dialect,
        tools=list(SCHEMAS),
        choice=choice,
        parallel=parallel,
        max_tokens=100,
        stream=stream,
    )
    assert reply.calls == (TWO_CALLS_PARSED if parallel else TWO_CALLS_PARSED[:1])
    assert reply.text == ""
    assert reply.finish == CALLED[dialect]
    script = srv.steer.script
    if parallel:
        assert reply.completion_tokens == len(script)
    else:
        # generation stops at the end of the first call: the second is never written
        first = script.index(srv.steer.ids("</tool_call>")[0]) + 1
        assert reply.completion_tokens == first


# ---------------------------------------------------------------------------- calls and schemas

ANSWER = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
CUT = {"chat": "length", "responses": "incomplete", "messages": "max_tokens"}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_an_output_schema_and_tools_under_auto_are_calls_or_text_of_the_schema(
    srv: Served, dialect: str
) -> None:
    srv.steer.say(TWO_CALLS + "<|im_end|>")
    reply = srv.ask(dialect, tools=list(SCHEMAS), schema=ANSWER, max_tokens=100)
    assert (reply.calls, reply.text, reply.finish) == (TWO_CALLS_PARSED, "", CALLED[dialect])
    srv.steer.say('{"n": 42}<|im_end|>')
    reply = srv.ask(dialect, tools=list(SCHEMAS), schema=ANSWER)
    assert (reply.calls, reply.text, reply.finish) == ([], '{"n": 42}', ANSWERED[dialect])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_forced_call_with_an_output_schema_is_a_call(
    srv: Served, dialect: str, stream: bool
) -> None:
    srv.steer.always = srv.steer.ids("<|im_end|>")[0]
    reply = srv.ask(dialect, tools=list(SCHEMAS), choice="get_time", schema=ANSWER,
                    max_tokens=80, stream=stream)
    ((name, arguments),) = reply.calls
    assert name == "get_time" and conforms(arguments, TIME)
    assert (reply.text, reply.finish) == ("", CALLED[dialect])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_call_the_token_bound_cuts_off_is_a_partial_call_not_text(
    srv: Served, dialect: str, stream: bool
) -> None:
    """Not forced: the model opens a call region and runs into max_tokens inside it. The
    call comes back as the dialect's call, its arguments the JSON written so far; its
    markers and JSON never as text."""
    call = TWO_CALLS.split("\n</tool_call>")[0] + "\n</tool_call>"
    srv.steer.say(PREAMBLE + "\n" + call + "<|im_end|>")
    head = PREAMBLE + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
    cut = len(srv.steer.ids(head)) + 1  # a token into the city
    reply = srv.ask(dialect, tools=list(SCHEMAS), max_tokens=cut, stream=stream)
    assert (reply.text, reply.finish) == (PREAMBLE, CUT[dialect])
    ((name, arguments),) = reply.calls
    assert name == "get_weather"
    if dialect == "messages" and not stream:
        # a whole message's input holds what was written, a string so far closed
        assert list(arguments) == ["city"] and "Lima".startswith(arguments["city"])
    else:
        assert isinstance(arguments, str) and arguments.startswith('{"city": "L')
        assert '{"city": "Lima", "unit": "f"}'.startswith(arguments)
    # cut inside the opening marker or before the name: no call, no text
    reply = srv.ask(dialect, tools=list(SCHEMAS),
                    max_tokens=len(srv.steer.ids(PREAMBLE + "\n<tool_call>\n{")), stream=stream)
    assert (reply.text, reply.calls, reply.finish) == (PREAMBLE, [], CUT[dialect])


# ---------------------------------------------------------------------------- 3. malformed


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_call_region_that_is_not_json_passes_through_as_text(
    srv: Served, dialect: str, stream: bool
) -> None:
    srv.steer.say(BAD_CALL + "<|im_end|>")
    reply = srv.ask(dialect, tools=list(SCHEMAS), stream=stream)
    assert reply.text == BAD_CALL
    assert reply.calls == []
    assert reply.finish == ANSWERED[dialect]


# ---------------------------------------------------------------------------- 4. thinking


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_reasoning_comes_back_in_the_dialects_reasoning_field(
    srv: Served, dialect: str, stream: bool
) -> None:
    srv.steer.say(THOUGHT + "<|im_end|>")
    reply = srv.ask(dialect, thinking=True, stream=stream)
    assert srv.prompt.endswith("<|im_start|>assistant\n")  # the model opens the block
    assert reply.reasoning == "some reasoning"
    assert reply.text == "the answer"
    assert reply.finish == ANSWERED[dialect]
    assert reply.completion_tokens == len(srv.steer.script)
    if dialect == "messages":
        assert reply.signatures and all(sig == "" for sig in reply.signatures)
    else:
        # at least the reasoning's own tokens, at most the whole think block
        block = srv.steer.ids(THOUGHT.split("\n\n")[0])
        assert reply.reasoning_tokens is not None
        assert len(srv.steer.ids("some reasoning")) <= reply.reasoning_tokens <= len(block)
    if stream:
        assert REASONING_EVENTS[dialect] <= reply.events


@pytest.mark.parametrize("dialect", DIALECTS)
def test_reasoning_off_renders_the_primed_empty_think_block(srv: Served, dialect: str) -> None:
    srv.steer.say("the answer<|im_end|>")
    reply = srv.ask(dialect, thinking=False)
    assert srv.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert (reply.reasoning, reply.text) == ("", "the answer")
    assert reply.signatures == []
    assert reply.reasoning_tokens in (0, None)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_think_block_written_with_reasoning_off_stays_out_of_the_answer(
    srv: Served, dialect: str
) -> None:
    # Reasoning off: the prompt primes an empty think block, so a model should not think;
    # if it does anyway, its block is still routed out of the answer, never mixed into it.
    srv.steer.say(THOUGHT + "<|im_end|>")
    reply = srv.ask(dialect, thinking=False)
    assert reply.text == "the answer"
    assert reply.reasoning == "some reasoning"


def test_reasoning_through_the_sdk_stream_helpers(srv: Served) -> None:
    srv.steer.say(THOUGHT + "<|im_end|>")
    with srv.openai.responses.stream(
        model="qwen3",
        input=ASK,
        reasoning={"effort": "high"},
        max_output_tokens=64,
        temperature=0,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        response = stream.get_final_response()
    assert "".join(deltas) == "some reasoning"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "some reasoning"
    assert response.output_text == "the answer"
    assert response.usage.output_tokens_details.reasoning_tokens > 0

    srv.steer.say(THOUGHT + "<|im_end|>")
    with srv.anthropic.messages.stream(
        model="qwen3",
        max_tokens=64,
        messages=[{"role": "user", "content": ASK}],
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 0},
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "thinking" in kinds and "signature" in kinds
    thinking, text = final.content
    assert thinking.type == "thinking" and thinking.thinking == "some reasoning"
    assert thinking.signature == ""
    assert text.type == "text" and text.text == "the answer"
    assert final.stop_reason == "end_turn"

    srv.steer.say(THOUGHT + "<|im_end|>")
    chunks = srv.openai.chat.completions.create(
        model="qwen3",
        messages=[{"role": "user", "content": ASK}],
        reasoning_effort="high",
        max_tokens=64,
        temperature=0,
        stream=True,
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "some reasoning"
    assert "".join(d.content or "" for d in deltas) == "the answer"


# A reasoning that would run far past the budget; the words are one token each.
LONG_REASONING = " ".join(["first", "then", "next", "also", "more"] * 8)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_thinking_budget_closes_the_think_block_and_the_answer_follows(
    srv: Served, stream: bool
) -> None:
    budget = 6
    srv.steer.say("<think>\n" + LONG_REASONING, then="the answer<|im_end|>")
    reply = srv.ask("messages", thinking=True, budget=budget, max_tokens=100, stream=stream)
    assert reply.reasoning and LONG_REASONING.startswith(reply.reasoning)
    assert len(srv.steer.ids(reply.reasoning)) <= budget
    # the server wrote the closing marker into the model's own sequence, after a
    # reasoning token, in the step that fed that token
    closing = srv.steer.ids("</think>\n\n")
    assert any(len(step) == 1 + len(closing) and step[1:] == closing for step in srv.steer.steps)
    assert reply.text == "the answer" and "</think>" not in reply.text
    assert reply.finish == "end_turn"
    # <think>, at most the budget's reasoning tokens, the closing, the answer
    answer = srv.steer.ids("the answer<|im_end|>")
    assert reply.completion_tokens is not None
    assert reply.completion_tokens <= 1 + budget + len(closing) + len(answer)
