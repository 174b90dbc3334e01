"""Tools the benchmarks run, loaded with `streamgate serve --tools bench.tools` from the repository root.

None of them touches the model: they measure the gateway around a job, not the job.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

import msgspec

from gateway.tools import Context, Model, tool


class NoopParams(msgspec.Struct, forbid_unknown_fields=True):
    partials: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 8
    size: Annotated[int, msgspec.Meta(ge=0, le=65_536, description="Characters of text in each partial.")] = 64


class NoopResult(msgspec.Struct):
    partials: int


@tool
def noop(model: Model, params: NoopParams, ctx: Context) -> NoopResult:
    """Emit `partials` partials of `size` characters at once, then a small result."""
    text = "x" * params.size
    for index in range(params.partials):
        ctx.partial({"index": index, "text": text})
    return NoopResult(params.partials)


class TicksParams(msgspec.Struct, forbid_unknown_fields=True):
    count: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 10
    interval_ms: Annotated[float, msgspec.Meta(ge=0, le=60_000)] = 10.0
    kind: Literal["log", "progress"] = "log"


class TicksResult(msgspec.Struct):
    ticks: int


@tool
def ticks(model: Model, params: TicksParams, ctx: Context) -> TicksResult:
    """Every `interval_ms`, `count` times: a log event whose message is the emit time, or a progress step.

    The message is `time.time()` as the worker thread sees it, in full precision:
    frames' own `ts` is rounded to the millisecond and, through a remote gateway,
    stamped after the hop, so it cannot measure the hop.
    """
    for index in range(params.count):
        time.sleep(params.interval_ms / 1000)
        ctx.raise_if_cancelled()
        if params.kind == "log":
            ctx.log(repr(time.time()))
        else:
            ctx.progress(index + 1, params.count, "ticks")
    return TicksResult(params.count)


class WaitParams(msgspec.Struct, forbid_unknown_fields=True):
    seconds: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 60.0


class WaitResult(msgspec.Struct):
    waited: float


@tool
def wait(model: Model, params: WaitParams, ctx: Context) -> WaitResult:
    """Hold the worker for `seconds`, emitting nothing, stopping early once cancelled."""
    start = time.monotonic()
    deadline = start + params.seconds
    while not ctx.cancelled and time.monotonic() < deadline:
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    return WaitResult(round(time.monotonic() - start, 3))
