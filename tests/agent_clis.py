"""Claude Code and Codex CLI run headless against a real ``lmserve`` process.

Each CLI is installed once with npm (never globally) into the test cache
(``$LMSERVE_TEST_CACHE``, else ``~/.cache/lmserve-test-assets``) under
``agent-clis/<package>-<version>``: npm installs into a temporary directory next to it,
which is renamed into place once the CLI answers ``--version``. A test skips, with the
reason, when npm/node is missing or the install fails.

The CLIs run offline: ``HOME`` (and ``CODEX_HOME``) are fresh directories, so no user
configuration leaks in; telemetry, updates and error reporting are switched off; and every
proxy variable points at a closed loopback port, with only loopback exempt, so any
connection that is not to the server under test fails at once instead of hanging.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from processes import RunningServer, free_port

from lmserve_core.testing.assets import cache_dir

PROMPT = "Say hello."
MODEL_NAME = "lmserve"  # the server answers with its own model whatever the name


@dataclass(frozen=True)
class NpmCli:
    package: str
    version: str
    command: str

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"

    @property
    def label(self) -> str:
        return f"{self.package.lstrip('@').replace('/', '__')}-{self.version}"


# Pinned: both change their requests often; a new version is a deliberate bump.
CLAUDE_CODE = NpmCli("@anthropic-ai/claude-code", "2.1.332", "claude")
CODEX = NpmCli("@openai/codex", "0.171.0", "codex")


class Unavailable(RuntimeError):
    """The CLI cannot be installed or run here; the message is the skip reason."""


def _npm_env() -> dict[str, str]:
    return {
        **os.environ,
        "npm_config_update_notifier": "false",
        "npm_config_fund": "false",
        "npm_config_audit": "false",
    }


def _binaries(root: Path, cli: NpmCli) -> list[Path]:
    """Where the CLI's executable may be, best first."""
    found = [root / "node_modules" / ".bin" / cli.command]
    if cli is CLAUDE_CODE:
        # The wrapper's postinstall copies the platform binary over a stub; should npm
        # ever skip install scripts, the platform package's own binary still runs.
        found += sorted((root / "node_modules" / "@anthropic-ai").glob("claude-code-*/claude"))
    return found


def _working_binary(root: Path, cli: NpmCli) -> Path:
    problems = []
    for path in _binaries(root, cli):
        if not path.exists():
            continue
        try:
            with tempfile.TemporaryDirectory(prefix="agent-cli-home-") as home:
                proc = subprocess.run(
                    [str(path), "--version"], capture_output=True, text=True, timeout=60,
                    stdin=subprocess.DEVNULL, env=isolated_env(Path(home)),
                )
        except (OSError, subprocess.TimeoutExpired) as exc:
            problems.append(f"{path.name}: {exc}")
            continue
        if proc.returncode == 0 and cli.version in proc.stdout:
            return path
        problems.append(f"{path}: exit {proc.returncode}: {(proc.stdout + proc.stderr)[-500:]}")
    raise Unavailable(f"{cli.spec} installed but does not run here: {'; '.join(problems)}")


@functools.cache
def _install(cli: NpmCli) -> Path | str:
    try:
        return install(cli)
    except Unavailable as exc:
        return str(exc)


def install(cli: NpmCli) -> Path:
    """The CLI's executable, installed into the cache on first use. Raises Unavailable."""
    npm, node = shutil.which("npm"), shutil.which("node")
    if npm is None or node is None:
        raise Unavailable(f"npm and node are needed to install {cli.spec}")
    dest = cache_dir() / "agent-clis" / cli.label
    if dest.is_dir():
        return _working_binary(dest, cli)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{cli.label}.") as tmp:
        work = Path(tmp) / cli.label
        work.mkdir()
        cmd = [npm, "install", "--prefix", str(work), "--no-save", "--loglevel=error", cli.spec]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=900, env=_npm_env(),
                cwd=work, stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unavailable(f"npm install {cli.spec} failed: {exc}") from exc
        if proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip()[-2000:]
            raise Unavailable(f"npm install {cli.spec} failed ({proc.returncode}): {detail}")
        _working_binary(work, cli)  # only a CLI that runs goes into the cache
        try:
            work.rename(dest)
        except OSError:
            if not dest.is_dir():  # not a lost race with another process: a real failure
                raise
    return _working_binary(dest, cli)


def require(cli: NpmCli) -> Path:
    """The CLI's executable, or skip the test with the reason it is unavailable."""
    import pytest

    result = _install(cli)
    if isinstance(result, str):
        pytest.skip(result)
    return result


def isolated_env(home: Path) -> dict[str, str]:
    """An environment with nothing of the user's and no way out but loopback."""
    home.mkdir(parents=True, exist_ok=True)
    closed = f"http://127.0.0.1:{free_port()}"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "NO_PROXY": "127.0.0.1,localhost,::1",
    }
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = closed
    env.update({k.lower(): v for k, v in env.items() if k.endswith("_PROXY")})
    return env


@dataclass
class CliRun:
    cmd: list[str]
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    seconds: float
    server: RunningServer
    files: dict[str, str]  # configuration written for the CLI, by path

    def report(self) -> str:
        """Both sides, for an assertion message."""
        parts = [
            f"$ {' '.join(self.cmd)}",
            f"exit: {'timeout' if self.returncode is None else self.returncode}"
            f" after {self.seconds:.1f} s",
            *[f"--- {path}\n{text}" for path, text in self.files.items()],
            f"--- stdout\n{self.stdout[-6000:]}",
            f"--- stderr\n{self.stderr[-6000:]}",
            f"--- server log ({self.server.log_path})\n{self.server.log_text()[-6000:]}",
        ]
        return "\n".join(parts)


def _run(
    cmd: list[str], env: dict[str, str], cwd: Path, timeout: float, server: RunningServer,
    files: dict[str, str] | None = None,
) -> CliRun:
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # its own session: the CLI and whatever it spawned
        out, err = proc.communicate()
        code = None
    seconds = time.monotonic() - start
    print(f"{Path(cmd[0]).name}: {seconds:.1f} s, exit {code}")
    return CliRun(cmd, code, out, err, seconds, server, files or {})


def claude_code(
    binary: Path, server: RunningServer, tmp: Path, *, max_output_tokens: int,
    timeout: float = 300, prompt: str = PROMPT,
) -> CliRun:
    """``claude -p PROMPT --output-format json`` against ``server`` (Anthropic Messages)."""
    work = tmp / "claude-work"
    work.mkdir(parents=True, exist_ok=True)
    env = isolated_env(tmp / "claude-home")
    env.update({
        "ANTHROPIC_BASE_URL": server.base_url,
        "ANTHROPIC_API_KEY": server.api_key or "unused",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        # Its default (32000) lets a model that never stops talk for many minutes.
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens),
        # Every tool declared in the request, none deferred behind its ToolSearch tool.
        "ENABLE_TOOL_SEARCH": "false",
    })
    cmd = [str(binary), "-p", prompt, "--output-format", "json", "--model", MODEL_NAME]
    return _run(cmd, env, work, timeout, server)


CODEX_CONFIG = """\
model = "{model}"
model_provider = "lmserve"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[model_providers.lmserve]
name = "lmserve"
base_url = "{base_url}/v1"
env_key = "LMSERVE_TEST_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"

# Without this Codex syncs its curated plugin list from github.com and chatgpt.com at start.
[features]
plugins = false
"""


def codex(
    binary: Path, server: RunningServer, tmp: Path, *, timeout: float = 300,
    prompt: str = PROMPT,
) -> CliRun:
    """``codex exec PROMPT`` against ``server`` (OpenAI Responses, the only wire API left
    in Codex); the final message goes to ``tmp/codex-last-message.txt``."""
    work = tmp / "codex-work"
    work.mkdir(parents=True, exist_ok=True)
    home = tmp / "codex-home"
    env = isolated_env(home)
    config = home / "config.toml"
    config.write_text(CODEX_CONFIG.format(model=MODEL_NAME, base_url=server.base_url))
    env.update({"CODEX_HOME": str(home), "LMSERVE_TEST_API_KEY": server.api_key or "unused"})
    cmd = [
        str(binary), "exec", "--strict-config", "--skip-git-repo-check", "--ephemeral",
        "--color", "never", "--output-last-message", str(tmp / "codex-last-message.txt"), prompt,
    ]
    return _run(cmd, env, work, timeout, server, {str(config): config.read_text()})


def codex_last_message(tmp: Path) -> str | None:
    path = tmp / "codex-last-message.txt"
    return path.read_text() if path.is_file() else None


def claude_result(run: CliRun) -> dict[str, Any] | None:
    """The JSON result object ``claude -p --output-format json`` prints last."""
    for line in reversed(run.stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and value.get("type") == "result":
            return value
    return None


def served_requests(server: RunningServer) -> list[dict[str, Any]]:
    """The server's one-line-per-request log records (``event: request``)."""
    records = []
    for line in server.log_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == "request":
            records.append(record)
    return records


def answered(server: RunningServer, dialect: str, since: int) -> list[dict[str, Any]]:
    """The requests of ``dialect`` ("messages", "responses") logged after the first ``since``."""
    return [r for r in served_requests(server)[since:] if r.get("dialect") == dialect]
