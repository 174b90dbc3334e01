"""Tools for the engine-process tests: a batched nap that holds its engine for as long as asked, and a memory hog."""

from __future__ import annotations

import time

import msgspec
import torch

from gateway.tools import Cancelled, Context, Model, tool
from gateway.tools.batching import one_pass


class NapParams(msgspec.Struct, forbid_unknown_fields=True):
    seconds: float
    tag: str = ""


class Napped(msgspec.Struct):
    tag: str
    batch: int  # how many jobs napped together


def _nap_many(model: Model, params: list[NapParams], ctxs: list[Context]) -> list[Napped]:
    end = time.monotonic() + max(p.seconds for p in params)
    while time.monotonic() < end:
        if all(ctx.cancelled for ctx in ctxs):
            raise Cancelled()
        time.sleep(0.01)
    return [Napped(p.tag, len(params)) for p in params]


@tool(batch=one_pass(_nap_many))
def nap(model: Model, params: NapParams, ctx: Context) -> Napped:
    """Hold the engine for `seconds`, batched with the naps that came with it."""
    return _nap_many(model, [params], [ctx])[0]


class HogParams(msgspec.Struct, forbid_unknown_fields=True):
    gib: float


class Hogged(msgspec.Struct):
    bytes: int


@tool
def hog(model: Model, params: HogParams, ctx: Context) -> Hogged:
    """Allocate (and touch) `gib` GiB: a job that runs away with memory."""
    block = torch.ones(int(params.gib * (1 << 30)), dtype=torch.uint8)
    return Hogged(block.numel())
