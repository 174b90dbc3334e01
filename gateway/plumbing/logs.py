"""Request ids and log lines: `X-Request-Id` on every answer, and in every log line of its request.

Shaped this way because of where log lines come from:

- `RequestIds` is plain ASGI middleware, not Starlette's `BaseHTTPMiddleware`:
  it must not buffer event streams, and it must run in the request's own task,
  so that the context variable it sets is seen by every log call the request
  makes, uvicorn's access line included (written when the response starts).
- It sets the variable and never resets it. uvicorn runs each request in a
  task of its own, with a copy of the context, so the id cannot leak into
  another request; and it is still there for what happens after the app
  returns: a 500 answered by Starlette's outermost error handler
  (`ApiError.response` adds the header from here) and its log lines.
- One `logging.Filter`, on the handler `configure_logging` installs, stamps
  `request_id` and `job_id` on every record (and with tracing, the current span's
  `trace_id` and `span_id`: gateway/plumbing/tracing.py) and redacts credentials, whatever
  logger the record came from: a filter on a logger would miss the records
  its child loggers propagate, such as `uvicorn.access`'s.
- uvicorn's own loggers are routed through that handler (the CLI starts uvicorn
  with `log_config=None`), so its lines get the same format, ids and redaction.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Any, TextIO

from opentelemetry import trace
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "X-Request-Id"
# A client's id is kept if it is short and plain enough to log and echo as is.
_SANE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")

request_id: ContextVar[str | None] = ContextVar("streamgate_request_id", default=None)
job_id: ContextVar[str | None] = ContextVar("streamgate_job_id", default=None)


def accept_request_id(value: str | None) -> str:
    """The client's id if it is sane (1 to 128 of `A-Z a-z 0-9 . _ : -`), else a new one (32 hex)."""
    if value and _SANE_ID.fullmatch(value):
        return value
    return os.urandom(16).hex()  # a uuid4().hex, without building a UUID


class RequestIds:
    """ASGI middleware: take or make the request's id, answer it in `X-Request-Id`, bind it for logs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        rid = accept_request_id(given.decode("latin-1"))
        request_id.set(rid)  # not reset: see the module docstring

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = rid
            await send(message)

        await self.app(scope, receive, send_with_id)


def bind_job(job: str) -> None:
    """Name `job` in the rest of this request's log lines."""
    job_id.set(job)


def request_id_headers() -> dict[str, str]:
    """`X-Request-Id` for a response built outside the middleware's reach (Starlette's 500)."""
    rid = request_id.get()
    return {HEADER: rid} if rid else {}


async def forward_request_id(request: Any) -> None:
    """An httpx request hook: calls made while handling a request carry its id onward."""
    rid = request_id.get()
    if rid and HEADER not in request.headers:
        request.headers[HEADER] = rid


# -- credentials out of log lines ------------------------------------------------------

_SECRETS = (
    # Query keys that carry credentials (`max_tokens=` is not one of them).
    (re.compile(r"(?i)(?<![\w.-])(ticket|token|access_token|refresh_token|id_token|api_key|apikey|password|secret)=[^&\s\"'#;]+"), r"\1=REDACTED"),
    (re.compile(r"(?i)\b(bearer)\s+[^\s\"',;]+"), r"\1 REDACTED"),
    # user:password@ in URLs (redis://:secret@host, https://user:pass@host).
    (re.compile(r"(://[^/\s:@]*):[^/\s@]+@"), r"\1:REDACTED@"),
)


# Every pattern above needs one of these: a line without any (most access lines) is let
# through after one scan, instead of three substitutions each building a new string.
_MAYBE_SECRET = re.compile(r"[=@]|(?i:bearer)")


def redact(text: str) -> str:
    """`text` with credentials in query strings, bearer tokens and URL passwords replaced by REDACTED."""
    if _MAYBE_SECRET.search(text) is None:
        return text
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


class RequestContext(logging.Filter):
    """Stamps `request_id` and `job_id` (None outside a request or job), the current span's
    `trace_id` and `span_id` (None without one), and redacts the message."""

    def filter(self, record: logging.LogRecord) -> bool:
        # An explicit `extra={"job_id": …}` wins over the request's.
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id.get()
        if getattr(record, "job_id", None) is None:
            record.job_id = job_id.get()
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            record.trace_id, record.span_id = trace.format_trace_id(span.trace_id), trace.format_span_id(span.span_id)
        try:
            message = record.getMessage()
        except Exception:  # a malformed call: let the handler report it, as logging does
            return True
        clean = redact(message)
        if clean is not message:
            record.msg, record.args = clean, None
        return True


def _ids(record: logging.LogRecord, keys: tuple[str, ...] = ("engine", "request_id", "job_id")) -> dict[str, str]:
    return {k: v for k in keys if (v := getattr(record, k, None))}


# A JSON line also names its trace, for a log store to link to it; a text line stays short to read.
_JSON_IDS = ("engine", "request_id", "job_id", "trace_id", "span_id")


class EngineTag(logging.Filter):
    """Stamps `engine`: the model whose engine process (backends/engines.py) wrote the line."""

    def __init__(self, engine: str) -> None:
        super().__init__()
        self.engine = engine

    def filter(self, record: logging.LogRecord) -> bool:
        record.engine = self.engine
        return True


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message [request_id=… job_id=…]`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        ids = " ".join(f"{k}={v}" for k, v in _ids(record).items())
        return f"{line} [{ids}]" if ids else line

    def formatException(self, ei: Any) -> str:
        return redact(super().formatException(ei))


class JsonFormatter(logging.Formatter):
    """One JSON object a line: `ts` (UTC, ISO 8601), `level`, `logger`, `message`, ids where known, `exc`."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **_ids(record, _JSON_IDS),
        }
        if record.exc_info:
            entry["exc"] = redact(self.formatException(record.exc_info))
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler `configure_logging` installs (and replaces when called again)."""


UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


def configure_logging(level: str = "info", fmt: str = "text", stream: TextIO | None = None, engine: str | None = None) -> logging.Handler:
    """Log `level` and above to `stream` (stderr) as `text` or `json` lines, uvicorn's loggers included;
    in an engine process, each line names the `engine`.

    Other handlers on the root logger are left alone; uvicorn must then be started
    with `log_config=None`, or its own configuration takes its loggers back.
    """
    handler = _Handler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RequestContext())
    if engine is not None:
        handler.addFilter(EngineTag(engine))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
    return handler
