"""Fixtures: the tiny nanochat models of tiny_nanochat.py (torch and transformers build and
run the references; the tests skip without them)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from tiny_nanochat import TinyModel, tiny_model

_models: dict[str, TinyModel] = {}


@pytest.fixture(scope="session")
def tiny() -> Callable[[str], TinyModel]:
    """``tiny(kind)``: the cached tiny model of a kind (smear, ve32, hf), built once a run."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")

    def get(kind: str) -> TinyModel:
        if kind not in _models:
            _models[kind] = tiny_model(kind)
        return _models[kind]

    return get
