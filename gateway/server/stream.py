"""Every event stream the gateway sends: a job's (`POST`/`GET /{tool}/run`, `/jobs/{id}/events`)
and the OpenAI routes' (gateway/server/openai.py), through one writer, `EventStream`.

sse-starlette's `EventSourceResponse` showed how; the streams keep its headers
and framing, with deliberate differences, each measured (bench/streaming.py,
bench/idle_streams.py; figures in bench/RESULTS.md):

- The response is sent from the request's own task, by `EventStream`, a plain
  Starlette response. sse-starlette runs every response in an anyio task group
  of three or four tasks (the stream, a ping clock, a shutdown listener, a
  disconnect listener) and wraps every send in a cancel scope; for a job of a
  dozen small events that machinery cost more than the rest of the gateway's
  part in it, and each idle stream carried its tasks' memory. Here a stream has
  one helper task, the disconnect listener (only `receive()` tells that a quiet
  client left).
- One watcher for every stream (`Streams.watch`), not timers and tasks per
  stream: each write is stamped with its start, and the watcher cuts a write
  blocked past `send_timeout`, dropping what the connection has not sent; on
  shutdown it ends every open stream (a job's stream with its job's
  `shutting_down`; an OpenAI one at once, which cancels its job). A chunk over
  a piece (a big result) is written a piece at a time, each stamped, and
  counts as written once drained (gateway/plumbing/sendbuffer.py): a stream
  ends, and frees its slot, when its client has the last event, not when the
  server buffered it. A big event is written from the one copy every reader
  shares (`framed`): its bytes in memory sliced a piece at a time, or a result
  in the spool (gateway/plumbing/spool.py) read a piece at a time, so that a
  hundred followers of one result hold a piece each, not a copy each.
- Keep-alive comments come from the content, not from a ping task: `follow`
  gives the moment for one after `ping_interval` seconds in which nothing else
  was written, instead of a fixed clock alongside the data.
- The content hands the writer bytes, its own framing: a job's events are
  encoded once, when they happen (`Event.sse()`), everything that arrived
  together goes out as one chunk, the first one with the `retry:` line; the
  OpenAI routes' chunks are sse-starlette's `ServerSentEvent`s as before
  (`data:` lines, CRLF, a `: ping - <time>` comment), with no event names or ids.

A job's stream follows the job's log from `after` until the terminal event and
then returns, which ends the response. A client that goes away first detaches
(see `store.py`): the job runs on, and any client can attach again and read on
from its last event id. A job followed from a shared store that stays
unreachable past its outage grace ends the response without a terminal event,
for the client to reconnect. If the server shuts down first, the job is stopped and
ends with `error` `shutting_down`, which the client still receives.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import resource
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from typing import Any

from sse_starlette.sse import AppStatus
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.backend import Backend
from gateway.plumbing import sendbuffer
from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.plumbing.logs import bind_job
from gateway.plumbing.metrics import Metrics
from gateway.protocol import PING, Code, Event, Kept, retry_line
from gateway.server.store import JobHandle, JobStore, StoppedFollowing, StoreUnavailable
from gateway.tenants import over_share

log = logging.getLogger("streamgate.stream")

SHUTDOWN_GRACE_S = 5.0  # time for the last events to reach the clients on shutdown (thousands of streams may need it)
RETRY_AFTER_S = (1, 5)  # an overloaded gateway's Retry-After, drawn at random


WATCH_PERIOD_S = 0.5  # how often the streams' watcher looks for stalled writes and for shutdown
FD_MARGIN = 256  # file descriptors besides the streams' own: listeners, Redis, executors, files


def raise_fd_limit(needed: int) -> int:
    """Raise this process's RLIMIT_NOFILE soft limit towards `needed` (never past the hard limit,
    nor down); the soft limit now. Every stream holds a socket, and many systems start at 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


class Streams:
    """The event streams this process holds, `--max-streams`, and `--max-streams-per-owner`.

    A request for a stream takes a slot before any work, so that a burst of
    requests cannot all pass the check while each awaits its job: past the
    limit it is refused with 503 `overloaded` and a Retry-After drawn from
    1-5 s, so that the clients of a reconnect storm come back spread out rather
    than all at once again; past its owner's (gateway/tenants.py) share, with 429
    `rate_limited` and the same Retry-After: the gateway has room, that owner
    has not. The slot is held by the response until it ends, or freed as soon
    as the request ends without one.

    On shutdown `close` ends them all: one handler for every stream, where a
    task per stream would wait for the same moment.
    """

    def __init__(self, limit: int, per_owner: int | None = None) -> None:
        self.limit = limit
        self.per_owner = per_owner
        self.open = 0
        self.by_owner: collections.Counter[str] = collections.Counter()  # open streams of each owner that holds any
        self._live: dict[Slot, Callable[[], None]] = {}  # slots of open streams: how to end each
        self._closing = False

    def slot(self, owner: str = "") -> Slot:
        if self.open >= self.limit:
            raise ApiError(
                Code.OVERLOADED,
                f"this gateway holds its limit of {self.limit} event streams; try again shortly",
                retry_after=random.randint(*RETRY_AFTER_S),
            )
        held = self.by_owner[owner]
        if self.per_owner is not None and held >= self.per_owner:
            raise over_share(owner, f"holds {held} event streams", "--max-streams-per-owner", random.randint(*RETRY_AFTER_S))
        self.open += 1
        self.by_owner[owner] = held + 1
        return Slot(self, owner)

    async def close(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        """End every open stream: its job is stopped with `shutting_down` (or, run elsewhere, no longer
        followed), and the stream ends once that is written; after `grace`, those left are cut."""
        if self._closing:
            return
        self._closing = True
        for slot, end in list(self._live.items()):
            try:
                end()
            except Exception:  # one stream's failure must not keep the others open
                log.exception("ending a stream on shutdown failed (job %s)", slot.job_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self._live and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for slot in list(self._live):
            if slot.response is not None:
                slot.response.stop()

    async def watch(self, period: float = WATCH_PERIOD_S) -> None:
        """The one watcher of every stream, for as long as the app runs: every `period`, cut the
        streams whose write has been blocked past their `send_timeout`; on uvicorn's exit (Ctrl-C, or
        sse-starlette's `AppStatus` flag, which the drain sets too), `close` them all."""
        loop = asyncio.get_running_loop()
        while not AppStatus.should_exit:
            await asyncio.sleep(period)
            now = loop.time()
            for slot in list(self._live):
                if slot.response is not None and slot.response.stalled(now):
                    slot.response.stop(write_timed_out=True)
        await self.close()


class Slot:
    """One stream's place: `with streams.slot() as slot:` frees it on leaving unless a response `keep`s it."""

    def __init__(self, streams: Streams, owner: str) -> None:
        self._streams = streams
        self._owner = owner
        self._held = True
        self._kept = False
        self.response: EventStream | None = None
        self.job_id: str | None = None

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._kept:
            self.release()

    def keep(self) -> Callable[[], None]:
        """The response holds the slot from now on; it calls what this returns when it ends."""
        self._kept = True
        return self.release

    def watch(self, response: EventStream, job_id: str, end: Callable[[], None]) -> None:
        """Have `Streams.watch` look after `response`: cut it if a write stalls; on shutdown, `end()` its job."""
        self.response, self.job_id = response, job_id
        if self._held:
            self._streams._live[self] = end

    def release(self) -> None:
        if self._held:
            self._held = False
            self._streams.open -= 1
            by_owner = self._streams.by_owner
            by_owner[self._owner] -= 1
            if not by_owner[self._owner]:
                del by_owner[self._owner]  # only owners holding streams are counted: addresses come and go
            self._streams._live.pop(self, None)
            self.response = None


class EventStream(Response):
    """An event stream, sent from the request's own task (see the module docstring).

    Its content is an async iterator of (encoded chunk, whether it is the last),
    pings included: the framing is the content's, everything else is the
    writer's. It holds `slot` until it ends, and counts itself among the
    gauge's open streams while it streams. It ends when the content does; when
    the client leaves (its one helper task, the disconnect listener, tells); or
    on `stop()`, from the streams' watcher (a write blocked past
    `send_timeout`, or shutdown when `on_shutdown` is not given). The content
    is closed however it ends, so its `finally` always runs, and then `on_end`
    is called.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[tuple[bytes | Sequence[bytes | Kept], bool]],
        *,
        slot: Slot,
        job_id: str,
        metrics: Metrics,
        headers: Mapping[str, str],
        send_timeout: float | None,
        on_shutdown: Callable[[], None] | None = None,
        on_end: Callable[[], None] | None = None,
    ) -> None:
        self.body_iterator = content
        self.status_code = 200
        self.background = None
        self.send_timeout = send_timeout
        # sse-starlette's headers: no proxy buffering, a connection kept open.
        self.init_headers({**headers, "Connection": "keep-alive", "X-Accel-Buffering": "no"})
        self._metrics = metrics
        self._release = slot.keep()
        self._on_end = on_end
        self._task: asyncio.Task[Any] | None = None
        self._streaming = False
        self._stopped = False
        self._write_timed_out = False
        self._sending_since: float | None = None
        slot.watch(self, job_id, on_shutdown or self.stop)

    def stalled(self, now: float) -> bool:
        """Whether a write has been blocked for `send_timeout` seconds by `now` (the loop's clock)."""
        since = self._sending_since
        return since is not None and self.send_timeout is not None and now - since >= self.send_timeout

    def stop(self, *, write_timed_out: bool = False) -> None:
        """End the stream now; its content is closed."""
        if self._stopped:
            return
        self._stopped = True
        self._write_timed_out = write_timed_out
        if self._streaming and self._task is not None:
            self._task.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        counted = False
        try:
            if scope["method"] == "HEAD":  # the headers a GET would get, and no stream
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            self._task = asyncio.current_task()
            self._metrics.stream_opened()
            counted = True
            listener = asyncio.get_running_loop().create_task(self._listen(receive))
            try:
                if await self._stream(send):
                    listener.cancel()
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                elif self._write_timed_out:
                    await sendbuffer.cut(scope, lambda: self._metrics.client_timeout("write"), self.send_timeout)
            finally:
                listener.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            self._release()
            if counted:
                self._metrics.stream_closed()
            if self._on_end is not None:
                self._on_end()

    async def _stream(self, send: Send) -> bool:
        """Send the head and every chunk; True if the body is still to be ended (the content ended
        without a last chunk), False if it was ended or `stop()` ended the stream first."""
        loop = asyncio.get_running_loop()
        self._streaming = True
        try:
            if self._stopped:
                return False
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk, last in self.body_iterator:
                if not isinstance(chunk, bytes):  # parts: a big event's data, in memory or in the spool
                    await self._send_parts(send, chunk, last)
                elif len(chunk) > sendbuffer.PIECE:
                    await self._send_pieces(send, chunk, last)
                else:
                    # Stamped, not timed: the streams' watcher cuts a write blocked too long, at no
                    # cost to the writes that are not (a timer per write cost more than the write).
                    self._sending_since = loop.time()
                    # The last chunk ends the body in the same write (no empty chunk after it).
                    await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                    self._sending_since = None
                if last:
                    return False
            return True
        except asyncio.CancelledError:
            # Only `stop()` cancels while streaming; any other cancel goes on up.
            if not self._stopped:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            return False
        finally:
            self._streaming = False
            self._sending_since = None

    async def _send_pieces(self, send: Send, chunk: bytes, last: bool) -> None:
        """A big chunk, a piece at a time, each stamped on its own: a reader that stopped blocks a
        piece, for the watcher to cut; a last one ends the body once it has drained (gateway/plumbing/sendbuffer.py)."""
        loop = asyncio.get_running_loop()
        for message in sendbuffer.pieces(chunk, more_body=not last):
            self._sending_since = loop.time()
            await send(message)
        self._sending_since = None

    async def _send_parts(self, send: Send, parts: Sequence[bytes | Kept], last: bool) -> None:
        """A chunk in parts, as `_send_pieces` sends a big one: no part is copied whole, a result in
        the spool is read a piece at a time as the client takes it."""
        loop = asyncio.get_running_loop()
        async with contextlib.aclosing(sendbuffer.part_pieces(parts, more_body=not last)) as messages:
            async for message in messages:
                self._sending_since = loop.time()
                await send(message)
        self._sending_since = None

    async def _listen(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.stop()
                return


async def follow(job: JobHandle, after: int = 0, ping_interval: float = 0) -> AsyncIterator[tuple[list[Event], bool]]:
    """`job`'s events after seq `after` to its terminal event, each batch as it arrived and whether it
    holds the terminal event; an empty batch after `ping_interval` seconds without one (0: never),
    the moment for a stream's ping."""
    seen = after
    while True:
        batch = await job.wait_events(seen, timeout=ping_interval or None)
        if batch:
            seen = batch[-1].seq
        last = job.terminal is not None and seen >= job.terminal.seq
        yield batch, last
        if last:
            return


def framed(batch: list[Event], head: bytes = b"") -> bytes | list[bytes | Kept]:
    """A batch of events as one chunk, after `head`: bytes, or parts where an event is big or kept in
    the spool, so that its data is written from the one copy every reader shares, never copied whole."""
    if all(event.kept is None and len(event.raw) <= sendbuffer.PIECE for event in batch):
        return head + b"".join([event.sse() for event in batch])
    parts: list[bytes | Kept] = [head] if head else []
    for event in batch:
        if event.kept is None and len(event.raw) <= sendbuffer.PIECE:
            parts.append(event.sse())
        else:
            parts.extend(event.sse_parts())
    return parts


def job_response(
    job: JobHandle,
    backend: Backend,
    store: JobStore,
    *,
    metrics: Metrics,
    slot: Slot,
    ping_interval: float = 15.0,
    retry_ms: int = 3000,
    after: int = 0,
    write_timeout: float | None = None,
) -> EventStream:
    bind_job(job.id)

    def end_on_shutdown() -> None:
        if not isinstance(job, Job):  # another replica runs it: the stream ends, the client reconnects
            store.stop_following()
        elif not job.done:  # only the replica running it can end it
            backend.cancel(job)
            job.fail(Code.SHUTTING_DOWN, "the server is shutting down")

    async def events() -> AsyncIterator[tuple[bytes | list[bytes | Kept], bool]]:
        store.attach(job)
        try:
            head = retry_line(retry_ms)  # goes out with the first events, or alone if there are none yet
            if not (isinstance(job, Job) and len(job.events) > after):
                yield head, False
                head = b""
            async for batch, last in follow(job, after, ping_interval):
                if not batch:
                    yield PING, False
                    continue
                metrics.sent(batch)
                yield framed(batch, head), last
                head = b""
        except StoppedFollowing:
            pass  # another replica runs the job: the client reconnects, to a replica that stays
        except StoreUnavailable as exc:
            # Ended without a terminal event: the client reconnects with its Last-Event-ID and
            # reads on from wherever the job's events are by then.
            log.warning("job %s: stream ended early: %s", job.id, exc)
        finally:
            store.detach(job)

    return EventStream(
        events(),
        slot=slot,
        job_id=job.id,
        metrics=metrics,
        headers={"Cache-Control": "no-cache", "X-Job-Id": job.id},
        # A write blocked this long means a client that stopped reading (a half-open
        # connection, a stalled proxy): the response ends, and the client is detached.
        send_timeout=write_timeout,
        on_shutdown=end_on_shutdown,
    )
