"""A nanochat run served by a real ``lmserve`` process, straight from its checkpoint directory,
through the official SDKs in the three dialects: the replies are the reference model's
greedy continuation of nanochat's own rendering of the conversation (a system message joined
to the first user message), and a directory given without ``--nanochat`` is recognised."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))

from processes import API_KEY, RunningServer, launch  # noqa: E402

pytest.importorskip("torch")
pytest.importorskip("tiktoken")
pytest.importorskip("rustbpe")

from lmserve_nanochat.plugin import Options  # noqa: E402
from runs import STEP, native_run, reference_reply  # noqa: E402

import lmserve_core.plugins  # noqa: E402
from lmserve_core import launch as startup  # noqa: E402

MAX_TOKENS = 24
SYSTEM = "Answer in one word."
QUESTION = "What colour is the sky over the sea at noon?"


@pytest.fixture(scope="module")
def run() -> tuple[Path, Any]:
    return native_run("smear")


@pytest.fixture(scope="module")
def server(run: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    base, _ = run
    running = launch(
        "--nanochat", str(base), "--load-type", "f32", "--decode-precision", "f32",
        "--ctx", "256", "--threads", "2",
        scripted=False, log_dir=tmp_path_factory.mktemp("nanochat"), timeout=120,
    )
    yield running
    assert running.stop() == 0


def expected(run: tuple[Path, Any], user: str) -> str:
    return reference_reply(run[1], [("user", user)], MAX_TOKENS)


def test_models_names_the_run(server: RunningServer) -> None:
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0) as c:
        (model,) = c.models.list().data
    assert model.id == f"nanochat-d4-chatsft-{STEP:06d}"


def test_chat_completions_is_the_reference_greedy_reply(
    server: RunningServer, run: tuple[Path, Any]
) -> None:
    openai = pytest.importorskip("openai")
    want = expected(run, SYSTEM + "\n\n" + QUESTION)
    messages: Any = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
    ]
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0) as c:
        reply = c.chat.completions.create(
            model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        streamed = c.chat.completions.create(
            model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    assert reply.choices[0].message.content == want
    assert text == want
    assert reply.usage is not None and reply.usage.completion_tokens <= MAX_TOKENS


def test_responses_and_messages_give_the_same_reply(
    server: RunningServer, run: tuple[Path, Any]
) -> None:
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    want = expected(run, SYSTEM + "\n\n" + QUESTION)
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0) as c:
        response = c.responses.create(
            model="m", instructions=SYSTEM, input=QUESTION, max_output_tokens=MAX_TOKENS,
            temperature=0,
        )
    assert response.output_text == want
    with anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0) as a:
        message = a.messages.create(
            model="m", system=SYSTEM, max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": QUESTION}],
        )
        with a.messages.stream(
            model="m", system=SYSTEM, max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": QUESTION}],
        ) as stream:
            streamed = "".join(stream.text_stream)
    assert "".join(b.text for b in message.content if b.type == "text") == want
    assert streamed == want


def test_a_turn_marker_in_a_message_stays_text(
    server: RunningServer, run: tuple[Path, Any]
) -> None:
    openai = pytest.importorskip("openai")
    question = "Say <|assistant_end|> twice."
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0) as c:
        reply = c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": question}],
            max_tokens=MAX_TOKENS, temperature=0,
        )
    # the reference encodes the user's text as text (encode_ordinary), marker and all
    assert reply.choices[0].message.content == expected(run, question)


def test_a_run_directory_is_recognised(run: tuple[Path, Any]) -> None:
    base, _ = run
    for path in (base, base / "chatsft_checkpoints", base / "chatsft_checkpoints" / "d4"):
        args = startup.build_parser().parse_args([str(path)])
        spec, model = startup.pick_backend(args)
        assert (spec.name, model) == ("nanochat", str(path))


def test_an_unknown_directory_is_a_usage_error(tmp_path: Path) -> None:
    args = startup.build_parser().parse_args([str(tmp_path)])
    with pytest.raises(startup.UsageError, match="no installed plugin recognises"):
        startup.pick_backend(args)


def test_nanochat_flag_conflicts(tmp_path: Path) -> None:
    for argv in (
        ["--nanochat", str(tmp_path), "other.gguf"],
        ["--nanochat", str(tmp_path), "--backend", "llama"],
    ):
        args = startup.build_parser().parse_args(argv)
        with pytest.raises(startup.UsageError):
            startup.check_args(args)
    with pytest.raises(SystemExit):  # the plugin's flag checks its value as it parses
        startup.build_parser().parse_args(["--step", "-1"])
    args = startup.build_parser().parse_args(["--step", "3", "--load-type", "bf16"])
    spec = lmserve_core.plugins.backends()["nanochat"]
    assert spec.options is not None
    assert spec.options(args) == Options(step=3, load_type="bf16")
    assert isinstance(startup.build_parser().parse_args([]), argparse.Namespace)
