"""Stopping a big forward pass between its blocks once nobody wants what it computes.

A tool stops at its own steps (between chunks, at the layers a lens reads,
between generated tokens), but one pass over thousands of tokens (a long
text's embedding, a long prompt's prefill) runs for seconds with no such step
inside it. `stoppable` adds stop points inside the model: a forward pre-hook
on every block of its layer stack and on each block's direct parts (attention,
MLP, norms) raises `Cancelled` once every job the pass serves is cancelled or
past its time. A batch-mate still wanted keeps the pass going; the others leave
it when it ends, as before.

The hooks are set only around the passes of jobs priced (gateway/cost.py) over
`STOPPABLE_TOKENS` tokens: a short pass ends soon anyway, and a hook sends every
module it sits on through torch's slower call path, which a decoding step of a
small model would feel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from gateway.tools.base import Cancelled, Context, Model

STOPPABLE_TOKENS = 512


def big(jobs: Sequence[Any]) -> bool:
    """True when a pass over these jobs' inputs is long enough to stop inside."""
    return any(job.cost is not None and job.cost.tokens >= STOPPABLE_TOKENS for job in jobs)


def stop_points(model: Model) -> list[nn.Module]:
    """The blocks of every layer stack in the model (a `ModuleList` of two or more modules), and their parts."""
    points = model.memo.get("stop_points")
    if points is None:
        points = []
        module = model.module if isinstance(model.module, nn.Module) else None
        for stack in module.modules() if module is not None else ():
            if isinstance(stack, nn.ModuleList) and len(stack) >= 2:
                for block in stack:
                    points.append(block)
                    points.extend(block.children())
        model.memo["stop_points"] = points
    return points


@contextlib.contextmanager
def stoppable(model: Model, ctxs: Sequence[Context]) -> Iterator[None]:
    """Within: a pass of `model` raises `Cancelled` at its next stop point once every one of `ctxs` is cancelled."""

    def check(module: nn.Module, args: Any) -> None:
        if all(ctx.cancelled for ctx in ctxs):
            raise Cancelled()

    handles = [point.register_forward_pre_hook(check) for point in stop_points(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
