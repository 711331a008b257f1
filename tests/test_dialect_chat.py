"""OpenAI Chat Completions: the official SDK against a real ``lmserve`` (scripted backend),
plus the request translation on its own."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from lmserve_core.backend import Capabilities
from lmserve_core.dialects.openai_chat_models import ChatCompletionRequest
from lmserve_core.dialects.openai_translate import chat_request
from lmserve_core.errors import InvalidRequest, Unsupported
from lmserve_core.request import ToolChoiceMode
from lmserve_core.tools import HERMES

WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOL_PROMPT = '#reply:Checking. #tool:get_weather:{"city":"Paris"}'


def user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def post(
    server: Any, body: Any, *, path: str = "/v1/chat/completions", **kw: Any
) -> httpx.Response:
    headers = {"Authorization": "Bearer test-key", **kw.pop("headers", {})}
    if isinstance(body, bytes | str):
        headers.setdefault("content-type", "application/json")
        return httpx.post(server.base_url + path, content=body, headers=headers, timeout=30)
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=30)


# -- non-streaming -----------------------------------------------------------------------


def test_create(openai_client: openai.OpenAI) -> None:
    completion = openai_client.chat.completions.create(
        model="anything", messages=user("#reply:Hi there, friend.")
    )
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    assert completion.model == "scripted-model"  # the request's model is ignored
    assert completion.system_fingerprint
    choice = completion.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content == "Hi there, friend."
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert choice.logprobs is None
    usage = completion.usage
    assert usage is not None
    assert usage.completion_tokens > 0 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == 0


def test_unprefixed_path_and_developer_role(server: Any) -> None:
    r = post(
        server,
        {
            "model": "m",
            "messages": [{"role": "developer", "content": "Be brief."}, *user("#reply:ok")],
        },
        path="/chat/completions",
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "ok"


def test_content_parts(openai_client: openai.OpenAI) -> None:
    completion = openai_client.chat.completions.create(
        model="m",
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
            {"role": "user", "content": [{"type": "text", "text": "#reply:parts work"}]},
        ],
    )
    assert completion.choices[0].message.content == "parts work"


def test_stop_sequence_finishes_with_stop(openai_client: openai.OpenAI) -> None:
    completion = openai_client.chat.completions.create(
        model="m", messages=user("#reply:one two three four"), stop=[" three"]
    )
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].message.content == "one two"


def test_max_tokens_finishes_with_length(openai_client: openai.OpenAI) -> None:
    completion = openai_client.chat.completions.create(
        model="m", messages=user("#tokens:40"), max_tokens=5
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    completion = openai_client.chat.completions.create(
        model="m", messages=user("#tokens:40"), max_completion_tokens=3
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 3


def test_default_max_tokens_is_bounded(openai_client: openai.OpenAI) -> None:
    completion = openai_client.chat.completions.create(model="m", messages=user("#tokens:1100"))
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 1024


def test_tool_call(openai_client: openai.OpenAI) -> None:
    completion = openai_client.chat.completions.create(
        model="m", messages=user(TOOL_PROMPT), tools=[WEATHER_TOOL]
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_only_reply_has_null_content() -> None:
    from types import SimpleNamespace

    from lmserve_core.dialects.common import Collected
    from lmserve_core.dialects.openai_chat import ChatEncoder
    from lmserve_core.events import Finish
    from lmserve_core.request import ToolCall

    fake_server: Any = SimpleNamespace(model_id="m", backend=SimpleNamespace(name="b"))
    reply = Collected(tool_calls=[ToolCall(id="", name="f", arguments="{}")], finish=Finish("stop"))
    body = ChatEncoder(fake_server, "chatcmpl-x").completion([reply])
    choice = body["choices"][0]
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["id"].startswith("call_")  # never empty
    assert choice["finish_reason"] == "tool_calls"


def test_tool_history_is_accepted(openai_client: openai.OpenAI) -> None:
    completion = openai_client.chat.completions.create(
        model="m",
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
            {"role": "user", "content": "#reply:It is sunny."},
        ],
    )
    assert completion.choices[0].message.content == "It is sunny."
    assert completion.choices[0].finish_reason == "stop"


def test_reasoning_content(openai_client: openai.OpenAI) -> None:
    completion = openai_client.chat.completions.create(
        model="m", messages=user("#think:Let me see. #reply:Four."), reasoning_effort="high"
    )
    message = completion.choices[0].message
    assert message.content == "Four."
    assert getattr(message, "reasoning_content", None) == "Let me see."
    assert completion.usage is not None and completion.usage.completion_tokens_details
    assert (completion.usage.completion_tokens_details.reasoning_tokens or 0) > 0
    # Reasoning is off by default and with none/minimal.
    for effort in (None, "minimal"):
        extra = {"reasoning_effort": effort} if effort else {}
        completion = openai_client.chat.completions.create(
            model="m", messages=user("#think:hidden #reply:Four."), extra_body=extra
        )
        assert getattr(completion.choices[0].message, "reasoning_content", None) is None


def test_replayed_reasoning_and_extensions_accepted(server: Any) -> None:
    r = post(
        server,
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"},
                *user("#reply:fine"),
            ],
            "top_k": 20,
            "min_p": 0.1,
            "repeat_penalty": 1.1,
            "seed": 7,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "chat_template_kwargs": {"enable_thinking": False},
            "metadata": {"a": "b"},
            "user": "u1",
            "store": False,
            "parallel_tool_calls": True,
            "service_tier": "auto",
            "prompt_cache_key": "k",
            "diffusion": {"max_steps": 4},  # block-diffusion models only: ignored here
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "fine"


def echoed(completion: Any) -> Any:
    """What the scripted backend received (its ``#echo`` reply)."""
    return json.loads(completion.choices[0].message.content or "")


def test_structured_output_fields_map_to_the_constraint(openai_client: openai.OpenAI) -> None:
    # Which field becomes which constraint; that the constraint governs decoding is shown on
    # the real model (test_real_model_tools.py::test_constraint_forces_a_shape_...).
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    completion = openai_client.chat.completions.create(
        model="m",
        messages=user("#echo"),
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "obj", "schema": schema, "strict": True},
        },
    )
    constraint = echoed(completion)["constraint"]
    assert constraint["kind"] == "json_schema" and constraint["name"] == "obj"
    assert json.loads(constraint["source"]) == schema and constraint["strict"] is True
    for extra, kind, source in (
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        ({"regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"lark": "start: /x/"}, "lark", "start: /x/"),
    ):
        completion = openai_client.chat.completions.create(
            model="m", messages=user("#echo"), extra_body=extra
        )
        constraint = echoed(completion)["constraint"]
        assert (constraint["kind"], constraint["source"]) == (kind, source)
    plain = openai_client.chat.completions.create(model="m", messages=user("#echo"))
    assert echoed(plain)["constraint"] is None


def test_tool_decisions_reach_backend(openai_client: openai.OpenAI) -> None:
    # none: the model does not see the tools, so nothing can come back as a call
    completion = openai_client.chat.completions.create(
        model="m", messages=user(TOOL_PROMPT), tools=[WEATHER_TOOL], tool_choice="none"
    )
    assert completion.choices[0].message.tool_calls is None
    assert completion.choices[0].finish_reason == "stop"
    got = echoed(
        openai_client.chat.completions.create(
            model="m", messages=user("#echo"), tools=[WEATHER_TOOL], tool_choice="none"
        )
    )
    assert got["tools"] == [] and got["tool_choice"]["mode"] == "none"
    got = echoed(
        openai_client.chat.completions.create(
            model="m",
            messages=user("#echo"),
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
            reasoning_effort="high",
        )
    )
    assert got["tool_choice"] == {"mode": "named", "name": "get_weather"}
    assert got["parallel_tool_calls"] is False
    assert got["reasoning"] is False  # the forced call's grammar governs the reply


def test_parse_helper(openai_client: openai.OpenAI) -> None:
    import pydantic

    class Answer(pydantic.BaseModel):
        city: str
        degrees: int

    completion = openai_client.chat.completions.parse(
        model="m",
        messages=user('#reply:{"city": "Oslo", "degrees": 4}'),
        response_format=Answer,
    )
    assert completion.choices[0].message.parsed == Answer(city="Oslo", degrees=4)


# -- streaming ---------------------------------------------------------------------------


def test_stream(openai_client: openai.OpenAI) -> None:
    stream = openai_client.chat.completions.create(
        model="m", messages=user("#reply:Streaming works fine. #delay:5"), stream=True
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Streaming works fine."
    assert len(chunks) > 4  # tokens paced like a model's come as deltas, not one blob
    last = chunks[-1]
    assert last.choices[0].finish_reason == "stop"
    assert last.choices[0].delta.content is None
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)


def test_stream_include_usage(openai_client: openai.OpenAI) -> None:
    stream = openai_client.chat.completions.create(
        model="m",
        messages=user("#tokens:6"),
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 6
    assert usage_chunk.usage.total_tokens == (
        usage_chunk.usage.prompt_tokens + usage_chunk.usage.completion_tokens
    )
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks[:-1])


def stream_lines(server: Any, text: str) -> list[str]:
    """The non-empty SSE lines of a raw streamed chat request."""
    body = {"model": "m", "messages": user(text), "stream": True}
    with httpx.stream(
        "POST",
        server.base_url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": "Bearer test-key"},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line for line in r.iter_lines() if line]


def test_stream_raw_frames_end_with_done(server: Any) -> None:
    lines = stream_lines(server, "#reply:ab")
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_stream_stop_and_length(openai_client: openai.OpenAI) -> None:
    chunks = list(
        openai_client.chat.completions.create(
            model="m", messages=user("#reply:one two three"), stop=" two", stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "one"
    assert chunks[-1].choices[0].finish_reason == "stop"
    chunks = list(
        openai_client.chat.completions.create(
            model="m", messages=user("#tokens:30"), max_tokens=4, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stream_helper_final_completion(openai_client: openai.OpenAI) -> None:
    with openai_client.chat.completions.stream(
        model="m",
        messages=user("#reply:Helper says hi."),
        stream_options={"include_usage": True},
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "content.delta" in kinds and "content.done" in kinds
    assert final.choices[0].message.content == "Helper says hi."
    assert final.choices[0].finish_reason == "stop"
    assert final.usage is not None and final.usage.completion_tokens > 0


def test_stream_tool_call(openai_client: openai.OpenAI) -> None:
    chunks = list(
        openai_client.chat.completions.create(
            model="m", messages=user(TOOL_PROMPT), tools=[WEATHER_TOOL], stream=True
        )
    )
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and len(deltas[0]) == 1
    call = deltas[0][0]
    assert call.index == 0 and call.id and call.type == "function"
    assert call.function is not None and call.function.name == "get_weather"
    assert json.loads(call.function.arguments or "") == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_stream_helper_tool_call(openai_client: openai.OpenAI) -> None:
    with openai_client.chat.completions.stream(
        model="m", messages=user(TOOL_PROMPT), tools=[WEATHER_TOOL]
    ) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert len(done) == 1 and done[0].name == "get_weather"
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert message.content == "Checking."
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_stream_reasoning_content(openai_client: openai.OpenAI) -> None:
    chunks = list(
        openai_client.chat.completions.create(
            model="m",
            messages=user("#think:Thinking it over. #reply:Done."),
            reasoning_effort="medium",
            stream=True,
        )
    )
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert reasoning == "Thinking it over."
    assert content == "Done."


def test_stream_error_mid_stream(openai_client: openai.OpenAI) -> None:
    stream = openai_client.chat.completions.create(
        model="m", messages=user("#reply:partial answer #error"), stream=True
    )
    received: list[str] = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            received.append(chunk.choices[0].delta.content or "")
    assert "scripted failure mid-stream" in info.value.message
    assert "".join(received)  # the error came after some output


def test_stream_error_frame_shape(server: Any) -> None:
    lines = stream_lines(server, "#reply:x y #error")
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))
    assert set(error) == {"error"}
    assert error["error"]["message"] == "scripted failure mid-stream"
    assert error["error"]["type"] == "server_error"


def test_failure_before_output_is_plain_http_error(openai_client: openai.OpenAI) -> None:
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as info:
            openai_client.chat.completions.create(
                model="m",
                messages=user("#fail"),
                stream=stream,  # type: ignore[call-overload]
            )
        assert info.value.status_code == 500
        assert "scripted failure before output" in info.value.message


# -- auth and request errors ---------------------------------------------------------------


def test_wrong_key(server: Any) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0)
    with client, pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model="m", messages=user("hi"))
    assert info.value.status_code == 401


def test_missing_key(server: Any) -> None:
    r = httpx.post(
        server.base_url + "/v1/chat/completions", json={"model": "m", "messages": user("hi")}
    )
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"logit_bias": {"42": 101}}, "logit_bias"),
        ({"logit_bias": {"-1": 5}}, "logit_bias"),
        ({"logit_bias": {"300": 5}}, "logit_bias"),  # outside the backend's vocabulary
        ({"logit_bias": [[42, 5]]}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"frequency_penalty": 2.1}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"regex": "a+", "lark": "start: /a+/"}, "lark"),
        ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": "sometimes", "tools": [WEATHER_TOOL]}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
                "tools": [WEATHER_TOOL],
            },
            "tool_choice",
        ),
    ],
)
def test_rejected_fields_name_the_param(
    openai_client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model="m", messages=user("hi"), extra_body=extra)
    assert info.value.status_code == 400
    assert param in info.value.message
    body = info.value.body
    assert isinstance(body, dict) and body.get("param") == param


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
        ([{"role": "function", "name": "f", "content": "x"}], "messages[0].role"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0].type",
        ),
        ([{"role": "user", "content": [{"type": "input_audio"}]}], "messages[0].content[0].type"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
    ],
)
def test_bad_messages(openai_client: openai.OpenAI, messages: list[Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model="m", messages=messages)
    assert param in info.value.message
    assert isinstance(info.value.body, dict) and info.value.body.get("param") == param


def test_malformed_json(server: Any) -> None:
    r = post(server, b'{"model": "m", "messages": [')
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": user("hi"), "temperature": "hot"}, "temperature"),
        ({"model": "m", "messages": user("hi"), "max_tokens": "lots"}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "m", "messages": "hello"}, "messages"),
    ],
)
def test_wrong_types(server: Any, body: dict[str, Any], param: str) -> None:
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_backend_without_capabilities(start_server: Any) -> None:
    bare = start_server(env={"LMSERVE_SCRIPTED_CAPS": ""})
    with openai.OpenAI(base_url=bare.base_url + "/v1", api_key="test-key", max_retries=0) as client:
        # Tools are dropped (the model answers as plain chat) under auto.
        completion = client.chat.completions.create(
            model="m", messages=user(TOOL_PROMPT), tools=[WEATHER_TOOL]
        )
        assert completion.choices[0].finish_reason == "stop"
        assert completion.choices[0].message.tool_calls is None
        # A forced call is a grammar: without constrained decoding it is a 501.
        with pytest.raises(openai.APIStatusError) as unsupported:
            client.chat.completions.create(
                model="m", messages=user("hi"), tools=[WEATHER_TOOL], tool_choice="required"
            )
        assert unsupported.value.status_code == 501
        assert unsupported.value.body["param"] == "tool_choice"  # type: ignore[index]
        # Reasoning needs a reasoning mode; none/minimal stay accepted.
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="m", messages=user("hi"), reasoning_effort="low")
        assert "reasoning_effort" in bad.value.message
        assert "tools_dropped" in bare.log_text()
        client.chat.completions.create(model="m", messages=user("hi"), reasoning_effort="none")
        # Constraints need constrained decoding.
        for extra, param in (
            ({"response_format": {"type": "json_object"}}, "response_format"),
            ({"regex": "[a-z]+"}, "regex"),
            ({"lark": "start: /x/"}, "lark"),
        ):
            with pytest.raises(openai.APIStatusError) as err:
                client.chat.completions.create(model="m", messages=user("hi"), extra_body=extra)
            assert err.value.status_code == 501
            assert param in err.value.message
        client.chat.completions.create(
            model="m", messages=user("hi"), response_format={"type": "text"}
        )


# -- translation ---------------------------------------------------------------------------

ALL_CAPS = Capabilities(grammar=True, reasoning=True, tools=HERMES, logit_bias=True)


def translate(body: dict[str, Any], caps: Capabilities = ALL_CAPS, ctx: int = 4096) -> Any:
    import msgspec

    return chat_request(msgspec.convert(body, ChatCompletionRequest), caps, ctx, "chatcmpl-test")


def test_translate_messages() -> None:
    req = translate(
        {
            "messages": [
                {"role": "developer", "content": "sys"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "thought",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": {"x": 1}},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "result"},
            ],
        }
    )
    roles = [m.role for m in req.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert req.messages[1].content == "a\nb"
    assistant = req.messages[2]
    assert assistant.content == "" and assistant.reasoning == "thought"
    assert assistant.tool_calls[0].arguments == '{"x":1}'
    assert req.messages[3].name == "f" and req.messages[3].tool_call_id == "c1"
    assert req.dialect == "chat" and req.id == "chatcmpl-test"


def test_translate_limits_and_sampling() -> None:
    req = translate({"messages": user("x")}, ctx=512)
    assert req.max_tokens == 512  # the 1024 default, clamped to the context
    assert req.sampling.temperature is None  # absent: the model's own default
    req = translate(
        {
            "messages": user("x"),
            "max_tokens": 10,
            "max_completion_tokens": 20,
            "temperature": 0,
            "seed": -1,
            "stop": "END",
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert req.max_tokens == 20
    assert req.sampling.temperature == 0.0
    assert req.sampling.seed is None  # -1 asks for a random seed (llama.cpp)
    assert req.stop == ["END"]
    assert req.stream and req.include_usage


def test_translate_constraints_and_tools() -> None:
    req = translate(
        {
            "messages": user("x"),
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "object"}},
            },
        }
    )
    assert req.constraint.kind == "json_schema"
    assert json.loads(req.constraint.source) == {"type": "object"}
    assert req.constraint.name == "n"
    assert translate({"messages": user("x"), "regex": "a+"}).constraint.kind == "regex"
    assert (
        translate({"messages": user("x"), "response_format": {"type": "text"}}).constraint is None
    )

    req = translate(
        {
            "messages": user("x"),
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "reasoning_effort": "high",
        }
    )
    assert req.tool_choice.mode is ToolChoiceMode.NAMED and req.tool_choice.name == "get_weather"
    assert req.tools[0].parameters["required"] == ["city"]
    assert req.reasoning is False  # a forced call governs the reply from its first token

    no_grammar = Capabilities(grammar=False, reasoning=True, tools=HERMES)
    req = translate({"messages": user("x"), "tools": [WEATHER_TOOL]}, no_grammar)
    assert req.tool_choice.mode is ToolChoiceMode.AUTO and len(req.tools) == 1


GRAMMAR_ONLY = Capabilities(grammar=True)  # constrained decoding, no tool convention
FORCED_CHOICES: list[Any] = [
    "required",
    {"type": "function", "function": {"name": "get_weather"}},
    {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "required",
            "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        },
    },
]


@pytest.mark.parametrize("choice", FORCED_CHOICES)
def test_forced_call_without_a_convention_is_accepted_with_grammar(choice: Any) -> None:
    req = translate(
        {"messages": user("x"), "tools": [WEATHER_TOOL], "tool_choice": choice}, GRAMMAR_ONLY
    )
    assert [t.name for t in req.tools] == ["get_weather"]
    assert req.tool_choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)


def test_auto_tools_without_a_convention_are_dropped() -> None:
    req = translate({"messages": user("x"), "tools": [WEATHER_TOOL]}, GRAMMAR_ONLY)
    assert req.tools == [] and req.tool_choice.mode is ToolChoiceMode.AUTO


@pytest.mark.parametrize("caps", [Capabilities(tools=HERMES), Capabilities()])
@pytest.mark.parametrize("choice", FORCED_CHOICES)
def test_forced_call_needs_grammar(caps: Capabilities, choice: Any) -> None:
    with pytest.raises(Unsupported) as info:
        translate({"messages": user("x"), "tools": [WEATHER_TOOL], "tool_choice": choice}, caps)
    assert info.value.status == 501 and info.value.param == "tool_choice"
    assert info.value.code == "unsupported_parameter"


@pytest.mark.parametrize(
    ("extra", "kind"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"regex": "a+"}, "regex"),
        ({"lark": "start: /a/"}, "lark"),
    ],
)
def test_forced_call_goes_with_a_constraint(extra: dict[str, Any], kind: str) -> None:
    # the tool choice governs the turn's call, the constraint its text: both stay
    for caps in (ALL_CAPS, GRAMMAR_ONLY):
        req = translate(
            {"messages": user("x"), "tools": [WEATHER_TOOL], "tool_choice": "required", **extra},
            caps,
        )
        assert req.tool_choice.mode is ToolChoiceMode.REQUIRED and len(req.tools) == 1
        assert req.constraint is not None and req.constraint.kind == kind


def test_tool_choice_none_hides_the_tools() -> None:
    for caps in (ALL_CAPS, GRAMMAR_ONLY, Capabilities()):
        req = translate(
            {"messages": user("x"), "tools": [WEATHER_TOOL], "tool_choice": "none"}, caps
        )
        assert req.tools == [] and req.tool_choice.mode is ToolChoiceMode.NONE


def test_parallel_tool_calls() -> None:
    body = {"messages": user("x"), "tools": [WEATHER_TOOL]}
    assert translate(body).parallel_tool_calls is True
    assert translate({**body, "parallel_tool_calls": True}).parallel_tool_calls is True
    assert translate({**body, "parallel_tool_calls": False}).parallel_tool_calls is False
    forced = {**body, "tool_choice": "required", "parallel_tool_calls": False}
    assert translate(forced, GRAMMAR_ONLY).parallel_tool_calls is False


def test_translate_caps_rejections() -> None:
    with pytest.raises(InvalidRequest) as info:
        translate(
            {"messages": [{"role": "system", "content": "s"}]}, Capabilities(system_role=False)
        )
    assert info.value.param == "messages[0].role"
    with pytest.raises(Unsupported) as unsupported:
        translate({"messages": user("x"), "stop": ["x"]}, Capabilities(stop_strings=False))
    assert unsupported.value.param == "stop"


def test_translate_reasoning_switches() -> None:
    assert translate({"messages": user("x")}).reasoning is False
    assert translate({"messages": user("x"), "reasoning_effort": "low"}).reasoning is True
    assert translate({"messages": user("x"), "reasoning_effort": "none"}).reasoning is False
    assert translate({"messages": user("x"), "reasoning_effort": "minimal"}).reasoning is False
    thinking = {"messages": user("x"), "chat_template_kwargs": {"enable_thinking": True, "x": 1}}
    req = translate(thinking)
    # consumed as the switch: the backend renders the decision through its family's switch
    assert req.reasoning is True and req.template_kwargs == {"x": 1}
    assert translate(thinking, Capabilities()).reasoning is False  # a no-op without reasoning
    off = {"messages": user("x"), "chat_template_kwargs": {"enable_thinking": False}}
    assert translate(off).reasoning is False and translate(off).template_kwargs == {}
    # an explicit effort wins over the template switch
    assert translate({**thinking, "reasoning_effort": "none"}).reasoning is False
    assert translate({**off, "reasoning_effort": "low"}).reasoning is True
    # a constraint or a forced call governs the reply from its first token
    for extra in (
        {"regex": "a"},
        {"response_format": {"type": "json_object"}},
        {"tools": [WEATHER_TOOL], "tool_choice": "required"},
    ):
        assert (
            translate({"messages": user("x"), "reasoning_effort": "high", **extra}).reasoning
            is False
        )
        assert translate({**thinking, **extra}).reasoning is False
    # auto tools leave it on
    assert translate({**thinking, "tools": [WEATHER_TOOL]}).reasoning is True
    # chat has no budget field
    assert translate({"messages": user("x"), "reasoning_effort": "high"}).reasoning_budget is None


def test_reasoning_effort_on_a_backend_without_reasoning() -> None:
    with pytest.raises(InvalidRequest) as info:
        translate({"messages": user("x"), "reasoning_effort": "high"}, Capabilities())
    assert info.value.status == 400 and info.value.param == "reasoning_effort"
    assert (
        translate({"messages": user("x"), "reasoning_effort": "none"}, Capabilities()).reasoning
        is False
    )


def test_translate_allowed_tools() -> None:
    other = {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}
    ref = {"type": "function", "function": {"name": "get_weather"}}

    def choice(mode: str, refs: list[Any]) -> Any:
        return translate(
            {
                "messages": user("x"),
                "tools": [WEATHER_TOOL, other],
                "tool_choice": {
                    "type": "allowed_tools",
                    "allowed_tools": {"mode": mode, "tools": refs},
                },
            }
        )

    req = choice("auto", [ref])
    assert req.tool_choice.mode is ToolChoiceMode.AUTO
    assert [t.name for t in req.tools] == ["get_weather"]
    req = choice("required", [ref])
    assert req.tool_choice.mode is ToolChoiceMode.NAMED and req.tool_choice.name == "get_weather"
    req = choice("required", [ref, {"type": "function", "function": {"name": "other"}}])
    assert req.tool_choice.mode is ToolChoiceMode.REQUIRED and len(req.tools) == 2
    with pytest.raises(InvalidRequest) as info:
        choice("required", [{"type": "function", "function": {"name": "missing"}}])
    assert info.value.param == "tool_choice"


def test_translate_logit_bias() -> None:
    req = translate({"messages": user("x"), "logit_bias": {"42": -100, "7": 0, "0009": 2.5}})
    assert req.sampling.logit_bias == {42: -100.0, 9: 2.5}  # a zero bias is no bias
    assert translate({"messages": user("x"), "logit_bias": {}}).sampling.logit_bias is None
    for bias, names in (
        ({"x1": 1}, "'x1'"),
        ({"1.5": 1}, "'1.5'"),
        ({"5": 100.5}, "'5'"),
        ({"5": True}, "'5'"),
        ({"5": None}, "'5'"),
        ({"5": 1, "05": 2}, "'05'"),
        ({str(i): 1 for i in range(1025)}, "1024"),
    ):
        with pytest.raises(InvalidRequest) as info:
            translate({"messages": user("x"), "logit_bias": bias})
        assert info.value.param == "logit_bias" and names in info.value.message
    # a backend that cannot bias logits refuses a bias, with the field named
    with pytest.raises(Unsupported) as unsupported:
        translate({"messages": user("x"), "logit_bias": {"5": 1}}, Capabilities())
    assert unsupported.value.status == 501 and unsupported.value.param == "logit_bias"
    assert translate({"messages": user("x"), "logit_bias": {"5": 0}}, Capabilities())


def test_logit_bias_reaches_the_backend(openai_client: openai.OpenAI) -> None:
    completion = openai_client.chat.completions.create(
        model="m", messages=user("#echo"), logit_bias={"42": -100, "7": 5}
    )
    echoed = json.loads(completion.choices[0].message.content or "")
    assert echoed["logit_bias"] == {"42": -100.0, "7": 5.0}


def test_models_retrieve(openai_client: openai.OpenAI) -> None:
    model = openai_client.models.retrieve("scripted-model")
    assert (model.id, model.object, model.owned_by) == ("scripted-model", "model", "lmserve")
    assert model.created > 0
    assert model.meta["backend"] == "scripted"  # type: ignore[attr-defined]
    assert model.model_dump() == openai_client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.models.retrieve("gpt-nope")
    assert "'gpt-nope'" in info.value.message
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "model_not_found"
