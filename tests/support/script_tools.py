"""Test tools for tests/test_invariants.py, in a module of their own so that an executor can load them.

Servers of either kind load this module: the local gateway imports it, and an
executor process gets `--tools tests.support.script_tools` (conftest's `tool_modules`).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from gateway.tools import Context, Model, tool

MARKER = "__await_disconnect__"  # logged by the `await_disconnect` step
DISCONNECT_TIMEOUT_S = 15.0  # how long that step waits for the cancellation

# -- the test tools ----------------------------------------------------------------------


class LogStep(msgspec.Struct, tag="log"):
    message: str
    level: str = "info"


class ProgressStep(msgspec.Struct, tag="progress"):
    done: int
    total: int | None = None


class BurstStep(msgspec.Struct, tag="burst"):
    """`n` progress updates in a tight loop."""

    n: int


class PartialStep(msgspec.Struct, tag="partial"):
    value: Any


class SleepStep(msgspec.Struct, tag="sleep"):
    ms: int


class RaiseStep(msgspec.Struct, tag="raise"):
    message: str


class CheckStep(msgspec.Struct, tag="check"):
    pass


class AwaitDisconnectStep(msgspec.Struct, tag="await_disconnect"):
    """Log MARKER, then wait until the job is cancelled (the client goes away on MARKER)."""


Step = (
    LogStep | ProgressStep | BurstStep | PartialStep | SleepStep | RaiseStep | CheckStep | AwaitDisconnectStep
)


class ScriptParams(msgspec.Struct, forbid_unknown_fields=True):
    script: list[Step]


class ScriptResult(msgspec.Struct):
    job_id: str
    steps: int


class ScriptError(Exception):
    pass


@tool
def script(model: Model, params: ScriptParams, ctx: Context) -> ScriptResult:
    """Do the steps of a script: the test's stand-in for any user tool."""
    for i, step in enumerate(params.script):
        if isinstance(step, LogStep):
            ctx.log(step.message, step.level)
        elif isinstance(step, ProgressStep):
            ctx.progress(step.done, step.total, f"{i}/0")
        elif isinstance(step, BurstStep):
            for k in range(step.n):
                ctx.progress(k, step.n, f"{i}/{k}")
        elif isinstance(step, PartialStep):
            ctx.partial({"step": i, "value": step.value})
        elif isinstance(step, SleepStep):
            time.sleep(step.ms / 1000)
        elif isinstance(step, RaiseStep):
            raise ScriptError(step.message)
        elif isinstance(step, CheckStep):
            ctx.raise_if_cancelled()
        elif isinstance(step, AwaitDisconnectStep):
            ctx.log(MARKER)
            deadline = time.monotonic() + DISCONNECT_TIMEOUT_S
            while not ctx.cancelled:
                if time.monotonic() > deadline:
                    raise RuntimeError("the job was never cancelled after its client went away")
                time.sleep(0.005)
    return ScriptResult(ctx.job_id, len(params.script))


class SpinParams(msgspec.Struct):
    n: int
    fail: bool = False


class SpinResult(msgspec.Struct):
    n: int


@tool
def spin(model: Model, params: SpinParams, ctx: Context) -> SpinResult:
    """Report progress `n` times in a tight loop."""
    for i in range(1, params.n + 1):
        ctx.progress(i, params.n, "it")
    if params.fail:
        raise ScriptError("spun out")
    return SpinResult(params.n)


class NapParams(msgspec.Struct):
    seconds: float


class NapResult(msgspec.Struct):
    slept: float


@tool
def nap(model: Model, params: NapParams, ctx: Context) -> NapResult:
    """Do nothing for a while."""
    time.sleep(params.seconds)
    return NapResult(params.seconds)


class ChatterParams(msgspec.Struct):
    n: int
    every_ms: int


@tool
def chatter(model: Model, params: ChatterParams, ctx: Context) -> NapResult:
    """Log every `every_ms` milliseconds, `n` times."""
    for i in range(params.n):
        ctx.log(f"line {i}")
        time.sleep(params.every_ms / 1000)
    return NapResult(params.n * params.every_ms / 1000)
