"""Tools that fail the way a GPU does, loaded with `--tools tests.support.device_tools`."""

from __future__ import annotations

import time

import msgspec
import torch

from gateway.tools import Context, Model, tool


class DeviceErrorParams(msgspec.Struct, forbid_unknown_fields=True):
    kind: str = "oom"  # oom | fatal | none
    delay: float = 0.0


class DeviceErrorResult(msgspec.Struct):
    ok: bool


@tool
def device_error(model: Model, params: DeviceErrorParams, ctx: Context) -> DeviceErrorResult:
    """Raises what CUDA raises: out of memory (the job fails, work goes on), or an illegal memory access."""
    time.sleep(params.delay)
    if params.kind == "oom":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    if params.kind == "fatal":
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return DeviceErrorResult(True)
