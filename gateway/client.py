"""A Python client for a streamgate server, built on httpx and httpx-sse.

    from gateway.client import Client

    with Client("http://127.0.0.1:8000") as client:
        result = client.run("generate", {"prompts": ["Hello"], "max_tokens": 8},
                            on_partial=lambda p: print(p["text"], end=""))

`run` returns the `data` event's payload or raises: `HttpError` (the server
refused before the stream opened), `JobError` (an `error` event), or
`StreamEndedError` (the stream kept ending without a terminal event). A dropped
connection is resumed where it left off (`X-Job-Id` and the last event id).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from httpx_sse import ServerSentEvent, connect_sse


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
class Event:
    """One event of a job's stream: its type, id and decoded JSON data."""

    type: str
    id: str
    data: Any


class Client:
    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = 30.0,
        transport: httpx.BaseTransport | None = None,
        resume_tries: int = 5,
    ) -> None:
        # No read timeout on streams: a long job may be quiet between keep-alives.
        self._http = httpx.Client(
            base_url=base_url,
            headers=dict(headers or {}),
            timeout=httpx.Timeout(timeout, read=None),
            transport=transport,
        )
        self.job_id: str | None = None
        self.resume_tries = resume_tries

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def tools(self, model: str | None = None) -> list[dict[str, Any]]:
        """`GET /tools`: each tool's schemas, and whether `model` (default: the default model) runs it."""
        response = self._http.get("/tools", params={"model": model} if model else None)
        _raise_for_status(response)
        return response.json()

    def models(self) -> dict[str, Any]:
        """`GET /models`: `{"default", "models": [{name, kind, context_length, device, dtype, tools, …}]}`."""
        response = self._http.get("/models")
        _raise_for_status(response)
        return response.json()

    def cancel(self, job_id: str | None = None) -> dict[str, Any]:
        """Cancel a job (by default the one this client ran last); `{"job_id", "cancelled", "status"}`."""
        job_id = job_id or self.job_id
        if job_id is None:
            raise ValueError("no job to cancel: none started yet")
        response = self._http.delete(f"/jobs/{job_id}")
        _raise_for_status(response)
        return response.json()

    def stream(
        self,
        tool: str,
        params: Mapping[str, Any] | None = None,
        *,
        query: list[tuple[str, str]] | None = None,
    ) -> Iterator[Event]:
        """Start a job and yield its events, each once, until its terminal event.

        POSTs `params` (with an `Idempotency-Key`, so a POST sent again after a
        failed connection attaches to the same job), or uses the GET form with
        `query`. A connection that drops before the terminal event is resumed
        with `GET /jobs/{id}/events` and the last event id seen, up to
        `resume_tries` times with backoff.
        """
        if query is not None:
            first = ("GET", f"/{tool}/run", {"params": query})
        else:
            key = uuid.uuid4().hex
            first = ("POST", f"/{tool}/run", {"json": dict(params or {}), "headers": {"Idempotency-Key": key}})
        self.job_id, last_id, failures = None, None, 0
        while True:
            if self.job_id is None:
                method, url, kwargs = first
            else:
                headers = {"Last-Event-ID": last_id} if last_id else {}
                method, url, kwargs = "GET", f"/jobs/{self.job_id}/events", {"headers": headers}
            try:
                with connect_sse(self._http, method, url, **kwargs) as source:
                    response = source.response
                    if response.status_code == 204:
                        return  # the server says we already hold the terminal event
                    if response.status_code != 200:
                        response.read()
                        _raise_for_status(response)
                    self.job_id = response.headers.get("x-job-id") or self.job_id
                    for sse in source.iter_sse():
                        if not sse.data:
                            continue  # a block without data (the `retry:` hint) is no event
                        event = _event(sse)
                        last_id, failures = event.id or last_id, 0
                        yield event
                        if event.type in ("data", "error"):
                            return
            except (httpx.TransportError, httpx.RemoteProtocolError) as exc:
                if self.job_id is None and query is not None:
                    raise  # a GET that never started a job is not ours to repeat
                dropped: Exception = exc
            else:
                dropped = StreamEndedError(f"the stream of job {self.job_id} ended without a terminal event")
            failures += 1
            if failures > self.resume_tries:
                raise dropped
            time.sleep(min(5.0, 0.2 * 2 ** (failures - 1)))

    def run(
        self,
        tool: str,
        params: Mapping[str, Any] | None = None,
        *,
        query: list[tuple[str, str]] | None = None,
        on_status: Callable[[dict[str, Any]], None] | None = None,
        on_log: Callable[[dict[str, Any]], None] | None = None,
        on_partial: Callable[[Any], None] | None = None,
    ) -> Any:
        """Run a job to its end and return its result (the `data` event's payload)."""
        handlers = {"status": on_status, "log": on_log, "partial": on_partial}
        for event in self.stream(tool, params, query=query):
            if event.type == "data":
                return event.data
            if event.type == "error":
                error = event.data.get("error", {})
                raise JobError(
                    event.data.get("job_id", ""),
                    error.get("code", "internal"),
                    error.get("message", ""),
                    bool(error.get("retryable")),
                )
            handler = handlers.get(event.type)
            if handler is not None:
                handler(event.data)
        raise StreamEndedError(f"the stream of job {self.job_id} ended without a result")


def _event(sse: ServerSentEvent) -> Event:
    try:
        data = json.loads(sse.data) if sse.data else None
    except json.JSONDecodeError:
        data = sse.data
    return Event(sse.event, sse.id, data)


def _raise_for_status(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"code": "http_error", "message": response.text[:500]}}
    retry_after = response.headers.get("retry-after")
    raise HttpError(
        response.status_code,
        body,
        float(retry_after) if retry_after and retry_after.isdigit() else None,
    )
