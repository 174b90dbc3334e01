"""Completion webhooks' deliveries in Redis (gateway/server/webhooks.py): every replica puts its jobs'
there and tries whichever are due, so that one a stopped replica was delivering is delivered by
another, or by itself once it is back.

A delivery is a key (`webhook:<job id>`, its msgpack) and, while a try is due, a member of the
sorted set `webhooks` scored by when; while its job runs, a member of the set `webhooks:waiting`. Claiming moves the members due to a lease's end in one
script: a replica that dies mid-try leaves it to be claimed again once the lease is over. An ended
delivery is kept as long as jobs are (`retention`), for `GET /jobs/{id}`.
"""

from __future__ import annotations

from typing import Any

import msgspec
from gateway.server.redis_store.keys import small_client
from gateway.server.webhooks import Delivery

# KEYS: the set of due deliveries. ARGV: now (ms), the lease's end (ms), the most to claim.
CLAIM = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, id in ipairs(ids) do redis.call('ZADD', KEYS[1], ARGV[2], id) end
return ids
"""


class RedisOutbox:
    """Deliveries kept in Redis at `url` under `prefix` (the store's), shared by every replica."""

    shared = True

    def __init__(self, url: str, retention: float, prefix: str = "streamgate:") -> None:
        self.prefix, self.retention = prefix, retention
        self.due_key = f"{prefix}webhooks"
        self.waiting_key = f"{prefix}webhooks:waiting"  # the jobs with a delivery waiting for their end
        self.redis = small_client(url)
        self.claim_script: Any = self.redis.register_script(CLAIM)

    def _key(self, job_id: str) -> str:
        return f"{self.prefix}webhook:{job_id}"

    async def put(self, delivery: Delivery) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            ended = delivery.state in ("delivered", "failed")
            # A waiting one lives as long as a running job's record may; an ended one as a finished job's.
            pipe.set(self._key(delivery.job_id), msgspec.msgpack.encode(delivery), ex=max(1, int(self.retention)) if ended else 7 * 86400)
            if delivery.state == "pending":
                pipe.zadd(self.due_key, {delivery.job_id: int(delivery.due * 1000)})
            else:
                pipe.zrem(self.due_key, delivery.job_id)
            if delivery.state == "waiting":
                pipe.sadd(self.waiting_key, delivery.job_id)
            else:
                pipe.srem(self.waiting_key, delivery.job_id)
            await pipe.execute()

    async def waiting(self, most: int) -> list[str]:
        """Some of the jobs whose delivery waits for their end (any replica's), for a look at whether
        their replica is still alive (gateway/server/webhooks.py `Webhooks.look`)."""
        ids = await self.redis.srandmember(self.waiting_key, most)
        gone = []
        found = []
        for raw in ids or []:
            job_id = raw.decode()
            (found if await self.redis.exists(self._key(job_id)) else gone).append(job_id)
        if gone:  # its delivery expired (a week): nothing to look at
            await self.redis.srem(self.waiting_key, *gone)
        return found

    async def claim(self, now: float, lease: float, most: int) -> list[Delivery]:
        if most <= 0:
            return []
        ids = await self.claim_script(keys=[self.due_key], args=[int(now * 1000), int((now + lease) * 1000), most])
        if not ids:
            return []
        found = await self.redis.mget([self._key(i.decode()) for i in ids])
        return [msgspec.msgpack.decode(raw, type=Delivery) for raw in found if raw is not None]

    async def get(self, job_id: str) -> Delivery | None:
        raw = await self.redis.get(self._key(job_id))
        return msgspec.msgpack.decode(raw, type=Delivery) if raw is not None else None

    async def next_due(self) -> float | None:
        return None  # polled: other replicas put deliveries in it too

    async def close(self) -> None:
        await self.redis.aclose()
