"""The gateway as one object: the parts every surface shares, the one way a request enters, and
the routes' handlers.

`Gateway` owns the job store, auth, admission, streams, metrics and the drain. Every surface
(`POST /{tool}/run`, the OpenAI routes of gateway/server/openai.py, `/mcp` of
gateway/server/mcp.py) takes the gateway itself, and starts a job the same way:

1. `caller(request)`: the token (401 without a good one) and the tenant it counts against
   (gateway/tenants.py);
2. a stream slot of that tenant (gateway/server/stream.py `Streams`), held for the answer;
3. `enter(caller, tool, params)`: the tool by name (404), the token's right to it (403), the
   params read (the body, decoded on the parsing thread when big), then admission
   (gateway/admission.py), which prices and queues the job.

`POST /{tool}/run` answers either an ordinary HTTP error with the protocol's JSON body, or
`200` and the job's event stream: every check that can fail runs before the stream opens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import checkpoints, tenants
from gateway import params as params_mod
from gateway.admission import Admission, Applicant, Attached
from gateway.backend import Backend
from gateway.config import Settings
from gateway.cost import inline_only
from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.plumbing.drain import Drain
from gateway.plumbing.metrics import Metrics
from gateway.plumbing.sendbuffer import WholeResponse
from gateway.plumbing.spool import ResultSpool
from gateway.protocol import Code, Kept, encode, parse_event_id, splice
from gateway.server.auth import Auth, AuthConfigError, Principal, load_access
from gateway.server.signin import Issuer, IssuerConfigError
from gateway.server import webhooks
from gateway.server.webhooks import Webhooks
from gateway.server.metering import MAX_USAGE_ROWS, USAGE_KEYS, Ledger, Meter, Row, summed
from gateway.server.openapi import Allowance, Me, UsageReport
from gateway.server.results import file_response, result_response
from gateway.server.store import JobHandle, JobStore, MemoryStore, jobs_query
from gateway.server.stream import Slot, Streams, job_response
from gateway.tools.base import Tool


@dataclass(frozen=True)
class Caller:
    """Who makes a request: the token (None without tokens) and the tenant it counts against."""

    principal: Principal | None
    tenant: str

    @property
    def applicant(self) -> Applicant:
        return Applicant.of(self.principal, self.tenant)


def open_store(settings: Settings, cancel: Any) -> JobStore:
    """The job store `settings.store` names: `memory`, or a Redis URL shared by every replica."""
    results = ResultSpool(settings.result_spool, settings.result_store_bytes, retention=settings.retention)
    if settings.store == "memory":
        return MemoryStore(
            cancel, detach_grace=settings.detach_grace, retention=settings.retention,
            results=results, memory_budget=settings.result_memory_bytes, max_finished=settings.max_finished_jobs,
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


def _issuer(settings: Settings) -> Issuer | None:
    """The OpenID Connect issuer whose JWTs sign users in (gateway/server/signin.py), if one is set."""
    if settings.oidc_issuer is None:
        if settings.oidc_audience is not None or settings.oidc_jwks_url is not None:
            raise AuthConfigError("--oidc-audience and --oidc-jwks-url need --oidc-issuer")
        return None
    try:
        return Issuer(
            settings.oidc_issuer, settings.oidc_audience, jwks_url=settings.oidc_jwks_url, tenant_claim=settings.oidc_tenant_claim,
            groups_claim=settings.oidc_groups_claim, algorithms=settings.oidc_algorithms, refresh_s=settings.oidc_jwks_refresh,
        )
    except IssuerConfigError as exc:
        raise AuthConfigError(str(exc)) from None


def _ledger(settings: Settings) -> Ledger | None:
    """Where the meter keeps what jobs used: Redis with the Redis store (shared, and kept across restarts)."""
    if settings.store == "memory":
        return None
    from gateway.server.redis_store.ledger import RedisLedger

    return RedisLedger(settings.store)


def _webhooks(settings: Settings) -> Webhooks:
    """Completion webhooks, their deliveries kept in Redis with the Redis store (delivered across restarts)."""
    outbox = None
    if settings.store != "memory" and settings.webhook_secret:
        from gateway.server.redis_store.outbox import RedisOutbox

        outbox = RedisOutbox(settings.store, settings.retention)
    return Webhooks(
        settings.webhook_secret, settings.callback_hosts, attempts=settings.webhook_attempts, timeout=settings.webhook_timeout,
        outbox=outbox, retention=settings.retention, per_tenant=settings.webhooks_per_tenant,
    )


def _last_event_id(request: Request) -> tuple[str, int] | None:
    """`Last-Event-ID` (header, or `last_event_id` query key) as (job id, seq)."""
    # The query string parsed only if there is one: most requests have none.
    value = request.headers.get("last-event-id") or (request.query_params.get("last_event_id") if request.scope["query_string"] else None)
    if value is None:
        return None
    parsed = parse_event_id(value)
    if parsed is None:
        raise ApiError(Code.BAD_REQUEST, f"Last-Event-ID {value!r} is not of the form <job_id>:<seq>")
    return parsed


class Gateway:
    """One gateway over one backend: its parts, the way in, and the handlers of its own routes."""

    def __init__(self, backend: Backend, settings: Settings | None = None) -> None:
        self.backend = backend
        self.settings = settings = settings or Settings()
        self.limits = settings.limits()
        self.store = open_store(settings, lambda job: backend.cancel(job))
        self.metrics = Metrics(backend)
        self.metrics.results(self.store.results_kept)
        access = load_access(
            settings.tokens_file, settings.tokens,
            max_concurrent=settings.max_concurrent_per_token, jobs_per_minute=settings.jobs_per_minute_per_token,
        )
        self.auth = Auth(
            access.principals,
            ticket_ttl=settings.ticket_ttl,
            issuer=_issuer(settings),
            max_concurrent=settings.max_concurrent_per_token,
            jobs_per_minute=settings.jobs_per_minute_per_token,
            classes=access.classes,
        )
        self.drain = Drain(settings.drain_timeout)
        self.meter = Meter(_ledger(settings))
        self.metrics.usage(self.meter.counted)
        self.webhooks = _webhooks(settings)
        self.admission = Admission(
            backend, self.limits, drain=self.drain, store=self.store, quota=self.auth.limits, metrics=self.metrics,
            room=getattr(self.store, "results", None), meter=self.meter, webhooks=self.webhooks,
        )
        self.streams = Streams(settings.max_streams, settings.max_streams_per_owner)
        # A job another replica ran until it stopped goes on here, admitted as any other (a shared store's).
        self.store.takes_over(self.admission, lambda: backend.ready and not self.drain.draining, self.webhooks)
        if getattr(self.webhooks.outbox, "shared", False):
            self.webhooks.look = self.store.get
        # How a whole answer is sent (gateway/plumbing/sendbuffer.py): a client that stops reading is cut.
        self.sending: dict[str, Any] = {
            "send_timeout": settings.write_timeout, "on_write_timeout": lambda: self.metrics.client_timeout("write"),
        }
        self._described: tuple[object, bytes] = (None, b"")  # the tools and model last described, and their JSON
        self._per_model: dict[tuple[object, str | None], bytes] = {}  # `GET /tools?model=`, by tools version and model

    # -- the way in ------------------------------------------------------------------------------

    async def caller(self, request: Request) -> Caller:
        """The request's token (401) and the tenant it counts against."""
        principal = await self.auth.authenticate(request)
        return Caller(principal, tenants.tenant(principal, request))

    def tool(self, caller: Caller, name: str) -> Tool:
        """The tool `name` (404), if the caller's token may use it (403)."""
        tool = self.backend.tool(name)
        self.auth.authorize(caller.principal, tool.name)
        return tool

    async def read_body(self, request: Request, extra: int = 0) -> bytes:
        """A request's body, within the run's limits (413 past --max-body-bytes and `extra`, 408 past --body-timeout)."""
        settings = self.settings
        return await params_mod.read_body(request, settings.max_body_bytes + extra, settings.body_timeout, self.metrics.client_timeout)

    async def enter(
        self, caller: Caller, tool_name: str, params: Callable[[Tool], Awaitable[Any]], *, key: str | None = None,
        most_result: int | None = None, inline: bool = False, callback: str | None = None,
    ) -> Job | Attached:
        """A job of the tool named `tool_name` for `caller`, with the params `params(tool)` reads, as
        every surface starts one: the tool (404) and the caller's right to it (403), then admission.
        `key`: the request's `Idempotency-Key` (the job it started again: `Attached`); `most_result`:
        the most bytes of result the surface answers with; `inline`: the surface answers with the
        result itself, never files; `callback`: its `Callback-URL`."""
        tool = self.tool(caller, tool_name)
        decoded = await params(tool)
        token = inline_only.set(True) if inline else None
        try:
            return await self.admission.admit_once(tool, decoded, caller.applicant, key, most_result=most_result, callback=callback)
        finally:
            if token is not None:
                inline_only.reset(token)

    async def cancel(self, job: JobHandle) -> None:
        await self.store.cancel(job)

    # -- runs and jobs ---------------------------------------------------------------------------

    def follow(self, job: JobHandle, slot: Slot, after: int = 0) -> Response:
        """The job's event stream from after seq `after`."""
        settings = self.settings
        return job_response(
            job, self.backend, self.store, metrics=self.metrics, slot=slot, ping_interval=settings.ping_interval,
            retry_ms=settings.retry_ms, after=after, write_timeout=settings.write_timeout,
        )

    async def run(self, request: Request) -> Response:
        """`POST` (and `GET`) `/{tool}/run`: a new job's stream, or a job's again (`Last-Event-ID`, `Idempotency-Key`)."""
        if request.method == "HEAD":
            # Starlette answers HEAD on a GET route. A run's GET starts a job; a HEAD (a link checker's, a
            # proxy's) must not: nothing would follow that job, and so nothing would ever cancel it.
            raise ApiError(Code.METHOD_NOT_ALLOWED, f"HEAD {request.url.path} would start a job: use GET or POST")
        caller = await self.caller(request)
        name = request.path_params["tool"]
        with self.streams.slot(caller.tenant) as slot:
            resumed = _last_event_id(request)
            if resumed is not None and (request.method == "GET" or not request.headers.get("idempotency-key")):
                # A client reconnecting to the URL it first opened: an EventSource (GET), or a POST sent
                # again by a retrying client (fetch-event-source sends Last-Event-ID, no key). The same job.
                tool = self.tool(caller, name)
                job = await self._job(resumed[0], caller.principal, to_follow=True)
                if (its_tool := job.snapshot(kept=[]).tool) != tool.name:
                    raise ApiError(
                        Code.BAD_REQUEST,
                        f"Last-Event-ID {resumed[0]}:{resumed[1]} is an event of a {its_tool} job, not of {tool.name}",
                    )
                return self._resume(job, slot, resumed[1])

            async def params(tool: Tool) -> Any:
                self.admission.refuse_if_draining()  # before reading a request that would be refused anyway
                if request.method == "POST":
                    return await self.admission.decode(tool, await self.read_body(request))
                return self.admission.decode_query(tool, request.query_params)

            headers = request.headers
            admitted = await self.enter(
                caller, name, params, key=headers.get("idempotency-key") or None, callback=headers.get(webhooks.HEADER) or None
            )
            if isinstance(admitted, Attached):
                # The same request again (a client replaying its POST): attach to the job it started.
                job = await self._job(admitted.job_id, caller.principal, to_follow=True, admitting=True)
                after = resumed[1] if resumed is not None and resumed[0] == admitted.job_id else 0
                return self._resume(job, slot, after)
            return self.follow(await self.store.followed(admitted), slot)

    async def _job(self, job_id: str, principal: Principal | None, *, to_follow: bool = False, admitting: bool = False) -> JobHandle:
        """`admitting`: the job an Idempotency-Key is bound to, which may still be being admitted (not yet stored)."""
        job = await self.store.get(job_id, to_follow=to_follow)
        if job is None and admitting:
            raise ApiError(
                Code.RATE_LIMITED, "the request first sent with this Idempotency-Key is still being admitted: send it again", retry_after=1
            )
        # Another token's job is answered as an unknown one: its existence is not the caller's to learn.
        if job is None or not self.auth.sees(principal, job.snapshot(kept=[]).owner):
            raise ApiError(Code.NOT_FOUND, f"no job {job_id} (unknown, or finished more than {self.settings.retention:g} s ago)")
        return job

    def _resume(self, job: JobHandle, slot: Slot, after: int) -> Response:
        if job.terminal is not None and after >= job.terminal.seq:
            # The client holds the terminal event: 204 stops an EventSource for good.
            return Response(status_code=204, headers={"X-Job-Id": job.id})
        return self.follow(job, slot, after)

    async def job_events(self, request: Request) -> Response:
        caller = await self.caller(request)
        with self.streams.slot(caller.tenant) as slot:
            job = await self._job(request.path_params["job_id"], caller.principal, to_follow=True)
            resumed = _last_event_id(request)
            if resumed is not None and resumed[0] != job.id:
                raise ApiError(Code.BAD_REQUEST, f"Last-Event-ID {resumed[0]}:{resumed[1]} is not an event of job {job.id}")
            return self._resume(job, slot, resumed[1] if resumed else 0)

    def _whole(self, body: bytes, kept: list[Kept]) -> Response:
        """A JSON answer that may carry results (a snapshot, a page of them): big, it is sent as a
        stream's big event is, and a result in the spool is read from it a piece at a time."""
        return WholeResponse(splice(body, kept), **self.sending)

    async def _asked(self, request: Request) -> JobHandle:
        """The job a `/jobs/{job_id}…` route names, if the caller may see it."""
        return await self._job(request.path_params["job_id"], await self.auth.authenticate(request))

    async def job_snapshot(self, request: Request) -> Response:
        job = await self._asked(request)
        kept: list[Kept] = []
        snapshot = job.snapshot(kept)
        if (callback := await self.webhooks.state(job.id)) is not None:
            snapshot = msgspec.structs.replace(snapshot, callback=callback)
        return self._whole(encode(snapshot), kept)

    async def job_result(self, request: Request) -> Response:
        job = await self._asked(request)
        return result_response(job, request.headers.get("range"), request.headers.get("if-range"), **self.sending)

    async def job_file(self, request: Request) -> Response:
        job = await self._asked(request)
        name = request.path_params["name"]
        return file_response(job, name, request.headers.get("range"), request.headers.get("if-range"), **self.sending)

    async def cancel_job(self, request: Request) -> Response:
        job = await self._asked(request)
        running = not job.done
        if running:
            await self.cancel(job)
        return JSONResponse({"job_id": job.id, "cancelled": running, "status": job.snapshot(kept=[]).status})

    async def list_jobs(self, request: Request) -> Response:
        principal = await self.auth.authenticate(request)
        query = jobs_query(request)
        kept: list[Kept] = []
        page = await self.store.listed(query, self.auth.whose(principal), kept)
        return self._whole(encode(page), kept)

    async def me(self, request: Request) -> Response:
        """`GET /me`: who the caller is, their class, limits and what of them is in use here."""
        caller = await self.caller(request)
        p = caller.principal
        if p is None:
            return Response(encode(Me(name=None, tenant=caller.tenant, user_class=None)), media_type="application/json")
        running, started = self.auth.limits.usage(p.name)
        me = Me(
            name=p.name, tenant=caller.tenant, user_class=p.user_class, priority=p.priority, groups=sorted(p.groups), admin=p.admin,
            weight=p.weight, tools=sorted(p.tools) if p.tools is not None else None, models=sorted(p.models) if p.models is not None else None,
            usage=Allowance(p.max_concurrent, p.jobs_per_minute, running, started, p.max_job_memory, p.job_timeout),
            quotas=await self.meter.left(caller.tenant, p.quotas),
        )
        return Response(encode(me), media_type="application/json", headers={"Cache-Control": "no-store"})

    async def usage(self, request: Request) -> Response:
        """`GET /usage`: settled use by tenant, class and model: an admin's, everyone's (or `tenant`'s);
        anyone else's, their own."""
        caller = await self.caller(request)
        query = request.query_params
        by = [key.strip() for key in query.get("by", "tenant,class,model").split(",") if key.strip()]
        if not by or set(by) - set(USAGE_KEYS):
            raise ApiError(Code.BAD_REQUEST, f"by: a comma-separated list of {', '.join(USAGE_KEYS)}", field="by")
        limit = query.get("limit", "1000")
        if not limit.isdigit() or not 1 <= int(limit) <= MAX_USAGE_ROWS:
            raise ApiError(Code.BAD_REQUEST, f"limit: an integer from 1 to {MAX_USAGE_ROWS}", field="limit")
        admin = caller.principal is None or caller.principal.admin
        tenant = query.get("tenant") if admin else caller.tenant
        rows = await self.meter.rows(tenant)
        # Up to MAX_ROWS rows summed, sorted and encoded: tens of ms, off the event loop.
        return Response(await asyncio.to_thread(usage_report, rows, by, int(limit)), media_type="application/json", headers={"Cache-Control": "no-store"})

    async def ticket(self, request: Request) -> Response:
        principal = await self.auth.authenticate(request)
        if principal is None:
            raise ApiError(Code.NOT_FOUND, "this gateway has no tokens configured: GET streams need no ticket")
        value, ttl = self.auth.issue_ticket(principal)
        return JSONResponse({"ticket": value, "expires_in": ttl}, headers={"Cache-Control": "no-store"})

    # -- what is served --------------------------------------------------------------------------

    async def tools(self, request: Request) -> Response:
        """The tools, and which of them the default model (or `?model=NAME`) cannot run."""
        backend = self.backend
        model = request.query_params.get("model")
        if model is not None:
            name = backend.resolve_model(model)
            key = (backend.tools_version, name)
            if key not in self._per_model:
                self._per_model.clear()  # one version's answers at a time
                info = params_mod.describe(backend.tools.values(), self.limits, lambda t: backend.unsupported(t, name))
                self._per_model[key] = encode(info)
            return Response(self._per_model[key], media_type="application/json")
        # A remote backend learns its tools after start-up, a local one its model's capabilities: describe each once.
        if self._described[0] != backend.tools_version:
            self._described = (backend.tools_version, encode(params_mod.describe(backend.tools.values(), self.limits, backend.unsupported)))
        return Response(self._described[1], media_type="application/json")

    async def models(self, request: Request) -> Response:
        return Response(encode(self.backend.model_list()), media_type="application/json")

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        backend, drain = self.backend, self.drain
        store_problem = getattr(self.store, "problem", None)
        ready = backend.ready and store_problem is None and not drain.draining
        body = {"ready": ready, **backend.describe()}
        if drain.draining:
            body["reason"] = "shutting down"
        elif not backend.ready:
            body["reason"] = backend.not_ready_reason
        elif store_problem is not None:
            body["reason"] = store_problem
        return JSONResponse(body, status_code=200 if ready else 503)

    # -- its life --------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.auth.start()
        await self.backend.start()
        await self.store.start()
        self.webhooks.start()

    async def stop_jobs(self) -> None:
        """The drain's end: jobs that can go on in another replica are left to it, the rest stopped."""
        await self.store.hand_off()
        await self.backend.stop()

    async def stop(self) -> None:
        await self.webhooks.stop()
        await self.meter.close()
        await self.store.stop()
        await self.backend.stop()
        await self.auth.stop()


def usage_report(rows: list[Row], by: list[str], limit: int) -> bytes:
    """`GET /usage`'s answer: `rows` summed by `by`, the first `limit` of them, and how many there are."""
    sums = summed(rows, by)
    return encode(UsageReport(rows=sums[:limit], rows_total=len(sums)))
