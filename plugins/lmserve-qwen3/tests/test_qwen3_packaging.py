"""The packaged plugin: the wheels ``nox -s wheels`` builds, installed into a fresh venv by
``pip install --find-links DIST lmserve-qwen3``, serve a Qwen3 GGUF through that venv's own
``lmserve``.

The wheels are built afresh into a temporary directory (never a possibly stale ``dist/``) by
``tools/build_wheels.py``, the code ``nox -s wheels`` runs; the venv sees none of the
repository's editable installs. Slow: it compiles the kernels and installs the dependencies
(from pip's cache once warm).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[3]
BUILDER = ROOT / "tools" / "build_wheels.py"
# variables that would let the repository's sources or venv leak into the fresh venv
LEAKY = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV")


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The core's and this plugin's wheels, built once per session."""
    if not BUILDER.is_file():
        pytest.skip("not run from the lmserve repository: tools/build_wheels.py is missing")
    spec = importlib.util.spec_from_file_location("lmserve_build_wheels", BUILDER)
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    dist = tmp_path_factory.mktemp("dist")
    builder.build(dist, ["plugins/lmserve-qwen3"])
    return dist


@pytest.fixture(scope="session")
def gguf(synthetic: Any) -> Path:
    # requested before the wheels (same scope, so in argument order): skips before the build
    path, _ = synthetic(kind="qwen3", type="q8_0")
    return Path(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def members(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def run(cmd: list[Any], env: dict[str, str], cwd: Path, timeout: float) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )
    assert done.returncode == 0, f"{cmd} exited with {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_wheels_install_into_a_fresh_venv_and_serve_qwen3(
    gguf: Path, wheelhouse: Path, tmp_path: Path
) -> None:
    core, qwen3 = sorted(wheelhouse.glob("*.whl"))
    assert core.name.startswith("lmserve_core-") and qwen3.name.startswith("lmserve_qwen3-")
    # families compile against the core's installed kit headers; no build debris ships
    core_files, qwen3_files = members(core), members(qwen3)
    assert "lmserve_core/native/include/lmserve/kit.h" in core_files
    assert "lmserve_core/webui/index.html" in core_files  # the chat page at /
    debris = (".o", "_forward.c", "_kernels.c")
    assert not [n for n in core_files | qwen3_files if n.endswith(debris)]
    assert [n for n in qwen3_files if n.startswith("lmserve_qwen3/_forward.") and n.endswith(".so")]

    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in LEAKY}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    # no --system-site-packages: the venv starts from the base interpreter's stdlib only
    run([sys.executable, "-m", "venv", venv], env, tmp_path, 120)
    run([venv / "bin" / "pip", "install", "--find-links", wheelhouse, "lmserve-qwen3"],
        env, tmp_path, 900)
    where = run([venv / "bin" / "python", "-c",
                 "import lmserve_core, lmserve_qwen3, lmserve_core._kernels as k, "
                 "lmserve_qwen3._forward as f\n"
                 "for m in (lmserve_core, lmserve_qwen3, k, f): print(m.__file__)"],
                env, tmp_path, 60)
    for path in where.split():
        assert Path(path).is_relative_to(venv), where

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "lmserve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [str(venv / "bin" / "lmserve"), "--backend", "qwen3", str(gguf), "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
        )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, f"lmserve exited early:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"lmserve did not come up:\n{log.read_text()}"
            try:
                health = httpx.get(base + "/health", timeout=1)
                if health.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert health.json()["status"] == "ok", health.text
        page = httpx.get(base + "/webui/app.js", timeout=10)
        assert page.status_code == 200 and "v1/chat/completions" in page.text
        reply = httpx.post(
            base + "/v1/chat/completions", timeout=60,
            json={"model": "any", "messages": [{"role": "user", "content": "Hello"}],
                  "max_tokens": 8, "seed": 1},
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("stop", "length")
        assert body["usage"]["prompt_tokens"] > 5 and body["usage"]["completion_tokens"] >= 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
