"""A tool for the dashboard's queue test: its job holds the model's worker until a file exists, so
that jobs sent after it wait behind it for as long as the test wants, not for as long as a model
happens to take. Loaded with `streamgate serve --tools held_tools` (this folder on PYTHONPATH).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import msgspec

from gateway.tools import Context, Model, tool


class HeldParams(msgspec.Struct, forbid_unknown_fields=True):
    gate: Annotated[str, msgspec.Meta(min_length=1, description="A file whose existence lets the job end.")]


class HeldResult(msgspec.Struct):
    gate: str


@tool
def held(model: Model, params: HeldParams, ctx: Context) -> HeldResult:
    """Hold the worker until the gate file exists."""
    while not Path(params.gate).exists():
        ctx.raise_if_cancelled()
        time.sleep(0.01)
    return HeldResult(params.gate)
