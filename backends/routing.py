"""Backends that route each job to one of several services, through a link to each: executors
(backends/remote.py), engine processes (backends/engines.py) and inference servers
(backends/inference.py).

A `Link` is what such a backend knows of one service: whether it is ready, what it serves, how many
of this gateway's jobs it holds, and how to submit and cancel one there. `Routing` learns the tools
and models from what the links' services publish, and sends a new job to the ready link that serves
its model and tool with the least in front of it; a link that cannot be reached passes it to the next.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from backends.base import Relaying
from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.protocol import Code, ModelInfo, ToolInfo
from gateway.tools.base import Tool


class Unreachable(Exception):
    """The service could not be reached to submit a job: the next link is tried."""


class Link(Protocol):
    """One service a routing backend sends jobs to."""

    url: str
    problem: str  # why it is not ready, when it is not
    tools: list[ToolInfo]  # what it publishes
    models: list[ModelInfo]
    facts: dict[str, Any]  # its last `/readyz` answer's (its model, device, queue)

    @property
    def ready(self) -> bool: ...

    @property
    def load(self) -> int:
        """This gateway's jobs there, not ended."""
        ...

    @property
    def backlog(self) -> int:
        """Its jobs not started yet: what a job sent now would wait behind."""
        ...

    def counts(self) -> tuple[int, int]:
        """This gateway's jobs there waiting, and running."""
        ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def submit(self, job: Job, tool: Tool) -> None:
        """Hand `job` to the service (it gets its frames from there); raises `Unreachable`, or its refusal."""
        ...

    def cancel(self, job: Job) -> bool:
        """Stop `job` if it is this link's (True): a queued one leaves its queue, a running one stops."""
        ...


class Routing(Relaying):
    """Jobs routed over `links`, in the order given: the first one's default model is the gateway's."""

    def __init__(self, links: Sequence[Link]) -> None:
        super().__init__()
        self.links = list(links)

    def _learn_tools(self) -> None:
        """The links' services answered what they serve: their tools and models, the first of each name."""
        models: dict[str, ModelInfo] = {}
        for link in self.links:
            for info in link.models:
                if info.name not in models:
                    # Queue figures are the service's at that moment, of every gateway's jobs: not kept.
                    models[info.name] = msgspec.structs.replace(info, default=not models, queued=0, running=0)
        self.learn((info for link in self.links for info in link.tools), list(models.values()))

    def _serving(self, model: str | None) -> list[Link]:
        return [link for link in self.links if link.ready and (model is None or any(m.name == model for m in link.models))]

    def ready_for(self, model: str | None) -> bool:
        return bool(self._serving(model))

    def models(self) -> list[ModelInfo]:
        served = []
        for model in self._models:
            ready = self.ready_for(model.name)
            counts = [link.counts() for link in self.links if any(m.name == model.name for m in link.models)]
            served.append(msgspec.structs.replace(
                model, ready=ready, problem=None if ready else "no service serving it is ready",
                queued=sum(q for q, _ in counts), running=sum(r for _, r in counts),
            ))
        return served

    @property
    def ready(self) -> bool:
        return any(link.ready for link in self.links)

    @property
    def in_flight(self) -> int:
        return sum(link.load for link in self.links)

    async def start(self) -> None:
        for link in self.links:
            link.start()

    async def stop(self) -> None:
        await asyncio.gather(*(link.stop() for link in self.links))

    async def submit(self, job: Job) -> None:
        tool = self.tool(job.tool)
        await self._submit_first(job, tool, self._candidates(job, tool))

    def _candidates(self, job: Job, tool: Tool) -> list[Link]:
        """The ready links that run the job's model and tool, the least loaded first."""
        serving = [link for link in self._serving(job.model) if any(t.name == tool.name for t in link.tools)]
        return sorted(serving, key=self._order)

    def _order(self, link: Link) -> Any:
        return link.load

    async def _submit_first(self, job: Job, tool: Tool, links: list[Link]) -> None:
        """Submit to the first of `links` that can be reached."""
        for link in links:
            try:
                await link.submit(job, tool)
                return
            except Unreachable:
                continue
        raise ApiError(Code.NOT_READY, self.not_ready_reason, retry_after=5)

    def cancel(self, job: Job) -> None:
        if not any(link.cancel(job) for link in self.links):
            job.cancel()
