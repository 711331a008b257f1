"""The plugin contract: hooks are documented and tested, loading is idempotent."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lmserve_core import hookimpl, plugins
from lmserve_core.backend import BackendSpec, ServerSettings

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "docs" / "plugins.md").read_text()
TEST_SOURCES = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))


def hook_names() -> list[str]:
    return sorted(name for name in dir(plugins.pm.hook) if not name.startswith("_"))


@pytest.mark.parametrize("hook", hook_names())
def test_every_hook_has_a_documented_signature(hook: str) -> None:
    spec = getattr(plugins.pm.hook, hook).spec
    args = ", ".join(spec.argnames)
    assert f"### {hook}({args})" in DOCS, f"docs/plugins.md lacks a heading for {hook}({args})"


@pytest.mark.parametrize("hook", hook_names())
def test_every_hook_has_a_test(hook: str) -> None:
    assert re.search(rf"def test_hook_{hook}\b", TEST_SOURCES), f"no test_hook_{hook}"


def test_load_plugins_is_idempotent() -> None:
    plugins.load_plugins()
    before = plugins.pm.list_name_plugin()
    plugins.load_plugins()
    assert plugins.pm.list_name_plugin() == before


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    @hookimpl
    def register_backends(self, register):  # type: ignore[no-untyped-def]
        register("recorder-test", lambda model, settings: None, architectures=("recarch",))

    @hookimpl
    def startup(self, backend, settings) -> None:  # type: ignore[no-untyped-def]
        self.calls.append("startup")

    @hookimpl
    def shutdown(self, backend) -> None:  # type: ignore[no-untyped-def]
        self.calls.append("shutdown")

    @hookimpl
    def prepare_request(self, request, backend) -> None:  # type: ignore[no-untyped-def]
        request.max_tokens = min(request.max_tokens, 3)
        self.calls.append("prepare_request")


def _registered(plugin: Any, name: str) -> Iterator[Any]:
    plugins.pm.register(plugin, name=name)
    yield plugin
    plugins.pm.unregister(plugin)


@pytest.fixture
def recorder() -> Iterator[_Recorder]:
    yield from _registered(_Recorder(), "recorder")


def test_hook_register_backends(recorder: _Recorder) -> None:
    spec = plugins.backends()["recorder-test"]
    assert spec.plugin == "recorder"
    found = plugins.backend_for_architecture("recarch")
    assert found is not None and (found.name, found.plugin) == (spec.name, spec.plugin)


@dataclass(frozen=True)
class _Flags:
    colour: str


class _Extender:
    """A plugin adding a flag (read back typed by its backend) and a command."""

    def __init__(self) -> None:
        self.ran: list[list[str]] = []

    @hookimpl
    def register_options(self, parser):  # type: ignore[no-untyped-def]
        parser.add_argument_group("extender").add_argument("--colour", default="blue")

    @hookimpl
    def register_backends(self, register):  # type: ignore[no-untyped-def]
        register("extender", lambda model, settings: settings,
                 options=lambda args: _Flags(args.colour))

    @hookimpl
    def register_commands(self, register):  # type: ignore[no-untyped-def]
        register("shout", lambda argv: self.ran.append(list(argv)) or 7, help="a test command")
        register("convert", lambda argv: 99)  # taken by core: core's stays


@pytest.fixture
def extender() -> Iterator[_Extender]:
    yield from _registered(_Extender(), "extender")


def test_hook_register_options(extender: _Extender) -> None:
    from lmserve_core import launch

    args = launch.build_parser().parse_args(["m.gguf", "--colour", "red"])
    spec = plugins.backends()["extender"]
    settings = launch.settings_from(launch.build_parser().parse_args(["m.gguf"]), spec)
    assert settings.options == _Flags("blue")
    assert spec.options is not None and spec.options(args) == _Flags("red")
    assert spec.model_option is None


def test_hook_register_commands(extender: _Extender, capsys: pytest.CaptureFixture[str]) -> None:
    from lmserve_core import cli

    assert cli.main(["shout", "a", "--b"]) == 7 and extender.ran == [["a", "--b"]]
    found = plugins.commands()
    assert found["shout"].plugin == "extender" and found["convert"].plugin != "extender"
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "lmserve shout ...  a test command" in out and "lmserve cluster ..." in out


class _Wrapper:
    @hookimpl(wrapper=True)
    def register_backends(self, register):  # type: ignore[no-untyped-def]
        register("wrapper-test", lambda model, settings: None)
        return (yield)


def test_register_backends_goes_through_the_hook_caller(recorder: _Recorder) -> None:
    seen: list[tuple[str, list[str]]] = []
    undo = plugins.pm.add_hookcall_monitoring(
        lambda name, impls, kwargs: seen.append((name, [i.plugin_name for i in impls])),
        lambda outcome, name, impls, kwargs: None,
    )
    wrapper = _Wrapper()
    plugins.pm.register(wrapper, name="wrapper")
    try:
        found = plugins.backends()
    finally:
        plugins.pm.unregister(wrapper)
        undo()
    calls = [impls for name, impls in seen if name == "register_backends"]
    assert len(calls) == 1 and {"recorder", "wrapper"} <= set(calls[0])
    assert found["wrapper-test"].plugin == "wrapper"
    assert found["recorder-test"].plugin == "recorder"


PACKAGE_PLUGIN = """\
from concurrent.futures import ThreadPoolExecutor

from lmserve_core import hookimpl

from .factories import make_backend


@hookimpl
def register_backends(register):
    register("attrib-direct", make_backend)
    with ThreadPoolExecutor(1) as pool:  # off the hook's stack: found by the factory's module
        pool.submit(register, "attrib-thread", make_backend).result()
"""

BORROWING_PLUGIN = """\
from lmserve_attrib_pkg.factories import make_backend

from lmserve_core import hookimpl


@hookimpl
def register_backends(register):
    register("attrib-borrowed", make_backend)
"""


@pytest.fixture
def attributed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, BackendSpec]]:
    """Backends from a plugin package whose factory lives in a sibling submodule, and from a
    plugin that registers that same factory."""
    package = tmp_path / "lmserve_attrib_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "factories.py").write_text("def make_backend(model_path, settings):\n    pass\n")
    (package / "plugin.py").write_text(PACKAGE_PLUGIN)
    (tmp_path / "lmserve_attrib_other.py").write_text(BORROWING_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    names = {"attrib": "lmserve_attrib_pkg.plugin", "other": "lmserve_attrib_other"}
    modules = {name: importlib.import_module(dotted) for name, dotted in names.items()}
    try:
        for name, module in modules.items():
            plugins.pm.register(module, name=name)
        yield plugins.backends()
    finally:
        for module in modules.values():
            if plugins.pm.is_registered(module):
                plugins.pm.unregister(module)
        for dotted in [m for m in sys.modules if m.startswith("lmserve_attrib_")]:
            del sys.modules[dotted]


def test_backend_from_a_plugin_submodule_is_attributed_to_the_plugin(
    attributed: dict[str, BackendSpec],
) -> None:
    direct, threaded = attributed["attrib-direct"], attributed["attrib-thread"]
    assert direct.factory.__module__ == "lmserve_attrib_pkg.factories"
    assert (direct.plugin, threaded.plugin) == ("attrib", "attrib")


def test_backend_is_attributed_to_the_plugin_that_registered_it(
    attributed: dict[str, BackendSpec],
) -> None:
    borrowed = attributed["attrib-borrowed"]
    assert borrowed.factory is attributed["attrib-direct"].factory
    assert borrowed.plugin == "other"


def _scripted_app(recorder: _Recorder):  # type: ignore[no-untyped-def]
    from fake_backend import ScriptedBackend

    from lmserve_core.app import create_app
    from lmserve_core.engine import Engine
    from lmserve_core.server import Server

    settings = ServerSettings()
    engine = Engine(ScriptedBackend(settings))
    return create_app(Server(engine=engine, settings=settings)), engine


def test_hook_startup(recorder: _Recorder) -> None:
    from litestar.testing import TestClient

    app, engine = _scripted_app(recorder)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        assert recorder.calls == ["startup"]
    engine.stop()


def test_hook_shutdown(recorder: _Recorder) -> None:
    from litestar.testing import TestClient

    app, engine = _scripted_app(recorder)
    with TestClient(app):
        pass
    assert recorder.calls[-1] == "shutdown"
    engine.stop()


def test_hook_prepare_request(recorder: _Recorder) -> None:
    from litestar.testing import TestClient

    app, engine = _scripted_app(recorder)
    with TestClient(app) as client:
        reply = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "#tokens:10"}], "max_tokens": 50},
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] == 3
        assert body["choices"][0]["finish_reason"] == "length"
    assert "prepare_request" in recorder.calls
    engine.stop()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env_path = str(ROOT / "tests")
    return subprocess.run(
        [sys.executable, "-m", "lmserve_core", *args], capture_output=True, text=True,
        timeout=120, env={**__import__("os").environ, "PYTHONPATH": env_path},
    )


def test_plugins_command_lists_plugins_and_backends() -> None:
    out = run_cli("plugins", "--plugin", "fake_backend")
    assert out.returncode == 0, out.stderr
    assert "fake_backend" in out.stdout and "register_backends" in out.stdout
    assert "scripted" in out.stdout


def test_help_documents_every_flag() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    for flag in ("--host", "--port", "--ctx", "--api-key", "--queue", "--conns", "--batch",
                 "--threads", "--kv-slots", "--backend", "--plugin", "--decode-precision"):
        assert flag in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "nope"], "unknown backend 'nope'"),
        (["--ctx", "0", "--backend", "scripted"], "--ctx must be at least"),
        (["--spec-draft", "/nonexistent/d.gguf", "--backend", "scripted"],
         "--spec-draft /nonexistent/d.gguf: no such file"),
        (["--cartridge", "/nonexistent/c.safetensors", "--backend", "scripted"],
         "--cartridge /nonexistent/c.safetensors: no such file"),
        (["--kv-cache-dir", "/etc/passwd", "--backend", "scripted"], "--kv-cache-dir /etc/passwd:"),
        (["--backend", "qwen3"], "--backend qwen3: no model given"),
        (["--host", "no-such-host.invalid", "--backend", "scripted"],
         "--host no-such-host.invalid: not an address of this machine"),
        (["--fleet", "/nonexistent/fleet", "--backend", "scripted"], "no fleet.json"),
        (["--fleet", "/tmp", "--cartridge", "/tmp", "--backend", "scripted"],
         "--fleet and --cartridge exclude each other"),
        (["--fleet", "/tmp", "--kv-cache-dir", "/tmp", "--backend", "scripted"],
         "--fleet and --kv-cache-dir exclude each other"),
        (["--rag-docs", "2", "--backend", "scripted"], "--rag-docs go with --fleet"),
        (["--fleet", "/tmp", "--rag-docs", "0", "--backend", "scripted"], "--rag-docs must be"),
        (["--kv-disk-slots", "0", "--backend", "scripted"], "--kv-disk-slots must be"),
        (["/nonexistent/model.gguf"], "model file not found"),
        (["--decode-precision", "int8", "--backend", "scripted"], "invalid choice: 'int8'"),
    ],
)
def test_cli_refuses_bad_arguments_clearly(args: list[str], message: str) -> None:
    out = run_cli("--plugin", "fake_backend", *args)
    assert out.returncode == 2
    assert message in out.stderr


def test_a_taken_port_is_one_line_before_the_model_loads() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # a model that would take long to load is never loaded: the port is checked first
        out = run_cli("--plugin", "fake_backend", "--backend", "scripted", "--port", str(port))
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"lmserve: error: --port {port}: already in use on 127.0.0.1 (another server? pick "
        "another with --port)"
    )


def test_malformed_model_file_is_a_clear_error_not_a_crash(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1 << 60).to_bytes(8, "little") * 2)
    out = run_cli(str(bad))
    assert out.returncode == 2
    assert "broken.gguf" in out.stderr and "impossible" in out.stderr


def test_a_fresh_process_parses_the_families_flags() -> None:
    """A cluster's replica parses lmserve's flags first thing: the plugins' own are there."""
    code = (
        "from lmserve_core.launch import build_parser; "
        "a = build_parser().parse_args(['--nanochat', 'run', '--step', '2']); "
        "print(a.nanochat, a.step)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["run", "2"], done.stderr
