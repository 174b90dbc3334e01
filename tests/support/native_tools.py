"""A user tool for the process tests: `streamgate serve --tools tests.support.native_tools`.

`grind` keeps its device's thread in torch's native code for as long as asked,
one matrix product after another, and never checks for a cancel: the way one
long forward pass (a long prompt on a big model) holds a step that nothing can
interrupt.
"""

from __future__ import annotations

import time

import msgspec
import torch

from gateway.tools import Context, Model, tool


class GrindParams(msgspec.Struct, forbid_unknown_fields=True):
    seconds: float = 30.0


class GrindResult(msgspec.Struct):
    products: int


@tool
def grind(model: Model, params: GrindParams, ctx: Context) -> GrindResult:
    """Matrix products for `seconds`, deaf to cancels."""
    ctx.log("grinding")
    a = torch.randn(512, 512)
    products = 0
    deadline = time.monotonic() + params.seconds
    while time.monotonic() < deadline:
        a = torch.tanh(a @ a)  # each product releases the GIL and takes it back
        products += 1
    return GrindResult(products)
