"""A tool whose result weighs what its params say, priced exactly: `--tools tests.support.result_tools`."""

from __future__ import annotations

import msgspec

from gateway.cost import Cost
from gateway.tools import Context, Model, tool


class SizedParams(msgspec.Struct, forbid_unknown_fields=True):
    size: int  # copies of `fill` in the result's text
    fill: str = "x"


class SizedResult(msgspec.Struct):
    text: str


def result_bytes(size: int, fill: str = "x") -> int:
    """The JSON of a `sized` result: the text, and `{"text":""}` around it."""
    return size * len(fill.encode()) + 11


def _cost(model: Model, params: SizedParams) -> Cost:
    result = result_bytes(params.size, params.fill)
    return Cost(memory=2 * result, result=result, memory_field="size", result_field="size")


@tool(cost=_cost)
def sized(model: Model, params: SizedParams, ctx: Context) -> SizedResult:
    """A result of `size` copies of `fill`: what a big tool's result weighs, without its compute."""
    return SizedResult(params.fill * params.size)


class ChattyParams(msgspec.Struct, forbid_unknown_fields=True):
    partials: int  # partial events before the result
    size: int = 40  # characters in each
    fail: bool = False  # end with an error, not a result


@tool
def chatty(model: Model, params: ChattyParams, ctx: Context) -> SizedResult:
    """Many small partial events, then a small result: the log of a long generation, without its compute."""
    for i in range(params.partials):
        ctx.partial({"i": i, "text": "y" * params.size})
    if params.fail:
        raise RuntimeError("asked to fail")
    return SizedResult("done")
