"""One served model: its copies on their devices, its queue and its workers.

A gateway may serve several models at once (`--model base=./a --model tiny=./b`).
Each is a `ServedModel` of its own, with its own devices, queue and workers, so a
long job on one never waits in the other's queue, and a batch only ever holds
jobs of one model. The local backend (backends/local.py) routes each job to the
model its params name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from backends import loading as models
from backends.workers import Worker
from backends.queue import MIN_SHARE, JobQueue
from gateway.models import sae as sae_files
from gateway.jobs import Job
from gateway.models import capabilities
from gateway.models.base import Capability
from gateway.protocol import ModelInfo
from gateway.tools.base import Model, Tool

log = logging.getLogger("streamgate.local")


class ServedModel:
    """A model loaded on each of its devices, each copy with a worker, all taking jobs from one queue."""

    def __init__(
        self,
        spec: models.ModelSpec,
        tools: Mapping[str, Tool],
        *,
        devices: list[str] | None,
        dtype: str | None,
        cache_dir: Path | None,
        trust_remote_code: bool,
        sae_specs: list[Any],
        queue_size: int,
        max_queued_per_owner: int | None,
        worker_options: dict[str, Any],
        min_share: float = MIN_SHARE,
        on_fatal: Callable[[BaseException], None],
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.tools = tools
        self.devices = list(spec.devices) or devices
        self.dtype = dtype
        self.cache_dir = cache_dir
        self.trust_remote_code = trust_remote_code
        self.sae_specs = sae_specs
        self.worker_options = worker_options
        self.on_fatal = on_fatal
        self.queue = JobQueue(queue_size, eta=self.eta, per_owner=max_queued_per_owner, min_share=min_share)
        self.model: Model | None = None
        self.error: str | None = None
        self.workers: list[Worker] = []

    @property
    def ready(self) -> bool:
        return bool(self.workers)

    @property
    def problem(self) -> str | None:
        if self.error:
            return f"the model {self.name} failed to load: {self.error}"
        return None if self.workers else f"the model {self.name} is still loading"

    def check_kind(self) -> None:
        """Refuse a local checkpoint of a kind that cannot be served, from its config alone (ModelError)."""
        models.check_kind(self.spec, self.trust_remote_code)

    async def load(self) -> None:
        """Load a copy on every device and start their workers; on failure, `error` says why."""
        try:
            loaded = [
                await asyncio.to_thread(
                    models.load, self.spec, device, self.dtype, self.cache_dir, trust_remote_code=self.trust_remote_code
                )
                for device in self.devices or models.default_devices()
            ]
            for model in loaded:
                await asyncio.to_thread(sae_files.attach, model, self.sae_specs)
        except Exception as exc:
            self.error = str(exc) if isinstance(exc, models.ModelError) else f"{type(exc).__name__}: {models.first_sentence(exc)}"
            log.error("cannot load model %s: %s", self.name, self.error)
            return
        self.model = loaded[0]
        workers = [Worker(model, self.queue, self.tools, on_fatal=self.on_fatal, **self.worker_options) for model in loaded]
        for worker in workers:
            worker.peers = workers  # one job's chunks may run on every device (Tool.spread)
            worker.start()
        self.workers = workers

    def take_all(self) -> list[Job]:
        """Every waiting job, out of the queue at once (one by one, each left would hear its new position each time)."""
        return self.queue.take(lambda _: True, len(self.queue))

    async def stop(self) -> None:
        for worker in self.workers:
            await worker.stop()

    def unsupported(self, tool: Tool) -> str | None:
        return capabilities.unsupported(tool, self.model) if self.model is not None else None

    @property
    def running(self) -> int:
        return sum(len(w.running) for w in self.workers)

    @property
    def in_flight(self) -> int:
        return len(self.queue) + self.running

    def eta(self, position: int) -> float | None:
        """Seconds until a job at `position` starts, from the workers' mean run time."""
        means = [w.mean_run_s for w in self.workers if w.mean_run_s is not None]
        if not means:
            return None
        return position * (sum(means) / len(means)) / len(self.workers)

    def info(self, default: bool) -> ModelInfo:
        """This model's `GET /models` entry."""
        entry = ModelInfo(
            name=self.name, default=default, ready=self.ready, problem=self.problem, queued=len(self.queue), running=self.running
        )
        model = self.model
        if model is not None:
            entry.kind = model.kind.value
            entry.context_length = model.context_length
            entry.device = ",".join(str(w.model.device) for w in self.workers) or str(model.device)
            entry.dtype = str(model.dtype).removeprefix("torch.")
            entry.alphabet = model.alphabet
            entry.tags = sorted(model.tags)
            for name, tool in self.tools.items():
                if (reason := self.unsupported(tool)) is None:
                    entry.tools.append(name)
                else:
                    entry.unsupported[name] = reason
        return entry

    def describe(self) -> dict[str, Any]:
        """The facts `/readyz` gives about the default model."""
        info: dict[str, Any] = {"model": self.model.name if self.model else self.name}
        if self.model is not None:
            model = self.model
            info["kind"] = model.kind.value
            info["capabilities"] = sorted(c.value for c in model.capabilities)
            if model.has(Capability.MASKED_LM) and model.mask_token_id is not None:
                info["mask_token"] = model.token_text(model.mask_token_id)
            info["device"] = ",".join(str(w.model.device) for w in self.workers) or str(model.device)
            info["dtype"] = str(model.dtype).removeprefix("torch.")
            info["context_length"] = model.context_length
        return info
