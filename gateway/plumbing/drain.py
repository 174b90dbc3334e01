"""Stopping well: SIGTERM drains the service before uvicorn shuts it down.

uvicorn's own SIGTERM handling stops at once: open streams are cut and
running jobs lose their work. A supervisor's SIGTERM (compose, systemd,
Kubernetes) means "finish up", so on the first one:

1. the service drains: `/readyz` answers 503 (load balancers stop sending
   work) and new runs get 503 `shutting_down` with `Retry-After`;
2. jobs already accepted, queued or running, may finish for up to
   `--drain-timeout` seconds;
3. those still going then end with `error` `shutting_down`, and their
   streams carry that terminal event to their clients;
   streams of jobs that other replicas run (a shared store) end with no
   terminal event, and their clients reconnect, to another replica;
4. only then does uvicorn shut down, and the process exits 0 (`exit_cleanly`),
   even while a device is still inside a step of work that was cancelled.

A second SIGTERM skips the wait. SIGINT (Ctrl-C) keeps uvicorn's quick stop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn
from sse_starlette.sse import AppStatus

from gateway.plumbing import handoff
from gateway.errors import ApiError
from gateway.protocol import Code

log = logging.getLogger("streamgate.drain")

# Time for the last terminal events to be written before the server closes its connections.
FLUSH_S = 0.5
# Once the server is down, how long the process waits for a device's step in flight to end:
# a cancelled tool stops at its next check, well within this, unless one native call is long.
STEP_WAIT_S = 1.0


class Drain:
    """Whether the service is draining, and the drain itself."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.draining = False
        self.deadline: float | None = None

    def refuse(self) -> None:
        """503 `shutting_down` while draining: a run is better sent to another replica."""
        if self.draining:
            raise ApiError(Code.SHUTTING_DOWN, "the server is shutting down; try another replica or again shortly", retry_after=5)

    async def run(self, in_flight: Callable[[], int], stop: Callable[[], Awaitable[None]]) -> None:
        """Drain: wait (up to the timeout) for `in_flight()` to reach 0, then `stop()` what is left."""
        self.draining = True
        self.deadline = time.monotonic() + self.timeout
        log.warning("draining: %d jobs in flight, up to %g s to finish", in_flight(), self.timeout)
        while in_flight() and time.monotonic() < self.deadline:
            await asyncio.sleep(0.05)
        if in_flight():
            log.warning("drain timeout: ending %d jobs with shutting_down", in_flight())
        await stop()
        await asyncio.sleep(FLUSH_S)


def on_sigterm(drain: Drain, in_flight: Callable[[], int], stop: Callable[[], Awaitable[None]]) -> None:
    """Make the first SIGTERM drain before uvicorn shuts down (call from the app's start-up).

    uvicorn has installed its handler by then; this one runs first and hands
    over when the drain is done. Only the main thread can own signals: an app
    served from another thread (tests) keeps uvicorn's handling.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []

    async def drain_then_exit() -> None:
        try:
            await drain.run(in_flight, stop)
        finally:
            # Streams of jobs that run elsewhere (another replica's, through a shared store) end
            # now, without a terminal event, for their clients to reconnect to another replica:
            # `Streams.watch` (gateway/server/stream.py) and sse-starlette's own responses watch
            # this flag, which uvicorn's SIGTERM handler would have set, had this one not replaced it.
            AppStatus.should_exit = True
            server = getattr(previous, "__self__", None)
            if isinstance(server, uvicorn.Server):
                # Not through its handle_exit: uvicorn raises a recorded signal again once it
                # is down, and the process would die of it instead of exiting 0.
                server.should_exit = True
            elif callable(previous):
                previous(signal.SIGTERM, None)

    def handle(sig: int, frame: FrameType | None) -> None:
        if tasks:  # asked again: stop now
            if callable(previous):
                previous(sig, frame)
            return
        # Signal handlers run on the main thread, which is the event loop's.
        tasks.append(loop.create_task(drain_then_exit()))

    signal.signal(signal.SIGTERM, handle)


def exit_cleanly(code: int = 0, besides: frozenset[threading.Thread] = frozenset()) -> None:
    """Once uvicorn has returned: return, for the process to exit as usual, or exit with `code`
    at once if a device's step is still running (of the threads the server started: not those
    `besides`, which were there before it, as other servers' are in a process that runs several).

    A step cannot be interrupted inside one native call (a forward pass over a
    long prompt), and its thread is a daemon. Were the interpreter to finalize
    around it, CPython (before 3.14) would end that thread with pthread_exit as
    it leaves torch's C++ code to take the GIL back, and that unwinding through
    a noexcept frame is std::terminate: "terminate called without an active
    exception", SIGABRT, after a drain that was otherwise clean. Waiting for the
    step instead could hold the exit past the supervisor's grace, so after
    STEP_WAIT_S the process leaves with `os._exit`: nothing is lost by skipping
    finalization, since every job has ended and its events have been written and
    copied to the store by now; the logs are flushed first.
    """
    if not handoff.wait_ended(STEP_WAIT_S, besides):
        return
    log.warning("a device is still inside a step of cancelled work; exiting without waiting for it")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
