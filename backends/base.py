"""The backends whose tools run in other services (executors, engine processes, Ray Serve replicas):
the tools and models learned from what those services publish."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gateway.backend import Backend
from gateway.protocol import ModelInfo, ToolInfo
from gateway.tools.base import Tool


class Relaying(Backend):
    """A backend whose tools and models run in other services (executors, Ray Serve replicas)
    and are learned from what those services publish (`GET /tools`, `GET /models`)."""

    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {}
        self._models: list[ModelInfo] = []

    @property
    def tools(self) -> Mapping[str, Tool]:
        return self._tools

    def tool(self, name: str) -> Tool:
        if not self._tools:
            # No service has said what it serves: the gateway is not ready, the tool not unknown.
            raise self.not_ready_error()
        return super().tool(name)

    def models(self) -> list[ModelInfo]:
        return self._models

    @property
    def tools_version(self) -> object:
        return (id(self._tools), id(self._models))

    def learn(self, infos: Iterable[ToolInfo], models: list[ModelInfo]) -> None:
        """Take the tools and models published, the first of each name winning; a tool whose
        schemas did not change keeps its object (and the Struct its params decode into)."""
        learned: dict[str, Tool] = {}
        for info in infos:
            if info.name not in learned:
                known = self._tools.get(info.name)
                learned[info.name] = known if known is not None and known.info == info else remote_tool(info)
        if learned.keys() != self._tools.keys() or any(learned[n] is not self._tools.get(n) for n in learned):
            self._tools = learned
        if models != self._models:
            self._models = models


def _relayed_only(model: Any, params: Any, ctx: Any) -> Any:
    raise RuntimeError("this tool runs in another service")


def remote_tool(info: ToolInfo) -> Tool:
    """A tool known from another service's `GET /tools`: validation from its schema, no code."""
    from backends.schema_structs import struct_from_schema

    return Tool(
        name=info.name,
        description=info.description,
        params=struct_from_schema(info.params_schema, f"{info.name}_params"),
        result=object,
        run=_relayed_only,
        info=info,
    )
