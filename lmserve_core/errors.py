"""Errors that carry an HTTP status; every dialect renders them in its own envelope."""

from __future__ import annotations


class LmserveError(Exception):
    """A failure with an HTTP status code and, optionally, the request field at fault."""

    status: int = 500
    kind: str = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status is not None:
            self.status = status


class InvalidRequest(LmserveError):
    """400: the request is malformed or names a value the server cannot accept."""

    status = 400
    kind = "invalid_request_error"


class Unsupported(LmserveError):
    """501: a well-formed request asks for a feature this server or backend lacks."""

    status = 501
    kind = "invalid_request_error"


class Unauthorized(LmserveError):
    """401: missing or wrong API key."""

    status = 401
    kind = "authentication_error"


class NotFound(LmserveError):
    status = 404
    kind = "not_found_error"


class PayloadTooLarge(LmserveError):
    status = 413
    kind = "invalid_request_error"


class QueueFull(LmserveError):
    """429: the bounded request queue is full; the client should retry later."""

    status = 429
    kind = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, code="queue_full")
        self.retry_after = retry_after


class ShuttingDown(LmserveError):
    status = 503
    kind = "overloaded_error"


class BackendFailure(LmserveError):
    """500: generation failed inside the backend."""

    status = 500
    kind = "server_error"
