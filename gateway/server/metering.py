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
use is settled. With the Redis store the holds are in Redis beside the windows, checked and made in
one script, so that replicas admitting at once hold together; a replica renews its jobs' holds every
HOLD_RENEW_S, and those of one that stopped go after HOLD_LEASE_S.
A device-seconds quota is checked on what ended jobs used: a job's time is not priced before it
runs, so the jobs a tenant has running may pass it by their own use, and no further (the class's
`max_concurrent` and `job_timeout` bound them).

With the Redis store (`--store redis://…`), the ledger and the windows live in Redis
(gateway/server/redis_store/ledger.py): every replica settles into the same rows and checks the
same windows, and they outlive a restart. Otherwise they are this process's, in memory.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import msgspec

from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.protocol import Code
from gateway.server.classes import Quotas
from gateway.usage import JobUsage

log = logging.getLogger("streamgate.metering")

HOLD_LEASE_S = 30.0  # a shared ledger's hold of a job not renewed this long (its replica stopped) is let go
HOLD_RENEW_S = 10.0  # how often a replica renews its running jobs' holds

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
    running jobs hold of it (a token quota's: the tokens they may still count), and when the window
    turns."""

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

    async def hold(self, tenant: str, job_id: str, tokens: int, limits: list[tuple[str, int]], now: float) -> HoldRefused | None:
        """Hold `tokens` for the job `job_id` if, in each (window, limit), what `tenant` spent, what its
        jobs hold and these stay within the limit, checked and held as one step: None once held, else
        the first window they would pass."""

    async def held(self, tenant: str, now: float) -> int:
        """The tokens `tenant`'s running jobs hold."""

    async def release(self, tenant: str, job_id: str) -> None: ...

    async def renew(self, holds: list[tuple[str, str]], now: float) -> None:
        """The holds (tenant, job id) of jobs still running here: kept a lease longer (a shared ledger
        lets those of a replica that stopped go after a lease)."""

    async def close(self) -> None: ...


class HoldRefused(NamedTuple):
    """A hold refused: the window it would pass, what was spent in it and what is held."""

    window: str
    used: int
    held: int


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
        self.holds: dict[str, dict[str, int]] = {}  # per tenant with jobs running, each job's hold

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

    async def hold(self, tenant: str, job_id: str, tokens: int, limits: list[tuple[str, int]], now: float) -> HoldRefused | None:
        spent, held = await self.spent(tenant, now), await self.held(tenant, now)
        for window, limit in limits:
            if spent[window].tokens + held + tokens > limit:
                return HoldRefused(window, spent[window].tokens, held)
        self.holds.setdefault(tenant, {})[job_id] = tokens
        return None

    async def held(self, tenant: str, now: float) -> int:
        return sum(self.holds.get(tenant, {}).values())

    async def release(self, tenant: str, job_id: str) -> None:
        self.let_go(tenant, job_id)

    def let_go(self, tenant: str, job_id: str) -> None:
        mine = self.holds.get(tenant)
        if mine is not None:
            mine.pop(job_id, None)
            if not mine:
                del self.holds[tenant]

    async def renew(self, holds: list[tuple[str, str]], now: float) -> None:
        pass  # this process's: they go with it

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
        # The holds of this process's running jobs (`hold`): job id -> tenant, renewed while they run;
        # and the settlements in flight, by job id, which a hold is given back after.
        self.holding: dict[str, str] = {}
        self._settling: dict[str, asyncio.Future[None]] = {}
        self._renewing: asyncio.Task[None] | None = None

    async def left(self, tenant: str, quotas: Quotas) -> list[QuotaLeft]:
        """Each quota of `quotas`: its limit, what `tenant` used of it this window, when that turns, and
        (token quotas) what its running jobs hold."""
        used = await self._used(tenant, quotas)
        tokens = [quota for quota in used if quota.name.startswith("tokens_")]
        if tokens:
            held = await self.ledger.held(tenant, self.clock())
            for quota in tokens:
                quota.held = held
        return used

    async def _used(self, tenant: str, quotas: Quotas) -> list[QuotaLeft]:
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
                out.append(QuotaLeft(quota.name, limit, round(used, 3), round(resets, 1)))
        return out

    async def check(self, tenant: str, quotas: Quotas, user_class: str | None) -> None:
        """Refuse (429) a tenant that has used up one of its class's quotas in its current window: one
        read of its windows, before the job is priced (what running jobs hold is `hold`'s to count)."""
        for quota in await self._used(tenant, quotas):
            if quota.used >= quota.limit:
                raise ApiError(
                    Code.RATE_LIMITED,
                    f"the {quota.name} quota of the class {user_class!r} ({quota.limit:g}) is used up: {quota.used:g} "
                    f"this {quota.name.rsplit('_', 1)[1]}; it turns in {math.ceil(quota.resets_in_s)} s",
                    retry_after=quota.resets_in_s,
                )

    async def hold(self, tenant: str, quotas: Quotas, user_class: str | None, tokens: int, job_id: str) -> Callable[[], None]:
        """Hold the `tokens` the job `job_id` may count against `tenant`'s token quotas while it runs
        (what gives them back, after its use is settled): 429 while what the tenant used this window,
        what its running jobs hold (on every replica, with a shared ledger) and these would pass a
        quota; 413 when these alone would."""
        limits = [(quota, getattr(quotas, quota.name)) for quota in _QUOTAS if quota.measure == "tokens"]
        limits = [(quota, limit) for quota, limit in limits if limit is not None]
        if not limits or tokens <= 0:
            return lambda: None
        for quota, limit in limits:
            if tokens > limit:
                raise ApiError(
                    Code.TOO_LARGE,
                    f"the job may count {tokens} tokens, more than the {quota.name} quota of the class {user_class!r} ({limit}) allows",
                )
        now = self.clock()
        refused = await self.ledger.hold(tenant, job_id, tokens, [(quota.window, limit) for quota, limit in limits], now)
        if refused is not None:
            quota, limit = next((quota, limit) for quota, limit in limits if quota.window == refused.window)
            resets = (bucket(quota.window, now) + 1) * WINDOWS[quota.window] - now
            raise ApiError(
                Code.RATE_LIMITED,
                f"the {quota.name} quota of the class {user_class!r} ({limit}) would be passed: {refused.used} used this "
                f"{quota.window}, {refused.held} held by your running jobs, and this job may count {tokens}; it turns in {math.ceil(resets)} s",
                retry_after=resets,
            )
        self.holding[job_id] = tenant
        if not isinstance(self.ledger, MemoryLedger) and self._renewing is None:
            self._renewing = asyncio.ensure_future(self._renew())
        return functools.partial(self._give_back, tenant, job_id)

    def _give_back(self, tenant: str, job_id: str) -> None:
        if self.holding.pop(job_id, None) is None:  # given back already
            return
        if isinstance(self.ledger, MemoryLedger):
            self.ledger.let_go(tenant, job_id)  # after the settling, which a memory ledger does at once
            return
        self._background(self._release(tenant, job_id, self._settling.get(job_id)))

    async def _release(self, tenant: str, job_id: str, settling: asyncio.Future[None] | None) -> None:
        # Once the job's use is in the ledger: until then, the hold is what counts it.
        if settling is not None:
            await asyncio.wait([settling])
        try:
            await self.ledger.release(tenant, job_id)
        except Exception as exc:  # a store that is down: the hold goes with its lease
            log.warning("a job's quota hold could not be given back: %s", exc)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(HOLD_RENEW_S)
            try:
                await self.ledger.renew(list((tenant, job_id) for job_id, tenant in self.holding.items()), self.clock())
            except Exception as exc:  # tried again at the next turn, well within a lease
                log.warning("quota holds could not be renewed: %s", exc)

    def _background(self, work: Any) -> asyncio.Future[None]:
        task = asyncio.ensure_future(work)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return task

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
        task = self._background(self._settle(key, job.tenant, usage, now))
        if job.id in self.holding:  # its hold is given back once this is written
            self._settling[job.id] = task
            task.add_done_callback(lambda _: self._settling.pop(job.id, None))

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
        if self._renewing is not None:
            self._renewing.cancel()
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
