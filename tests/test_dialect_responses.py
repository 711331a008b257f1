"""The OpenAI Responses dialect against a real ``lmserve`` process (scripted backend)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import openai
import pytest
from httpx_sse import connect_sse

from lmserve_core.backend import Capabilities
from lmserve_core.dialects.responses import translate
from lmserve_core.dialects.responses_models import ResponsesRequest
from lmserve_core.errors import InvalidRequest, Unsupported
from lmserve_core.request import ToolChoiceMode
from lmserve_core.tools import HERMES

API_KEY = "test-key"  # the key the conftest servers are started with

MODEL = "anything"  # accepted and ignored: one process serves one model
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def raw_events(base_url: str, body: dict[str, Any], path: str = "/v1/responses") -> list[Any]:
    """The SSE events of a streamed request, as (event name, decoded data) pairs."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with (
        httpx.Client(timeout=30) as client,
        connect_sse(client, "POST", base_url + path, json=body, headers=headers) as source,
    ):
        assert source.response.status_code == 200
        assert source.response.headers["content-type"].startswith("text/event-stream")
        return [(sse.event, sse.data) for sse in source.iter_sse()]


def decoded(events: list[Any]) -> list[dict[str, Any]]:
    out = []
    for name, data in events:
        assert data != "[DONE]"
        payload = json.loads(data)
        assert payload["type"] == name  # the event: line mirrors data.type
        out.append(payload)
    return out


def check_sequence(payloads: list[dict[str, Any]]) -> None:
    numbers = [p["sequence_number"] for p in payloads]
    assert numbers == list(range(len(payloads)))


# -- non-streaming -----------------------------------------------------------------------


def test_create_string_input(openai_client: openai.OpenAI) -> None:
    resp = openai_client.responses.create(model=MODEL, input="#reply:Hi there, friend")
    assert resp.id.startswith("resp_")
    assert resp.object == "response"
    assert resp.status == "completed"
    assert resp.model == "scripted-model"
    assert resp.output_text == "Hi there, friend"
    message = resp.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert message.content[0].type == "output_text"
    assert resp.usage is not None
    assert resp.usage.input_tokens > 0 and resp.usage.output_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.usage.input_tokens_details.cached_tokens == 0
    assert resp.error is None and resp.incomplete_details is None


def test_create_item_list_with_instructions(openai_client: openai.OpenAI) -> None:
    resp = openai_client.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input=[
            {"role": "developer", "content": "Be kind."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello!"}],
            },
            {"role": "user", "content": [{"type": "input_text", "text": "#reply:Fine thanks"}]},
        ],
        temperature=0.2,
        top_p=0.9,
        max_output_tokens=64,
    )
    assert resp.output_text == "Fine thanks"
    assert resp.instructions == "Answer briefly."
    assert resp.temperature == 0.2 and resp.top_p == 0.9
    assert resp.max_output_tokens == 64
    assert resp.usage is not None and resp.usage.input_tokens >= 5


def test_unprefixed_path_and_extensions(server: Any) -> None:
    body = {
        "model": MODEL,
        "input": "#reply:ok",
        "top_k": 20,
        "min_p": 0.05,
        "repeat_penalty": 1.1,
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "store": False,
        "metadata": {"k": "v"},
        "user": "u",
        "service_tier": "auto",
        "parallel_tool_calls": False,
        "prompt_cache_key": "p",
        "safety_identifier": "s",
        "max_tool_calls": 3,
        "include": ["reasoning.encrypted_content"],
    }
    r = httpx.post(
        server.base_url + "/responses", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["output"][0]["content"][0]["text"] == "ok"
    assert data["metadata"] == {"k": "v"}


def test_max_output_tokens_incomplete(openai_client: openai.OpenAI) -> None:
    resp = openai_client.responses.create(model=MODEL, input="#tokens:40", max_output_tokens=5)
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == "t0 t1 t2 t3 t4"
    assert resp.usage is not None and resp.usage.output_tokens == 5


def test_json_schema_format_reaches_backend(openai_client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    resp = openai_client.responses.create(
        model=MODEL,
        input="#echo",
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}},
    )
    constraint = json.loads(resp.output_text)["constraint"]
    assert constraint["kind"] == "json_schema" and constraint["name"] == "thing"
    assert json.loads(constraint["source"]) == schema
    assert resp.text is not None and resp.text.format.type == "json_schema"
    resp = openai_client.responses.create(
        model=MODEL, input="#echo", text={"format": {"type": "json_object"}}
    )
    assert json.loads(resp.output_text)["constraint"]["kind"] == "json_object"


def test_parse_with_pydantic_format(openai_client: openai.OpenAI) -> None:
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        temp: int

    resp = openai_client.responses.parse(
        model=MODEL, input='#reply:{"city": "Paris", "temp": 21}', text_format=Weather
    )
    assert resp.output_parsed == Weather(city="Paris", temp=21)


# -- streaming ---------------------------------------------------------------------------


def test_stream_event_order(openai_client: openai.OpenAI) -> None:
    stream = openai_client.responses.create(
        model=MODEL, input="#reply:one two three #delay:5", stream=True
    )
    events = list(stream)
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers)) and numbers[0] == 0
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert all(d.output_index == 0 and d.content_index == 0 and d.logprobs == [] for d in deltas)
    assert "".join(d.delta for d in deltas) == "one two three"
    done = events[-1]
    assert done.type == "response.completed"
    assert done.response.output_text == "one two three"
    assert done.response.usage is not None and done.response.usage.output_tokens > 0


def test_stream_raw_framing(server: Any) -> None:
    events = raw_events(server.base_url, {"model": MODEL, "input": "#reply:hey", "stream": True})
    payloads = decoded(events)
    check_sequence(payloads)
    assert payloads[-1]["type"] == "response.completed"
    assert payloads[0]["response"]["status"] == "in_progress"
    assert payloads[0]["response"]["output"] == []


def test_stream_helper_final_response(openai_client: openai.OpenAI) -> None:
    with openai_client.responses.stream(model=MODEL, input="#reply:streamed reply") as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == "streamed reply"
    assert final.output_text == "streamed reply"
    assert final.status == "completed"


def test_stream_incomplete(server: Any) -> None:
    body = {"model": MODEL, "input": "#tokens:30", "stream": True, "max_output_tokens": 4}
    payloads = decoded(raw_events(server.base_url, body))
    check_sequence(payloads)
    last = payloads[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["output"][0]["status"] == "incomplete"


# -- tools -------------------------------------------------------------------------------


def test_tool_call_non_streaming(openai_client: openai.OpenAI) -> None:
    resp = openai_client.responses.create(
        model=MODEL,
        input='What is the weather? #reply:Checking. #tool:get_weather:{"city":"Paris"}',
        tools=[WEATHER_TOOL],
    )
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id and call.id and call.id.startswith("fc_")
    assert call.status == "completed"
    assert resp.output_text == "Checking."
    assert [t.name for t in resp.tools if t.type == "function"] == ["get_weather"]


def test_tool_call_streaming(openai_client: openai.OpenAI) -> None:
    with openai_client.responses.stream(
        model=MODEL,
        input='#reply:Let me check. #tool:get_weather:{"city":"Oslo"}',
        tools=[WEATHER_TOOL],
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    message_done = types.index("response.output_item.done")
    call_added = [
        i
        for i, e in enumerate(events)
        if e.type == "response.output_item.added" and e.item.type == "function_call"
    ]
    assert call_added and call_added[0] > message_done
    assert types[call_added[0] :] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    call = [item for item in final.output if item.type == "function_call"][0]
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Oslo"}
    assert final.output_text == "Let me check."


def test_function_call_output_history(openai_client: openai.OpenAI) -> None:
    resp = openai_client.responses.create(
        model=MODEL,
        tools=[WEATHER_TOOL],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21C"},
            {
                "type": "function_call_output",
                "call_id": "call_1",
                "output": [{"type": "input_text", "text": "also windy"}],
            },
            {"role": "user", "content": "#reply:It is sunny."},
        ],
    )
    assert resp.output_text == "It is sunny."


def test_tool_choice_forces_hosted_tool_rejected(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.responses.create(
            model=MODEL,
            input="hi",
            tools=[{"type": "web_search"}],
            tool_choice={"type": "web_search_preview"},
        )
    assert "tool_choice" in str(err.value)


def test_named_tool_choice_must_exist(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.responses.create(
            model=MODEL,
            input="hi",
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "name": "nope"},
        )
    assert "tool_choice" in str(err.value)


def test_allowed_tools_choice(openai_client: openai.OpenAI) -> None:
    other = {**WEATHER_TOOL, "name": "get_time"}
    resp = openai_client.responses.create(
        model=MODEL,
        input='#reply:ok #tool:get_weather:{"city":"Rome"}',
        tools=[WEATHER_TOOL, other],
        tool_choice={
            "type": "allowed_tools",
            "mode": "auto",
            "tools": [{"type": "function", "name": "get_weather"}],
        },
    )
    assert [t.name for t in resp.tools if t.type == "function"] == ["get_weather"]
    assert [item.type for item in resp.output] == ["message", "function_call"]


# -- reasoning ---------------------------------------------------------------------------


def test_reasoning_item(openai_client: openai.OpenAI) -> None:
    resp = openai_client.responses.create(
        model=MODEL,
        input="#think:Let me think. #reply:42",
        reasoning={"effort": "high", "summary": "auto"},
    )
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    reasoning = resp.output[0]
    assert reasoning.type == "reasoning"
    assert reasoning.content is not None
    assert reasoning.content[0].text == "Let me think."
    assert reasoning.summary == []
    assert resp.output_text == "42"
    assert resp.usage is not None and resp.usage.output_tokens_details.reasoning_tokens > 0


def test_reasoning_off_by_default(openai_client: openai.OpenAI) -> None:
    resp = openai_client.responses.create(model=MODEL, input="#think:hidden #reply:42")
    assert [item.type for item in resp.output] == ["message"]


def test_reasoning_streams_as_its_own_item(server: Any) -> None:
    body = {
        "model": MODEL,
        "input": "#think:Step one. #reply:Done.",
        "reasoning": {"effort": "medium"},
        "stream": True,
    }
    payloads = decoded(raw_events(server.base_url, body))
    check_sequence(payloads)
    types = [p["type"] for p in payloads]
    first_text = types.index("response.output_text.delta")
    assert types.index("response.reasoning_text.delta") < first_text
    assert types.index("response.reasoning_text.done") < first_text
    added = [p for p in payloads if p["type"] == "response.output_item.added"]
    assert [(p["output_index"], p["item"]["type"]) for p in added] == [
        (0, "reasoning"),
        (1, "message"),
    ]
    reasoning = "".join(
        p["delta"] for p in payloads if p["type"] == "response.reasoning_text.delta"
    )
    assert reasoning == "Step one."
    final = payloads[-1]["response"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Step one."}]


# -- agents ------------------------------------------------------------------------------


def codex_body() -> dict[str, Any]:
    """A request in the shape Codex CLI sends."""
    return {
        "model": "gpt-5-codex",
        "instructions": "You are a coding agent running in a terminal.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "<permissions>sandboxed</permissions>"}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "<environment_context/>"}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "list files #reply:Sure."}],
            },
        ],
        "tools": [
            {
                "type": "function",
                "name": "shell",
                "description": "Runs a shell command",
                "strict": False,
                "parameters": {
                    "type": "object",
                    "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                    "required": ["command"],
                    "additionalProperties": False,
                },
            },
            {"type": "web_search"},
            {
                "type": "namespace",
                "name": "mcp__docs",
                "description": "Documentation server",
                "tools": [{"type": "function", "name": "search", "parameters": {}}],
            },
            {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a1b2-session",
        "text": {"verbosity": "medium"},
    }


def test_codex_shaped_request(server: Any) -> None:
    payloads = decoded(raw_events(server.base_url, codex_body()))
    check_sequence(payloads)
    final = payloads[-1]
    assert final["type"] == "response.completed"
    response = final["response"]
    assert [item["type"] for item in response["output"]] == ["message"]
    assert response["output"][0]["content"][0]["text"] == "Sure."
    assert [tool["name"] for tool in response["tools"]] == ["shell"]
    assert response["usage"]["total_tokens"] > 0


def test_codex_shaped_tool_turn(server: Any) -> None:
    body = codex_body()
    body["input"][-1]["content"][0]["text"] = '#reply:Running. #tool:shell:{"command":["ls"]}'
    payloads = decoded(raw_events(server.base_url, body))
    done = [p["item"] for p in payloads if p["type"] == "response.output_item.done"]
    calls = [item for item in done if item["type"] == "function_call"]
    assert len(calls) == 1 and json.loads(calls[0]["arguments"]) == {"command": ["ls"]}
    # the next turn replays the call and its output
    body["input"] += [
        {"type": "reasoning", "id": "rs_x", "summary": [], "encrypted_content": None},
        {k: calls[0][k] for k in ("type", "call_id", "name", "arguments")},
        {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "a.txt"},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "#reply:ok"}],
        },
    ]
    payloads = decoded(raw_events(server.base_url, body))
    assert payloads[-1]["type"] == "response.completed"


def test_namespace_tools_are_offered_and_called_by_namespace(server: Any) -> None:
    # Codex CLI groups client-run tools in namespaces; the model sees them under flat names
    # and a call comes back with its namespace and name apart, as Codex reads it.
    body = codex_body()
    body["tools"].append(
        {
            "type": "namespace",
            "name": "agents",
            "description": "Sub-agents.",
            "tools": [
                {
                    "type": "function",
                    "name": "spawn_agent",
                    "description": "Spawn one.",
                    "parameters": {"type": "object", "properties": {"message": {"type": "string"}}},
                },
                {"type": "web_search"},
            ],
        }
    )
    body["input"][-1]["content"][0]["text"] = (
        '#echo #reply:Go. #tool:agents.spawn_agent:{"message":"hi"}'
    )
    payloads = decoded(raw_events(server.base_url, body))
    done = [p["item"] for p in payloads if p["type"] == "response.output_item.done"]
    calls = [item for item in done if item["type"] == "function_call"]
    assert [(c["namespace"], c["name"]) for c in calls] == [("agents", "spawn_agent")]
    args_done = [p for p in payloads if p["type"] == "response.function_call_arguments.done"]
    assert args_done[0]["name"] == "spawn_agent"
    # the backend saw the flat name among the tools
    text = "".join(
        p.get("delta", "") for p in payloads if p["type"] == "response.output_text.delta"
    )
    assert "agents.spawn_agent" in text
    # and a replayed call with its namespace maps back to the flat name
    body["input"] += [
        {k: calls[0][k] for k in ("type", "call_id", "name", "namespace", "arguments")},
        {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "ok"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "#echo"}]},
    ]
    payloads = decoded(raw_events(server.base_url, body))
    text = "".join(
        p.get("delta", "") for p in payloads if p["type"] == "response.output_text.delta"
    )
    received = json.loads(text)
    assert ["agents.spawn_agent"] in [m["tool_calls"] for m in received["messages"]]
    assert payloads[-1]["type"] == "response.completed"


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ],
)
def test_rejected_fields(openai_client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.responses.create(model=MODEL, input="hi", extra_body=extra)
    assert err.value.status_code == 400
    assert param in err.value.message
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == param


@pytest.mark.parametrize("empty", ["", []])
def test_an_empty_input_is_a_400(openai_client: openai.OpenAI, empty: Any) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.responses.create(model=MODEL, input=empty)
    assert err.value.status_code == 400
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == "input"


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "item_reference", "id": "msg_1"}, "input[0]"),
        (
            {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]},
            "input[0].content[0]",
        ),
        (
            {"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]},
            "input[0].content[0]",
        ),
    ],
)
def test_rejected_input_items(
    openai_client: openai.OpenAI, item: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.responses.create(model=MODEL, input=[item])
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == param


def test_wrong_key(server: Any) -> None:
    with (
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.responses.create(model=MODEL, input="hi")


def test_in_band_error(openai_client: openai.OpenAI, server: Any) -> None:
    stream = openai_client.responses.create(model=MODEL, input="#reply:a b c #error", stream=True)
    types = [e.type for e in stream]
    assert "response.output_text.delta" in types
    assert types[-2:] == ["error", "response.failed"]
    payloads = decoded(
        raw_events(
            server.base_url, {"model": MODEL, "input": "#reply:a b c #error", "stream": True}
        )
    )
    check_sequence(payloads)
    error, failed = payloads[-2], payloads[-1]
    assert error["message"] and error["code"] == "server_error"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == error["message"]


def test_failure_before_output_is_plain_error(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError):
        openai_client.responses.create(model=MODEL, input="#fail", stream=True)
    with pytest.raises(openai.InternalServerError):
        openai_client.responses.create(model=MODEL, input="#fail")


def test_invalid_body_is_400(server: Any) -> None:
    r = httpx.post(
        server.base_url + "/v1/responses",
        json={"model": MODEL, "input": 5},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


# -- a backend without grammar, reasoning or tools ---------------------------------------


def test_plain_backend(start_server: Any) -> None:
    plain = start_server(env={"LMSERVE_SCRIPTED_CAPS": ""})
    with openai.OpenAI(base_url=plain.base_url + "/v1", api_key=API_KEY, max_retries=0) as client:
        # reasoning.effort is a no-op and function tools are dropped: agents stay usable
        resp = client.responses.create(
            model=MODEL,
            input='#think:no #reply:plain #tool:get_weather:{"city":"Rome"}',
            reasoning={"effort": "high"},
            tools=[WEATHER_TOOL, {"type": "web_search_preview"}],
        )
        assert [item.type for item in resp.output] == ["message"]
        assert resp.output_text == "plain"
        # a forced call is a grammar: without constrained decoding it is a 501
        with pytest.raises(openai.APIStatusError) as err:
            client.responses.create(
                model=MODEL, input="hi", tools=[WEATHER_TOOL], tool_choice="required"
            )
        assert err.value.status_code == 501
        assert err.value.body["param"] == "tool_choice"  # type: ignore[index]
        with pytest.raises(openai.APIStatusError) as status_err:
            client.responses.create(
                model=MODEL, input="hi", text={"format": {"type": "json_object"}}
            )
        assert status_err.value.status_code == 501
        assert status_err.value.body["param"] == "text.format"  # type: ignore[index]


# -- the capability policy, through the translator ---------------------------------------

ALL_CAPS = Capabilities(grammar=True, reasoning=True, tools=HERMES)
GRAMMAR_ONLY = Capabilities(grammar=True)  # constrained decoding, no tool convention
FORCED_CHOICES: list[Any] = [
    "required",
    {"type": "function", "name": "get_weather"},
    {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "get_weather"}],
    },
]


def translated(body: dict[str, Any], caps: Capabilities = ALL_CAPS) -> Any:
    server: Any = SimpleNamespace(
        backend=SimpleNamespace(capabilities=caps), ctx=4096, model_id="m"
    )
    return translate(msgspec.convert({"input": "x", **body}, ResponsesRequest), server).normalized


@pytest.mark.parametrize("choice", FORCED_CHOICES)
def test_forced_call_without_a_convention_is_accepted_with_grammar(choice: Any) -> None:
    req = translated({"tools": [WEATHER_TOOL], "tool_choice": choice}, GRAMMAR_ONLY)
    assert [t.name for t in req.tools] == ["get_weather"]
    assert req.tool_choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)
    # under auto the same tools are dropped: nothing in a free reply reads as a call
    assert translated({"tools": [WEATHER_TOOL]}, GRAMMAR_ONLY).tools == []


@pytest.mark.parametrize("caps", [Capabilities(tools=HERMES), Capabilities()])
@pytest.mark.parametrize("choice", FORCED_CHOICES)
def test_forced_call_needs_grammar(caps: Capabilities, choice: Any) -> None:
    with pytest.raises(Unsupported) as info:
        translated({"tools": [WEATHER_TOOL], "tool_choice": choice}, caps)
    assert info.value.status == 501 and info.value.param == "tool_choice"


@pytest.mark.parametrize(
    ("extra", "kind"),
    [({"text": {"format": {"type": "json_object"}}}, "json_object"), ({"regex": "a"}, "regex")],
)
def test_forced_call_goes_with_a_constraint(extra: dict[str, Any], kind: str) -> None:
    # the tool choice governs the turn's call, the constraint its text: both stay
    req = translated({"tools": [WEATHER_TOOL], "tool_choice": "required", **extra})
    assert req.tool_choice.mode is ToolChoiceMode.REQUIRED and len(req.tools) == 1
    assert req.constraint is not None and req.constraint.kind == kind


def test_tool_choice_none_hides_the_tools_and_parallel_maps() -> None:
    req = translated({"tools": [WEATHER_TOOL], "tool_choice": "none"})
    assert req.tools == [] and req.tool_choice.mode is ToolChoiceMode.NONE
    assert translated({"tools": [WEATHER_TOOL]}).parallel_tool_calls is True
    req = translated({"tools": [WEATHER_TOOL], "parallel_tool_calls": False})
    assert req.parallel_tool_calls is False and len(req.tools) == 1


def test_allowed_tools_must_name_declared_tools() -> None:
    choice = {
        "type": "allowed_tools",
        "mode": "auto",
        "tools": [{"type": "function", "name": "nope"}],
    }
    with pytest.raises(InvalidRequest) as info:
        translated({"tools": [WEATHER_TOOL], "tool_choice": choice})
    assert info.value.param == "tool_choice" and "'nope'" in info.value.message


def test_reasoning_effort_mapping() -> None:
    assert translated({}).reasoning is False
    for effort, on in (("none", False), ("minimal", False), ("low", True), ("xhigh", True)):
        assert translated({"reasoning": {"effort": effort}}).reasoning is on
    # a no-op without a reasoning channel (agents send an effort on every request)
    assert translated({"reasoning": {"effort": "high"}}, Capabilities()).reasoning is False
    with pytest.raises(InvalidRequest) as info:
        translated({"reasoning": {"effort": "extreme"}})
    assert info.value.param == "reasoning.effort"
    # a constraint or a forced call governs the reply from its first token
    high = {"reasoning": {"effort": "high"}}
    assert translated({**high, "text": {"format": {"type": "json_object"}}}).reasoning is False
    assert (
        translated({**high, "tools": [WEATHER_TOOL], "tool_choice": "required"}).reasoning is False
    )
    assert translated({**high, "tools": [WEATHER_TOOL]}).reasoning is True
    assert translated(high).reasoning_budget is None  # no budget field in this dialect


def test_replayed_reasoning_items_become_the_turn_reasoning() -> None:
    req = translated(
        {
            "input": [
                {"role": "user", "content": "q"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [{"type": "summary_text", "text": "a summary"}],
                    "content": [{"type": "reasoning_text", "text": "first thought"}],
                },
                {"type": "message", "role": "assistant", "content": "Checking."},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": "{}",
                },
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "opaque"},
                {
                    "type": "reasoning",
                    "id": "rs_3",
                    "content": [{"type": "reasoning_text", "text": "second"}],
                },
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "name": "get_weather",
                    "arguments": "{}",
                },
                {"type": "function_call_output", "call_id": "c2", "output": "windy"},
                {"role": "user", "content": "and now?"},
            ]
        }
    )
    roles = [(m.role, m.reasoning, [c.id for c in m.tool_calls]) for m in req.messages]
    assert roles == [
        ("user", None, []),
        ("assistant", "first thought", ["c1"]),
        ("tool", None, []),
        ("assistant", "second", ["c2"]),  # encrypted-only reasoning carries no text
        ("tool", None, []),
        ("user", None, []),
    ]


def test_replayed_reasoning_reaches_backend(openai_client: openai.OpenAI) -> None:
    resp = openai_client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "q"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "mulling"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "a"}],
            },
            {"role": "user", "content": "#echo"},
        ],
    )
    messages = json.loads(resp.output_text)["messages"]
    assert messages[1] == {
        "role": "assistant",
        "content": "a",
        "reasoning": "mulling",
        "tool_calls": [],
    }


# -- typed items and tools: what does not fit is a 400 naming the field -------------------


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([{"type": "computer_call", "id": "x"}], "input[0].type"),
        ([{"type": "function_call", "call_id": 5, "name": "f"}], "input[0].call_id"),
        ([{"type": "function_call", "call_id": "c", "name": ""}], "input[0].name"),
        ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
        ([{"role": "user", "content": [{"text": "no type"}]}], "input[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "input_text"}]}], "input[0].content[0].text"),
        (
            [{"role": "user", "content": [{"type": "spoken", "text": "x"}]}],
            "input[0].content[0].type",
        ),
        ([{"role": "robot", "content": "x"}], "input[0].role"),
    ],
)
def test_an_item_that_does_not_fit_is_a_400_naming_it(items: list[Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        translated({"input": items})
    assert err.value.status == 400 and err.value.param == param, err.value.message
    assert param.split(".")[0] in err.value.message


def test_typed_items_keep_their_turns() -> None:
    req = translated(
        {
            "instructions": "be brief",
            "input": [
                {"role": "developer", "content": [{"type": "input_text", "text": "rules"}, "more"]},
                {"type": "message", "role": "user", "content": "q"},
                {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": {"a": 1}},
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [{"type": "output_text", "text": "r"}, {"type": "refusal"}],
                },
            ],
        }
    )
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "be brief"),
        ("system", "rules\nmore"),
        ("user", "q"),
        ("assistant", ""),
        ("tool", "r\n"),
    ]
    call = req.messages[3].tool_calls[0]
    assert (call.name, json.loads(call.arguments), req.messages[3].reasoning) == (
        "f",
        {"a": 1},
        "hm",
    )
    assert req.messages[4].name == "f"


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "function", "name": "f", "parameters": "{}"}], None, "tools[0].parameters"),
        ([{"type": "function"}], None, "tools[0].name"),
        ([{"type": "namespace", "tools": []}], None, "tools[0].name"),
        (
            [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}, {"name": 3}]}],
            None,
            "tools[0].tools[1].name",
        ),
        (
            [WEATHER_TOOL],
            {"type": "allowed_tools", "tools": ["get_weather"]},
            "tool_choice.tools[0]",
        ),
        ([WEATHER_TOOL], {"type": "function", "name": 7}, "tool_choice.name"),
    ],
)
def test_a_tool_that_does_not_fit_is_a_400_naming_it(
    tools: list[Any], choice: Any, param: str
) -> None:
    body: dict[str, Any] = {"tools": tools}
    if choice is not None:
        body["tool_choice"] = choice
    with pytest.raises(InvalidRequest) as err:
        translated(body)
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_namespaced_and_hosted_tools_are_typed() -> None:
    req = translated(
        {
            "tools": [
                {"type": "web_search"},
                {
                    "type": "namespace",
                    "name": "agents",
                    "tools": [{"name": "spawn", "strict": True}, {"type": "web_search"}],
                },
                WEATHER_TOOL,
            ],
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "agents.spawn"}],
            },
        }
    )
    assert [(t.name, t.strict) for t in req.tools] == [("agents.spawn", True)]
    assert req.tool_choice.mode is ToolChoiceMode.NAMED
