"""The one execution path: a bounded job queue and a worker per device.

The local backend runs jobs through this module, and so does the executor
service: there is no second copy of the queue, the worker or the tool call.

A worker owns one device and one thread. Its coroutine takes the next job from
the shared queue and hands the tool's run function to that thread, so model
work never touches the event loop and runs one job at a time per device.
Results are encoded on the worker thread too, as JSON for a gateway's clients
or msgpack for an executor's: a large result costs the loop nothing.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import torch

from gateway.encoding import to_json
from gateway.errors import ApiError
from gateway.jobs import Job, JobContext
from gateway.protocol import Code, Status
from gateway.tools.base import Cancelled, Model, Tool

log = logging.getLogger("streamgate.worker")


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
    # Inference mode is per thread, so it is set here, on the worker's thread.
    with torch.inference_mode():
        result = tool.run(model, params, ctx)
    return msgspec.Raw(encode(result))


class Worker:
    """Runs queued jobs one at a time on one device, on a thread of its own."""

    def __init__(
        self,
        model: Model,
        queue: JobQueue,
        tools: Mapping[str, Tool],
        *,
        encode: Callable[[Any], bytes] = to_json,
        debug: bool = False,
    ) -> None:
        self.model = model
        self.encode = encode
        self.queue = queue
        self.tools = tools
        self.debug = debug
        self.current: Job | None = None
        self.mean_run_s: float | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"streamgate-worker-{model.device}"
        )
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"worker {self.model.device}")

    async def stop(self) -> None:
        if self.current is not None:
            self.current.cancel()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            job = await self.queue.get()
            self.current = job
            try:
                await self._run(loop, job)
            finally:
                self.current = None

    async def _run(self, loop: asyncio.AbstractEventLoop, job: Job) -> None:
        if job.cancel_requested.is_set():
            job.fail(Code.CANCELLED, "the job was cancelled")
            return
        tool = self.tools[job.tool]
        job.set_status(Status.RUNNING)
        started = loop.time()
        try:
            result = await loop.run_in_executor(
                self._thread, execute, tool, self.model, job.params, JobContext(job), self.encode
            )
        except Cancelled:
            job.fail(Code.CANCELLED, "the job was cancelled")
        except asyncio.CancelledError:
            job.cancel()
            job.fail(Code.SHUTTING_DOWN, "the worker stopped before the job finished")
            raise
        except Exception as exc:
            log.exception("tool %s failed in job %s", tool.name, job.id)
            message = f"{type(exc).__name__}: {exc}"
            if self.debug:
                message += "\n" + traceback.format_exc()
            job.fail(Code.TOOL_ERROR, message)
        else:
            if job.cancel_requested.is_set():
                job.fail(Code.CANCELLED, "the job was cancelled")
            else:
                job.succeed(result)
        elapsed = loop.time() - started
        self.mean_run_s = elapsed if self.mean_run_s is None else 0.8 * self.mean_run_s + 0.2 * elapsed
