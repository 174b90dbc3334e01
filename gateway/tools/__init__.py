"""Model tools: the public tool API, the built-in tools, and loading a user's module of tools."""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from gateway.errors import ParamError, TooLong
from gateway.tools.base import Cancelled, Capability, Context, Model, Tool, tool

__all__ = [
    "Cancelled",
    "Capability",
    "Context",
    "Model",
    "ParamError",
    "Tool",
    "TooLong",
    "builtin_tools",
    "load_module",
    "tool",
]


def builtin_tools() -> list[Tool]:
    from gateway.tools.activation_patching import activation_patching
    from gateway.tools.embed import embed
    from gateway.tools.fill_mask import fill_mask
    from gateway.tools.generate import generate
    from gateway.tools.logit_lens import lens_grid, lens_line, logit_lens
    from gateway.tools.loglikelihood import loglikelihood
    from gateway.tools.logprobs import logprobs
    from gateway.tools.predict import predict
    from gateway.tools.pseudo_loglikelihood import pseudo_loglikelihood

    return [
        generate, loglikelihood, logprobs, predict, logit_lens, lens_line, lens_grid, activation_patching, embed,
        fill_mask, pseudo_loglikelihood,
    ]


def load_module(name: str) -> list[Tool]:
    """Every `Tool` defined at the top level of the module `name` (e.g. `mypkg.tools`)."""
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise ValueError(f"--tools {name}: cannot import it: {exc}") from None
    found = [value for value in vars(module).values() if isinstance(value, Tool)]
    if not found:
        raise ValueError(f"--tools {name}: the module defines no tools (make them with @tool)")
    return found


def collect(tools: Iterable[Tool]) -> dict[str, Tool]:
    """Tools by name; a name given twice is an error, not a silent override."""
    by_name: dict[str, Tool] = {}
    for t in tools:
        if t.name in by_name and by_name[t.name] is not t:
            raise ValueError(f"two tools are named {t.name!r}")
        by_name[t.name] = t
    return by_name
