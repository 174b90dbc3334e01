"""Engine processes: each served model in a child process of its own (`--engine process`), driven as
the remote backend drives executors (backends/remote.py): one execution path, the same protocol, each
request decoded, checked and priced once, where the model is (its tokenizer, its price). The processes
are started, restarted and stopped by backends/engine_processes.py; this module routes jobs to them:

- when an engine exits, its running jobs end once with `backend_unavailable` (retryable), unless they
  go on from their checkpoint; its jobs that had not started wait in the gateway, `queued`, and go to
  the new engine in their order once it is ready (if it exits before it is ready, they end as the
  running ones did); the gateway, its streams and the other models' engines go on untouched.

One engine per model and device (`--devices cuda:0,cuda:1`, or every GPU by default):
each device's steps hold a GIL of their own, and a device that fails for good (a
CUDA context lost to an illegal memory access) takes down its own engine, not the
model's other copies. A new job goes to the model's engine with the fewest jobs not
started yet; a job whose items split (`Tool.spread`: `embed`'s texts,
`pseudo_loglikelihood`'s sequences) is cut over the idle ones (backends/spreading.py).
A model on an inference server (`vllm:`, `openai+`) is reached by a `ServerLink` (backends/inference.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shlex
import shutil
import tempfile
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import msgspec

from backends import inference, vllm_server
from gateway.plumbing import memory, tracing
from backends import loading as models
from backends.base import NULL, answers_inline, files_folder, remove_files_folder, sent
from backends.frames import failure
from backends.remote import UNIX, ExecutorLink, RemoteJob
from backends.routing import Link, Routing, Unreachable
from backends.engine_processes import Engine, VllmEngine, engine_devices, engine_settings
from backends.spreading import Spread, merged_cost, split
from gateway import checkpoints
from gateway.config import Settings
from gateway import params as params_mod
from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.plumbing.logs import request_id
from gateway.cost import Cost
from gateway.protocol import Accepted, Code, Forget, ModelInfo, Refusal, RemoteFrame, RemoteKind, Status, Submit, encode
from gateway.tools.base import Tool
from gateway.tools.batching import Chunked


log = logging.getLogger("streamgate.engines")

# Times a job goes on from its checkpoint after its engine died: a job that kills its engine
# itself (its memory) would otherwise take the next one down too, over and over.
MAX_RESUMES = 2
POLL_S = 0.2  # an engine is on this machine: its readiness is cheap to ask often


class EngineLink(ExecutorLink):
    """The link to one engine: an executor's link that submits and forgets jobs on the session socket,
    takes results from their `completed` frames, and keeps its unstarted jobs when the engine dies.

    The socket, not `POST /jobs` and `DELETE /jobs/{id}`: each HTTP call costs the gateway a
    request's worth of work, which with many short jobs was a third of its time (py-spy).
    """

    def __init__(self, url: str, checkpoint_folder: str | None = None, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.answers: dict[str, asyncio.Future[None]] = {}  # submits waiting for `accepted` or `refused`
        self.waiting: list[Job] = []  # jobs of a lost engine that had not started, in their order
        self.ready_since_start = False
        self.tool_of: Any = None  # a tool by name (the backend's), to submit the waiting jobs again
        self.checkpointed: frozenset[str] = frozenset()  # the tools that keep checkpoints (`Tool.resumable`)
        self._requeuing: asyncio.Task[None] | None = None
        # The jobs' checkpoints (gateway/checkpoints.py), one folder each: an engine that dies takes none
        # of them with it. In the gateway's own result files folder, or, where another gateway may go on
        # with its jobs (a shared store), in one that outlives it (`checkpoints.lasting_folder`).
        if checkpoint_folder is None and self.files_folder:
            checkpoint_folder = os.path.join(self.files_folder, "checkpoints")
        self.checkpoints = checkpoint_folder

    def _checkpoint(self, job: Job, tool: Tool) -> str | None:
        """The folder of `job`'s checkpoint, if its tool keeps one (`Tool.resumable`), removed when it ends."""
        if self.checkpoints is None or tool.name not in self.checkpointed:
            return None
        folder = os.path.join(self.checkpoints, job.id)
        if job.checkpoint is None:
            job.checkpoint = checkpoints.Checkpoint(folder, resumed=job.resumes > 0)
            if job.resumes == 0:
                # A journal there is another run's (a part of a job cut again after a takeover): gone before
                # this run starts, so that its engine dying early never makes it look resumable.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(job.checkpoint.path)
            checkpoints.removed_with(job, folder)
        return folder

    def resumable(self, job: Job) -> bool:
        """Whether a running job of an engine that died goes on in the next from its checkpoint: it
        has finished some pieces, was not cancelled, and has not gone on so too often already."""
        if job.resumes >= MAX_RESUMES or job.cancel_requested.is_set() or self.checkpoints is None:
            return False
        try:
            return os.path.getsize(os.path.join(self.checkpoints, job.id, checkpoints.JOURNAL)) > 0
        except OSError:
            return False

    async def _submit(self, job: Job, tool: Tool) -> None:
        """The `submit` op on the socket: returns once the engine answers `accepted`."""
        socket = self._socket
        if socket is None:
            raise Unreachable("the engine's socket is not open")
        answer = self.answers[job.id] = asyncio.get_running_loop().create_future()
        op = Submit(
            tool.name, job_id=job.id, tenant=job.tenant, weight=job.weight, priority=job.priority, timeout=job.timeout, request_id=request_id.get(),
            traceparent=tracing.traceparent(job.span), files=not answers_inline(job), **sent(job.params),
            checkpoint=self._checkpoint(job, tool), resumed=job.resumes > 0,
        )
        try:
            self._send(encode(op))  # the socket closing fails the answer (`_closed`)
            await answer
        finally:
            self.answers.pop(job.id, None)

    @staticmethod
    def as_json(data: bytes | memoryview) -> msgspec.Raw:
        return msgspec.Raw(data)  # an engine's results are JSON already

    def taken(self, job: Job) -> None:
        """The engine is this gateway's own: the stream is the one threads give (no DISPATCHED)."""

    @staticmethod
    def failure(frame: RemoteFrame) -> tuple[Code, str]:
        """An engine's errors are this gateway's own: `tool_error` stays `tool_error`."""
        return failure(frame, every_code=True)

    def completed(self, remote: RemoteJob, frame: RemoteFrame) -> None:
        """The result is in the frame, JSON already; a big one stays behind (`null`), fetched as an executor's is."""
        if not frame.files and frame.data != NULL:
            self.succeed(remote, frame.data)
        else:
            super().completed(remote, frame)

    def _on_frames(self, frames: list[RemoteFrame]) -> None:
        for frame in frames:
            if frame.kind is RemoteKind.ACCEPTED or frame.kind is RemoteKind.REFUSED:
                answer = self.answers.get(frame.job_id)
                if answer is not None and not answer.done():
                    if frame.kind is RemoteKind.ACCEPTED:
                        remote = self.jobs.get(frame.job_id)
                        if remote is not None:  # what the engine, which decoded its params, learned of them
                            accepted = msgspec.json.decode(frame.data, type=Accepted)
                            if accepted.cost != NULL:  # its price
                                remote.job.cost = msgspec.json.decode(accepted.cost, type=Cost)
                            remote.job.resumable = accepted.resumable
                        answer.set_result(None)
                    else:
                        refusal = msgspec.json.decode(frame.data, type=Refusal)
                        error = refusal.error
                        answer.set_exception(
                            ApiError(error.code, error.message, field=error.field, status=refusal.status, retry_after=refusal.retry_after)
                        )
            else:
                super()._on_frames([frame])

    def _closed(self) -> None:
        for answer in self.answers.values():
            if not answer.done():
                answer.set_exception(Unreachable("the engine's socket closed"))

    def forget(self, job_id: str, *, urgent: bool = True) -> None:
        if self._socket is None:
            super().forget(job_id)
        else:
            self._forgetting.append(job_id)
            self._send(encode(Forget(job_id)), urgent=urgent)

    async def _poll_loop(self) -> None:
        watch = asyncio.create_task(self._watch_ready())
        try:
            await super()._poll_loop()
        finally:
            watch.cancel()

    async def _watch_ready(self) -> None:
        while True:
            await asyncio.sleep(POLL_S / 2)
            if self.ready:
                self.ready_since_start = True

    def lost(self, reason: str) -> None:
        """The engine's process ended: end its running jobs, keep the others for the next engine."""
        self.healthy = False
        self.problem = reason
        self.abandoned.clear()  # a new engine has none of them
        # A job whose submit is unanswered is its submitter's (`_closed` fails it): admission tries
        # another engine or refuses the run, `_requeue` waits again. Kept here too, it would run twice.
        # So is one whose answer the socket's closing failed already, its submitter not yet woken.
        unanswered = {job_id for job_id, answer in self.answers.items() if not answer.done() or _failed(answer)}
        self._closed()
        keep = self.ready_since_start  # an engine that never got ready is in a crash loop: nothing waits on it
        going_on: list[Job] = []  # running ones that go on from their checkpoints, first: they started first
        for remote in list(self.jobs.values()):
            job = remote.job
            if job.id in unanswered:
                continue
            if keep and (job.started is None or self.resumable(job)):
                self.jobs.pop(job.id, None)
                if job.started is None:
                    self.waiting.append(job)
                else:
                    job.resumes += 1
                    job.going_on()
                    going_on.append(job)
            else:
                self._end(remote, f"the engine {reason}; it is restarting: try again")
        self.waiting[:0] = going_on
        if not keep:
            for job in self.waiting:
                job.fail(Code.BACKEND_UNAVAILABLE, f"the engine {reason} before it was ready; try again")
            self.waiting.clear()
        for position, job in enumerate(self.waiting, 1):
            message = "the engine is restarting"
            if job.resumes and job.started is not None:
                message = f"the engine {reason}; the job goes on from its last finished piece once it is back"
            job.set_status(Status.QUEUED, position=position, message=message)
        self.ready_since_start = False
        if self.waiting and (self._requeuing is None or self._requeuing.done()):
            self._requeuing = asyncio.create_task(self._requeue())
            self._tasks.add(self._requeuing)
            self._requeuing.add_done_callback(self._tasks.discard)

    def _end(self, remote: RemoteJob, message: str) -> None:
        if self._take(remote):
            remote.job.fail(Code.BACKEND_UNAVAILABLE, message)

    async def _requeue(self) -> None:
        """Once the new engine is ready, submit the waiting jobs to it, in their order. If that one dies
        too meanwhile, the job being submitted waits again, first, for the next (`lost` fails them all
        if the engines die before they are ready)."""
        while self.waiting:
            while not self.ready:
                await asyncio.sleep(POLL_S / 2)
            job = self.waiting.pop(0)
            if job.done:
                continue
            try:
                await self.submit(job, self.tool_of(job.tool))
            except ApiError as exc:  # the new engine refuses it (its queue is full, say)
                job.fail(exc.code, exc.message)
            except Unreachable:
                # Its engine died meanwhile: `lost` has put it back among the waiting, or ended it; a
                # submit that found no socket at all leaves it to wait here.
                if not job.done and job not in self.waiting:
                    self.waiting.insert(0, job)
                await asyncio.sleep(POLL_S)

    @property
    def backlog(self) -> int:
        return super().backlog + len(self.waiting)

    def cancel(self, job: Job) -> bool:
        if job in self.waiting:  # waiting for the engine to be back
            self.waiting.remove(job)
            job.cancel()
            job.fail(Code.CANCELLED, "the job was cancelled while its engine restarted")
            return True
        return super().cancel(job)


class EngineBackend(Routing):
    """Every model in an engine process of its own, driven as executors are (or on an inference server)."""

    def __init__(self, settings: Settings) -> None:
        """Checks what a gateway with threads checks before it starts (raises ValueError, ModelError):
        the models' names and kinds, and that the tool modules import and define tools."""
        memory.bound_heap()  # results pass through this process: big ones given back when freed (gateway/plumbing/memory.py)
        specs = models.specs(settings.model, settings.model_loader, settings.model_devices)
        for spec in specs:
            if spec.server is None:
                models.check_kind(spec, settings.trust_remote_code)
        from gateway.tools import builtin_tools, load_module

        local = [*builtin_tools(), *(t for name in settings.tools for t in load_module(name))]
        # The tools' code, for what the gateway cannot learn from a schema: how a job is cut over engines,
        # whether it keeps a checkpoint, and the params of the jobs it runs itself (on an inference server).
        self.local = {t.name: t for t in local}
        self.works: dict[str, Chunked] = {
            t.name: t.spread for t in local if isinstance(t.spread, Chunked) and t.spread.items
        }
        self.limits = settings.limits()
        self._spreads: dict[str, Spread] = {}
        self.model_order = [spec.name for spec in specs]
        self.max_result_bytes = settings.max_result_bytes
        self.folder = Path(tempfile.mkdtemp(prefix="streamgate-engines-"))  # 0700: only this user reaches the sockets
        self.files_folder = files_folder(settings.result_spool)
        self.checkpoints = checkpoints.lasting_folder(settings.result_spool, settings.store)
        if self.checkpoints is not None:
            os.makedirs(self.checkpoints, 0o700, exist_ok=True)
        token = secrets.token_urlsafe(24)
        infos = params_mod.describe(local, settings.limits())
        links: list[Link] = []  # in the models' order: the first one's default model is the gateway's
        self.engines: list[Engine] = []
        for i, spec in enumerate(specs):
            if spec.server is not None:
                server, engine = self._server(spec, settings, infos)
                links.append(server)
                if engine is not None:
                    self.engines.append(engine)
                continue
            for device in engine_devices(settings, spec):
                path = self.folder / f"{len(self.engines)}.sock"
                link = EngineLink(
                    UNIX + str(path), token=token, deadline=settings.executor_deadline, poll_interval=POLL_S, on_tools=self._learn_tools,
                    files_folder=self.files_folder, checkpoint_folder=self.checkpoints,
                )
                link.tool_of = self.tool
                link.checkpointed = frozenset(t.name for t in local if t.resumable is not None)
                settings_of = engine_settings(settings, spec, i == 0, token, device)
                self.engines.append(Engine(spec.name, device, link, settings.engine_memory_limit, settings_of, path))
                links.append(link)
        # The tools as the engines publish them, their params relayed: decoded once, by what runs the job.
        super().__init__(links)
        self._supervisors: list[asyncio.Task[None]] = []

    def _server(self, spec: models.ModelSpec, settings: Settings, infos: list[Any]) -> tuple[inference.ServerLink, Engine | None]:
        """A model an inference server serves: its link, and for vLLM the engine that runs the server."""
        keys = dict(entry.split("=", 1) for entry in settings.model_api_key if "=" in entry)
        if spec.server == "vllm":
            port = inference.free_port()
            url = f"http://127.0.0.1:{port}/v1"
        else:
            port, url = 0, spec.source
        link = inference.ServerLink(
            spec.name, url, spec.server or "openai",
            api_key=None if spec.server == "vllm" else inference.api_key(spec.name, keys),
            tools=infos, max_jobs=settings.max_decoding_jobs, queue_size=settings.queue_size,
            per_owner=settings.max_queued_per_owner, job_timeout=settings.job_timeout, deadline=settings.executor_deadline,
            max_result_bytes=settings.max_result_bytes, on_tools=self._learn_tools, code=self.local, limits=self.limits,
        )
        if spec.server != "vllm":
            return link, None
        source = vllm_server.MODEL_PLACEHOLDER if spec.gguf is not None else spec.source
        command = vllm_server.vllm_command(
            vllm_server.vllm_python(settings.vllm_python), source, spec.name, port, settings.dtype, shlex.split(settings.vllm_args),
            kv_cache_bytes=settings.vllm_kv_cache_bytes,
        )
        return link, VllmEngine(spec.name, "vllm server", link, command=command, spec=spec, cache_dir=settings.cache_dir)

    async def start(self) -> None:
        await super().start()
        for engine in self.engines:
            self._supervisors.append(asyncio.create_task(engine.supervise(), name=f"engine {engine.name} on {engine.device}"))

    async def stop(self) -> None:
        for task in self._supervisors:
            task.cancel()
        await asyncio.gather(*self._supervisors, return_exceptions=True)
        for engine in self.engines:
            for job in engine.link.waiting:
                job.fail(Code.SHUTTING_DOWN, "the gateway is shutting down")
            engine.link.waiting.clear()
        await super().stop()
        await asyncio.gather(*(engine.stop() for engine in self.engines))
        shutil.rmtree(self.folder, ignore_errors=True)
        remove_files_folder(self.files_folder)

    def _learn_tools(self) -> None:
        super()._learn_tools()
        # A model's copies are engines of their own, each telling its one device.
        devices: dict[str, list[str]] = {}
        for engine in self.engines:
            if any(info.name == engine.name for info in engine.link.models):
                devices.setdefault(engine.name, []).append(engine.device)
        known = {m.name: msgspec.structs.replace(m, device=",".join(devices.get(m.name, [])) or m.device) for m in self._models}
        # Every model in the order given, the first the default, whichever answered first: a request
        # without `model` must never land on another model because the default one is still loading.
        self._models = [
            msgspec.structs.replace(known.get(name) or ModelInfo(name, False, False, problem="its engine is starting"), default=i == 0)
            for i, name in enumerate(self.model_order)
        ]

    async def submit(self, job: Job) -> None:
        """To the engine of the job's model with the fewest jobs not started (then the fewest jobs); a
        job whose inputs split, cut over that model's idle engines when there are several."""
        tool = self.tool(job.tool)
        links = self._candidates(job, tool)
        work = self.works.get(tool.name)
        if work is not None and len(links) > 1:
            idle = [link for link in links if link.load == 0]
            if len(idle) > 1 and await self._spread(job, tool, work, idle):
                return
        await self._submit_first(job, tool, links)


    def _order(self, link: Link) -> Any:
        return (link.backlog, link.load)  # type: ignore[attr-defined]

    async def _spread(self, job: Job, tool: Tool, work: Chunked, links: list[Link]) -> bool:
        """Submit `job` as parts, one to each of `links`; False (nothing submitted) when it does not split
        or an engine refused its part."""
        context = next((m.context_length for m in self._models if m.name == job.model), None)
        try:  # only to cut it: the job refused whole, by an engine, if it must be
            params = await params_mod.decoded(self.local[tool.name], job.params, self.limits)
        except ApiError:
            return False
        cut = split(params, work, len(links), context)
        if cut is None:
            return False
        spread = Spread(job, *cut, super().cancel)  # a part is cancelled where it runs
        self._spreads[job.id] = spread
        try:
            outcomes = await asyncio.gather(*(link.submit(part, tool) for link, part in zip(links, spread.parts)), return_exceptions=True)
        except BaseException:  # the request itself was cancelled: no part may run on unattended
            self._spreads.pop(job.id, None)
            spread.drop()
            raise
        # Each part was priced alone; merged, their results are one, which --max-result-bytes bounds,
        # and their price the job's, which admission holds (the result's room, a class's quotas).
        merged = merged_cost(spread.parts)
        if any(isinstance(outcome, BaseException) for outcome in outcomes) or (merged is not None and merged.result > self.max_result_bytes):
            # Whole, the job meets the refusal (or the acceptance: as files) it would have met unspread.
            self._spreads.pop(job.id, None)
            spread.drop()
            return False
        job.cost = merged
        job.when_ended(lambda ended: self._spreads.pop(ended.id, None))
        spread.arm()
        return True

    def cancel(self, job: Job) -> None:
        spread = self._spreads.get(job.id)
        if spread is not None:
            job.cancel()
            spread.cancel()  # the first part to end cancelled ends the job so
            return
        super().cancel(job)

    @property
    def in_flight(self) -> int:
        return super().in_flight + sum(len(engine.link.waiting) for engine in self.engines)

    @property
    def ready(self) -> bool:
        # Every model, as with models on threads: a gateway is ready when all it serves is.
        return all(link.ready for link in self.links)

    @property
    def not_ready_reason(self) -> str:
        problems = [
            f"the engine of model {e.name} on {e.device} is {e.shown_state}" + (f" (it {e.last_exit})" if e.last_exit else "")
            + ("; it is not started again: fix its settings and restart the gateway" if e.state == "given up" else "")
            for e in self.engines
            if not e.link.ready
        ]
        problems += [
            f"the inference server of model {link.name} is not ready ({link.problem})"
            for link in self._outside()
            if not link.ready
        ]
        return "; ".join(problems) or "the engines are not ready"

    def _outside(self) -> list[inference.ServerLink]:
        """The links to servers the gateway did not start (`openai+` models)."""
        started = {id(engine.link) for engine in self.engines}
        return [link for link in self.links if isinstance(link, inference.ServerLink) and id(link) not in started]

    def batch_size_counts(self) -> list[Mapping[int, int]]:
        """Each engine's batch sizes so far, as it last reported them on /readyz."""
        return [{int(size): n for size, n in e.link.facts.get("batch_sizes", {}).items()} for e in self.engines]

    def describe(self) -> dict[str, Any]:
        # The default model's facts as its engine last told them, as a gateway with threads tells its own.
        first = self.links[0]
        facts = {k: v for k, v in first.facts.items() if k not in ("ready", "backend", "sessions", "reason", "batch_sizes")}
        copies = [e for e in self.engines if self.engines and e.name == self.engines[0].name and self.engines[0].link is first]
        if len(copies) > 1:  # as threads tell it: the copies' devices
            facts["device"] = ",".join(e.device for e in copies)
        if first.ready:  # counted from the jobs' own frames, current when read (`Link.counts`)
            counts = [e.link.counts() for e in copies] or [first.counts()]
            facts["queued"], facts["running"] = sum(q for q, _ in counts), sum(r for _, r in counts)
        return {
            **facts,
            "backend": "local",
            "engine": "process",
            "engines": [
                {
                    "model": e.name,
                    "device": e.device,
                    "copy": sum(1 for other in self.engines[:n] if other.name == e.name),  # the model's copies, from 0
                    "state": "ready" if e.link.ready else e.state,
                    "pid": e.pid,
                    "restarts": e.restarts,
                    "jobs": e.link.load,
                    "queued": e.link.counts()[0] if e.link.ready else 0,
                    "running": e.link.counts()[1] if e.link.ready else 0,
                    "waiting": len(e.link.waiting),
                    "batches": sum(e.link.facts.get("batch_sizes", {}).values()),  # steps run, as it last said
                    "rss_bytes": e.rss(),
                }
                | ({"last_exit": e.last_exit} if e.last_exit else {})
                | ({"url": e.link.url, **e.sizing()} if isinstance(e, VllmEngine) else {})
                | ({} if e.link.ready else {"problem": e.link.problem})
                for n, e in enumerate(self.engines)
            ],
            **(
                {"servers": [{"model": link.name, "url": link.url, "ready": link.ready, "jobs": link.load, **link.facts}
                             | ({} if link.ready else {"problem": link.problem}) for link in self._outside()]}
                if self._outside() else {}
            ),
        }


def _failed(answer: asyncio.Future[None]) -> bool:
    return answer.cancelled() or answer.exception() is not None
