"""The legacy text-completion endpoint: the official SDK against a real ``lmserve``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec
import openai
import pytest

from lmserve_core.backend import Capabilities
from lmserve_core.dialects.openai_chat_models import CompletionRequest
from lmserve_core.dialects.openai_translate import completion_request
from lmserve_core.errors import InvalidRequest, Unsupported


def test_create(openai_client: openai.OpenAI) -> None:
    completion = openai_client.completions.create(model="m", prompt="#reply:Once upon a time")
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    assert completion.model == "scripted-model"
    choice = completion.choices[0]
    assert choice.text == "Once upon a time"
    assert choice.index == 0 and choice.logprobs is None
    assert choice.finish_reason == "stop"
    usage = completion.usage
    assert usage is not None and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_prompt_list_of_one_string(openai_client: openai.OpenAI) -> None:
    completion = openai_client.completions.create(model="m", prompt=["#reply:listed"])
    assert completion.choices[0].text == "listed"


def test_unprefixed_path(server: Any) -> None:
    r = httpx.post(
        server.base_url + "/completions",
        json={"model": "m", "prompt": "#reply:plain"},
        headers={"Authorization": "Bearer test-key"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "plain"


def test_length_and_stop(openai_client: openai.OpenAI) -> None:
    completion = openai_client.completions.create(model="m", prompt="#tokens:50", max_tokens=7)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 7
    completion = openai_client.completions.create(
        model="m", prompt="#reply:alpha beta gamma", stop=["gamma"]
    )
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].text == "alpha beta "


def test_default_max_tokens_is_1024(openai_client: openai.OpenAI) -> None:
    completion = openai_client.completions.create(model="m", prompt="#tokens:1100")
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 1024


def test_stream(openai_client: openai.OpenAI) -> None:
    chunks = list(
        openai_client.completions.create(
            model="m", prompt="#reply:Streamed text here #delay:5", stream=True
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == "Streamed text here"
    assert len(chunks) > 3
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)


def test_stream_include_usage(openai_client: openai.OpenAI) -> None:
    chunks = list(
        openai_client.completions.create(
            model="m",
            prompt="#tokens:5",
            stream=True,
            stream_options={"include_usage": True},
            seed=3,
            temperature=0.2,
            top_p=0.9,
            presence_penalty=0.1,
            frequency_penalty=0.1,
            extra_body={"top_k": 10, "min_p": 0.05, "repeat_penalty": 1.1},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "stop"


def test_stream_error_mid_stream(openai_client: openai.OpenAI) -> None:
    stream = openai_client.completions.create(model="m", prompt="#reply:a b c #error", stream=True)
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            pass
    assert "scripted failure mid-stream" in info.value.message


def test_raw_stream_ends_with_done(server: Any) -> None:
    with httpx.stream(
        "POST",
        server.base_url + "/v1/completions",
        json={"model": "m", "prompt": "#reply:xy", "stream": True},
        headers={"Authorization": "Bearer test-key"},
        timeout=30,
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1, 2], "a"]}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": [[1, "a"]]}, "prompt"),
        ({"prompt": [True]}, "prompt"),
        ({"prompt": ["a"] * 65}, "prompt"),
        ({"prompt": ["a"] * 9, "n": 2}, "prompt"),  # more than the queue's 16
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"suffix": "tail"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"n": 17}, "n"),
        ({"logprobs": 6}, "logprobs"),
        ({"logit_bias": {"5": -101}}, "logit_bias"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"temperature": 9}, "temperature"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"regex": "a", "lark": "start: /a/"}, "lark"),
    ],
)
def test_rejected_fields(openai_client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(model="m", prompt="hi", extra_body=extra)
    assert param in info.value.message
    assert isinstance(info.value.body, dict) and info.value.body.get("param") == param


def test_missing_prompt_and_key(server: Any) -> None:
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": "m"},
        headers={"Authorization": "Bearer test-key"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.base_url + "/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 401


def test_backend_without_raw_completion() -> None:
    body = msgspec.convert({"prompt": "x"}, CompletionRequest)
    with pytest.raises(Unsupported) as info:
        completion_request(body, Capabilities(raw_completion=False), 4096, "cmpl-x")
    assert info.value.status == 501


def test_token_prompts_need_a_backend_that_takes_them(server: Any) -> None:
    # the scripted backend continues text only
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": "m", "prompt": [491, 84, 268]},
        headers={"Authorization": "Bearer test-key"},
    )
    assert r.status_code == 501, r.text
    assert r.json()["error"]["param"] == "prompt"


def test_translate() -> None:
    body = msgspec.convert(
        {"prompt": ["text"], "max_tokens": 9000, "stop": "\n", "regex": "[0-9]+"}, CompletionRequest
    )
    [req] = completion_request(body, Capabilities(grammar=True), 2048, "cmpl-x")
    assert req.dialect == "completions" and req.prompt == "text" and req.messages == []
    assert req.prompt_ids is None and req.id == "cmpl-x"
    assert req.max_tokens == 2048  # clamped to the context
    assert req.stop == ["\n"]
    assert req.constraint is not None and req.constraint.kind == "regex"


def test_logit_bias_reaches_the_backend(openai_client: openai.OpenAI) -> None:
    reply = openai_client.completions.create(
        model="m", prompt="#echo", logit_bias={"65": 100}, max_tokens=64
    )
    assert json.loads(reply.choices[0].text)["logit_bias"] == {"65": 100.0}


def test_translate_prompt_forms() -> None:
    caps = Capabilities(token_prompts=True)

    def prompts(value: Any, vocab: int | None = 100) -> list[tuple[str | None, Any, str]]:
        body = msgspec.convert({"prompt": value, "n": 2, "seed": 5}, CompletionRequest)
        reqs = completion_request(body, caps, 2048, "cmpl-x", vocab)
        assert all(r.n == 2 for r in reqs)
        return [(r.prompt, r.prompt_ids, r.id) for r in reqs]

    assert prompts("a") == [("a", None, "cmpl-x")]
    assert prompts(["a", "b"]) == [("a", None, "cmpl-x-p0"), ("b", None, "cmpl-x-p1")]
    assert prompts([5, 6]) == [("", [5, 6], "cmpl-x")]
    assert prompts([[5], [7, 99]]) == [("", [5], "cmpl-x-p0"), ("", [7, 99], "cmpl-x-p1")]
    # the vocabulary's bound names the index; without one only negative ids are refused
    with pytest.raises(InvalidRequest) as info:
        prompts([[5], [7, 100]])
    assert "'prompt[1][1]'" in info.value.message and info.value.param == "prompt"
    with pytest.raises(InvalidRequest) as info:
        prompts([3, -1])
    assert "'prompt[1]'" in info.value.message
    assert prompts([10**6], None) == [("", [10**6], "cmpl-x")]


def test_several_prompts_are_prompt_major(openai_client: openai.OpenAI) -> None:
    completion = openai_client.completions.create(
        model="m", prompt=["#reply:first", "#reply:second one"], n=2
    )
    assert [(c.index, c.text) for c in completion.choices] == [
        (0, "first"),
        (1, "first"),
        (2, "second one"),
        (3, "second one"),
    ]
    one = openai_client.completions.create(model="m", prompt="#reply:first")
    two = openai_client.completions.create(model="m", prompt="#reply:second one")
    assert one.usage is not None and two.usage is not None and completion.usage is not None
    # each prompt counted once, every choice's completion counted
    assert completion.usage.prompt_tokens == one.usage.prompt_tokens + two.usage.prompt_tokens
    assert completion.usage.completion_tokens == 2 * (
        one.usage.completion_tokens + two.usage.completion_tokens
    )


def test_several_prompts_streamed(openai_client: openai.OpenAI) -> None:
    chunks = list(
        openai_client.completions.create(
            model="m",
            prompt=["#reply:a b c", "#reply:d e"],
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            reasons[choice.index] = choice.finish_reason
    assert texts == {0: "a b c", 1: "a b c", 2: "d e", 3: "d e"}
    assert reasons == {i: "stop" for i in range(4)}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    single = openai_client.completions.create(model="m", prompt="#reply:a b c")
    assert single.usage is not None
    assert usage.completion_tokens > 2 * single.usage.completion_tokens


def test_echo(openai_client: openai.OpenAI) -> None:
    completion = openai_client.completions.create(
        model="m", prompt=["#reply:hi", "#reply:yo"], echo=True
    )
    assert [c.text for c in completion.choices] == ["#reply:hihi", "#reply:yoyo"]
    chunks = list(
        openai_client.completions.create(
            model="m", prompt="#reply:x y #delay:2", echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text.startswith("#reply:x y #delay:2")
    assert "".join(c.choices[0].text for c in chunks) == "#reply:x y #delay:2x y"
