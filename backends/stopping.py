"""Stopping a big forward pass between its blocks once nobody wants what it computes.

A tool stops at its own steps (between chunks, at the layers a lens reads,
between generated tokens), but one pass over thousands of tokens (a long
text's embedding, a long prompt's prefill) runs for seconds with no such step
inside it. `stoppable` adds stop points inside the model: a forward pre-hook
on every block of its layer stack and on each block's direct parts (attention,
MLP, norms) raises `Cancelled` once every job the pass serves is cancelled or
past its time. A batch-mate still wanted keeps the pass going; the others leave
it when it ends, as before. The same points are where another tenant's short
job gets its turn inside a long pass (backends/workers.py lets it in; it runs
on the same thread, there, and the pass goes on after it).

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

from gateway.plumbing import handoff
from gateway.tools.base import Cancelled, Context, Model

STOPPABLE_TOKENS = 512


def big(jobs: Sequence[Any]) -> bool:
    """True when a pass over these jobs' inputs is long enough to stop inside."""
    return any(job.cost is not None and job.cost.tokens >= STOPPABLE_TOKENS for job in jobs)


def stop_points(model: Model) -> list[nn.Module]:
    """The blocks of every layer stack in the model (a `ModuleList` of two or more modules), and their
    parts; then its output projection (the head), which tools that read many positions call once per
    chunk of them (a vocabulary's logits over thousands of positions take seconds in one go)."""
    points = model.memo.get("stop_points")
    if points is None:
        points = []
        module = model.module if isinstance(model.module, nn.Module) else None
        for stack in module.modules() if module is not None else ():
            if isinstance(stack, nn.ModuleList) and len(stack) >= 2:
                for block in stack:
                    points.append(block)
                    points.extend(block.children())
        head = getattr(module, "get_output_embeddings", lambda: None)() if module is not None else None
        if isinstance(head, nn.Module) and all(head is not point for point in points):
            points.append(head)
        model.memo["stop_points"] = points
    return points


_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


@contextlib.contextmanager
def hooks_set_aside(model: Model) -> Iterator[None]:
    """Within: the model's modules without the forward hooks set on them now, put back after.

    A job let in between runs its passes on the same modules as the pass it interrupts, whose
    tool may have hooks on them (a lens capturing each block's output, a patch replacing one, the
    stop points themselves): fired by the other job's pass, they would mix its activations into
    this one's. Its own hooks, set and removed within, go into the fresh tables.
    """
    module = model.module if isinstance(model.module, nn.Module) else None
    saved = []
    for part in module.modules() if module is not None else ():
        tables = {name: getattr(part, name) for name in _FORWARD_HOOKS if hasattr(part, name)}
        if any(tables.values()):
            saved.append((part, tables))
            for name, table in tables.items():
                setattr(part, name, type(table)())
    try:
        yield
    finally:
        for part, tables in saved:
            for name, table in tables.items():
                setattr(part, name, table)


@contextlib.contextmanager
def stoppable(model: Model, ctxs: Sequence[Context]) -> Iterator[None]:
    """Within: a pass of `model` raises `Cancelled` at its next stop point once every one of `ctxs` is
    cancelled; and at each stop point, the work let in between (gateway/plumbing/handoff.py
    `call_between`: another tenant's short job) runs first, inside the pass."""
    device = handoff.current()
    depth = device.depth if device is not None else 0

    def check(module: nn.Module, args: Any) -> None:
        if device is not None and device.depth != depth:
            return  # a pass let in between runs inside this one: its own stop points are its own
        if all(ctx.cancelled for ctx in ctxs):
            raise Cancelled()
        if device is not None and device.waiting_between:
            with hooks_set_aside(model):
                device.run_between()

    handles = [point.register_forward_pre_hook(check) for point in stop_points(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
