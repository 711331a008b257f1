"""The chat page (docs/webui.md) in headless Chromium against a real ``lmserve`` process
serving the tiny synthetic Qwen3: with the page's thinking switch on, the reply's think
block is streamed as ``reasoning_content`` and shown folded above the answer.

Random weights never think on their own, so the process serves the synthetic model with its
replies steered to a script (steered_qwen3.py): the server's own think-marker routing turns
the script's ``<think>`` block into reasoning. The ``chromium`` and ``tab`` fixtures and the
helpers are lmserve_core.testing.browser's (see conftest.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "tests"))

from processes import RunningServer, launch  # noqa: E402

from lmserve_core.testing.browser import open_page, screenshot, send, wait_idle  # noqa: E402

THOUGHT = "The user says hello. A short greeting back will do."
ANSWER = "Hello! How can I help you today?"
SCRIPT = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}<|im_end|>"


@pytest.fixture(scope="module")
def steered(synthetic: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    path, _ = synthetic(kind="qwen3", type="q8_0")
    paths = [str(HERE), os.environ.get("PYTHONPATH", "")]
    running = launch(
        str(path),
        "--plugin",
        "steered_qwen3",
        "--backend",
        "qwen3-steered",
        "--model-id",
        "qwen3-synthetic",
        "--ctx",
        "2048",
        env={"LMSERVE_STEER": SCRIPT, "PYTHONPATH": os.pathsep.join(filter(None, paths))},
        api_key=None,
        scripted=False,
        log_dir=tmp_path_factory.mktemp("webui"),
    )
    yield running
    running.stop()


def test_the_thinking_block(tab: Any, steered: RunningServer) -> None:
    open_page(tab, steered.base_url)
    tab.wait_for_function(
        "() => document.getElementById('model-id').textContent === 'qwen3-synthetic'"
    )
    assert tab.inner_text("#model-meta") == "qwen3 · context 2,048"
    bodies: list[Any] = []
    tab.on("request", lambda r: bodies.append(r.post_data_json) if r.method == "POST" else None)
    tab.check("#thinking")  # the switch is there: Qwen3 has a reasoning mode
    send(tab, "Hello!")
    wait_idle(tab)
    assert bodies[0]["reasoning_effort"] == "high"
    assert tab.locator(".msg.assistant .error").is_hidden()
    assert tab.inner_text(".msg.assistant .content") == ANSWER
    block = tab.locator(".msg.assistant .reasoning")
    assert block.is_visible() and block.get_attribute("open") is None  # folded after the answer
    block.locator("summary").click()
    assert block.locator(".reasoning-body").inner_text() == THOUGHT
    screenshot(tab, "qwen3-thinking")
