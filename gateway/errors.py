"""Errors a request can meet before its stream opens, and their HTTP form.

An `ApiError` raised anywhere in request handling becomes an ordinary HTTP
response whose JSON body is `{"error": {"code", "message", "retryable", "field"?}}`.
Tool authors raise `ParamError` or `TooLong` from a tool's `check` to answer
422 or 413 naming the field at fault.
"""

from __future__ import annotations

import math

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.protocol import RETRYABLE, Code, ErrorBody, ErrorInfo, encode

STATUS_OF = {
    Code.BAD_REQUEST: 400,
    Code.UNAUTHORIZED: 401,
    Code.FORBIDDEN: 403,
    Code.NOT_FOUND: 404,
    Code.UNKNOWN_TOOL: 404,
    Code.UNKNOWN_MODEL: 404,
    Code.METHOD_NOT_ALLOWED: 405,
    Code.REQUEST_TIMEOUT: 408,
    Code.TOO_LARGE: 413,
    Code.HEADERS_TOO_LARGE: 431,
    Code.TOO_LONG: 413,
    Code.INVALID_PARAMS: 422,
    Code.UNSUPPORTED_BY_MODEL: 422,
    Code.IDEMPOTENCY_KEY_REUSED: 422,
    Code.NO_RESULT: 409,
    Code.RANGE_NOT_SATISFIABLE: 416,
    Code.QUEUE_FULL: 429,
    Code.RATE_LIMITED: 429,
    Code.INTERNAL: 500,
    Code.NOT_READY: 503,
    Code.STORE_UNAVAILABLE: 503,
    Code.OVERLOADED: 503,
    Code.SHUTTING_DOWN: 503,
    Code.BACKEND_UNAVAILABLE: 503,
}


class ApiError(Exception):
    """A request that cannot start a job; answered as HTTP with the protocol's error body."""

    def __init__(
        self,
        code: Code,
        message: str,
        *,
        field: str | None = None,
        retry_after: float | None = None,
        status: int | None = None,
        retryable: bool | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})
        self.code = code
        self.message = message
        self.field = field
        self.retry_after = retry_after
        self.status = status or STATUS_OF[code]
        self.retryable = code in RETRYABLE if retryable is None else retryable

    def info(self) -> ErrorInfo:
        return ErrorInfo(
            code=self.code, message=self.message, retryable=self.retryable, field=self.field
        )

    def response(self) -> Response:
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return Response(
            encode(ErrorBody(self.info())),
            status_code=self.status,
            media_type="application/json",
            headers=headers,
        )


class ParamError(ApiError):
    """422 `invalid_params` for one field, e.g. `ParamError("prompts[2]", "must not be empty")`."""

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(Code.INVALID_PARAMS, f"{field}: {rule}", field=field)


class TooLong(ApiError):
    """413 `too_long`: the input does not fit the model's context."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(Code.TOO_LONG, f"{field}: {message}", field=field)


def from_validation_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> ApiError:
    """Turn msgspec's message (`Expected int >= 1 - at $.max_tokens`) into a 422 naming the field."""
    text = str(exc)
    rule, field = text, None
    if " - at `$" in text:
        rule, _, path = text.rpartition(" - at `$")
        field = path.rstrip("`").lstrip(".")
    for marker in ("unknown field `", "missing required field `"):
        if marker in rule:
            name = rule.split(marker, 1)[1].split("`", 1)[0]
            field = f"{field}.{name}" if field else name
    if not field:
        return ApiError(Code.INVALID_PARAMS, rule)
    return ParamError(field, rule[0].lower() + rule[1:])


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def http_error_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405, in the protocol's error body."""
    assert isinstance(exc, HTTPException)
    code = {404: Code.NOT_FOUND, 405: Code.METHOD_NOT_ALLOWED}.get(exc.status_code, Code.BAD_REQUEST)
    response = ApiError(code, exc.detail, status=exc.status_code).response()
    response.headers.update(exc.headers or {})  # e.g. the `Allow` a 405 must carry
    return response
