"""The example third-party plugin works through a real process and the SDKs.

``nox -s tests`` installs it (``examples/lmserve-reverse``), so the server finds it through its
entry point as it would find any plugin; elsewhere it is loaded with ``--plugin``.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import anthropic
import openai
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lmserve-reverse"


def _installed() -> bool:
    try:
        importlib.metadata.distribution("lmserve-reverse")
    except importlib.metadata.PackageNotFoundError:
        if os.environ.get("LMSERVE_EXAMPLE_INSTALLED"):  # nox -s tests installed it
            pytest.fail("lmserve-reverse is not installed")
        return False
    return True


@pytest.fixture
def reverse_server(start_server):  # type: ignore[no-untyped-def]
    if _installed():
        return start_server("--backend", "reverse", scripted=False)
    return start_server(
        "--plugin",
        "lmserve_reverse",
        "--backend",
        "reverse",
        scripted=False,
        env={"PYTHONPATH": f"{EXAMPLE}:{ROOT / 'tests'}"},
    )


@pytest.fixture
def client(reverse_server):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=reverse_server.base_url + "/v1", api_key="test-key")


def test_installed_example_is_listed_as_a_plugin() -> None:
    if not _installed():
        pytest.skip("lmserve-reverse is not installed here")
    listing = subprocess.run(
        [sys.executable, "-m", "lmserve_core", "plugins"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "reverse 0.1.0  hooks: register_backends" in listing


def test_example_backend_serves_chat_with_usage_counted_by_core(client) -> None:  # type: ignore[no-untyped-def]
    reply = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "one two three"}]
    )
    assert reply.choices[0].message.content == "three two one"
    assert reply.choices[0].finish_reason == "stop"
    # the prompt's count is the backend's (validate), the reply's is core's: one per event
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (3, 3)


def test_core_applies_max_tokens_to_the_example(client) -> None:  # type: ignore[no-untyped-def]
    pieces = []
    finish = None
    for chunk in client.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "a b c d"}],
        stream=True,
        max_tokens=2,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        elif chunk.usage is not None:
            assert chunk.usage.completion_tokens == 2
    assert "".join(pieces) == "d c" and finish == "length"


def test_core_applies_stop_strings_to_the_example(client) -> None:  # type: ignore[no-untyped-def]
    reply = client.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "one two three four"}],
        stop=["e tw"],
    )
    assert reply.choices[0].message.content == "four thre"
    assert reply.choices[0].finish_reason == "stop"
    # streamed: no chunk ever carries the start of the stop string
    pieces = [
        chunk.choices[0].delta.content
        for chunk in client.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": "one two three four"}],
            stop=["e tw"],
            stream=True,
        )
        if chunk.choices and chunk.choices[0].delta.content
    ]
    assert "".join(pieces) == "four thre"


def test_example_serves_raw_completions_and_messages(reverse_server, client) -> None:  # type: ignore[no-untyped-def]
    completion = client.completions.create(model="x", prompt="alpha beta gamma", max_tokens=2)
    assert completion.choices[0].text == "gamma beta"
    assert completion.choices[0].finish_reason == "length"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3, 2)
    claude = anthropic.Anthropic(base_url=reverse_server.base_url, api_key="test-key")
    message = claude.messages.create(
        model="x",
        max_tokens=10,
        stop_sequences=["2"],
        messages=[{"role": "user", "content": "1 2 3"}],
    )
    assert message.content[0].text == "3 "  # type: ignore[union-attr]
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "2"


def test_example_backend_refuses_what_it_cannot_do(client) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": "a b"}],
            response_format={"type": "json_object"},
        )
    assert info.value.status_code == 501
    assert "response_format" in str(info.value)


def test_the_plugin_guide_quotes_the_example_as_it_is() -> None:
    guide = (ROOT / "docs" / "plugins.md").read_text()
    source = (EXAMPLE / "lmserve_reverse" / "__init__.py").read_text()
    assert f"```python\n{source}```" in guide
