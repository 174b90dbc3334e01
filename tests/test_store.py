"""The job store on its own: `MemoryStore` and `RedisStore` pass the same suite; then what only a shared store does.

No model and no HTTP here: jobs are `Job`s driven by hand, and "cancelling" one
is what a backend does, recorded. The Redis tests run against a real
redis-server (tests/support/redis_server.py) with a fast heartbeat, so that leases,
lapsed attachments and silent owners play out in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.protocol import Code, Event, Status, encode
from gateway.server.redis_store import RedisJobView, RedisStore
from gateway.server.store import JobStore, MemoryStore
from tests.support.processes import free_port
from tests.support.redis_server import redis_server, start_redis  # noqa: F401

HEARTBEAT = 0.1


class Replica:
    """A store and the cancels its backend was asked for (a cancel ends the job, as a backend's does)."""

    def __init__(self, make: Callable[[Callable[[Job], None]], JobStore]) -> None:
        self.cancelled: list[str] = []
        self.store = make(self._cancel)

    def _cancel(self, job: Job) -> None:
        self.cancelled.append(job.id)
        job.cancel()
        job.fail(Code.CANCELLED, "cancelled")

    async def add(self, key: str | None = None) -> Job:
        job = Job("echo", {"text": "hi"})
        if key:
            assert await self.store.reserve(key, job.id, "request") is None
            job.idempotency_key = key
        await self.store.add(job)
        return job


@pytest.fixture(params=["memory", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def replicas(request: pytest.FixtureRequest) -> AsyncIterator[Callable[..., Any]]:
    """`await replicas(kind, detach_grace=…, retention=…)`: a started Replica; all are stopped after the test."""
    started: list[Replica] = []

    async def start(kind: str, url: str | None = None, **settings: Any) -> Replica:
        settings.setdefault("detach_grace", 0.0)
        settings.setdefault("retention", 60.0)
        if kind == "redis":
            settings.setdefault("outage_grace", 0.5)  # a silent owner is found out in a fraction of a second
        if kind == "memory":
            replica = Replica(lambda cancel: MemoryStore(cancel, **settings))
        else:
            if url is None:
                url = request.getfixturevalue("redis_server").url
            replica = Replica(lambda cancel: RedisStore(url, cancel, heartbeat=HEARTBEAT, **settings))
        await replica.store.start()
        started.append(replica)
        return replica

    yield start
    for replica in started:
        await replica.store.stop()


async def eventually(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def read_all(handle: Any, after: int = 0, timeout: float = 10.0) -> list[Event]:
    """A follower's view: events after `after` until the terminal one."""
    events: list[Event] = []
    async with asyncio.timeout(timeout):
        while True:
            batch = await handle.wait_events(after, timeout=1.0)
            events += batch
            after = events[-1].seq if events else after
            if handle.terminal is not None and after >= handle.terminal.seq:
                return events


def crash(store: RedisStore) -> None:
    """The replica dies: no more heartbeats, attachments or copies, and no goodbye."""
    store._closing = True  # a cancel alone may be lost inside redis-py (see RedisStore._closing)
    for task in [*store._tasks, *store._mirrors.values()]:
        task.cancel()


def key() -> str:
    return "key-" + uuid.uuid4().hex


# -- the same suite for both stores ------------------------------------------------------


async def test_add_get_and_unknown(store_kind: str, replicas: Any) -> None:
    a = await replicas(store_kind)
    job = await a.add()
    assert await a.store.get(job.id) is job  # the replica that runs a job serves it from memory
    assert await a.store.get(uuid.uuid4().hex) is None


async def test_follow_events_to_the_terminal(store_kind: str, replicas: Any) -> None:
    a = await replicas(store_kind)
    job = await a.add()
    handle = await a.store.get(job.id)
    reader = asyncio.create_task(read_all(handle))
    job.set_status(Status.RUNNING)
    job.log("one")
    job.progress(1, 2)
    job.succeed({"text": "hi"})
    events = await reader
    assert [e.seq for e in events] == list(range(1, len(job.events) + 1))
    assert events == job.events
    assert handle.done and handle.terminal == job.events[-1]
    assert handle.snapshot().status == "SUCCEEDED"


async def test_idempotency_keys(store_kind: str, replicas: Any) -> None:
    a = await replicas(store_kind)
    k = key()
    assert await a.store.reserve(k, "job-1", "first") is None
    assert await a.store.reserve(k, "job-2", "second") == ("job-1", "first")  # what it is bound to
    await a.store.release(k, "job-2")  # not its binding: nothing happens
    await a.store.release(k, "job")  # a prefix of the bound id is not it either
    assert await a.store.reserve(k, "job-3", "first") == ("job-1", "first")
    await a.store.release(k, "job-1")
    assert await a.store.reserve(k, "job-4", "second") is None


async def test_cancel_runs_the_backend_cancel_once(store_kind: str, replicas: Any) -> None:
    a = await replicas(store_kind)
    job = await a.add()
    await a.store.cancel(await a.store.get(job.id))
    assert a.cancelled == [job.id]
    assert job.terminal is not None and b'"cancelled"' in job.terminal.data
    await a.store.cancel(job)  # finished: nothing to do
    assert a.cancelled == [job.id]


async def test_detach_without_grace_cancels_at_once(store_kind: str, replicas: Any) -> None:
    a = await replicas(store_kind, detach_grace=0)
    job = await a.add()
    a.store.attach(job)
    a.store.attach(job)
    a.store.detach(job)
    await asyncio.sleep(0.2)
    assert a.cancelled == []  # one client still follows it
    a.store.detach(job)
    await eventually(lambda: a.cancelled == [job.id], what="the cancel")


async def test_detach_grace(store_kind: str, replicas: Any) -> None:
    a = await replicas(store_kind, detach_grace=0.5)
    job = await a.add()
    a.store.attach(job)
    a.store.detach(job)
    await asyncio.sleep(0.2)
    a.store.attach(job)  # back within the grace: the job lives on
    await asyncio.sleep(0.6)
    assert a.cancelled == [] and not job.done
    a.store.detach(job)
    await asyncio.sleep(0.2)
    assert a.cancelled == []
    await eventually(lambda: a.cancelled == [job.id], timeout=5, what="the cancel after the grace")


async def test_a_job_nobody_attached_to_is_not_cancelled(store_kind: str, replicas: Any) -> None:
    a = await replicas(store_kind, detach_grace=0)
    job = await a.add()
    await asyncio.sleep(0.5)
    assert a.cancelled == [] and not job.done


async def test_the_memory_store_counts_no_follower_of_a_job_it_forgot(replicas: Any) -> None:
    """A stream that outlives its job's retention (a slow download of a big result) detaches after
    the job is forgotten: nothing is left counted for it."""
    a = await replicas("memory", retention=0.0)
    job = await a.add()
    a.store.attach(job)
    job.succeed({"text": "hi"})
    a.store._forget_expired(time.time() + 1)
    assert await a.store.get(job.id) is None
    a.store.detach(job)
    assert a.store._attached == {}


async def test_retention(store_kind: str, replicas: Any) -> None:
    a = await replicas(store_kind, retention=0.5)
    k = key()
    job = await a.add(k)
    job.succeed({"text": "hi"})
    await asyncio.sleep(0.1)
    assert await a.store.get(job.id) is job
    assert await a.store.reserve(k, "other", "request") == (job.id, "request")
    for _ in range(300):  # the memory store sweeps once a second
        if await a.store.get(job.id) is None:
            break
        await asyncio.sleep(0.01)
    assert await a.store.get(job.id) is None
    assert await a.store.reserve(k, "other", "request") is None  # the key was forgotten with its job


async def test_past_its_count_the_memory_store_forgets_the_oldest_finished_jobs_first(replicas: Any) -> None:
    """A busy gateway ends hundreds of jobs a second: the memory store keeps `max_finished` of them,
    the oldest forgotten early (their keys with them); running jobs are never forgotten."""
    a = await replicas("memory", max_finished=3)
    running = await a.add(key())
    ended = []
    for i in range(5):
        job = await a.add(k := key())
        job.succeed({"i": i})
        ended.append((job, k))
    assert [await a.store.get(job.id) for job, _ in ended] == [None, None, *(job for job, _ in ended[2:])]
    assert await a.store.get(running.id) is running
    assert await a.store.reserve(ended[0][1], "other", "request") is None  # its key went with it
    assert len(await a.store.snapshots()) == 4


async def every_page(store: JobStore, whose: str | None, state: str | None, limit: int = 7) -> int:
    """Walk `GET /jobs`'s pages for `whose` and `state`, each checked against sorting every snapshot
    kept (the listing as it would be read whole); how many pages there were."""
    from gateway.server.store import JobsQuery

    cursor, pages = None, 0
    while True:
        query = JobsQuery(state, limit, cursor)
        ours = await store.listed(query, whose, [])
        whole = [s for s in await store.snapshots([]) if (whose is None or s.owner == whose) and query.wants(s)]
        assert ours == query.page(whole), (whose, state, cursor)
        pages += 1
        if ours.next is None:
            return pages
        created, _, job_id = ours.next.partition(":")
        cursor = (float(created), job_id)


async def many_jobs(replicas: list[Any], owners: list[str | None], count: int = 60) -> list[Job]:
    """`count` jobs of `owners` in turn, added on `replicas` in turn: a quarter succeeded, a quarter
    failed, the rest running; made at 13 moments, so that many share one (ties broken by the id)."""
    jobs = []
    for i in range(count):
        job = Job("echo", {"text": "hi"}, owner=owners[i % len(owners)])
        job.created = 1000.0 + (i * 7) % 13 + 0.1
        await replicas[i % len(replicas)].store.add(job)
        if i % 4 == 0:
            job.succeed({"i": i})
        elif i % 4 == 1:
            job.fail(Code.INTERNAL, "no")
        jobs.append(job)
    return jobs


async def test_the_memory_stores_pages_of_jobs_are_those_of_every_snapshot_sorted(replicas: Any) -> None:
    """`GET /jobs` on the memory store makes only the page's jobs snapshots: its pages, owner by owner,
    state by state and cursor by cursor, are the ones sorting every snapshot gives."""
    a = await replicas("memory", max_finished=1000)
    await many_jobs([a], ["alice", "bob", None])
    for whose in ("alice", "bob", None):
        for state in (None, "active", "finished", "failed"):
            assert await every_page(a.store, whose, state) >= 1


# -- only a shared store: two replicas on one Redis ---------------------------------------------


async def test_a_page_of_jobs_in_redis_reads_the_jobs_on_it_not_every_job(replicas: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Across replicas, `GET /jobs` reads a page's jobs from a list by owner (or of all) in the order
    of their making: its pages are those of every snapshot sorted, on either replica, and a page
    of seven reads eight jobs whatever the number kept; one expired is dropped from the list."""
    from gateway.server.store import JobsQuery

    a, b = await replicas("redis"), await replicas("redis")
    names = [f"{name}-{uuid.uuid4().hex[:8]}" for name in ("alice", "bob")]
    jobs = await many_jobs([a, b], [*names, None])
    for _ in range(500):  # until every end is copied to Redis: the pages and the whole are read apart
        copied = {s.job_id: s.status for s in await a.store.snapshots([])}
        if all(copied.get(job.id) == job.state for job in jobs):
            break
        await asyncio.sleep(0.02)
    for replica in (a, b):
        for whose in names:
            for state in (None, "active", "finished", "failed"):
                assert await every_page(replica.store, whose, state) >= 1
        everyone = await replica.store.listed(JobsQuery(None, 500, None), None, [])
        assert {job.id for job in jobs} <= {s.job_id for s in everyone.jobs}
    read: list[int] = []
    snapshots_of = a.store._snapshots_of
    a.store._snapshots_of = lambda ids, kept: read.append(len(ids)) or snapshots_of(ids, kept)
    page = await a.store.listed(JobsQuery(None, 7, None), names[0], [])
    assert len(page.jobs) == 7 and page.next is not None and sum(read) == 8
    # A job whose keys expired leaves the lists as a page meets it.
    gone = page.jobs[0].job_id
    await a.store._redis.delete(a.store.keys.job(gone))
    later = await a.store.listed(JobsQuery(None, 7, None), names[0], [])
    assert gone not in {s.job_id for s in later.jobs} and len(later.jobs) == 7
    assert await a.store._redis.zscore(a.store.keys.listing_by(names[0]), gone) is None
    # A state filter that passes over most jobs reads at most READ_MOST ids a page: pages come shorter
    # (some empty), their `next` going on where the reading stopped; the same jobs, in the same order.
    from gateway.server.redis_store import listing

    monkeypatch.setattr(listing, "READ_MOST", 4)
    a.store._snapshots_of = snapshots_of
    for whose in names:
        whole = [s for s in await a.store.snapshots([]) if s.owner == whose and s.status == "FAILED"]
        expected = [s.job_id for s in JobsQuery("failed", 500, None).page(whole).jobs]
        seen, cursor, short = [], None, 0
        while True:
            page = await a.store.listed(JobsQuery("failed", 3, cursor), whose, [])
            seen += [s.job_id for s in page.jobs]
            short += len(page.jobs) < 3 and page.next is not None
            if page.next is None:
                break
            created, _, job_id = page.next.partition(":")
            cursor = (float(created), job_id)
        assert seen == expected and short > 0


async def test_another_replica_follows_the_job(replicas: Any) -> None:
    a, b = await replicas("redis"), await replicas("redis")
    job = await a.add()
    job.set_status(Status.RUNNING)
    job.log("before")
    view = await b.store.get(job.id)
    assert isinstance(view, RedisJobView) and view.owner == a.store.replica_id
    assert view.snapshot().tool == "echo" and not view.done
    whole = asyncio.create_task(read_all(view))
    await eventually(lambda: len(job.events) >= 3)
    later = asyncio.create_task(read_all(await b.store.get(job.id), after=2))
    for i in range(5):
        job.log(f"line {i}")
        await asyncio.sleep(0.01)
    job.succeed({"text": "hi"})
    assert await whole == job.events  # same seqs, types and bytes
    assert await later == job.events[2:]
    finished = await b.store.get(job.id)
    assert finished.done and finished.terminal == job.terminal
    assert encode(finished.snapshot()) == encode(job.snapshot())


async def test_a_job_running_longer_than_two_leases_stays_listed(replicas: Any) -> None:
    # Its index entry is pruned two leases after it was last touched (by a copy or a heartbeat),
    # not after it was created: here a lease is under a second, and the job runs past three.
    a = await replicas("redis", retention=0.3, outage_grace=0.2)
    long = await a.add()
    long.set_status(Status.RUNNING)
    lease = a.store._lease_ms / 1000
    assert lease < 1.0
    await asyncio.sleep(2 * lease + 1.0)
    short = await a.add()  # an add prunes the index
    listed = {s.job_id for s in await a.store.snapshots()}
    assert {long.id, short.id} <= listed
    long.succeed({"text": "done"})


async def test_followers_on_one_replica_share_one_reader(replicas: Any, redis_server: Any) -> None:
    """Many clients following one job through one replica: Redis sees one blocked XREAD, not one per client."""
    a, b = await replicas("redis"), await replicas("redis")
    job = await a.add()
    job.set_status(Status.RUNNING)
    views = [await b.store.get(job.id) for _ in range(50)]
    readers = [asyncio.create_task(read_all(view, timeout=15)) for view in views]
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        await eventually(lambda: job.id in b.store._tails, what="a reader")
        await asyncio.sleep(0.2)  # every follower is waiting now
        assert (await admin.info("clients"))["blocked_clients"] == 1
    finally:
        await admin.aclose()
    job.log("one")
    job.succeed({"text": "hi"})
    for events in await asyncio.gather(*readers):
        assert events == job.events


async def test_snapshot_on_another_replica_follows_the_job(replicas: Any) -> None:
    a, b = await replicas("redis"), await replicas("redis")
    job = await a.add()
    job.set_status(Status.QUEUED, position=3, queue_size=5)

    async def status() -> str:
        return (await b.store.get(job.id)).snapshot().status

    for _ in range(200):
        if await status() == "QUEUED":
            break
        await asyncio.sleep(0.01)
    assert (await b.store.get(job.id)).snapshot().position == 3


async def test_cancel_from_another_replica(replicas: Any) -> None:
    a, b = await replicas("redis"), await replicas("redis")
    job = await a.add()
    await b.store.cancel(await b.store.get(job.id))
    await eventually(lambda: a.cancelled == [job.id], what="the owner's cancel")
    assert b.cancelled == []
    view = await b.store.get(job.id)
    events = await read_all(view)
    assert events[-1].type.value == "error" and b'"cancelled"' in events[-1].data


async def test_a_key_bound_without_a_request_digest_reads_as_bound_to_its_job(replicas: Any) -> None:
    a = await replicas("redis")
    k = key()
    await a.store._redis.set(a.store.keys.idem(k), "job-old")  # as a replica of the last release wrote it
    assert await a.store.reserve(k, "job-new", "request") == ("job-old", "")
    await a.store.release(k, "job-old")
    assert await a.store.reserve(k, "job-new", "request") is None


async def test_idempotency_key_across_replicas(replicas: Any) -> None:
    a, b = await replicas("redis"), await replicas("redis")
    k = key()
    job = await a.add(k)
    assert await b.store.reserve(k, "another", "other request") == (job.id, "request")
    assert (await b.store.get(job.id)).id == job.id


async def test_a_follower_elsewhere_holds_the_job_past_the_grace(replicas: Any) -> None:
    a, b = await replicas("redis", detach_grace=0.3), await replicas("redis", detach_grace=0.3)
    job = await a.add()
    a.store.attach(job)
    view = await b.store.get(job.id)
    b.store.attach(view)
    a.store.detach(job)
    await asyncio.sleep(0.8)
    assert a.cancelled == [], "cancelled although a client on the other replica follows it"
    b.store.detach(view)
    await eventually(lambda: a.cancelled == [job.id], timeout=5, what="the cancel after the follower left")


async def test_a_job_taken_over_by_the_replica_its_clients_follow_it_on_is_let_go_when_they_leave(replicas: Any) -> None:
    """B's client follows A's job; A stops and B takes the job over (its `add` of the job going on
    there). The client is B's own follower now: once it leaves, the job is cancelled after the grace,
    as any of B's, and B no longer heartbeats an attachment of itself as another replica's follower."""
    a, b = await replicas("redis", detach_grace=0.2), await replicas("redis", detach_grace=0.2)
    job = await a.add()
    view = await b.store.get(job.id)
    b.store.attach(view)
    attached = b.store.keys.attached(job.id)
    crash(a.store)
    going_on = Job("echo", {"text": "hi"}, job_id=job.id, after=len(job.events))
    await b.store.add(going_on)
    b.store.detach(view)
    await eventually(lambda: b.cancelled == [job.id], timeout=5, what="the cancel once its client left")
    await asyncio.sleep(3 * HEARTBEAT)  # heartbeats that would attach it again
    assert await b.store._redis.zscore(attached, b.store.replica_id) is None


async def test_a_crashed_follower_does_not_pin_the_job(replicas: Any) -> None:
    a, b = await replicas("redis", detach_grace=0.2), await replicas("redis", detach_grace=0.2)
    job = await a.add()
    a.store.attach(job)
    b.store.attach(await b.store.get(job.id))
    a.store.detach(job)
    await asyncio.sleep(0.5)
    assert a.cancelled == []
    crash(b.store)  # B's attachment lapses after 3 heartbeats
    await eventually(lambda: a.cancelled == [job.id], timeout=5, what="the cancel once B's lease lapsed")


async def test_a_silent_owner_s_job_ends_with_backend_unavailable(replicas: Any) -> None:
    a, b = await replicas("redis"), await replicas("redis")
    job = await a.add()
    job.set_status(Status.RUNNING)
    for _ in range(500):
        view = await b.store.get(job.id)
        if view.snapshot().last_event_id == f"{job.id}:2":
            break
        await asyncio.sleep(0.01)
    reader = asyncio.create_task(read_all(view, timeout=15))
    crash(a.store)  # nothing refreshes its liveness key any more, nothing is copied
    events = await reader
    assert [e.seq for e in events] == [1, 2, 3]
    terminal = msgspec.json.decode(events[-1].data)
    assert terminal["error"]["code"] == "backend_unavailable" and terminal["seq"] == 3
    again = await b.store.get(job.id)
    assert again.done and again.snapshot().status == "FAILED"
    assert again.snapshot().last_event_id == f"{job.id}:3"


async def test_redis_unreachable(replicas: Any) -> None:
    a = await replicas("redis", url=f"redis://127.0.0.1:{free_port()}/0")
    assert a.store.problem is not None and "unreachable" in a.store.problem
    with pytest.raises(ApiError) as refused:
        await a.store.reserve(key(), "job", "request")
    assert refused.value.status == 503 and refused.value.code is Code.STORE_UNAVAILABLE
    job = Job("echo", {"text": "hi"})
    with pytest.raises(ApiError) as refused:
        await a.store.add(job)
    assert refused.value.status == 503 and a.cancelled == [job.id]  # nothing runs that nobody can find
    with pytest.raises(ApiError):
        await a.store.get(uuid.uuid4().hex)


async def test_redis_restart_loses_nothing_of_a_running_job(replicas: Any, tmp_path: Any) -> None:
    """Redis goes down mid-job and comes back empty: the owner streams on, then copies the whole log again."""
    server = start_redis(tmp_path)
    try:
        a, b = await replicas("redis", url=server.url), await replicas("redis", url=server.url)
        job = await a.add()
        job.set_status(Status.RUNNING)
        follower = await a.store.get(job.id)
        server.stop()
        job.log("while Redis is down")
        assert (await follower.wait_events(2, timeout=1)) == job.events[2:]  # the owner serves from memory
        with pytest.raises(ApiError):
            await b.store.get(job.id)
        await eventually(lambda: a.store.problem is not None, what="the store to notice")
        server.start()
        await eventually(lambda: a.store.problem is None, what="the store to recover")
        job.log("after")
        job.succeed({"text": "hi"})
        for _ in range(300):
            view = await b.store.get(job.id)
            if view is not None and view.done:
                break
            await asyncio.sleep(0.02)
        assert await read_all(view) == job.events
    finally:
        server.stop()
