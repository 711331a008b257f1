"""Fixtures of the Inkling tests: the tiny checkpoints (tiny_inkling.py) and their GGUFs.

tiny_inkling.py is imported under the name ``inkling_tiny``: other plugins' tests have
helper modules of their own, and one pytest session may collect every folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve_core.testing.synthetic import load_script

tiny = load_script("inkling_tiny", Path(__file__).with_name("tiny_inkling.py"))


@pytest.fixture(scope="session")
def checkpoint() -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return tiny.tiny_checkpoint()


@pytest.fixture(scope="session")
def gguf_f32(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lmserve_inkling.convert import convert

    return convert(checkpoint, tmp_path_factory.mktemp("inkling") / "tiny-f32.gguf")


@pytest.fixture(scope="session")
def inkling_tiny() -> object:
    return tiny
