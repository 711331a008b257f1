"""A family's backend served in-process for its tests, with the prompts it renders recorded,
and transformers' rendering of the same chat template to compare them with.

litestar, transformers and pytest are imported only by the functions that use them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def record_prompts(backend: Any) -> list[tuple[str, list[int]]]:
    """The list that the (text, tokens) of every prompt ``backend`` (a ``GGUFChatBackend``)
    renders from now on are appended to."""
    prompts: list[tuple[str, list[int]]] = []
    preparation = backend.preparation
    render = preparation.prompt_tokens

    def recording(request: Any, *args: Any, **kwargs: Any) -> tuple[list[int], str | None]:
        tokens, text = render(request, *args, **kwargs)
        prompts.append((text or "", list(tokens)))
        return tokens, text

    preparation.prompt_tokens = recording
    return prompts


@contextlib.contextmanager
def serve(backend: Any, settings: Any) -> Iterator[Any]:
    """A litestar ``TestClient`` of a server of ``backend`` with ``settings`` (ServerSettings);
    the engine stops and the backend closes on the way out."""
    from litestar.testing import TestClient

    from lmserve_core.app import create_app
    from lmserve_core.engine import Engine
    from lmserve_core.server import Server

    engine = Engine(backend)
    app = create_app(Server(engine=engine, settings=settings))
    try:
        with TestClient(app) as client:
            yield client
    finally:
        engine.stop()
        backend.close()


@contextlib.contextmanager
def lmserve_process(*args: str, log: Path, timeout: float = 90) -> Iterator[str]:
    """A real ``lmserve ARGS...`` on a free loopback port, its output in ``log``: yields its
    base URL once /health answers; stopped with SIGTERM on the way out (and must exit 0)."""
    import httpx
    import pytest

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "lmserve_core", *args, "--port", str(port)]
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"lmserve exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        process.kill()
        pytest.fail(f"lmserve did not become healthy:\n{log.read_text()}")
    try:
        yield base
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0


def reference_tokenizer(hf_dir: Path | None) -> Any:
    """transformers' tokenizer of a synthetic model's ``hf/`` directory; the test skips without
    transformers."""
    import pytest

    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(hf_dir)


def reference_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    thinking: bool,
) -> str:
    """The prompt transformers renders with ``tokenizer``'s chat template: ``messages`` and
    ``tools`` in chat-completions shape (call arguments as objects), ``enable_thinking``
    set to ``thinking``, the generation prompt added."""
    text: str = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        enable_thinking=thinking,
        add_generation_prompt=True,
        tokenize=False,
    )
    return text
