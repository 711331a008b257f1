"""Real ``lmserve`` processes on loopback ports, for the tests that talk to one."""

from __future__ import annotations

import os
import pty
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

TESTS = Path(__file__).parent
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningServer:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    api_key: str | None = API_KEY
    base_url: str = field(init=False)

    def __post_init__(self) -> None:
        self.base_url = f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def on_terminal(
    cmd: list[str], env: dict[str, str], log_path: Path
) -> tuple[subprocess.Popen[bytes], threading.Thread]:
    """Start ``cmd`` with its stdout and stderr on a pseudo-terminal whose output is
    copied into ``log_path`` as it comes (by the thread returned, until the child's side
    closes)."""
    log_path.write_bytes(b"")
    master, child = pty.openpty()
    process = subprocess.Popen(cmd, stdout=child, stderr=child, env=env)
    os.close(child)

    def copy() -> None:
        with open(log_path, "ab") as log_file:
            while True:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child's side is closed
                    break
                if not data:
                    break
                log_file.write(data)
                log_file.flush()
        os.close(master)

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return process, thread


def launch(
    *args: str, env: dict[str, str] | None = None, api_key: str | None = API_KEY,
    log_dir: Path, scripted: bool = True, timeout: float = 60, terminal: bool = False,
    subcommand: tuple[str, ...] = (),
) -> RunningServer:
    """Start ``lmserve`` (``lmserve SUBCOMMAND...`` with ``subcommand``) and wait until
    /health answers. Its output goes to a file, or with ``terminal`` to a pseudo-terminal
    (copied into the file)."""
    port = free_port()
    cmd = [sys.executable, "-m", "lmserve_core", *subcommand, "--port", str(port)]
    if scripted:
        cmd += ["--plugin", "fake_backend", "--backend", "scripted"]
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += list(args)
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), *filter(None, [full_env.get("PYTHONPATH")])]
    )
    full_env.update(env or {})
    log_path = log_dir / f"lmserve-{port}.log"
    if terminal:
        process, _ = on_terminal(cmd, full_env, log_path)
    else:
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=full_env)
    server = RunningServer(process, port, log_path, api_key)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"lmserve exited with {process.returncode}:\n{server.log_text()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"lmserve did not become healthy:\n{server.log_text()}")
