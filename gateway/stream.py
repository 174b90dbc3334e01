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

import anyio
from sse_starlette import EventSourceResponse

from backends.base import Backend
from gateway.jobs import Job
from gateway.logs import bind_job
from gateway.metrics import Metrics
from gateway.protocol import PING, Code, retry_line
from gateway.store import JobHandle, JobStore, StoreUnavailable

log = logging.getLogger("streamgate.stream")

SHUTDOWN_GRACE_S = 2.0  # time for the terminal event to reach the client on shutdown


def job_response(
    job: JobHandle,
    backend: Backend,
    store: JobStore,
    *,
    metrics: Metrics,
    ping_interval: float = 15.0,
    retry_ms: int = 3000,
    after: int = 0,
    write_timeout: float | None = None,
) -> EventSourceResponse:
    shutdown = anyio.Event()
    bind_job(job.id)

    async def end_on_shutdown() -> None:
        await shutdown.wait()
        if isinstance(job, Job) and not job.done:  # only the replica running it can end it
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
        except StoreUnavailable as exc:
            # Ended without a terminal event: the client reconnects with its Last-Event-ID and
            # reads on from wherever the job's events are by then.
            log.warning("job %s: stream ended early: %s", job.id, exc)
        finally:
            watcher.cancel()
            store.detach(job)
            metrics.stream_closed()

    return EventSourceResponse(
        events(),
        ping=0,
        sep="\n",
        headers={"Cache-Control": "no-cache", "X-Job-Id": job.id},
        shutdown_event=shutdown,
        shutdown_grace_period=SHUTDOWN_GRACE_S,
        # A write blocked this long means a client that stopped reading (a half-open
        # connection, a stalled proxy): the response ends, and the client is detached.
        send_timeout=write_timeout,
    )
