"""A job's events as a Server-Sent Events response.

Built on sse-starlette's `EventSourceResponse`, with two deliberate choices:

- Keep-alive comments come from this generator, not from sse-starlette's ping
  task: a `: ping` is written only after `ping_interval` seconds in which
  nothing else was, instead of on a fixed clock alongside the data.
- Events are encoded once, when they happen (`Event.sse()`), and written as
  bytes; everything that arrived together goes out as one chunk.

The generator follows the job's log from `after` until the terminal event and
then returns, which ends the response. A client that goes away first detaches
(see `store.py`): the job runs on, and any client can attach again and read on
from its last event id. A job followed from a shared store that stays
unreachable past its outage grace ends the response without a terminal event,
for the client to reconnect. If the server shuts down first, the job is stopped and
ends with `error` `shutting_down`, which the client still receives.
"""

from __future__ import annotations

import asyncio
import logging
import random
import resource
from collections.abc import Callable

import anyio
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError
from starlette.types import Receive, Scope, Send

from backends.base import Backend
from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.logs import bind_job
from gateway.metrics import Metrics
from gateway.protocol import PING, Code, retry_line
from gateway.store import JobHandle, JobStore, StoppedFollowing, StoreUnavailable

log = logging.getLogger("streamgate.stream")

SHUTDOWN_GRACE_S = 5.0  # time for the last events to reach the clients on shutdown (thousands of streams may need it)
RETRY_AFTER_S = (1, 5)  # an overloaded gateway's Retry-After, drawn at random


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
    """The event streams this process holds, and `--max-streams`.

    A request for a stream takes a slot before any work, so that a burst of
    requests cannot all pass the check while each awaits its job: past the
    limit it is refused with 503 `overloaded` and a Retry-After drawn from
    1-5 s, so that the clients of a reconnect storm come back spread out rather
    than all at once again. The slot is held by the response until it ends, or
    freed as soon as the request ends without one.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0

    def slot(self) -> Slot:
        if self.open >= self.limit:
            raise ApiError(
                Code.OVERLOADED,
                f"this gateway holds its limit of {self.limit} event streams; try again shortly",
                retry_after=random.randint(*RETRY_AFTER_S),
            )
        self.open += 1
        return Slot(self)


class Slot:
    """One stream's place: `with streams.slot() as slot:` frees it on leaving unless a response `keep`s it."""

    def __init__(self, streams: Streams) -> None:
        self._streams = streams
        self._held = True
        self._kept = False

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._kept:
            self.release()

    def keep(self) -> Callable[[], None]:
        """The response holds the slot from now on; it calls what this returns when it ends."""
        self._kept = True
        return self.release

    def release(self) -> None:
        if self._held:
            self._held = False
            self._streams.open -= 1


class CountedResponse(EventSourceResponse):
    """An event stream that calls `on_end` however it ends (finished, client gone, cancelled before
    its body began), and `on_write_timeout` when a client stopped reading for `send_timeout`."""

    def __init__(
        self, *args: object, on_end: Callable[[], None], on_write_timeout: Callable[[], None], **kwargs: object
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._on_end = on_end
        self._on_write_timeout = on_write_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            # A client that stopped reading (half-open, or a stalled proxy): detached, and its
            # connection closed by the server. A known end, not an error with a traceback.
            self._on_write_timeout()
            log.warning("a client stopped reading for %g s: detached", self.send_timeout)
        finally:
            self._on_end()


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
) -> EventSourceResponse:
    shutdown = anyio.Event()
    bind_job(job.id)

    async def end_on_shutdown() -> None:
        await shutdown.wait()
        if not isinstance(job, Job):  # another replica runs it: the stream ends, the client reconnects
            store.stop_following()
        elif not job.done:  # only the replica running it can end it
            backend.cancel(job)
            job.fail(Code.SHUTTING_DOWN, "the server is shutting down")

    async def events():
        seen = after
        watcher = asyncio.create_task(end_on_shutdown())
        store.attach(job)
        metrics.stream_opened()
        try:
            yield retry_line(retry_ms)
            while True:
                batch = await job.wait_events(seen, timeout=ping_interval or None)
                if not batch:
                    yield PING
                    continue
                seen = batch[-1].seq
                metrics.sent(batch)
                yield b"".join(event.sse() for event in batch)
                if job.terminal is not None and seen >= job.terminal.seq:
                    return
        except StoppedFollowing:
            pass  # another replica runs the job: the client reconnects, to a replica that stays
        except StoreUnavailable as exc:
            # Ended without a terminal event: the client reconnects with its Last-Event-ID and
            # reads on from wherever the job's events are by then.
            log.warning("job %s: stream ended early: %s", job.id, exc)
        finally:
            watcher.cancel()
            store.detach(job)
            metrics.stream_closed()

    return CountedResponse(
        events(),
        on_end=slot.keep(),
        on_write_timeout=lambda: metrics.client_timeout("write"),
        ping=0,
        sep="\n",
        headers={"Cache-Control": "no-cache", "X-Job-Id": job.id},
        shutdown_event=shutdown,
        shutdown_grace_period=SHUTDOWN_GRACE_S,
        # A write blocked this long means a client that stopped reading (a half-open
        # connection, a stalled proxy): the response ends, and the client is detached.
        send_timeout=write_timeout,
    )
