"""Metered usage and quotas: what each tenant used, by class and model, and each class's quotas.

A job's use (gateway/usage.py: tokens in and out, device-seconds, result bytes) is counted where it
ran and comes back with its terminal event; as the job ends here, the meter settles it:

- into the rows of the ledger, one per (tenant, class, model), for `GET /usage` and the CLI's
  `streamgate usage`; at most `MAX_ROWS` of them, a tenant past that counted as `(others)`;
- into the tenant's windows, the clock hour and the UTC day it ended in, which the class's
  quotas (gateway/server/classes.py: `tokens_per_hour`, `tokens_per_day`,
  `device_seconds_per_hour`, `device_seconds_per_day`) are checked against at admission: a
  tenant whose window has reached a quota is refused 429 `rate_limited`, the message naming the
  quota, with `Retry-After` the seconds until the window turns;
- into this process's Prometheus counters, labelled by tenant, class and model: the first
  `METRIC_TENANTS` tenants by name, the others summed as `(others)`, so that a scrape stays small
  (100,000 tenants would make it 40 MB, written in seconds on the event loop).

A token quota also holds, while a job runs, the most tokens it may count (its price's
`most_counted`, gateway/cost.py): a job is refused 429 when what its tenant used this window, what
its running jobs hold and its own would pass the quota (413 when its own alone would), so that
running jobs never take a tenant past a token quota together. What a job held is given back as its
use is settled. The holds are this process's: with several replicas, each holds its own jobs'.
A device-seconds quota is checked on what ended jobs used: a job's time is not priced before it
runs, so the jobs a tenant has running may pass it by their own use, and no further (the class's
`max_concurrent` and `job_timeout` bound them).

With the Redis store (`--store redis://…`), the ledger and the windows live in Redis
(gateway/server/redis_store/ledger.py): every replica settles into the same rows and checks the
same windows, and they outlive a restart. Otherwise they are this process's, in memory.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.protocol import Code
from gateway.server.classes import Quotas
from gateway.usage import JobUsage

log = logging.getLogger("streamgate.metering")

MAX_ROWS = 100_000  # (tenant, class, model) rows a ledger keeps: past it, new tenants are counted as OTHERS
METRIC_TENANTS = 500  # tenants this process's counters name; the rest are summed as OTHERS
OTHERS = "(others)"
NO_CLASS = ""  # the class of a caller without one (no tokens, or a token of no class)
WINDOWS = {"hour": 3600, "day": 86400}


class Row(msgspec.Struct):
    """One tenant's use of one model, in one class, since the ledger began."""

    tenant: str
    user_class: str = msgspec.field(name="class")
    model: str
    usage: JobUsage


class Spent(msgspec.Struct):
    """A tenant's use in the window a quota is counted over."""

    tokens: int = 0
    device_s: float = 0.0


class QuotaLeft(msgspec.Struct):
    """One quota of a caller's class: its limit, what of it is used this window, what the caller's
    running jobs hold of it here (a token quota's: the tokens they may still count), and when the
    window turns."""

    name: str
    limit: float
    used: float
    resets_in_s: float
    held: float = 0


def bucket(window: str, now: float) -> int:
    """Which hour (or UTC day) `now` falls in, counted from the epoch."""
    return int(now // WINDOWS[window])


def row_key(tenant: str, user_class: str, model: str) -> str:
    return f"{tenant}\t{user_class}\t{model}"


class Ledger(Protocol):
    """Where settled use is kept: this process's memory, or Redis shared by every replica."""

    async def settle(self, key: str, tenant: str, usage: JobUsage, now: float) -> None: ...

    async def spent(self, tenant: str, now: float) -> dict[str, Spent]: ...

    async def rows(self, tenant: str | None = None) -> list[Row]:
        """Every row, or `tenant`'s."""

    async def close(self) -> None: ...


def parse_row(key: str, usage: JobUsage) -> Row:
    tenant, user_class, model = (key.split("\t") + ["", ""])[:3]
    return Row(tenant, user_class, model, usage)


class MemoryLedger:
    """Settled use in this process: rows (at most MAX_ROWS) and each tenant's current windows."""

    def __init__(self, max_rows: int = MAX_ROWS) -> None:
        self.max_rows = max_rows
        self.totals: dict[str, JobUsage] = {}
        self.by_tenant: dict[str, list[str]] = {}  # each tenant's rows' keys: its own are read without the others'
        # Per tenant, per window: (its bucket, what was spent in it). A tenant's entry goes once both
        # of its windows have turned (swept as the table grows), so the table is bounded by the
        # tenants active in a day, and by MAX_ROWS at most.
        self.windows: dict[str, dict[str, tuple[int, Spent]]] = {}

    def add(self, key: str, tenant: str, usage: JobUsage, now: float) -> None:
        if key not in self.totals:
            if len(self.totals) >= self.max_rows:
                key = row_key(OTHERS, *key.split("\t")[1:])
            if key not in self.totals:
                self.by_tenant.setdefault(key.split("\t", 1)[0], []).append(key)
        self.totals.setdefault(key, JobUsage()).add(usage)
        mine = self.windows.get(tenant)
        if mine is None:
            if len(self.windows) >= self.max_rows:
                self._sweep(now)
            mine = self.windows.setdefault(tenant, {})
        for window in WINDOWS:
            at = bucket(window, now)
            held = mine.get(window)
            spent = held[1] if held is not None and held[0] == at else Spent()
            spent.tokens += usage.tokens
            spent.device_s += usage.device_s
            mine[window] = (at, spent)

    def _sweep(self, now: float) -> None:
        day = bucket("day", now)
        for tenant in [t for t, mine in self.windows.items() if all(at < day for at, _ in mine.values())]:
            del self.windows[tenant]
        while len(self.windows) >= self.max_rows:  # all active today: the oldest entry goes
            del self.windows[next(iter(self.windows))]

    async def settle(self, key: str, tenant: str, usage: JobUsage, now: float) -> None:
        self.add(key, tenant, usage, now)

    async def spent(self, tenant: str, now: float) -> dict[str, Spent]:
        mine = self.windows.get(tenant, {})
        return {window: held[1] if (held := mine.get(window)) is not None and held[0] == bucket(window, now) else Spent() for window in WINDOWS}

    async def rows(self, tenant: str | None = None) -> list[Row]:
        keys = self.totals if tenant is None else self.by_tenant.get(tenant, ())
        return [parse_row(key, self.totals[key]) for key in keys]

    async def close(self) -> None:
        pass


@dataclass(frozen=True)
class _Quota:
    name: str
    window: str
    measure: str  # a `Spent` field


_QUOTAS = (
    _Quota("tokens_per_hour", "hour", "tokens"),
    _Quota("tokens_per_day", "day", "tokens"),
    _Quota("device_seconds_per_hour", "hour", "device_s"),
    _Quota("device_seconds_per_day", "day", "device_s"),
)


class Meter:
    """Settles ended jobs into the ledger (and this process's counters), and checks quotas."""

    def __init__(self, ledger: Ledger | None = None, clock: Any = time.time) -> None:
        self.ledger: Ledger = ledger if ledger is not None else MemoryLedger()
        # This process's own counts, for Prometheus (counters per process, summed across replicas
        # there): by (tenant, class, model), the tenants past METRIC_TENANTS as OTHERS.
        self.counts: dict[tuple[str, str, str], JobUsage] = {}
        self._named: set[str] = set()
        self.clock = clock
        self._writes: set[asyncio.Task[None]] = set()
        # Tokens this process's running jobs may still count, per tenant (`hold`): only tenants
        # with jobs running, so as many entries as those at most.
        self.held: dict[str, int] = {}

    async def left(self, tenant: str, quotas: Quotas) -> list[QuotaLeft]:
        """Each quota of `quotas`: its limit, what `tenant` used of it this window, and when that turns."""
        if not quotas:
            return []
        now = self.clock()
        spent = await self.ledger.spent(tenant, now)
        out = []
        for quota in _QUOTAS:
            limit = getattr(quotas, quota.name)
            if limit is not None:
                used = getattr(spent[quota.window], quota.measure)
                resets = (bucket(quota.window, now) + 1) * WINDOWS[quota.window] - now
                held = self.held.get(tenant, 0) if quota.measure == "tokens" else 0
                out.append(QuotaLeft(quota.name, limit, round(used, 3), round(resets, 1), held))
        return out

    async def check(self, tenant: str, quotas: Quotas, user_class: str | None) -> None:
        """Refuse (429) a tenant that has used up one of its class's quotas in its current window."""
        for quota in await self.left(tenant, quotas):
            if quota.used >= quota.limit:
                raise ApiError(
                    Code.RATE_LIMITED,
                    f"the {quota.name} quota of the class {user_class!r} ({quota.limit:g}) is used up: {quota.used:g} "
                    f"this {quota.name.rsplit('_', 1)[1]}; it turns in {math.ceil(quota.resets_in_s)} s",
                    retry_after=quota.resets_in_s,
                )

    async def hold(self, tenant: str, quotas: Quotas, user_class: str | None, tokens: int) -> Callable[[], None]:
        """Hold the `tokens` a job may count against `tenant`'s token quotas while it runs (what gives
        them back, once its use is settled): 429 while what the tenant used this window, what its
        running jobs hold and these would pass a quota; 413 when these alone would."""
        limits = [(quota, getattr(quotas, quota.name)) for quota in _QUOTAS if quota.measure == "tokens"]
        limits = [(quota, limit) for quota, limit in limits if limit is not None]
        if not limits or tokens <= 0:
            return lambda: None
        now = self.clock()
        spent = await self.ledger.spent(tenant, now)
        held = self.held.get(tenant, 0)  # read after the wait: what other admissions held meanwhile counts
        for quota, limit in limits:
            if tokens > limit:
                raise ApiError(
                    Code.TOO_LARGE,
                    f"the job may count {tokens} tokens, more than the {quota.name} quota of the class {user_class!r} ({limit}) allows",
                )
            used = spent[quota.window].tokens
            if used + held + tokens > limit:
                resets = (bucket(quota.window, now) + 1) * WINDOWS[quota.window] - now
                raise ApiError(
                    Code.RATE_LIMITED,
                    f"the {quota.name} quota of the class {user_class!r} ({limit}) would be passed: {used} used this "
                    f"{quota.window}, {held} held by your running jobs, and this job may count {tokens}; it turns in {math.ceil(resets)} s",
                    retry_after=resets,
                )
        self.held[tenant] = held + tokens
        given = False

        def give_back() -> None:
            nonlocal given
            if given:
                return
            given = True
            left = self.held.get(tenant, 0) - tokens
            if left > 0:
                self.held[tenant] = left
            else:
                self.held.pop(tenant, None)

        return give_back

    def settle(self, job: Job, user_class: str | None) -> None:
        """The ended job's use, into the ledger (a write to Redis goes on in the background)."""
        # A job handed to another replica counts its use here, and as a job where it ends.
        usage = JobUsage(jobs=0 if job.handed_off else 1)
        usage.add(job.usage)
        key, now = row_key(job.tenant, user_class or NO_CLASS, job.model or ""), self.clock()
        self._count(job.tenant, user_class or NO_CLASS, job.model or "", usage)
        if isinstance(self.ledger, MemoryLedger):
            self.ledger.add(key, job.tenant, usage, now)
            return
        task = asyncio.ensure_future(self._settle(key, job.tenant, usage, now))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _settle(self, key: str, tenant: str, usage: JobUsage, now: float) -> None:
        try:
            await self.ledger.settle(key, tenant, usage, now)
        except Exception as exc:  # a store that is down loses this count, never the job
            log.warning("a job's usage could not be settled in the ledger: %s", exc)

    def _count(self, tenant: str, user_class: str, model: str, usage: JobUsage) -> None:
        if tenant not in self._named:
            if len(self._named) < METRIC_TENANTS:
                self._named.add(tenant)
            else:
                tenant = OTHERS
        self.counts.setdefault((tenant, user_class, model), JobUsage()).add(usage)

    async def rows(self, tenant: str | None = None) -> list[Row]:
        return await self.ledger.rows(tenant)

    def counted(self) -> Iterator[tuple[tuple[str, str, str], JobUsage]]:
        """This process's settled use, per (tenant, class, model), for its counters."""
        yield from self.counts.items()

    async def close(self) -> None:
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        await self.ledger.close()


USAGE_KEYS = ("tenant", "class", "model")
MAX_USAGE_ROWS = 10_000  # rows one `GET /usage` answers with at most


def summed(rows: list[Row], by: list[str]) -> list[Row]:
    """`rows` summed over what `by` leaves out (its fields "" in the sums), the largest device-seconds first."""
    sums: dict[tuple[str, str, str], JobUsage] = {}
    for row in rows:
        key = (row.tenant if "tenant" in by else "", row.user_class if "class" in by else "", row.model if "model" in by else "")
        sums.setdefault(key, JobUsage()).add(row.usage)
    out = [Row(*key, usage) for key, usage in sums.items()]
    out.sort(key=lambda row: (-row.usage.device_s, row.tenant, row.user_class, row.model))
    return out
