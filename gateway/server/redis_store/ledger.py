"""The meter's ledger in Redis (gateway/server/metering.py): the rows and the quota windows that every
replica settles into and checks against, kept across restarts.

The rows are five hashes, one per measure (`usage:jobs`, `usage:tokens_in`, …), each field a row
(`tenant<TAB>class<TAB>model`); a tenant's window is a hash (`usage:hour:<tenant>:<bucket>`, and
`day`) of `tokens` and `device_s`, which expires once its window has turned. A job's settlement is
one script, whole: its row (or `(others)` past MAX_ROWS rows) and both windows.

A tenant's running jobs' token holds (metering.py `Meter.hold`) are a hash (`usage:holds:<tenant>`,
job id -> tokens) beside a sorted set of when each one's lease ends (`usage:holds-until:<tenant>`):
the replica running the job renews it, so that the holds of one that stopped go after HOLD_LEASE_S.
A hold is checked against the windows and the other holds, and made, in one script.
"""

from __future__ import annotations

from typing import Any

from gateway.server.metering import HOLD_LEASE_S, MAX_ROWS, OTHERS, WINDOWS, HoldRefused, Row, Spent, bucket, parse_row
from gateway.server.redis_store.keys import answering, small_client
from gateway.usage import JobUsage

MEASURES = ("jobs", "tokens_in", "tokens_out", "device_s", "result_bytes")

# KEYS: the five measures' hashes, the hour's window, the day's. ARGV: row, the row past the cap,
# the cap, the five amounts, the hour's and the day's time to live (s).
SETTLE = """
local row = ARGV[1]
if redis.call('HEXISTS', KEYS[1], row) == 0 and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then row = ARGV[2] end
redis.call('HINCRBY', KEYS[1], row, ARGV[4])
redis.call('HINCRBY', KEYS[2], row, ARGV[5])
redis.call('HINCRBY', KEYS[3], row, ARGV[6])
redis.call('HINCRBYFLOAT', KEYS[4], row, ARGV[7])
redis.call('HINCRBY', KEYS[5], row, ARGV[8])
local tokens = tonumber(ARGV[5]) + tonumber(ARGV[6])
for i = 0, 1 do
  redis.call('HINCRBY', KEYS[6 + i], 'tokens', tokens)
  redis.call('HINCRBYFLOAT', KEYS[6 + i], 'device_s', ARGV[7])
  redis.call('EXPIRE', KEYS[6 + i], ARGV[9 + i])
end
return 1
"""

# The live holds' sum, those whose lease ended dropped first. KEYS: the holds, their leases. ARGV: now (ms).
_LIVE = """
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])) do
  redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
end
local held = 0
for _, tokens in ipairs(redis.call('HVALS', KEYS[1])) do held = held + tonumber(tokens) end
"""
HELD = _LIVE + "return held"
# KEYS: the holds, their leases, the hour's window, the day's. ARGV: now (ms), the job, its tokens,
# the lease (ms), then (window: 1 the hour, 2 the day; its limit) pairs. {0} once held, else
# {the window passed, what was spent in it, what is held}.
HOLD = _LIVE + """
local tokens = tonumber(ARGV[3])
for i = 5, #ARGV, 2 do
  local used = tonumber(redis.call('HGET', KEYS[2 + tonumber(ARGV[i])], 'tokens') or '0')
  if used + held + tokens > tonumber(ARGV[i + 1]) then return {tonumber(ARGV[i]), used, held} end
end
redis.call('HSET', KEYS[1], ARGV[2], tokens)
redis.call('ZADD', KEYS[2], tonumber(ARGV[1]) + tonumber(ARGV[4]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return {0}
"""
WINDOW_ORDER = list(WINDOWS)  # the script's 1 and 2

_answering = answering("the usage ledger")


class RedisLedger:
    """Settled use in Redis at `url`, under `prefix` (the store's)."""

    def __init__(self, url: str, prefix: str = "streamgate:", max_rows: int = MAX_ROWS, hold_lease: float = HOLD_LEASE_S) -> None:
        self.prefix, self.max_rows, self.hold_lease_ms = prefix, max_rows, int(hold_lease * 1000)
        self.redis = small_client(url)
        self.script: Any = self.redis.register_script(SETTLE)
        self.hold_script: Any = self.redis.register_script(HOLD)
        self.held_script: Any = self.redis.register_script(HELD)

    def _holds(self, tenant: str) -> list[str]:
        return [f"{self.prefix}usage:holds:{tenant}", f"{self.prefix}usage:holds-until:{tenant}"]

    @_answering
    async def hold(self, tenant: str, job_id: str, tokens: int, limits: list[tuple[str, int]], now: float) -> HoldRefused | None:
        keys = [*self._holds(tenant), *(self._window(w, tenant, now) for w in WINDOW_ORDER)]
        pairs = [value for window, limit in limits for value in (WINDOW_ORDER.index(window) + 1, limit)]
        answer = await self.hold_script(keys=keys, args=[int(now * 1000), job_id, tokens, self.hold_lease_ms, *pairs])
        return None if answer[0] == 0 else HoldRefused(WINDOW_ORDER[answer[0] - 1], int(answer[1]), int(answer[2]))

    @_answering
    async def held(self, tenant: str, now: float) -> int:
        return int(await self.held_script(keys=self._holds(tenant), args=[int(now * 1000)]))

    @_answering
    async def release(self, tenant: str, job_id: str) -> None:
        holds, until = self._holds(tenant)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(holds, job_id)
            pipe.zrem(until, job_id)
            await pipe.execute()

    @_answering
    async def renew(self, holds: list[tuple[str, str]], now: float) -> None:
        if not holds:
            return
        ends = int(now * 1000) + self.hold_lease_ms
        async with self.redis.pipeline(transaction=False) as pipe:
            for tenant, job_id in holds:
                pipe.zadd(self._holds(tenant)[1], {job_id: ends}, xx=True)
            for tenant in {tenant for tenant, _ in holds}:
                for key in self._holds(tenant):
                    pipe.pexpire(key, self.hold_lease_ms)
            await pipe.execute()

    def _measure(self, measure: str) -> str:
        return f"{self.prefix}usage:{measure}"

    def _window(self, window: str, tenant: str, now: float) -> str:
        return f"{self.prefix}usage:{window}:{tenant}:{bucket(window, now)}"

    async def settle(self, key: str, tenant: str, usage: JobUsage, now: float) -> None:
        others = "\t".join([OTHERS, *key.split("\t")[1:]])
        keys = [*(self._measure(m) for m in MEASURES), *(self._window(w, tenant, now) for w in WINDOWS)]
        # A window's key lives until its window has turned, and a while after: a clock a little behind reads it still.
        ttls = [int((bucket(w, now) + 1) * length - now) + 60 for w, length in WINDOWS.items()]
        await self.script(keys=keys, args=[key, others, self.max_rows, *(getattr(usage, m) for m in MEASURES), *ttls])

    @_answering
    async def spent(self, tenant: str, now: float) -> dict[str, Spent]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for window in WINDOWS:
                pipe.hmget(self._window(window, tenant, now), "tokens", "device_s")
            answers = await pipe.execute()
        return {window: Spent(int(tokens or 0), float(device_s or 0)) for window, (tokens, device_s) in zip(WINDOWS, answers)}

    @_answering
    async def rows(self, tenant: str | None = None) -> list[Row]:
        # A piece at a time (HSCAN), never a whole table in one answer: the event loop runs other
        # requests between pieces. A tenant's fields only are matched by Redis, not read here.
        pattern = None if tenant is None else _glob_escaped(tenant) + "\t*"
        tables = [{field: value async for field, value in self.redis.hscan_iter(self._measure(m), match=pattern, count=1000)} for m in MEASURES]
        usages: dict[str, JobUsage] = {}
        for measure, table in zip(MEASURES, tables):
            for field, value in table.items():
                usage = usages.setdefault(field.decode(), JobUsage())
                setattr(usage, measure, float(value) if measure == "device_s" else int(value))
        return [parse_row(key, usage) for key, usage in usages.items()]

    async def close(self) -> None:
        await self.redis.aclose()


def _glob_escaped(text: str) -> str:
    """`text` matched as itself by a Redis glob pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
