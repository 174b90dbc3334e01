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

A block's parts are not the end of it on a CPU: one attention over 8k tokens
takes seconds there, and so does a head's matmul over thousands of positions.
So inside such a pass the two ops that grow with its length past the rest,
scaled-dot-product attention and a linear layer, run in pieces of at most
`PIECE_MACS` multiply-adds (`_Pieces`), with the same stop point between two
pieces: attention a run of queries at a time (each query row's softmax is its
own, so the pieces compute what the whole does), a linear layer a run of rows
at a time, each into its part of the output.

The hooks are set only around the passes of jobs priced (gateway/cost.py) over
`STOPPABLE_TOKENS` tokens: a short pass ends soon anyway, and a hook sends every
module it sits on through torch's slower call path, which a decoding step of a
small model would feel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from gateway.plumbing import handoff
from gateway.tools.base import Cancelled, Context, Model

STOPPABLE_TOKENS = 512
# Multiply-adds of one piece of attention or of a linear layer on a CPU, at most: about 0.1-0.2 s
# on two cores. A GPU runs the largest op of a model at its context in milliseconds: no pieces there.
PIECE_MACS = 1 << 32


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
    `call_between`: another tenant's short job) runs first, inside the pass. On a CPU, attention and
    linear layers run in pieces with a stop point between two (`_Pieces`)."""
    device = handoff.current()
    depth = device.depth if device is not None else 0

    def between() -> None:
        if device is not None and device.depth != depth:
            return  # a pass let in between runs inside this one: its own stop points are its own
        if all(ctx.cancelled for ctx in ctxs):
            raise Cancelled()
        if device is not None and device.waiting_between:
            with hooks_set_aside(model):
                device.run_between()

    handles = [point.register_forward_pre_hook(lambda module, args: between()) for point in stop_points(model)]
    on_cpu = getattr(model.device, "type", str(model.device)) != "cuda"
    try:
        with _Pieces(between) if on_cpu else contextlib.nullcontext():
            yield
    finally:
        for handle in handles:
            handle.remove()


class _Pieces(TorchFunctionMode):
    """Attention and linear layers, on this thread, in pieces of at most `PIECE_MACS` multiply-adds
    with `between()` called between two pieces; every other op as it is."""

    def __init__(self, between: Callable[[], None]) -> None:
        super().__init__()
        self.between = between

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.attention(*args, **kwargs)
        if func is F.linear:
            return self.linear(*args, **kwargs)
        return func(*args, **kwargs)

    def pieces(self, total: int, each: int) -> Iterator[tuple[int, int]]:
        """(start, end) of `total` items `each` at a time, `between()` called between two."""
        for start in range(0, total, each):
            if start:
                self.between()
            yield start, min(start + each, total)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1) if x.dim() >= 2 else 1
        per_row = weight.shape[0] * weight.shape[-1]
        if rows < 2 or rows * per_row <= PIECE_MACS:
            return F.linear(x, weight, bias)
        flat = x.reshape(rows, x.shape[-1])
        out = flat.new_empty((rows, weight.shape[0]))
        for start, end in self.pieces(rows, max(1, PIECE_MACS // per_row)):
            out[start:end] = F.linear(flat[start:end], weight, bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        **rest: Any,
    ) -> torch.Tensor:
        queries, keys = query.shape[-2], key.shape[-2]
        per_query = query.numel() // max(queries, 1) * keys * 2  # scores and the weighted sum
        if queries < 2 or queries * per_query <= PIECE_MACS:
            return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **rest)
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        for start, end in self.pieces(queries, max(1, PIECE_MACS // per_query)):
            if is_causal:
                # torch's causal mask is aligned top-left: query i sees keys 0..i, so these queries
                # see the keys up to `end` and, of those, each the ones up to its own position.
                seen = min(end, keys)
                mask = torch.ones((end - start, seen), dtype=torch.bool, device=query.device).tril(start)
                part = F.scaled_dot_product_attention(
                    query[..., start:end, :], key[..., :seen, :], value[..., :seen, :], mask, dropout_p, scale=scale, **rest
                )
            else:
                mask = attn_mask
                if mask is not None and mask.dim() >= 2 and mask.shape[-2] == queries:
                    mask = mask[..., start:end, :]
                part = F.scaled_dot_product_attention(query[..., start:end, :], key, value, mask, dropout_p, scale=scale, **rest)
            out[..., start:end, :] = part
        return out
