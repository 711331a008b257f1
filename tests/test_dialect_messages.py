"""The Anthropic Messages dialect against a real ``lmserve`` process (scripted backend)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import msgspec
import pytest
from httpx_sse import connect_sse
from processes import API_KEY, RunningServer, launch

from lmserve_core.backend import Capabilities
from lmserve_core.dialects.anthropic import translate
from lmserve_core.dialects.anthropic_encoder import (
    MessageStreamEncoder,
    message_body,
    partial_input,
)
from lmserve_core.dialects.anthropic_models import CountTokensRequest, MessagesRequest
from lmserve_core.dialects.common import Collected
from lmserve_core.errors import InvalidRequest, Unsupported
from lmserve_core.events import Finish, Usage
from lmserve_core.request import ToolCall, ToolChoiceMode
from lmserve_core.tools import HERMES
from lmserve_core.wire_errors import anthropic_error

HEADERS = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def sse_events(base_url: str, body: dict[str, Any], path: str = "/v1/messages") -> list[Any]:
    """POST a streaming request; the (event name, parsed data) pairs, in order."""
    with (
        httpx.Client(base_url=base_url, headers=HEADERS, timeout=30) as client,
        connect_sse(client, "POST", path, json={**body, "stream": True}) as source,
    ):
        assert source.response.status_code == 200
        assert source.response.headers["content-type"].startswith("text/event-stream")
        events = []
        for sse in source.iter_sse():
            assert sse.data != "[DONE]"
            data = json.loads(sse.data)
            assert data["type"] == sse.event
            events.append((sse.event, data))
        return events


def post(base_url: str, body: dict[str, Any], path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(base_url + path, json=body, headers=HEADERS, timeout=30)


@pytest.fixture(scope="module")
def bare_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """No grammar, no reasoning, no tool convention; a small body limit."""
    running = launch(
        "--max-body-mb",
        "0.05",
        env={"LMSERVE_SCRIPTED_CAPS": ""},
        log_dir=tmp_path_factory.mktemp("bare"),
    )
    yield running
    running.stop()


# ---------------------------------------------------------------- non-streaming


def test_create_returns_message(anthropic_client: anthropic.Anthropic) -> None:
    message = anthropic_client.messages.create(
        model="any-model-name", max_tokens=64, messages=user("hi")
    )
    assert message.id.startswith("msg_")
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.model == "scripted-model"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "Hello from scripted."
    assert message.stop_reason == "end_turn"
    assert message.stop_sequence is None
    assert message.usage.input_tokens > 0
    assert message.usage.output_tokens > 0
    assert message.usage.cache_read_input_tokens == 0
    assert message.usage.cache_creation_input_tokens == 0


def test_unprefixed_path_and_query_string(server: RunningServer) -> None:
    response = post(
        server.base_url,
        {"model": "m", "max_tokens": 8, "messages": user("hi")},
        path="/messages?beta=true",
    )
    assert response.status_code == 200
    assert response.json()["type"] == "message"


def test_stop_sequence_is_attributed(anthropic_client: anthropic.Anthropic) -> None:
    message = anthropic_client.messages.create(
        model="m",
        max_tokens=64,
        stop_sequences=["three"],
        messages=user("#reply:one two three four"),
    )
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == "three"
    assert message.content[0].text == "one two "


def test_max_tokens_stop_reason(anthropic_client: anthropic.Anthropic) -> None:
    message = anthropic_client.messages.create(model="m", max_tokens=5, messages=user("#tokens:20"))
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 5
    assert message.content[0].text == "t0 t1 t2 t3 t4"


def test_thinking_block_comes_first(anthropic_client: anthropic.Anthropic) -> None:
    message = anthropic_client.messages.create(
        model="m",
        max_tokens=64,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=user("#think:let me see #reply:done"),
    )
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "let me see"
    assert message.content[0].signature == ""
    assert message.content[1].text == "done"


def test_thinking_off_without_the_field(anthropic_client: anthropic.Anthropic) -> None:
    message = anthropic_client.messages.create(
        model="m", max_tokens=64, messages=user("#think:hidden #reply:done")
    )
    assert [block.type for block in message.content] == ["text"]


def test_tool_use_block(anthropic_client: anthropic.Anthropic) -> None:
    message = anthropic_client.messages.create(
        model="m",
        max_tokens=64,
        tools=[WEATHER_TOOL],
        messages=user('#reply:Checking. #tool:get_weather:{"city": "Paris"}'),
    )
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["text", "tool_use"]
    call = message.content[1]
    assert call.id.startswith("toolu_")
    assert call.name == "get_weather"
    assert call.input == {"city": "Paris"}


def test_tool_use_without_text_omits_the_text_block() -> None:
    out = Collected(
        tool_calls=[ToolCall("call_7", "get_weather", '{"city": "Oslo"}')],
        finish=Finish("tool_calls", Usage(10, 4, cached_tokens=6)),
    )
    body = message_body("msg_1", "scripted-model", out)
    assert body["content"] == [
        {"type": "tool_use", "id": "toolu_7", "name": "get_weather", "input": {"city": "Oslo"}}
    ]
    assert body["stop_reason"] == "tool_use"
    # input_tokens excludes cache reads, as Anthropic reports it
    assert body["usage"] == {
        "input_tokens": 4,
        "output_tokens": 4,
        "cache_read_input_tokens": 6,
        "cache_creation_input_tokens": 0,
    }


def test_unparseable_tool_arguments_pass_through_as_text(
    anthropic_client: anthropic.Anthropic,
) -> None:
    message = anthropic_client.messages.create(
        model="m",
        max_tokens=64,
        tools=[WEATHER_TOOL],
        messages=user("#reply:Hm. #tool:get_weather:[1, 2]"),
    )
    assert message.stop_reason == "end_turn"
    assert [block.type for block in message.content] == ["text", "text"]
    assert message.content[1].text == "[1, 2]"


def test_stream_unparseable_tool_arguments_match_non_stream(
    anthropic_client: anthropic.Anthropic,
) -> None:
    with anthropic_client.messages.stream(
        model="m",
        max_tokens=64,
        tools=[WEATHER_TOOL],
        messages=user("#reply:Hm. #tool:get_weather:[1, 2]"),
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn"
    assert [(block.type, block.text) for block in final.content] == [
        ("text", "Hm."),
        ("text", "[1, 2]"),
    ]


def test_tool_history_round_trip(anthropic_client: anthropic.Anthropic) -> None:
    first = anthropic_client.messages.create(
        model="m",
        max_tokens=64,
        tools=[WEATHER_TOOL],
        messages=user('#tool:get_weather:{"city": "Rome"}'),
    )
    call = next(block for block in first.content if block.type == "tool_use")
    second = anthropic_client.messages.create(
        model="m",
        max_tokens=64,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "auto"},
        messages=[
            *user('#tool:get_weather:{"city": "Rome"}'),
            first.to_param(),
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": call.id,
                        "content": [{"type": "text", "text": "sunny, 24C"}],
                    },
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_other",
                        "content": "boom",
                        "is_error": True,
                    },
                    {"type": "text", "text": "#reply:It is sunny."},
                ],
            },
        ],
    )
    assert second.content[0].text == "It is sunny."
    assert second.stop_reason == "end_turn"


def echoed(message: Any) -> Any:
    """What the scripted backend received (its ``#echo`` reply)."""
    return json.loads(message.content[0].text)


def test_history_thinking_blocks_become_the_turn_reasoning(server: RunningServer) -> None:
    body = {
        "model": "m",
        "max_tokens": 16,
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "old", "signature": "abc"},
                    {"type": "redacted_thinking", "data": "xyz"},
                    {"type": "text", "text": "a"},
                ],
            },
            {"role": "user", "content": [{"type": "text", "text": "#echo"}]},
        ],
    }
    response = post(server.base_url, body)
    assert response.status_code == 200, response.text
    messages = json.loads(response.json()["content"][0]["text"])["messages"]
    assert messages[1] == {"role": "assistant", "content": "a", "reasoning": "old", "tool_calls": []}
    assert messages[0]["reasoning"] is None and messages[2]["reasoning"] is None


def test_output_config_json_schema(anthropic_client: anthropic.Anthropic) -> None:
    # The mapping only; the real model shows the constraint governs decoding
    # (test_real_model_tools.py::test_constraint_forces_a_shape_...).
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for extra in (
        {"output_config": {"effort": "high", "format": {"type": "json_schema", "schema": schema}}},
        {"output_format": {"type": "json_schema", "schema": schema}},  # the beta spelling
    ):
        message = anthropic_client.messages.create(
            model="m", max_tokens=64, messages=user("#echo"), extra_body=extra
        )
        constraint = echoed(message)["constraint"]
        assert constraint["kind"] == "json_schema"
        assert json.loads(constraint["source"]) == schema
    plain = anthropic_client.messages.create(model="m", max_tokens=64, messages=user("#echo"))
    assert echoed(plain)["constraint"] is None


def test_thinking_and_tool_decisions_reach_backend(anthropic_client: anthropic.Anthropic) -> None:
    got = echoed(
        anthropic_client.messages.create(
            model="m",
            max_tokens=4096,
            thinking={"type": "enabled", "budget_tokens": 1500},
            tools=[WEATHER_TOOL],
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
            messages=user("#echo"),
        )
    )
    assert got["reasoning"] is True and got["reasoning_budget"] == 1500
    assert got["parallel_tool_calls"] is False
    assert [t["name"] for t in got["tools"]] == ["get_weather"]
    got = echoed(
        anthropic_client.messages.create(
            model="m",
            max_tokens=64,
            thinking={"type": "enabled", "budget_tokens": 1500},
            tools=[WEATHER_TOOL],
            tool_choice={"type": "tool", "name": "get_weather"},
            messages=user("#echo"),
        )
    )
    assert got["tool_choice"] == {"mode": "named", "name": "get_weather"}
    assert got["reasoning"] is False and got["reasoning_budget"] is None  # the grammar rules
    assert got["tools"] == [{"name": "get_weather", "strict": True}]  # input_schema is the contract
    # none hides the tools: the scripted call never comes back
    message = anthropic_client.messages.create(
        model="m",
        max_tokens=64,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "none"},
        messages=user('#reply:No call. #tool:get_weather:{"city": "Paris"}'),
    )
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason == "end_turn"


# ---------------------------------------------------------------- streaming


def test_stream_helper(anthropic_client: anthropic.Anthropic) -> None:
    with anthropic_client.messages.stream(
        model="m", max_tokens=64, messages=user("#reply:streamed words here")
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "streamed words here"
    assert final.content[0].text == text
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens > 0
    assert final.usage.output_tokens > 0
    assert final.usage.cache_read_input_tokens == 0


def test_stream_event_order(server: RunningServer) -> None:
    events = sse_events(
        server.base_url,
        {
            "model": "m",
            "max_tokens": 64,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "tools": [WEATHER_TOOL],
            "messages": user('#think:hmm #reply:Sure. #tool:get_weather:{"city": "Lima"}'),
        },
    )
    names = [name for name, _ in events]
    assert names[0] == "message_start"
    assert names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0
    # the prompt was counted before generation started, as Anthropic reports it
    final_usage = events[-2][1]["usage"]
    assert start["usage"]["input_tokens"] > 0
    assert start["usage"]["input_tokens"] == (
        final_usage["input_tokens"] + final_usage["cache_read_input_tokens"]
    )
    blocks = [data for name, data in events if name == "content_block_start"]
    assert [b["index"] for b in blocks] == [0, 1, 2]
    assert [b["content_block"]["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    deltas = {
        i: [d["delta"] for n, d in events if n == "content_block_delta" and d["index"] == i]
        for i in range(3)
    }
    assert deltas[0][-1] == {"type": "signature_delta", "signature": ""}
    assert "".join(d["thinking"] for d in deltas[0][:-1]) == "hmm"
    assert "".join(d["text"] for d in deltas[1]) == "Sure."
    assert deltas[2] == [{"type": "input_json_delta", "partial_json": '{"city": "Lima"}'}]
    assert blocks[2]["content_block"]["input"] == {}
    # every block is closed before the next opens
    order = [(n, d.get("index")) for n, d in events if n.startswith("content_block_")]
    for i in range(3):
        opened = order.index(("content_block_start", i))
        closed = order.index(("content_block_stop", i))
        assert all(index == i for _, index in order[opened : closed + 1])
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["input_tokens"] > 0 and delta["usage"]["output_tokens"] > 0
    assert delta["usage"]["cache_read_input_tokens"] == 0
    assert delta["usage"]["cache_creation_input_tokens"] == 0


def test_stream_tool_use_final_message(anthropic_client: anthropic.Anthropic) -> None:
    with anthropic_client.messages.stream(
        model="m",
        max_tokens=64,
        tools=[WEATHER_TOOL],
        messages=user('#reply:Let me check. #tool:get_weather:{"city": "Kyiv"}'),
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [block.type for block in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Kyiv"}
    assert final.content[1].id.startswith("toolu_")


def test_stream_thinking_final_message(anthropic_client: anthropic.Anthropic) -> None:
    with anthropic_client.messages.stream(
        model="m",
        max_tokens=64,
        thinking={"type": "adaptive"},
        messages=user("#think:one two #reply:answer"),
    ) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "one two"
    assert final.content[1].text == "answer"


def test_stream_stop_sequence_and_max_tokens(anthropic_client: anthropic.Anthropic) -> None:
    with anthropic_client.messages.stream(
        model="m",
        max_tokens=64,
        stop_sequences=["END"],
        messages=user("#reply:go on END more"),
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence"
    assert final.stop_sequence == "END"
    assert final.content[0].text == "go on "
    with anthropic_client.messages.stream(
        model="m", max_tokens=3, messages=user("#tokens:10")
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 3


def test_claude_code_shaped_request(server: RunningServer) -> None:
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {
                "type": "text",
                "text": "You are Claude Code.",
                "cache_control": {"type": "ephemeral"},
            },
            {
                "type": "text",
                "text": "Be brief.",
                "cache_control": {"type": "ephemeral", "ttl": "1h"},
            },
        ],
        "messages": [
            {"role": "system", "content": "Extra instructions."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {
                        "type": "text",
                        "text": "#reply:Done.",
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            },
        ],
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": "user_abc_account_123_session_xyz"},
        "temperature": 1,
        "tools": [
            {
                **WEATHER_TOOL,
                "input_schema": {
                    "$schema": "http://json-schema.org/draft-07/schema#",
                    "additionalProperties": False,
                    **WEATHER_TOOL["input_schema"],
                },
            },
            {
                "name": "Read",
                "description": "Read a file",
                "defer_loading": True,
                "cache_control": {"type": "ephemeral"},
                "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": False},
    }
    with (
        httpx.Client(
            base_url=server.base_url,
            timeout=30,
            headers={
                **HEADERS,
                "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
                "anthropic-dangerous-direct-browser-access": "true",
            },
        ) as client,
        connect_sse(client, "POST", "/v1/messages?beta=true", json=body) as source,
    ):
        assert source.response.status_code == 200
        events = [(sse.event, json.loads(sse.data)) for sse in source.iter_sse()]
    assert events[0][0] == "message_start"
    assert events[-1][0] == "message_stop"
    text = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
    assert text == "Done."


# ---------------------------------------------------------------- errors


def test_wrong_key_is_authentication_error(server: RunningServer) -> None:
    with (
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0) as client,
        pytest.raises(anthropic.AuthenticationError) as info,
    ):
        client.messages.create(model="m", max_tokens=8, messages=user("hi"))
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "authentication_error"


def test_missing_max_tokens_is_bad_request(anthropic_client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.post(
            "/v1/messages", body={"model": "m", "messages": user("hi")}, cast_to=httpx.Response
        )
    error = info.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert "max_tokens" in error["message"]


def test_image_block_is_rejected_by_name(anthropic_client: anthropic.Anthropic) -> None:
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(
            model="m",
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "text", "text": "what?"}, image]}],
        )
    assert "'image'" in info.value.body["error"]["message"]
    assert "messages[0].content[1]" in info.value.body["error"]["message"]


@pytest.mark.parametrize(
    ("block", "name"),
    [
        ({"type": "search_result", "source": "s", "title": "t", "content": []}, "search_result"),
        (
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
            "server_tool_use",
        ),
    ],
)
def test_other_unsupported_blocks(server: RunningServer, block: dict[str, Any], name: str) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [block]}]}
    response = post(server.base_url, body)
    assert response.status_code == 400
    assert f"'{name}'" in response.json()["error"]["message"]


def test_document_blocks_are_user_text(anthropic_client: anthropic.Anthropic) -> None:
    got = echoed(
        anthropic_client.messages.create(
            model="m",
            max_tokens=64,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "document",
                            "source": {
                                "type": "text",
                                "media_type": "text/plain",
                                "data": "The sky is green.",
                            },
                            "title": "Notes",
                            "context": "Written in 2020",
                            "citations": {"enabled": True},
                        },
                        {
                            "type": "document",
                            "source": {
                                "type": "content",
                                "content": [
                                    {"type": "text", "text": "Part one."},
                                    {"type": "text", "text": "Part two."},
                                ],
                            },
                        },
                        {"type": "text", "text": "What colour is the sky? #echo"},
                    ],
                }
            ],
        )
    )
    assert got["messages"][-1] == {
        "role": "user",
        "content": "Document: Notes\nContext: Written in 2020\n\nThe sky is green.\n\n"
        "Document\n\nPart one.\n\nPart two.\n\nWhat colour is the sky? #echo",
        "reasoning": None,
        "tool_calls": [],
    }


@pytest.mark.parametrize(
    ("source", "field"),
    [
        ({"type": "base64", "media_type": "application/pdf", "data": "JVBE"}, "source.type"),
        ({"type": "url", "url": "https://example.com/a.pdf"}, "source.type"),
        ({"type": "file", "file_id": "file_1"}, "source.type"),
        ({"type": "text", "media_type": "text/html", "data": "x"}, "source.media_type"),
        ({"type": "text", "media_type": "text/plain"}, "source.data"),
        ({"type": "content", "content": [{"type": "image", "source": {}}]}, "source.content[0].type"),
        ({"type": "content", "content": 5}, "source.content"),
    ],
)
def test_document_sources_not_served_name_the_field(
    anthropic_client: anthropic.Anthropic, source: dict[str, Any], field: str
) -> None:
    document = {"type": "document", "source": source}
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(
            model="m", max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, document]}],
        )
    assert f"'messages[0].content[1].{field}'" in info.value.body["error"]["message"]


def test_document_in_a_tool_result() -> None:
    req = translated(
        {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [
                                {"type": "document", "title": "a.txt",
                                 "source": {"type": "content", "content": "text of a"}},
                            ],
                        }
                    ],
                },
            ]
        }
    )
    assert req.messages[-1].role == "tool"
    assert req.messages[-1].content == "Document: a.txt\n\ntext of a"
    with pytest.raises(InvalidRequest) as info:
        translated(
            {"messages": [{"role": "user", "content": [
                {"type": "document", "source": {"type": "base64", "data": "x"}}]}]}
        )
    assert info.value.param == "messages[0].content[0].source.type"


def test_models_retrieve(server: RunningServer, anthropic_client: anthropic.Anthropic) -> None:
    info = anthropic_client.models.retrieve("scripted-model")
    assert (info.id, info.type, info.display_name) == ("scripted-model", "model", "scripted-model")
    assert info.created_at.year >= 2024
    assert info.max_input_tokens and info.max_input_tokens > 0
    listed = anthropic_client.models.list()
    assert [m.id for m in listed.data] == ["scripted-model"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        anthropic_client.models.retrieve("claude-nope")
    error = missing.value.body["error"]  # type: ignore[index]
    assert error["type"] == "not_found_error" and "'claude-nope'" in error["message"]
    # on the paths both APIs share, anthropic-version picks Anthropic's envelope
    url = server.base_url + "/v1/models/scripted-model"
    refused = httpx.get(url, headers={**HEADERS, "x-api-key": "wrong"})
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    assert refused.json()["type"] == "error"


def test_image_in_tool_result_is_rejected(server: RunningServer) -> None:
    body = {
        "model": "m",
        "max_tokens": 8,
        "tools": [WEATHER_TOOL],
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [
                            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
                        ],
                    }
                ],
            },
        ],
    }
    response = post(server.base_url, body)
    assert response.status_code == 400
    assert "'image'" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 1.5}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ({"container": "container_123"}, "container"),
        ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        (
            {"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER_TOOL]},
            "tool_choice.name",
        ),
        (
            {
                "tool_choice": {"type": "any"},
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tool_choice",
        ),
        ({"tools": [{"name": "x", "description": "no schema"}]}, "tools[0].input_schema"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config.format.type"),
        ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "hologram"),
    ],
)
def test_rejections_name_the_field(
    server: RunningServer, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": user("hi"), **extra}
    response = post(server.base_url, body)
    assert response.status_code == 400, response.text
    payload = response.json()
    assert payload["type"] == "error"
    assert payload["error"]["type"] == "invalid_request_error"
    assert param in payload["error"]["message"]


def test_in_band_error_event(server: RunningServer, anthropic_client: anthropic.Anthropic) -> None:
    events = sse_events(
        server.base_url, {"model": "m", "max_tokens": 64, "messages": user("#reply:a b c #error")}
    )
    assert events[0][0] == "message_start"
    assert events[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "scripted failure mid-stream"}},
    )
    assert "message_stop" not in [name for name, _ in events]
    with (
        pytest.raises(anthropic.APIStatusError) as info,
        anthropic_client.messages.stream(
            model="m", max_tokens=64, messages=user("#reply:a b c #error")
        ) as stream,
    ):
        for _ in stream.text_stream:
            pass
    assert info.value.body["error"]["type"] == "api_error"


def test_failure_before_output_is_a_plain_error(
    server: RunningServer, anthropic_client: anthropic.Anthropic
) -> None:
    response = post(
        server.base_url, {"model": "m", "max_tokens": 8, "stream": True, "messages": user("#fail")}
    )
    assert response.status_code == 500
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["type"] == "api_error"
    with (
        pytest.raises(anthropic.InternalServerError),
        anthropic_client.messages.stream(model="m", max_tokens=8, messages=user("#fail")),
    ):
        pass


def test_unknown_messages_path_is_not_found(anthropic_client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        anthropic_client.get("/v1/messages/batches/nope", cast_to=httpx.Response)
    assert info.value.body["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("status", "kind", "sdk_class"),
    [
        (400, "invalid_request_error", anthropic.BadRequestError),
        (401, "authentication_error", anthropic.AuthenticationError),
        (403, "permission_error", anthropic.PermissionDeniedError),
        (404, "not_found_error", anthropic.NotFoundError),
        (413, "request_too_large", anthropic.ContentTooLargeError),
        (429, "rate_limit_error", anthropic.RateLimitError),
        (500, "api_error", anthropic.InternalServerError),
        (503, "overloaded_error", anthropic.InternalServerError),
        (529, "overloaded_error", anthropic.OverloadedError),
    ],
)
def test_error_types_match_the_sdk(status: int, kind: str, sdk_class: type[Exception]) -> None:
    body = anthropic_error(status, "x")
    assert body == {"type": "error", "error": {"type": kind, "message": "x"}}
    request = httpx.Request("POST", "http://h/v1/messages")
    response = httpx.Response(status, json=body, request=request)
    client = anthropic.Anthropic(base_url="http://h", api_key="k")
    assert isinstance(client._make_status_error_from_response(response), sdk_class)


# ---------------------------------------------------------------- backend capabilities


def test_bare_backend_drops_tools_and_ignores_thinking(bare_server: RunningServer) -> None:
    body = {
        "model": "m",
        "max_tokens": 64,
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "auto"},
        "messages": user('#think:x #reply:plain #tool:get_weather:{"city": "Paris"}'),
    }
    response = post(bare_server.base_url, body)
    assert response.status_code == 200, response.text
    message = response.json()
    assert message["content"] == [{"type": "text", "text": "plain"}]
    assert message["stop_reason"] == "end_turn"
    assert "tools_dropped" in bare_server.log_text()


def test_bare_backend_rejects_forced_tools(bare_server: RunningServer) -> None:
    body = {
        "model": "m",
        "max_tokens": 8,
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": user("hi"),
    }
    response = post(bare_server.base_url, body)
    # a forced call is a grammar: without constrained decoding it is a 501
    assert response.status_code == 501
    assert "tool_choice" in response.json()["error"]["message"]


def test_bare_backend_output_config_is_501(bare_server: RunningServer) -> None:
    schema_format = {"type": "json_schema", "schema": {"type": "object"}}
    with (
        anthropic.Anthropic(
            base_url=bare_server.base_url, api_key=API_KEY, max_retries=0
        ) as client,
        pytest.raises(anthropic.HTTPNotImplementedError) as info,
    ):
        client.messages.create(
            model="m",
            max_tokens=8,
            messages=user("hi"),
            extra_body={"output_config": {"format": schema_format}},
        )
    assert "output_config.format" in info.value.body["error"]["message"]


def test_body_too_large_is_413(bare_server: RunningServer) -> None:
    with (
        anthropic.Anthropic(
            base_url=bare_server.base_url, api_key=API_KEY, max_retries=0
        ) as client,
        pytest.raises(anthropic.ContentTooLargeError) as info,
    ):
        client.messages.create(model="m", max_tokens=8, messages=user("x" * 100_000))
    assert info.value.body["error"]["type"] == "request_too_large"


# ---------------------------------------------------------------- count_tokens


def test_count_tokens(anthropic_client: anthropic.Anthropic) -> None:
    plain = anthropic_client.messages.count_tokens(model="any-model-name", messages=user("hi"))
    assert plain.input_tokens > 0
    with_tools = anthropic_client.messages.count_tokens(
        model="m", messages=user("hi"), system="You are terse.", tools=[WEATHER_TOOL]
    )
    assert with_tools.input_tokens > plain.input_tokens


def test_count_tokens_folds_system_entries(server: RunningServer) -> None:
    top = post(
        server.base_url,
        {"model": "m", "system": "Rules.", "messages": user("hi")},
        path="/v1/messages/count_tokens?beta=true",
    )
    inline = post(
        server.base_url,
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "Rules."}]},
                *user("hi"),
            ],
        },
        path="/v1/messages/count_tokens",
    )
    assert top.status_code == inline.status_code == 200
    assert top.json() == inline.json()


def test_count_tokens_rejects_images(server: RunningServer) -> None:
    response = post(
        server.base_url,
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
                    ],
                }
            ],
        },
        path="/v1/messages/count_tokens",
    )
    assert response.status_code == 400
    assert "'image'" in response.json()["error"]["message"]


def test_openapi_describes_the_bodies(server: RunningServer) -> None:
    schema = httpx.get(server.base_url + "/schema/openapi.json", headers=HEADERS).json()
    assert "MessagesRequest" in json.dumps(schema["components"]["schemas"])


# ---------------------------------------------------------------- translation


ALL_CAPS = Capabilities(grammar=True, reasoning=True, tools=HERMES)
GRAMMAR_ONLY = Capabilities(grammar=True)  # constrained decoding, no tool convention


def translated(body: dict[str, Any], caps: Capabilities = ALL_CAPS, *, count: bool = False) -> Any:
    server: Any = SimpleNamespace(
        backend=SimpleNamespace(capabilities=caps), ctx=4096, model_id="m"
    )
    full = {"messages": user("x"), **body}
    if count:
        return translate(msgspec.convert(full, CountTokensRequest), server)
    return translate(msgspec.convert({"max_tokens": 64, **full}, MessagesRequest), server)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_call_without_a_convention_is_accepted_with_grammar(choice: Any) -> None:
    req = translated({"tools": [WEATHER_TOOL], "tool_choice": choice}, GRAMMAR_ONLY)
    assert [t.name for t in req.tools] == ["get_weather"]
    assert req.tool_choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)
    assert translated({"tools": [WEATHER_TOOL]}, GRAMMAR_ONLY).tools == []  # auto: dropped


@pytest.mark.parametrize("caps", [Capabilities(tools=HERMES), Capabilities()])
def test_forced_call_needs_grammar(caps: Capabilities) -> None:
    with pytest.raises(Unsupported) as info:
        translated({"tools": [WEATHER_TOOL], "tool_choice": {"type": "any"}}, caps)
    assert info.value.status == 501 and info.value.param == "tool_choice"


def test_forced_call_goes_with_output_config() -> None:
    # the tool choice governs the turn's call, the output format its text: both stay
    fmt = {"type": "json_schema", "schema": {"type": "object"}}
    for extra in ({"output_config": {"format": fmt}}, {"output_format": fmt}):
        for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
            req = translated({"tools": [WEATHER_TOOL], "tool_choice": choice, **extra})
            assert req.tool_choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)
            assert req.constraint is not None and req.constraint.kind == "json_schema"


def test_partial_input_keeps_what_a_cut_off_object_wrote_whole() -> None:
    full = {"city": "Zürich \"Nord\"", "days": [1, 2.5, None], "deep": {"ok": True}, "n": 12}
    text = json.dumps(full, ensure_ascii=False)
    last: dict[str, Any] = {}
    for end in range(len(text) + 1):
        got = partial_input(text[:end])
        assert isinstance(got, dict), end
        # members come in order and are whole, but a string cut off (kept as written so far)
        # and the containers the cut is in (holding what they got whole)
        assert list(got) == list(full)[: len(got)], (end, got)
        for key, value in got.items():
            if isinstance(value, str):
                assert full[key].startswith(value)
            elif key != list(got)[-1]:
                assert value == full[key], (end, got)
        assert len(got) >= len(last), end  # a cut further on keeps what an earlier one had
        last = got
    assert partial_input(text) == full
    assert partial_input("") == {} and partial_input('{"a": tr') == {}
    assert partial_input('{"a": "x\\') == {"a": "x"}  # an escape cut in two is left out
    assert partial_input("[1, 2") == {}  # not an object


def test_tool_choice_none_hides_the_tools_and_parallel_maps() -> None:
    req = translated({"tools": [WEATHER_TOOL], "tool_choice": {"type": "none"}})
    assert req.tools == [] and req.tool_choice.mode is ToolChoiceMode.NONE
    assert translated({"tools": [WEATHER_TOOL]}).parallel_tool_calls is True
    for kind in ("auto", "any"):
        choice = {"type": kind, "disable_parallel_tool_use": True}
        assert (
            translated({"tools": [WEATHER_TOOL], "tool_choice": choice}).parallel_tool_calls
            is False
        )
        choice = {"type": kind, "disable_parallel_tool_use": False}
        assert (
            translated({"tools": [WEATHER_TOOL], "tool_choice": choice}).parallel_tool_calls is True
        )


def test_thinking_mapping() -> None:
    enabled = {"thinking": {"type": "enabled", "budget_tokens": 2048}}
    req = translated(enabled)
    assert req.reasoning is True and req.reasoning_budget == 2048
    req = translated({"thinking": {"type": "adaptive"}})
    assert req.reasoning is True and req.reasoning_budget is None
    req = translated({"thinking": {"type": "disabled", "budget_tokens": 2048}})
    assert req.reasoning is False and req.reasoning_budget is None
    assert translated({}).reasoning is False
    # a no-op without a reasoning channel: no error, no budget
    req = translated(enabled, Capabilities())
    assert req.reasoning is False and req.reasoning_budget is None
    # a constraint or a forced call governs the reply from its first token
    fmt = {"type": "json_schema", "schema": {"type": "object"}}
    for extra in (
        {"output_config": {"format": fmt}},
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "any"}},
    ):
        req = translated({**enabled, **extra})
        assert req.reasoning is False and req.reasoning_budget is None
    assert translated({**enabled, "tools": [WEATHER_TOOL]}).reasoning is True
    with pytest.raises(InvalidRequest) as info:
        translated({"thinking": {"type": "enabled", "budget_tokens": 0}})
    assert info.value.param == "thinking.budget_tokens"
    # count_tokens sees the same decision (the thinking switch changes the rendered prompt)
    assert translated(enabled, count=True).reasoning is True


def test_history_reasoning_and_tool_results() -> None:
    req = translated(
        {
            "tools": [WEATHER_TOOL],
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "first", "signature": "s"},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}},
                        {"type": "thinking", "thinking": "second", "signature": "s"},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [
                                {"type": "text", "text": "a"},
                                {"type": "text", "text": "b"},
                            ],
                        },
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": "boom",
                            "is_error": True,
                        },
                        {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True},
                        {"type": "text", "text": "go on"},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "x"},
                    ],
                },
                {"role": "user", "content": "more"},
            ],
        }
    )
    got = [(m.role, m.content, m.reasoning, m.name) for m in req.messages]
    assert got == [
        ("user", "q", None, None),
        ("assistant", "Let me look.", "first\n\nsecond", None),
        ("tool", "a\nb", None, "get_weather"),
        ("tool", "Error: boom", None, "get_weather"),
        ("tool", "Error", None, "get_weather"),
        ("user", "go on", None, None),
        ("assistant", "x", None, None),  # redacted thinking has no text to replay
        ("user", "more", None, None),
    ]


def test_stop_sequences_need_stop_strings() -> None:
    with pytest.raises(Unsupported) as info:
        translated({"stop_sequences": ["END"]}, Capabilities(stop_strings=False))
    assert info.value.status == 501 and "stop_sequences" in info.value.message


def test_message_start_reports_the_counted_prompt() -> None:
    def start_usage(encoder: MessageStreamEncoder) -> Any:
        frame = encoder.start().decode()
        return json.loads(frame.split("data: ", 1)[1])["message"]["usage"]

    assert start_usage(MessageStreamEncoder("msg_1", "m", input_tokens=42))["input_tokens"] == 42
    assert start_usage(MessageStreamEncoder("msg_1", "m"))["input_tokens"] == 0
