"""The Litestar application: routes, auth, error envelopes, lifespan."""

from __future__ import annotations

import hmac
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import structlog
from litestar import Litestar, MediaType, Request, Response, get
from litestar.config.cors import CORSConfig
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import Provide
from litestar.exceptions import HTTPException, ValidationException
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.types import ControllerRouterHandler

from . import __version__
from .backend import HasFamily
from .errors import LmserveError, NotFound, QueueFull, Unauthorized
from .metrics import CONTENT_TYPE, dialect_of
from .plugins import pm
from .server import Server, ServerDep
from .webui import routes as webui_routes
from .wire_errors import error_body

log = structlog.get_logger("lmserve.http")

DEFAULT_MAX_BODY = 32 * 1024 * 1024


def _presented_key(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    auth = connection.headers.get("authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return connection.headers.get("x-api-key")


def make_auth_guard(api_key: str | None) -> Any:
    expected = api_key.encode() if api_key else None

    def auth_guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
        if expected is None or handler.opt.get("public"):
            return
        presented = _presented_key(connection)
        if presented is None or not hmac.compare_digest(presented.encode(), expected):
            raise Unauthorized("invalid or missing API key (Authorization: Bearer or x-api-key)")

    return auth_guard


def _error_response(request: Request[Any, Any, Any], status: int, message: str, **kw: Any) -> Response[Any]:
    headers = {}
    if status == 429:
        headers["retry-after"] = str(kw.pop("retry_after", 1))
    kw.pop("retry_after", None)
    anthropic_client = "anthropic-version" in request.headers
    return Response(
        content=error_body(
            request.url.path, status, message, anthropic_client=anthropic_client, **kw
        ),
        status_code=status,
        media_type=MediaType.JSON,
        headers=headers,
    )


def _count_refusal(request: Request[Any, Any, Any], status: int) -> None:
    metrics = request.app.state.get("metrics")
    if metrics is not None:
        metrics.request(dialect_of(request.url.path), status)


def handle_lmserve_error(request: Request[Any, Any, Any], exc: LmserveError) -> Response[Any]:
    _count_refusal(request, exc.status)
    extra: dict[str, Any] = {}
    if isinstance(exc, QueueFull):
        extra["retry_after"] = exc.retry_after
    log.info("request_rejected", path=request.url.path, status=exc.status, error=exc.message)
    return _error_response(
        request, exc.status, exc.message, param=exc.param, code=exc.code,
        kind=exc.kind if exc.status < 500 else None, **extra,
    )


def handle_validation_error(request: Request[Any, Any, Any], exc: ValidationException) -> Response[Any]:
    message = exc.detail or "invalid request body"
    param = None
    extra = exc.extra
    if isinstance(extra, list) and extra and isinstance(extra[0], dict):
        first = extra[0]
        detail = str(first.get("message") or "")
        key = first.get("key")
        missing = re.search(r"missing required field `([^`]+)`", detail)
        if missing:
            param = missing.group(1)
        elif key and key != "data":
            param = str(key)
        if detail:
            where = f" at '{param}'" if param and not missing else ""
            message = f"invalid request body{where}: {detail}"
    log.info("request_rejected", path=request.url.path, status=400, error=message)
    _count_refusal(request, 400)
    return _error_response(request, 400, message, param=param, code="invalid_request")


def handle_http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    status = exc.status_code
    message = exc.detail or "error"
    if status == 413:
        message = "request body too large"
    _count_refusal(request, status)
    return _error_response(request, status, message)


def handle_too_deep(request: Request[Any, Any, Any], exc: RecursionError) -> Response[Any]:
    # msgspec refuses JSON nested deeper than it recurses: the body is at fault, not us
    message = "the request body is nested too deeply"
    log.info("request_rejected", path=request.url.path, status=400, error=message)
    _count_refusal(request, 400)
    return _error_response(request, 400, message, code="invalid_request")


def handle_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    log.exception("unhandled_error", path=request.url.path)
    _count_refusal(request, 500)
    return _error_response(request, 500, f"internal error: {type(exc).__name__}")


@get("/metrics", sync_to_thread=False, media_type=CONTENT_TYPE)
def metrics(server: ServerDep) -> Response[bytes]:
    """Prometheus metrics (text format): requests, tokens, latencies, queue, KV slots."""
    return Response(server.engine.metrics.render(), media_type=CONTENT_TYPE)


@get(["/health", "/v1/health"], opt={"public": True}, include_in_schema=True, sync_to_thread=False)
def health(server: ServerDep) -> Response[dict[str, Any]]:
    """Liveness and readiness: 200 while serving, 503 while shutting down."""
    engine = server.engine
    if not engine.accepting:
        return Response({"status": "shutting_down"}, status_code=503)
    return Response(
        {"status": "ok", "model": server.model_id, "queued": engine.queued, "busy": engine.busy}
    )


@get(["/v1/models", "/models"], sync_to_thread=False)
def list_models(server: ServerDep) -> dict[str, Any]:
    """The one loaded model, in a shape both OpenAI and Anthropic clients read."""
    return {
        "object": "list",
        "data": [model_object(server)],
        "has_more": False,
        "first_id": server.model_id,
        "last_id": server.model_id,
    }


@get(["/v1/models/{model_id:path}", "/models/{model_id:path}"], sync_to_thread=False)
def retrieve_model(model_id: str, server: ServerDep) -> dict[str, Any]:
    """The loaded model by its id (OpenAI's and Anthropic's retrieve), in the shape of
    :func:`list_models`' entries; any other id is a 404 naming it."""
    wanted = model_id.lstrip("/")  # an id may hold slashes (--model-id org/name)
    if wanted != server.model_id:
        raise NotFound(
            f"The model '{wanted}' does not exist; this server serves '{server.model_id}'",
            param="model",
            code="model_not_found",
        )
    return model_object(server)


def model_object(server: Server) -> dict[str, Any]:
    """The served model with the fields of both APIs' model objects: OpenAI's (``id``,
    ``object``, ``created``, ``owned_by``), Anthropic's (``type``, ``display_name``,
    ``created_at``, ``lifecycle``, ``max_input_tokens``, ``max_tokens``), and lmserve's
    ``meta``."""
    return {
        "id": server.model_id,
        "object": "model",
        "created": server.created,
        "owned_by": "lmserve",
        "type": "model",
        "display_name": server.model_id,
        "created_at": _rfc3339(server.created),
        "lifecycle": "active",
        "max_input_tokens": server.ctx,
        "max_tokens": server.ctx,
        "meta": model_meta(server),
    }


def model_meta(server: Server) -> dict[str, Any]:
    """What a client may want to know of the served model beyond its id (docs/webui.md)."""
    from .native.kernels import kernels_name

    backend = server.backend
    caps = backend.capabilities
    return {
        "backend": backend.name,
        "family": (backend.family if isinstance(backend, HasFamily) else None) or backend.name,
        "n_ctx": server.ctx,
        "kernels": kernels_name(),
        "capabilities": {
            "reasoning": caps.reasoning,
            "tools": caps.tool_style,
            "grammar": caps.grammar,
        },
        **embedding_meta(server),
    }


def embedding_meta(server: Server) -> dict[str, Any]:
    """What the model serves beside generation: ``embeddings`` and ``rerank`` (booleans),
    ``pooling`` and ``n_embd`` when it embeds."""
    embedder = server.embedder
    if embedder is None:
        return {"embeddings": False, "rerank": False}
    return {
        "embeddings": True,
        "rerank": embedder.ranks,
        "pooling": embedder.pooling,
        "n_embd": embedder.n_embd,
    }


def _rfc3339(ts: int) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# The endpoints the start-up banner lists, by the API they belong to (all of them: README).
ENDPOINTS: dict[str, tuple[str, ...]] = {
    "openai": (
        "POST /v1/chat/completions",
        "POST /v1/responses",
        "POST /v1/completions",
        "POST /v1/embeddings",
        "GET /v1/models",
    ),
    "anthropic": ("POST /v1/messages", "POST /v1/messages/count_tokens"),
    "server": (
        "GET /health",
        "GET /metrics",
        "GET /schema/openapi.json",
        "POST /tokenize",
        "POST /detokenize",
        "POST /v1/rerank",
    ),
}


def dialect_routes() -> list[ControllerRouterHandler]:
    from .dialects import (
        anthropic,
        embeddings,
        openai_chat,
        openai_completions,
        responses,
        tokenize,
    )

    return [
        *openai_chat.routes,
        *openai_completions.routes,
        *responses.routes,
        *anthropic.routes,
        *tokenize.routes,
        *embeddings.routes,
    ]


# Browser origins served by default: pages of this machine, on any port.
LOOPBACK_ORIGINS = r"^https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]+)?$"


def cors_config(origins: Sequence[str] | None) -> CORSConfig:
    """CORS for browser clients: ``origins`` (exact origins, ``*`` for any), or loopback
    origins when None. An allowed origin is reflected; any other gets no CORS headers.
    Preflight requests are answered without the API key; the API's own requests are not."""
    headers = ["Authorization", "Content-Type", "x-api-key", "anthropic-version",
               "anthropic-beta", "OpenAI-Organization", "OpenAI-Project"]
    methods: list[Any] = ["GET", "POST", "OPTIONS"]
    if origins is None:
        return CORSConfig(allow_origins=[], allow_origin_regex=LOOPBACK_ORIGINS,
                          allow_methods=methods, allow_headers=headers,
                          expose_headers=["retry-after"])
    return CORSConfig(allow_origins=list(origins), allow_methods=methods, allow_headers=headers,
                      expose_headers=["retry-after"])


def create_app(
    server: Server,
    *,
    max_body: int = DEFAULT_MAX_BODY,
    extra_routes: Sequence[ControllerRouterHandler] = (),
    cors_origins: Sequence[str] | None = None,
    webui: bool = True,
) -> Litestar:
    """Build the application serving ``server``'s engine (``cors_origins``: see
    :func:`cors_config`; ``webui``: the chat page at ``/``, see :mod:`lmserve_core.webui`)."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        server.engine.start()
        pm.hook.startup(backend=server.backend, settings=server.settings)
        try:
            yield
        finally:
            server.engine.begin_shutdown()
            pm.hook.shutdown(backend=server.backend)

    return Litestar(
        route_handlers=[
            health, list_models, retrieve_model, metrics, *dialect_routes(), *(webui_routes() if webui else []),
            *extra_routes,
        ],
        state=State({"metrics": server.engine.metrics}),
        dependencies={"server": Provide(lambda: server, use_cache=True, sync_to_thread=False)},
        guards=[make_auth_guard(server.api_key)],
        cors_config=cors_config(cors_origins),
        exception_handlers={
            LmserveError: handle_lmserve_error,
            ValidationException: handle_validation_error,
            HTTPException: handle_http_error,
            RecursionError: handle_too_deep,
            Exception: handle_unexpected,
        },
        lifespan=[lifespan],
        request_max_body_size=max_body,
        openapi_config=OpenAPIConfig(title="lmserve", version=__version__),
        logging_config=None,  # logging is configured once, in lmserve_core.logs
        debug=False,
    )
