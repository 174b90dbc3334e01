"""The Redis store itself (gateway/server/redis_store/__init__.py has the whole of it): its clients and
lifecycle, idempotency keys, a job recorded, read, listed and cancelled. Its other parts are
rooms of their own: the copy of its jobs' events (writer.py), reading jobs that run elsewhere
(reading.py), replicas that stop and jobs that go on in another (replicas.py), and its heartbeat,
channel and attachments (leases.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

from gateway.admission import Admission
from gateway.errors import ApiError
from gateway.jobs import Job, terminal_event
from gateway.protocol import Code, Event, EventType, JobList, JobSnapshot, Kept, encode
from gateway.plumbing.spool import ResultSpool
from gateway.server.redis_store.keys import ANSWER_S, NO_MAINT, READ_FIELDS, Keys, is_redis_url
from gateway.server.redis_store import listing
from gateway.server.redis_store.leases import Leases
from gateway.server.redis_store.reading import InRedis, Reading, RedisJobView, Tail
from gateway.server.redis_store.replicas import STOP_FLUSH_S, Replicas, KeptRequest
from gateway.server.redis_store.scripts import Scripts
from gateway.server.redis_store.writer import Writing
from gateway.server.store import (
    DEFAULT_MEMORY_BUDGET,
    Binding,
    FinishedResults,
    JobHandle,
    JobsQuery,
    JobStore,
)

log = logging.getLogger("streamgate.redis")

LAG_TICK_S = 0.1
COMMAND_CONNECTIONS = 64  # per replica, for requests and copies
READ_CONNECTIONS = 1024  # per replica: jobs followed from here at once, each one blocking read


@dataclass
class Owned:
    """What the owner tracks about one of its jobs, for detach grace."""

    job: Job
    ever_attached: bool = False
    unattached_since: float | None = None  # loop time
    timer: asyncio.TimerHandle | None = None
    evaluating: bool = False
    cancel_seen: bool = False
    # Taken over from a replica that stopped: its events before are in Redis only (its clients here follow
    # it there, as they do every job that may go on elsewhere: `followed`).
    taken: bool = False


class RedisStore(Writing, Reading, Replicas, Leases, JobStore):
    """Jobs shared by every gateway replica through Redis; its parts are the classes it is made of."""

    def __init__(
        self,
        url: str,
        cancel: Callable[[Job], None],
        *,
        detach_grace: float = 30.0,
        retention: float = 600.0,
        heartbeat: float = 1.0,
        outage_grace: float = 30.0,
        prefix: str = "streamgate:",
        results: ResultSpool | None = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        checkpoints: str | None = None,
    ) -> None:
        if not is_redis_url(url):
            raise ValueError(f"not a Redis URL: {url!r} (redis://host:port/db, rediss://…, unix://…)")
        self.url = url
        self._cancel = cancel
        self.detach_grace = detach_grace
        self.retention = retention
        self.heartbeat = heartbeat
        self.outage_grace = outage_grace
        self.prefix = prefix
        # The jobs this replica runs keep their events here too, to serve its own clients: bounded
        # as the memory store's are (a big result in this replica's spool, once copied to Redis).
        self.results = results
        self.finished = FinishedResults(results, memory_budget)
        # Where jobs keep their checkpoints (gateway/checkpoints.py `lasting_folder`): swept here of those
        # whose job has ended everywhere.
        self.checkpoints = checkpoints
        self._admission: Admission | None = None  # with which a job whose replica stopped goes on here
        self.webhooks: Any = None  # whose callbacks a job taken over, or ended for its silent replica, delivers
        self._ready: Callable[[], bool] = lambda: False
        self._taking: set[str] = set()  # jobs being taken over here now
        self._followed: dict[str, bool] = {}  # whether a client ever followed them (for detach grace)
        self._missing: set[str] = set()  # checkpoints whose job the last sweep found no record of
        self._looking = False  # for jobs to take over, now
        self._swept = 0.0  # loop time of the last sweep
        self.replica_id = uuid.uuid4().hex
        self.keys = Keys(prefix, self.replica_id)
        self.ttl = 3 * heartbeat  # of an attachment
        # A replica silent for this long is taken for dead and its jobs ended: no sooner than an
        # outage it must be able to ride out, or a stall would end jobs that are running fine.
        self.liveness = outage_grace + self.ttl
        self._block = max(0.05, min(5.0, self.ttl))  # one XREAD BLOCK, at most
        # Three pools, so that no kind of use starves another: requests and copies share a
        # bounded one (a burst of thousands of requests queues for its connections, for up
        # to ANSWER_S, rather than opening thousands); followers' blocking reads, one per
        # job followed here, have their own; the heartbeat and the owner's channel theirs.
        self._redis = self._client(aioredis.BlockingConnectionPool, max_connections=COMMAND_CONNECTIONS, timeout=ANSWER_S)
        self._reads = self._client(aioredis.BlockingConnectionPool, max_connections=READ_CONNECTIONS, timeout=None)
        self._pulse = self._client(aioredis.ConnectionPool, max_connections=4)
        self.scripts = Scripts(self._redis)
        self._owned: dict[str, Owned] = {}
        self._mirrors: dict[str, asyncio.Task[None]] = {}
        self._attached: dict[str, int] = {}  # clients on this replica, per job (owned or not)
        self._views: dict[str, str] = {}  # remote jobs followed from here -> their owner
        self._tails: dict[str, Tail] = {}  # remote jobs read from here, one reader each
        self._following = True  # until shutdown
        self._pending: dict[str, asyncio.Future[Any]] = {}  # reads in flight that others may share
        self._alive_until: dict[str, float] = {}  # replicas seen alive, until when (loop time)
        self._ops: asyncio.Queue[tuple[str, str, str] | None] = asyncio.Queue()
        # Background loops end on this flag rather than on cancellation alone: redis-py can
        # swallow a cancel that lands while it opens a connection (redis/redis-py#2028).
        self._closing = False
        self._tasks: list[asyncio.Task[Any]] = []
        self._spawned: set[asyncio.Task[Any]] = set()
        self.problem: str | None = f"not connected to Redis at {self._where()} yet"
        self._failed_beats = 0
        self._beat_ok = 0.0  # loop time of the last heartbeat Redis answered
        self._late_until = 0.0  # loop time until which the event loop counts as running late

    def _client(self, pool: type[aioredis.ConnectionPool], **sizing: Any) -> aioredis.Redis:
        return aioredis.Redis(
            connection_pool=pool.from_url(
                self.url,
                socket_connect_timeout=2,
                socket_timeout=self._block + 5,
                retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 2),
                **NO_MAINT,  # one round trip less per connection, and a window less in which a cancel is lost
                **sizing,
            )
        )

    def _where(self) -> str:
        return self.url.split("@")[-1]  # no password in messages

    def _ms(self, seconds: float) -> int:
        return max(1, int(seconds * 1000))

    @property
    def _lease_ms(self) -> int:
        # A running job's keys outlive its owner's last sign of life by the owner's liveness and
        # then the retention: a job whose owner died reads as lost (`_finalize_if_orphan`) for as
        # long as a finished one reads as finished, never as unknown before its owner counts as gone.
        return self._ms(self.liveness + self.retention)

    def _unavailable(self, exc: BaseException) -> ApiError:
        if isinstance(exc, TimeoutError) and self._busy():
            # No answer in time because this process could not listen for it, not because Redis
            # is away: the client is told so, and to come back a little later.
            return ApiError(
                Code.OVERLOADED,
                "this gateway is too busy to answer in time; try again shortly",
                retry_after=random.randint(1, 5),
            )
        why = str(exc) or f"no answer in {ANSWER_S:g} s"
        return ApiError(Code.STORE_UNAVAILABLE, f"the job store (Redis at {self._where()}) is unreachable: {why}", retry_after=5)

    def _busy(self) -> bool:
        """Whether this process's event loop ran late in the last few seconds (see `_watch_lag`)."""
        return asyncio.get_running_loop().time() < self._late_until

    async def _watch_lag(self) -> None:
        """Note when the event loop runs late: a timer due in LAG_TICK_S that fires a quarter of
        ANSWER_S after it means a loop too busy to hear Redis, whatever Redis does."""
        loop = asyncio.get_running_loop()
        while not self._closing:
            due = loop.time() + LAG_TICK_S
            await asyncio.sleep(LAG_TICK_S)
            if loop.time() - due > ANSWER_S / 4:
                self._late_until = loop.time() + 2 * ANSWER_S

    @contextlib.asynccontextmanager
    async def _answering(self) -> Any:
        """Redis on a request's path: unreachable, or stalled past ANSWER_S, is a 503 store_unavailable."""
        try:
            async with asyncio.timeout(ANSWER_S):
                yield
        except (RedisError, TimeoutError) as exc:
            raise self._unavailable(exc) from exc

    async def _quietly(self, coro: Any) -> None:
        """A background chore that tries again at the next heartbeat if Redis or the disk fails it."""
        try:
            await coro
        except (RedisError, OSError, TimeoutError) as exc:
            log.debug("a background chore failed, tried again later: %s", exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    async def start(self) -> None:
        await self._beat()
        self._tasks = [
            asyncio.create_task(self._heartbeat(), name="redis store heartbeat"),
            asyncio.create_task(self._listen(), name="redis store listener"),
            asyncio.create_task(self._run_ops(), name="redis store attachments"),
            asyncio.create_task(self._watch_lag(), name="redis store loop lag"),
        ]

    async def stop(self) -> None:
        await self.hand_off()
        for owned in self._owned.values():
            if not owned.job.done:
                self._cancel(owned.job)
                owned.job.fail(Code.SHUTTING_DOWN, "the server is shutting down")
            if owned.timer is not None:
                owned.timer.cancel()
        mirrors = [task for task in self._mirrors.values() if not task.done()]
        if mirrors:
            await asyncio.wait(mirrors, timeout=STOP_FLUSH_S)
        self._closing = True
        self._ops.put_nowait(None)
        tasks = [task for task in [*self._tasks, *self._mirrors.values(), *self._spawned] if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2)  # bounded: see `_closing`
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(2):
                pipe = self._redis.pipeline(transaction=False)
                for job_id in self._views:
                    pipe.zrem(self.keys.attached(job_id), self.replica_id)
                pipe.delete(self.keys.replica(self.replica_id))
                await pipe.execute()
        for client in (self._redis, self._reads, self._pulse):
            with contextlib.suppress(Exception):
                await client.aclose()
        self.finished.stop()

    def results_kept(self) -> dict[str, int]:
        return self.finished.facts()

    async def reserve(self, key: str, job_id: str, request: str) -> Binding | None:
        try:
            async with self._answering():
                while True:
                    if await self._redis.set(self.keys.idem(key), f"{job_id} {request}", nx=True, px=self._lease_ms):
                        return None
                    bound = await self._redis.get(self.keys.idem(key))
                    if bound is not None:  # else it expired in between: try again
                        bound_id, _, bound_request = bound.decode().partition(" ")
                        return Binding(bound_id, bound_request)
        except ApiError:
            # A SET that timed out may still land: unbind it once Redis answers, so that the
            # client's retry with the same key starts its job rather than finding none.
            self._spawn(self._release_until_done(key, job_id))
            raise

    async def release(self, key: str, job_id: str) -> None:
        try:
            async with asyncio.timeout(ANSWER_S):
                await self.scripts.release(keys=[self.keys.idem(key)], args=[job_id])
        except (RedisError, TimeoutError):
            self._spawn(self._release_until_done(key, job_id))

    async def _release_until_done(self, key: str, job_id: str) -> None:
        """Unbind `key` from `job_id` once Redis answers (until the key's own lease would end it)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._lease_ms / 1000
        delay = 0.05
        while not self._closing and loop.time() < give_up:
            try:
                async with asyncio.timeout(ANSWER_S):
                    await self.scripts.release(keys=[self.keys.idem(key)], args=[job_id])
                return
            except (RedisError, TimeoutError):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def add(self, job: Job) -> None:
        if job.taken_over:  # (`_take_over`): its hash is there, and names this replica its owner
            followed = self._followed.pop(job.id, False) or self._attached.get(job.id, 0) > 0
            self._owned[job.id] = Owned(job, ever_attached=followed, taken=True)
            if (owner := self._views.pop(job.id, None)) is not None:
                # Its clients here followed it as the old owner's: they count as this replica's own now,
                # not as another's (which the heartbeats would keep alive, and it never be let go).
                self._ops.put_nowait(("detach", job.id, owner))
            self._restart_mirror(job)
            return
        key = job.idempotency_key
        try:
            pipe = self._redis.pipeline(transaction=True)
            fields: dict[str, Any] = {
                "owner": self.replica_id, "snapshot": encode(job.snapshot()), "last_seq": 0, "key": key or "",
            }
            if job.resumable:  # another replica can go on with it if this one stops
                fields["request"] = encode(
                    KeptRequest(
                        job.tool, msgspec.Raw(encode(job.params)), job.tenant, job.weight, job.owner, job.request_digest, job.created,
                        priority=job.priority, timeout=job.timeout,
                    )
                )
                fields["resumable"] = 1
                pipe.zadd(self.keys.resumable, {job.id: time.time()})
            pipe.hset(self.keys.job(job.id), mapping=fields)
            pipe.pexpire(self.keys.job(job.id), self._lease_ms)
            # The index of every job, for listing; members whose job has expired are dropped
            # as it is read, and any older than a lease past retention here.
            # Touched at each copy and heartbeat (`_beat`); one untouched for two leases has expired.
            pipe.zadd(self.keys.index, {job.id: time.time()})
            pipe.zremrangebyscore(self.keys.index, "-inf", time.time() - (self._lease_ms / 1000) * 2)
            listing.enlist(pipe, self.keys, [job], self._lease_ms)
            if key:
                pipe.pexpire(self.keys.idem(key), self._lease_ms)
            async with self._answering():
                await pipe.execute()
        except ApiError:
            # Nobody may find the job again: stop it, free its key, and refuse the run. A write
            # that timed out may still land, so the job's end is copied too once Redis answers:
            # its record never shows a job running that is not.
            job.fail(Code.STORE_UNAVAILABLE, "the job store could not record the job")
            self._cancel(job)
            if key:
                await self.release(key, job.id)
            self._owned[job.id] = Owned(job)
            self._restart_mirror(job)
            raise
        self._owned[job.id] = Owned(job)
        self._restart_mirror(job)

    async def get(self, job_id: str, *, to_follow: bool = False) -> JobHandle | None:
        owned = self._owned.get(job_id)
        if owned is not None and not owned.taken and not owned.job.resumable:
            job = owned.job
            if job.finished is None or time.time() - job.finished <= self.retention:
                return job
            # Forgotten here; Redis's copy expires on Redis's clock, a moment later: read it as any
            # replica would, so that this one never says 404 while it is still found there.
            self._forget(job_id)
        tail = self._tails.get(job_id)
        if to_follow and tail is not None and tail.failure is None:
            # Followed from here already: the job's owner, tool and events are at hand, so a
            # reconnect storm's clients cost Redis nothing more (their snapshot may be stale).
            return tail.view_for_another()
        async with self._answering():
            fields = await self._fields(job_id)
            if not fields or b"snapshot" not in fields:
                return None
            view = RedisJobView(self, job_id, fields)
            if not view.done and view.owner != self.replica_id and await self._finalize_if_orphan(view):
                fields = await self._hash_fields(job_id)
                if not fields:
                    return None
                view._update(fields)
            if owned is not None:
                view.files = owned.job.files
            return view

    async def followed(self, job: Job) -> JobHandle:
        # A job that may go on in another replica is followed from Redis here too: a client never
        # reads an event that Redis lacks, which the replica going on with it would send again
        # under the same seq, and so reconnects after its last event wherever it goes on.
        if job.resumable:
            try:
                view = await self.get(job.id, to_follow=True)
            except ApiError:
                self._cancel(job)  # (nobody could follow it: it ends, and the client may run it again)
                raise
            if view is not None:
                return view
        return job

    async def _shared(self, key: str, call: Callable[[], Awaitable[Any]]) -> Any:
        """`call()`'s answer; calls for one `key` made while one is in flight share its round trip.
        A reconnect storm of a job's followers so costs Redis one read of the job, not one per client."""
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = asyncio.ensure_future(call())
            pending.add_done_callback(lambda done: self._settled(key, done))
        return await asyncio.shield(pending)

    def _settled(self, key: str, done: asyncio.Future[Any]) -> None:
        self._pending.pop(key, None)
        if not done.cancelled():
            done.exception()  # retrieved: a failure every waiter gave up on is not logged as lost

    async def _fields(self, job_id: str) -> dict[bytes, bytes]:
        return await self._shared(f"job {job_id}", lambda: self._hash_fields(job_id))

    async def _hash_fields(self, job_id: str) -> dict[bytes, bytes]:
        """The job's hash as readers need it (`READ_FIELDS`); {} if it is gone."""
        values = await self._redis.hmget(self.keys.job(job_id), READ_FIELDS)
        return {name: value for name, value in zip(READ_FIELDS, values) if value is not None}

    async def _owner_alive(self, owner: str) -> bool:
        """Whether `owner`'s liveness key exists; a yes is kept for one heartbeat (the key lasts
        far longer), so that reads of its jobs do not ask again and again."""
        loop = asyncio.get_running_loop()
        if self._alive_until.get(owner, 0.0) > loop.time():
            return True
        alive = bool(await self._shared(f"alive {owner}", lambda: self._redis.exists(self.keys.replica(owner))))
        if alive:
            self._alive_until[owner] = loop.time() + self.heartbeat
        else:
            self._alive_until.pop(owner, None)
        return alive

    async def snapshots(self, kept: list[Kept] | None = None) -> list[JobSnapshot]:
        async with self._answering():
            ids = [member.decode() for member in await self._redis.zrange(self.keys.index, 0, -1)]
        return await self._snapshots_of(ids, kept)

    async def listed(self, query: JobsQuery, whose: str | None, kept: list[Kept]) -> JobList:
        key = self.keys.listing if whose is None else self.keys.listing_by(whose)
        async with self._answering():
            return await listing.page(self._redis, key, query, whose, lambda ids: self._snapshots_of(ids, kept))

    async def _snapshots_of(self, ids: list[str], kept: list[Kept] | None) -> list[JobSnapshot]:
        # A big result is in Redis apart (`InRedis`): a marker with `kept`, read whole without.
        names = ("snapshot", "owner", "tseq", "ttype", "tsize")
        async with self._answering():
            pipe = self._redis.pipeline(transaction=False)
            for job_id in ids:
                pipe.hmget(self.keys.job(job_id), *names)
            found = {job_id: dict(zip(names, values)) for job_id, values in zip(ids, await pipe.execute() if ids else [])}
            gone = [job_id for job_id, fields in found.items() if fields["snapshot"] is None]
            if gone:  # expired jobs leave the index as it is read
                await self._redis.zrem(self.keys.index, *gone)
            kept_here = {job_id: fields for job_id, fields in found.items() if fields["snapshot"] is not None}
            # A job whose owner went silent is listed as lost, as `get` reads it, not as running.
            elsewhere = {
                job_id: fields["owner"].decode()
                for job_id, fields in kept_here.items()
                if fields["tseq"] is None and fields["owner"] and fields["owner"].decode() != self.replica_id
            }
            silent = {owner for owner in set(elsewhere.values()) if not await self._owner_alive(owner)}
            lost = {job_id for job_id, owner in elsewhere.items() if owner in silent}
            views = {
                view.id: view for view in await asyncio.gather(*(self.get(job_id) for job_id in lost)) if isinstance(view, RedisJobView)
            }
        snapshots = []
        for job_id, fields in kept_here.items():
            if job_id in views:
                snapshots.append(views[job_id].snapshot(kept))
                continue
            snapshot = msgspec.json.decode(fields["snapshot"], type=JobSnapshot)
            if fields["tsize"] is not None and fields["tseq"] is not None:
                result = Event(job_id, int(fields["tseq"]), EventType(fields["ttype"].decode()), b"", InRedis(self, job_id, int(fields["tsize"])))
                snapshot = msgspec.structs.replace(snapshot, terminal=terminal_event(result, kept))
            snapshots.append(snapshot)
        return snapshots

    async def cancel(self, job: JobHandle) -> None:
        if isinstance(job, Job):
            if not job.done:
                self._cancel(job)
            return
        assert isinstance(job, RedisJobView)
        if job.done:
            return
        async with self._answering():
            if not await self.scripts.flag(keys=[self.keys.job(job.id)], args=["cancel"]):
                return  # expired meanwhile
            message = encode({"op": "cancel", "job_id": job.id})
            heard = await self._redis.publish(self.keys.replica(job.owner), message)
            if not heard:
                await self._finalize_if_orphan(job)

    def _forget(self, job_id: str) -> None:
        owned = self._owned.pop(job_id, None)
        if owned is not None:
            self.finished.forget(owned.job)
        if owned is not None and owned.timer is not None:
            owned.timer.cancel()
        self._mirrors.pop(job_id, None)
        self._attached.pop(job_id, None)
