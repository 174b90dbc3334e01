"""The job lifecycle: one job, its numbered event log, and the one terminal event.

A `Job` lives on the event loop. Everything that happens to it is appended to
its log as an encoded `Event` with the next `seq`; followers read the log from
any point and wait for more. The terminal invariant is enforced here and
nowhere else: the first `data` or `error` closes the log, and anything emitted
after it is dropped.

Run functions execute on worker threads; they reach their job through a
`JobContext`, which hops onto the loop through its worker's `Handoff`
(gateway/plumbing/handoff.py): the frames keep the order the tool emitted them in, and
the terminal event (set once the step's outcome has come back the same way)
always lands after them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable
from typing import IO, Any

import msgspec
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from gateway.usage import JobUsage
from gateway.protocol import (
    RETRYABLE,
    JobSnapshot,
    TerminalEvent,
    Code,
    ErrorFrame,
    ErrorInfo,
    Event,
    EventType,
    Kept,
    LogFrame,
    Progress,
    Status,
    StatusFrame,
    encode,
    kept_marker,
    now,
)
from gateway.checkpoints import Checkpoint
from gateway.eventlog import KeptLog, LiveLog
from gateway.encoding import to_json
from gateway.tools.base import Cancelled
from gateway.tools.files import MAX_FILES

log = logging.getLogger("streamgate.jobs")

PROGRESS_INTERVAL_S = 0.1  # RUNNING frames are coalesced to at most ~10/s per job


class Job:
    """One run of one tool, from RECEIVED to its terminal event."""

    # Its trace's span (started by admission, gateway/admission.py; the no-op one without tracing),
    # ended here with its terminal event, whose outcome is its status.
    span: trace.Span = trace.INVALID_SPAN

    def __init__(
        self,
        tool: str,
        params: Any,
        job_id: str | None = None,
        owner: str | None = None,
        tenant: str | None = None,
        weight: float = 1.0,
        after: int | None = None,
        priority: int = 0,
        timeout: float | None = None,
    ) -> None:
        self.id = job_id or os.urandom(16).hex()  # as uuid4().hex is random, without building a UUID
        # `after`: the seq its log starts after, for a job another gateway replica ran until it stopped,
        # that goes on here (gateway/server/redis_store/): its events before are in the shared store.
        self.taken_over = after is not None
        self.base = after or 0
        self.tool = tool
        self.owner = owner  # the token's name that started it; None without tokens
        # Whom its queue place counts against, and its share of turns (gateway/tenants.py, backends/queue.py).
        self.tenant = tenant if tenant is not None else owner or ""
        self.weight = weight
        self.priority = priority  # its class's (gateway/server/classes.py): served before lower ones
        # Preempted for a higher class's job (backends/workers.py): how often, the seconds it had run
        # (its time limit counts only those), and what its batch kept of it to go on from.
        # What it used (gateway/usage.py): written by the thread its work runs on, or from the terminal
        # frame of the process that ran it; read once it has ended.
        self.usage = JobUsage()
        self.preemptions = 0
        self.ran_s = 0.0
        self.kept: Any = None
        self.timeout = timeout  # its class's job_timeout, in seconds: the runner's own limit bounds it too
        self.params = params
        self.created = now()
        self.started: float | None = None
        self.finished: float | None = None
        self.status = Status.RECEIVED
        self.position: int | None = None
        self.last_progress: Progress | None = None
        self.idempotency_key: str | None = None
        self.request_digest = ""  # what the key was bound with (params.digest)
        # Its price (gateway/cost.py), where the backend that admitted it knows it: batches are cut by it.
        self.cost: Any = None
        # Called once with the job when its terminal event is appended (e.g. to free a per-token slot): `when_ended`.
        self.on_end: list[Callable[[Job], None]] = []
        self.on_start: list[Callable[[Job], None]] = []  # called once, as it first runs
        # Its log, packed; once it has ended, its events before the terminal one may be moved out of memory (`keep_log`).
        self.events: LiveLog | KeptLog = LiveLog(self.id, self.base)
        self.terminal: Event | None = None
        # Read by worker threads between steps, hence a threading.Event.
        self.cancel_requested = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._waiters: list[asyncio.Future[None]] = []  # followers waiting for the next event
        # Called with each event as it is appended, on the loop: a follower of many jobs (an executor's
        # session) takes their events in one pass, where a waiting task per job woke once per event.
        self.listeners: list[Callable[[Event], None]] = []
        self.files = ResultFiles(self.id)
        # Where its run keeps what it finished, for a run after a crash to go on from (gateway/checkpoints.py),
        # and how often it went on so.
        self.checkpoint: Checkpoint | None = None
        self.resumes = 0
        # Partial events sent before its log here began (`after`), and how many partials to drop: a run
        # that goes on from its checkpoint sends those it had sent again first, so that a stream shows each once.
        self.partials_earlier = 0
        self.skip_partials = 0
        # Whether a run of it can go on from its checkpoint (gateway/checkpoints.py `resumable`).
        self.resumable = False
        # Whether another gateway replica goes on with it: its checkpoint is that replica's (not removed as it ends here).
        self.handed_off = False
        self._pending_progress: Progress | None = None
        self._progress_timer: asyncio.TimerHandle | None = None
        self._last_progress = 0.0
        if self.taken_over:
            self.set_status(Status.QUEUED, message="the gateway replica that ran the job stopped; it goes on here from its last finished piece")
        else:
            self.set_status(Status.RECEIVED)

    @property
    def model(self) -> str | None:
        """The served model the job runs on (every tool's params carry it; see gateway/tools/base.py)."""
        return getattr(self.params, "model", None)

    # -- emitting (event loop only) ------------------------------------------

    def _append(self, type: EventType, data: bytes) -> Event | None:
        if self.terminal is not None:
            return None
        assert isinstance(self.events, LiveLog)  # a kept log is a finished job's
        event = Event(self.id, self.base + len(self.events) + 1, type, data)
        self.events.append(event)
        if event.terminal:
            self.terminal = event
            self.finished = now()
            self._drop_pending_progress()
            for callback in self.on_end:
                self._ended_with(callback)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # one follower's bug must not keep the event from the others
                log.exception("a listener of job %s failed", self.id)
        if event.terminal:
            self.listeners = []
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
        return event

    def next_seq(self) -> int:
        return self.base + len(self.events) + 1

    @property
    def last_seq(self) -> int:
        return self.base + len(self.events)

    def going_on(self) -> None:
        """Its run is to go on from its checkpoint: drop the partials the next run sends again."""
        self.skip_partials = self.partials_earlier + self.events.count(EventType.PARTIAL)

    def set_status(self, status: Status, **fields: Any) -> None:
        """Move to `status` and send a status frame (QUEUED again when the position moves)."""
        if self.terminal is not None:
            return
        self.status = status
        if status is Status.RUNNING and self.started is None:
            self.started = now()
            for callback in self.on_start:
                callback(self)
        if status is Status.QUEUED:
            self.position = fields.get("position")
        if fields.get("progress") is not None:
            self.last_progress = fields["progress"]
        frame = StatusFrame(self.id, self.next_seq(), status, now(), **fields)
        self._append(EventType.STATUS, encode(frame))

    def progress(self, done: int, total: int | None = None, unit: str | None = None) -> None:
        """Coalesce: at most one RUNNING frame per PROGRESS_INTERVAL_S, the newest update wins.

        A pending update waits for its slot even when other events go out first, so a
        progress frame may follow a log or partial emitted after it; the last pending
        update is sent just before the terminal event.
        """
        if self.terminal is not None:
            return
        self._pending_progress = Progress(done, total, unit)
        wait = self._last_progress + PROGRESS_INTERVAL_S - self._loop.time()
        if wait <= 0:
            self._flush_progress()
        elif self._progress_timer is None:
            self._progress_timer = self._loop.call_later(wait, self._flush_progress)

    def _flush_progress(self) -> None:
        progress, self._pending_progress = self._pending_progress, None
        self._drop_pending_progress()
        if progress is None or self.terminal is not None:
            return
        self._last_progress = self._loop.time()
        self.last_progress = progress
        frame = StatusFrame(self.id, self.next_seq(), Status.RUNNING, now(), progress=progress)
        self._append(EventType.STATUS, encode(frame))

    def _drop_pending_progress(self) -> None:
        if self._progress_timer is not None:
            self._progress_timer.cancel()
            self._progress_timer = None

    def log(self, message: str, level: str = "info") -> None:
        frame = LogFrame(self.id, self.next_seq(), now(), level, message)
        self._append(EventType.LOG, encode(frame))

    def partial(self, obj: Any) -> None:
        if self.skip_partials:
            self.skip_partials -= 1  # sent before this run went on from its checkpoint
            return
        self._append(EventType.PARTIAL, encode(obj))

    def succeed(self, result: Any) -> None:
        self._flush_progress()
        if self._append(EventType.DATA, encode(result)) is not None and self.span.is_recording():
            self.span.set_status(StatusCode.OK)
            self.span.end()

    def fail(self, code: Code, message: str) -> None:
        """End with an `error` event (no-op if the job already ended)."""
        info = ErrorInfo(code=code, message=message, retryable=code in RETRYABLE)
        self._flush_progress()
        if self._append(EventType.ERROR, encode(ErrorFrame(self.id, self.next_seq(), info))) is not None:
            self.files.discard()
            end_span(self.span, code, message)

    def cancel(self) -> None:
        """Ask the work to stop. A queued job is failed by its queue; a running one by its worker."""
        self.cancel_requested.set()

    @property
    def done(self) -> bool:
        return self.terminal is not None

    def when_ended(self, callback: Callable[[Job], None]) -> None:
        """Call `callback` with the job once its terminal event is appended, or now if it has been: a
        job can end before the call that queued it returns (an engine's frames may come with its
        answer to the submit, backends/remote.py), and what it held must be given back all the same."""
        if self.terminal is not None:
            self._ended_with(callback)
        else:
            self.on_end.append(callback)

    def _ended_with(self, callback: Callable[[Job], None]) -> None:
        try:
            callback(self)
        except Exception:  # one bookkeeping bug must not keep the others from running
            log.exception("an end-of-job callback failed for job %s", self.id)

    def keep_result(self, kept: Kept) -> None:
        """Its result now lies in `kept` (the spool): the log and the terminal event refer to it there."""
        terminal = self.terminal
        assert terminal is not None and self.events.terminal is terminal
        self.terminal = self.events.terminal = terminal.spooled(kept)

    def keep_log(self, kept: Kept) -> None:
        """Its events before the terminal one (`events.data`) now lie in `kept`: its log holds its
        terminal event and an index of 9 bytes an event."""
        assert self.terminal is not None and isinstance(self.events, LiveLog)
        self.events = self.events.kept_in(kept)

    @property
    def state(self) -> str:
        """The status a listing shows: the terminal's outcome once there is one."""
        terminal = self.terminal
        if terminal is None:
            return self.status.value
        return "SUCCEEDED" if terminal.type is EventType.DATA else "FAILED"

    def snapshot(self, kept: list[Kept] | None = None) -> JobSnapshot:
        """Where it stands; with `kept`, a result in the spool is a `kept_marker` in it, not read whole."""
        terminal = self.terminal
        return JobSnapshot(
            job_id=self.id,
            tool=self.tool,
            status=self.state,
            created=self.created,
            model=self.model,
            started=self.started,
            finished=self.finished,
            position=self.position if self.status is Status.QUEUED and terminal is None else None,
            progress=self.last_progress,
            last_event_id=f"{self.id}:{self.last_seq}" if len(self.events) else None,
            terminal=terminal_event(terminal, kept) if terminal else None,
            owner=self.owner,
        )

    # -- following ------------------------------------------------------------

    async def wait_events(self, after: int, timeout: float | None = None) -> list[Event]:
        """Events with seq > `after`, waiting up to `timeout` for one; [] on timeout. As many as a
        piece holds (at least one): the follower asks again for the rest."""
        if isinstance(self.events, KeptLog):
            return await self.events.after(after)
        # (a job that went on here has only its newer events in this log)
        if len(self.events) <= max(0, after - self.base) and self.terminal is None:
            # A bare future and a timer: no Event per appended event, no task per wait
            # (asyncio.wait_for makes one), for the many followers a gateway holds.
            waiter = self._loop.create_future()
            self._waiters.append(waiter)
            timer = self._loop.call_later(timeout, _expire, waiter) if timeout is not None else None
            try:
                await waiter
            finally:
                if timer is not None:
                    timer.cancel()
                if waiter.cancelled() or waiter.result() is _TIMED_OUT:
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(waiter)
            if waiter.result() is _TIMED_OUT:
                return []
        return self.events.after(after)


_TIMED_OUT = object()

_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class ResultFiles:
    """The files a job's run writes beside its result (a per-position array, a feature track).

    The backend that runs the job names the `folder` (none: this backend keeps no files, and a
    tool asked for one is refused at admission). The run opens each through its `Context.file`;
    a file is `{folder}/{job id}.{name}`. If the job does not succeed they are deleted with its
    terminal event, even one a run still writes to (its descriptor writes into an unlinked file);
    if it does, whatever keeps its result `take`s them (a gateway's spool, an executor until its
    gateway has fetched them) and `kept` holds them as the store keeps them, each read a piece at
    a time, until `discard`.
    """

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.folder: str | None = None
        # A run that goes on from a checkpoint (gateway/checkpoints.py): its files, in the checkpoint's
        # folder, hold the rows the runs before it wrote, and are opened as they are.
        self.resumed = False
        # Whether its folder is its checkpoint's: its files are then the checkpoint's too, removed with it
        # (a run that stops there leaves them for the next, in this process or in another gateway's).
        self.in_checkpoint = False
        self.paths: dict[str, str] = {}
        self.kept: dict[str, Kept] = {}
        self._lock = threading.Lock()  # runs open files on their threads; the loop ends the job
        self._closed = False

    def open(self, name: str) -> IO[bytes]:
        """A new file `name` of the job's result, open for writing and reading (the run's thread)."""
        if not _FILE_NAME.fullmatch(name):
            raise ValueError(f"result file name {name!r}: letters, digits, '.', '_' and '-', at most 128")
        with self._lock:
            if self._closed or self.folder is None:
                # The job ended meanwhile (its batch goes on for the others), or a backend that keeps
                # none was asked anyway: its writes go to a file nobody will see.
                if self.folder is None and not self._closed:
                    raise RuntimeError("this backend keeps no result files")
                return tempfile.TemporaryFile(dir=self.folder if self.folder and os.path.isdir(self.folder) else None)
            if name not in self.paths and len(self.paths) >= MAX_FILES:
                raise RuntimeError(f"result file {name!r}: a job writes at most {MAX_FILES} files")
            path = os.path.join(self.folder, f"{self.job_id}.{name}")
            if self.resumed and os.path.exists(path):  # (its run again alone after its batch failed too)
                self.paths[name] = path
                return open(path, "r+b")
            # Written again when a job's work is run again alone after its batch failed: a new file, so
            # that what the first try still holds open (a bigWig finishing as it is freed) writes elsewhere.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self.paths[name] = path
            return open(path, "x+b")

    def __bool__(self) -> bool:
        return bool(self.paths or self.kept)

    def take(self) -> dict[str, str]:
        """The files written (name → path), for the caller to keep: the job succeeded."""
        with self._lock:
            self._closed = True
            paths, self.paths = self.paths, {}
        return paths

    def discard(self) -> None:
        """Delete the files written and release those kept: the job failed, or is forgotten."""
        with self._lock:
            self._closed = True
            paths, self.paths = self.paths, {}
        for path in paths.values() if not self.in_checkpoint else ():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        kept, self.kept = self.kept, {}
        for record in kept.values():
            record.release()


def terminal_event(event: Event, kept: list[Kept] | None = None) -> TerminalEvent:
    """A snapshot's `terminal`: its data whole, or (`kept`) a marker for a result in the spool."""
    if event.kept is not None and kept is not None:
        return TerminalEvent(event.type.value, kept_marker(kept, event.kept))
    return TerminalEvent(event.type.value, msgspec.Raw(event.data))


def time_limit(runner: float, job: Job) -> float:
    """The seconds `job` may run: the runner's limit (`--job-timeout`; 0: none) and its class's, the
    smaller; 0 for no limit."""
    limits = [limit for limit in (runner, job.timeout) if limit]
    return min(limits) if limits else 0.0


def end_span(span: trace.Span, code: Code, message: str) -> None:
    """End a job's span, or its admission's, with the error `code` as its status."""
    if span.is_recording():
        span.set_attribute("streamgate.code", code.value)
        span.set_status(StatusCode.ERROR, f"{code.value}: {message}")
        span.end()


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_result(_TIMED_OUT)


class JobContext:
    """The `Context` a run function gets: thread-safe, forwards onto the job's loop through `post`
    (a worker's `Handoff.post`; by default `call_soon_threadsafe`, a wake-up per frame)."""

    # The span of the job's run on a device (backends/workers.py), its steps' and encoding's parent.
    span: trace.Span = trace.INVALID_SPAN

    def __init__(self, job: Job, post: Callable[..., Any] | None = None) -> None:
        self.job_id = job.id
        self._job = job
        self._call = post or job._loop.call_soon_threadsafe
        self._begun = False

    def begin(self) -> None:
        """The job's work starts now, on this thread: RUNNING (once, however often its work is retried)."""
        if not self._begun:
            self._begun = True
            self._call(self._job.set_status, Status.RUNNING)

    def progress(self, done: int, total: int | None = None, unit: str | None = None) -> None:
        self._call(self._job.progress, done, total, unit)

    def log(self, message: str, level: str = "info") -> None:
        self._call(self._job.log, str(message), level)

    def count(self, tokens_in: int = 0, tokens_out: int = 0) -> None:
        # On the thread the work runs on, straight into the job's count: only that thread writes it
        # while the job runs, and the loop reads it after the job's end, which that thread posts.
        usage = self._job.usage
        usage.tokens_in += tokens_in
        usage.tokens_out += tokens_out

    @property
    def usage(self) -> JobUsage:
        """The job's count, for its worker to add device-seconds to."""
        return self._job.usage

    def partial(self, obj: Any) -> None:
        # Encode now, on the worker thread: the tool may reuse `obj` afterwards.
        self._call(self._job.partial, msgspec.Raw(to_json(obj)))

    @property
    def cancelled(self) -> bool:
        return self._job.cancel_requested.is_set()

    def raise_if_cancelled(self) -> None:
        if self.cancelled:
            raise Cancelled()

    def file(self, name: str) -> IO[bytes]:
        return self._job.files.open(name)

    @property
    def checkpoint(self) -> Checkpoint | None:
        return self._job.checkpoint
