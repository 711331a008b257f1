"""Prompts that share a prefix with an earlier one reuse it on the hybrid recurrent families,
served end to end.

A recurrent state cannot be cut back, so a cache continues only from its end or from a
checkpoint of the state taken while a prompt was read. The checkpoints are taken where other
prompts may leave this one: the end of the system prompt (another conversation with the same
system prompt: sub-agents, a chat app's fixed instructions) and of the last earlier messages
(a turn retried or edited). The reused prefix must give the replies a cold server gives.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from lmserve_core.backend import ServerSettings
from lmserve_core.kv_slots import common_prefix_length
from lmserve_core.testing.serving import record_prompts, serve

KINDS = ("qwen35", "qwen35moe", "qwen3next")

SYSTEM = "You answer questions about the notes below, briefly.\n" + "\n".join(
    f"Note {i}: the item {i * 7 % 101} was seen in room {i * 13 % 97} on day {i % 31}."
    for i in range(40)
)
QUESTIONS = ("Which room holds item 14?", "What happened on day 9?", "List two rooms.")


def chat(http: Any, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def cached(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.fixture(scope="module", params=KINDS)
def served(request: pytest.FixtureRequest, synthetic: Any) -> Iterator[tuple[Any, list[Any]]]:
    from lmserve_qwen35.plugin import create_backend

    settings = ServerSettings(ctx=2048, threads=2)
    backend = create_backend(str(synthetic(request.param, "q8_0").gguf), settings)
    prompts = record_prompts(backend)
    with serve(backend, settings) as http:
        yield http, prompts


def cold(synthetic: Any, kind: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """The reply of a fresh server, which has nothing to reuse."""
    from lmserve_qwen35.plugin import create_backend

    settings = ServerSettings(ctx=2048, threads=2)
    backend = create_backend(str(synthetic(kind, "q8_0").gguf), settings)
    with serve(backend, settings) as http:
        return chat(http, messages)


def test_conversations_sharing_a_system_prompt_reuse_it(
    served: tuple[Any, list[Any]], synthetic: Any, request: pytest.FixtureRequest
) -> None:
    http, prompts = served
    kind = request.node.callspec.params["served"]
    replies = [
        chat(http, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in QUESTIONS
    ]
    tokens = [p[1] for p in prompts[-3:]]
    shared = common_prefix_length(tokens[0], tokens[1])
    assert shared > 500  # the system prompt, and the next message's opener
    assert cached(replies[0]) == 0
    for reply in replies[1:]:
        # all of the system prompt (the checkpoint sits at its end, before the next opener)
        assert cached(reply) >= 0.95 * shared, (cached(reply), shared)
        assert cached(reply) <= shared
    # what was reused gives what a cold read gives
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}]
    want = cold(synthetic, kind, messages)
    assert replies[1]["choices"][0]["message"] == want["choices"][0]["message"]


def test_a_retried_last_turn_reuses_the_conversation_before_it(
    served: tuple[Any, list[Any]],
) -> None:
    http, prompts = served
    history = [
        {"role": "user", "content": SYSTEM},
        {"role": "assistant", "content": "Noted."},
    ]
    chat(http, [*history, {"role": "user", "content": QUESTIONS[0]}])
    first = prompts[-1][1]
    # the same history, another last message: it shares everything up to that message
    reply = chat(http, [*history, {"role": "user", "content": QUESTIONS[2]}])
    second = prompts[-1][1]
    shared = common_prefix_length(first, second)
    assert shared > 500
    assert 0.95 * shared <= cached(reply) <= shared, (cached(reply), shared)
