"""The example third-party plugin works through a real process and the SDKs."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lmserve-reverse"


@pytest.fixture
def reverse_server(start_server):  # type: ignore[no-untyped-def]
    return start_server(
        "--plugin", "lmserve_reverse", "--backend", "reverse", scripted=False,
        env={"PYTHONPATH": f"{EXAMPLE}:{ROOT / 'tests'}"},
    )


def test_example_backend_serves_chat_and_stream(reverse_server) -> None:
    client = openai.OpenAI(base_url=reverse_server.base_url + "/v1", api_key="test-key")
    reply = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "one two three"}]
    )
    assert reply.choices[0].message.content == "three two one"
    pieces = [
        chunk.choices[0].delta.content
        for chunk in client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "a b c d"}], stream=True,
            max_tokens=2,
        )
        if chunk.choices and chunk.choices[0].delta.content
    ]
    assert "".join(pieces) == "d c"


def test_example_backend_refuses_what_it_cannot_do(reverse_server) -> None:
    client = openai.OpenAI(base_url=reverse_server.base_url + "/v1", api_key="test-key")
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "a b"}],
            response_format={"type": "json_object"},
        )
    assert info.value.status_code == 501
    assert "response_format" in str(info.value)
