"""What a worker (backends/workers.py) runs on its device's thread: one job's call, one step of a
batch, a spread job's plan, chunks and assembly; each result encoded there, so that a large
one costs the event loop nothing. `BatchSteps` is what a stepping batch shares with the loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import msgspec
import torch

from backends.stopping import stoppable
from gateway.jobs import JobContext
from gateway.plumbing import memory, tracing
from gateway.tools.base import Cancelled, Context, Model, Tool
from gateway.tools.batching import Batch, Chunk, Chunked, ChunkRun, Preemptible, Resumed


def execute(
    tool: Tool, model: Model, params: Any, ctx: JobContext, encode: Callable[[Any], bytes], stop: bool = False
) -> msgspec.Raw:
    """Run one tool call on the current thread and encode its result; with `stop`, its passes stop
    between blocks once it is cancelled (backends/stopping.py)."""
    ctx.raise_if_cancelled()
    ctx.begin()
    began = time.time_ns()
    # Inference mode is per thread, so it is set here, on the worker's thread.
    with torch.inference_mode(), (stoppable(model, [ctx]) if stop else contextlib.nullcontext()):
        result = tool.run(model, params, ctx)
    if ctx.span.is_recording():  # alone, its run is one step
        tracing.step(ctx, began, 1, 0)
    return encoded(ctx, result, encode)


def encoded(ctx: Context, result: Any, encode: Callable[[Any], bytes]) -> msgspec.Raw:
    """`result` encoded (under its job's `encoding` span, when traced)."""
    with tracing.encoding(ctx) as span:
        data = encode(result)
        span.set_attribute("streamgate.result.bytes", len(data))
    return msgspec.Raw(data)


StepOutcome = msgspec.Raw | BaseException


def step(
    batch: Batch,
    joining: list[tuple[Any, JobContext]],
    encode: Callable[[Any], bytes],
    model: Model | None = None,
    members: Sequence[Context] = (),
    traced: tracing.Steps | None = None,
) -> list[tuple[Context, StepOutcome]]:
    """Add `joining` to `batch`, run one step, and encode the results of the members that ended.
    With `model` and every member's context, the step's passes stop between blocks once all of
    them are cancelled (backends/stopping.py); with `traced`, its traced members' step spans."""
    ended: list[tuple[Context, StepOutcome]] = []
    with torch.inference_mode(), (stoppable(model, members) if model is not None else contextlib.nullcontext()):
        for params, ctx in joining:
            ctx.begin()
            try:
                if isinstance(params, Resumed):  # a preempted job taken back where it stopped
                    cast(Preemptible, batch).resume(params.kept, ctx)
                else:
                    batch.add(params, ctx)
            except Exception as exc:  # this job's input alone is at fault
                ended.append((ctx, exc))
            else:
                if traced is not None:
                    traced.join(ctx)
        if len(batch):
            size = len(batch)
            began = time.time_ns() if traced else 0
            ended.extend(batch.step())
            if traced:
                traced.stepped(began, size)
            if not batch.continuous:  # a chunked job's next chunk (a continuous batch's steps hold what they grow)
                memory.trim_heap()
    if traced:
        traced.leave(ctx for ctx, _ in ended)
    return [(ctx, outcome if isinstance(outcome, BaseException) else encoded(ctx, outcome, encode)) for ctx, outcome in ended]


def plan_chunks(work: Chunked, model: Model, params: list[Any], ctxs: list[JobContext]) -> ChunkRun:
    """The jobs' chunks as they run (`ChunkRun`): planned, less what their checkpoints kept."""
    for ctx in ctxs:
        ctx.begin()
    with torch.inference_mode():
        return ChunkRun(work, model, params, ctxs)


def run_chunk(work: Chunked, model: Model, params: list[Any], chunk: Chunk, run: ChunkRun) -> None:
    """One chunk on this device; its outputs kept in `run` (and its jobs' checkpoints) and its progress
    told, one device at a time."""
    with torch.inference_mode():
        outputs = work.run(model, params, chunk)
    with run.lock:
        run.done(chunk, outputs)


def assemble_chunks(
    work: Chunked, model: Model, params: list[Any], outputs: dict[tuple[int, int], Any], ctxs: list[Context], encode: Callable[[Any], bytes]
) -> list[tuple[Context, StepOutcome]]:
    with torch.inference_mode():
        results = work.assemble(model, params, outputs, ctxs)
    return [(ctx, Cancelled() if ctx.cancelled else encoded(ctx, result, encode)) for ctx, result in zip(ctxs, results)]


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


class BatchSteps:
    """What a batch stepping on the device's thread shares with the event loop.

    The loop hands joining members through `inbox` and asks for a pause (to let a
    job through), a stop, or members to leave (`evict`); the thread reads them
    between two steps. `big`: the
    members' passes are long enough to stop inside (backends/stopping.py).
    """

    def __init__(self) -> None:
        self.inbox: collections.deque[tuple[Any, Context]] = collections.deque()
        # The members in the batch, on the device's thread: kept across a pause, whose batch goes on after it.
        self.live: list[Context] = []
        self.pause = False
        self.stopped = False
        # Members to take out after the step under way, for a job of a higher class (`Preemptible`):
        # some of `live`, chosen on the loop.
        self.evict: collections.deque[Context] = collections.deque()
        self.big = False
        self.changed = asyncio.Event()  # set on the loop when members end
        self.traced = tracing.Steps()  # its members whose traces are recorded, on the device's thread

    def offer(self, added: list[tuple[Any, Context]]) -> None:
        self.inbox.extend(added)

    def preempt(self, batch: Batch) -> list[tuple[Context, Any]]:
        """On the device's thread, between two steps: the members asked to leave taken out of the
        batch, each with what the batch kept of it (`Preemptible.preempt`)."""
        evict = set()
        while self.evict:
            evict.add(self.evict.popleft())
        if not evict:
            return []
        out = cast(Preemptible, batch).preempt(evict)
        gone = {ctx for ctx, _ in out}
        self.live = [ctx for ctx in self.live if ctx not in gone]
        return out

    def drain(self) -> list[tuple[Any, Context]]:
        added = []
        while self.inbox:
            added.append(self.inbox.popleft())
        return added
