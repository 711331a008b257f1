"""What the server says once it listens: where it is, what it serves, how to reach it.

:func:`facts` gathers it as the fields of the ``serving`` log event (the JSON format);
:func:`render` writes them as a block of readable lines (a terminal, the console format).
"""

from __future__ import annotations

from typing import Any

from . import __version__
from .app import ENDPOINTS
from .backend import HasModel, HasSlots, ServesPrefixes, Speculates
from .native.kernels import kernels_name
from .progress import byte_unit

# Bind addresses meaning every interface, and the address this machine reaches them at.
_ALL_INTERFACES = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def facts(
    *,
    host: str,
    port: int,
    backend: Any,
    backend_name: str,
    plugin: str,
    model_path: str | None,
    batch: int,
    decode_precision: str,
    auth: bool,
    chat_page: bool,
    prefill_precision: str = "int16",
) -> dict[str, Any]:
    """The fields of the ``serving`` event: the URL (``all_interfaces`` when the address
    binds every interface; ``local_url`` is where this machine reaches it), the model's id,
    file, backend, plugin and architecture, the context, the KV slots and the bytes they
    take at full context, the kernels' instruction-set path, the cartridge and the fleet (None
    without one), the chat page (None without one), the OpenAI and Anthropic base URLs and the
    API's endpoints."""
    everywhere = host in _ALL_INTERFACES
    local = _url(_ALL_INTERFACES[host], port) if everywhere else _url(host, port)
    gguf = backend.gguf if isinstance(backend, HasModel) else None
    model = backend.model if isinstance(backend, HasModel) else None
    prefixes = backend if isinstance(backend, ServesPrefixes) else None
    prefix = None if prefixes is None else prefixes.prefix
    fleet = None if prefixes is None else prefixes.fleet
    slots = backend if isinstance(backend, HasSlots) else None
    drafts = backend.drafts if isinstance(backend, Speculates) else None
    return {
        "version": __version__,
        "url": _url(host, port),
        "all_interfaces": everywhere,
        "local_url": local,
        "model": backend.model_id,
        "model_path": str((gguf and gguf.path) or model_path or "") or None,
        "backend": backend_name,
        "plugin": plugin or None,
        "architecture": None if gguf is None else gguf.architecture,
        "ctx": backend.context_length,
        "kv_slots": None if slots is None else slots.kv_slots,
        "kv_bytes": None if slots is None else slots.kv_bytes,
        # optional on a ForwardModel (the kit's models have it)
        "kv_type": getattr(model, "kv_type", None),
        "decode_precision": decode_precision,
        "prefill_precision": prefill_precision,
        "kernels": kernels_name(),
        "batch": batch,
        "spec": None if drafts is None else drafts.name,
        # --cartridge: the KV prefix every conversation starts behind
        "cartridge": None if prefix is None else {"path": prefix.source, "rows": prefix.p},
        # --fleet: the documents conversations are served behind
        "fleet": None if fleet is None else {
            "path": str(fleet.fleet.path), "documents": len(fleet.fleet.docs),
            "rag_docs": fleet.k, "rows": fleet.rows, "adaptive": fleet.adaptive,
        },
        "auth": auth,
        "webui": chat_page,
        "chat_url": local + "/" if chat_page else None,
        "openai_base_url": local + "/v1",
        "anthropic_base_url": local,
        "endpoints": {api: list(paths) for api, paths in ENDPOINTS.items()},
    }


def render(f: dict[str, Any], *, colors: bool = False) -> str:
    """The ``serving`` event's fields as a block of lines for a person."""

    def paint(code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if colors else text

    def link(url: str) -> str:
        return paint("36", url)

    rows: list[tuple[str, str]] = []
    where = link(f["url"])
    if f["all_interfaces"]:
        where += f"  (all interfaces; from this machine {link(f['local_url'])})"
    rows.append(("listening", where))
    rows.append(("model", paint("1", f["model"])))
    if f["model_path"]:
        rows.append(("", f["model_path"]))
    about = ", ".join(
        f"{what} {value}"
        for what, value in (("plugin", f["plugin"]), ("architecture", f["architecture"]))
        if value
    )
    rows.append(("backend", f["backend"] + (f"  ({about})" if about else "")))
    speed = f"batch {f['batch']}, {f.get('kernels', 'portable')} kernels, decode {f['decode_precision']}"
    if f.get("prefill_precision", "int16") != "int16":
        speed += f", prefill {f['prefill_precision']}"
    if f["spec"]:
        speed += f", speculative ({f['spec']})"
    rows.append(("context", f"{f['ctx']} tokens; {speed}"))
    if f["kv_slots"] is not None:
        kv = f"{f['kv_slots']} slot{'s' if f['kv_slots'] != 1 else ''}"
        if f["kv_bytes"] is not None:
            scale, unit = byte_unit(f["kv_bytes"])
            kv += f", {f['kv_bytes'] / scale:.1f} {unit}"
            kv += f" {f['kv_type']}" if f["kv_type"] else ""
            kv += " at full context"
        rows.append(("KV cache", kv))
    if f.get("cartridge"):
        rows.append(("cartridge", f"{f['cartridge']['path']}  ({f['cartridge']['rows']} rows)"))
    if f.get("fleet"):
        fl = f["fleet"]
        rows.append(("fleet", f"{fl['path']}  ({fl['documents']} documents, {fl['rag_docs']} a "
                     f"conversation, {fl['rows']} rows{', adaptive' if fl['adaptive'] else ''})"))
    if f["chat_url"]:
        rows.append(("chat page", link(f["chat_url"])))
    endpoints = f["endpoints"]
    rows.append(("OpenAI", "base URL " + link(f["openai_base_url"])))
    rows.append(("", _endpoints(endpoints["openai"])))
    rows.append(("Anthropic", "base URL " + link(f["anthropic_base_url"])))
    rows.append(("", _endpoints(endpoints["anthropic"])))
    rows.append(("server", _endpoints(endpoints["server"])))
    if f["auth"]:
        rows.append(
            ("API key", "required: Authorization: Bearer <key>, or x-api-key (not on /health)")
        )
    else:
        rows.append(("API key", "none (--api-key or $LMSERVE_API_KEY sets one)"))
    title = paint("1", f"lmserve {f['version']} is ready")
    width = max(len(label) for label, _ in rows)
    lines = [f"  {paint('2', label.ljust(width))}  {value}" for label, value in rows]
    return "\n".join(["", title, *lines, ""])


def _endpoints(items: list[str]) -> str:
    """ "POST /a, /b; GET /c" from ["POST /a", "POST /b", "GET /c"]."""
    groups: list[tuple[str, list[str]]] = []
    for item in items:
        method, path = item.split(" ", 1)
        if groups and groups[-1][0] == method:
            groups[-1][1].append(path)
        else:
            groups.append((method, [path]))
    return "; ".join(f"{method} {', '.join(paths)}" for method, paths in groups)
