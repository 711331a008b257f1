"""Error envelopes of the two API families, chosen by the request path (and, on the paths
both APIs define, by the client)."""

from __future__ import annotations

from typing import Any

ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    501: "invalid_request_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


def is_anthropic_path(path: str) -> bool:
    return path.rstrip("/").endswith("/messages") or "/messages/" in path


def is_shared_path(path: str) -> bool:
    """A path both APIs define (``/v1/models``, ``/v1/models/{id}``)."""
    key = path.strip("/")
    key = key[3:] if key.startswith("v1/") else key
    return key == "models" or key.startswith("models/")


def openai_error(
    status: int, message: str, *, param: str | None = None, code: str | None = None,
    kind: str | None = None,
) -> dict[str, Any]:
    """``{"error": {message, type, param, code}}`` as the OpenAI API sends it."""
    return {
        "error": {
            "message": message,
            "type": kind or OPENAI_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {type, message}}`` as the Anthropic API sends it."""
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(
    path: str, status: int, message: str, *, param: str | None = None, code: str | None = None,
    kind: str | None = None, anthropic_client: bool = False,
) -> dict[str, Any]:
    """The error in the envelope of the path's API; on a path both APIs define, in
    Anthropic's when the client is one (``anthropic_client``: it sent ``anthropic-version``,
    as Anthropic's SDKs always do)."""
    if is_anthropic_path(path) or (anthropic_client and is_shared_path(path)):
        return anthropic_error(status, message)
    return openai_error(status, message, param=param, code=code, kind=kind)
