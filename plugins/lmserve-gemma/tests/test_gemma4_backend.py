"""The ``gemma`` backend on a Gemma 4 GGUF: conventions, registration, and a synthetic Gemma 4
served through the OpenAI chat dialect, its prompts tokenized exactly as transformers renders
them from the same chat template (tools and thinking on and off, tool history included)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from lmserve_gemma import plugin
from lmserve_gemma.gemma4_tools import GEMMA4_TOOLS

from lmserve_core.backend import ServerSettings
from lmserve_core.plugins import backend_for_architecture
from lmserve_core.testing.serving import (
    record_prompts,
    reference_prompt,
    reference_tokenizer,
    serve,
)
from lmserve_core.tokenizer import TokenizerError

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["c", "f"]},
        },
        "required": ["city"],
    },
    "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}},
}
DESCRIPTIONS = {"get_weather": "Current weather in a city.", "get_time": "Current time in a zone."}
SYSTEM = "You are a terse assistant."
ASK = "What is the weather in Paris and Zürich?"
PREAMBLE = "Let me check both."
CALLS = [
    ("call_1", "get_weather", {"city": "Paris", "unit": "c"}),
    ("call_2", "get_weather", {"city": "Zürich"}),
]
RESULTS = ["21 C, sunny", "8 C, rain"]
REASONING = "Two cities: two calls."


# ---------------------------------------------------------------------------- conventions


def test_registers_gemma_for_gemma4() -> None:
    assert "gemma4" in plugin.ARCHITECTURES
    found = backend_for_architecture("gemma4")
    if found is None:
        pytest.skip("lmserve-gemma is not installed")
    assert found.name == "gemma"


def test_conventions() -> None:
    c = plugin.gemma4_conventions()
    caps = c.capabilities
    assert caps.grammar and caps.reasoning and caps.tools is GEMMA4_TOOLS
    assert c.think is not None
    assert (c.think.open, c.think.close) == ("<|channel>thought", "<channel|>")
    assert c.thinking_switch == "enable_thinking"
    # llama.cpp's end-of-generation tokens of Gemma 4
    assert set(c.extra_stop_tokens) == {"<turn|>", "<|tool_response>", "<eos>"}
    s = c.sampling_for(False)
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == (1.0, 64, 0.95, 0.0)
    assert c.sampling_for(True) == s


def test_a_prompt_left_at_a_closed_turn_opens_the_models_turn() -> None:
    finish = plugin.gemma4_conventions().finish_prompt
    assert finish is not None
    closed = (
        "<|turn>user\nhi<turn|>\n<|turn>model\nok<|tool_response>x<tool_response|>done<turn|>\n"
    )
    assert finish(closed) == closed + "<|turn>model\n"
    for prompt in (
        "<|turn>user\nhi<turn|>\n<|turn>model\n",
        "<|turn>user\nhi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>",
        "<|tool_response>response:f{value:1}<tool_response|>",
    ):
        assert finish(prompt) == prompt


# ---------------------------------------------------------------------------- serving


@dataclass
class Served:
    http: Any  # litestar TestClient
    backend: Any
    prompts: list[tuple[str, list[int]]]  # (text, tokens) of every rendered prompt


@pytest.fixture(scope="module")
def served(synthetic: Any) -> Iterator[Served]:
    pytest.importorskip("litestar")
    path, _ = synthetic(kind="gemma4", type="q8_0")
    settings = ServerSettings(ctx=1024, threads=2)
    try:
        backend = plugin.create_backend(str(path), settings)
    except TokenizerError as exc:
        if "gemma4" not in str(exc):
            raise
        pytest.skip(f"the core tokenizer does not read Gemma 4's vocabulary yet: {exc}")
    prompts = record_prompts(backend)
    with serve(backend, settings) as client:
        yield Served(http=client, backend=backend, prompts=prompts)


@pytest.fixture
def srv(served: Served) -> Served:
    served.prompts.clear()
    return served


@pytest.fixture(scope="module")
def hf_tokenizer(synthetic: Any) -> Any:
    return reference_tokenizer(synthetic(kind="gemma4", type="q8_0").hf_dir)


def chat_tool(name: str) -> dict[str, Any]:
    fn = {"name": name, "description": DESCRIPTIONS[name], "parameters": SCHEMAS[name]}
    return {"type": "function", "function": fn}


def conversation(history: str, *, reference: bool) -> list[dict[str, Any]]:
    """``plain``: a question; ``follow-up``: a turn with text and two calls, their results, an
    answer and a new question; ``loop``: the same turn and results, nothing after them (the
    template closes the calling turn after the results when it has text); ``loop-no-text``:
    a calling turn without text (the model's turn stays open). ``reference``: call arguments
    as objects, as transformers' templates take them."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": ASK},
    ]
    if history == "plain":
        return messages
    args = (lambda a: a) if reference else (lambda a: json.dumps(a, ensure_ascii=False))
    assistant: dict[str, Any] = {
        "role": "assistant",
        "content": "" if history == "loop-no-text" else PREAMBLE,
        "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": args(a)}}
            for cid, name, a in CALLS
        ],
    }
    if history != "follow-up":
        assistant["reasoning_content"] = REASONING
    messages.append(assistant)
    messages += [
        {"role": "tool", "tool_call_id": cid, "content": text}
        for (cid, _, _), text in zip(CALLS, RESULTS, strict=True)
    ]
    if history == "follow-up":
        messages += [
            {"role": "assistant", "content": "Paris is warmer."},
            {"role": "user", "content": "Thanks!"},
        ]
    return messages


@pytest.mark.reference
@pytest.mark.parametrize(
    ("history", "tools"),
    [
        ("plain", False),
        ("plain", True),
        ("follow-up", True),
        ("loop", True),
        ("loop-no-text", True),
    ],
    ids=["plain", "plain-tools", "follow-up", "loop", "loop-no-text"],
)
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_prompt_tokens_are_what_transformers_renders(
    srv: Served, hf_tokenizer: Any, history: str, tools: bool, thinking: bool
) -> None:
    names = list(SCHEMAS)
    body: dict[str, Any] = {
        "model": "gemma4",
        "messages": conversation(history, reference=False),
        "max_tokens": 1,
        "temperature": 0,
        "reasoning_effort": "high" if thinking else "none",
    }
    if tools:
        body["tools"] = [chat_tool(name) for name in names]
    reply = srv.http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    ((text, tokens),) = srv.prompts

    expected = reference_prompt(
        hf_tokenizer,
        conversation(history, reference=True),
        tools=[chat_tool(name) for name in names] if tools else None,
        thinking=thinking,
    )
    if history == "loop":
        # the template closed the calling turn after its results: the model's turn is opened
        # as llama.cpp opens it
        assert expected.endswith(f"<tool_response|>{PREAMBLE}<turn|>\n")
        expected += "<|turn>model\n"
    assert tokens == hf_tokenizer.encode(expected, add_special_tokens=False)
    assert expected.startswith(hf_tokenizer.bos_token)
    # the BOS the template writes is the one the vocabulary adds
    assert text == expected[len(hf_tokenizer.bos_token) :]
    assert tokens[0] == hf_tokenizer.bos_token_id and tokens.count(tokens[0]) == 1
    if history == "plain":
        primed = "" if thinking else "<|channel>thought\n<channel|>"
        assert text.endswith("<|turn>model\n" + primed)
        assert ("<|tool>declaration:get_weather{" in text) == tools
        assert ("<|think|>" in text) == thinking


def test_a_reply_is_generated_by_the_model(srv: Served) -> None:
    body = {
        "model": "gemma4",
        "messages": [{"role": "user", "content": ASK}],
        "max_tokens": 8,
        "temperature": 0,
        "reasoning_effort": "none",
    }
    first = srv.http.post("/v1/chat/completions", json=body)
    assert first.status_code == 200, first.text
    out = first.json()
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] >= 1
    # greedy replies of the same prompt are the same (the second reuses the cached prefix)
    second = srv.http.post("/v1/chat/completions", json=body)
    assert second.json()["choices"][0]["message"] == out["choices"][0]["message"]
    # ... and they are the model's own greedy continuation of the rendered prompt
    (_, tokens), _ = srv.prompts
    model = srv.backend.model
    cache = model.new_cache(len(tokens) + 8)
    logits = model.forward(cache, tokens, 0)
    greedy: list[int] = []
    for step in range(out["usage"]["completion_tokens"]):
        greedy.append(int(logits[: srv.backend.vocab_size].argmax()))
        if greedy[-1] in srv.backend.stop_ids:
            greedy.pop()
            break
        logits = model.forward(cache, [greedy[-1]], len(tokens) + step)
    assert out["choices"][0]["message"]["content"] == srv.backend.tokenizer.decode(greedy)


@pytest.mark.parametrize("args", [(), ("--backend", "gemma")], ids=["detected", "named"])
def test_lmserve_serves_a_gemma4_file(args: tuple[str, ...], synthetic: Any, tmp_path: Any) -> None:
    # a real process: without --backend the file's architecture picks the gemma family
    import sys
    from pathlib import Path

    openai = pytest.importorskip("openai")
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
    from processes import API_KEY, launch

    path, _ = synthetic(kind="gemma4-moe", type="q8_0")
    server = launch(
        *args,
        str(path),
        "--ctx",
        "512",
        "--threads",
        "2",
        scripted=False,
        log_dir=tmp_path,
        timeout=120,
    )
    try:
        with openai.OpenAI(
            base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0
        ) as client:
            assert client.models.list().data[0].id
            reply = client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": ASK}],
                max_tokens=6,
                temperature=0,
            )
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage is not None and reply.usage.prompt_tokens > 5
    finally:
        assert server.stop() == 0
    log = server.log_text()  # the start-up line names the backend that serves the file
    assert "backend=gemma" in log or '"backend": "gemma"' in log, log[-2000:]
