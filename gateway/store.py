"""Where jobs live after their first connection: lookup, idempotency keys, detach, retention.

A client that disconnects detaches from its job; the job runs on. Any client
may attach again (`GET /jobs/{id}/events`, or an `EventSource` reconnecting
with `Last-Event-ID`) and read on from where it left off, because a job keeps
its whole event log. A job nobody has been attached to for `detach_grace`
seconds is cancelled (0: at once, as when a disconnect meant cancel). Finished
jobs, their logs and their idempotency keys are kept for `retention` seconds,
then forgotten (404).

`MemoryStore` keeps all this in this process, for one gateway.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Callable

from gateway.jobs import Job

SWEEP_INTERVAL_S = 1.0


class JobStore(abc.ABC):
    """The jobs a gateway can find again by id or by idempotency key."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    def claim(self, key: str) -> Job | None:
        """The live job started with idempotency `key`, if there is one."""

    @abc.abstractmethod
    def add(self, job: Job, key: str | None = None) -> None:
        """Keep `job` (under `key` too, when given)."""

    @abc.abstractmethod
    def get(self, job_id: str) -> Job | None:
        """The job, or None if unknown or past its retention."""

    @abc.abstractmethod
    def attach(self, job: Job) -> None:
        """A client now follows `job`."""

    @abc.abstractmethod
    def detach(self, job: Job) -> None:
        """A client stopped following `job`; with none left for `detach_grace`, it is cancelled."""


class MemoryStore(JobStore):
    def __init__(
        self,
        cancel: Callable[[Job], None],
        *,
        detach_grace: float = 30.0,
        retention: float = 600.0,
    ) -> None:
        self._cancel = cancel
        self.detach_grace = detach_grace
        self.retention = retention
        self.jobs: dict[str, Job] = {}
        self.keys: dict[str, str] = {}
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

    def claim(self, key: str) -> Job | None:
        job_id = self.keys.get(key)
        return self.jobs.get(job_id) if job_id else None

    def add(self, job: Job, key: str | None = None) -> None:
        self.jobs[job.id] = job
        if key:
            self.keys[key] = job.id
            job.idempotency_key = key

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def attach(self, job: Job) -> None:
        self._attached[job.id] = self._attached.get(job.id, 0) + 1
        timer = self._timers.pop(job.id, None)
        if timer is not None:
            timer.cancel()

    def detach(self, job: Job) -> None:
        left = self._attached.get(job.id, 1) - 1
        self._attached[job.id] = left
        if left > 0 or job.done:
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
            now = time.time()
            for job in list(self.jobs.values()):
                if job.finished is not None and now - job.finished > self.retention:
                    self._forget(job)

    def _forget(self, job: Job) -> None:
        self.jobs.pop(job.id, None)
        self._attached.pop(job.id, None)
        key = getattr(job, "idempotency_key", None)
        if key and self.keys.get(key) == job.id:
            del self.keys[key]
