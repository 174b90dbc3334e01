"""User tools for the CLI tests, loaded with `streamgate serve --tools tests.support.user_tools`."""

from __future__ import annotations

import time

import msgspec

from gateway.tools import Context, Model, tool


class EchoParams(msgspec.Struct, forbid_unknown_fields=True):
    text: str
    repeat: int = 1
    delay: float = 0.0  # seconds per copy, to keep the worker busy


class EchoResult(msgspec.Struct):
    text: str
    tokens: int


@tool
def echo(model: Model, params: EchoParams, ctx: Context) -> EchoResult:
    """Return the text, repeated, and how many tokens the model makes of it."""
    ctx.log(f"echoing {params.text!r}")
    for step in range(params.repeat):
        ctx.raise_if_cancelled()
        time.sleep(params.delay)
        ctx.progress(step + 1, params.repeat, "copies")
    return EchoResult(params.text * params.repeat, len(model.encode(params.text)))


class FailParams(msgspec.Struct, forbid_unknown_fields=True):
    message: str = "boom"


@tool
def fail(model: Model, params: FailParams, ctx: Context) -> EchoResult:
    """Always raises: the job ends with a tool_error event."""
    ctx.log("about to fail", level="warning")
    raise RuntimeError(params.message)
