"""The local backend: the models live in this process, on this machine's devices.

Start-up returns at once; the models load on a thread in the background, one
after the other, and each reports not ready until it is in memory. Each model
(`--model NAME=SOURCE`, repeatable) is a `ServedModel` with its own queue and
workers; a job goes to the one its params name. With several devices
(`--devices cuda:0,cuda:1`, or every GPU by default) each model gets a copy and
a worker on each, all taking jobs from that model's queue. Checks that need the
tokenizer run on a small thread pool of their own, so a long prompt's
tokenisation neither blocks the event loop nor waits behind a running job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gateway.plumbing import memory
from backends import loading as models
from gateway.backend import Backend
from backends.base import files_folder, remove_files_folder
from backends.workers import Worker, set_torch_threads
from backends.queue import JobQueue
from backends.served import ServedModel
from gateway.models import sae as sae_files
from gateway.config import Settings
from gateway import checkpoints
from gateway.cost import FILE_FIELD, Budget, Cost, default_job_memory, inline_only
from gateway.encoding import to_json
from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.models import alphabet
from gateway.protocol import Code, ModelInfo
from gateway.tools.base import MODEL_FIELD, Model, Tool

log = logging.getLogger("streamgate.local")

EXIT_DEVICE_FAILED = 70  # EX_SOFTWARE: a supervisor restarts the process


class LocalBackend(Backend):
    """Serves one model or several (backends/served.py), each job on the model its params name."""

    def __init__(
        self,
        tools: Mapping[str, Tool],
        settings: Settings,
        *,
        encode: Callable[[Any], bytes] = to_json,
        exit_on_device_failure: bool = False,
        supervised: bool = False,
        result_files: str | None = None,
        checkpoint_folder: str | None = None,
    ) -> None:
        """`tools` on the models of `settings`; `encode`: how results are written; `exit_on_device_failure`:
        the process exits on a device that cannot be trusted any more; `supervised`: an engine process
        (backends/engines.py), whose gateway queues its jobs that had not started again; `result_files`:
        the folder where jobs write their result files (None: none); `checkpoint_folder`: where a job
        that can go on from its checkpoint keeps it for another gateway process (a shared store's:
        gateway/checkpoints.py `lasting_folder`; None: only as its gateway asks, an engine's jobs)."""
        if settings.device and settings.devices:
            raise ValueError("give --device or --devices, not both")
        # Process-wide, as torch's threads are: this backend runs the process's model work.
        set_torch_threads(settings.torch_threads)
        memory.bound_heap()
        self._tools = dict(tools)
        # SAE files are checked here as far as they can be without the model (gateway/models/sae.py).
        self.sae_specs = sae_files.read_specs(settings.sae)
        if self.sae_specs:
            from gateway.tools import collect
            from gateway.tools.sae_tools import sae_tools

            self._tools = collect([*self._tools.values(), *sae_tools()])
        specs = models.specs(settings.model, settings.model_loader, settings.model_devices)
        if served := [spec.name for spec in specs if spec.server is not None]:
            # An inference server is driven from the gateway's engine supervisor (backends/engines.py).
            raise ValueError(f"the model(s) {', '.join(served)} on an inference server need --engine process (the default) on a gateway")
        self.max_batch_size = settings.max_batch_size
        self.max_decoding_jobs = settings.max_decoding_jobs
        # Where jobs write their result files (a folder of this process's, gone with it), if anywhere.
        self.files_folder = files_folder(result_files) if result_files is not None and settings.max_result_file_bytes else None
        self.checkpoints = checkpoint_folder
        if checkpoint_folder is not None:
            os.makedirs(checkpoint_folder, 0o700, exist_ok=True)
        devices = settings.devices or ([settings.device] if settings.device else None)
        self.budget = Budget(
            memory=settings.max_job_memory or default_job_memory(devices),
            result=settings.max_result_bytes,
            files=settings.max_result_file_bytes if self.files_folder else 0,
            journal=settings.max_checkpoint_bytes,
        )
        self.exit_on_device_failure = exit_on_device_failure
        self.supervised = supervised
        self.device_failed: str | None = None
        worker_options = {
            "encode": encode, "debug": settings.debug, "max_batch_size": settings.max_batch_size,
            "max_decoding_jobs": settings.max_decoding_jobs, "batch_wait": settings.batch_wait_ms / 1000,
            "job_timeout": settings.job_timeout, "batch_memory": self.budget.memory,
        }
        self.served: dict[str, ServedModel] = {
            spec.name: ServedModel(
                spec,
                self._tools,
                devices=devices,
                dtype=settings.dtype,
                cache_dir=Path(settings.cache_dir) if settings.cache_dir else None,
                trust_remote_code=settings.trust_remote_code,
                # SAEs are read on the default model's layers.
                sae_specs=self.sae_specs if i == 0 else [],
                queue_size=settings.queue_size,
                max_queued_per_owner=settings.max_queued_per_owner,
                min_share=settings.class_min_share,
                worker_options=worker_options,
                on_fatal=self._device_failed,
            )
            for i, spec in enumerate(specs)
        }
        self.default = next(iter(self.served.values()))
        self._checks = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="streamgate-check")
        self._loading: asyncio.Task[None] | None = None

    # The default model's parts, as code that serves one model knows them.
    @property
    def model(self) -> Model | None:
        return self.default.model

    @property
    def workers(self) -> list[Worker]:
        return self.default.workers

    @property
    def queue(self) -> JobQueue:
        return self.default.queue

    @property
    def error(self) -> str | None:
        return next((s.error for s in self.served.values() if s.error), None)

    @property
    def tools(self) -> Mapping[str, Tool]:
        return self._tools

    @property
    def ready(self) -> bool:
        return all(s.ready for s in self.served.values()) and self.device_failed is None

    @property
    def not_ready_reason(self) -> str:
        if self.device_failed:
            return f"the device failed ({self.device_failed}); the server is restarting"
        problems = [s.problem for s in self.served.values() if s.problem]
        return "; ".join(problems) or "the backend is not ready"

    def not_ready_error(self, model: str | None = None) -> ApiError:
        """503 `not_ready`: retryable while loading; not once loading has failed. With `model`,
        about that model alone (another's failure is not this request's)."""
        if self.device_failed:
            return ApiError(Code.NOT_READY, self.not_ready_reason, retry_after=30)
        if model is not None:
            served = self._served(model)
            reason = served.problem or self.not_ready_reason
            if served.error:
                return ApiError(Code.NOT_READY, reason, retryable=False)
            return ApiError(Code.NOT_READY, reason, retry_after=5)
        if self.error:
            return ApiError(Code.NOT_READY, self.not_ready_reason, retryable=False)
        return ApiError(Code.NOT_READY, self.not_ready_reason, retry_after=5)

    def check_kind(self) -> None:
        """Refuse a local checkpoint of a kind that cannot be served now, from its config alone (ModelError)."""
        for served in self.served.values():
            served.check_kind()

    async def start(self) -> None:
        self._loading = asyncio.create_task(self._load(), name="load models")

    async def _load(self) -> None:
        # One after the other: two models loading at once would only compete for the same disk and cores.
        for served in self.served.values():
            await served.load()
        memory.settle()  # the weights' modules are for life: out of the collector's passes

    def _device_failed(self, exc: BaseException) -> None:
        """A device can no longer be trusted: not ready, every job ended, then exit non-zero
        so that the supervisor (compose `restart:`, systemd, Kubernetes) starts a fresh process."""
        if self.device_failed is not None:
            return
        self.device_failed = f"{type(exc).__name__}: {exc}"
        log.critical("the device failed: %s; ending every job", self.device_failed)
        for served in self.served.values():
            # Out of the queue, so that no worker starts one on a device that cannot be trusted;
            # a supervised engine's gateway submits them again to the next engine.
            for job in served.take_all():
                if not self.supervised:
                    job.fail(Code.BACKEND_UNAVAILABLE, "the device failed and the server is restarting")
            for worker in served.workers:
                for job in list(worker.running):
                    job.fail(Code.BACKEND_UNAVAILABLE, "the device failed and the server is restarting")
                    job.cancel()
        if self.exit_on_device_failure:
            # A moment for the streams to carry their terminal events out.
            asyncio.get_running_loop().call_later(1.0, os._exit, EXIT_DEVICE_FAILED)

    async def wait_ready(self) -> None:
        """Wait until loading ends (for tests and tooling); raises if it failed."""
        if self._loading is not None:
            await self._loading
        if self.error:
            raise models.ModelError(self.error)

    async def stop(self) -> None:
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        for served in self.served.values():
            for job in served.take_all():
                job.fail(Code.SHUTTING_DOWN, "the server stopped before the job started")
        for served in self.served.values():
            await served.stop()
        self._checks.shutdown(wait=False, cancel_futures=True)
        remove_files_folder(self.files_folder)

    def model_names(self) -> list[str]:
        return list(self.served)

    def models(self) -> list[ModelInfo]:
        return [served.info(served is self.default) for served in self.served.values()]

    def _served(self, name: str | None) -> ServedModel:
        return self.served[name] if name is not None else self.default

    def unsupported(self, tool: Tool, model: str | None = None) -> str | None:
        return self._served(model).unsupported(tool)

    @property
    def tools_version(self) -> object:
        return (id(self._tools), *(id(s.model) for s in self.served.values()))

    async def check(self, tool: Tool, params: Any) -> Cost | None:
        if tool.check is None and tool.cost is None and not tool.sequences:
            return None  # (a tool without sequences has no `tag`)
        name = getattr(params, MODEL_FIELD, None)
        model = self._served(name).model
        if model is None:
            raise self.not_ready_error(name)
        loop = asyncio.get_running_loop()
        budget = dataclasses.replace(self.budget, files=0) if inline_only.get() else self.budget
        return await loop.run_in_executor(self._checks, prepare, tool, model, params, budget)

    def ready_for(self, model: str | None) -> bool:
        return self._served(model).ready and self.device_failed is None

    async def submit(self, job: Job) -> None:
        served = self._served(job.model)
        if not self.ready_for(job.model):
            raise self.not_ready_error(job.model)
        job.files.folder = self.files_folder
        checkpoint = checkpoints.given.get()
        own = checkpoint is None and self.checkpoints is not None and job.resumable
        if own:
            checkpoint = checkpoints.Checkpoint(os.path.join(self.checkpoints, job.id), resumed=job.resumes > 0)
        if checkpoint is not None:  # its files with its checkpoint: a run after this one's crash finds both
            # A journal priced over its bound is not kept; one that grows past it stops there (gateway/checkpoints.py).
            checkpoint.most = self.budget.journal if job.cost is None or job.cost.journal else 0
            job.checkpoint = checkpoint
            job.files.folder, job.files.resumed, job.files.in_checkpoint = checkpoint.folder, checkpoint.resumed, True
        served.queue.put(job, retry_after=served.eta(len(served.queue) + 1))
        if checkpoint is not None:  # once queued (a refused job has no folder to leave behind); before it can start
            os.makedirs(checkpoint.folder, 0o700, exist_ok=True)  # one mkdir: cheaper than a thread hop
        if own:
            checkpoints.removed_with(job, checkpoint.folder)

    def cancel(self, job: Job) -> None:
        job.cancel()
        if self._served(job.model).queue.remove(job):
            job.fail(Code.CANCELLED, "the job was cancelled while queued")

    @property
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.served.values())

    def batch_size_counts(self) -> list[Mapping[int, int]]:
        return [w.batch_sizes for s in self.served.values() for w in s.workers]

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"backend": "local", **self.default.describe()}
        if len(self.served) > 1:
            info["models"] = list(self.served)
        info["queued"] = sum(len(s.queue) for s in self.served.values())
        info["running"] = sum(s.running for s in self.served.values())
        info["max_batch_size"] = self.max_batch_size
        info["max_decoding_jobs"] = self.max_decoding_jobs
        if self.sae_specs:
            info["saes"] = [f"{s.name} (layer {s.layer}, {s.n_features} features, {s.activation})" for s in self.sae_specs]
        return info


def prepare(tool: Tool, model: Model, params: Any, budget: Budget | None = None) -> Cost | None:
    """The model-dependent checks of a job before it is queued: its sequences cleaned and checked
    against the model's alphabet, then the tool's own check (413, 422), then its price against
    `budget` (413 `too_large`); the price, where the tool states one. A job that keeps no
    checkpoint (`Tool.resumable`) has no journal in its price."""
    alphabet.clean_params(model, tool.sequences, params, tool.tagged)
    if tool.check is not None:
        tool.check(model, params)
    if tool.cost is None:
        return None
    cost: Cost = tool.cost(model, params)
    if cost.journal and not checkpoints.resumable(tool, params):
        cost = dataclasses.replace(cost, journal=0)
    if budget is not None:
        admitted = budget.admit(cost)
        if cost.as_files is not None and admitted.as_files is None:  # its result goes to files, as the tool writes them by default
            setattr(params, FILE_FIELD, cost.file_format)
        cost = admitted
    return cost


def from_settings(settings: Settings, **kwargs: Any) -> LocalBackend:
    """The local backend `streamgate serve` (or an executor, or a Ray replica) builds from its settings:
    the built-in tools and those of `settings.tools`; raises ValueError or ModelError."""
    from gateway.tools import builtin_tools, collect, load_module

    tools = collect(builtin_tools() + [t for name in settings.tools for t in load_module(name)])
    backend = LocalBackend(
        tools,
        settings,
        result_files=kwargs.pop("result_files", settings.result_spool or tempfile.gettempdir()),
        exit_on_device_failure=True,
        supervised=settings.engine == "process",
        # An engine's jobs keep the checkpoints their gateway gives them (backends/engines.py).
        checkpoint_folder=None if settings.engine == "process" else checkpoints.lasting_folder(settings.result_spool, settings.store),
        **kwargs,
    )
    backend.check_kind()
    return backend
