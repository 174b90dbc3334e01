"""Staying alive and keeping leases (a part of `RedisStore`): the heartbeat (the replica's liveness
key, its running jobs' keys re-leased, their cancel flags read), the owner's channel, and which
replicas follow a job (attachments), for detach grace across replicas."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

import msgspec
from redis.exceptions import RedisError

from gateway.protocol import encode
from gateway.server.redis_store import listing
from gateway.server.redis_store.keys import ANSWER_S
from gateway.server.redis_store.reading import RedisJobView
from gateway.server.redis_store.replicas import SWEEP_S
from gateway.server.store import JobHandle

if TYPE_CHECKING:
    from gateway.server.redis_store.store import Owned

log = logging.getLogger("streamgate.redis")


class Leases:
    """A part of `RedisStore`: its heartbeat, its channel, and its jobs' followers."""

    def attach(self, job: JobHandle) -> None:
        count = self._attached.get(job.id, 0) + 1
        self._attached[job.id] = count
        owned = self._owned.get(job.id)
        if owned is not None:
            if not owned.ever_attached and owned.job.resumable:  # for the replica that may take it over
                self._ops.put_nowait(("followed", job.id, ""))
            owned.ever_attached = True
            owned.unattached_since = None
            if owned.timer is not None:
                owned.timer.cancel()
                owned.timer = None
        elif isinstance(job, RedisJobView) and count == 1 and not job.done:
            self._views[job.id] = job.owner
            self._ops.put_nowait(("attach", job.id, job.owner))

    def detach(self, job: JobHandle) -> None:
        count = self._attached.get(job.id, 1) - 1
        if count > 0:
            self._attached[job.id] = count
            return
        self._attached.pop(job.id, None)
        owned = self._owned.get(job.id)
        if owned is not None:
            if not owned.job.done:
                self._evaluate_soon(owned)
        elif job.id in self._views:
            owner = self._views.pop(job.id)
            self._ops.put_nowait(("detach", job.id, owner))

    async def _run_ops(self) -> None:
        """Attachments of remote jobs, in order (an attach never lands after its detach)."""
        while not self._closing:
            item = await self._ops.get()
            if item is None:
                return
            op, job_id, owner = item
            try:
                if op == "followed":
                    await self.scripts.flag(keys=[self.keys.job(job_id)], args=["followed"])
                elif op == "attach":
                    if job_id in self._views:
                        await self.scripts.attach(
                            keys=[self.keys.attached(job_id)],
                            args=[self.replica_id, self._ms(self.ttl), self._lease_ms],
                        )
                elif job_id not in self._views:  # detach, unless a client came back meanwhile
                    await self._redis.zrem(self.keys.attached(job_id), self.replica_id)
                    await self._redis.publish(self.keys.replica(owner), encode({"op": "detached", "job_id": job_id}))
            except RedisError as exc:
                log.debug("attachment %s of job %s not recorded: %s", op, job_id, exc)

    def _evaluate_soon(self, owned: Owned) -> None:
        if not owned.evaluating:
            owned.evaluating = True
            self._spawn(self._evaluate(owned))

    async def _evaluate(self, owned: Owned) -> None:
        """Cancel the job if no client anywhere has followed it for detach_grace; else check again later."""
        job = owned.job
        try:
            if job.done or self._attached.get(job.id, 0) > 0:
                owned.unattached_since = None
                return
            try:
                remote = await self.scripts.live(keys=[self.keys.attached(job.id)])
            except RedisError as exc:
                log.debug("job %s: cannot count its followers, cancelling nothing: %s", job.id, exc)
                return
            if job.done or self._attached.get(job.id, 0) > 0 or job.id not in self._owned:
                return
            if remote:
                owned.ever_attached = True
                owned.unattached_since = None
                return
            if not owned.ever_attached:
                return
            loop = asyncio.get_running_loop()
            if owned.unattached_since is None:
                owned.unattached_since = loop.time()
            left = self.detach_grace - (loop.time() - owned.unattached_since)
            if left <= 0:
                log.info("job %s: no client for %g s, cancelling", job.id, self.detach_grace)
                self._cancel(job)
            elif owned.timer is None:
                owned.timer = loop.call_later(left, self._grace_over, owned)
        finally:
            owned.evaluating = False

    def _grace_over(self, owned: Owned) -> None:
        owned.timer = None
        self._evaluate_soon(owned)

    async def _heartbeat(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.heartbeat)
            if not self._closing:
                await self._beat()

    async def _beat(self) -> None:
        """Stay alive, re-lease running jobs, pick up cancel flags, keep attachments, forget old jobs."""
        running = [owned for owned in self._owned.values() if not owned.job.done]
        try:
            pipe = self._pulse.pipeline(transaction=False)
            pipe.set(self.keys.replica(self.replica_id), b"1", px=self._ms(self.liveness))
            for owned in running:
                await self.scripts.lease(
                    keys=self.keys.job_keys(owned.job.id, owned.job.idempotency_key),
                    args=[self._lease_ms, self.replica_id],
                    client=pipe,
                )
            if running:  # still listed, however long they run
                pipe.zadd(self.keys.index, {owned.job.id: time.time() for owned in running}, xx=True)
                listing.enlist(pipe, self.keys, [owned.job for owned in running], self._lease_ms)
            if resumable := {owned.job.id: time.time() for owned in running if owned.job.resumable}:
                pipe.zadd(self.keys.resumable, resumable, xx=True)  # alive: nobody takes them over
            async with asyncio.timeout(ANSWER_S):  # a stalled Redis is found out as soon as a dead one
                replies = await pipe.execute()
        except (RedisError, TimeoutError) as exc:
            why = str(exc) or f"no answer in {ANSWER_S:g} s"
            if isinstance(exc, TimeoutError) and self._busy():
                return  # this process was too busy to hear the answer: no sign of an outage
            self._failed_beats += 1
            # Twice in a row (or before the first success): once may be this process too busy to hear the answer
            # in time (a storm of reconnects while the model loads), which is no outage of Redis.
            if self.problem is not None or self._failed_beats >= 2:
                if self.problem is None:
                    log.warning("Redis at %s is unreachable: %s", self._where(), why)
                self.problem = f"the job store (Redis at {self._where()}) is unreachable: {why}"
            if asyncio.get_running_loop().time() - self._beat_ok > self.outage_grace:
                self._stand_down()
            return
        if self.problem is not None:
            log.info("Redis at %s is reachable", self._where())
        self.problem = None
        self._failed_beats = 0
        self._beat_ok = asyncio.get_running_loop().time()
        for owned, flag in zip(running, replies[1 : 1 + len(running)]):
            if flag == -2:
                self._handed_off(owned.job)
            elif flag == -1 and not owned.job.done:  # Redis lost the job: copy it again
                self._restart_mirror(owned.job)
            elif flag and not owned.cancel_seen and not owned.job.done:
                owned.cancel_seen = True
                self._cancel(owned.job)
            elif owned.ever_attached and owned.timer is None and not self._attached.get(owned.job.id):
                self._evaluate_soon(owned)
        for job_id, owner in self._views.items():
            self._ops.put_nowait(("attach", job_id, owner))
        if self._admission is not None and not self._looking:
            self._looking = True
            self._spawn(self._quietly(self._take_over_orphans()))
        loop = asyncio.get_running_loop()
        if self.checkpoints is not None and loop.time() - self._swept > SWEEP_S:
            self._swept = loop.time()
            self._spawn(self._quietly(self._sweep()))
        moment = time.time()
        for job_id, owned in list(self._owned.items()):
            if owned.job.finished is not None and moment - owned.job.finished > self.retention:
                self._forget(job_id)

    async def _listen(self) -> None:
        channel = self.keys.replica(self.replica_id)
        while not self._closing:
            pubsub = self._pulse.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                while not self._closing:
                    message = await pubsub.get_message(timeout=0.5)
                    if message is not None and message.get("type") == "message":
                        self._on_message(message["data"])
            except RedisError as exc:
                log.debug("subscription to %s lost: %s", channel, exc)
                await asyncio.sleep(min(1.0, self.heartbeat))
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def _on_message(self, data: bytes) -> None:
        try:
            message = msgspec.json.decode(data)
            op, job_id = message["op"], message["job_id"]
        except (msgspec.DecodeError, KeyError, TypeError):
            log.warning("ignoring a malformed message on the replica channel: %r", data[:200])
            return
        owned = self._owned.get(job_id)
        if owned is None or owned.job.done:
            return
        if op == "cancel":
            owned.cancel_seen = True
            self._cancel(owned.job)
        elif op == "detached":
            self._evaluate_soon(owned)
