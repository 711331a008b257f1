"""Gemma 3 270M (real weights) served by a real ``lmserve`` process, through the official
SDKs: architecture auto-detection, the shipped fallback template, the turn's stop tokens,
and slot reuse over a conversation longer than the sliding window."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from lmserve_gemma import plugin

from lmserve_core.plugins import backend_for_architecture, backends
from lmserve_core.testing.hooks import registrations

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))

from models import gemma3_path  # noqa: E402
from processes import API_KEY, RunningServer, launch  # noqa: E402

TEXT = ROOT / "tests" / "data" / "perplexity" / "text.txt"


def test_registers_gemma_for_its_architectures() -> None:
    (spec,) = registrations(plugin)
    assert spec["name"] == "gemma" and "gemma3" in spec["architectures"]
    points = {ep.name: ep.value for ep in metadata.entry_points(group="lmserve")}
    if "gemma" not in points:
        pytest.skip("lmserve-gemma is not installed")
    assert backends()["gemma"].plugin == "gemma"
    found = backend_for_architecture("gemma3")
    assert found is not None and found.name == "gemma"


def test_conventions() -> None:
    c = plugin.gemma3_conventions()
    assert set(c.extra_stop_tokens) == {"<end_of_turn>", "<eos>"}
    assert c.capabilities.tools is None and not c.capabilities.reasoning
    assert c.fallback_template is not None and "<start_of_turn>" in c.fallback_template
    s = c.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == (1.0, 64, 0.95, 0.0)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    # no --backend: the gemma3 architecture picks the gemma family; one slot (and so one
    # request at a time), so an unrelated request evicts the conversation
    running = launch(
        str(gemma3_path()),
        "--ctx",
        "4096",
        "--threads",
        "2",
        "--kv-slots",
        "1",
        "--batch",
        "1",
        scripted=False,
        log_dir=tmp_path_factory.mktemp("gemma3"),
        timeout=120,
    )
    yield running
    assert running.stop() == 0


@pytest.fixture
def oai(gemma: RunningServer) -> Iterator[Any]:
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=gemma.base_url + "/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


def log_events(server: RunningServer, event: str) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in server.log_text().splitlines() if x.startswith("{")]
    return [x for x in lines if x.get("event") == event]


pytestmark = pytest.mark.slow


# The packaged 270M is the pretrained model, not the instruction-tuned one: through the
# template it answers a few-shot chat correctly, but it was never taught to end a turn, so
# replies are kept short (llama.cpp's greedy replies run on the same way).
SHOTS = [
    {"role": "user", "content": "What is the capital of Germany?"},
    {"role": "assistant", "content": "Berlin."},
    {"role": "user", "content": "What is the capital of Japan?"},
    {"role": "assistant", "content": "Tokyo."},
]


def test_template_and_stop_tokens() -> None:
    from lmserve_core.backend import ServerSettings
    from lmserve_core.request import Message, NormalizedRequest

    backend = plugin.create_backend(str(gemma3_path()), ServerSettings(ctx=256, threads=1))
    try:
        tok = backend.tokenizer
        assert {tok.token_text(i) for i in backend.stop_ids} >= {"<end_of_turn>", "<eos>"}
        request = NormalizedRequest(
            id="t",
            dialect="chat",
            max_tokens=4,
            messages=[
                Message(role="system", content="Be brief."),
                Message(role="user", content="Hi"),
            ],
        )
        ids = backend.preparation.prompt_tokens(request)[0]
        # the system text is folded into the first user turn, as Gemma's template does
        assert tok.decode(ids) == (
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
        )
        assert ids[:2] == [tok.bos_id, tok.token_id("<start_of_turn>")]
    finally:
        backend.close()


def test_greedy_chat_is_sensible_through_the_fallback_template(
    oai: Any, gemma: RunningServer
) -> None:
    for question, answer in (("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid")):
        reply = oai.chat.completions.create(
            model="gemma",
            temperature=0,
            max_tokens=3,
            messages=[*SHOTS, {"role": "user", "content": f"What is the capital of {question}?"}],
        )
        assert reply.choices[0].message.content.startswith(answer + "."), reply
    models = oai.models.list()
    assert "gemma" in models.data[0].id.lower()
    kv = log_events(gemma, "kv_cache")[0]
    # 3 global layers keep a row per position (1 kv head x 256 x K,V x f16); the 15 local
    # layers keep rings of 512 + 256 rows, whatever the context
    assert kv["bytes_per_position"] == 3 * 256 * 2 * 2
    assert kv["full_mib"] == pytest.approx((3 * 4096 + 15 * 768) * 256 * 2 * 2 / 2**20, abs=0.1)


def test_anthropic_and_responses_dialects(gemma: RunningServer) -> None:
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    question = {"role": "user", "content": "What is the capital of Italy?"}
    with anthropic.Anthropic(base_url=gemma.base_url, api_key=API_KEY, max_retries=0) as ant:
        msg = ant.messages.create(
            model="gemma", max_tokens=3, extra_body={"temperature": 0}, messages=[*SHOTS, question]
        )
    assert msg.content[0].text.startswith("Rome."), msg
    assert msg.stop_reason == "max_tokens"
    with openai.OpenAI(base_url=gemma.base_url + "/v1", api_key=API_KEY, max_retries=0) as oai:
        resp = oai.responses.create(
            model="gemma", input=[*SHOTS, question], temperature=0, max_output_tokens=3
        )
    assert resp.output_text.startswith("Rome."), resp


def test_slot_reuse_past_the_window_gives_the_cold_reply(oai: Any) -> None:
    # A conversation of ~1000 tokens (the rings of 768 rows have wrapped); the follow-up
    # reuses the slot's prefix and must answer exactly as the same request served cold.
    text = TEXT.read_text(encoding="utf-8")[:4000]
    first = [{"role": "user", "content": f"{text}\n\nWhat is this text about? One sentence."}]
    a = oai.chat.completions.create(model="gemma", messages=first, temperature=0, max_tokens=40)
    assert a.usage.prompt_tokens > 800
    follow = [
        *first,
        {"role": "assistant", "content": a.choices[0].message.content},
        {"role": "user", "content": "Name one danger for ships that it mentions."},
    ]
    warm = oai.chat.completions.create(model="gemma", messages=follow, temperature=0, max_tokens=40)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached > 800, cached
    # evict the only slot, then the same follow-up from an empty cache
    oai.chat.completions.create(
        model="gemma", messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=4
    )
    cold = oai.chat.completions.create(model="gemma", messages=follow, temperature=0, max_tokens=40)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert warm.choices[0].message.content
