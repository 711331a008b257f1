"""Plugin loading and the backend registry.

Plugins are found through the ``lmserve`` entry-point group. ``LMSERVE_PLUGINS`` (a
comma-separated list of entry-point names) restricts which ones load;
``LMSERVE_TRACE_HOOKS=1`` logs every hook call.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from types import CodeType, FrameType, ModuleType
from typing import Any, TypeVar

import pluggy
import structlog

from . import hookspecs
from .backend import BackendFactory, BackendSpec

log = structlog.get_logger("lmserve.plugins")

ENTRY_POINT_GROUP = "lmserve"

_T = TypeVar("_T")

pm = pluggy.PluginManager("lmserve")
pm.add_hookspecs(hookspecs)

_lock = threading.Lock()
_loaded = False


@dataclass(frozen=True, slots=True)
class PluginInfo:
    name: str
    version: str | None
    hooks: tuple[str, ...]


def load_plugins() -> None:
    """Load every installed plugin once; later calls do nothing."""
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True
        allowed = _allowed_names()
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allowed is not None and ep.name not in allowed:
                continue
            if pm.has_plugin(ep.name):
                continue
            try:
                module = ep.load()
            except Exception as exc:  # a broken plugin must not take the server down
                log.warning("plugin_load_failed", plugin=ep.name, error=str(exc))
                continue
            pm.register(module, name=ep.name)
            _versions[ep.name] = ep.dist.version if ep.dist else None
        if os.environ.get("LMSERVE_TRACE_HOOKS"):
            pm.trace.root.setwriter(lambda msg: log.info("hook", trace=msg.rstrip()))
            pm.enable_tracing()


_versions: dict[str, str | None] = {}


def _allowed_names() -> set[str] | None:
    raw = os.environ.get("LMSERVE_PLUGINS")
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def load_module_plugin(dotted: str) -> ModuleType:
    """Register a module by import path as a plugin (``lmserve --plugin mod``)."""
    module = importlib.import_module(dotted)
    if not pm.is_registered(module):
        pm.register(module, name=dotted)
    return module


def list_plugins() -> list[PluginInfo]:
    """What is registered: name, version and implemented hooks (core's own commands are
    not a plugin)."""
    infos = []
    for name, plugin in pm.list_name_plugin():
        if name == CORE_COMMANDS:
            continue
        hooks = tuple(sorted(h.name for h in pm.get_hookcallers(plugin) or ()))
        infos.append(PluginInfo(name=name, version=_versions.get(name), hooks=hooks))
    return sorted(infos, key=lambda info: info.name)


#: the name core's own commands (``lmserve_core.commands``) are registered under
CORE_COMMANDS = "lmserve-core-commands"


@dataclass(frozen=True, slots=True)
class CommandSpec:
    """A command of ``lmserve`` (``lmserve NAME ARGS...``), as ``register_commands`` gave it."""

    name: str
    main: Callable[[list[str]], int]
    help: str
    plugin: str


def commands() -> dict[str, CommandSpec]:
    """Every command registered through ``register_commands``, by name: core's own
    (:data:`CORE_COMMANDS`) first, then the first registration of a name wins."""
    load_plugins()
    return _registrations(
        "register_commands", "command", first=CORE_COMMANDS,
        make=lambda name, main, plugin, help="": CommandSpec(name, main, help, plugin),
    )


def _registrations(hook: str, what: str, make: Callable[..., _T], first: str = "") -> dict[str, _T]:
    """What each plugin's ``hook`` registers, by key: ``register(key, fn, **kwargs)`` makes
    ``make(key, fn, plugin, **kwargs)``; the first registration of a key wins (plugin
    ``first``'s before the others')."""
    found: dict[str, _T] = {}
    impls = getattr(pm.hook, hook).get_hookimpls()  # in registration order
    for impl in sorted(impls, key=lambda impl: impl.plugin_name != first):

        def register(key: str, fn: Callable[..., Any], _plugin: str = impl.plugin_name,
                     **kwargs: Any) -> None:
            if key in found:
                log.warning(f"{what}_taken", **{what: key}, plugin=_plugin)
                return
            found[key] = make(key, fn, _plugin, **kwargs)

        impl.function(register=register)
    return found


def backends() -> dict[str, BackendSpec]:
    """Every backend registered through ``register_backends``, by name."""
    load_plugins()
    found: dict[str, BackendSpec] = {}
    callers = _register_backends_callers()

    def register(
        name: str,
        factory: BackendFactory,
        *,
        architectures: tuple[str, ...] | list[str] = (),
        description: str = "",
        default_model: Callable[[], str | None] | None = None,
        recognizes: Callable[[str], bool] | None = None,
        options: Callable[[Any], object] | None = None,
        model_option: str | None = None,
    ) -> None:
        plugin_name = _registering_plugin(callers, sys._getframe(1)) or _plugin_owning(factory)
        if name in found:
            log.warning("backend_name_taken", backend=name, plugin=plugin_name)
            return
        found[name] = BackendSpec(
            name=name,
            factory=factory,
            architectures=tuple(architectures),
            description=description,
            default_model=default_model,
            plugin=plugin_name,
            recognizes=recognizes,
            options=options,
            model_option=model_option,
        )

    pm.hook.register_backends(register=register)
    return found


def _register_backends_callers() -> dict[CodeType, list[tuple[object, str]]]:
    # each hook's code, and the object it is bound to (a family's hook is one method of
    # lmserve_core.kit.Family, bound to each plugin's own family)
    callers: dict[CodeType, list[tuple[object, str]]] = {}
    for impl in pm.hook.register_backends.get_hookimpls():
        function = inspect.unwrap(impl.function)
        code = getattr(function, "__code__", None)
        if code is not None:
            bound = getattr(impl.function, "__self__", None)
            callers.setdefault(code, []).append((bound, impl.plugin_name))
    return callers


def _registering_plugin(
    callers: dict[CodeType, list[tuple[object, str]]], frame: FrameType | None
) -> str:
    # The hookimpl that called register (maybe through helpers) is on the stack.
    while frame is not None:
        for bound, name in callers.get(frame.f_code, ()):
            if bound is None or frame.f_locals.get("self") is bound:
                return name
        frame = frame.f_back
    return ""


def _plugin_owning(factory: BackendFactory) -> str:
    # The registered plugin whose module or package defines the factory; the innermost wins.
    while isinstance(factory, functools.partial):
        factory = factory.func
    module = getattr(inspect.unwrap(factory), "__module__", None)
    if not module:
        return ""
    homes = {name: _home_package(plugin) for name, plugin in pm.list_name_plugin()}
    owners = [
        (len(home), name)
        for name, home in homes.items()
        if home and (module == home or module.startswith(f"{home}."))
    ]
    return max(owners, default=(0, ""))[1]


def _home_package(plugin: object) -> str:
    # A plugin module's package (the module itself when top-level) holds its other modules.
    if isinstance(plugin, ModuleType):
        name = plugin.__name__
    else:
        name = getattr(plugin, "__module__", None) or ""  # a class or an instance
    module = sys.modules.get(name)
    if module is None or hasattr(module, "__path__"):
        return name
    return module.__package__ or name


def backend_for_architecture(architecture: str) -> BackendSpec | None:
    """The backend whose registration claims this GGUF ``general.architecture``."""
    for spec in backends().values():
        if architecture in spec.architectures:
            return spec
    return None


@dataclass(frozen=True, slots=True)
class ConverterSpec:
    """A converter of transformers checkpoints of one architecture to a GGUF file."""

    architecture: str  # an ``architectures`` entry of a config.json
    convert: Callable[..., Any]  # convert(hf_dir: Path, out: Path, outtype: str) -> Path
    description: str
    plugin: str


def converters() -> dict[str, ConverterSpec]:
    """Every converter registered through ``register_converters``, by architecture."""
    load_plugins()
    return _registrations(
        "register_converters", "converter",
        make=lambda arch, convert, plugin, description="": ConverterSpec(
            arch, convert, description, plugin
        ),
    )


def backend_for_path(path: str) -> BackendSpec | None:
    """The backend that recognises ``path`` as a model of its own that is not a GGUF file (a
    checkpoint directory); None when none does."""
    for spec in backends().values():
        if spec.recognizes is None:
            continue
        try:
            if spec.recognizes(path):
                return spec
        except Exception as exc:  # a plugin's check must not stop the others'
            log.warning("recognizes_failed", backend=spec.name, path=path, error=str(exc))
    return None


def call_hook(name: str, **kwargs: Any) -> list[Any]:
    return list(getattr(pm.hook, name)(**kwargs))
