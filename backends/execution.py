"""The one execution path: a bounded job queue and a worker per device.

The local backend runs jobs through this module, and so does the executor
service: there is no second copy of the queue, the worker or the tool call.

A worker owns one device and one long-lived thread (backends/handoff.py). Its
coroutine takes the next job from the shared queue and hands the tool's work to
that thread, so model work never touches the event loop; the thread sends the
tool's frames and each step's outcome back in bursts. Workers on several devices share one queue: an idle
worker takes the next job, so the least-loaded device gets it.

Jobs of a tool that batches (see gateway/tools/batching.py) run together: the
worker takes every compatible job waiting (same tool, same batch key), up to
`max_batch_size`; a lone job waits up to `batch_wait` seconds for company,
unless it came to an idle worker and the tool's last batch was a lone job too:
one client sending jobs one after another then pays no wait, while clients
whose jobs arrive together, or queue behind other work, are still gathered.
Between the steps of a continuous batch it takes in jobs that arrived since.
Each member still gets its own frames, result, error and cancellation.

A tool whose work falls into independent chunks (`Tool.spread`: `embed`,
`pseudo_loglikelihood`) runs one job on every device at once when there are
several: each device's thread takes the next chunk as it frees up, between
the steps of whatever it runs itself, and the results come back in the
caller's order, the same as on one device.

Results are encoded on the worker thread too, as JSON for a gateway's clients
or msgpack for an executor's: a large result costs the loop nothing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import torch

from backends import memory
from backends.handoff import DeviceThread, Handoff
from backends.memory import free_device_memory
from gateway.encoding import to_json
from gateway.errors import ApiError
from gateway.jobs import Job, JobContext
from gateway.protocol import Code, Status
from gateway.tools.base import Cancelled, Context, Model, Tool
from gateway.tools.batching import Batch, Chunk, Chunked, Progress

log = logging.getLogger("streamgate.worker")


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


class JobQueue:
    """Jobs waiting for a worker, in order; full at `maxsize`.

    Every waiting job is told its 1-based position whenever it changes.
    """

    def __init__(self, maxsize: int, eta: Callable[[int], float | None] = lambda n: None) -> None:
        self.maxsize = maxsize
        self._jobs: collections.deque[Job] = collections.deque()
        self._ready = asyncio.Event()
        self._eta = eta

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job: Job) -> bool:
        return job in self._jobs

    def put(self, job: Job, retry_after: float | None = None) -> None:
        if len(self._jobs) >= self.maxsize:
            raise ApiError(
                Code.QUEUE_FULL,
                f"the queue is full ({self.maxsize} jobs waiting); try again shortly",
                retry_after=retry_after or 1,
            )
        self._jobs.append(job)
        self._ready.set()
        self._announce()

    def remove(self, job: Job) -> bool:
        try:
            self._jobs.remove(job)
        except ValueError:
            return False
        self._announce()
        return True

    async def get(self) -> Job:
        while not self._jobs:
            self._ready.clear()
            await self._ready.wait()
        job = self._jobs.popleft()
        self._announce()
        return job

    def take(self, wanted: Callable[[Job], bool], n: int) -> list[Job]:
        """Up to `n` waiting jobs that are `wanted`, oldest first, out of the queue."""
        taken = [job for job in self._jobs if wanted(job)][: max(n, 0)]
        if taken:
            for job in taken:
                self._jobs.remove(job)
            self._announce()
        return taken

    async def arrival(self, timeout: float) -> None:
        """Return when a job is put, or after `timeout` seconds."""
        self._ready.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):  # no task per wait, as wait_for makes
                await self._ready.wait()

    def _announce(self) -> None:
        size = len(self._jobs)
        for index, job in enumerate(self._jobs):
            if job.position != index + 1:
                fields: dict[str, Any] = {"position": index + 1, "queue_size": size}
                eta = self._eta(index + 1)
                if eta is not None:
                    fields["eta_s"] = round(eta, 2)
                job.set_status(Status.QUEUED, **fields)


def execute(
    tool: Tool, model: Model, params: Any, ctx: JobContext, encode: Callable[[Any], bytes]
) -> msgspec.Raw:
    """Run one tool call on the current thread and encode its result."""
    ctx.raise_if_cancelled()
    ctx.begin()
    # Inference mode is per thread, so it is set here, on the worker's thread.
    with torch.inference_mode():
        result = tool.run(model, params, ctx)
    return msgspec.Raw(encode(result))


Outcome = msgspec.Raw | BaseException


def step(batch: Batch, joining: list[tuple[Any, JobContext]], encode: Callable[[Any], bytes]) -> list[tuple[Context, Outcome]]:
    """Add `joining` to `batch`, run one step, and encode the results of the members that ended."""
    ended: list[tuple[Context, Outcome]] = []
    with torch.inference_mode():
        for params, ctx in joining:
            ctx.begin()
            try:
                batch.add(params, ctx)
            except Exception as exc:  # this job's input alone is at fault
                ended.append((ctx, exc))
        if len(batch):
            ended.extend(batch.step())
    return [(ctx, outcome if isinstance(outcome, BaseException) else msgspec.Raw(encode(outcome))) for ctx, outcome in ended]


def _plan(work: Chunked, model: Model, params: list[Any], ctxs: list[JobContext]) -> tuple[list[Chunk], Progress]:
    for ctx in ctxs:
        ctx.begin()
    with torch.inference_mode():
        chunks = work.plan(model, params)
    return chunks, Progress(chunks, ctxs, work.unit)


def _run_chunk(work: Chunked, model: Model, params: list[Any], chunk: Chunk) -> list[Any]:
    with torch.inference_mode():
        return work.run(model, params, chunk)


def _assemble(
    work: Chunked, model: Model, params: list[Any], outputs: dict[tuple[int, int], Any], ctxs: list[Context], encode: Callable[[Any], bytes]
) -> list[tuple[Context, Outcome]]:
    with torch.inference_mode():
        results = work.assemble(model, params, outputs)
    return [(ctx, Cancelled() if ctx.cancelled else msgspec.Raw(encode(result))) for ctx, result in zip(ctxs, results)]


def device_failure(exc: BaseException) -> str | None:
    """`"oom"` for a device out of memory (the job fails, memory is freed, work goes on),
    `"fatal"` for a device that can no longer be trusted (an illegal access, a device-side
    assert: the process must restart), None for anything else."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "oom"
    if isinstance(exc, torch.AcceleratorError):
        return "fatal"
    if isinstance(exc, RuntimeError) and any(s in str(exc) for s in ("CUDA error", "device-side assert")):
        return "fatal"
    return None


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
        batch_wait: float = 0.005,
        job_timeout: float = 0.0,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.model = model
        self.job_timeout = job_timeout
        self.on_fatal = on_fatal
        self.encode = encode
        self.queue = queue
        self.tools = tools
        self.debug = debug
        self.max_batch_size = max_batch_size
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
        """The job's `Context`, whose frames travel with this worker's outcomes."""
        assert self._thread is not None, "the worker has not started"
        return JobContext(job, self._thread.handoff.post)

    async def stop(self) -> None:
        for job in self.running:
            job.cancel()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._thread is not None:
            self._thread.stop()

    async def _loop(self) -> None:
        while True:
            idle = not self.queue  # nothing waited: the job comes to an idle worker
            job = await self.queue.get()
            tool = self.tools[job.tool]
            try:
                if tool.batch is None:
                    await self._run_alone(job, tool)
                else:
                    await self._run_batch(job, tool, idle)
            except asyncio.CancelledError:
                for member in self.running:
                    member.cancel()
                    member.fail(Code.SHUTTING_DOWN, "the worker stopped before the job finished")
                raise
            finally:
                self.running.clear()
                # Nothing of the last job is held while the next is awaited: its result stays in
                # memory for as long as the store keeps the job, not until another job comes.
                job = tool = None  # type: ignore[assignment]
                if not self.queue and self._thread is not None:
                    # Idle: what big work freed goes back (backends/memory.py), on the device's thread.
                    self._thread.soon(memory.give_back, self.model.device)

    async def _run_alone(self, job: Job, tool: Tool) -> None:
        if not self._admit(job):
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        ctx = self.context(job)

        def run() -> None:
            try:
                outcome: Outcome = execute(tool, self.model, job.params, ctx, self.encode)
            except Exception as exc:
                outcome = exc
            # The job ends in the burst that carries its frames (see `_ending`).
            self._thread_post(lambda: self._finish(job, tool, outcome, loop.time() - started))

        await self.call(run)

    async def _run_batch(self, first: Job, tool: Tool, idle: bool = False) -> None:
        loop = asyncio.get_running_loop()
        key = tool.batch_key(first.params) if tool.batch_key is not None else None

        def compatible(job: Job) -> bool:
            return job.tool == tool.name and (tool.batch_key is None or tool.batch_key(job.params) == key)

        joining = [first, *self.queue.take(compatible, self.max_batch_size - 1)]
        # A job that came to an idle worker, as the last of its tool did alone, is one client's next
        # job: waiting would only delay it. One that queued behind other work waits, so that clients
        # whose jobs ended together fall into step and batch.
        alone = idle and len(joining) == 1 and self._last_batch.get(tool.name) == 1
        wait = 0.0 if alone else self.batch_wait
        deadline = loop.time() + wait
        while len(joining) < self.max_batch_size and (left := deadline - loop.time()) > 0:
            await self.queue.arrival(left)
            joining += self.queue.take(compatible, self.max_batch_size - len(joining))
        batch: Batch = tool.batch(self.model)
        members: dict[Context, tuple[Job, float]] = {}
        self._last_batch[tool.name] = 0
        while True:
            added = []
            for job in joining:
                if self._admit(job):
                    ctx = self.context(job)
                    members[ctx] = (job, loop.time())
                    added.append((job.params, ctx))
            self.batch_sizes[len(members)] += 1
            self._last_batch[tool.name] = max(self._last_batch[tool.name], len(members))
            if tool.spread is not None and len(self.peers) > 1 and len(members) == len(added):
                try:
                    ended = await self._spread(tool, batch, added)
                except Exception as exc:  # even the one-device rerun failed: every member ends with it
                    ended = [(ctx, exc) for ctx in members]
                for ctx, outcome in ended:
                    job, started = members.pop(ctx)
                    self._finish(job, tool, outcome, loop.time() - started)
                return
            def finish(ended: list[tuple[Context, Outcome]]) -> None:
                for ctx, outcome in ended:
                    job, started = members.pop(ctx)
                    self._finish(job, tool, outcome, loop.time() - started)

            try:
                await self.call(self._ending(step, finish), batch, added, self.encode)
            except Exception as exc:  # the batch as a whole failed: every member ends with it
                finish([(ctx, exc) for ctx in members])
            if not members:
                return
            joining = self.queue.take(compatible, self.max_batch_size - len(members)) if batch.continuous else []

    async def _spread(self, tool: Tool, batch: Batch, added: list[tuple[Any, Context]]) -> list[tuple[Context, Outcome]]:
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
            chunks, progress = await self.call(_plan, work, self.model, params, ctxs)
            left = collections.deque(chunks)
            outputs: dict[tuple[int, int], Any] = {}

            async def device(worker: Worker) -> None:
                while left and not all(ctx.cancelled for ctx in ctxs) and (worker is self or not worker.busy):
                    chunk = left.popleft()
                    try:
                        out = await worker.call(_run_chunk, work, worker.model, params, chunk)
                    except BaseException as exc:
                        left.clear()  # the others stop after their chunk in flight
                        if (failure := device_failure(exc)) == "oom":
                            free_device_memory()
                        elif failure == "fatal" and worker.on_fatal is not None:
                            worker.on_fatal(exc)
                        raise
                    outputs.update(zip(chunk.items, out))
                    progress.advance(chunk)

            others = [worker for worker in self.peers if worker is not self]
            failed = [r for r in await asyncio.gather(*(device(w) for w in [self, *others]), return_exceptions=True) if r]
            if failed:
                raise failed[0]
            if all(ctx.cancelled for ctx in ctxs):
                return [(ctx, Cancelled()) for ctx in ctxs]
            return await self.call(_assemble, work, self.model, params, outputs, ctxs, self.encode)
        except Exception:
            log.warning("a spread %s batch failed; running it on one device", tool.name, exc_info=True)
            return await self.call(step, batch, added, self.encode)

    def _thread_post(self, fn: Callable[[], None]) -> None:
        assert self._thread is not None
        self._thread.handoff.post(fn)

    def _ending(self, work: Callable[..., list[tuple[Context, Outcome]]], finish: Callable[[list[tuple[Context, Outcome]]], None]) -> Callable[..., None]:
        """`work`, then `finish` its ended members, posted from the device's thread.

        The members end in the same hand-off as the frames their work sent, before
        the coroutine awaiting the step resumes: a client's stream then gets a short
        job's RUNNING, partials and terminal event in one write, where ending them
        from the coroutine came a loop turn later, in a write of its own.
        """

        def run(*args: Any) -> None:
            ended = work(*args)
            self._thread_post(lambda: finish(ended))

        return run

    def _admit(self, job: Job) -> bool:
        """Mark the job running, unless it was cancelled while it waited."""
        if job.cancel_requested.is_set():
            job.fail(Code.CANCELLED, "the job was cancelled")
            return False
        self.running.add(job)
        # RUNNING itself is sent from the device's thread as the work starts (`JobContext.begin`):
        # with the frames and the result of a short job, in one burst and one write to its client.
        if self.job_timeout:
            timer = asyncio.get_running_loop().call_later(self.job_timeout, self._expire, job)
            job.on_end.append(lambda _: timer.cancel())
        return True

    def _expire(self, job: Job) -> None:
        """End a job past its deadline now; its work stops at its next step (a batch's member leaves it)."""
        job.fail(Code.TIMEOUT, f"the job ran past its limit of {self.job_timeout:g} s and was stopped")
        job.cancel()

    def _finish(self, job: Job, tool: Tool, outcome: Outcome, elapsed: float) -> None:
        self.running.discard(job)
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
