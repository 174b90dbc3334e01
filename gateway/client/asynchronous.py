"""`AsyncClient`: the requests, the resuming and the retrying, written once (`Client` runs it on a loop of its own)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import os
import uuid
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Iterable, Mapping
from functools import partial
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from httpx_sse import ServerSentEvent, aconnect_sse

from gateway.client.outcomes import ClientError, Handler, HttpError, JobError, Outcome, StreamEndedError, StreamEvent

# `run_many` lets jobs finish up to this many times `concurrency` records ahead of the
# oldest one not yet handed back in order: a slow record holds back only so many results.
LOOKAHEAD = 4
# A refusal that says "try again" (429 queue_full or rate_limited; 503 not_ready,
# overloaded, store_unavailable, shutting_down) is tried again in `run_many` this many
# times, after the server's Retry-After (else a backoff), before it is the record's error.
REFUSAL_TRIES = 8
MAX_RETRY_WAIT = 60.0

T = TypeVar("T")


class AsyncClient:
    """`Client`'s methods as coroutines, on `httpx.AsyncClient`: `stream` and `run_many` are async iterators.

    The handlers given to `run` may be plain functions or coroutine functions.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        resume_tries: int = 5,
    ) -> None:
        self._http = httpx.AsyncClient(transport=transport, **_http_options(base_url, headers, timeout))
        self.job_id: str | None = None
        self.resume_tries = resume_tries

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def tools(self, model: str | None = None) -> list[dict[str, Any]]:
        """`GET /tools`, as `Client.tools`."""
        return _json_of(await self._http.get("/tools", params=_model_query(model)))

    async def models(self) -> dict[str, Any]:
        """`GET /models`, as `Client.models`."""
        return _json_of(await self._http.get("/models"))

    async def me(self) -> dict[str, Any]:
        """`GET /me`, as `Client.me`."""
        return _json_of(await self._http.get("/me"))

    async def usage(self, by: str | None = None, tenant: str | None = None, limit: int | None = None) -> dict[str, Any]:
        """`GET /usage`, as `Client.usage`."""
        query = {key: value for key, value in (("by", by), ("tenant", tenant), ("limit", limit)) if value is not None}
        return _json_of(await self._http.get("/usage", params=query))

    async def ready(self) -> dict[str, Any]:
        """`GET /readyz`, as `Client.ready`."""
        return _readiness(await self._http.get("/readyz"))

    async def cancel(self, job_id: str | None = None) -> dict[str, Any]:
        """Cancel a job (by default the one this client ran last), as `Client.cancel`."""
        return _json_of(await self._http.delete(_cancel_path(job_id or self.job_id)))

    async def download(self, path: str | os.PathLike[str], job_id: str | None = None, file: str | None = None) -> int:
        """Write a finished job's result (or its result `file`) to `path`, resuming a dropped connection; as `Client.download`."""
        url = _cancel_path(job_id or self.job_id) + ("/result" if file is None else f"/files/{quote(file, safe='')}")
        partial = f"{os.fspath(path)}.part"
        etag: str | None = None
        written = 0
        tries = 0
        with open(partial, "wb") as out:
            while True:
                headers = {"Range": f"bytes={written}-", "If-Range": etag} if etag and written else {}
                try:
                    async with self._http.stream("GET", url, headers=headers) as response:
                        if response.status_code >= 400:
                            await response.aread()
                            _raise_for_status(response)
                        if response.status_code == 200 and written:  # the copy changed: start again
                            out.seek(0)
                            out.truncate()
                            written = 0
                        etag = response.headers.get("etag")
                        size = int(response.headers["content-length"]) + written
                        async for chunk in response.aiter_bytes():
                            out.write(chunk)
                            written += len(chunk)
                    if written == size:
                        break
                    why = f"it ended at byte {written} of {size}"
                except httpx.TransportError as exc:
                    why = repr(exc)
                tries += 1
                if tries > self.resume_tries:
                    raise StreamEndedError(f"the download of {url} kept failing: {why}")
                await asyncio.sleep(min(0.25 * 2**tries, 5.0))
        os.replace(partial, path)
        return written

    def stream(
        self,
        tool: str,
        params: Mapping[str, Any] | None = None,
        *,
        query: list[tuple[str, str]] | None = None,
        callback_url: str | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """Start a job and yield its events, each once, until its terminal event; as `Client.stream`."""
        self.job_id = None
        return self._events(_Resume(tool, params, query, self.resume_tries, self._started, callback_url))

    async def run(
        self,
        tool: str,
        params: Mapping[str, Any] | None = None,
        *,
        query: list[tuple[str, str]] | None = None,
        on_status: Handler | None = None,
        on_log: Handler | None = None,
        on_partial: Handler | None = None,
        callback_url: str | None = None,
    ) -> Any:
        """Run a job to its end and return its result (the `data` event's payload)."""
        handlers = {"status": on_status, "log": on_log, "partial": on_partial}
        async with contextlib.aclosing(self.stream(tool, params, query=query, callback_url=callback_url)) as events:
            async for event in events:
                ended, value = _settle(event, handlers)
                if ended:
                    return value
                if inspect.isawaitable(value):
                    await value
        raise StreamEndedError(f"the stream of job {self.job_id} ended without a result")

    def run_many(
        self,
        tool: str,
        params_iter: Iterable[Mapping[str, Any]] | AsyncIterable[Mapping[str, Any]],
        *,
        concurrency: int = 8,
        model: str | None = None,
        ordered: bool = True,
    ) -> AsyncGenerator[Outcome, None]:
        """`Client.run_many` on asyncio tasks; `params_iter` may be an iterable or an async iterable.

        To stop early and cancel the jobs still running at once, close the
        iterator (`contextlib.aclosing`); else that waits for the garbage collector.
        """
        return self._run_many(tool, params_iter, model, _Window(concurrency, ordered))

    async def _run_many(
        self,
        tool: str,
        params_iter: Iterable[Mapping[str, Any]] | AsyncIterable[Mapping[str, Any]],
        model: str | None,
        window: _Window,
    ) -> AsyncGenerator[Outcome, None]:
        finished: asyncio.Queue[Outcome] = asyncio.Queue()
        tasks: set[asyncio.Task[Any]] = set()
        late: list[asyncio.Task[Any]] = []  # cancels of jobs that started as the caller left
        stopping = False  # the caller left: start nothing more, cancel what runs

        def started(index: int, job_id: str) -> None:
            window.running[index] = job_id
            if stopping:  # the caller left while this job's request was under way
                late.append(asyncio.ensure_future(self._quiet_cancel(job_id)))

        async def work(index: int, params: Mapping[str, Any]) -> None:
            try:
                for attempt in itertools.count(1):
                    state = _Resume(tool, _on_model(params, model), None, self.resume_tries, partial(started, index))
                    try:
                        result = await self._result(state)
                        break
                    except HttpError as exc:
                        delay = _retry_delay(exc, attempt)
                        if delay is None:
                            raise
                        await asyncio.sleep(delay)
                outcome = Outcome(index, params, result, job_id=window.running.get(index))
            except Exception as exc:  # noqa: BLE001 (any failure is this record's outcome)
                outcome = Outcome(index, params, None, exc, job_id=window.running.get(index))
            window.running.pop(index, None)
            finished.put_nowait(outcome)

        items = _numbered(params_iter)
        try:
            while True:
                async for index, params in window.admit(items):
                    task = asyncio.create_task(work(index, params))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if not window.in_flight:
                    return
                for outcome in window.done(await finished.get()):
                    yield outcome
        finally:
            stopping = True
            if tasks:
                await asyncio.gather(*(self._quiet_cancel(job_id) for job_id in list(window.running.values())))
                for task in list(tasks):
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*late)

    async def _quiet_cancel(self, job_id: str) -> None:
        try:
            await self.cancel(job_id)
        except (httpx.HTTPError, ClientError):
            pass

    def _started(self, job_id: str) -> None:
        self.job_id = job_id

    async def _result(self, state: _Resume) -> Any:
        async with contextlib.aclosing(self._events(state)) as events:
            async for event in events:
                ended, value = _settle(event, {})
                if ended:
                    return value
        raise StreamEndedError(f"the stream of job {state.job_id} ended without a result")

    async def _events(self, state: _Resume) -> AsyncGenerator[StreamEvent, None]:
        while True:
            method, url, kwargs = state.request()
            try:
                async with aconnect_sse(self._http, method, url, **kwargs) as source:
                    if source.response.status_code not in (200, 204):
                        await source.response.aread()
                    if not state.opened(source.response):
                        return
                    async for sse in source.aiter_sse():
                        event = state.event(sse)
                        if event is not None:
                            yield event
                            if state.ended:
                                return
            except httpx.TransportError as exc:
                delay = state.dropped(exc)
            else:
                delay = state.dropped(None)
            await asyncio.sleep(delay)


class _Resume:
    """One job's stream over as many connections as it takes: which request comes next, the
    last event seen, and when to give up. The clients' loops only do the I/O.

    The first request POSTs the params with a fresh `Idempotency-Key` (or is the GET form,
    with `query`); once the job's id is known (`X-Job-Id`), each reconnect is
    `GET /jobs/{id}/events` with the last event id seen. `started` hears the job id.
    """

    def __init__(
        self,
        tool: str,
        params: Mapping[str, Any] | None,
        query: list[tuple[str, str]] | None,
        tries: int,
        started: Callable[[str], None] | None = None,
        callback_url: str | None = None,
    ) -> None:
        # Where the job's terminal event is also POSTed once it ends (a completion webhook).
        callback = {"Callback-URL": callback_url} if callback_url else {}
        if query is not None:
            self.first: tuple[str, str, dict[str, Any]] = ("GET", f"/{tool}/run", {"params": query, "headers": callback})
        else:
            key = uuid.uuid4().hex
            self.first = ("POST", f"/{tool}/run", {"json": dict(params or {}), "headers": {"Idempotency-Key": key, **callback}})
        self.repeatable = query is None  # a POST with its key may be sent again; a GET that started no job not
        self.tries, self.started = tries, started
        self.job_id: str | None = None
        self.last_id: str | None = None
        self.failures = 0
        self.ended = False  # the terminal event has been seen

    def request(self) -> tuple[str, str, dict[str, Any]]:
        if self.job_id is None:
            return self.first
        headers = {"Last-Event-ID": self.last_id} if self.last_id else {}
        return "GET", f"/jobs/{self.job_id}/events", {"headers": headers}

    def opened(self, response: httpx.Response) -> bool:
        """A response's head (an error's body read): False when nothing is left to read (204), HttpError on an error."""
        if response.status_code == 204:
            return False  # the server says we already hold the terminal event
        _raise_for_status(response)
        job_id = response.headers.get("x-job-id")
        if job_id and job_id != self.job_id:
            self.job_id = job_id
            if self.started is not None:
                self.started(job_id)
        return True

    def event(self, sse: ServerSentEvent) -> StreamEvent | None:
        if not sse.data:
            return None  # a block without data (the `retry:` hint) is no event
        event = _event(sse)
        self.last_id, self.failures = event.id or self.last_id, 0
        self.ended = event.type in ("data", "error")
        return event

    def dropped(self, exc: Exception | None) -> float:
        """The connection ended before the terminal event (`exc`: how): the wait before the next try, or raise."""
        if exc is not None and self.job_id is None and not self.repeatable:
            raise exc  # a GET that never started a job is not ours to repeat
        failures = self.failures = self.failures + 1
        if failures > self.tries:
            raise exc or StreamEndedError(f"the stream of job {self.job_id} ended without a terminal event")
        return min(5.0, 0.2 * 2 ** (failures - 1))


class _Window:
    """Which records of `run_many` may start, and the outcomes to hand back, in input order or as they come."""

    def __init__(self, concurrency: int, ordered: bool) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.concurrency, self.ordered = concurrency, ordered
        self.reach = LOOKAHEAD * concurrency
        self.in_flight = 0
        self.running: dict[int, str] = {}  # index → job id of the jobs started: those to cancel if the caller leaves
        self.next = 0  # the index of the next outcome to hand back in order
        self.held: dict[int, Outcome] = {}
        self.waiting: tuple[int, Any] | None = None  # read from the input, not started yet
        self.exhausted = False

    def _room(self) -> bool:
        return self.in_flight < self.concurrency

    def _may_start(self, index: int) -> bool:
        return not self.ordered or index < self.next + self.reach

    async def admit(self, items: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[tuple[int, Any]]:
        """The records to start now, read from `items` as far as there is room."""
        while self._room() and not self.exhausted:
            if self.waiting is None:
                try:
                    self.waiting = await anext(items)
                except StopAsyncIteration:
                    self.exhausted = True
                    return
            if not self._may_start(self.waiting[0]):
                return
            item, self.waiting = self.waiting, None
            self.in_flight += 1
            yield item

    def done(self, outcome: Outcome) -> list[Outcome]:
        """A record ended: the outcomes that can be handed back now."""
        self.in_flight -= 1
        if not self.ordered:
            return [outcome]
        self.held[outcome.index] = outcome
        ready = []
        while self.next in self.held:
            ready.append(self.held.pop(self.next))
            self.next += 1
        return ready


async def _numbered(items: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[tuple[int, Any]]:
    index = 0
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield index, item
            index += 1
    else:
        for item in items:
            yield index, item
            index += 1


def _settle(event: StreamEvent, handlers: Mapping[str, Handler | None]) -> tuple[bool, Any]:
    """What one event means to a run: `(True, result)` for `data`, JobError raised for `error`,
    else `(False, what its handler returned)`."""
    if event.type == "data":
        return True, event.data
    if event.type == "error":
        data = event.data if isinstance(event.data, Mapping) else {}
        error = data.get("error", {})
        raise JobError(
            data.get("job_id", ""), error.get("code", "internal"), error.get("message", ""), bool(error.get("retryable"))
        )
    handler = handlers.get(event.type)
    return False, handler(event.data) if handler is not None else None


def _retry_delay(exc: HttpError, attempt: int) -> float | None:
    """How long to wait before sending a refused request again, or None to give up on it."""
    if not (exc.retryable and exc.status in (429, 503)) or attempt >= REFUSAL_TRIES:
        return None
    if exc.retry_after is not None:
        return min(MAX_RETRY_WAIT, exc.retry_after)
    return min(MAX_RETRY_WAIT, 0.5 * 2 ** (attempt - 1))


def _on_model(params: Mapping[str, Any] | None, model: str | None) -> Mapping[str, Any]:
    return {**(params or {}), "model": model} if model is not None else params or {}


def _http_options(base_url: str, headers: Mapping[str, str] | None, timeout: float | None) -> dict[str, Any]:
    return {
        "base_url": base_url,
        "headers": dict(headers or {}),
        # No read timeout on streams: a long job may be quiet between keep-alives.
        "timeout": httpx.Timeout(timeout, read=None),
        # Each stream holds a connection as long as its job runs: the caller's concurrency bounds them, not a pool.
        "limits": httpx.Limits(max_connections=None, max_keepalive_connections=None),
    }


def _model_query(model: str | None) -> dict[str, str] | None:
    return {"model": model} if model else None


def _cancel_path(job_id: str | None) -> str:
    if job_id is None:
        raise ValueError("no job to cancel: none started yet")
    return f"/jobs/{job_id}"


def _json_of(response: httpx.Response) -> Any:
    _raise_for_status(response)
    return response.json()


def _readiness(response: httpx.Response) -> Any:
    """`/readyz`'s body: a 503 that says why the gateway is not ready is an answer, not an error."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code == 503 and isinstance(body, dict) and "ready" in body:
        return body
    _raise_for_status(response)
    return body


def _event(sse: ServerSentEvent) -> StreamEvent:
    try:
        data = json.loads(sse.data) if sse.data else None
    except json.JSONDecodeError:
        data = sse.data
    return StreamEvent(sse.event, sse.id, data)


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
