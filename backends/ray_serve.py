"""The Ray backend: jobs run on the replicas of a Ray Serve application (`--backend ray`).

The gateway deploys one Serve application, `streamgate` (or attaches to it when
it is running already), whose deployment is `Replica`: a plain class, each
instance a local backend (`backends/local.py`) with the model, its queue,
dynamic batching and workers — the one execution path, with results encoded as
msgpack as an executor's are. Ray does what it is good at and this module does
not redo: placing replicas on GPUs, starting a new one when one dies, scaling
between `--ray-min-replicas` and `--ray-max-replicas` on ongoing requests, and
routing each call to a replica with room.

A job is one streaming call, `handle.options(stream=True).run.remote(…)`. The
replica answers with a `Dispatch` (accepted, naming itself; or refused with
the protocol's error, which the gateway answers as HTTP before any stream),
then the job's events as `RemoteFrame`s, the executor's frames, and after a
`completed` frame the result's msgpack bytes, which travel in Ray's object
store rather than as JSON. The gateway re-emits them on its own `Job`, so its
clients get the same stream as from the local backend, byte for byte, apart
from a `DISPATCHED` status.

Cancelling a job (the client's `DELETE`, a client gone past the detach grace,
the job's deadline) cancels the call: Ray cancels the replica's generator,
whose `finally` cancels the job there, so the work stops at its next step and
frees its batch slot. A replica that dies mid-job makes the call raise: the
job ends with `backend_unavailable` (retryable), once, and Serve starts a new
replica while new jobs go to the live ones.

`ray[serve]` is an optional extra: without it `--backend ray` stops at start-up
with one sentence saying what to install.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec

from backends.base import Relaying, sent
from backends.frames import failure, relay
from backends.remote import as_json
from gateway import params as params_mod
from gateway.admission import Admission, Applicant
from gateway.config import Settings
from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.plumbing import tracing
from gateway.protocol import Code, ErrorInfo, EventType, ModelInfo, RemoteFrame, RemoteKind, Status, ToolInfo, encode, remote_frame

log = logging.getLogger("streamgate.ray")

# Ray's C++ core otherwise catches SIGTERM in the gateway's process and aborts it 3 s later,
# whatever the drain (gateway/plumbing/drain.py) is doing. Ray reads this when first imported, and this
# module imports Ray only inside functions, after it.
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")

APP_NAME = "streamgate"
DEPLOYMENT = "Replica"
NAMESPACE = "streamgate"
POLL_S = 1.0  # how often the gateway reads the application's status, and replicas report their load
BOARD = "streamgate-load"  # the named actor replicas report their load to
INSTALL_HINT = "--backend ray needs Ray Serve: pip install 'streamgate[ray]' (ray[serve]==2.60.0)"


class Dispatch(msgspec.Struct, omit_defaults=True):
    """A replica's first answer to a job: accepted (and by whom), or refused before it ran."""

    replica: str = ""
    error: ErrorInfo | None = None
    status: int = 0  # the HTTP status of a refusal
    retry_after: float | None = None


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        return False
    return True


# -- the replicas' load, for the gateways' /metrics ------------------------------------


class Board:
    """Where every replica reports its load each second, and every gateway reads it: calls are
    routed to replicas at random, so a gateway cannot ask each one itself."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, dict[str, Any]]] = {}

    def report(self, replica: str, load: dict[str, Any]) -> None:
        self.reports[replica] = (time.monotonic(), load)

    def read(self, max_age: float) -> list[dict[str, Any]]:
        """The latest reports of replicas heard from within `max_age` s (the others are gone)."""
        now = time.monotonic()
        self.reports = {r: (at, load) for r, (at, load) in self.reports.items() if now - at <= max_age}
        return [load for _, load in self.reports.values()]


def _board() -> Any:
    import ray

    # Detached and shared: it outlives any one gateway, and replicas deployed without one find it
    # too; on the head node (not a gateway's, which may go) and restarted if it dies anyway.
    return ray.remote(Board).options(
        name=BOARD, namespace=NAMESPACE, get_if_exists=True, lifetime="detached", num_cpus=0, max_restarts=-1,
        resources={"node:__internal_head__": 0.001},
    ).remote()


# -- the replica: runs in a Ray actor --------------------------------------------------


class Replica:
    """One Serve replica: a local backend whose jobs stream their frames to the gateway that called."""

    async def __init__(self, settings: bytes, paths: list[str]) -> None:
        from ray import serve

        from backends.local import from_settings
        from gateway.encoding import to_msgpack

        for path in paths:  # where the gateway found `--tools` modules, when this machine has it too
            if os.path.isdir(path) and path not in sys.path:
                sys.path.insert(0, path)
        self.settings = msgspec.json.decode(settings, type=Settings)
        self.limits = self.settings.limits()
        self.name = serve.get_replica_context().replica_tag
        # As the replica's own environment says (a local Ray's workers have the gateway's).
        tracing.configure("streamgate-replica", **{"streamgate.replica": self.name})
        # Results come back through the replica's stream: files stay where no gateway could fetch them.
        self.backend = from_settings(self.settings, encode=to_msgpack, result_files=None)
        self.admission = Admission(self.backend, self.limits)
        await self.backend.start()
        # Serve counts the replica as up once its constructor returns: only when the model is.
        while not self.backend.ready:
            if self.backend.error is not None:
                raise RuntimeError(f"the model did not load: {self.backend.error}")
            await asyncio.sleep(0.05)
        self._reporting = asyncio.create_task(self._report())

    async def _report(self) -> None:
        board = _board()
        while True:
            try:
                await board.report.remote(self.name, await self.stats())
            except Exception:  # noqa: BLE001 - a report lost is the next one's to make, to the board as it is now
                with contextlib.suppress(Exception):
                    board = _board()
            await asyncio.sleep(POLL_S)

    async def check_health(self) -> None:
        """Serve's health check: a replica whose device failed is replaced."""
        if not self.backend.ready:
            raise RuntimeError(self.backend.not_ready_reason)

    async def tools(self) -> bytes:
        return encode(params_mod.describe(self.backend.tools.values(), self.limits, self.backend.unsupported))

    async def models(self) -> bytes:
        return encode(self.backend.models())

    async def stats(self) -> dict[str, Any]:
        """This replica's name, its jobs queued and in flight, and its batch sizes so far."""
        sizes: dict[int, int] = {}
        for counts in self.backend.batch_size_counts():
            for size, n in counts.items():
                sizes[size] = sizes.get(size, 0) + n
        queued = sum(len(served.queue) for served in self.backend.served.values())
        return {"replica": self.name, "queued": queued, "jobs": self.backend.in_flight, "batch_sizes": sizes}

    async def run(
        self, tool_name: str, params: msgspec.Raw, job_id: str, tenant: str = "", weight: float = 1.0,
        query: list[tuple[str, str]] | None = None, model: str | None = None, traceparent: str | None = None,
        priority: int = 0, timeout: float | None = None,
    ) -> AsyncIterator[bytes]:
        """Run one job, queued as the gateway's `tenant` with its `weight` and its class's `priority`; its
        Dispatch, frames and result.
        The params come as the gateway's client sent them (`SubmitRequest` says how), decoded here; its
        spans here join the trace of the gateway's job that `traceparent` names."""
        try:
            tool = self.backend.tool(tool_name)
            decoded = await params_mod.decode_relayed(tool, bytes(params), query, model, "the body")
            with tracing.continued(traceparent):
                job = await self.admission.admit(tool, decoded, Applicant(tenant, weight, priority=priority, timeout=timeout), job_id=job_id)
        except ApiError as exc:
            yield encode(Dispatch(error=exc.info(), status=exc.status, retry_after=exc.retry_after))
            return
        yield encode(Dispatch(replica=self.name))
        seen = 0
        try:
            while True:
                for event in await job.wait_events(seen):
                    seen = event.seq
                    yield encode(remote_frame(event, usage=job.usage))
                    if event.type is EventType.DATA:
                        yield event.data  # the msgpack result, through the object store
                if job.terminal is not None and seen >= job.terminal.seq:
                    return
        finally:
            if not job.done:  # the call was cancelled: stop the work at its next step
                self.backend.cancel(job)


# -- the gateway's side -----------------------------------------------------------------


class RayBackend(Relaying):
    """Runs jobs on the replicas of the `streamgate` Serve application."""

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.settings = settings
        self._handle: Any = None
        self._replicas: dict[str, int] = {}  # replicas in each state (RUNNING, STARTING, …), from Serve
        self._load: list[dict[str, Any]] = []  # each live replica's last report
        self._problem = "connecting to Ray"
        self._calls: dict[str, Any] = {}  # job id -> its streaming call
        self._tasks: set[asyncio.Task[Any]] = set()
        self._main: asyncio.Task[None] | None = None
        self._ray_thread: threading.Thread | None = None
        self._leave = threading.Event()
        self._joined_ray = False  # this process called ray.init: it shuts Ray down (or leaves the cluster)

    # -- what the gateway asks -----------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._handle is not None and bool(self._tools) and self._replicas.get("RUNNING", 0) > 0

    def models(self) -> list[ModelInfo]:
        # Learned once; whether they can run now is the application's state now.
        ready = self.ready
        return [
            msgspec.structs.replace(m, ready=ready, problem=None if ready else self.not_ready_reason) for m in self._models
        ]

    @property
    def not_ready_reason(self) -> str:
        if self._handle is not None and not self._replicas.get("RUNNING"):
            states = ", ".join(f"{n} {state.lower()}" for state, n in sorted(self._replicas.items()) if n) or "none yet"
            return f"no Ray Serve replica is up (replicas: {states})"
        return self._problem

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    def describe(self) -> dict[str, Any]:
        load = [{"replica": r["replica"], "jobs": r["jobs"], "queued": r["queued"]} for r in self._load]
        return {"backend": "ray", "replicas": dict(sorted(self._replicas.items())), "replica_load": load}

    def batch_size_counts(self) -> list[Mapping[int, int]]:
        return [report["batch_sizes"] for report in self._load]

    # -- start-up: connect, deploy (or attach), then watch -----------------------------

    async def start(self) -> None:
        if not ray_available():
            raise RuntimeError(INSTALL_HINT)
        self._main = asyncio.create_task(self._watch(), name="ray backend")

    async def stop(self) -> None:
        for call in list(self._calls.values()):
            with contextlib.suppress(Exception):
                call.cancel()
        for job_id in list(self._calls):
            self._calls.pop(job_id, None)
        if self._main is not None:
            self._main.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._main
        for task in list(self._tasks):
            task.cancel()
        self._leave.set()
        if self._ray_thread is not None:
            await asyncio.to_thread(self._ray_thread.join, 15)

    async def _watch(self) -> None:
        try:
            self._handle = await self._connect()
        except Exception as exc:  # noqa: BLE001 - any start-up failure is the reason we are not ready
            self._problem = f"Ray Serve did not start: {exc}"
            log.error("%s", self._problem)
            return
        board = await asyncio.to_thread(_board)
        while True:
            try:
                self._replicas = await asyncio.to_thread(_replica_states)
                self._load = await board.read.remote(3 * POLL_S)
                if not self._tools and self._replicas.get("RUNNING"):
                    infos = msgspec.json.decode(await self._handle.tools.remote(), type=list[ToolInfo])
                    # Every replica serves every model: queue figures are one replica's, not kept.
                    models = [
                        msgspec.structs.replace(m, queued=0, running=0)
                        for m in msgspec.json.decode(await self._handle.models.remote(), type=list[ModelInfo])
                    ]
                    self.learn(infos, models)
            except Exception as exc:  # noqa: BLE001 - Ray's errors are many; say it and try again
                self._problem = f"cannot read the Serve application's state: {exc}"
                log.warning("%s", self._problem)
            await asyncio.sleep(POLL_S)

    async def _connect(self) -> Any:
        """Connect and deploy on a thread of the backend's own, which stays until the backend stops:
        Ray ties the processes of a local instance it starts to the thread that started them, and
        a pool's thread may end. The same thread shuts Ray down at the end."""
        loop = asyncio.get_running_loop()
        connected: asyncio.Future[Any] = loop.create_future()

        def settle(handle: Any, error: BaseException | None) -> None:
            if not connected.done():
                connected.set_exception(error) if error is not None else connected.set_result(handle)

        def hold() -> None:
            try:
                handle = self._deploy()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
                loop.call_soon_threadsafe(settle, None, exc)
                return
            loop.call_soon_threadsafe(settle, handle, None)
            self._leave.wait()
            if self._joined_ray:
                import ray

                with contextlib.suppress(Exception):
                    ray.shutdown()

        self._ray_thread = threading.Thread(target=hold, name="streamgate-ray", daemon=True)
        self._ray_thread.start()
        return await connected

    def _deploy(self) -> Any:
        """Connect to (or start) Ray, and deploy the application unless it runs already; its handle."""
        import ray
        from ray import serve

        settings = self.settings
        if not ray.is_initialized():
            ray.init(
                address=settings.ray_address or None,  # None: join a local cluster, or start one; "local": start one
                namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
            )
            self._joined_ray = True
        # No Serve HTTP proxy: gateways call the replicas through handles (and its default port,
        # 8000, is the gateway's own).
        serve.start(proxy_location="Disabled")
        try:
            return serve.get_app_handle(APP_NAME)  # attach, by name: another gateway deployed it
        except Exception:  # noqa: BLE001 - Serve raises a plain exception when the app does not exist
            pass
        app = application(settings, [os.getcwd()])
        return serve.run(app, name=APP_NAME, route_prefix=None, blocking=False)

    # -- jobs ------------------------------------------------------------------------------

    async def submit(self, job: Job) -> None:
        tool = self.tool(job.tool)
        # Only when traced: a replica deployed by an older gateway takes no `traceparent`.
        traced = {"traceparent": value} if (value := tracing.traceparent(job.span)) else {}
        # Nor a class's priority or timeout (a gateway without classes sends neither).
        classed = {k: v for k, v in (("priority", job.priority), ("timeout", job.timeout)) if v}
        call = self._handle.options(stream=True).run.remote(
            tool.name, job_id=job.id, tenant=job.tenant, weight=job.weight, **sent(job.params), **traced, **classed
        )
        try:
            dispatch = msgspec.json.decode(await call.__anext__(), type=Dispatch)
        except Exception as exc:  # noqa: BLE001 - the replica died, or Ray could not place the call
            raise ApiError(Code.NOT_READY, f"no Ray Serve replica took the job: {exc}", retry_after=5) from None
        if dispatch.error is not None:
            error = dispatch.error
            raise ApiError(
                error.code, error.message, field=error.field, status=dispatch.status, retryable=error.retryable,
                retry_after=dispatch.retry_after,
            )
        job.set_status(Status.DISPATCHED, message=f"replica {dispatch.replica}")
        self._calls[job.id] = call
        task = asyncio.create_task(self._follow(job, call), name=f"ray job {job.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _follow(self, job: Job, call: Any) -> None:
        try:
            async for item in call:
                frame = msgspec.json.decode(item, type=RemoteFrame)
                if frame.usage is not None:  # a terminal frame's: counted in the replica
                    job.usage.add(frame.usage)
                if frame.kind is RemoteKind.COMPLETED:
                    result = await call.__anext__()
                    job.succeed(await asyncio.to_thread(as_json, result))
                    return
                if frame.kind is RemoteKind.ERROR:
                    job.fail(*failure(frame))
                    return
                relay(job, frame)
            if not job.done:
                job.fail(Code.BACKEND_UNAVAILABLE, "the replica ended the job's stream without its end")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a replica that died, or any failure of the call
            if not job.done:
                log.warning("job %s: its Ray Serve replica failed: %s", job.id, exc)
                job.fail(Code.BACKEND_UNAVAILABLE, "the replica running the job stopped; try again")
        finally:
            self._calls.pop(job.id, None)

    def cancel(self, job: Job) -> None:
        job.cancel()
        call = self._calls.pop(job.id, None)
        if call is not None:
            call.cancel()
        job.fail(Code.CANCELLED, "the job was cancelled")


def application(settings: Settings, paths: list[str]) -> Any:
    """The application of `Replica`s these settings describe, unnamed (serve.run or a config names it)."""
    import ray
    from ray import serve

    gpus = settings.ray_gpus_per_replica
    if gpus is None:
        gpus = 1 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1 else 0
    options: dict[str, Any] = {
        "name": DEPLOYMENT,
        "ray_actor_options": {"num_cpus": settings.ray_cpus_per_replica, "num_gpus": gpus},
        # A replica takes as many jobs as its queue and one batch hold: batching happens inside it.
        "max_ongoing_requests": settings.queue_size + settings.max_batch_size,
        "health_check_period_s": 2,
    }
    if settings.ray_min_replicas is not None or settings.ray_max_replicas is not None:
        low = settings.ray_min_replicas if settings.ray_min_replicas is not None else 1
        options["autoscaling_config"] = {
            "min_replicas": low,
            "max_replicas": settings.ray_max_replicas if settings.ray_max_replicas is not None else max(low, 1),
            "target_ongoing_requests": settings.max_batch_size,
        }
    else:
        options["num_replicas"] = settings.ray_replicas or 1
    replica_settings = msgspec.structs.replace(settings, device=None if gpus else "cpu", devices=[])
    return serve.deployment(Replica).options(**options).bind(encode(replica_settings), paths)


def _replica_states() -> dict[str, int]:
    """How many replicas of the deployment are in each state (RUNNING, STARTING, …), from Serve."""
    from ray import serve

    status = serve.status()
    app = status.applications.get(APP_NAME)
    if app is None:
        return {}
    deployment = app.deployments.get(DEPLOYMENT)
    if deployment is None:
        return {}
    return {str(getattr(state, "value", state)): n for state, n in (deployment.replica_states or {}).items()}

