"""The Qwen3 plugin: registration, conventions, the chat backend and a real ``lmserve``."""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lmserve_qwen3 import plugin

from lmserve_core.backend import ServerSettings
from lmserve_core.plugins import backend_for_architecture, backends
from lmserve_core.request import Message, NormalizedRequest
from lmserve_core.testing.hooks import registrations
from lmserve_core.testing.serving import lmserve_process


def test_registers_both_architectures() -> None:
    specs = {spec["name"]: spec for spec in registrations(plugin)}
    assert set(specs) == {"qwen3", "qwen3moe"}
    assert specs["qwen3"]["architectures"] == ("qwen3",)
    assert specs["qwen3moe"]["architectures"] == ("qwen3moe",)
    assert all(spec["factory"] is plugin.create_backend for spec in specs.values())


def test_installed_plugin_is_found_by_architecture() -> None:
    points = {ep.name: ep.value for ep in metadata.entry_points(group="lmserve")}
    if "qwen3" not in points:
        pytest.skip("lmserve-qwen3 is not installed")
    assert points["qwen3"] == "lmserve_qwen3.plugin"
    assert backends()["qwen3"].plugin == "qwen3"
    for arch in ("qwen3", "qwen3moe"):
        spec = backend_for_architecture(arch)
        assert spec is not None and spec.plugin == "qwen3"


def test_conventions_follow_the_model_card() -> None:
    c = plugin.CONVENTIONS
    plain, thinking = c.sampling_for(False), c.sampling_for(True)
    assert (plain.temperature, plain.top_k, plain.top_p, plain.min_p) == (0.7, 20, 0.8, 0.0)
    assert (thinking.temperature, thinking.top_k, thinking.top_p, thinking.min_p) == (
        0.6, 20, 0.95, 0.0,
    )
    assert c.think is not None and (c.think.open, c.think.close) == ("<think>", "</think>")
    assert set(c.extra_stop_tokens) == {"<|im_end|>", "<|endoftext|>"}
    assert c.thinking_switch == "enable_thinking"
    assert c.capabilities.grammar and c.capabilities.reasoning


def chat(text: str, *, reasoning: bool = False) -> NormalizedRequest:
    return NormalizedRequest(
        id="t", dialect="chat", messages=[Message(role="user", content=text)], max_tokens=4,
        reasoning=reasoning,
    )


@pytest.mark.parametrize("kind", ["qwen3", "qwen3moe"])
def test_backend_renders_qwen3_template_and_stops_on_its_tokens(
    kind: str, synthetic: Any
) -> None:
    path, _ = synthetic(kind=kind, type="q8_0")
    backend = plugin.create_backend(str(path), ServerSettings(ctx=256, threads=1))
    try:
        assert backend.name == kind
        tok = backend.tokenizer
        stop_texts = {tok.token_text(i) for i in backend.stop_ids}
        assert {"<|im_end|>", "<|endoftext|>"} <= stop_texts
        plain = tok.decode(backend.preparation.prompt_tokens(chat("Hi"))[0])
        assert plain.startswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
        # Qwen3's template primes an empty think block when thinking is switched off
        assert plain.endswith("<think>\n\n</think>\n\n")
        thinking = tok.decode(backend.preparation.prompt_tokens(chat("Hi", reasoning=True))[0])
        assert thinking.endswith("<|im_start|>assistant\n")
        assert backend.model.kv_bytes_per_pos == 2 * 2 * 2 * 2 * 64  # f16, 2 layers, 2 kv heads
    finally:
        backend.close()


# ---------------------------------------------------------------------------- real server


@pytest.fixture(scope="module")
def server(synthetic: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path, _ = synthetic(kind="qwen3moe", type="q4_k_m")
    log = tmp_path_factory.mktemp("qwen3-server") / "lmserve.log"
    args = ("--backend", "qwen3", str(path), "--ctx", "512", "--threads", "2")
    with lmserve_process(*args, log=log) as base:
        yield base, log


def test_lmserve_serves_a_qwen3moe_file_to_the_openai_sdk(server: Any) -> None:
    openai = pytest.importorskip("openai")
    base, log = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, seed=1,
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    assert reply.usage.prompt_tokens > 5
    # the start-up log says what a position of the cache costs
    lines = [json.loads(line) for line in Path(log).read_text().splitlines() if line.startswith("{")]
    kv = next(line for line in lines if line.get("event") == "kv_cache")
    assert kv["bytes_per_position"] == 2 * 2 * 2 * 2 * 64 and kv["kv_type"] == "f16"
    stream = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Count"}], max_tokens=6, stream=True,
    )
    finishes = [c.choices[0].finish_reason for c in stream if c.choices]
    assert finishes[-1] in ("stop", "length")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_full_cache_costs_its_bytes_per_position(kv_type: str, synthetic: Any) -> None:
    # Pages commit as positions are written: filling a 64k-position cache costs what
    # kv_bytes_per_pos says (f16: 2 layers x 2 heads x 64 dims x K,V x 2 bytes = 1 KiB), and
    # half of the f32 cache's.
    from lmserve_qwen3.model import Qwen3Model

    from lmserve_core.gguf_file import GGUFFile

    path, _ = synthetic(kind="qwen3", type="q8_0")
    model = Qwen3Model.load(GGUFFile.open(path), n_threads=1, kv_type=kv_type)
    n_ctx = 65536
    per_pos = model.kv_bytes_per_pos
    assert per_pos == 2 * 2 * 64 * 2 * (2 if kv_type == "f16" else 4)
    rows = np.ones((4096, 2 * 64), np.float32)
    before = _rss_bytes()
    cache = model.new_cache(n_ctx)
    assert _rss_bytes() - before < 2**20  # nothing committed yet
    for layer in range(2):
        for pos in range(0, n_ctx, 4096):
            cache.native.write(layer, pos, rows, rows)
    grown = _rss_bytes() - before
    assert 0.9 * per_pos * n_ctx <= grown <= 1.1 * per_pos * n_ctx + 2**20, grown
