"""Every hook a plugin can implement, grouped by when the server calls it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import argparse

    from .backend import Backend, ServerSettings
    from .request import NormalizedRequest

hookspec = pluggy.HookspecMarker("lmserve")
hookimpl = pluggy.HookimplMarker("lmserve")


# ---------------------------------------------------------------- discovery


@hookspec
def register_backends(register: Any) -> None:
    """Register backends: call ``register(name, factory, architectures=..., ...)``."""


@hookspec
def register_converters(register: Any) -> None:
    """Register converters of transformers checkpoints to GGUF (``lmserve convert``): call
    ``register(architecture, convert, description=...)`` with an ``architectures`` entry of a
    ``config.json`` and ``convert(hf_dir: Path, out: Path, outtype: str) -> Path``."""


@hookspec
def register_options(parser: argparse.ArgumentParser) -> None:
    """Add a family's own flags to ``lmserve``'s (in an argument group of its own). Its
    backend gets them as one typed object, ``ServerSettings.options``, made from the parsed
    flags by the ``options`` callable it registers with (``register(..., options=...)``)."""


@hookspec
def register_commands(register: Any) -> None:
    """Add commands to ``lmserve``: call ``register(name, main, help=...)``, where
    ``main(argv: list[str]) -> int`` runs ``lmserve NAME ARGS...`` and returns the exit
    status. Import what a command needs inside ``main``: registering costs nothing."""


# ---------------------------------------------------------------- startup / shutdown


@hookspec
def startup(backend: Backend, settings: ServerSettings) -> None:
    """Called once the backend is loaded, before the server accepts requests."""


@hookspec
def shutdown(backend: Backend) -> None:
    """Called once after the last request drained, before the backend is closed."""


# ---------------------------------------------------------------- per request


@hookspec
def prepare_request(request: NormalizedRequest, backend: Backend) -> None:
    """Adjust a translated request in place before it is validated and queued."""
