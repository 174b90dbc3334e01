"""A tool for the dashboard's page tests with 64-bit integer params: bounds and a default past
2**53 - 1, which a JavaScript number cannot hold. It sends the integers back as text, so the
test reads the exact values the gateway got. Loaded with `streamgate serve --tools big_ints_tools`
(this folder on PYTHONPATH).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from gateway.tools import Context, Model, tool

I64 = msgspec.Meta(ge=-(2**63), le=2**63 - 1, description="Any 64-bit signed integer.")


class BigIntsParams(msgspec.Struct, forbid_unknown_fields=True):
    n: Annotated[int, I64] = 2**62 + 1
    ids: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]],
        msgspec.Meta(description="Non-negative 64-bit signed integers."),
    ] = []


class BigIntsResult(msgspec.Struct):
    n: str
    ids: list[str]


@tool
def big_ints(model: Model, params: BigIntsParams, ctx: Context) -> BigIntsResult:
    """Send the integers back as decimal text."""
    return BigIntsResult(str(params.n), [str(i) for i in params.ids])
