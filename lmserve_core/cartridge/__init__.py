"""Cartridges: KV prefixes a model serves behind every conversation (docs/cartridges.md)."""

from .file import (
    FORMAT,
    Cartridge,
    CartridgeError,
    check_geometry,
    read_cartridge,
    write_cartridge,
)

__all__ = [
    "FORMAT",
    "Cartridge",
    "CartridgeError",
    "check_geometry",
    "read_cartridge",
    "write_cartridge",
]
