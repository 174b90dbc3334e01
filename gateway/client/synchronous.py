"""`Client`: an `AsyncClient` run on an event loop of its own, on a thread of its own, so that it blocks as a
sync client does, inside a running event loop as well as outside one."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from gateway.client.asynchronous import AsyncClient, T, _settle
from gateway.client.outcomes import Handler, Outcome, StreamEndedError, StreamEvent


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

    def me(self) -> dict[str, Any]:
        """`GET /me`: who this client's token says it is: `{"name", "tenant", "class", "priority", "groups", "tools", "models", "usage", …}`."""
        return self._loop.call(self._async.me())

    def usage(self, by: str | None = None, tenant: str | None = None, limit: int | None = None) -> dict[str, Any]:
        """`GET /usage`: settled use by tenant, class and model (`by`: which of them, comma-separated):
        `{"rows": [{"tenant", "class", "model", "usage": {"jobs", "tokens_in", …}}], "rows_total"}`;
        an admin's token sees everyone's (or `tenant`'s), another its own."""
        return self._loop.call(self._async.usage(by, tenant, limit))

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
        callback_url: str | None = None,
    ) -> Iterator[StreamEvent]:
        """Start a job and yield its events, each once, until its terminal event.

        POSTs `params` (with an `Idempotency-Key`, so a POST sent again after a
        failed connection attaches to the same job), or uses the GET form with
        `query`. A connection that drops before the terminal event is resumed
        with `GET /jobs/{id}/events` and the last event id seen, up to
        `resume_tries` times with backoff. `callback_url`: the job's terminal event is also
        POSTed there, signed, once it ends (`Callback-URL`, a completion webhook).
        """
        return self._loop.iterate(self._async.stream(tool, params, query=query, callback_url=callback_url))

    def run(
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
        with contextlib.closing(self.stream(tool, params, query=query, callback_url=callback_url)) as events:
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
