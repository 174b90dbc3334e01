"""The job queue of a served model: bounded, and fair between tenants.

Jobs wait here for a worker (backends/workers.py). The rule this module
owns is the order they are served in: tenants (`Job.tenant`: a token's name,
or without tokens a client's address; gateway/tenants.py) take turns, in
proportion to their jobs' `weight`, and each tenant's own jobs keep the order
they came in. One tenant's hundred waiting jobs then hold back another's one
job by a turn, not by a hundred.

The turns are start-time fair queueing: a job is put in line at a virtual time
`start = max(clock, the tenant's next turn)`, and its tenant's next turn is
`start + 1 / weight`; the queue is kept sorted by (start, arrival), and `clock`
is the largest start of the jobs taken so far. A tenant with nothing waiting
has no next turn, so it joins at the clock: it cannot save up turns while idle,
and a newcomer goes ahead of the jobs a flooding tenant queued for later turns.

Every waiting job is told its 1-based place in that order whenever it changes
(a newcomer's job can move others back), at a cost linear in the queue's
length per change; a flooding tenant's next job, put at the end, moves no
one. `take` gathers jobs for a batch in the same order.

Classes of users (gateway/server/classes.py) come before fairness: a job's
`priority` (its class's) ranks it ahead of every job of a lower one, and
tenants take turns within their own class, each class on its own clock. A
lower class is not starved: while it has jobs waiting, at least `min_share` of
the jobs taken are its (`--class-min-share`): once that many turns went by
without one of its jobs, its first job is the next served, the class waiting
longest first. The places each waiting job is told count that turn for the job
it promotes; behind it, the order is by class. With one class, the order is as
if there were none.

Two limits refuse a job before it waits: the queue's size (429 `queue_full`)
and the jobs one tenant may have waiting (`per_owner`, by default half the
queue's size, rounded up; 429 `rate_limited`), so that one client cannot fill
the queue for everyone.

The queue does not know what runs: a worker busy with one tenant's long batch
lets the head of the line through between its steps (backends/workers.py).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import math
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.protocol import Code, Status
from gateway.tenants import over_share


class _Turns(msgspec.Struct):
    """A tenant with jobs waiting: how many, and the virtual time of its next job's turn."""

    waiting: int = 0
    next: float = 0.0


MIN_SHARE = 0.1  # of the jobs taken, the least a waiting lower class gets


class _Place(msgspec.Struct):
    """A job's place in line: the line is sorted by `rank`, its class first (the higher the sooner),
    then its start, then its arrival. `reason`: why it waits again, told with its place (it was preempted)."""

    start: float
    seq: int
    job: Job
    reason: str | None = None

    @property
    def rank(self) -> tuple[int, float, int]:
        return -self.job.priority, self.start, self.seq


def _rank(place: _Place) -> tuple[int, float, int]:
    return place.rank


class JobQueue:
    """Jobs waiting for a worker, in fair order; full at `maxsize`, `per_owner` jobs per tenant at most."""

    def __init__(
        self, maxsize: int, eta: Callable[[int], float | None] = lambda n: None, per_owner: int | None = None,
        min_share: float = MIN_SHARE,
    ) -> None:
        self.maxsize = maxsize
        self.min_share = min_share
        self.per_owner = per_owner if per_owner is not None else -(-maxsize // 2)
        self._line: list[_Place] = []
        self._places: dict[Job, _Place] = {}
        self._tenants: dict[str, _Turns] = {}  # only those with jobs waiting
        self._clocks: dict[int, float] = {}  # each class's virtual time (by priority); only classes with jobs waiting
        # A lower class waiting this many turns of others since its last is served next (0: never,
        # strictly by class): one turn in every `1 / min_share` at least.
        self._every = max(1, math.ceil(1 / min_share) - 1) if min_share > 0 else 0
        self._taken = 0  # jobs taken so far
        self._last_turn: dict[int, int] = {}  # by priority, of the classes waiting: `_taken` at their last turn
        self._arrivals = itertools.count()
        # A job put back goes ahead of every arrival (their seqs count from 0), and behind those put back before it.
        self._returns = itertools.count(-(2**62))
        self._ready = asyncio.Event()
        self._eta = eta

    def __len__(self) -> int:
        return len(self._line)

    def __contains__(self, job: Job) -> bool:
        return job in self._places

    @property
    def head(self) -> Job | None:
        """The job served next, if any waits."""
        if not self._line:
            return None
        due = self._due()
        return due.job if due is not None else self._line[0].job

    def put(self, job: Job, retry_after: float | None = None) -> None:
        if len(self._line) >= self.maxsize:
            raise ApiError(
                Code.QUEUE_FULL,
                f"the queue is full ({self.maxsize} jobs waiting); try again shortly",
                retry_after=retry_after or 1,
            )
        turns = self._tenants.get(job.tenant)
        if turns is not None and turns.waiting >= self.per_owner:
            raise over_share(job.tenant, f"has {turns.waiting} jobs waiting", "--max-queued-per-owner", self._first_turn(job.tenant))
        clock = self._clocks.setdefault(job.priority, 0.0)
        if turns is None:
            turns = self._tenants[job.tenant] = _Turns(next=clock)
        start = max(clock, turns.next)
        self._last_turn.setdefault(job.priority, self._taken)
        turns.next = start + 1 / job.weight
        turns.waiting += 1
        place = _Place(start, next(self._arrivals), job)
        bisect.insort(self._line, place, key=_rank)
        self._places[job] = place
        self._ready.set()
        self._announce()

    def put_back(self, job: Job, reason: str) -> None:
        """Put a job that was running back at the head of its class (it was preempted, `reason`), ahead
        of the jobs that came before it was taken out. It was admitted once: no limit refuses it, and
        its tenant's turns are not counted again."""
        clock = self._clocks.setdefault(job.priority, 0.0)
        at = bisect.bisect_left(self._line, (-job.priority, -math.inf, -1), key=_rank)
        waiting = at < len(self._line) and self._line[at].job.priority == job.priority
        start = min(clock, self._line[at].start) if waiting else clock
        turns = self._tenants.setdefault(job.tenant, _Turns(next=clock))
        turns.waiting += 1
        self._last_turn.setdefault(job.priority, self._taken)
        job.position = None  # its place is told afresh, with the reason
        place = _Place(start, next(self._returns), job, reason)
        bisect.insort(self._line, place, key=_rank)
        self._places[job] = place
        self._ready.set()
        self._announce()

    def remove(self, job: Job) -> bool:
        """Take a job out that will not run (cancelled); False if it was not waiting."""
        place = self._places.pop(job, None)
        if place is None:
            return False
        del self._line[self._index(place)]
        turns = self._tenants[job.tenant]
        if turns.next == place.start + 1 / job.weight:
            # Its tenant's last job: the turn is given back. One from the middle leaves its turn
            # unused, so that the tenant's later jobs keep their places.
            turns.next = place.start
        self._left(job.tenant)
        self._forget_idle_classes()
        self._announce()
        return True

    async def get(self) -> Job:
        while not self._line:
            self._ready.clear()
            await self._ready.wait()
        place = self._due() or self._line[0]
        del self._line[self._index(place)]
        self._served([place])
        self._announce()
        return place.job

    def take(self, wanted: Callable[[Job], bool], n: int, *, in_turn: bool = False) -> list[Job]:
        """Up to `n` waiting jobs that are `wanted`, in the order they would be served, out of the queue.

        `in_turn`: none past the first job that is not wanted, which keeps its turn.
        """
        taken: list[_Place] = []
        for place in self._order():
            if len(taken) >= n:
                break
            if wanted(place.job):
                taken.append(place)
            elif in_turn:
                break
        if not taken:
            return []
        if len(taken) == len(self._line):
            self._line = []
        else:
            gone = {id(place) for place in taken}
            self._line = [place for place in self._line if id(place) not in gone]
        self._served(taken)
        self._announce()
        return [place.job for place in taken]

    def next_arrival(self) -> Coroutine[Any, Any, Any]:
        """An awaitable that returns when a job is put after this call (it counts from now, not
        from when it is first awaited: a put in between is not missed)."""
        self._ready.clear()
        return self._ready.wait()

    async def arrival(self, timeout: float) -> None:
        """Return when a job is put, or after `timeout` seconds."""
        self._ready.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):  # no task per wait, as wait_for makes
                await self._ready.wait()

    def _index(self, place: _Place) -> int:
        return bisect.bisect_left(self._line, place.rank, key=_rank)

    def _order(self) -> list[_Place]:
        """The line in the order it is served: a lower class's job due a turn first (`_due`)."""
        due = self._due()
        if due is None:
            return self._line
        return [due, *(place for place in self._line if place is not due)]

    def _due(self) -> _Place | None:
        """The first job of the lower class owed a turn (the one owed longest), if any is."""
        if not self._every or len(self._last_turn) < 2:
            return None
        top = -self._line[0].rank[0]
        owed = [(last, priority) for priority, last in self._last_turn.items() if priority != top and self._taken - last >= self._every]
        if not owed:
            return None
        priority = min(owed)[1]
        return self._line[bisect.bisect_left(self._line, (-priority, -math.inf, -1), key=_rank)]

    def _served(self, places: list[_Place]) -> None:
        for place in places:
            del self._places[place.job]
            priority = place.job.priority
            self._clocks[priority] = max(self._clocks[priority], place.start)
            self._taken += 1
            self._last_turn[priority] = self._taken
            self._left(place.job.tenant)
        self._forget_idle_classes()

    def _forget_idle_classes(self) -> None:
        """A class with nothing waiting starts afresh when a job of it comes: its clock, and its count of turns."""
        for priority in [p for p in self._clocks if not self._waiting(p)]:
            del self._clocks[priority]
            self._last_turn.pop(priority, None)

    def _waiting(self, priority: int) -> bool:
        at = bisect.bisect_left(self._line, (-priority, -math.inf, -1), key=_rank)
        return at < len(self._line) and self._line[at].job.priority == priority

    def _left(self, tenant: str) -> None:
        turns = self._tenants[tenant]
        turns.waiting -= 1
        if not turns.waiting:
            del self._tenants[tenant]  # nothing waiting: its next job joins at the clock

    def _first_turn(self, tenant: str) -> float:
        """Seconds until `tenant`'s first waiting job starts, as a Retry-After (at least 1)."""
        position = next((i + 1 for i, place in enumerate(self._line) if place.job.tenant == tenant), 1)
        return self._eta(position) or 1

    def _announce(self) -> None:
        size = len(self._line)
        for index, place in enumerate(self._order()):
            job = place.job
            if job.position != index + 1:
                fields: dict[str, Any] = {"position": index + 1, "queue_size": size}
                if place.reason is not None:
                    fields["message"] = place.reason
                eta = self._eta(index + 1)
                if eta is not None:
                    fields["eta_s"] = round(eta, 2)
                job.set_status(Status.QUEUED, **fields)
