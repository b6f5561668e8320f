"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.

The official client picks its exception class from the status (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 429 RateLimitError, 5xx InternalServerError) and shows `message`,
so every failure, including FastAPI's own 422 and Starlette's 404/405, is rewritten into this shape.
"""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.engine.async_engine import EngineDeadError
from specserve.errors import SpecServeError

log = logging.getLogger("specserve.server")

# OpenAI's `type` for each status we send.
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_exceeded", 500: "internal_server_error", 503: "service_unavailable"}
# Seconds a client should wait before retrying (the official client honours Retry-After up to 60 s): a
# full queue drains within a few decode steps; a draining or unhealthy server needs a restart or another
# replica.
RETRY_AFTER_S = {429: 1, 503: 5}


class SafeJSONResponse(JSONResponse):
    """JSON that always renders: a lone surrogate echoed from a request (a model name, a field name in an
    error) is escaped as \\udXXX instead of failing the UTF-8 encoding with a 500."""

    def render(self, content) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    """The error as a response; 429 and 503 carry Retry-After unless `headers` set their own."""
    headers = dict(headers or {})
    if status in RETRY_AFTER_S and not any(k.lower() == "retry-after" for k in headers):
        headers["Retry-After"] = str(RETRY_AFTER_S[status])
    return SafeJSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def from_exception(exc: BaseException, log_unexpected: bool = True) -> APIError:
    """What a client is told about a failure inside request handling (also used mid-stream)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SpecServeError):  # InvalidRequestError and friends: the user can fix the request
        return APIError(400, str(exc))
    if isinstance(exc, EngineDeadError):  # a one-line engine message; its traceback went to the log
        return APIError(500, str(exc))
    if log_unexpected:
        log.error("internal error while serving a request", exc_info=exc)
    return APIError(500, "internal server error (details are in the server log)")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":  # its loc is a character position, not a field
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    # loc is ("body", "field", ...): name the field the way the client wrote it.
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "lone_surrogate":  # found by a whole-body check, which names the field itself
        param = first.get("ctx", {}).get("where") or param
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return (f"{param}: {msg}" if param else msg) + more, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        headers = dict(exc.headers or {})
        if exc.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return error_response(exc.status, exc.message, exc.param, exc.code, headers)

    @app.exception_handler(SpecServeError)
    async def _user_error(request: Request, exc: SpecServeError):
        return error_response(400, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path} (see /v1/models, /v1/completions, " \
                      "/v1/chat/completions, /health, /metrics)"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # Starlette re-raises after this response is sent and uvicorn logs the traceback: don't log twice.
        err = from_exception(exc, log_unexpected=False)
        return error_response(err.status, err.message, err.param, err.code)
