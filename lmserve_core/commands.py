"""``lmserve``'s own commands, registered through ``register_commands`` as a plugin's are:
``plugins``, ``convert``, ``cartridge`` and ``cluster``. Each imports what it needs when it
runs (``cluster`` needs Ray, the optional ``ray`` extra, only to run)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import logs, plugins
from .hookspecs import hookimpl
from .launch import UsageError


@hookimpl
def register_commands(register: Any) -> None:
    register("plugins", plugins_command, help="list the installed plugins and backends")
    register("convert", convert_command,
             help="convert a transformers checkpoint to the GGUF its family serves")
    register("cartridge", cartridge_command, help="build KV-prefix cartridges and fleets")
    register("cluster", cluster_command, help="serve replicas on Ray Serve behind one ingress")


def plugins_command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmserve plugins", description="list plugins")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE")
    args = parser.parse_args(argv)
    logs.configure("warning")
    for module in args.plugin:
        plugins.load_module_plugin(module)
    return list_plugins()


def cartridge_command(argv: Sequence[str]) -> int:
    from .cartridge.cli import main

    return main(argv)


def cluster_command(argv: Sequence[str]) -> int:
    from .cluster.command import main

    return main(argv)


def list_plugins() -> int:
    specs = plugins.backends()
    infos = plugins.list_plugins()
    print("plugins:")
    for info in infos:
        version = f" {info.version}" if info.version else ""
        print(f"  {info.name}{version}  hooks: {', '.join(info.hooks) or '-'}")
    print("backends:")
    for spec in sorted(specs.values(), key=lambda s: s.name):
        arch = ", ".join(spec.architectures) or "-"
        default = spec.default_model() if spec.default_model else None
        print(f"  {spec.name}  architectures: {arch}  plugin: {spec.plugin}")
        if spec.description:
            print(f"      {spec.description}")
        if default:
            print(f"      default model: {default}")
    return 0


OUTTYPES = ("f32", "f16", "bf16", "q8_0")


def convert_command(argv: Sequence[str]) -> int:
    """``lmserve convert HF_DIR OUT.gguf``: a transformers checkpoint of an architecture that
    an installed plugin converts, written as the GGUF its family serves."""
    parser = argparse.ArgumentParser(
        prog="lmserve convert",
        description="Convert a transformers checkpoint (config.json + safetensors) to the GGUF "
        "layout its lmserve family serves, for architectures llama.cpp's converter does not "
        "know. `lmserve convert --list` names them.",
    )
    parser.add_argument("hf_dir", nargs="?", help="the checkpoint's directory")
    parser.add_argument("out", nargs="?", help="the GGUF file to write")
    parser.add_argument("--outtype", choices=OUTTYPES, default="f16",
                        help="type of the matrices (default f16; norms and vectors stay f32)")
    parser.add_argument("--list", action="store_true", help="the architectures installed")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE")
    args = parser.parse_args(argv)
    for module in args.plugin:
        plugins.load_module_plugin(module)
    found = plugins.converters()
    if args.list:
        for entry in sorted(found.values(), key=lambda s: s.architecture):
            print(f"{entry.architecture}  plugin: {entry.plugin}  {entry.description}".rstrip())
        return 0
    if not args.hf_dir or not args.out:
        parser.error("HF_DIR and OUT are required")
    try:
        architecture = _hf_architecture(Path(args.hf_dir))
        spec = found.get(architecture)
        if spec is None:
            known = ", ".join(sorted(found)) or "none installed"
            raise UsageError(
                f"no installed plugin converts {architecture} (converters: {known}); "
                "llama.cpp's convert_hf_to_gguf.py converts the architectures it knows"
            )
        if Path(args.out).is_dir():
            raise UsageError(f"{args.out} is a directory: give the GGUF file's path")
        written = spec.convert(Path(args.hf_dir), Path(args.out), args.outtype)
    except ImportError as exc:  # a converter's optional dependency (its plugin's extra)
        why = str(exc) if "pip install" in str(exc) else (
            f"the {architecture} converter needs {exc.name or exc}, which is not installed "
            "(its plugin's documentation names the extra that brings it)"
        )
        print(f"lmserve convert: error: {why}", file=sys.stderr)
        return 2
    except UsageError as exc:
        print(f"lmserve convert: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"lmserve convert: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {written}")
    return 0


def _hf_architecture(hf_dir: Path) -> str:
    config = hf_dir / "config.json"
    if not config.is_file():
        raise UsageError(f"{hf_dir}: no config.json (a transformers checkpoint directory)")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{config}: not readable JSON: {exc}") from None
    archs = data.get("architectures") if isinstance(data, dict) else None
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise UsageError(f"{config}: no architectures list")
    return archs[0]


