"""The meter's ledger in Redis (gateway/server/metering.py): the rows and the quota windows that every
replica settles into and checks against, kept across restarts.

The rows are five hashes, one per measure (`usage:jobs`, `usage:tokens_in`, …), each field a row
(`tenant<TAB>class<TAB>model`); a tenant's window is a hash (`usage:hour:<tenant>:<bucket>`, and
`day`) of `tokens` and `device_s`, which expires once its window has turned. A job's settlement is
one script, whole: its row (or `(others)` past MAX_ROWS rows) and both windows.
"""

from __future__ import annotations

from typing import Any

from gateway.server.metering import MAX_ROWS, OTHERS, WINDOWS, Row, Spent, bucket, parse_row
from gateway.server.redis_store.keys import small_client
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


class RedisLedger:
    """Settled use in Redis at `url`, under `prefix` (the store's)."""

    def __init__(self, url: str, prefix: str = "streamgate:", max_rows: int = MAX_ROWS) -> None:
        self.prefix, self.max_rows = prefix, max_rows
        self.redis = small_client(url)
        self.script: Any = self.redis.register_script(SETTLE)

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

    async def spent(self, tenant: str, now: float) -> dict[str, Spent]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for window in WINDOWS:
                pipe.hmget(self._window(window, tenant, now), "tokens", "device_s")
            answers = await pipe.execute()
        return {window: Spent(int(tokens or 0), float(device_s or 0)) for window, (tokens, device_s) in zip(WINDOWS, answers)}

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
