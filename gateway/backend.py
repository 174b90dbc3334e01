"""What the gateway needs from a backend: tools, readiness, checks, submit and cancel.

The interface is the core's: the server drives it, and the backends (backends/: local
models, executors, engines, Ray Serve replicas, inference servers) plug in below it."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from typing import Any

from gateway.cost import Cost
from gateway.errors import ApiError
from gateway.models import capabilities
from gateway.jobs import Job
from gateway.params import apply_caps
from gateway.protocol import Code, ModelInfo, ModelList, ToolInfo
from gateway.tools.base import MODEL_FIELD, Tool


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

    def not_ready_error(self, model: str | None = None) -> ApiError:
        """The 503 a request gets while the backend (or `model` on it) is not ready."""
        return ApiError(Code.NOT_READY, self.not_ready_reason, retry_after=5)

    @abc.abstractmethod
    async def start(self) -> None:
        """Begin getting ready; return at once (loading happens in the background)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop all work; running jobs end with an error event."""

    async def check(self, tool: Tool, params: Any) -> Cost | None:
        """Model-dependent validation before queueing, and the job's price where the tool states
        one (gateway/cost.py); raises `ApiError` (413, 422)."""
        return None

    def tool(self, name: str) -> Tool:
        """The tool called `name`, or 404 `unknown_tool` listing the tools there are."""
        found = self.tools.get(name)
        if found is None:
            known = ", ".join(sorted(self.tools)) or "none"
            raise ApiError(Code.UNKNOWN_TOOL, f"no tool named {name!r}; tools: {known}")
        return found

    def ready_for(self, model: str | None) -> bool:
        """True when a job on `model` (a name `resolve_model` gave, or None) can start."""
        return self.ready

    def model_names(self) -> list[str]:
        """The served models' names, the default first; [] while not known yet (a remote backend before its executors answer)."""
        return [m.name for m in self.models()]

    def models(self) -> list[ModelInfo]:
        """`GET /models`: each served model, what it is and which tools it runs."""
        return []

    def model_list(self) -> ModelList:
        """The `GET /models` answer."""
        served = self.models()
        return ModelList(default=next((m.name for m in served if m.default), None), models=served)

    def resolve_model(self, name: str | None) -> str | None:
        """The served model a request's `model` names: the default when None, else 404 `unknown_model` naming those served."""
        names = self.model_names()
        if not names:
            if name is None:
                return None
            if self.ready:  # a backend that does not say its models serves none by name
                raise ApiError(Code.UNKNOWN_MODEL, f"no model named {name!r}: this backend serves its one model unnamed", field=MODEL_FIELD)
            raise self.not_ready_error()
        if name is None:
            return names[0]
        if name not in names:
            raise ApiError(
                Code.UNKNOWN_MODEL, f"no model named {name!r}; models: {', '.join(names)}", field=MODEL_FIELD
            )
        return name

    def unsupported(self, tool: Tool, model: str | None = None) -> str | None:
        """Why `model` (None: the default) cannot run `tool`; None when it can (or is not known yet).

        A tool learned from another service carries that service's answer.
        """
        for info in self.models():
            if info.name == model or (model is None and info.default):
                return info.unsupported.get(tool.name)
        return tool.info.unsupported if tool.info is not None else None

    @property
    def tools_version(self) -> object:
        """Changes whenever what `GET /tools` says would change: the tools, or the model they run on."""
        return id(self.tools)

    async def admit(self, tool: Tool, params: Any, limits: Mapping[str, int]) -> Cost | None:
        """The checks after decoding, in order: server caps, readiness, the model's capabilities, the
        tool's own check and its price; the price, where this backend knows it (a `Job`'s `cost`)."""
        apply_caps(tool, params, limits)
        model = getattr(params, MODEL_FIELD, None)
        if not self.ready_for(model):
            raise self.not_ready_error(model)
        if (reason := self.unsupported(tool, model)) is not None:
            raise capabilities.refuse(reason)
        return await self.check(tool, params)

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
