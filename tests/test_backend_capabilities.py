"""The Backend contract's optional members: core finds each capability through its Protocol
(``lmserve_core.backend``), never by probing a backend for one attribute at a time."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lmserve_reverse import ReverseBackend
from models import smollm2_path
from structlog.testing import capture_logs

import lmserve_core
from lmserve_core import banner, launch
from lmserve_core.backend import (
    BackendSpec,
    Batching,
    CountsTokens,
    HasFamily,
    HasModel,
    HasSlots,
    HasVocabulary,
    ServerSettings,
    ServesPrefixes,
    Speculates,
)
from lmserve_core.engine import Engine
from lmserve_core.events import EventSink, Finish, TextDelta
from lmserve_core.plugins import backend_for_architecture
from lmserve_core.request import Message, NormalizedRequest

CAPABILITIES = (
    Batching,
    CountsTokens,
    HasVocabulary,
    HasSlots,
    Speculates,
    ServesPrefixes,
    HasModel,
    HasFamily,
)
CORE = Path(lmserve_core.__file__).parent


def _probes(source: str) -> Iterator[tuple[int, str]]:
    """``getattr``/``hasattr`` calls in ``source`` whose object is a backend (``backend``,
    ``server.backend``, ``backend.model``, ...): line and call."""
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
        ):
            names = {n.id for n in ast.walk(node.args[0]) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node.args[0]) if isinstance(n, ast.Attribute)}
            if "backend" in names:
                yield node.lineno, ast.unparse(node)


def test_core_asks_no_backend_for_an_attribute() -> None:
    probes = [
        f"{path.relative_to(CORE.parent)}:{line}: {call}"
        for path in sorted(CORE.rglob("*.py"))
        for line, call in _probes(path.read_text())
    ]
    assert not probes, "use the Protocols of lmserve_core.backend:\n" + "\n".join(probes)


def test_the_scan_finds_the_probes_core_had() -> None:
    source = (
        "a = callable(getattr(backend, 'begin', None))\n"
        "b = hasattr(self.backend, 'slots')\n"
        "c = getattr(getattr(server.backend, 'model', None), 'kv_type', None)\n"
        "d = getattr(self.model, 'kv_type', None)\n"  # a model's own member: not a backend's
        "e = getattr(built.backend.model, 'kv_type', None)\n"
    )
    assert sorted({line for line, _ in _probes(source)}) == [1, 2, 3, 5]


@pytest.fixture(scope="module")
def gguf_backend() -> Iterator[Any]:
    """SmolLM2 served by the llama plugin: the generic GGUF chat path."""
    spec = backend_for_architecture("llama")
    assert spec is not None
    backend = spec.factory(
        str(smollm2_path()), ServerSettings(ctx=256, threads=1, kv_slots=2, batch=2)
    )
    yield backend
    backend.close()


@pytest.mark.parametrize("protocol", CAPABILITIES, ids=lambda p: p.__name__)
def test_the_gguf_chat_backend_has_every_capability(gguf_backend: Any, protocol: type) -> None:
    assert isinstance(gguf_backend, protocol)


@pytest.mark.parametrize("protocol", CAPABILITIES, ids=lambda p: p.__name__)
def test_the_example_backend_has_none(protocol: type) -> None:
    # examples/lmserve-reverse implements only the required members
    assert not isinstance(ReverseBackend(ServerSettings()), protocol)


def test_what_core_makes_of_the_gguf_chat_backend(gguf_backend: Any) -> None:
    engine = Engine(gguf_backend)
    try:
        assert engine.batch_size == 2
        kv_bytes = engine.metrics.registry.get_sample_value("lmserve_kv_bytes")
        assert kv_bytes == gguf_backend.kv_bytes > 0
        request = _chat("Say hi")
        assert engine._count_prompt(request) == gguf_backend.count_tokens(request)
    finally:
        engine.stop()
    facts = _facts(gguf_backend)
    assert facts["architecture"] == "llama"
    assert facts["model_path"] == str(smollm2_path())
    assert (facts["kv_slots"], facts["kv_bytes"]) == (2, gguf_backend.kv_bytes)
    assert facts["kv_type"] == "f16"
    # the members are there, their values None: no speculation, no cartridge, no fleet
    assert facts["spec"] is facts["cartridge"] is facts["fleet"] is None


def test_what_core_makes_of_the_example_backend() -> None:
    backend = ReverseBackend(ServerSettings(ctx=64))
    engine = Engine(backend)
    try:
        assert engine.batch_size == 1
        # no count_tokens: its tokenize of the prompt's text
        assert engine._count_prompt(_chat("one two three")) == 3
    finally:
        engine.stop()
    facts = _facts(backend, model_path=None)
    assert facts["model_path"] is None and facts["architecture"] is None
    assert facts["kv_slots"] is facts["kv_bytes"] is facts["kv_type"] is None


class _Counting(ReverseBackend):
    """The example with ``count_tokens``, and a batching group without ``batch_size``."""

    def validate(self, request: NormalizedRequest) -> None:
        super().validate(request)
        request.prompt_tokens = None  # core counts them: through count_tokens

    def count_tokens(self, request: NormalizedRequest) -> int:
        return 42

    def begin(self, request: NormalizedRequest, sink: EventSink) -> Any:
        raise AssertionError("not a batching backend: begin is never called")

    def step(self, generations: Any) -> None:
        raise AssertionError("not a batching backend: step is never called")


def test_a_third_party_backend_has_a_capability_by_its_members() -> None:
    backend = _Counting(ServerSettings(ctx=64))
    assert isinstance(backend, CountsTokens)
    assert not isinstance(backend, Batching)  # a group is all of its members or none
    engine = Engine(backend)
    assert engine.batch_size == 1

    async def serve() -> tuple[list[Any], Finish | None]:
        engine.start()
        stream = await engine.submit(_chat("one two three"))
        events = [event async for event in stream]
        return events, stream.finish

    try:
        events, finish = asyncio.run(serve())
    finally:
        engine.stop()
    # the reply as the backend wrote it (a stream may join the pieces a slow reader missed)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "three two one"
    assert finish is not None and finish.reason == "stop"
    assert finish.usage is not None and finish.usage.prompt_tokens == 42


def test_launch_warns_when_a_flag_needs_a_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = BackendSpec("reverse", lambda model, settings: ReverseBackend(settings))
    monkeypatch.setattr(launch, "pick_backend", lambda args: (spec, None))
    args = launch.build_parser().parse_args(["--backend", "reverse", "--batch", "2", "--spec"])
    with capture_logs() as logs:
        built = launch.build(args)
    built.engine.stop()
    assert {"batch_not_supported", "spec_not_supported"} <= {e["event"] for e in logs}


def _chat(text: str) -> NormalizedRequest:
    return NormalizedRequest(id="r", dialect="chat", messages=[Message(role="user", content=text)])


def _facts(backend: Any, model_path: str | None = "") -> dict[str, Any]:
    return banner.facts(
        host="127.0.0.1",
        port=8080,
        backend=backend,
        backend_name="b",
        plugin="p",
        model_path=model_path,
        batch=1,
        decode_precision="int16",
        auth=False,
        chat_page=False,
    )
