"""The README's first ten minutes, as a new user runs them: the install command in a copy of
the checkout, the server it installs, and the requests the README gives to copy, verbatim but
for the port (the README's 8080 may be taken here).

The install builds a virtual environment from PyPI plus this checkout (about a minute); the
module is marked slow.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from processes import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def blocks(language: str) -> list[str]:
    """The README's fenced code blocks of one language, in order."""
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def install_command() -> tuple[str, str]:
    """The first command of the README: ``install && serve``."""
    install, _, serve = blocks("sh")[0].strip().partition(" && ")
    return install, serve


def test_ci_runs_the_readmes_test_command() -> None:
    development = README[README.index("## Development"):]
    command = re.search(r"```sh\n(.*?)\n```", development, flags=re.S)
    assert command is not None
    assert command.group(1).strip() in (ROOT / ".ci" / "run").read_text()


def test_claude_code_line_uses_what_the_agent_tests_set() -> None:
    # the variables tests/agent_clis.py gives Claude Code against a real server
    line = next(b for b in blocks("sh") if "claude" in b).strip()
    assert line == "ANTHROPIC_BASE_URL=http://127.0.0.1:8080 ANTHROPIC_API_KEY=unused claude"
    agents = (ROOT / "tests" / "agent_clis.py").read_text()
    assert '"ANTHROPIC_BASE_URL": server.base_url' in agents
    assert '"ANTHROPIC_API_KEY"' in agents


def stated_defaults(text: str) -> dict[str, str]:
    """The defaults a text states as "`--flag` ... (default X" (first word of X)."""
    found = re.findall(r"`(--[a-z-]+)[^`]*`[^`(]{0,60}\(default:? ([^),;:]+)", text)
    return {flag: value.split()[0] for flag, value in found}


def test_readme_defaults_are_the_parsers() -> None:
    from lmserve_core.launch import build_parser

    parser = build_parser()
    defaults = {a.option_strings[0]: a.default for a in parser._actions if a.option_strings}
    stated = stated_defaults(README)
    assert {"--ctx", "--kv-slots", "--batch", "--max-body-mb"} <= set(stated)
    for flag, value in stated.items():
        assert flag in defaults, f"the README names {flag}, which lmserve does not take"
        default = defaults[flag]
        if isinstance(default, int) and value.isdigit():
            assert int(value) == default, f"README: {flag} default {value}; --help: {default}"
    # the families the README lists are the plugins the checkout has
    families = {p.name.removeprefix("lmserve-") for p in (ROOT / "plugins").iterdir()}
    layout = next(line for line in README.splitlines() if line.startswith("plugins/lmserve-*/"))
    assert families <= set(re.findall(r"\w+", layout))
    guide = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    assert families <= set(re.findall(r"families/(\w+)\.md", guide))


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout's tracked files, with the README's install command run in it."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("the install compiles C: no compiler here")
    copy = tmp_path_factory.mktemp("clone")
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode().split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    install, _ = install_command()
    done = subprocess.run(
        install, shell=True, cwd=copy, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "done:" in done.stdout
    # packaging problems (a data directory setuptools would drop, ...) show as warnings
    assert "Warning" not in done.stdout + done.stderr, done.stdout + done.stderr
    return copy


@pytest.fixture(scope="module")
def server(installed: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    _, serve = install_command()
    port = free_port()
    log = tmp_path_factory.mktemp("readme-server") / "lmserve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            f"exec {serve} --port {port}", shell=True, cwd=installed, stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert process.poll() is None, log.read_text(errors="replace")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("the installed lmserve did not become healthy:\n" + log.read_text())
        yield port
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
    assert process.returncode == 0, log.read_text(errors="replace")


def on_port(text: str, port: int) -> str:
    return text.replace("127.0.0.1:8080", f"127.0.0.1:{port}")


def test_installed_server_serves_the_chat_page(server: int) -> None:
    page = httpx.get(f"http://127.0.0.1:{server}/")
    assert page.status_code == 200 and "<html" in page.text


def test_the_curl_request_streams_a_reply(server: int) -> None:
    curl = next(b for b in blocks("sh") if b.startswith("curl"))
    done = subprocess.run(
        on_port(curl, server), shell=True, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    events = [line[len("data: "):] for line in done.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.strip()
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length") or any(
        c["choices"] and c["choices"][0]["finish_reason"] for c in chunks
    )


def test_the_openai_sdk_example_prints_a_reply(server: int, tmp_path: Path) -> None:
    pytest.importorskip("openai")
    script = tmp_path / "example.py"
    script.write_text(on_port(blocks("python")[0], server))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_the_readmes_test_command_runs_the_tests_from_the_install(installed: Path) -> None:
    # last in the module: it turns the copy's environment into a development install
    development = README[README.index("## Development"):]
    command = re.findall(r"```sh\n(.*?)\n```", development, flags=re.S)[1].strip()
    install, _, tests = command.partition(" && ")
    assert install == "scripts/install.sh --dev"
    assert tests.startswith(".venv/bin/python -m pytest tests")
    done = subprocess.run(
        install, shell=True, cwd=installed, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Warning" not in done.stdout + done.stderr, done.stdout + done.stderr
    # the same interpreter and runner on two of the suite's files, one starting servers
    done = subprocess.run(
        ".venv/bin/python -m pytest tests/test_dialect_completions.py tests/test_examples_clients.py "
        "-q -x -p no:cacheprovider",
        shell=True, cwd=installed, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
