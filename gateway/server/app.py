"""The HTTP service: routes, thin around the admission every job passes (gateway/admission.py).

`POST /{tool}/run` (and the `GET` form for `EventSource`) answers either an
ordinary HTTP error with the protocol's JSON body, or `200` and the job's event
stream. Every check that can fail runs before the stream opens: here the token, the
tool's name and the stream slot, then admission's (params, readiness, the model's
checks, the job's price, the queue). Every job and stream counts against its tenant
(gateway/tenants.py): the token's name, or without tokens the client's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gateway.plumbing import memory
from gateway.backend import Backend
from gateway import params as params_mod
from gateway import checkpoints, tenants
from gateway.admission import Admission, Applicant, Attached
from gateway.cost import inline_only
from gateway.server.auth import Auth, Principal, load_principals
from gateway.config import Settings
from gateway.plumbing.drain import Drain, on_sigterm
from gateway.errors import ApiError, api_error_handler, http_error_handler
from gateway.jobs import Job
from gateway.plumbing import tracing
from gateway.plumbing.logs import RequestIds, request_id_headers
from gateway.plumbing.metrics import Metrics
from gateway.protocol import Code, Kept, encode, parse_event_id, splice
from gateway.plumbing.sendbuffer import WholeResponse
from gateway.plumbing.spool import ResultSpool
from gateway.server.results import file_response, result_response
from gateway.server.store import JobHandle, JobStore, MemoryStore, jobs_query
from gateway.tools.base import Tool
from gateway.server.stream import Slot, Streams, job_response

log = logging.getLogger("streamgate.app")

# The dashboard, built from web/ and shipped as package data.
STATIC = Path(__file__).parent.parent / "static"


class _Assets(StaticFiles):
    """The dashboard's files, revalidated on every load so a new build is never served stale."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


async def dashboard(request: Request) -> Response:
    index = STATIC / "index.html"
    if not index.is_file():
        raise ApiError(Code.NOT_FOUND, "the dashboard is not built: run `npm run build:dashboard` in web/")
    return FileResponse(index, headers={"Cache-Control": "no-cache"})


def _last_event_id(request: Request) -> tuple[str, int] | None:
    """`Last-Event-ID` (header, or `last_event_id` query key) as (job id, seq)."""
    value = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    if value is None:
        return None
    parsed = parse_event_id(value)
    if parsed is None:
        raise ApiError(Code.BAD_REQUEST, f"Last-Event-ID {value!r} is not of the form <job_id>:<seq>")
    return parsed


def _cors(origins: list[str]) -> list[Middleware]:
    """Cross-origin access for the listed origins only (none by default): browsers elsewhere get no CORS headers."""
    if not origins:
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST", "DELETE"],
            # traceparent and tracestate: a page's own tracing continues into the gateway's spans; the
            # Mcp-* ones are what a browser's MCP client sends to /mcp (the 2025 handshake's and the
            # 2026 envelope's), without which its preflight fails.
            allow_headers=[
                "Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID", "X-Request-Id", "traceparent", "tracestate",
                "Mcp-Session-Id", "MCP-Protocol-Version", "Mcp-Method", "Mcp-Name",
            ],
            # A page elsewhere reads these from a run's response (fetch hides the rest).
            expose_headers=["X-Job-Id", "X-Request-Id", "Retry-After", "Mcp-Session-Id"],
            max_age=600,
        )
    ]


def open_store(settings: Settings, cancel: Any) -> JobStore:
    """The job store `settings.store` names: `memory`, or a Redis URL shared by every replica."""
    results = ResultSpool(settings.result_spool, settings.result_store_bytes, retention=settings.retention)
    if settings.store == "memory":
        return MemoryStore(
            cancel, detach_grace=settings.detach_grace, retention=settings.retention,
            results=results, memory_budget=settings.result_memory_bytes,
        )
    from gateway.server.redis_store import RedisStore

    return RedisStore(
        settings.store,
        cancel,
        detach_grace=settings.detach_grace,
        retention=settings.retention,
        outage_grace=settings.store_outage_grace,
        results=results,
        memory_budget=settings.result_memory_bytes,
        checkpoints=checkpoints.lasting_folder(settings.result_spool, settings.store),
    )


def create_app(backend: Backend, settings: Settings | None = None) -> Starlette:
    settings = settings or Settings()
    limits = settings.limits()
    store = open_store(settings, lambda job: backend.cancel(job))
    metrics = Metrics(backend)
    metrics.results(store.results_kept)
    auth = Auth(
        load_principals(
            settings.tokens_file,
            settings.tokens,
            max_concurrent=settings.max_concurrent_per_token,
            jobs_per_minute=settings.jobs_per_minute_per_token,
        ),
        ticket_ttl=settings.ticket_ttl,
    )
    drain = Drain(settings.drain_timeout)
    admission = Admission(
        backend, limits, drain=drain, store=store, quota=auth.limits, metrics=metrics, room=getattr(store, "results", None)
    )
    streams = Streams(settings.max_streams, settings.max_streams_per_owner)
    # A job another replica ran until it stopped goes on here, admitted as any other (a shared store's).
    store.takes_over(admission, lambda: backend.ready and not drain.draining)

    def follow(job: JobHandle, slot: Slot, after: int = 0) -> Response:
        return job_response(
            job,
            backend,
            store,
            metrics=metrics,
            slot=slot,
            ping_interval=settings.ping_interval,
            retry_ms=settings.retry_ms,
            after=after,
            write_timeout=settings.write_timeout,
        )

    async def run(request: Request) -> Response:
        principal = auth.authenticate(request)
        tool = backend.tool(request.path_params["tool"])
        auth.authorize(principal, tool.name)
        with streams.slot(tenants.tenant(principal, request)) as slot:
            return await _run(request, principal, tool, slot)

    async def _run(request: Request, principal: Principal | None, tool: Tool, slot: Slot) -> Response:
        resumed = _last_event_id(request)
        if resumed is not None and (request.method == "GET" or not request.headers.get("idempotency-key")):
            # A client reconnecting to the URL it first opened: an EventSource (GET), or a POST sent
            # again by a retrying client (fetch-event-source sends Last-Event-ID, no key). The same job.
            job = await _job(resumed[0], principal, to_follow=True)
            if (its_tool := job.snapshot(kept=[]).tool) != tool.name:
                raise ApiError(
                    Code.BAD_REQUEST,
                    f"Last-Event-ID {resumed[0]}:{resumed[1]} is an event of a {its_tool} job, not of {tool.name}",
                )
            return _resume(job, slot, resumed[1])
        admission.refuse_if_draining()  # before reading a request that would be refused anyway
        if request.method == "POST":
            body = await params_mod.read_body(request, settings.max_body_bytes, settings.body_timeout, metrics.client_timeout)
            params = await admission.decode(tool, body)
        else:
            params = admission.decode_query(tool, request.query_params)
        admitted = await admission.admit_once(
            tool, params, Applicant.of(principal, tenants.tenant(principal, request)), key=request.headers.get("idempotency-key") or None
        )
        if isinstance(admitted, Attached):
            # The same request again (a client replaying its POST): attach to the job it started.
            after = resumed[1] if resumed is not None and resumed[0] == admitted.job_id else 0
            return _resume(await _job(admitted.job_id, principal, to_follow=True), slot, after)
        return follow(await store.followed(admitted), slot)

    async def launch(request: Request, tool_name: str, params: Any) -> Job:
        """Start a job of `tool_name` with `params` (its Struct) for another surface (the OpenAI routes):
        the same admission as a run of `POST /{tool}/run`."""
        principal = auth.authenticate(request)
        tool = backend.tool(tool_name)
        auth.authorize(principal, tool.name)
        inline = inline_only.set(True)  # its answer is made of the result: refused (413) rather than written as files
        try:
            return await admission.admit(tool, params, Applicant.of(principal, tenants.tenant(principal, request)))
        finally:
            inline_only.reset(inline)

    async def _job(job_id: str, principal: Principal | None, *, to_follow: bool = False) -> JobHandle:
        job = await store.get(job_id, to_follow=to_follow)
        # Another token's job is answered as an unknown one: its existence is not the caller's to learn.
        if job is None or not auth.sees(principal, job.snapshot(kept=[]).owner):
            raise ApiError(Code.NOT_FOUND, f"no job {job_id} (unknown, or finished more than {settings.retention:g} s ago)")
        return job

    def _resume(job: JobHandle, slot: Slot, after: int) -> Response:
        if job.terminal is not None and after >= job.terminal.seq:
            # The client holds the terminal event: 204 stops an EventSource for good.
            return Response(status_code=204, headers={"X-Job-Id": job.id})
        return follow(job, slot, after)

    async def job_events(request: Request) -> Response:
        principal = auth.authenticate(request)
        with streams.slot(tenants.tenant(principal, request)) as slot:
            return await _job_events(request, principal, slot)

    async def _job_events(request: Request, principal: Principal | None, slot: Slot) -> Response:
        job = await _job(request.path_params["job_id"], principal, to_follow=True)
        resumed = _last_event_id(request)
        if resumed is not None and resumed[0] != job.id:
            raise ApiError(Code.BAD_REQUEST, f"Last-Event-ID {resumed[0]}:{resumed[1]} is not an event of job {job.id}")
        return _resume(job, slot, resumed[1] if resumed else 0)

    # How a whole answer is sent (gateway/plumbing/sendbuffer.py): a client that stops reading is cut.
    sending = {"send_timeout": settings.write_timeout, "on_write_timeout": lambda: metrics.client_timeout("write")}

    def whole(body: bytes, kept: list[Kept]) -> Response:
        """A JSON answer that may carry results (a snapshot, a page of them): big, it is sent as a
        stream's big event is, and a result in the spool is read from it a piece at a time."""
        return WholeResponse(splice(body, kept), **sending)

    async def job_snapshot(request: Request) -> Response:
        job = await _job(request.path_params["job_id"], auth.authenticate(request))
        kept: list[Kept] = []
        return whole(encode(job.snapshot(kept)), kept)

    async def job_result(request: Request) -> Response:
        job = await _job(request.path_params["job_id"], auth.authenticate(request))
        return result_response(job, request.headers.get("range"), request.headers.get("if-range"), **sending)

    async def job_file(request: Request) -> Response:
        job = await _job(request.path_params["job_id"], auth.authenticate(request))
        name = request.path_params["name"]
        return file_response(job, name, request.headers.get("range"), request.headers.get("if-range"), **sending)

    async def cancel_job(request: Request) -> Response:
        job = await _job(request.path_params["job_id"], auth.authenticate(request))
        running = not job.done
        if running:
            await store.cancel(job)
        return JSONResponse({"job_id": job.id, "cancelled": running, "status": job.snapshot(kept=[]).status})

    async def list_jobs(request: Request) -> Response:
        principal = auth.authenticate(request)
        query = jobs_query(request)
        kept: list[Kept] = []
        mine = [s for s in await store.snapshots(kept) if auth.sees(principal, s.owner) and query.wants(s)]
        return whole(encode(query.page(mine)), kept)

    async def ticket(request: Request) -> Response:
        principal = auth.authenticate(request)
        if principal is None:
            raise ApiError(Code.NOT_FOUND, "this gateway has no tokens configured: GET streams need no ticket")
        value, ttl = auth.issue_ticket(principal)
        return JSONResponse({"ticket": value, "expires_in": ttl}, headers={"Cache-Control": "no-store"})

    described: list[object] = [None, b""]  # the tools and model last described, and their JSON
    per_model: dict[tuple[object, str | None], bytes] = {}  # `GET /tools?model=`, by tools version and model

    async def tools(request: Request) -> Response:
        """The tools, and which of them the default model (or `?model=NAME`) cannot run."""
        model = request.query_params.get("model")
        if model is not None:
            name = backend.resolve_model(model)
            key = (backend.tools_version, name)
            if key not in per_model:
                per_model.clear()  # one version's answers at a time
                info = params_mod.describe(backend.tools.values(), limits, lambda t: backend.unsupported(t, name))
                per_model[key] = encode(info)
            return Response(per_model[key], media_type="application/json")
        # A remote backend learns its tools after start-up, a local one its model's capabilities: describe each once.
        if described[0] != backend.tools_version:
            info = params_mod.describe(backend.tools.values(), limits, backend.unsupported)
            described[:] = [backend.tools_version, encode(info)]
        return Response(described[1], media_type="application/json")

    async def models(request: Request) -> Response:
        return Response(encode(backend.model_list()), media_type="application/json")

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        store_problem = getattr(store, "problem", None)
        ready = backend.ready and store_problem is None and not drain.draining
        body = {"ready": ready, **backend.describe()}
        if drain.draining:
            body["reason"] = "shutting down"
        elif not backend.ready:
            body["reason"] = backend.not_ready_reason
        elif store_problem is not None:
            body["reason"] = store_problem
        return JSONResponse(body, status_code=200 if ready else 503)


    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return ApiError(Code.INTERNAL, "internal error", headers=request_id_headers()).response()

    async def stop_jobs() -> None:
        """The drain's end: jobs that can go on in another replica are left to it, the rest stopped."""
        await store.hand_off()
        await backend.stop()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await backend.start()
        await store.start()
        # What is loaded by now (modules, routes, a remote backend's clients) lives as long as the
        # process: out of the collector's full passes, which walked it all and held the loop.
        memory.settle()
        on_sigterm(drain, lambda: backend.in_flight, stop_jobs)
        watcher = asyncio.create_task(streams.watch(), name="streams' watcher")
        try:
            async with agents.running():
                yield
        finally:
            watcher.cancel()
            await store.stop()
            await backend.stop()

    from gateway.server.apidocs import endpoint as api_docs
    from gateway.server.openapi import endpoint as openapi_json

    from gateway.server import openai

    compatible = openai.Surface(
        backend=backend,
        authenticate=auth.authenticate,
        tenant=tenants.tenant,
        launch=launch,
        cancel=store.cancel,
        streams=streams,
        metrics=metrics,
        read_body=lambda request: params_mod.read_body(
            request, settings.max_body_bytes, settings.body_timeout, metrics.client_timeout
        ),
        ping_interval=settings.ping_interval,
        write_timeout=settings.write_timeout,
        max_tokens=settings.max_tokens,
    )
    from gateway.server import mcp

    agents = mcp.McpServer(
        mcp.Surface(
            backend=backend,
            admission=admission,
            auth=auth,
            store=store,
            streams=streams,
            metrics=metrics,
            limits=limits,
            max_body_bytes=settings.max_body_bytes,
            body_timeout=settings.body_timeout,
            write_timeout=settings.write_timeout,
            retention=settings.retention,
            origins=settings.cors_origins,
        )
    )
    openapi_document = openapi_json(backend, limits, secured=auth.enabled)
    app = Starlette(
        routes=[
            Route("/openapi.json", openapi_document, methods=["GET"]),
            Route("/docs", api_docs(openapi_document), methods=["GET"]),
            Route("/tools", tools, methods=["GET"]),
            Route("/models", models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics.endpoint, methods=["GET"]),
            Route("/{tool}/run", run, methods=["GET", "POST"]),
            Route("/jobs", list_jobs, methods=["GET"]),
            Route("/jobs/{job_id}", job_snapshot, methods=["GET"]),
            Route("/jobs/{job_id}", cancel_job, methods=["DELETE"]),
            Route("/jobs/{job_id}/events", job_events, methods=["GET"]),
            Route("/jobs/{job_id}/result", job_result, methods=["GET"]),
            Route("/jobs/{job_id}/files/{name}", job_file, methods=["GET"]),
            Route("/auth/ticket", ticket, methods=["POST"]),
            *openai.routes(compatible),
            Route("/mcp", agents, methods=["POST"]),
            Route("/", dashboard, methods=["GET"]),
            Mount("/assets", _Assets(directory=STATIC / "assets", check_dir=False), name="assets"),
        ],
        exception_handlers={
            ApiError: api_error_handler,
            HTTPException: http_error_handler,
            Exception: unexpected,
        },
        lifespan=lifespan,
        middleware=_cors(settings.cors_origins),
    )
    app.state.auth = auth
    app.state.drain = drain
    app.state.backend = backend
    app.state.settings = settings
    app.state.store = store
    app.state.metrics = metrics
    app.state.mcp = agents
    if tracing.enabled():  # without tracing, not even a pass through it
        app.add_middleware(tracing.RequestSpans)
    # Added last, so it wraps the other middleware (CORS included): every answer carries X-Request-Id.
    app.add_middleware(RequestIds)
    return app
