"""Replicas that stop, and the jobs that go on in another (a part of `RedisStore`): a job whose
replica stopped or went silent is ended as lost, or, if it can go on from its checkpoint, taken over
by a ready replica and admitted again there; checkpoints of jobs ended everywhere are swept."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import msgspec
from redis.exceptions import RedisError

from gateway import checkpoints
from gateway.admission import Admission, Applicant, GoingOn
from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.params import Relayed
from gateway.protocol import RETRYABLE, Code, ErrorFrame, ErrorInfo, TerminalEvent, encode, now
from gateway.server.redis_store.reading import RedisJobView

log = logging.getLogger("streamgate.redis")

MOST_TAKEOVERS = 2  # times a job goes on in another replica: one that kills every gateway it runs on ends
TAKE_OVER_COUNT = 8  # orphans one heartbeat looks at
TAKE_OVER_WAIT_S = 300.0  # the longest a job waits for a replica ready to take it over (at most half its retention)
SWEEP_S = 60.0  # how often the checkpoints of jobs ended everywhere are looked for
SWEEP_COUNT = 1000  # checkpoint folders one sweep looks at
STOP_FLUSH_S = 2.0  # how long leaving jobs (and `stop`) waits for Redis


class KeptRequest(msgspec.Struct, frozen=True):
    """What another replica needs to admit a job again (`_take_over`): its tool, its params as admitted
    (on a named model), who it runs for, its idempotency key's digest, and when it was admitted."""

    tool: str
    params: msgspec.Raw
    tenant: str
    weight: float = 1.0
    owner: str | None = None
    digest: str = ""
    created: float = 0.0
    priority: int = 0
    timeout: float | None = None


class Replicas:
    """A part of `RedisStore`: jobs left by a replica that stops, and taken over by another."""

    def _handed_off(self, job: Job) -> None:
        """Another replica took `job` over while this one could not reach Redis (it counted as gone):
        the work here stops, and leaves the job's checkpoint to the replica that goes on with it."""
        if job.done or job.handed_off:
            return
        log.warning("job %s was taken over by another replica (this one was thought gone): stopping it here", job.id)
        self._leave(job)

    def _leave(self, job: Job) -> None:
        """`job` goes on in another replica: its run here stops (what it appends from now on reaches
        no client: they follow it in Redis), and its checkpoint is left to that replica."""
        job.handed_off = True
        self._cancel(job)
        job.fail(Code.BACKEND_UNAVAILABLE, "the job goes on in another gateway replica")

    def _stand_down(self) -> None:
        """Cut off from Redis past the outage grace, this replica may count as gone, and its jobs that can
        go on elsewhere be taken over: their runs here stop (and leave the checkpoints alone) before
        another replica's can start. Once Redis answers, each is left (`_mirror`) unless taken."""
        for owned in list(self._owned.values()):
            job = owned.job
            if job.resumable and not job.done and not job.handed_off:
                log.warning("job %s: Redis unreachable past the outage grace; its run here stops, for another replica to go on with it", job.id)
                self._leave(job)

    async def hand_off(self) -> None:
        """This replica stops: its jobs that can go on elsewhere are left, for another replica (or this
        one's successor) to take over at once. Their events not copied yet stay behind: nobody has
        read them (clients follow such jobs in Redis), and the replica that goes on sends its own. A
        job not left in `STOP_FLUSH_S` (Redis unreachable) is taken over once this one counts as gone."""
        leaving = [o.job for o in self._owned.values() if o.job.resumable and not o.job.done and not o.job.handed_off]
        if not leaving:
            return
        try:
            async with asyncio.timeout(STOP_FLUSH_S):
                for job in leaving:
                    if await self._left(job):
                        log.info("job %s: left for another replica to go on with", job.id)
                        self._leave(job)
        except (RedisError, TimeoutError) as exc:
            log.warning("could not leave every job to another replica: %s", exc or "no answer in time")

    def takes_over(self, admission: Admission, ready: Callable[[], bool], webhooks: Any = None) -> None:
        self._admission, self._ready = admission, ready
        # The gateway's completion webhooks (gateway/server/webhooks.py): a job taken over here, or ended
        # here for its silent replica, has its callback delivered from here.
        self.webhooks = webhooks

    async def _left(self, job: Job) -> int:
        """`scripts.LEAVE` `job` in Redis: 1 if it is not this replica's any more."""
        return int(await self.scripts.leave(keys=[self.keys.job(job.id), self.keys.resumable], args=[self.replica_id, job.id, time.time()]))

    async def _may_go_on(self, job_id: str) -> bool:
        """Whether a job whose owner is silent may still go on elsewhere: its owner re-leased it less than
        a liveness and `TAKE_OVER_WAIT_S` (or half the retention) ago. After that, no replica having
        been ready to take it over, it is ended as lost, and reads so for its retention."""
        score = await self._redis.zscore(self.keys.resumable, job_id)
        return score is not None and time.time() - abs(float(score)) < self.liveness + min(TAKE_OVER_WAIT_S, self.retention / 2)

    def _take_over_soon(self, job_id: str, owner: str) -> None:
        if self._admission is not None and self._ready() and job_id not in self._taking and not self._closing:
            self._taking.add(job_id)
            self._spawn(self._take_over(job_id, owner))

    async def _take_over_orphans(self) -> None:
        """Take over the jobs that can go on whose owners have not re-leased them within a liveness, and
        those left by a replica that stopped (`hand_off`: scored by minus when, so they come first)."""
        try:
            await self._look_for_orphans()
        finally:
            self._looking = False

    async def _look_for_orphans(self) -> None:
        until = time.time() - self.liveness
        ids = await self._redis.zrangebyscore(self.keys.resumable, "-inf", until, start=0, num=TAKE_OVER_COUNT)
        if not ids:
            return
        pipe = self._redis.pipeline(transaction=False)
        for member in ids:
            pipe.hget(self.keys.job(member.decode()), "owner")
        owners = await pipe.execute()
        for member, owner in zip(ids, owners):
            job_id = member.decode()
            if owner is None:  # expired: nothing to go on with
                await self._redis.zrem(self.keys.resumable, job_id)
            elif owner.decode() != self.replica_id and not await self._owner_alive(owner.decode()):
                if await self._may_go_on(job_id):
                    self._take_over_soon(job_id, owner.decode())
                elif fields := await self._hash_fields(job_id):  # waited too long: lost
                    await self._finalize_if_orphan(RedisJobView(self, job_id, fields))

    async def _take_over(self, job_id: str, owner: str) -> None:
        """Make this replica the owner of `job_id` (if `owner` is still silent and nobody took it first)
        and admit the job again here, under its id, to go on from its checkpoint after its last event."""
        try:
            if job_id in self._owned:
                return
            keys = [self.keys.replica(owner), self.keys.job(job_id), self.keys.events(job_id), self.keys.attached(job_id), self.keys.result(job_id), self.keys.resumable]
            key = (await self._redis.hget(self.keys.job(job_id), "key") or b"").decode()
            if key:
                keys.append(self.keys.idem(key))
            args = [owner, self.replica_id, self._lease_ms, MOST_TAKEOVERS, time.time(), job_id]
            taken = await self.scripts.take_over(keys=keys, args=args)
            if taken == -1:
                view = RedisJobView(self, job_id, await self._hash_fields(job_id))
                await self._finalize_if_orphan(view, f"the gateway replicas running this job stopped {MOST_TAKEOVERS + 1} times while it ran")
                return
            if not taken:
                return
            last, partials, key_bytes, request, followed = taken
            self._followed[job_id] = bool(followed)
            await self._go_on(job_id, int(last), int(partials), key_bytes.decode() or None, msgspec.json.decode(request, type=KeptRequest))
        except (RedisError, TimeoutError, msgspec.DecodeError) as exc:
            log.warning("job %s: could not be taken over from replica %s: %s", job_id, owner, exc)
        finally:
            self._taking.discard(job_id)
            self._followed.pop(job_id, None)

    async def _go_on(self, job_id: str, last: int, partials: int, key: str | None, request: KeptRequest) -> None:
        """Admit a job taken over here again; a refusal (its tool gone, over a budget) is its end."""
        assert self._admission is not None
        log.warning("job %s: its replica stopped; it goes on here after event %d", job_id, last)
        going_on = GoingOn(last, partials, key, request.digest, request.created)
        try:
            tool = self._admission.backend.tool(request.tool)
            if tool.params is Relayed:  # kept as it was relayed, for the engine to decode
                params = msgspec.json.decode(request.params, type=Relayed)
            else:
                params = await self._admission.decode(tool, bytes(request.params), "the job's request")
            applicant = Applicant(request.tenant, request.weight, request.owner, priority=request.priority, timeout=request.timeout)
            callback = await self.webhooks.waiting_url(job_id) if self.webhooks is not None else None
            await self._admission.admit(tool, params, applicant, job_id=job_id, going_on=going_on, callback=callback)
        except Exception as exc:  # refused here: the job ends, once, with why
            if isinstance(exc, ApiError) and exc.code in RETRYABLE:  # (busy, not ready, stopping): another may take it
                log.warning("job %s: not admitted here now (%s); given back", job_id, exc.message)
                await self.scripts.give_back(keys=[self.keys.job(job_id)], args=[self.replica_id])
                return
            if isinstance(exc, ApiError):
                code, message = exc.code, exc.message
            else:
                log.exception("job %s: admitting it again failed", job_id)
                code, message = Code.INTERNAL, "the job could not go on in the replica that took it over"
            job = Job(request.tool, None, job_id=job_id, owner=request.owner, tenant=request.tenant, after=last)
            job.idempotency_key, job.request_digest = key, request.digest
            job.fail(code, message)
            await self.add(job)
            if self.webhooks is not None:
                await self.webhooks.ended_elsewhere(job.snapshot())
            if self.checkpoints is not None:  # nothing will go on from it
                await asyncio.to_thread(shutil.rmtree, os.path.join(self.checkpoints, job_id), True)

    async def _sweep(self) -> None:
        """Remove the checkpoints of jobs that have ended everywhere (or are gone): a job goes on from
        its checkpoint only while it runs, or waits for a replica to take it over."""
        assert self.checkpoints is not None
        ids = await asyncio.to_thread(lambda: list(checkpoints.folders(self.checkpoints, SWEEP_S, SWEEP_COUNT)))
        ids = [job_id for job_id in ids if job_id not in self._owned]
        if not ids:
            return
        pipe = self._redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(self.keys.job(job_id), "owner", "tseq")
        states = await pipe.execute()
        # No record at all on two sweeps in a row (Redis restarted empty: a running job's owner copies
        # it back within a heartbeat), or its end recorded.
        missing = {job_id for job_id, (owner, _) in zip(ids, states) if owner is None}
        ended = [job_id for job_id, (owner, tseq) in zip(ids, states) if tseq is not None or job_id in missing & self._missing]
        self._missing = missing
        if ended:
            root = self.checkpoints
            await asyncio.to_thread(lambda: [shutil.rmtree(os.path.join(root, job_id), ignore_errors=True) for job_id in ended])

    async def _finalize_if_orphan(self, view: RedisJobView, message: str | None = None) -> bool | None:
        """End `view`'s job with backend_unavailable if its owner is silent (unless it can go on in
        another replica: `_take_over`); True if it has ended, None if Redis no longer has it.
        `message`: why, if not the owner's silence."""
        for _ in range(5):
            if await self._owner_alive(view.owner):
                return False
            fields = await self._hash_fields(view.id)
            if not fields or b"snapshot" not in fields:
                return None
            silent = view.owner
            view._update(fields)
            if view.done:
                return True
            if view.owner != silent:
                continue  # taken over meanwhile: is the new owner alive?
            if message is None and b"resumable" in fields and await self._may_go_on(view.id):
                self._take_over_soon(view.id, view.owner)
                return False
            seq = view.last_seq + 1
            info = ErrorInfo(
                code=Code.BACKEND_UNAVAILABLE, message=message or "the gateway replica running this job stopped answering", retryable=True
            )
            data = encode(ErrorFrame(view.id, seq, info))
            old = view.snapshot()
            snapshot = msgspec.structs.replace(
                old,
                status="FAILED",
                finished=now(),
                position=None,
                last_event_id=f"{view.id}:{seq}",
                terminal=TerminalEvent("error", msgspec.Raw(data)),
            )
            keys = [self.keys.replica(view.owner), *self.keys.job_keys(view.id, view.idempotency_key or None)]
            args = [str(view.last_seq), data, encode(snapshot), self._ms(self.retention), seq]
            done = await self.scripts.finalize(keys=keys, args=args)
            if done == 1:
                log.warning("job %s: its replica %s is gone; ended with backend_unavailable", view.id, view.owner)
                if self.webhooks is not None:  # its callback, which its replica would have delivered
                    await self.webhooks.ended_elsewhere(snapshot)
                return True
            if done == 0:
                return False
        return False
