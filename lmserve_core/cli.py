"""The ``lmserve`` command: serves a model (:func:`serve`), or runs a command a plugin
registered (``register_commands``; core's own are in :mod:`lmserve_core.commands`)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence

import structlog

from . import commands as core_commands
from . import logs, plugins
from .launch import UsageError, build, build_parser

log = structlog.get_logger("lmserve")

_EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def check_address(host: str, port: int) -> None:
    """Fail before the model loads when ``host:port`` cannot be listened on (a taken port,
    a host that is no address of this machine): the error names the flag."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # as uvicorn binds: a port left in TIME_WAIT by a previous server is free
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(
                    f"--port {port}: already in use on {host} (another server? pick another "
                    "with --port)"
                ) from None
            raise UsageError(f"--host {host} --port {port}: cannot listen: {exc.strerror}") from None


def serve(args: argparse.Namespace) -> int:
    import gc

    import uvicorn

    from . import banner

    check_address(args.host, args.port)  # before the model loads
    built = build(args)
    spec, model, backend, engine, app = (
        built.spec, built.model, built.backend, built.engine, built.app
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        # uvicorn counts the arriving connection itself against its limit.
        limit_concurrency=args.conns + 1,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_keep_alive=30,
        timeout_graceful_shutdown=10,
    )

    def announce() -> None:
        """The banner once the server listens: a ``serving`` event, or a block of lines."""
        facts = banner.facts(
            host=args.host,
            port=args.port,
            backend=backend,
            backend_name=spec.name,
            plugin=spec.plugin,
            model_path=model,
            batch=engine.batch_size,
            decode_precision=args.decode_precision,
            prefill_precision=args.prefill_precision,
            auth=bool(args.api_key),
            chat_page=args.webui,
        )
        out = logs.output()
        if out.json:
            log.info("serving", **facts)
        else:
            print(banner.render(facts, colors=out.colors), file=out.stream, flush=True)

    class _Uvicorn(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:  # listening: no request has been answered yet
                announce()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # Our own handlers: uvicorn's re-raise the signal after the drain, which
            # would make a clean shutdown exit with a signal status instead of 0.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in _EXIT_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: object) -> None:
            # Cancel queued and running generations first, so open streams end now and
            # the graceful shutdown only has to drain them. A second SIGINT forces exit.
            engine.begin_shutdown()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    # What is loaded now lives as long as the server: keep it out of the collector's full
    # passes, which would otherwise walk it whenever one runs (~30 ms with SmolLM2's
    # vocabulary and the app, holding the GIL: a stall in every stream running then).
    gc.collect()
    gc.freeze()
    try:
        _Uvicorn(config).run()
    finally:
        engine.stop()
        backend.close()
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not plugins.pm.has_plugin(plugins.CORE_COMMANDS):
        plugins.pm.register(core_commands, name=plugins.CORE_COMMANDS)
    commands = plugins.commands()
    if argv[:1] and argv[0] in commands:
        return commands[argv[0]].main(argv[1:])
    # --plugin modules first: their flags (register_options) are part of the parser
    early, _ = _plugin_parser().parse_known_args(argv)
    try:
        for module in early.plugin:
            plugins.load_module_plugin(module)
    except ImportError as exc:
        print(f"lmserve: error: --plugin: {exc}", file=sys.stderr)
        return 2
    args = build_parser(commands).parse_args(argv)
    logs.configure(args.log_level, log_format=args.log_format)
    try:
        return serve(args)
    except UsageError as exc:
        print(f"lmserve: error: {exc}", file=logs.output().stream)  # clears a progress bar
        return 2


def _plugin_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--plugin", action="append", default=[])
    return p
