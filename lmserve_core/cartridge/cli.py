"""``lmserve cartridge``: making cartridges (``build``)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .file import CartridgeError, write_cartridge


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmserve cartridge",
        description="Make KV-prefix cartridges that `lmserve --cartridge FILE` serves "
        "(docs/cartridges.md).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    b = sub.add_parser(
        "build",
        help="a cartridge of a document",
        description="Write the cartridge of a document: with --init prefill, the model's own "
        "keys and values for the document's first p tokens (no training; served, it equals "
        "the document read at the start of the prompt); with --train, those rows trained by "
        "self-study.",
    )
    b.add_argument("corpus", help="the document: a UTF-8 text file")
    b.add_argument("out", help="the cartridge to write (.safetensors)")
    b.add_argument(
        "--p", type=int, default=None,
        help="rows of the prefix: the document's first p tokens (default: the whole document)",
    )
    b.add_argument(
        "--init", choices=["prefill"], default="prefill",
        help="how the rows start: prefill, the model's own rows for the document's first p "
        "tokens (default, and the only one)",
    )
    b.add_argument(
        "--train", action="store_true",
        help="train the rows by self-study after the prefill init (needs the train extra: "
        "pip install 'lmserve-core[train]')",
    )
    b.add_argument(
        "--model", help="the GGUF model (default: the model an installed plugin ships)"
    )
    b.add_argument("--backend", help="backend name (default: chosen by the GGUF's architecture)")
    b.add_argument(
        "--kv-type", choices=["f16", "f32"], default="f16",
        help="the KV cache the rows are computed in: the --kv-type of the servers that will "
        "serve the cartridge makes them equal to the document in the prompt (default f16)",
    )
    b.add_argument("--threads", type=int, default=0, help="compute threads (default: all cores)")
    b.add_argument("--plugin", action="append", default=[], metavar="MODULE")
    from .fleet_build import add_fleet_parser
    from .train import add_train_arguments

    add_train_arguments(b)
    add_fleet_parser(sub)
    return parser


def whole_document(args: argparse.Namespace) -> int:
    """The token count of ``args.corpus`` as a cartridge reads it (``--p`` left out)."""
    from ..launch import load_backend
    from .prefill import document_tokens

    text = Path(args.corpus).read_text(encoding="utf-8")
    backend = load_backend(args, 16)
    try:
        return len(document_tokens(backend.tokenizer, text))
    finally:
        backend.close()


def build_command(args: argparse.Namespace) -> int:
    from .prefill import document_tokens, model_metadata, prefill_cartridge

    if args.train:
        if args.p is None:
            args.p = whole_document(args)
        # self-study lives in lmserve_core.cartridge.train, on the train extra's libraries
        if importlib.util.find_spec("lmserve_core.cartridge.train") is None:
            raise CartridgeError(
                "--train: self-study training is not in this installation (it needs the "
                "train extra: pip install 'lmserve-core[train]')"
            )
        train = importlib.import_module("lmserve_core.cartridge.train")
        return int(train.build_command(args))
    if args.p is not None and args.p < 2:
        raise CartridgeError(f"--p must be at least 2, got {args.p}")
    text = Path(args.corpus).read_text(encoding="utf-8")
    from ..launch import load_backend

    # without --p, the whole document: its length is known once its model's tokenizer is
    backend = load_backend(args, args.p or 16)
    try:
        started = time.perf_counter()
        if args.p is None:
            args.p = len(document_tokens(backend.tokenizer, text))
        meta = model_metadata(backend.gguf)
        meta["corpus"] = Path(args.corpus).name
        meta["kv_type"] = args.kv_type
        cartridge = prefill_cartridge(backend.model, backend.tokenizer, text, args.p, meta)
        write_cartridge(args.out, cartridge)
    finally:
        backend.close()
    took = time.perf_counter() - started
    print(
        f"wrote {args.out}: p = {cartridge.p} rows x {cartridge.n_layer} layers, "
        f"{cartridge.nbytes / 2**20:.1f} MiB, init prefill ({args.kv_type} rows), {took:.1f} s"
    )
    return 0


def main(argv: Sequence[str]) -> int:
    """``lmserve cartridge ...``; the exit status."""
    from .. import logs
    from ..launch import UsageError

    args = build_parser().parse_args(argv)
    logs.configure("warning")
    try:
        if args.command == "fleet":
            from .fleet_build import fleet_command

            return fleet_command(args)
        return build_command(args)
    except UsageError as exc:
        print(f"lmserve cartridge: error: {exc}", file=sys.stderr)
        return 2
    except (CartridgeError, OSError, ValueError) as exc:
        print(f"lmserve cartridge: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, CartridgeError) else 1
