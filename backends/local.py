"""The local backend: the model lives in this process, on this machine's device.

Start-up returns at once; the model loads on a thread in the background and
the backend reports not ready until it is in memory. With several devices
(`--devices cuda:0,cuda:1`, or every GPU by default) each gets its own copy of
the model and its own worker, all taking jobs from one queue. Checks that need the
tokenizer run on a small thread pool of their own, so a long prompt's
tokenisation neither blocks the event loop nor waits behind a running job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from backends import model as models
from backends.base import Backend
from backends.execution import JobQueue, Worker
from gateway import sae as sae_files
from gateway.config import Settings
from gateway.encoding import to_json
from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.models import capabilities
from gateway.models.base import Capability
from gateway.protocol import Code
from gateway.tools.base import Model, Tool

log = logging.getLogger("streamgate.local")

EXIT_DEVICE_FAILED = 70  # EX_SOFTWARE: a supervisor restarts the process


class LocalBackend(Backend):
    def __init__(
        self,
        tools: Mapping[str, Tool],
        *,
        model: str | None = None,
        model_loader: str | None = None,
        trust_remote_code: bool = False,
        device: str | None = None,
        devices: list[str] | None = None,
        dtype: str | None = None,
        cache_dir: str | Path | None = None,
        queue_size: int = 64,
        debug: bool = False,
        encode: Callable[[Any], bytes] = to_json,
        max_batch_size: int = 32,
        batch_wait: float = 0.005,
        job_timeout: float = 0.0,
        exit_on_device_failure: bool = False,
        sae: list[str] | None = None,
    ) -> None:
        if device and devices:
            raise ValueError("give --device or --devices, not both")
        self._tools = dict(tools)
        # SAE files are checked here as far as they can be without the model (gateway/sae.py).
        self.sae_specs = sae_files.read_specs(sae or [])
        if self.sae_specs:
            from gateway.tools import collect
            from gateway.tools.sae_tools import sae_tools

            self._tools = collect([*self._tools.values(), *sae_tools()])
        # A loader's model is whatever --model names to it (a folder, a file, nothing).
        self.spec = models.ModelSpec(model or model_loader, model or "") if model_loader else models.resolve(model)
        self._loader = model_loader
        self._trust_remote_code = trust_remote_code
        self._devices = devices or ([device] if device else None)
        self.max_batch_size = max_batch_size
        self.batch_wait = batch_wait
        self.job_timeout = job_timeout
        self.exit_on_device_failure = exit_on_device_failure
        self.device_failed: str | None = None
        self._dtype = dtype
        self._cache_dir = Path(cache_dir) if cache_dir else None
        self._debug = debug
        self._encode = encode
        self.queue_size = queue_size
        self.model: Model | None = None
        self.error: str | None = None
        self.queue: JobQueue | None = None
        self.workers: list[Worker] = []
        self._checks = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="streamgate-check")
        self._loading: asyncio.Task[None] | None = None

    @property
    def tools(self) -> Mapping[str, Tool]:
        return self._tools

    @property
    def ready(self) -> bool:
        return bool(self.workers) and self.device_failed is None

    @property
    def not_ready_reason(self) -> str:
        if self.device_failed:
            return f"the device failed ({self.device_failed}); the server is restarting"
        if self.error:
            return f"the model failed to load: {self.error}"
        return f"the model {self.spec.name} is still loading"

    def not_ready_error(self) -> ApiError:
        """503 `not_ready`: retryable while loading; not once loading has failed."""
        if self.device_failed:
            return ApiError(Code.NOT_READY, self.not_ready_reason, retry_after=30)
        if self.error:
            return ApiError(Code.NOT_READY, self.not_ready_reason, retryable=False)
        return ApiError(Code.NOT_READY, self.not_ready_reason, retry_after=5)

    def check_kind(self) -> None:
        """Refuse a local checkpoint of a kind that cannot be served now, from its config alone (ModelError)."""
        if self._loader is None and self.spec.gguf is None and Path(self.spec.source).is_dir():
            models.detect_kind(self.spec.source, self._trust_remote_code)

    async def start(self) -> None:
        self.queue = JobQueue(self.queue_size, eta=self._eta)
        self._loading = asyncio.create_task(self._load(), name="load model")

    async def _load(self) -> None:
        try:
            loaded = [
                await asyncio.to_thread(
                    models.load,
                    self.spec,
                    device,
                    self._dtype,
                    self._cache_dir,
                    loader=self._loader,
                    trust_remote_code=self._trust_remote_code,
                )
                for device in self._devices or models.default_devices()
            ]
            for model in loaded:
                await asyncio.to_thread(sae_files.attach, model, self.sae_specs)
        except Exception as exc:
            self.error = str(exc) if isinstance(exc, models.ModelError) else f"{type(exc).__name__}: {models.first_sentence(exc)}"
            log.error("cannot load model %s: %s", self.spec.name, self.error)
            return
        self.model = loaded[0]
        assert self.queue is not None
        workers = [
            Worker(
                model,
                self.queue,
                self._tools,
                encode=self._encode,
                debug=self._debug,
                max_batch_size=self.max_batch_size,
                batch_wait=self.batch_wait,
                job_timeout=self.job_timeout,
                on_fatal=self._device_failed,
            )
            for model in loaded
        ]
        for worker in workers:
            worker.peers = workers  # one job's chunks may run on every device (Tool.spread)
            worker.start()
        self.workers = workers

    def _device_failed(self, exc: BaseException) -> None:
        """A device can no longer be trusted: not ready, every job ended, then exit non-zero
        so that the supervisor (compose `restart:`, systemd, Kubernetes) starts a fresh process."""
        if self.device_failed is not None:
            return
        self.device_failed = f"{type(exc).__name__}: {exc}"
        log.critical("the device failed: %s; ending every job", self.device_failed)
        if self.queue is not None:
            for job in self.queue.take(lambda _: True, len(self.queue)):
                job.fail(Code.BACKEND_UNAVAILABLE, "the device failed and the server is restarting")
        for worker in self.workers:
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
        if self.queue is not None:
            # All at once: taken one by one, every job left would hear its new position each time.
            for job in self.queue.take(lambda _: True, len(self.queue)):
                job.fail(Code.SHUTTING_DOWN, "the server stopped before the job started")
        for worker in self.workers:
            await worker.stop()
        self._checks.shutdown(wait=False, cancel_futures=True)

    def unsupported(self, tool: Tool) -> str | None:
        return capabilities.unsupported(tool, self.model) if self.model is not None else None

    @property
    def tools_version(self) -> object:
        return (id(self._tools), id(self.model))

    async def check(self, tool: Tool, params: Any) -> None:
        if tool.check is None:
            return
        if self.model is None:
            raise self.not_ready_error()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._checks, tool.check, self.model, params)

    async def submit(self, job: Job) -> None:
        if not self.ready or self.queue is None:
            raise self.not_ready_error()
        self.queue.put(job, retry_after=self._eta(len(self.queue) + 1))

    def cancel(self, job: Job) -> None:
        job.cancel()
        if self.queue is not None and self.queue.remove(job):
            job.fail(Code.CANCELLED, "the job was cancelled while queued")

    @property
    def in_flight(self) -> int:
        return (len(self.queue) if self.queue is not None else 0) + sum(len(w.running) for w in self.workers)

    def batch_size_counts(self) -> list[Mapping[int, int]]:
        return [w.batch_sizes for w in self.workers]

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"backend": "local", "model": self.model.name if self.model else self.spec.name}
        if self.model is not None:
            info["kind"] = self.model.kind.value
            info["capabilities"] = sorted(c.value for c in self.model.capabilities)
            if self.model.has(Capability.MASKED_LM) and self.model.mask_token_id is not None:
                info["mask_token"] = self.model.token_text(self.model.mask_token_id)
            info["device"] = ",".join(str(w.model.device) for w in self.workers) or str(self.model.device)
            info["dtype"] = str(self.model.dtype).removeprefix("torch.")
            info["context_length"] = self.model.context_length
        if self.queue is not None:
            info["queued"] = len(self.queue)
        info["running"] = sum(len(w.running) for w in self.workers)
        info["max_batch_size"] = self.max_batch_size
        if self.sae_specs:
            info["saes"] = [f"{s.name} (layer {s.layer}, {s.n_features} features, {s.activation})" for s in self.sae_specs]
        return info

    def _eta(self, position: int) -> float | None:
        """Seconds until a job at `position` starts, from the workers' mean run time."""
        means = [w.mean_run_s for w in self.workers if w.mean_run_s is not None]
        if not means:
            return None
        return position * (sum(means) / len(means)) / len(self.workers)


def from_settings(settings: Settings, **kwargs: Any) -> LocalBackend:
    """The local backend `streamgate serve` (or an executor, or a Ray replica) builds from its settings:
    the built-in tools and those of `settings.tools`; raises ValueError or ModelError."""
    from gateway.tools import builtin_tools, collect, load_module

    tools = collect(builtin_tools() + [t for name in settings.tools for t in load_module(name)])
    backend = LocalBackend(
        tools,
        model=settings.model,
        model_loader=settings.model_loader,
        trust_remote_code=settings.trust_remote_code,
        device=settings.device,
        devices=settings.devices,
        dtype=settings.dtype,
        cache_dir=settings.cache_dir,
        queue_size=settings.queue_size,
        debug=settings.debug,
        max_batch_size=settings.max_batch_size,
        batch_wait=settings.batch_wait_ms / 1000,
        job_timeout=settings.job_timeout,
        sae=settings.sae,
        exit_on_device_failure=True,
        **kwargs,
    )
    backend.check_kind()
    return backend
