"""A device's thread, and the way its work gets back to the event loop.

Model work never runs on the event loop, and the hops between the two are the
cost a cheap job pays most often, so both directions are kept to one
wake-up where there could be many:

- `DeviceThread` is one long-lived thread per device, fed by a queue. A step
  of work is a queue entry; nothing is submitted to an executor per step (a
  `ThreadPoolExecutor` submit allocates a future, a work item and a wrapper
  future, and wakes the loop through its own callback).
- `Handoff` carries everything a thread sends to the loop, the tool's frames
  (progress, logs, partials) and each step's outcome, in the order sent. A
  thread's calls are buffered, and the loop is woken only when the buffer goes
  from empty to non-empty: a burst of frames and the step's result that ends
  it usually cost one `call_soon_threadsafe` (one write to the loop's
  self-pipe), where one per frame cost nine for a small job. Because frames
  and outcomes share one buffer, a job's terminal event always lands after
  every frame its tool emitted.
- `call_between` is the other way in: work that runs at the next stop point
  of a long pass under way (backends/stopping.py), inside it, on the same
  thread, so that another tenant's short job waits one piece of a long pass,
  not all of it (backends/workers.py decides what may).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("streamgate.worker")

# Every device thread that has not ended yet, for the process's exit (gateway/plumbing/drain.py).
_alive: set[threading.Thread] = set()
_local = threading.local()
_BETWEEN = object()  # a wake-up in a thread's queue: run the work waiting to run between (`call_between`)


def current() -> DeviceThread | None:
    """The device thread this code runs on, if any."""
    return getattr(_local, "device", None)


def alive() -> frozenset[threading.Thread]:
    """The device threads alive now."""
    return frozenset(_alive)


def wait_ended(timeout: float, besides: frozenset[threading.Thread] = frozenset()) -> int:
    """Wait up to `timeout` s for every device thread but those `besides` to end; how many have not.

    A stopped thread ends after the step it is in; one never stopped waits for work (and counts).
    """
    deadline = time.monotonic() + timeout
    threads = [thread for thread in list(_alive) if thread not in besides]
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sum(thread.is_alive() for thread in threads)


class Handoff:
    """Calls from other threads run on one event loop, in order, woken once per burst."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._calls: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the loop, after everything posted before it (any thread)."""
        with self._lock:
            self._calls.append((fn, args))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: the process is going down, nobody is left to tell
            pass

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    self._scheduled = False
                    return
                calls, self._calls = self._calls, collections.deque()
            for fn, args in calls:
                try:
                    fn(*args)
                except Exception:  # one bad callback must not lose the frames behind it
                    log.exception("a call handed to the event loop failed")


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # its awaiter was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class DeviceThread:
    """One thread that runs a device's work in order; `call` returns an awaitable of the outcome."""

    def __init__(self, name: str, handoff: Handoff) -> None:
        self.handoff = handoff
        self._work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Work to run at the next stop point of the long pass under way (`call_between`), and how
        # deep in such work the thread is now: a pass let through runs inside another, never a third.
        self._between: collections.deque[tuple[asyncio.Future[Any], Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        self.depth = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        _alive.add(self._thread)
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Run `fn(*args)` on this thread after the work queued before it (event loop only)."""
        future = self.handoff.loop.create_future()
        self._work.put((future, fn, args))
        return future

    def call_between(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Run `fn(*args)` at the next stop point of the long pass this thread is in (backends/stopping.py
        calls `run_between` there), or, in none, before the work queued before it (event loop only):
        how a short job of another tenant gets a turn inside a pass that runs for many seconds."""
        future = self.handoff.loop.create_future()
        self._between.append((future, fn, args))
        self._work.put(_BETWEEN)  # wakes an idle thread; after a pass, runs what it did not reach
        return future

    @property
    def waiting_between(self) -> bool:
        return bool(self._between)

    def run_between(self, every: bool = False) -> None:
        """On this thread, at a stop point: run the next work waiting to run between, one deeper (a
        piece of the pass goes between two of them, however many wait); `every`: all of it (no pass
        is under way)."""
        if self.depth or not self._between:
            return
        self.depth += 1
        try:
            while self._between:
                future, fn, args = self._between.popleft()
                self._settle_call(future, fn, args)
                if not every:
                    break
        finally:
            self.depth -= 1

    def soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on this thread after the work queued before it, and report nothing back:
        housekeeping that no one awaits (any thread)."""
        self._work.put((None, fn, args))

    def stop(self) -> None:
        """Drop the work not yet started; the thread ends after the step it is in, if any."""
        while True:
            try:
                item = self._work.get_nowait()
            except queue.Empty:
                break
            if item is not None and item is not _BETWEEN and item[0] is not None:
                item[0].cancel()
        while self._between:
            self._between.popleft()[0].cancel()
        self._work.put(None)

    def _run(self) -> None:
        _local.device = self
        try:
            self._serve()
        finally:
            _alive.discard(self._thread)

    def _settle_call(self, future: asyncio.Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(*args), None)
        except BaseException as exc:  # noqa: BLE001 - every outcome goes back to its awaiter
            outcome = (None, exc)
        self.handoff.post(_settle, future, *outcome)

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            if item is _BETWEEN:
                self.run_between(every=True)
                continue
            future, fn, args = item
            if future is None:
                try:
                    fn(*args)
                except Exception:  # housekeeping must never end the device's thread
                    log.exception("housekeeping on a device's thread failed")
                item = fn = args = None  # type: ignore[assignment]
                continue
            self._settle_call(future, fn, args)
            # No reference to the last step's inputs or outputs while the thread idles.
            item = future = fn = args = None  # type: ignore[assignment]
