"""Inkling served end to end in the three dialects, through the official SDKs: the tiny
converted model, its replies steered (the Qwen3 tests' ``Steer``: the real forward pass, the
next scripted token's logit biased) into a thinking block, text blocks and a call block."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmserve_core.backend import ServerSettings
from lmserve_core.testing.serving import record_prompts, serve

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lmserve-qwen3" / "tests"))

import test_qwen3_tools as q3  # noqa: E402
from steering import Steer  # noqa: E402

THOUGHT = (
    "<|content_thinking|>some reasoning<|end_message|>"
    "<|message_model|><|content_text|>the answer<|end_message|><|content_model_end_sampling|>"
)
CALL = (
    "<|content_thinking|>I should look it up.<|end_message|>"
    '<|message_model|>get_weather<|content_invoke_tool_json|>{"name":"get_weather",'
    '"args":{"city":"Paris","unit":"c"}}<|end_message|><|content_model_end_sampling|>'
)


@pytest.fixture(scope="module")
def served(gguf_f32: Path) -> Iterator[q3.Served]:
    from lmserve_inkling.plugin import create_backend

    settings = ServerSettings(ctx=1024, threads=2)
    backend = create_backend(str(gguf_f32), settings)
    steer = Steer(backend)
    prompts = record_prompts(backend)
    with serve(backend, settings) as client, q3.httpx2.Client(transport=q3._Bridge(client)) as b:
        sdk = {"api_key": "x", "max_retries": 0}
        yield q3.Served(
            http=client, steer=steer, prompts=prompts,
            openai=q3.openai.OpenAI(base_url="http://testserver/v1", http_client=client, **sdk),
            anthropic=q3.anthropic.Anthropic(base_url="http://testserver", http_client=b, **sdk),
        )


@pytest.fixture
def srv(served: q3.Served) -> q3.Served:
    served.steer.reset()
    served.prompts.clear()
    return served


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", q3.DIALECTS)
def test_thinking_block_is_reasoning(srv: q3.Served, dialect: str, stream: bool) -> None:
    srv.steer.say(THOUGHT)
    reply = srv.ask(dialect, thinking=True, stream=stream)
    assert srv.prompt.endswith("<|message_user|><|content_text|>" + q3.ASK
                               + "<|end_message|><|message_model|>")
    assert "Thinking effort level: 0.9" in srv.prompt
    assert (reply.reasoning, reply.text) == ("some reasoning", "the answer")
    assert reply.finish == q3.ANSWERED[dialect]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", q3.DIALECTS)
def test_call_block_is_a_call(srv: q3.Served, dialect: str, stream: bool) -> None:
    srv.steer.say(CALL)
    reply = srv.ask(dialect, tools=list(q3.SCHEMAS), thinking=True, max_tokens=100, stream=stream)
    assert (reply.reasoning, reply.text) == ("I should look it up.", "")
    assert reply.calls == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert reply.finish == q3.CALLED[dialect]


def test_reasoning_off_sets_effort_zero(srv: q3.Served) -> None:
    srv.steer.say("<|content_text|>the answer<|end_message|><|content_model_end_sampling|>")
    reply = srv.ask("chat", thinking=False)
    assert "Thinking effort level: 0<" in srv.prompt
    assert (reply.reasoning, reply.text) == ("", "the answer")


@pytest.mark.parametrize("dialect", q3.DIALECTS)
def test_forced_call_through_the_grammar(srv: q3.Served, dialect: str) -> None:
    reply = srv.ask(dialect, tools=["get_weather"], choice="get_weather", max_tokens=200)
    assert [name for name, _ in reply.calls] == ["get_weather"]
    assert q3.conforms(reply.calls[0][1], q3.WEATHER)


def test_through_the_sdks(srv: q3.Served) -> None:
    srv.steer.say(CALL)
    chat = srv.openai.chat.completions.create(
        model="x", messages=[{"role": "user", "content": q3.ASK}], max_tokens=100,
        reasoning_effort="high", tools=[q3.chat_tool("get_weather")],
    )
    call = chat.choices[0].message.tool_calls[0]
    assert (call.function.name, q3.arguments_of(call.function.arguments)) == (
        "get_weather", {"city": "Paris", "unit": "c"})
    srv.steer.reset()
    srv.steer.say(THOUGHT)
    message = srv.anthropic.messages.create(
        model="x", max_tokens=64, messages=[{"role": "user", "content": q3.ASK}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    kinds = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
             for b in message.content]
    assert kinds == [("thinking", "some reasoning"), ("text", "the answer")]
