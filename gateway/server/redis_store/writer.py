"""The owner's copy of its jobs' events into Redis (a part of `RedisStore`): one task a job follows its
log and copies each batch of events with the job's snapshot (`scripts.MIRROR`), once, in order,
across Redis outages and restarts."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
from redis.exceptions import RedisError

from gateway.jobs import Job
from gateway.plumbing.spool import SPOOL_FROM
from gateway.protocol import Code, Event, EventType, TerminalEvent, encode

log = logging.getLogger("streamgate.redis")


class Writing:
    """A part of `RedisStore`: its jobs' events copied to Redis."""

    def _restart_mirror(self, job: Job) -> None:
        old = self._mirrors.get(job.id)
        if old is not None:
            old.cancel()
        self._mirrors[job.id] = asyncio.create_task(self._mirror(job), name=f"mirror {job.id}")

    async def _mirror(self, job: Job) -> None:
        written = job.base  # a job taken over: its events before are there already
        delay = 0.05
        failing = False
        while not self._closing:
            if job.last_seq <= written and job.terminal is None:
                await job.wait_events(written)
            events = job.events[written - job.base :]
            if not events:
                return
            try:
                if job.handed_off and events[-1].terminal:
                    # Its run here stopped for another replica to go on with it: its end here is not the
                    # job's, and it is left (unless another took it over). What it sent and Redis lacks
                    # nobody read (its clients follow it there); the replica going on sends its own.
                    await self._left(job)
                    return
                ok = await self._copy(job, events)
            except RedisError as exc:
                if not failing:
                    log.warning("job %s: cannot copy events to Redis, retrying: %s", job.id, exc)
                failing = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if failing:
                log.info("job %s: events reach Redis again", job.id)
            failing, delay = False, 0.05
            if ok == 3:
                self._handed_off(job)
                return
            if ok == 2:
                if job.base:  # taken over here: the events before it are gone with Redis's copy
                    log.warning("job %s: Redis lost it (restarted empty?), with the events it had before it came here: stopping it", job.id)
                    self._cancel(job)
                    job.fail(Code.BACKEND_UNAVAILABLE, "the job store lost the job's events")
                    return
                log.warning("job %s: Redis lost it (restarted empty?); copying its events again", job.id)
                written = 0
                continue
            written = events[-1].seq
            if not ok:
                if not job.done:
                    log.warning("job %s was ended by another replica (this one was thought lost): stopping it", job.id)
                    self._cancel(job)
                    job.fail(Code.BACKEND_UNAVAILABLE, "the job was ended while this gateway could not reach Redis")
                return
            if events[-1].terminal:
                if self._owned.get(job.id) is not None:
                    # Copied out: its own copy here now counts against this replica's memory, or goes to the spool.
                    self.finished.ended(job)
                return

    async def _copy(self, job: Job, events: list[Event]) -> int:
        """Copy `events` (the next of `job`'s log) and its snapshot: `scripts.MIRROR`'s answer."""
        snapshot = job.snapshot(kept=[])  # taken with `events`, so the two agree
        terminal = events[-1] if events[-1].terminal else None
        # A result already in this replica's spool (a copy sent again) is read on a thread, not on the loop.
        datas = [event.raw if event.kept is None else await asyncio.to_thread(event.kept.read) for event in events]
        apart = terminal is not None and terminal.type is EventType.DATA and terminal.size >= SPOOL_FROM
        if terminal is not None:
            # A big result is kept once, in the result key, and readers fill it in from there.
            whole = TerminalEvent(terminal.type.value, msgspec.Raw(datas[-1]))
            snapshot = msgspec.structs.replace(snapshot, terminal=None if apart else whole)
        args: list[Any] = [
            job.id,
            encode(snapshot),
            self._ms(self.retention),
            terminal.seq if terminal else "",
            terminal.type.value if terminal else "",
            self.replica_id,
            job.idempotency_key or "",
            f"{job.id} {job.request_digest}",
            self._lease_ms,
            self._ms(self.liveness),
            time.time(),
            terminal.seq if apart and terminal is not None else "",
        ]
        for event, data in zip(events, datas):
            args += [event.seq, event.type.value, data]
        return int(await self.scripts.mirror(keys=self.keys.mirrored(job.id, job.idempotency_key), args=args))
