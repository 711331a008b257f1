"""A nanochat run served with what serving adds: concurrent requests batched, ``--spec``,
a conversation's prefix reused from memory and, after a restart, from the disk tier; in a
process where torch cannot be imported. Every reply is the reference's greedy one."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))

from processes import API_KEY, RunningServer, launch  # noqa: E402

pytest.importorskip("torch")
pytest.importorskip("tiktoken")
pytest.importorskip("rustbpe")
openai = pytest.importorskip("openai")

from runs import native_run, reference_reply  # noqa: E402

MAX_TOKENS = 16
QUESTIONS = [
    "Name a colour of the evening sky.",
    "What do bees make?",
    "Count from one to five.",
    "Which sea is the saltiest?",
]


def start(base: Path, cache: Path, log_dir: Path) -> RunningServer:
    # torch is not importable in the serving process: nothing may need it
    blocked = log_dir / "no-torch" / "torch"
    blocked.mkdir(parents=True, exist_ok=True)
    (blocked / "__init__.py").write_text("raise ImportError('torch is blocked here')\n")
    return launch(
        "--nanochat", str(base), "--load-type", "f32", "--decode-precision", "f32",
        "--ctx", "512", "--threads", "2", "--batch", "4", "--kv-slots", "4", "--spec",
        "--kv-cache-dir", str(cache),
        env={"PYTHONPATH": os.pathsep.join(filter(None, [str(blocked.parent), os.environ.get("PYTHONPATH")]))},
        scripted=False, log_dir=log_dir, timeout=120,
    )


def ask(server: RunningServer, messages: list[dict[str, str]]) -> tuple[str, int]:
    """The greedy reply and the prompt tokens read from a cache."""
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0) as c:
        reply = c.chat.completions.create(
            model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0  # type: ignore[arg-type]
        )
    usage = reply.usage
    assert usage is not None
    details = usage.prompt_tokens_details
    return reply.choices[0].message.content or "", (details.cached_tokens or 0) if details else 0


def turns(messages: list[dict[str, str]]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


def test_batched_speculative_reused_and_restored(tmp_path: Path) -> None:
    base, model = native_run("smear")
    cache = tmp_path / "kv"
    server = start(base, cache, tmp_path / "first")
    try:
        # four at once: they decode together
        asked = [[{"role": "user", "content": q}] for q in QUESTIONS]
        with ThreadPoolExecutor(len(asked)) as pool:
            replies = list(pool.map(lambda m: ask(server, m)[0], asked))
        for messages, reply in zip(asked, replies, strict=True):
            assert reply == reference_reply(model, turns(messages), MAX_TOKENS)

        # the second turn reads the first from the cache
        first = asked[0]
        second = [*first, {"role": "assistant", "content": replies[0]},
                  {"role": "user", "content": "And at dawn?"}]
        reply, cached = ask(server, second)
        assert reply == reference_reply(model, turns(second), MAX_TOKENS)
        assert cached > 0
    finally:
        assert server.stop() == 0  # a graceful stop writes the resident slots to disk

    assert any(cache.iterdir()), "the disk tier holds the conversations"
    third = [*second, {"role": "assistant", "content": reply},
             {"role": "user", "content": "Thanks."}]
    restarted = start(base, cache, tmp_path / "second")
    try:
        again, cached = ask(restarted, third)
    finally:
        restarted.stop()
    assert again == reference_reply(model, turns(third), MAX_TOKENS)
    assert cached > 0, "the conversation came back from the disk tier"
    assert "torch is blocked" not in restarted.log_text()
