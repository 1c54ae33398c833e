"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the HTTP layer answers goes through here, so a client (the ``openai`` package
included) always gets the status code and body it expects: bad input 400 (never a 500), a missing
or wrong API key 401, an unknown route or model 404, a wrong method 405, an overloaded engine
429/503, a request over its time limit 504, and a bare 500 for anything unexpected, logged here and
never echoed (no traceback, no exception text reaches the client). The API-key check lives here too
(`ApiKeyMiddleware`): it only ever answers 401s.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app.wire import GenerateError

logger = logging.getLogger(__name__)

# The error "type" for a status when the raiser names none.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_type_for(status: int) -> str:
    """The default error type for an HTTP status."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The JSON body of an OpenAI error response (also the payload of a mid-stream SSE error event)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(Exception):
    """A request that ends in an OpenAI-style error response with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type_for(status)
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if status in (429, 503):
            self.headers.setdefault("Retry-After", "1")

    @classmethod
    def from_generate_error(cls, error: GenerateError) -> APIError:
        """The engine's refusal (data from the replica) as an HTTP error with the engine's status."""
        return cls(error.status, error.message, error.type, error.param, error.code)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


_MISSING_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on every ``/v1/*`` path (known or not)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = None
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            challenge = {"WWW-Authenticate": "Bearer"}
            if scheme.lower() != b"bearer" or not token.strip():
                error = APIError(401, _MISSING_KEY, headers=challenge)
            elif not secrets.compare_digest(token.strip(), self._key):
                error = APIError(
                    401, "Incorrect API key provided.", code="invalid_api_key", headers=challenge
                )
        if error is None:
            await self.app(scope, receive, send)
        else:
            await error.response()(scope, receive, send)


def _format_loc(loc: Sequence[Any]) -> str:
    """``("body", "messages", 0, "content")`` -> ``messages[0].content``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def validation_error(errors: Sequence[Any]) -> APIError:
    """One 400 from pydantic/FastAPI validation errors: the first problem, its field path as param."""
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    kind = first.get("type", "")
    loc = list(first.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "could not parse")
        position = f" (at character {loc[0]})" if loc and isinstance(loc[0], int) else ""
        return APIError(400, f"invalid JSON in request body: {detail}{position}")
    if not loc:
        if kind == "missing":
            return APIError(400, "the request body is missing: send a JSON object")
        if isinstance(first.get("input"), bytes | bytearray):  # not sent as application/json
            return APIError(400, "the request body must be a JSON object (Content-Type: application/json)")
        return APIError(400, "the request body must be a JSON object")
    path = _format_loc(loc)
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {path}", param=path)
    message = str(first.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more: fix this first)" if len(errors) > 1 else ""
    return APIError(400, f"{path}: {message}{more}", param=path)


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc.errors()).response()


async def _http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    method, path = request.method, request.url.path
    if exc.status_code == 404:
        error = APIError(404, f"Invalid URL ({method} {path})", code="unknown_url")
    elif exc.status_code == 405:
        error = APIError(405, f"Method {method} is not allowed for {path}", code="method_not_allowed")
    else:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        error = APIError(exc.status_code, detail)
    error.headers.update(exc.headers or {})  # e.g. 405's Allow
    return error.response()


async def _internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, "The server had an error while processing your request.").response()


def install_error_handlers(app: FastAPI) -> None:
    """Answer every failure of ``app`` in OpenAI's error shape."""
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    app.add_exception_handler(Exception, _internal_error_handler)
