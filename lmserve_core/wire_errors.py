"""Error envelopes of the two API families, chosen by the request path."""

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
    kind: str | None = None,
) -> dict[str, Any]:
    if is_anthropic_path(path):
        return anthropic_error(status, message)
    return openai_error(status, message, param=param, code=code, kind=kind)
