"""Running several jobs of one tool together: the `Batch` a tool may offer.

A tool that batches sets `Tool.batch`, a factory `batch(model) -> Batch`. The
worker adds the queued jobs it gathered (same tool, equal `Tool.batch_key`),
then calls `step()` until the batch is empty. Each step returns the members
that ended in it, each with its result or the exception that ends that job
alone. A member whose job was cancelled leaves at the next step. A batch that
is `continuous` (`generate`'s) also takes new members between steps, so a job
that finishes early frees its place for a waiting one at once.

A batching tool's single-job `run` is `run_alone` over the same batch: a batch
of one and a batch of 32 run the same code, and their results differ only by
what padding can change (tests hold that to 1e-4 in float32).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from gateway.tools.base import Cancelled, Context

if TYPE_CHECKING:
    from gateway.tools.base import Model


class Batch(Protocol):
    """Jobs of one tool running together on one model."""

    @property
    def continuous(self) -> bool:
        """True while the batch takes new members between steps."""

    def add(self, params: Any, ctx: Context) -> None:
        """Take a job in; raise if its own input is at fault (that job alone fails)."""

    def step(self) -> list[tuple[Context, Any]]:
        """Run one step; return the members that ended, each with a result or an exception."""

    def __len__(self) -> int:
        """Members not ended yet."""


BatchFactory = Callable[["Model"], Batch]
BatchKey = Callable[[Any], Hashable]
ManyFn = Callable[["Model", list[Any], list[Context]], list[Any]]


def run_alone(batch: Batch, params: Any, ctx: Context) -> Any:
    """Run one job as a batch of one: its result, or raise what ended it."""
    batch.add(params, ctx)
    while True:
        for _, outcome in batch.step():
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome


def raise_if_all_cancelled(ctxs: Sequence[Context]) -> None:
    """Stop work that no member wants any more; a member cancelled alone leaves after it."""
    if all(ctx.cancelled for ctx in ctxs):
        raise Cancelled()


class OnePass:
    """A batch run in one step by `many(model, params_list, ctxs) -> results`.

    For tools whose work is a padded forward pass over every member's inputs
    (`predict`, `loglikelihood`, `embed`). If the batch as a whole fails, each
    member runs again alone, so that an error reaches only the job at fault.
    """

    continuous = False

    def __init__(self, model: Model, many: ManyFn) -> None:
        self.model = model
        self.many = many
        self.members: list[tuple[Any, Context]] = []

    def __len__(self) -> int:
        return len(self.members)

    def add(self, params: Any, ctx: Context) -> None:
        self.members.append((params, ctx))

    def step(self) -> list[tuple[Context, Any]]:
        members, self.members = self.members, []
        ended: list[tuple[Context, Any]] = [(ctx, Cancelled()) for _, ctx in members if ctx.cancelled]
        live = [(params, ctx) for params, ctx in members if not ctx.cancelled]
        if not live:
            return ended
        try:
            results = self.many(self.model, [p for p, _ in live], [c for _, c in live])
        except Exception as exc:
            if len(live) == 1:
                return [*ended, (live[0][1], exc)]
            results = [self._alone(params, ctx) for params, ctx in live]
        for (_, ctx), result in zip(live, results):
            ended.append((ctx, Cancelled() if ctx.cancelled else result))
        return ended

    def _alone(self, params: Any, ctx: Context) -> Any:
        try:
            return self.many(self.model, [params], [ctx])[0]
        except Exception as exc:
            return exc


def one_pass(many: ManyFn) -> BatchFactory:
    """The batch factory for a tool whose jobs run together as `many(model, params_list, ctxs)`."""
    return functools.partial(OnePass, many=many)
