"""Python clients for a streamgate server, built on httpx and httpx-sse: `Client` and `AsyncClient`.

    from gateway.client import Client

    with Client("http://127.0.0.1:8000") as client:
        result = client.run("generate", {"prompts": ["Hello"], "max_tokens": 8},
                            on_partial=lambda p: print(p["text"], end=""))

`run` returns the `data` event's payload or raises: `HttpError` (the server
refused before the stream opened), `JobError` (an `error` event), or
`StreamEndedError` (the stream kept ending without a terminal event). A dropped
connection is resumed where it left off (`X-Job-Id` and the last event id).

Many jobs, a few at a time, each one's outcome in input order:

    for outcome in client.run_many("embed", ({"texts": [s]} for s in sequences), concurrency=8):
        print(outcome.index, outcome.result if outcome.ok else outcome.error)

`AsyncClient` has the same methods as coroutines (`stream` and `run_many` as
async iterators), on `httpx.AsyncClient`:

    async with AsyncClient(url) as client:
        result = await client.run("predict", {"prompt": "Hi"})
        async for outcome in client.run_many("predict", params):
            ...

The requests, the resuming and the retrying are written once, in
`AsyncClient`; `Client` runs an `AsyncClient` on an event loop of its own (on a
thread of its own), so it blocks as a sync client does, inside a running event
loop as well as outside one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import itertools
import json
import os
import threading
import uuid
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Coroutine, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from httpx_sse import ServerSentEvent, aconnect_sse

# `run_many` lets jobs finish up to this many times `concurrency` records ahead of the
# oldest one not yet handed back in order: a slow record holds back only so many results.
LOOKAHEAD = 4
# A refusal that says "try again" (429 queue_full or rate_limited; 503 not_ready,
# overloaded, store_unavailable, shutting_down) is tried again in `run_many` this many
# times, after the server's Retry-After (else a backoff), before it is the record's error.
REFUSAL_TRIES = 8
MAX_RETRY_WAIT = 60.0


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
T = TypeVar("T")


class Client:
    """`AsyncClient`'s methods as plain calls: the same client, run on an event loop of its own.

    Each call is sent to that loop, on a thread of this client's, and waited
    for, so a `Client` works the same inside a running event loop (an async
    test, a notebook) as outside one; `stream` and `run_many` are lazy
    iterators that fetch each item from there when it is asked for. `run`'s
    handlers are called on the caller's thread, as its events come. A
    `transport` is a sync one (`httpx.BaseTransport`), whose blocking calls are
    made on threads. Interrupted (Ctrl-C), a call stops its work there before
    the interrupt goes on.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = 30.0,
        transport: httpx.BaseTransport | None = None,
        resume_tries: int = 5,
    ) -> None:
        threaded = transport if transport is None or isinstance(transport, httpx.AsyncBaseTransport) else _Threaded(transport)
        self._async = AsyncClient(base_url, headers=headers, timeout=timeout, transport=threaded, resume_tries=resume_tries)
        self._loop = _Loop()

    @property
    def job_id(self) -> str | None:
        """The id of the job this client started last."""
        return self._async.job_id

    @property
    def resume_tries(self) -> int:
        return self._async.resume_tries

    @resume_tries.setter
    def resume_tries(self, tries: int) -> None:
        self._async.resume_tries = tries

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._loop.close(self._async.aclose())

    def tools(self, model: str | None = None) -> list[dict[str, Any]]:
        """`GET /tools`: each tool's schemas, and whether `model` (default: the default model) runs it."""
        return self._loop.call(self._async.tools(model))

    def models(self) -> dict[str, Any]:
        """`GET /models`: `{"default", "models": [{name, kind, context_length, device, dtype, tools, …}]}`."""
        return self._loop.call(self._async.models())

    def ready(self) -> dict[str, Any]:
        """`GET /readyz`, ready (200) or not (503) alike: `{"ready", "model", "kind", "context_length", "max_batch_size"?, …}`."""
        return self._loop.call(self._async.ready())

    def cancel(self, job_id: str | None = None) -> dict[str, Any]:
        """Cancel a job (by default the one this client ran last); `{"job_id", "cancelled", "status"}`."""
        return self._loop.call(self._async.cancel(job_id))

    def download(self, path: str | os.PathLike[str], job_id: str | None = None, file: str | None = None) -> int:
        """Write a finished job's result (by default the last one's) to `path` from `GET /jobs/{id}/result`,
        or with `file` one of its result files (its result's `files`) from `GET /jobs/{id}/files/{file}`,
        never holding it whole: a connection that drops is resumed from the bytes written (`Range`,
        `If-Range`), up to `resume_tries` times. Its size in bytes."""
        return self._loop.call(self._async.download(path, job_id, file))

    def stream(
        self,
        tool: str,
        params: Mapping[str, Any] | None = None,
        *,
        query: list[tuple[str, str]] | None = None,
    ) -> Iterator[StreamEvent]:
        """Start a job and yield its events, each once, until its terminal event.

        POSTs `params` (with an `Idempotency-Key`, so a POST sent again after a
        failed connection attaches to the same job), or uses the GET form with
        `query`. A connection that drops before the terminal event is resumed
        with `GET /jobs/{id}/events` and the last event id seen, up to
        `resume_tries` times with backoff.
        """
        return self._loop.iterate(self._async.stream(tool, params, query=query))

    def run(
        self,
        tool: str,
        params: Mapping[str, Any] | None = None,
        *,
        query: list[tuple[str, str]] | None = None,
        on_status: Handler | None = None,
        on_log: Handler | None = None,
        on_partial: Handler | None = None,
    ) -> Any:
        """Run a job to its end and return its result (the `data` event's payload)."""
        handlers = {"status": on_status, "log": on_log, "partial": on_partial}
        with contextlib.closing(self.stream(tool, params, query=query)) as events:
            for event in events:
                ended, value = _settle(event, handlers)
                if ended:
                    return value
        raise StreamEndedError(f"the stream of job {self.job_id} ended without a result")

    def run_many(
        self,
        tool: str,
        params_iter: Iterable[Mapping[str, Any]],
        *,
        concurrency: int = 8,
        model: str | None = None,
        ordered: bool = True,
    ) -> Iterator[Outcome]:
        """Run `tool` on each params of `params_iter`, at most `concurrency` jobs at once; yield each `Outcome`.

        Outcomes come in input order, each as soon as it and those before it
        have ended (with `ordered=False`: as each ends). `params_iter` is read
        as jobs start, never more than `LOOKAHEAD` × `concurrency` ahead of
        the oldest outcome not yet yielded. A job that fails is that outcome's
        `error` and the others go on; a refusal that says to try again (429,
        503) is retried after its Retry-After first. `model`, if given, is
        every job's `model` param. Closing the iterator early (or dropping
        it) starts no more jobs and cancels those still running.
        """
        params = _read_on_threads(params_iter)
        return self._loop.iterate(self._async.run_many(tool, params, concurrency=concurrency, model=model, ordered=ordered))


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
    ) -> AsyncGenerator[StreamEvent, None]:
        """Start a job and yield its events, each once, until its terminal event; as `Client.stream`."""
        self.job_id = None
        return self._events(_Resume(tool, params, query, self.resume_tries, self._started))

    async def run(
        self,
        tool: str,
        params: Mapping[str, Any] | None = None,
        *,
        query: list[tuple[str, str]] | None = None,
        on_status: Handler | None = None,
        on_log: Handler | None = None,
        on_partial: Handler | None = None,
    ) -> Any:
        """Run a job to its end and return its result (the `data` event's payload)."""
        handlers = {"status": on_status, "log": on_log, "partial": on_partial}
        async with contextlib.aclosing(self.stream(tool, params, query=query)) as events:
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


class _Loop:
    """An event loop on a thread of its own, where a `Client` runs its `AsyncClient`."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        # Threads for what may block (a sync transport's reads, `run_many`'s params): each open
        # stream holds one between its chunks, so as many as the streams, not a small pool's worth.
        self._loop.set_default_executor(ThreadPoolExecutor(THREADS, thread_name_prefix="streamgate-client"))
        self._thread = threading.Thread(target=self._loop.run_forever, name="streamgate-client", daemon=True)
        self._thread.start()
        self._closed = False

    def call(self, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` there and wait for its result. Interrupted while waiting (Ctrl-C), it is
        cancelled and waited for first, so that what it opened is closed before the caller goes on."""
        if self._closed or threading.current_thread() is self._thread:
            work.close()
            raise RuntimeError("the client is closed" if self._closed else "a Client called from its own loop would wait on itself")
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        started: dict[str, asyncio.Task[T]] = {}
        handover = _task(work, done, started)
        try:
            asyncio.run_coroutine_threadsafe(handover, self._loop)
            return done.result()
        except BaseException:
            if not done.done():
                # Interrupted, perhaps while handing `work` over: once a no-op handed over after it
                # has run there, `work` has started if it was handed over at all.
                asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self._loop).result()
                if "task" in started:
                    self._loop.call_soon_threadsafe(started["task"].cancel)
                    concurrent.futures.wait([done])
                else:  # never handed over
                    handover.close()
                    work.close()
            raise

    def iterate(self, items: AsyncGenerator[T, None]) -> Iterator[T]:
        """`items`, each fetched there when asked for; closing (or dropping) the iterator closes `items`."""
        try:
            while True:
                try:
                    yield self.call(anext(items))  # type: ignore[arg-type]
                except StopAsyncIteration:
                    return
        finally:
            if threading.current_thread() is self._thread:  # dropped there: waiting would wait on itself
                self._loop.create_task(items.aclose())
            elif not self._closed:  # else the loop closed it as it closed
                self.call(items.aclose())

    def close(self, last: Coroutine[Any, Any, None]) -> None:
        """Run `last`, then end the loop and its thread."""
        if self._closed:
            return last.close()
        try:
            self.call(last)
            self.call(self._loop.shutdown_asyncgens())
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


THREADS = 256


async def _task(work: Coroutine[Any, Any, T], done: concurrent.futures.Future[T], started: dict[str, asyncio.Task[T]]) -> None:
    """`work` started as a task of this loop (`started["task"]`), its outcome copied to `done` as it ends."""

    def copy(task: asyncio.Task[T]) -> None:
        if task.cancelled():
            done.cancel()
        if not done.set_running_or_notify_cancel():
            return  # cancelled: its waiters are told
        if task.exception() is not None:
            done.set_exception(task.exception())
        else:
            done.set_result(task.result())

    task = started["task"] = asyncio.ensure_future(work)
    task.add_done_callback(copy)


async def _read_on_threads(items: Iterable[T]) -> AsyncIterator[T]:
    """`items`, each read on a thread when asked for: a caller's iterable may block (a file, a
    generator that waits for something) without holding up the loop its jobs run on."""
    it = iter(items)
    while (item := await asyncio.to_thread(next, it, _END)) is not _END:
        yield item


_END: Any = object()


class _Threaded(httpx.AsyncBaseTransport):
    """A sync transport given to `Client`, driven from its loop: each blocking call on a thread."""

    def __init__(self, transport: httpx.BaseTransport) -> None:
        self._transport = transport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await asyncio.to_thread(self._transport.handle_request, request)
        response.stream = _ThreadedStream(response.stream)  # type: ignore[arg-type]
        return response

    async def aclose(self) -> None:
        await asyncio.to_thread(self._transport.close)


class _ThreadedStream(httpx.AsyncByteStream):
    def __init__(self, stream: Any) -> None:
        self._stream, self._chunks = stream, iter(stream)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await asyncio.to_thread(next, self._chunks, None)) is not None:
            yield chunk

    async def aclose(self) -> None:
        await asyncio.to_thread(self._stream.close)


# -- what both clients share -----------------------------------------------------------------


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
    ) -> None:
        if query is not None:
            self.first: tuple[str, str, dict[str, Any]] = ("GET", f"/{tool}/run", {"params": query})
        else:
            key = uuid.uuid4().hex
            self.first = ("POST", f"/{tool}/run", {"json": dict(params or {}), "headers": {"Idempotency-Key": key}})
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
