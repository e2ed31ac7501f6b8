"""The HTTP bridge's failures in OpenAI's error shape: `{"error": {"message", "type", "param",
"code"}}` with the error kind's HTTP status (tandem.v1.errors), Retry-After on 429 and 503, and the
app's exception handlers that send them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from services.common.errors import DEFAULT_RETRY_AFTER_S, InvalidRequest, TandemError, http_status, retry_metadata
from tandem.v1.errors import RETRY_AFTER_KEY

RETRY_STATUSES = (429, 503)  # always sent with Retry-After
# The `type` of an error body by HTTP status (the openai package picks its exception by status);
# other 4xx are invalid_request_error, other 5xx server_error.
ERROR_TYPES = {
    401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
    503: "service_unavailable_error", 504: "timeout_error",
}


class ApiError(Exception):
    """An HTTP-level failure that has no domain error (body too large, malformed JSON)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """{"error": {"message", "type", "param", "code"}}, OpenAI's error shape."""
    error_type = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(error: TandemError | ApiError) -> JSONResponse:
    """The OpenAI error JSON with the error kind's HTTP status; 429 and 503 carry
    Retry-After (and Retry-After-Ms), the upstream's hint or the default."""
    status, payload = error_payload(error)
    headers = dict(error.trailing_metadata()) if isinstance(error, TandemError) else {}
    if status in RETRY_STATUSES and RETRY_AFTER_KEY not in headers:
        headers.update(retry_metadata(DEFAULT_RETRY_AFTER_S))
    return JSONResponse(payload, status_code=status, headers=headers)


def error_payload(error: TandemError | ApiError) -> tuple[int, dict[str, Any]]:
    if isinstance(error, ApiError):
        return error.status, error_body(error.status, error.message, error.param, error.code)
    status = http_status(error)
    param = error.field if isinstance(error, InvalidRequest) else None
    return status, error_body(status, error.message, param, _snake_case(type(error).__name__))


def add_error_handlers(app: FastAPI) -> None:
    """Domain errors, HTTP-level ones and routing errors (404, 405) all answer in the OpenAI shape."""
    app.add_exception_handler(TandemError, _handle_error)
    app.add_exception_handler(ApiError, _handle_error)
    app.add_exception_handler(HTTPException, _handle_http_exception)


def _snake_case(name: str) -> str:
    """'DeadlineExceeded' -> 'deadline_exceeded'."""
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


async def _handle_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, TandemError | ApiError)
    return error_response(error)


async def _handle_http_exception(request: Request, error: Exception) -> Response:
    """Routing errors (404 unknown path, 405 wrong method) in the OpenAI shape."""
    assert isinstance(error, HTTPException)
    return JSONResponse(error_body(error.status_code, f"{request.method} {request.url.path}: {error.detail}"),
                        status_code=error.status_code, headers=error.headers)
