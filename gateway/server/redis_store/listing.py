"""`GET /jobs` on the Redis store by pages: every job's id in one sorted set and in its owner's,
scored by when it was made, so that a page reads the jobs on it (and those a state filter passes
over), never every job kept. Ids whose job has expired are dropped as a page meets them; each
set expires with the last job it lists, and keeps at most LISTED_MAX ids."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from gateway.jobs import Job
from gateway.protocol import JobList, JobSnapshot
from gateway.server.redis_store.keys import Keys
from gateway.server.store import JobsQuery

LISTED_MAX = 100_000  # ids a set keeps, the newest: beyond them a job is found by its id only
BATCH_MOST = 1024  # ids read at once while a state filter passes over jobs
READ_MOST = 8192  # ids one page reads at most: past them, a shorter page whose `next` goes on from there


def enlist(pipe: Any, keys: Keys, jobs: Iterable[Job], ttl_ms: int) -> None:
    """Queue on `pipe` the writes that list `jobs`: at their start and, for those still running, at
    each heartbeat (Redis may have come back empty); `ttl_ms` is as long as a job's keys may last."""
    touched = set()
    for job in jobs:
        for key in (keys.listing, keys.listing_by(job.owner or "")):
            pipe.zadd(key, {job.id: job.created})
            touched.add(key)
    for key in touched:
        pipe.zremrangebyrank(key, 0, -LISTED_MAX - 1)
        pipe.pexpire(key, ttl_ms)


async def page(
    redis: Any, key: str, query: JobsQuery, whose: str | None, snapshots_of: Callable[[list[str]], Awaitable[list[JobSnapshot]]]
) -> JobList:
    """`query`'s page of the set `key`, newest first: read in growing batches until the page and one
    more are found, the set ends, or READ_MOST ids were read (a state filter that passes over most
    jobs): then the page holds what was found, and its `next` goes on after the last id read.
    `whose`: the owner every job listed must have, or None for all."""
    top: Any = "+inf" if query.cursor is None else query.cursor[0]
    found: list[JobSnapshot] = []
    gone: list[str] = []
    offset, batch, last = 0, query.limit + 1, None
    while len(found) <= query.limit:
        members = await redis.zrevrangebyscore(key, top, "-inf", start=offset, num=batch, withscores=True)
        offset += len(members)
        ids = [m.decode() for m, score in members if query.cursor is None or (score, m.decode()) < query.cursor]
        snapshots = await snapshots_of(ids)
        read = {s.job_id for s in snapshots}
        gone += [job_id for job_id in ids if job_id not in read]
        found += [s for s in snapshots if (whose is None or s.owner == whose) and query.wants(s)]
        if len(members) < batch:
            break
        if offset >= READ_MOST and len(found) <= query.limit:
            last = (members[-1][1], members[-1][0].decode())
            break
        batch = min(batch * 2, BATCH_MOST)
    if gone:  # after the walk, so that no offset moved under it
        await redis.zrem(key, *gone)
    if last is None:
        return query.page(found)
    return JobList(query.page(found).jobs, f"{last[0]!r}:{last[1]}")
