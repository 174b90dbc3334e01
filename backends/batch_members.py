"""One batch's members, on a worker's event loop (backends/workers.py): which queued jobs may join
it, those in it, the ones asked to leave for a higher class's job (preemption), and their ends."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from backends.device_work import BatchSteps, StepOutcome
from backends.stopping import big
from gateway.jobs import Job
from gateway.protocol import Code
from gateway.tools.base import Context, Tool
from gateway.tools.batching import Resumed

if TYPE_CHECKING:
    from backends.workers import Worker

log = logging.getLogger("streamgate.worker")


def job_memory(job: Job) -> int:
    """Its priced memory (0 unpriced): what a batch's members cost together is the sum."""
    return job.cost.memory if job.cost is not None else 0


class BatchMembers:
    """One batch's members, on the event loop: which jobs may join it (its tool, its batch key, and
    what its members cost together, the running ones included, within --max-job-memory), those in it
    with when each started, and their ends; `run`, what it shares with the device's thread."""

    def __init__(self, worker: Worker, tool: Tool, first: Job) -> None:
        self.worker, self.tool = worker, tool
        self.key = tool.batch_key(first.params) if tool.batch_key is not None else None
        self.held = job_memory(first)
        self.members: dict[Context, tuple[Job, float]] = {}
        self.leaving: set[Context] = set()  # members asked to leave after the step under way (`victims`)
        self.run = BatchSteps()
        self.loop = asyncio.get_running_loop()

    def compatible(self, job: Job) -> bool:
        return job.tool == self.tool.name and (self.tool.batch_key is None or self.tool.batch_key(job.params) == self.key)

    def joins(self, job: Job) -> bool:
        # A batch is one padded pass (or one step of each member): its members' prices add up,
        # and it takes no member that would carry it past --max-job-memory (that one waits its turn).
        limit = self.worker.batch_memory
        if not self.compatible(job) or (limit and self.held + job_memory(job) > limit):
            return False
        self.held += job_memory(job)
        return True

    def admit(self, jobs: list[Job]) -> list[tuple[Any, Context]]:
        """The jobs that start (those a cancel or a timeout ended meanwhile do not), as the batch takes them."""
        worker, added = self.worker, []
        for job in jobs:
            if worker._admit(job):
                ctx = worker.context(job)
                self.members[ctx] = (job, self.loop.time())
                kept, job.kept = job.kept, None
                added.append((job.params if kept is None else Resumed(kept), ctx))
            else:
                self.held -= job_memory(job)
        worker._last_batch[self.tool.name] = max(worker._last_batch.get(self.tool.name, 0), len(self.members))
        self.run.big = big([job for job, _ in self.members.values()])
        return added

    def kept_share(self, most: int) -> int:
        """The places of the batch the lower classes keep while they have jobs (--class-min-share of
        `most`, rounded up), as the queue keeps them their share of its turns."""
        return math.ceil(self.worker.queue.min_share * most)

    def owed(self, head: Job | None, most: int) -> Callable[[Job], bool] | None:
        """With a higher class's job first in line, and the lower classes holding fewer than their
        share of the places: which waiting jobs may take one (theirs, that the batch can take)."""
        if head is None or not self.compatible(head):
            return None
        top = max([head.priority, *(job.priority for job, _ in self.members.values())])
        lower = sum(1 for ctx, (job, _) in self.members.items() if job.priority < top and ctx not in self.leaving)
        if lower >= self.kept_share(most):
            return None
        return lambda job: job.priority < top and self.joins(job)

    def victims(self, job: Job, most: int) -> list[Context]:
        """The members to preempt so that `job`, of a higher class than theirs and one the batch could
        take but for its room (`most` members, and what they cost within --max-job-memory), joins it:
        the lowest class's first, the latest started first (the least work to take up again), only
        as many as make room, only members decoding now, and never the lower classes' minimum share
        of the places. None if that cannot make room."""
        if not self.compatible(job):
            return []
        staying = {ctx: member for ctx, member in self.members.items() if ctx not in self.leaving}
        over = len(staying) + 1 - most
        limit = self.worker.batch_memory
        held = sum(job_memory(member) for member, _ in staying.values())
        heavy = held + job_memory(job) - limit if limit else 0
        if over <= 0 and heavy <= 0:
            return []
        live = set(self.run.live)
        lower = sorted(
            ((member.priority, -started, ctx, member) for ctx, (member, started) in staying.items() if ctx in live and member.priority < job.priority),
            key=lambda row: row[:2],
        )
        # The lower classes keep their minimum share of the batch's places, as of the queue's turns
        # (--class-min-share): the members they started first are not preempted.
        kept = self.kept_share(most)
        chosen: list[Context] = []
        for _, _, ctx, member in lower[: max(0, len(lower) - kept)]:
            if over <= 0 and heavy <= 0:
                break
            chosen.append(ctx)
            over -= 1
            heavy -= job_memory(member)
        return chosen if over <= 0 and heavy <= 0 else []

    def preempted(self, out: list[tuple[Context, Any]]) -> None:
        """Members the batch took out (`victims`): back in the queue, at the head of their class, each
        with what the batch kept of it, to go on where it stopped."""
        for ctx, kept in out:
            self.leaving.discard(ctx)
            if (member := self.members.pop(ctx, None)) is None:
                continue
            job = member[0]
            self.held -= job_memory(job)
            self.worker._preempted(job, kept)
        if out:
            self.run.big = big([job for job, _ in self.members.values()])
            self.run.changed.set()

    def finish(self, ended: list[tuple[Context, StepOutcome]], size: int | None) -> None:
        """End the members `ended` with their outcomes; `size`: the step's batch size (None: no step ran)."""
        if size is not None:
            self.worker.batch_sizes[size] += 1
        for ctx, outcome in ended:
            self.leaving.discard(ctx)
            if (member := self.members.pop(ctx, None)) is None:  # ended already, by a failure of the batch
                continue
            job, started = member
            self.held -= job_memory(job)
            try:
                self.worker._finish(job, self.tool, outcome, self.loop.time() - started)
            except Exception:  # one member's bookkeeping must not leave the others unended
                log.exception("ending job %s failed", job.id, extra={"job_id": job.id})
                job.fail(Code.INTERNAL, "the job could not be ended normally")
        if ended:
            self.run.big = big([job for job, _ in self.members.values()])
            self.run.changed.set()
