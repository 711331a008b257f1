"""Calling a plugin's hooks directly, without the plugin manager (for a plugin's own tests)."""

from __future__ import annotations

from types import ModuleType
from typing import Any


def registrations(plugin: ModuleType) -> list[dict[str, Any]]:
    """What ``plugin.register_backends`` registers: one dict per call, ``name`` and
    ``factory`` plus the keyword arguments."""
    calls: list[dict[str, Any]] = []

    def register(name: str, factory: Any, **kwargs: Any) -> None:
        calls.append({"name": name, "factory": factory, **kwargs})

    plugin.register_backends(register)
    return calls
