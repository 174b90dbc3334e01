"""What the gateway needs from a backend: tools, readiness, checks, submit and cancel."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

from gateway.errors import ApiError
from gateway.models import capabilities
from gateway.jobs import Job
from gateway.params import apply_caps
from gateway.protocol import Code
from gateway.tools.base import Tool


class Backend(abc.ABC):
    """Runs jobs somewhere and reports on them through each `Job`'s event log."""

    @property
    @abc.abstractmethod
    def tools(self) -> Mapping[str, Tool]:
        """The tools this backend can run, by name."""

    @property
    @abc.abstractmethod
    def ready(self) -> bool:
        """True when a submitted job can start (the model is loaded, the executor reachable)."""

    @property
    def not_ready_reason(self) -> str:
        return "the backend is not ready"

    def not_ready_error(self) -> ApiError:
        """The 503 a request gets while the backend is not ready."""
        return ApiError(Code.NOT_READY, self.not_ready_reason, retry_after=5)

    @abc.abstractmethod
    async def start(self) -> None:
        """Begin getting ready; return at once (loading happens in the background)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop all work; running jobs end with an error event."""

    async def check(self, tool: Tool, params: Any) -> None:
        """Model-dependent validation before queueing; raises `ApiError` (413, 422)."""

    def tool(self, name: str) -> Tool:
        """The tool called `name`, or 404 `unknown_tool` listing the tools there are."""
        found = self.tools.get(name)
        if found is None:
            known = ", ".join(sorted(self.tools)) or "none"
            raise ApiError(Code.UNKNOWN_TOOL, f"no tool named {name!r}; tools: {known}")
        return found

    def unsupported(self, tool: Tool) -> str | None:
        """Why the served model cannot run `tool`; None when it can (or is not known yet).

        A tool learned from another service carries that service's answer.
        """
        return tool.info.unsupported if tool.info is not None else None

    @property
    def tools_version(self) -> object:
        """Changes whenever what `GET /tools` says would change: the tools, or the model they run on."""
        return id(self.tools)

    async def admit(self, tool: Tool, params: Any, limits: Mapping[str, int]) -> None:
        """The checks after decoding, in order: server caps, readiness, the model's capabilities, the tool's own check."""
        apply_caps(tool, params, limits)
        if not self.ready:
            raise self.not_ready_error()
        if (reason := self.unsupported(tool)) is not None:
            raise capabilities.refuse(reason)
        await self.check(tool, params)

    @abc.abstractmethod
    async def submit(self, job: Job) -> None:
        """Accept `job` (it gets QUEUED frames), or raise `ApiError` (429 `queue_full`, …)."""

    @abc.abstractmethod
    def cancel(self, job: Job) -> None:
        """Stop `job`: a queued one leaves the queue, a running one stops at its next step."""

    @property
    def in_flight(self) -> int:
        """Jobs accepted and not ended yet: what a graceful shutdown waits for."""
        return 0

    def describe(self) -> dict[str, Any]:
        """A few facts for `/readyz`."""
        return {}

    def batch_size_counts(self) -> list[Mapping[int, int]] | None:
        """For each worker that batches, how many steps ran with how many jobs (the batch-size
        histogram in `/metrics`); None where the work runs elsewhere and is not reported."""
        return None
