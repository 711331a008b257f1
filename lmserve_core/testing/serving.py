"""A family's backend served in-process for its tests, with the prompts it renders recorded,
and transformers' rendering of the same chat template to compare them with.

litestar, transformers and pytest are imported only by the functions that use them.
"""

from __future__ import annotations

import contextlib
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
