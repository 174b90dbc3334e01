"""Where jobs live after their first connection: lookup, idempotency keys, detach, retention.

A client that disconnects detaches from its job; the job runs on. Any client
may attach again (`GET /jobs/{id}/events`, or an `EventSource` reconnecting
with `Last-Event-ID`) and read on from where it left off, because a job keeps
its whole event log. A job nobody has been attached to for `detach_grace`
seconds is cancelled (0: at once, as when a disconnect meant cancel). Finished
jobs, their logs and their idempotency keys are kept for `retention` seconds,
then forgotten (404).

`MemoryStore` keeps all this in this process, for one gateway. `GET /jobs`
lists the jobs kept, a page at a time (`JobsQuery`). Its memory is bounded in
bytes, not only in time: a finished job's result goes to the result spool on
disk (gateway/plumbing/spool.py) when it is big, and so do its other events
(thousands of partials of a long generation) when they are (gateway/jobs.py
`KeptLog`); any job's do once the finished jobs' logs held in memory pass
`memory_budget` bytes. Readers then read that one copy a piece at a time. And in
count: past `max_finished` finished jobs (`--max-finished-jobs`) the oldest are
forgotten before their retention ends, since each costs a few KB of its own
beside its log, and a busy gateway ends hundreds a second.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import heapq
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from gateway.admission import Admission, Binding
from gateway.errors import ParamError
from gateway.eventlog import KEPT_EVENT, KeptLog, LiveLog
from gateway.jobs import Job
from gateway.plumbing.spool import SPOOL_FROM, ResultSpool
from gateway.protocol import Event, EventType, JobList, JobSnapshot, Kept

log = logging.getLogger("streamgate.store")

SWEEP_INTERVAL_S = 1.0
# --result-memory-bytes' default: the finished jobs' logs this store holds in memory before every result goes to the spool.
DEFAULT_MEMORY_BUDGET = 64 << 20
# What the terminal event costs in memory besides its data (the Event and its bytes object); the
# others are packed (gateway/eventlog.py, `KEPT_EVENT` each): counted against the budget too.
EVENT_OVERHEAD = 100

# `GET /jobs?state=`: a status (in lower case), or a group of them.
STATE_GROUPS = {"active": ("RECEIVED", "QUEUED", "DISPATCHED", "RUNNING"), "finished": ("SUCCEEDED", "FAILED")}
STATES = ("received", "queued", "dispatched", "running", "succeeded", "failed", *STATE_GROUPS)
MAX_PAGE = 500


class StoreUnavailable(RuntimeError):
    """A shared store stayed unreachable past its outage grace while a job was followed from it."""


class StoppedFollowing(StoreUnavailable):
    """This process is shutting down: jobs that run elsewhere are no longer followed from here."""


class JobHandle(Protocol):
    """What following a job needs: a `Job` on the replica that runs it, a view of it elsewhere."""

    id: str

    @property
    def terminal(self) -> Event | None: ...

    @property
    def done(self) -> bool: ...

    async def wait_events(self, after: int, timeout: float | None = None) -> list[Event]: ...

    def snapshot(self, kept: list[Kept] | None = None) -> JobSnapshot: ...


class JobStore(abc.ABC):
    """The jobs a gateway can find again by id or by idempotency key."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    async def reserve(self, key: str, job_id: str, request: str) -> Binding | None:
        """Bind idempotency `key` to `job_id`, started by `request` (a digest of the tool and its
        params), unless it is bound already: then what it is bound to."""

    @abc.abstractmethod
    async def release(self, key: str, job_id: str) -> None:
        """Unbind `key` from `job_id` (its job was refused before it started)."""

    @abc.abstractmethod
    async def add(self, job: Job) -> None:
        """Keep `job`, which runs on this replica."""

    @abc.abstractmethod
    async def get(self, job_id: str, *, to_follow: bool = False) -> JobHandle | None:
        """The job, or None if unknown or past its retention. `to_follow`: the caller wants its
        events, not a fresh snapshot (a shared store may then answer from what it already reads)."""

    @abc.abstractmethod
    async def snapshots(self, kept: list[Kept] | None = None) -> list[JobSnapshot]:
        """Every job kept (running, or finished within retention), on every replica sharing the store;
        with `kept`, results in the spool as markers (gateway/protocol.py `splice`)."""

    @abc.abstractmethod
    async def listed(self, query: JobsQuery, whose: str | None, kept: list[Kept]) -> JobList:
        """`GET /jobs`'s page of the jobs `query` wants: those the token named `whose` started, or
        with None every job."""

    @abc.abstractmethod
    async def cancel(self, job: JobHandle) -> None:
        """Cancel the job wherever it runs."""

    def stop_following(self) -> None:
        """The process is shutting down: every wait on a job that runs elsewhere raises
        `StoppedFollowing` (a store that keeps only this process's jobs has none)."""

    def results_kept(self) -> dict[str, int]:
        """Where this process keeps finished results (`FinishedResults.facts`)."""
        return {}

    async def followed(self, job: Job) -> JobHandle:
        """What a client of `job`, just admitted here, follows: the job (or, in a shared store, its
        record there, when the job may go on in another process)."""
        return job

    async def hand_off(self) -> None:
        """This process stops: its jobs that can go on in another are left to it (a shared store's)."""

    def takes_over(self, admission: Admission, ready: Callable[[], bool], webhooks: Any = None) -> None:
        """Jobs that another process ran until it stopped go on in this one, admitted through
        `admission` while `ready()` (a store that keeps only this process's jobs has none), their
        completion webhooks (`webhooks`) delivered from here."""

    @abc.abstractmethod
    def attach(self, job: JobHandle) -> None:
        """A client now follows `job`."""

    @abc.abstractmethod
    def detach(self, job: JobHandle) -> None:
        """A client stopped following `job`; with none left for `detach_grace`, it is cancelled."""


class FinishedResults:
    """The finished jobs a store keeps in this process: their logs' bytes counted against
    `memory_budget`, and a big result (any result, past the budget) moved to the spool, its job's
    terminal event then reading it from there (`Job.keep_result`). A result the spool cannot take
    (a full or failing disk) stays in memory: never dropped before its retention ends."""

    def __init__(self, spool: ResultSpool | None, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> None:
        self.spool = spool
        self.memory_budget = memory_budget
        self.in_memory = 0  # bytes of the finished jobs' logs held here
        self._held: dict[str, int] = {}  # each finished job's share of `in_memory`
        self._kept: dict[str, Job] = {}  # the jobs counted, until forgotten
        self._spooling: set[asyncio.Task[None]] = set()
        self._files: ResultSpool | None = None

    def ended(self, job: Job) -> None:
        """Count `job`'s log, or move its result and its other events to the spool (on a task: the
        writes are a thread's)."""
        if job.id in self._kept:
            return
        self._kept[job.id] = job
        if job.files:
            self._keep_files(job)
        terminal, events = job.terminal, job.events
        assert terminal is not None and isinstance(events, LiveLog)
        log_size = events.data_size + KEPT_EVENT * len(events.kinds)
        size = log_size + terminal.size + EVENT_OVERHEAD
        over = self.in_memory + size > self.memory_budget
        result_out = terminal.type is EventType.DATA and terminal.kept is None and (terminal.size >= SPOOL_FROM or over)
        log_out = bool(events.kinds) and (log_size >= SPOOL_FROM or over)
        if self.spool is not None and (result_out or log_out):
            task = asyncio.get_running_loop().create_task(self._spool(job, size, result_out, log_out))
            self._spooling.add(task)
            task.add_done_callback(self._spooling.discard)
        else:
            self._count(job, size)

    def forget(self, job: Job) -> None:
        job.files.discard()  # kept, or never taken (a job forgotten before it was counted)
        if self._kept.pop(job.id, None) is None:
            return
        self.in_memory -= self._held.pop(job.id, 0)
        if job.terminal is not None and job.terminal.kept is not None:
            job.terminal.kept.release()
        if isinstance(job.events, KeptLog):
            job.events.kept.release()

    def facts(self) -> dict[str, int]:
        """Where finished results are: bytes in memory, and the spool's facts (`ResultSpool.describe`)."""
        return {"memory_bytes": self.in_memory, **(self.spool.describe() if self.spool is not None else {})}

    def stop(self) -> None:
        for task in list(self._spooling):
            task.cancel()
        for spool in (self.spool, self._files):
            if spool is not None:
                spool.close()

    def _keep_files(self, job: Job) -> None:
        """The files the job wrote beside its result, into the spool as they are (open and unlink: no
        copy, nothing read); a file that cannot be opened is gone, and its job's `kept` lacks it."""
        if self.spool is None and self._files is None:  # a store that keeps results in memory keeps files on disk still
            self._files = ResultSpool(retention=0)
        spool = self.spool or self._files
        assert spool is not None
        for name, path in job.files.take().items():
            try:
                job.files.kept[name] = spool.adopt(path)
            except OSError as exc:
                log.error("job %s: its result file %s could not be kept (%s)", job.id, name, exc)

    def _count(self, job: Job, size: int) -> None:
        self._held[job.id] = size
        self.in_memory += size

    async def _spool(self, job: Job, size: int, result_out: bool, log_out: bool) -> None:
        """Move the result (`result_out`) and the events before it (`log_out`) to the spool; what the
        spool cannot take (a full or failing disk) stays in memory, counted: never dropped."""
        assert self.spool is not None and job.terminal is not None and isinstance(job.events, LiveLog)
        terminal, events = job.terminal, job.events
        if result_out:
            kept = await self._keep(job, "result", terminal.raw)
            if kept is not None:
                job.keep_result(kept)
                size -= terminal.size
        if log_out:
            kept = await self._keep(job, "events", memoryview(events.data))
            if kept is not None:
                job.keep_log(kept)
                size -= events.data_size
        if self._kept.get(job.id) is job:
            self._count(job, size)

    async def _keep(self, job: Job, what: str, data: bytes) -> Kept | None:
        assert self.spool is not None
        try:
            kept = await self.spool.keep(data)
        except OSError as exc:
            log.warning("job %s: its %s could not be spooled (%s); kept in memory", job.id, what, exc)
            return None
        if self._kept.get(job.id) is not job:  # forgotten meanwhile (retention 0)
            kept.release()
            return None
        return kept


class MemoryStore(JobStore):
    def __init__(
        self,
        cancel: Callable[[Job], None],
        *,
        detach_grace: float = 30.0,
        retention: float = 600.0,
        results: ResultSpool | None = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        max_finished: int = 10_000,
    ) -> None:
        self._cancel = cancel
        self.detach_grace = detach_grace
        self.retention = retention
        self.max_finished = max_finished
        self._finished: collections.OrderedDict[str, Job] = collections.OrderedDict()  # in the order they ended
        self.results = results  # where admission finds room for a priced result (gateway/admission.py `Room`)
        self.finished = FinishedResults(results, memory_budget)
        self.jobs: dict[str, Job] = {}
        self.keys: dict[str, Binding] = {}
        self._reserved: set[str] = set()  # ids bound to a key whose job is being admitted
        self._attached: dict[str, int] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for timer in self._timers.values():
            timer.cancel()
        self.finished.stop()

    async def reserve(self, key: str, job_id: str, request: str) -> Binding | None:
        bound = self.keys.get(key)
        if bound is not None and (bound.job_id in self.jobs or bound.job_id in self._reserved):
            return bound
        self.keys[key] = Binding(job_id, request)
        self._reserved.add(job_id)
        return None

    async def release(self, key: str, job_id: str) -> None:
        self._reserved.discard(job_id)
        bound = self.keys.get(key)
        if bound is not None and bound.job_id == job_id:
            del self.keys[key]

    async def add(self, job: Job) -> None:
        self._reserved.discard(job.id)
        self.jobs[job.id] = job
        if job.done:
            self._ended(job)
        else:
            job.on_end.append(self._ended)

    def _ended(self, job: Job) -> None:
        if self.jobs.get(job.id) is job:
            self.finished.ended(job)
            self._finished[job.id] = job
            while len(self._finished) > self.max_finished:
                self._forget(next(iter(self._finished.values())))

    def results_kept(self) -> dict[str, int]:
        return self.finished.facts()

    async def get(self, job_id: str, *, to_follow: bool = False) -> Job | None:
        return self.jobs.get(job_id)

    async def snapshots(self, kept: list[Kept] | None = None) -> list[JobSnapshot]:
        return [job.snapshot(kept) for job in self.jobs.values()]

    async def listed(self, query: JobsQuery, whose: str | None, kept: list[Kept]) -> JobList:
        # Only the page's jobs are made snapshots: the others are passed over on what they are.
        wanted = [job for job in self.jobs.values() if (whose is None or job.owner == whose) and query.wants_job(job)]
        return query.page_of(wanted, kept)

    async def cancel(self, job: JobHandle) -> None:
        if isinstance(job, Job) and not job.done:
            self._cancel(job)

    def attach(self, job: JobHandle) -> None:
        self._attached[job.id] = self._attached.get(job.id, 0) + 1
        timer = self._timers.pop(job.id, None)
        if timer is not None:
            timer.cancel()

    def detach(self, job: JobHandle) -> None:
        left = self._attached.get(job.id, 1) - 1
        if left > 0:
            self._attached[job.id] = left
            return
        self._attached.pop(job.id, None)  # none left (a stream may outlive its job's retention: never 0 kept)
        if job.done or not isinstance(job, Job):
            return
        if self.detach_grace <= 0:
            self._cancel(job)
        else:
            loop = asyncio.get_running_loop()
            self._timers[job.id] = loop.call_later(self.detach_grace, self._expire_detached, job)

    def _expire_detached(self, job: Job) -> None:
        self._timers.pop(job.id, None)
        if self._attached.get(job.id, 0) == 0 and not job.done:
            self._cancel(job)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self._forget_expired(time.time())

    def _forget_expired(self, now: float) -> None:
        # A function of its own, so that no local of the sleeping sweep still holds the last job
        # forgotten (and its result) until another comes. The oldest ended first: only those due are read.
        while self._finished:
            job = next(iter(self._finished.values()))
            if job.finished is not None and now - job.finished <= self.retention:
                return
            self._forget(job)

    def _forget(self, job: Job) -> None:
        self.jobs.pop(job.id, None)
        self._finished.pop(job.id, None)
        self._attached.pop(job.id, None)
        self.finished.forget(job)
        key = job.idempotency_key
        bound = self.keys.get(key) if key else None
        if bound is not None and bound.job_id == job.id:
            del self.keys[key]


class JobsQuery:
    """`GET /jobs`'s query: which states, how many per page, and where the page starts."""

    def __init__(self, state: str | None, limit: int, cursor: tuple[float, str] | None) -> None:
        self.statuses = None if state is None else STATE_GROUPS.get(state, (state.upper(),))
        self.limit = limit
        self.cursor = cursor

    def wants(self, snapshot: JobSnapshot) -> bool:
        return self.statuses is None or snapshot.status in self.statuses

    def wants_job(self, job: Job) -> bool:
        """`wants` of the job's snapshot, read from the job itself."""
        if self.statuses is None:
            return True
        return job.state in self.statuses

    def page(self, snapshots: list[JobSnapshot]) -> JobList:
        """Newest first, after the cursor; `next` set when more follow."""
        ordered = sorted(snapshots, key=lambda s: (s.created, s.job_id), reverse=True)
        if self.cursor is not None:
            ordered = [s for s in ordered if (s.created, s.job_id) < self.cursor]
        page = ordered[: self.limit]
        more = len(ordered) > self.limit
        return JobList(page, f"{page[-1].created!r}:{page[-1].job_id}" if more else None)

    def page_of(self, jobs: list[Job], kept: list[Kept]) -> JobList:
        """`page` of these jobs, made snapshots only once on the page: linear in their number."""
        after = [job for job in jobs if self.cursor is None or (job.created, job.id) < self.cursor]
        first = heapq.nlargest(self.limit + 1, after, key=lambda job: (job.created, job.id))
        page = [job.snapshot(kept) for job in first[: self.limit]]
        more = len(first) > self.limit
        return JobList(page, f"{page[-1].created!r}:{page[-1].job_id}" if more else None)


def jobs_query(request: Any) -> JobsQuery:
    """The query of `GET /jobs`, or 422 naming the key at fault."""
    q = request.query_params
    state = q.get("state")
    if state is not None and state not in STATES:
        raise ParamError("state", f"one of {', '.join(STATES)}")
    try:
        limit = int(q.get("limit", 50))
    except ValueError:
        raise ParamError("limit", "expected an integer") from None
    if not 1 <= limit <= MAX_PAGE:
        raise ParamError("limit", f"expected an integer from 1 to {MAX_PAGE}")
    cursor = None
    if "cursor" in q:
        created, _, job_id = q["cursor"].partition(":")
        try:
            cursor = (float(created), job_id)
        except ValueError:
            raise ParamError("cursor", "not a cursor this gateway gave (the `next` of a page)") from None
    return JobsQuery(state, limit, cursor)
