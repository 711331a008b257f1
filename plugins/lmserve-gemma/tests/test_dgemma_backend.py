"""DiffusionGemma served (lmserve_gemma.dgemma_backend) on the synthetic model, through the
SDKs: a block per streamed delta, usage counting committed tokens, max_tokens, seeded
replies reproducible, slot reuse of the causal prefix, grammars and tools refused with a 400
naming the field."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import pytest
from lmserve_gemma import plugin
from lmserve_gemma.dgemma_backend import DiffusionChatBackend

from lmserve_core.backend import ServerSettings
from lmserve_core.native import kernels
from lmserve_core.testing.serving import serve

openai = pytest.importorskip("openai")

CANVAS = 16
STEPS = 3  # denoising steps per block: the file's 48 would make each reply take seconds
MESSAGES = [{"role": "user", "content": "Write a short sentence about the sea."}]


@pytest.fixture(scope="module")
def served(diffusion_gemma: Any) -> Iterator[tuple[Any, Any, DiffusionChatBackend]]:
    pytest.importorskip("litestar")
    settings = ServerSettings(ctx=256, threads=2)
    backend = plugin.create_backend(str(diffusion_gemma.gguf), settings)
    assert isinstance(backend, DiffusionChatBackend)
    config = backend.model.config
    backend.model.config = dataclasses.replace(
        config, sampler=config.sampler.replace(max_denoising_steps=STEPS)
    )
    with serve(backend, settings) as client:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client,
                            max_retries=0)
        yield client, sdk, backend


@pytest.mark.xfail(
    kernels.isa_active() == kernels.Isa.AVX2,
    reason="on AVX2 a second seeded reply, served behind the first one's cached prompt, "
    "diverges after its first block: the model's forward gives a prompt read in two parts "
    "other bits than read in one (on the portable path too, where the seeded sampling "
    "happens to absorb the difference; not its f32 products, which run per token)",
    strict=False,
)
def test_a_seeded_reply_is_reproducible_and_counts_committed_tokens(served: Any) -> None:
    _, sdk, _ = served
    replies = [sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=40,
                                           seed=seed) for seed in (7, 7, 8)]
    a, b, c = replies
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != c.choices[0].message.content
    for r in replies:
        assert 0 < r.usage.completion_tokens <= 40
        if r.choices[0].finish_reason == "length":
            assert r.usage.completion_tokens == 40  # blocks of 16, the third cut to 8


def test_a_block_is_one_delta(served: Any) -> None:
    _, sdk, _ = served
    stream = sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=48, seed=3,
                                         stream=True, stream_options={"include_usage": True})
    deltas, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                deltas.append(choice.delta.content)
    assert usage is not None and deltas
    assert len(deltas) <= math.ceil(usage.completion_tokens / CANVAS)
    whole = sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=48, seed=3)
    assert "".join(deltas) == whole.choices[0].message.content


def test_responses_and_messages_dialects(served: Any) -> None:
    client, sdk, _ = served
    resp = sdk.responses.create(model="m", input="Say something.", max_output_tokens=20)
    assert resp.status in ("completed", "incomplete")
    assert 0 < resp.usage.output_tokens <= 20
    r = client.post("/v1/messages", json={
        "model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stop_reason"] in ("end_turn", "max_tokens")
    assert 0 < body["usage"]["output_tokens"] <= 20


def test_slot_reuse_gives_the_cold_reply(served: Any) -> None:
    _, sdk, backend = served
    ask = dict(model="m", messages=MESSAGES, max_tokens=32, seed=11)
    first = sdk.chat.completions.create(**ask)
    again = sdk.chat.completions.create(**ask)
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content


def test_grammars_and_tools_are_refused_naming_the_field(served: Any) -> None:
    client, _, _ = served
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = client.post("/v1/chat/completions",
                    json={"model": "m", "messages": MESSAGES, "tools": [tool]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = client.post("/v1/chat/completions", json={
        "model": "m", "messages": MESSAGES, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    r = client.post("/v1/messages", json={
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}]})
    assert r.status_code == 400 and "tools" in r.text, r.text
    r = client.post("/v1/chat/completions", json={
        "model": "m", "messages": MESSAGES, "tools": [tool], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = client.post("/v1/responses", json={
        "model": "m", "input": "Hi", "text": {"format": {"type": "json_object"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
    r = client.post("/v1/chat/completions",
                    json={"model": "m", "messages": MESSAGES, "logprobs": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    r = client.post("/v1/chat/completions",
                    json={"model": "m", "messages": MESSAGES, "logit_bias": {"5": 10}})
    assert r.status_code == 501 and r.json()["error"]["param"] == "logit_bias", r.text
    # tool_choice none hides the tools: a plain reply
    r = client.post("/v1/chat/completions", json={
        "model": "m", "messages": MESSAGES, "tools": [tool], "tool_choice": "none",
        "max_tokens": 4, "diffusion": {"max_steps": 1}})
    assert r.status_code == 200, r.text
    # what the server says of itself
    meta = client.get("/v1/models").json()["data"][0]["meta"]["capabilities"]
    assert meta == {"reasoning": True, "tools": "none", "grammar": False}, meta


def test_stop_strings_apply_to_committed_text(served: Any) -> None:
    _, sdk, _ = served
    ask = dict(model="m", messages=MESSAGES, max_tokens=32, seed=5)
    whole = sdk.chat.completions.create(**ask).choices[0].message.content
    assert len(whole) > 12
    stop = whole[8:12]
    cut = sdk.chat.completions.create(**ask, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == whole[: whole.index(stop)]


def _denoiser_passes(backend: DiffusionChatBackend, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that counts the denoiser passes the backend runs from now on."""
    calls: list[int] = []
    real = backend.model.denoise

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(backend.model, "denoise", counted)
    return calls


def test_the_diffusion_object_overrides_the_sampler_per_request(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, sdk, backend = served
    calls = _denoiser_passes(backend, monkeypatch)
    ask = dict(model="m", messages=MESSAGES, max_tokens=2 * CANVAS, seed=21)
    plain = sdk.chat.completions.create(**ask)
    plain_passes = len(calls)
    assert plain_passes >= STEPS  # the random model is never confident early: 3 a block
    # The file's own value, asked for: the same reply from the same passes.
    same = sdk.chat.completions.create(**ask, extra_body={"diffusion": {"max_steps": STEPS}})
    assert same.choices[0].message.content == plain.choices[0].message.content
    assert len(calls) == 2 * plain_passes
    # One step a block: one pass per block, and a different reply.
    calls.clear()
    one = sdk.chat.completions.create(**ask, extra_body={"diffusion": {"max_steps": 1}})
    blocks = math.ceil(one.usage.completion_tokens / CANVAS)
    assert len(calls) == blocks < plain_passes
    # Temperatures: a hot schedule draws other tokens from the same seed (the second
    # step's canvas holds the first step's draws; one step's block is its argmax alone).
    two = sdk.chat.completions.create(**ask, extra_body={"diffusion": {"max_steps": 2}})
    hot = sdk.chat.completions.create(
        **ask, extra_body={"diffusion": {"t_min": 50.0, "t_max": 50.0, "max_steps": 2}})
    assert hot.choices[0].message.content != two.choices[0].message.content
    # Overrides last one request: the next plain one is the first reply again.
    again = sdk.chat.completions.create(**ask)
    assert again.choices[0].message.content == plain.choices[0].message.content
    # The same object in the other dialects.
    calls.clear()
    resp = sdk.responses.create(model="m", input="Say something.", max_output_tokens=CANVAS,
                                extra_body={"diffusion": {"max_steps": 1}})
    assert resp.usage.output_tokens > 0 and len(calls) == 1
    calls.clear()
    r = client.post("/v1/messages", json={
        "model": "m", "max_tokens": CANVAS, "messages": [{"role": "user", "content": "Hi"}],
        "diffusion": {"max_steps": 1}})
    assert r.status_code == 200, r.text
    assert len(calls) == 1


@pytest.mark.parametrize(("diffusion", "param"), [
    ({"max_steps": 0}, "diffusion.max_steps"),
    ({"max_steps": 1.5}, "diffusion.max_steps"),
    ({"max_steps": 10_000}, "diffusion.max_steps"),
    ({"t_min": 0}, "diffusion.t_min"),
    ({"entropy_bound": -1}, "diffusion.entropy_bound"),
    ({"stability_threshold": True}, "diffusion.stability_threshold"),
    ({"confidence_threshold": "high"}, "diffusion.confidence_threshold"),
    ({"steps": 4}, "diffusion.steps"),
    ([1, 2], "diffusion"),
])
def test_a_bad_diffusion_object_is_a_400_naming_the_field(
    served: Any, diffusion: Any, param: str
) -> None:
    client, _, _ = served
    r = client.post("/v1/chat/completions",
                    json={"model": "m", "messages": MESSAGES, "diffusion": diffusion})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = client.post("/v1/messages", json={
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
        "diffusion": diffusion})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and param in body["error"]["message"], body


def test_a_real_lmserve_process_serves_blocks_through_both_sdks(
    diffusion_gemma: Any, tmp_path: Any
) -> None:
    # `lmserve FILE`: the diffusion-gemma architecture picks the gemma family's diffusion
    # backend; the official SDKs, whole and streamed, each reply's sampler cut to 2 steps a
    # block by the request's diffusion object.
    import sys
    from pathlib import Path

    anthropic = pytest.importorskip("anthropic")
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
    from processes import API_KEY, launch

    server = launch(str(diffusion_gemma.gguf), "--ctx", "256", "--threads", "2",
                    scripted=False, log_dir=tmp_path, timeout=120)
    fast = {"diffusion": {"max_steps": 2}}
    try:
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY,
                           max_retries=0) as sdk:
            ask = dict(model="m", messages=MESSAGES, max_tokens=24, seed=4, extra_body=fast)
            whole = sdk.chat.completions.create(**ask)
            assert 0 < whole.usage.completion_tokens <= 24
            deltas = [c.choices[0].delta.content for c in
                      sdk.chat.completions.create(**ask, stream=True)
                      if c.choices and c.choices[0].delta.content]
            assert 0 < len(deltas) <= 2  # blocks of 16: at most two for 24 tokens
            assert "".join(deltas) == whole.choices[0].message.content
            resp = sdk.responses.create(model="m", input="Say something.", max_output_tokens=16,
                                        extra_body=fast)
            assert resp.output_text and resp.usage.output_tokens <= 16
        with anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY,
                                 max_retries=0) as claude:
            msg = claude.messages.create(model="m", max_tokens=16, extra_body=fast,
                                         messages=[{"role": "user", "content": "Hi"}])
            assert msg.stop_reason in ("end_turn", "max_tokens")
            assert 0 < msg.usage.output_tokens <= 16
            with claude.messages.stream(model="m", max_tokens=16, extra_body=fast,
                                        messages=[{"role": "user", "content": "Hi"}]) as s:
                streamed = "".join(s.text_stream)
                final = s.get_final_message()
            assert streamed and final.usage.output_tokens <= 16
    finally:
        assert server.stop() == 0
    log = server.log_text()
    assert "diffusion-gemma" in log, log[-2000:]
