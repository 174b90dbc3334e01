"""The one execution path: a worker per device, taking jobs from a served model's queue.

The local backend runs jobs through this module, and so does the executor
service: there is no second copy of the worker or the tool call. The queue,
and the fair order between tenants it serves jobs in, is backends/queue.py.

A worker owns one device and one long-lived thread (gateway/plumbing/handoff.py). Its
coroutine takes the next job from the shared queue and hands the tool's work to
that thread, so model work never touches the event loop; the thread sends the
tool's frames and each step's outcome back in bursts. Workers on several devices share one queue: an idle
worker takes the next job, so the least-loaded device gets it.

Jobs of a tool that batches (see gateway/tools/batching.py) run together: the
worker takes every compatible job waiting (same tool, same batch key), in the
queue's order, up to `max_batch_size` (a continuous batch, `generate`'s, up to
`max_decoding_jobs`), and as long as their priced memory fits together; a lone job waits up to `batch_wait` seconds for company,
unless it came to an idle worker and the tool's last batch was a lone job too:
one client sending jobs one after another then pays no wait, while clients
whose jobs arrive together, or queue behind other work, are still gathered.
Between the steps of a continuous batch it takes in jobs that arrived since,
in the queue's order, up to the first it cannot take. Each member still gets
its own frames, result, error and cancellation.

A batch never holds the worker against the queue's order: between two of its
steps, if the job at the head of the queue is one the batch cannot take (another
tool, another batch key), the worker runs it first, alone or as a batch of its
own with the compatible jobs waiting, which runs to its end, takes no one in
and lets nothing through. A job behind one tenant's long generation then waits
about one step of it, not all of it. (A one-pass batch is a single step: it
runs to its end.) A step or a lone job long enough to have stop points inside
its passes (backends/stopping.py: over 512 tokens) does better: a short job at
the head of the queue runs inside it, at its next stop point, on the same
thread (gateway/plumbing/handoff.py `call_between`), if the two fit
`--max-job-memory` together; it then waits one block of the pass, not the pass
(an 8k-token embed or prefill is one pass of many seconds).

A continuous batch that is full (its member count, or their priced memory) and
`Preemptible` (`generate`'s) makes room for a job of a higher class at the head
of the queue: after the step under way, the lowest class's members leave it
(backends/batch_members.py `victims`), queued again at the head of their class
with what the batch kept of them, and go on where they stopped when their turn
comes (gateway/tools/generate.py: the same completions).

A tool whose work falls into independent chunks (`Tool.spread`: `embed`,
`pseudo_loglikelihood`, `logprobs`, `loglikelihood`, `fill_mask`) runs one job
on every device at once when there are several: the job's own device and every
idle one take the next chunk as they free up, and the results come back in the
caller's order, the same as on one device. Each chunk done is kept in its jobs'
checkpoints as on one device (`ChunkRun`), so a job cut by a crash goes on from
them here too.

Results are encoded on the worker thread too, as JSON for a gateway's clients
or msgpack for an executor's: a large result costs the loop nothing.

A traced job (gateway/plumbing/tracing.py) gets, under its own span: the time it
queued, its run on the device, a span for each step it took part in (the batch's
size then, and its own step count), and its result's encoding. They are made on
the device's thread, and only for the jobs whose trace is recorded: an untraced
batch's step costs one truth test.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import torch

from gateway.plumbing import memory, tracing
from gateway.plumbing.handoff import DeviceThread, Handoff
from gateway.plumbing.memory import free_device_memory
from backends.device_work import (
    StepOutcome, BatchSteps, assemble_chunks, device_failure, execute, plan_chunks, run_chunk, step,
)
from backends.batch_members import BatchMembers, job_memory
from backends.queue import JobQueue
from backends.stopping import big
from gateway.encoding import to_json
from gateway.jobs import Job, JobContext, time_limit
from gateway.protocol import Code
from gateway.tools.base import Cancelled, Context, Model, Tool
from gateway.tools.batching import Batch, Preemptible

log = logging.getLogger("streamgate.worker")

PREEMPTED = "preempted for a job of a higher class; it goes on where it stopped"


def set_torch_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (`--torch-threads`) and one inter-op thread; the intra-op count.

    None: OMP_NUM_THREADS when set (Ray sets it to a replica's CPUs), else one less
    than the cores this process may use, at least 1. torch's own default, a thread
    per core, is fastest on a quiet machine, but its threads spin waiting for each
    other, and on a machine that is busy (the event loop, a second model, other
    processes) throughput collapses (measured in bench/RESULTS.md): a core is left
    for the rest.
    """
    if threads is None:
        given = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(given) if given.isdigit() and int(given) > 0 else max(1, len(os.sched_getaffinity(0)) - 1)
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only before the first parallel work; a second call keeps the first
        torch.set_num_interop_threads(1)
    return threads


class Worker:
    """Runs queued jobs on one device, on a thread of its own: alone, or batched."""

    def __init__(
        self,
        model: Model,
        queue: JobQueue,
        tools: Mapping[str, Tool],
        *,
        encode: Callable[[Any], bytes] = to_json,
        debug: bool = False,
        max_batch_size: int = 32,
        max_decoding_jobs: int = 256,
        batch_wait: float = 0.005,
        job_timeout: float = 0.0,
        batch_memory: int = 0,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.model = model
        self.batch_memory = batch_memory  # what a batch's members may cost together (0: no bound)
        self.job_timeout = job_timeout
        self.on_fatal = on_fatal
        self.encode = encode
        self.queue = queue
        self.tools = tools
        self.debug = debug
        self.max_batch_size = max_batch_size
        # A continuous batch's members hold a KV cache each and add a row to every step, not a pass
        # each: their priced memory bounds them (`batch_memory`), and this count; 1 turns batching off.
        self.max_decoding_jobs = max_decoding_jobs if max_batch_size > 1 else 1
        self.batch_wait = batch_wait
        self.running: set[Job] = set()
        self.mean_run_s: float | None = None
        # The sizes of the batches run, for benchmarks and metrics.
        self.batch_sizes: collections.Counter[int] = collections.Counter()
        # The most members each tool's last batch had: after a lone job (1), the next lone one does not wait.
        self._last_batch: dict[str, int] = {}
        self._thread: DeviceThread | None = None
        self._task: asyncio.Task[None] | None = None
        # Every worker of the backend, this one included: the devices a spread job's chunks run on.
        self.peers: list[Worker] = [self]
        # The batches stepping on the device's thread now (one, and one let through while it waits).
        self._runs: set[BatchSteps] = set()
        # The running jobs with a time limit: each one's timer, and when it was set.
        self._timers: dict[Job, tuple[asyncio.TimerHandle, float]] = {}

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def start(self) -> None:
        self._thread = DeviceThread(f"streamgate-worker-{self.model.device}", Handoff(asyncio.get_running_loop()))
        self._task = asyncio.create_task(self._loop(), name=f"worker {self.model.device}")

    def call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Run `fn(*args)` on this worker's thread; the outcome comes back with the frames sent before it."""
        assert self._thread is not None, "the worker has not started"
        return self._thread.call(fn, *args)

    def context(self, job: Job) -> JobContext:
        """The job's `Context`, whose frames travel with this worker's outcomes (and, traced, the span of its run here)."""
        assert self._thread is not None, "the worker has not started"
        ctx = JobContext(job, self._thread.handoff.post)
        if job.span.is_recording():
            tracing.on_device(job, ctx, str(self.model.device))
        return ctx

    async def stop(self) -> None:
        for job in self.running:
            job.cancel()
        for run in self._runs:
            run.stopped = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._thread is not None:
            self._thread.stop()

    async def _loop(self) -> None:
        while True:
            idle = not self.queue  # nothing waited: the job comes to an idle worker
            job = await self.queue.get()
            try:
                await self._run(job, idle)
            except asyncio.CancelledError:
                for member in self.running:
                    member.cancel()
                    member.fail(Code.SHUTTING_DOWN, "the worker stopped before the job finished")
                raise
            finally:
                self.running.clear()
                # Nothing of the last job is held while the next is awaited: its result stays in
                # memory for as long as the store keeps the job, not until another job comes.
                job = None  # type: ignore[assignment]
                if not self.queue and self._thread is not None:
                    # Idle: what big work freed goes back (gateway/plumbing/memory.py), on the device's thread.
                    self._thread.soon(memory.give_back, self.model.device)

    async def _run(self, job: Job, idle: bool, lets_through: bool = True, between: bool = False) -> None:
        """Run `job`: alone, or as the first of a batch (which, unless `lets_through` is false, lets
        the head of the queue through between its steps and takes in jobs as it goes); `between`:
        inside the long pass under way, at its next stop point (`_let_in`)."""
        tool = self.tools[job.tool]
        if tool.batch is None:
            await self._run_alone(job, tool, between)
        else:
            await self._run_batch(job, tool, idle, lets_through, between)

    def _call(self, between: bool) -> Callable[..., asyncio.Future[Any]]:
        assert self._thread is not None, "the worker has not started"
        return self._thread.call_between if between else self._thread.call

    def _fits_in(self, job: Job, held: int) -> bool:
        """Whether `job` may run inside a long pass that holds `held` priced bytes: priced and short
        itself (no stop points of its own, so it ends within its own pass; a job with no price could
        run for as long as it likes there), and both within --max-job-memory."""
        return job.cost is not None and not big([job]) and (not self.batch_memory or held + job_memory(job) <= self.batch_memory)

    async def _let_in(self, work: asyncio.Future[Any], held: int) -> None:
        """While a long pass runs (`work`), each job at the head of the queue that `_fits_in` it runs
        inside it, at its next stop point (backends/stopping.py): a short job of another tenant waits
        one piece of the pass (a block, or one of its parts), not the whole pass. One at a time, each
        to its end; the pass goes on after it."""
        while not work.done():
            head = self.queue.head
            if head is not None and self._fits_in(head, held):
                self.queue.take(lambda job: job is head, 1)
                await self._run(head, idle=False, lets_through=False, between=True)
                continue
            arrival = asyncio.ensure_future(self.queue.next_arrival())
            try:
                await asyncio.wait([work, arrival], return_when=asyncio.FIRST_COMPLETED)
            finally:
                arrival.cancel()

    async def _let_through(self, compatible: Callable[[Job], bool]) -> None:
        """Between two steps of a batch: if the job served next is one the batch cannot take, run it now.

        It runs alone or with the compatible jobs waiting, to its end, letting nothing through itself
        and taking no one in: the batch it paused waits one such run, not a chain of them.
        """
        head = self.queue.head
        if head is None or compatible(head):
            return
        self.queue.take(lambda job: job is head, 1)
        await self._run(head, idle=False, lets_through=False)

    async def _run_alone(self, job: Job, tool: Tool, between: bool = False) -> None:
        if not self._admit(job):
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        ctx = self.context(job)
        long = big([job])

        def run() -> None:
            began = time.perf_counter()
            try:
                outcome: StepOutcome = execute(tool, self.model, job.params, ctx, self.encode, stop=long)
            except Exception as exc:
                outcome = exc
            ctx.usage.device_s += time.perf_counter() - began
            # The job ends in the hand-off that carries its frames: a short job's RUNNING, partials and
            # terminal event reach its client in one write.
            self._thread_post(lambda: self._finish(job, tool, outcome, loop.time() - started))

        work = self._call(between)(run)
        if long and not between:
            await self._let_in(work, job_memory(job))
        await work

    async def _run_batch(self, first: Job, tool: Tool, idle: bool = False, lets_through: bool = True, between: bool = False) -> None:
        group = BatchMembers(self, tool, first)
        batch: Batch = tool.batch(self.model)
        most = self.max_decoding_jobs if batch.continuous else self.max_batch_size
        joining = [first, *self.queue.take(group.joins, most - 1)]
        # A job that came to an idle worker, as the last of its tool did alone, is one client's next
        # job: waiting would only delay it. One that queued behind other work waits, so that clients
        # whose jobs ended together fall into step and batch.
        alone = idle and len(joining) == 1 and self._last_batch.get(tool.name) == 1
        # A batch let through pauses another: it takes what waits, and waits for nobody.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (0.0 if alone or not lets_through else self.batch_wait)
        while len(joining) < most and (left := deadline - loop.time()) > 0:
            await self.queue.arrival(left)
            joining += self.queue.take(group.joins, most - len(joining))
        self._last_batch[tool.name] = 0
        added = group.admit(joining)
        if not group.members:
            return
        whole = (keep := getattr(tool.spread, "whole", None)) is not None and any(keep(p) for p, _ in added)
        if tool.spread is not None and len(self.peers) > 1 and not whole:  # (partial events go out in order from one device)
            self.batch_sizes[len(group.members)] += 1
            try:
                ended = await self._spread(tool, batch, added)
            except Exception as exc:  # even the one-device rerun failed: every member ends with it
                ended = [(ctx, exc) for ctx in group.members]
            group.finish(ended, None)
            return
        group.run.inbox.extend(added)
        self._runs.add(group.run)
        try:
            await self._drive(group, batch, most, lets_through, between)
        finally:
            self._runs.discard(group.run)

    async def _drive(self, group: BatchMembers, batch: Batch, most: int, lets_through: bool, between: bool) -> None:
        """Step `group`'s batch on the device until its members have ended: meanwhile, let a job through
        between (or inside) its steps, take joining ones between steps, and end members as they end."""
        run, members = group.run, group.members
        while members:
            steps = self._call(between)(self._steps, batch, run, group)
            try:
                # While the device steps: a job the batch cannot take at the head of the queue pauses
                # it after its step (let through below), or, short and the step long, runs inside
                # the step at its next stop point; compatible ones join it between two steps.
                while lets_through and not steps.done():
                    head = self.queue.head
                    # (A compatible one too, unless the batch is continuous: one that could join only
                    # after this step, the long part, and not at all a one-pass batch under way.)
                    if (head is not None and run.big and not run.pause and (not batch.continuous or not group.compatible(head))
                            and self._fits_in(head, group.held)):
                        self.queue.take(lambda job: job is head, 1)
                        await self._run(head, idle=False, lets_through=False, between=True)
                        continue
                    if head is not None and not group.compatible(head):
                        run.pause = True
                    elif batch.continuous and not run.pause:
                        if len(members) < most and (owed := group.owed(head, most)) is not None:
                            # The lower classes below their share of the places: theirs first, out of turn.
                            run.offer(group.admit(self.queue.take(owed, 1)))
                        if len(members) < most:
                            # In turn: a job the batch cannot take keeps those behind it out until it has run.
                            run.offer(group.admit(self.queue.take(group.joins, most - len(members), in_turn=True)))
                        if (head := self.queue.head) is not None and isinstance(batch, Preemptible):
                            # A higher class's job the batch has no room for: lower ones leave after this step.
                            leave = group.victims(head, most)
                            run.evict.extend(leave)
                            group.leaving.update(leave)
                    await self._stepping(steps, run)
                left = await steps
            except Exception as exc:  # the batch as a whole failed: every member ends with it
                run.stopped = True  # (if the loop's side failed, the thread stops after its step)
                with contextlib.suppress(Exception):
                    await asyncio.shield(steps)
                if isinstance(exc, Cancelled) and run.live and all(ctx.cancelled for ctx in run.live) and run.inbox:
                    # The step stopped because every member in it was cancelled: those end; the
                    # jobs offered to join it meanwhile were not, and go on in a batch of their own.
                    group.finish([(ctx, exc) for ctx in run.live], len(run.live))
                    run.live, run.stopped = [], False
                    batch = group.tool.batch(self.model)
                    continue
                group.finish([(ctx, exc) for ctx in members], len(members))
                return
            if not left and not run.inbox and members:  # not one of them is in the batch any more
                group.finish([(ctx, RuntimeError("the batch ended without this job")) for ctx in members], None)
            if run.pause and members:
                run.pause = False
                await self._let_through(group.compatible)

    async def _stepping(self, steps: asyncio.Future[Any], run: BatchSteps) -> None:
        """Return when the device's steps end, a member ends or a job is queued."""
        run.changed.clear()
        waiters = [asyncio.ensure_future(self.queue.next_arrival()), asyncio.ensure_future(run.changed.wait())]
        try:
            await asyncio.wait([steps, *waiters], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    def _steps(self, batch: Batch, run: BatchSteps, group: BatchMembers) -> int:
        """A batch's steps, back to back on the device's thread, until it is empty, paused or
        stopped; the members left in it.

        The event loop is not asked between two steps, so that a step never waits for the loop's
        turn: each step's frames and ended members go to it in one hand-off, and jobs join through
        `run`'s inbox (and leave, preempted, through its `evict`).
        """
        while True:
            if run.evict and (out := run.preempt(batch)):
                self._thread_post(lambda out=out: group.preempted(out))
            added = run.drain()
            run.live += [ctx for _, ctx in added]
            began = time.perf_counter()
            ended = step(batch, added, self.encode, *((self.model, run.live) if run.big else ()), traced=run.traced)
            size = len(run.live)
            if size:  # the step's device time, shared by the members it ran for
                share = (time.perf_counter() - began) / size
                for ctx in run.live:
                    ctx.usage.device_s += share
            if ended:
                gone = {ctx for ctx, _ in ended}
                run.live = [ctx for ctx in run.live if ctx not in gone]
            self._thread_post(lambda ended=ended, size=size: group.finish(ended, size))
            if run.pause or run.stopped or (not len(batch) and not run.inbox):
                return len(batch)

    async def _spread(self, tool: Tool, batch: Batch, added: list[tuple[Any, Context]]) -> list[tuple[Context, StepOutcome]]:
        """Run a batch's chunks on every device at once; its members' outcomes, encoded.

        Busy peers take no chunks (this worker always does), so a chunk never waits
        behind another job's long step. If any chunk fails, no device starts
        another, and the batch runs again the ordinary way on this device, where
        a failure reaches only the job at fault; a device failure on a peer is
        handled as on that peer's own jobs (memory freed; a fatal one restarts).
        """
        work = tool.spread
        params = [p for p, _ in added]
        ctxs = [c for _, c in added]
        try:
            run = await self.call(plan_chunks, work, self.model, params, ctxs)
            left = collections.deque(run.chunks)
            traced = {i: 0 for i, ctx in enumerate(ctxs) if ctx.span.is_recording()}  # a traced job's chunks so far

            async def device(worker: Worker) -> None:
                while left and not all(ctx.cancelled for ctx in ctxs) and (worker is self or not worker.busy):
                    chunk = left.popleft()
                    began = time.time_ns()
                    try:
                        await worker.call(run_chunk, work, worker.model, params, chunk, run)
                        share = (time.time_ns() - began) / 1e9 / len(chunk.items)  # by items, each a row of the pass
                        for i, _ in chunk.items:
                            ctxs[i].usage.device_s += share
                    except BaseException as exc:
                        left.clear()  # the others stop after their chunk in flight
                        if (failure := device_failure(exc)) == "oom":
                            free_device_memory()
                        elif failure == "fatal" and worker.on_fatal is not None:
                            worker.on_fatal(exc)
                        raise
                    # A chunk is a step of each job it holds items of.
                    for i in {i for i, _ in chunk.items} & traced.keys() if traced else ():
                        tracing.step(ctxs[i], began, len(chunk.items), traced[i], **{"streamgate.device": str(worker.model.device)})
                        traced[i] += 1

            others = [worker for worker in self.peers if worker is not self]
            failed = [r for r in await asyncio.gather(*(device(w) for w in [self, *others]), return_exceptions=True) if r]
            if failed:
                raise failed[0]
            if all(ctx.cancelled for ctx in ctxs):
                return [(ctx, Cancelled()) for ctx in ctxs]
            return await self.call(assemble_chunks, work, self.model, params, run.outputs, ctxs, self.encode)
        except Exception:
            log.warning("a spread %s batch failed; running it on one device", tool.name, exc_info=True)
            ended = await self.call(step, batch, added, self.encode)
            while len(batch):  # a batch of several steps (a chunk each) runs them all
                ended += await self.call(step, batch, [], self.encode)
            return ended

    def _thread_post(self, fn: Callable[[], None]) -> None:
        assert self._thread is not None
        self._thread.handoff.post(fn)

    def _admit(self, job: Job) -> bool:
        """Mark the job running, unless it was cancelled while it waited."""
        if job.cancel_requested.is_set():
            job.fail(Code.CANCELLED, "the job was cancelled")
            return False
        self.running.add(job)
        # RUNNING itself is sent from the device's thread as the work starts (`JobContext.begin`):
        # with the frames and the result of a short job, in one burst and one write to its client.
        if limit := time_limit(self.job_timeout, job):
            # Its time runs while it runs: a job preempted and queued again has what it had left.
            loop = asyncio.get_running_loop()
            self._timers[job] = (loop.call_later(max(0.0, limit - job.ran_s), self._expire, job, limit), loop.time())
            if self._stop_timer not in job.on_end:
                job.when_ended(self._stop_timer)
        return True

    def _stop_timer(self, job: Job) -> float:
        """Stop the job's timer; the seconds it ran since it was set."""
        timer, since = self._timers.pop(job, (None, 0.0))
        if timer is None:
            return 0.0
        timer.cancel()
        return asyncio.get_running_loop().time() - since

    def _preempted(self, job: Job, kept: Any) -> None:
        """`job` left its batch for a higher class's: queued again at the head of its class, to go on
        from what its batch `kept` (its client is told it waits, where, and why)."""
        self.running.discard(job)
        job.ran_s += self._stop_timer(job)
        if job.cancel_requested.is_set():  # cancelled (or past its time) as it was taken out: it ends here
            job.fail(Code.CANCELLED, "the job was cancelled")
            return
        job.kept = kept
        job.preemptions += 1
        self.queue.put_back(job, PREEMPTED)

    def _expire(self, job: Job, limit: float) -> None:
        """End a job past its deadline now; its work stops at its next step (a batch's member leaves it)."""
        job.fail(Code.TIMEOUT, f"the job ran past its limit of {limit:g} s and was stopped")
        job.cancel()

    def _finish(self, job: Job, tool: Tool, outcome: StepOutcome, elapsed: float) -> None:
        self.running.discard(job)
        usage = job.usage
        if not usage.tokens_in and job.cost is not None:  # a tool that counts no tokens read those it was priced for
            usage.tokens_in = job.cost.tokens
        if isinstance(outcome, msgspec.Raw):
            usage.result_bytes += len(outcome)
        # A tool that raised after its job was cancelled still reports its error;
        # a result that came after a cancel is not delivered.
        if isinstance(outcome, Cancelled) or (job.cancel_requested.is_set() and not isinstance(outcome, BaseException)):
            job.fail(Code.CANCELLED, "the job was cancelled")
        elif isinstance(outcome, BaseException) and (failure := device_failure(outcome)) is not None:
            log.error("device failure (%s) in job %s", failure, job.id, exc_info=outcome, extra={"job_id": job.id})
            if failure == "oom":
                free_device_memory()
                job.fail(Code.TOOL_ERROR, f"the device ran out of memory running this job (try fewer or shorter inputs): {outcome}")
            else:
                job.fail(Code.BACKEND_UNAVAILABLE, f"the device failed and the server is restarting: {outcome}")
                if self.on_fatal is not None:
                    self.on_fatal(outcome)
        elif isinstance(outcome, BaseException):
            log.error("tool %s failed in job %s", tool.name, job.id, exc_info=outcome, extra={"job_id": job.id})
            message = f"{type(outcome).__name__}: {outcome}"
            if self.debug:
                message += "\n" + "".join(traceback.format_exception(outcome))
            job.fail(Code.TOOL_ERROR, message)
        else:
            job.succeed(outcome)
        self.mean_run_s = elapsed if self.mean_run_s is None else 0.8 * self.mean_run_s + 0.2 * elapsed
