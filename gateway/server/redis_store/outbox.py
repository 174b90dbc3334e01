"""Completion webhooks' deliveries in Redis (gateway/server/webhooks.py): every replica puts its jobs'
there and tries whichever are due, so that one a stopped replica was delivering is delivered by
another, or by itself once it is back.

A delivery is a key (`webhook:<job id>`, its msgpack) and, while a try is due, a member of the
sorted set `webhooks` scored by when; while its job runs, a member of the set `webhooks:waiting`. Claiming moves the members due to a lease's end in one
script: a replica that dies mid-try leaves it to be claimed again once the lease is over. An ended
delivery is kept as long as jobs are (`retention`), for `GET /jobs/{id}`.

What the outbox holds is counted as it changes, in the script that puts a delivery (so that the same
delivery put twice counts once): the open ones in a sorted set for all and one per tenant (scored by
when each was put first, so that one whose key expired unended leaves them after a week), and the
pending ones' inline bytes in a hash beside their total.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from gateway.server.redis_store.keys import answering, small_client
from gateway.server.webhooks import Delivery, OutboxHeld

_answering = answering("the webhook outbox")  # on a request's path: a run's admission
KEPT_OPEN_S = 7 * 86400  # a delivery waiting for its job lives as long as a running job's record may

# KEYS: the set of due deliveries. ARGV: now (ms), the lease's end (ms), the most to claim.
CLAIM = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, id in ipairs(ids) do redis.call('ZADD', KEYS[1], ARGV[2], id) end
return ids
"""

# KEYS: the delivery, due, waiting, open (all), open (its tenant's), inline (hash), inline (total).
# ARGV: the delivery (msgpack), its key's seconds to live, state, job id, due (ms), now (ms), inline bytes.
PUT = """
local state, id = ARGV[3], ARGV[4]
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
if state == 'pending' then redis.call('ZADD', KEYS[2], ARGV[5], id) else redis.call('ZREM', KEYS[2], id) end
if state == 'waiting' then redis.call('SADD', KEYS[3], id) else redis.call('SREM', KEYS[3], id) end
if state == 'waiting' or state == 'pending' then
  redis.call('ZADD', KEYS[4], 'NX', ARGV[6], id)
  redis.call('ZADD', KEYS[5], 'NX', ARGV[6], id)
else
  redis.call('ZREM', KEYS[4], id)
  redis.call('ZREM', KEYS[5], id)
end
local old = tonumber(redis.call('HGET', KEYS[6], id) or '0')
local new = 0
if state == 'pending' then new = tonumber(ARGV[7]) end
if new ~= old then
  if new > 0 then redis.call('HSET', KEYS[6], id, new) else redis.call('HDEL', KEYS[6], id) end
  redis.call('INCRBY', KEYS[7], new - old)
end
"""

# PUT for a delivery waiting for its job, if the caps leave room: KEYS as PUT's; ARGV as PUT's, then
# the tenant's cap, the outbox's, and when a delivery put before counts as gone (ms). {1, tenant's,
# all} once put; {0, tenant's, all} when refused.
OPEN = """
for _, key in ipairs({KEYS[4], KEYS[5]}) do redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[10]) end
local mine, all = redis.call('ZCARD', KEYS[5]), redis.call('ZCARD', KEYS[4])
local counted = redis.call('ZSCORE', KEYS[5], ARGV[4])  -- its job's, open already (a job taken over)
if not counted and (mine >= tonumber(ARGV[8]) or all >= tonumber(ARGV[9])) then return {0, mine, all} end
""" + PUT + """
return {1, mine, all}
"""

# A delivery taken out whole (its run was refused). KEYS as PUT's; ARGV: job id.
DROP = """
local id = ARGV[1]
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], id)
redis.call('SREM', KEYS[3], id)
redis.call('ZREM', KEYS[4], id)
redis.call('ZREM', KEYS[5], id)
local old = tonumber(redis.call('HGET', KEYS[6], id) or '0')
if old > 0 then
  redis.call('HDEL', KEYS[6], id)
  redis.call('INCRBY', KEYS[7], -old)
end
"""


class RedisOutbox:
    """Deliveries kept in Redis at `url` under `prefix` (the store's), shared by every replica."""

    shared = True

    def __init__(self, url: str, retention: float, prefix: str = "streamgate:") -> None:
        self.prefix, self.retention = prefix, retention
        self.due_key = f"{prefix}webhooks"
        self.waiting_key = f"{prefix}webhooks:waiting"  # the jobs with a delivery waiting for their end
        self.open_key = f"{prefix}webhooks:open"
        self.inline_key = f"{prefix}webhooks:inline"
        self.redis = small_client(url)
        self.claim_script: Any = self.redis.register_script(CLAIM)
        self.put_script: Any = self.redis.register_script(PUT)
        self.open_script: Any = self.redis.register_script(OPEN)
        self.drop_script: Any = self.redis.register_script(DROP)

    def _key(self, job_id: str) -> str:
        return f"{self.prefix}webhook:{job_id}"

    def _put(self, delivery: Delivery) -> tuple[list[str], list[Any]]:
        """PUT's keys and arguments."""
        ttl = KEPT_OPEN_S if delivery.open else max(1, int(self.retention))
        keys = [
            self._key(delivery.job_id), self.due_key, self.waiting_key, self.open_key, f"{self.open_key}:{delivery.tenant}",
            self.inline_key, f"{self.inline_key}:total",
        ]
        args = [msgspec.msgpack.encode(delivery), ttl, delivery.state, delivery.job_id, int(delivery.due * 1000), int(time.time() * 1000), delivery.inline]
        return keys, args

    async def put(self, delivery: Delivery) -> None:
        keys, args = self._put(delivery)
        await self.put_script(keys=keys, args=args)

    @_answering
    async def open(self, delivery: Delivery, per_tenant: int, most: int) -> OutboxHeld | None:
        keys, args = self._put(delivery)
        put, mine, everyone = await self.open_script(keys=keys, args=[*args, per_tenant, most, _gone_ms()])
        return None if put else OutboxHeld(mine, everyone, 0)

    async def drop(self, delivery: Delivery) -> None:
        keys, _ = self._put(delivery)
        await self.drop_script(keys=keys, args=[delivery.job_id])

    @_answering
    async def held(self, tenant: str) -> OutboxHeld:
        gone = _gone_ms()
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in (f"{self.open_key}:{tenant}", self.open_key):
                pipe.zremrangebyscore(key, "-inf", gone)
                pipe.zcard(key)
            pipe.get(f"{self.inline_key}:total")
            found = await pipe.execute()
        return OutboxHeld(found[1], found[3], int(found[4] or 0))

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


def _gone_ms() -> int:
    """When a delivery put before then and never ended counts as gone (its key expired unended)."""
    return int((time.time() - KEPT_OPEN_S) * 1000)
