"""Fixtures: real ``lmserve`` processes on loopback ports, and SDK clients for them."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from processes import API_KEY, RunningServer, launch

from lmserve_core.testing.browser import chromium, tab  # noqa: F401  (the chat page's tests)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A scripted-backend server shared by the whole session (api key "test-key")."""
    running = launch(log_dir=tmp_path_factory.mktemp("server"))
    yield running
    running.stop()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[object]:
    """Factory: ``start_server(*args, env=None, api_key="test-key", scripted=True)``."""
    started: list[RunningServer] = []

    def start(*args: str, **kwargs: object) -> RunningServer:
        running = launch(*args, log_dir=tmp_path, **kwargs)  # type: ignore[arg-type]
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop(signal.SIGKILL)


@pytest.fixture
def openai_client(server: RunningServer):  # type: ignore[no-untyped-def]
    import openai

    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0) as client:
        yield client


@pytest.fixture
def anthropic_client(server: RunningServer):  # type: ignore[no-untyped-def]
    import anthropic

    with anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0) as client:
        yield client


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def restore_isa() -> Iterator[None]:
    """The kernels' ISA and precisions as they were before the test."""
    from lmserve_core.native import kernels

    before, precision = kernels.isa_active(), kernels.decode_precision()
    prefill = kernels.prefill_precision()
    yield
    kernels.select_isa(before)
    kernels.select_decode_precision(precision)
    kernels.select_prefill_precision(prefill)
