"""What the clients raise, and what they hand back: an event of a stream, a job's outcome in `run_many`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any



class ClientError(Exception):
    """Base of the errors `Client.run` raises."""


class HttpError(ClientError):
    """The server answered an HTTP error before the stream opened."""

    def __init__(self, status: int, body: Mapping[str, Any], retry_after: float | None = None) -> None:
        error = body.get("error", {}) if isinstance(body, Mapping) else {}
        self.status = status
        self.code: str = error.get("code", "http_error")
        self.message: str = error.get("message", f"HTTP {status}")
        self.field: str | None = error.get("field")
        self.retryable: bool = bool(error.get("retryable", False))
        self.retry_after = retry_after
        super().__init__(f"{status} {self.code}: {self.message}")


class JobError(ClientError):
    """The job ended with an `error` event."""

    def __init__(self, job_id: str, code: str, message: str, retryable: bool = False) -> None:
        self.job_id, self.code, self.message, self.retryable = job_id, code, message, retryable
        super().__init__(f"{code}: {message}")


class StreamEndedError(ClientError):
    """The stream ended before its terminal event."""


@dataclass(frozen=True)
class StreamEvent:
    """One event of a job's stream: its type, id and decoded JSON data."""

    type: str
    id: str
    data: Any


@dataclass(frozen=True)
class Outcome:
    """How one job of `run_many` ended: its `result`, or the `error` it raised (`HttpError`,
    `JobError`, `StreamEndedError`, or an `httpx.HTTPError` when the server could not be reached).

    `index` is the params' place in the input (from 0), `params` the params as given.
    """

    index: int
    params: Mapping[str, Any] | None
    result: Any = None
    error: BaseException | None = None
    job_id: str | None = field(default=None, compare=False)  # which job it was (its result files are fetched by it)

    @property
    def ok(self) -> bool:
        return self.error is None


Handler = Callable[[Any], Any]
