"""Admission: the one way a job enters, whatever surface it comes through.

`POST` and `GET /{tool}/run`, an idempotent retry, the OpenAI routes, the executor service
and a Ray replica all start a job with `Admission.admit`; a surface only reads its request
and says who asks (`Applicant`). The steps, in the protocol's order (shared/PROTOCOL.md):

1. not shutting down (503 `shutting_down`);
2. params decoded (on the parsing thread when big, gateway/params.py) and put on a served model;
3. the store reachable, and the request's idempotency key bound, or the job it started found;
4. the applicant's token quota, and its class's quotas on what it used (gateway/server/metering.py):
   429 `rate_limited`; a completion webhook's URL (`Callback-URL`, gateway/server/webhooks.py),
   checked with the request's (400, 403) and kept for the job's end;
5. the backend's checks: server caps, readiness, the model's capabilities, the tool's own
   check and the job's price (gateway/cost.py: 413 `too_large`);
6. room for its priced result where finished results are kept (gateway/plumbing/spool.py: 503
   `overloaded` with Retry-After when full);
7. the queue, fair between tenants (backends/queue.py: 429 `queue_full`). A backend that learns
   the price only as its service takes the job (an engine's) has the room checked then: a job
   without room is cancelled there and refused here, before any event.

A refusal at any step undoes those before it: a refused request leaves no key bound, no quota
held and no job. A surface that lacks a part (the executor keeps no store, a replica no quota)
leaves it out; the order of the rest does not change.

With tracing (gateway/plumbing/tracing.py), the steps are the `admission` span, a refusal its
error status, and the job's own span starts as it is queued, beside admission under whatever
span was current (a request's, or another process's job's): the job's trace from there on.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import anyio
from opentelemetry import context as otel_context
from opentelemetry import trace

from gateway import checkpoints
from gateway.cost import inline_only, refuse_memory
from gateway import params as params_mod
from gateway.errors import ApiError
from gateway.jobs import Job, end_span
from gateway.protocol import Code
from gateway.tools.base import MODEL_FIELD, Tool

if TYPE_CHECKING:
    from starlette.datastructures import QueryParams

    from gateway.backend import Backend

tracer = trace.get_tracer("streamgate")


# What admission asks of the parts a surface has. The server's auth, job store, drain and metrics
# (and an executor's or a replica's subset) are these; admission names no surface's classes.


class Token(Protocol):
    """A client's token as admission sees it (gateway/server/auth.py's `Principal`)."""

    @property
    def name(self) -> str: ...

    @property
    def weight(self) -> float: ...

    @property
    def models(self) -> frozenset[str] | None: ...  # the models it may run on (None: every one)

    @property
    def priority(self) -> int: ...  # its class's

    @property
    def max_job_memory(self) -> int | None: ...  # its class's bound on one job's priced memory

    @property
    def job_timeout(self) -> float | None: ...  # its class's bound on one job's run, in seconds

    @property
    def user_class(self) -> str | None: ...

    @property
    def quotas(self) -> Any: ...  # its class's quotas on its use (gateway/server/classes.py `Quotas`)


class Quota(Protocol):
    """Per-token concurrency and rate, and each class's jobs waiting to start (gateway/server/auth.py's
    `Limits`): `admit` raises 429, or returns what gives the place back."""

    def admit(self, principal: Any, job: Job) -> Callable[[], None]: ...


class Metering(Protocol):
    """What jobs use, settled as they end, and the quotas on it (gateway/server/metering.py `Meter`):
    `check` raises 429 for a tenant that used up one of its class's quotas."""

    async def check(self, tenant: str, quotas: Any, user_class: str | None) -> None: ...

    async def hold(self, tenant: str, quotas: Any, user_class: str | None, tokens: int, job_id: str) -> Callable[[], None]: ...

    def settle(self, job: Job, user_class: str | None) -> None: ...


class Callbacks(Protocol):
    """Completion webhooks (gateway/server/webhooks.py): `check` a run's callback URL for its caller
    (400, 403), and have a job's terminal event delivered to it (`waiting`)."""

    def check(self, url: str, principal: Any) -> str: ...

    async def waiting(self, job: Job, url: str) -> None: ...

    async def withdraw(self, job: Job, url: str) -> None: ...

    def armed(self, job: Job, url: str) -> None: ...


class Binding(NamedTuple):
    """What an idempotency key is bound to: the job it started, and a digest of the request that started it."""

    job_id: str
    request: str


class KeyStore(Protocol):
    """The job store's part in admission (gateway/server/store.py): keys bound, jobs kept."""

    async def reserve(self, key: str, job_id: str, request: str) -> Binding | None: ...

    async def release(self, key: str, job_id: str) -> None: ...

    async def add(self, job: Job) -> None: ...


class Room(Protocol):
    """Where finished results are kept (gateway/plumbing/spool.py): `hold` promises a priced result
    its bytes, or raises (413 never, 503 not now), and returns what gives them back."""

    def hold(self, size: int, field: str = "") -> Callable[[], None]: ...


class Refusing(Protocol):
    """A shutdown in progress (gateway/plumbing/drain.py): `refuse` raises 503 `shutting_down`."""

    def refuse(self) -> None: ...


class Tracking(Protocol):
    """Metrics that count a job from its admission to its end (gateway/plumbing/metrics.py)."""

    def track(self, job: Job) -> None: ...


@dataclass(frozen=True)
class Applicant:
    """Who asks for a job: the tenant it is queued as and with what weight (backends/queue.py),
    the token that owns it (None: the gateway has no tokens), and that token's quota."""

    tenant: str
    weight: float = 1.0
    owner: str | None = None
    principal: Token | None = None
    priority: int = 0  # its class's: served before lower classes (backends/queue.py)
    timeout: float | None = None  # its class's job_timeout

    @classmethod
    def of(cls, principal: Token | None, tenant: str) -> Applicant:
        if principal is None:
            return cls(tenant)
        return cls(tenant, principal.weight, principal.name, principal, principal.priority, principal.job_timeout)


@dataclass(frozen=True)
class GoingOn:
    """A job another gateway replica ran until it stopped, admitted again here to go on from its
    checkpoint (gateway/server/redis_store/): its log goes on after seq `after`, where it had sent
    `partials` partial events; the idempotency key it holds (scoped), its request's digest, and when
    it was first admitted."""

    after: int
    partials: int = 0
    key: str | None = None
    digest: str = ""
    created: float = 0.0  # when it was first admitted


@dataclass(frozen=True)
class Attached:
    """The answer to a request sent again with its idempotency key: the job it first started."""

    job_id: str


@dataclass
class Admission:
    """The admission steps over one backend, with the parts of a gateway a surface has."""

    backend: Backend
    limits: Mapping[str, int]
    drain: Refusing | None = None
    store: KeyStore | None = None
    quota: Quota | None = None
    metrics: Tracking | None = None
    room: Room | None = None
    meter: Metering | None = None
    webhooks: Callbacks | None = None

    def refuse_if_draining(self) -> None:
        if self.drain is not None:
            self.drain.refuse()

    @staticmethod
    async def decode(tool: Tool, body: bytes, what: str = "the body") -> Any:
        """`tool`'s params from a JSON body."""
        return await params_mod.off_loop(functools.partial(params_mod.decode_body, what=what), body, tool)

    @staticmethod
    def decode_query(tool: Tool, query: QueryParams) -> Any:
        """`tool`'s params from a query string (no bigger than the header limit: decoded on the loop)."""
        return params_mod.decode_query(tool, query)

    async def admit(
        self, tool: Tool, params: Any, applicant: Applicant, *, job_id: str | None = None, most_result: int | None = None,
        going_on: GoingOn | None = None, callback: str | None = None,
    ) -> Job:
        """Admit a job of `tool` with decoded `params` (`decode`'s, or a Struct another surface
        built) for `applicant`, and queue it; `job_id`: the id a gateway gave it; `most_result`: the
        most bytes of result the surface can answer with (`/mcp` inlines results), priced beforehand;
        `going_on`: the job is one another replica ran, going on here under its id; `callback`: its
        completion webhook's URL."""
        job = await self._admit(tool, params, applicant, job_id, None, most_result, going_on, callback=callback)
        assert isinstance(job, Job)  # no key: never attached
        return job

    async def admit_once(
        self, tool: Tool, params: Any, applicant: Applicant, key: str | None, *, most_result: int | None = None,
        callback: str | None = None,
    ) -> Job | Attached:
        """`admit`, for a request that may carry an `Idempotency-Key` (`key`): the same request
        with it again, from the same token (one token cannot reach another's job by guessing its
        key), is `Attached` to the job it started; another request with it is a 409. `callback`:
        the URL its terminal event is to be delivered to (`Callback-URL`)."""
        return await self._admit(tool, params, applicant, None, key, most_result, callback=callback)

    async def _admit(
        self, tool: Tool, params: Any, applicant: Applicant, job_id: str | None, key: str | None, most_result: int | None = None,
        going_on: GoingOn | None = None, callback: str | None = None,
    ) -> Job | Attached:
        parent = otel_context.get_current()
        span = tracer.start_span("admission", parent, attributes={"streamgate.tool": tool.name})
        steps = functools.partial(self._steps, tool, params, applicant, job_id, key, parent, span, most_result, going_on, callback)
        if not span.get_span_context().is_valid:  # no tracing: not even the API's no-op context manager (5 µs)
            return await steps()
        try:
            with trace.use_span(span, record_exception=False, set_status_on_exception=False):
                admitted = await steps()
        except BaseException as exc:
            end_span(span, *_refusal(exc))
            raise
        if isinstance(admitted, Attached):
            span.set_attribute("streamgate.attached_to", admitted.job_id)
        span.end()
        return admitted

    async def _steps(
        self, tool: Tool, params: Any, applicant: Applicant, job_id: str | None, key: str | None,
        parent: otel_context.Context, admission: trace.Span, most_result: int | None = None, going_on: GoingOn | None = None,
        callback: str | None = None,
    ) -> Job | Attached:
        self.refuse_if_draining()
        if callback is not None:
            if self.webhooks is None:
                raise ApiError(Code.BAD_REQUEST, "this surface sends no webhooks: leave out Callback-URL")
            callback = self.webhooks.check(callback, applicant.principal)
        # Its model by name, so that what the job records, routes by and is keyed on never depends on the default.
        params = _may_run_on(applicant, params_mod.on_model(params, self.backend.resolve_model))
        if (problem := getattr(self.store, "problem", None)) is not None:  # a shared store that is unreachable
            raise ApiError(Code.STORE_UNAVAILABLE, problem, retry_after=5)
        # A job that can go on from its checkpoint may go on in another replica if this one stops: the
        # store keeps its request (gateway/server/redis_store/). Not one whose surface holds it here
        # to build its answer from its result (the OpenAI routes, /mcp): that answer would be lost.
        # Params relayed undecoded (an engine's) are judged where they are decoded, as the job is taken.
        may_go_on = not inline_only.get() and most_result is None
        job = _new_job(tool, params, applicant, job_id, may_go_on, going_on)
        digest, scoped = "", None
        if key is not None:
            digest, scoped = await params_mod.digest_of(tool.name, params), f"{applicant.owner or ''}:{key}"
            if (attached := await self._bound(scoped, key, job, digest)) is not None:
                return attached
        if self.metrics is not None:
            self.metrics.track(job)
        release = lambda: None  # noqa: E731
        room, withdraw = None, False
        try:
            release = await self._quotas(applicant, job)
            job.cost = await self.backend.admit(tool, params, self.limits)
            priced = job.cost is not None
            if priced:
                room = await self._priced(job, applicant, most_result)
            if callback is not None and self.webhooks is not None:
                await self.webhooks.waiting(job, callback)
                # A job going on here kept its delivery from its first admission, refused here or not.
                withdraw = going_on is None
            if admission.get_span_context().is_valid:
                # From here the job is its own trace's: it outlives the request, and another process
                # continues it from this span (the time it waits queued is measured from its start).
                job.span = tracer.start_span("job", parent, attributes=_attributes(job))
            await self.backend.submit(job)
            job.resumable = job.resumable and may_go_on
            if not priced and job.cost is not None:
                try:  # priced by the service that took it (an engine): checked now
                    room = await self._priced(job, applicant, most_result)
                except ApiError:
                    self.backend.cancel(job)
                    raise
        except BaseException as exc:
            release()
            if room is not None:
                room()
            await self._withdrawn(job, scoped, callback if withdraw else None)
            end_span(job.span, *_refusal(exc))
            raise
        self._until_end(job, applicant, release, room)
        job.idempotency_key, job.request_digest = scoped, digest
        if going_on is not None:  # bound before, by the replica that first admitted it
            job.idempotency_key, job.request_digest = going_on.key, going_on.digest
        if self.store is not None:
            try:
                await self.store.add(job)
            except BaseException:
                # Queued, and now found by no one (no stream, no cancel, no key): it must not run on.
                # What it holds is given back as it ends.
                self.backend.cancel(job)
                await self._withdrawn(job, scoped, callback if withdraw else None)
                raise
        if callback is not None and self.webhooks is not None:  # admitted: a refused run's end is no one's
            self.webhooks.armed(job, callback)
        return job

    async def _bound(self, scoped: str, key: str, job: Job, digest: str) -> Attached | None:
        """`key` (scoped to its token) bound to `job` (None), or the job it names already if it names
        this request (409 if another)."""
        assert self.store is not None, "an idempotency key needs a store to bind it in"
        if (bound := await self.store.reserve(scoped, job.id, digest)) is None:
            return None
        # A key bound before requests were recorded with it (an older replica) has no digest: it attaches.
        if bound.request and bound.request != digest:
            # A key names one request: the same key on another body is a client's bug, never a new job.
            raise ApiError(
                Code.IDEMPOTENCY_KEY_REUSED,
                f"Idempotency-Key {key!r} was first sent with another request (tool or params); use a new key for a new request",
            )
        return Attached(bound.job_id)

    async def _withdrawn(self, job: Job, scoped: str | None, callback: str | None) -> None:
        """A refused run's key and webhook delivery are taken back. Shielded: a request cancelled (its
        client gone, an MCP call's scope) stays cancelled under anyio, which would cancel these too and
        leave the key bound and the delivery counted."""
        with anyio.CancelScope(shield=True):
            if callback is not None and self.webhooks is not None:
                await self.webhooks.withdraw(job, callback)
            if scoped is not None and self.store is not None:
                await self.store.release(scoped, job.id)

    def _until_end(self, job: Job, applicant: Applicant, release: Callable[[], None], room: Callable[[], None] | None) -> None:
        """What the admitted job holds is given back as it ends (at once if it has: an engine's frames
        may come with its answer to the submit), and its use settled."""
        job.when_ended(lambda _: release())
        if (meter := self.meter) is not None:
            user_class = applicant.principal.user_class if applicant.principal is not None else None
            job.when_ended(lambda ended: meter.settle(ended, user_class))
        if room is not None:  # after the settling: the tokens its quota held count as used from then
            job.when_ended(lambda _: room())

    async def _quotas(self, applicant: Applicant, job: Job) -> Callable[[], None]:
        """The token's place within its limits (429; what gives it back), and its class's quotas on
        what it used (429)."""
        release = self.quota.admit(applicant.principal, job) if self.quota is not None else lambda: None
        principal = applicant.principal
        try:
            if self.meter is not None and principal is not None and principal.quotas:
                await self.meter.check(applicant.tenant, principal.quotas, principal.user_class)
        except BaseException:
            release()
            raise
        return release

    async def _priced(self, job: Job, applicant: Applicant, most_result: int | None) -> Callable[[], None] | None:
        """A priced job's checks: its memory within its class's bound (413), its result within the
        surface's and held in the room for results, the tokens it may count held against its class's
        token quotas (413, 429), its checkpoint's journal. What gives back what it holds."""
        principal = applicant.principal
        if principal is not None and principal.max_job_memory is not None:
            refuse_memory(job.cost, principal.max_job_memory, "max_job_memory of this token's class")
        room = self._result_room(job, most_result)
        if self.meter is None or principal is None or not principal.quotas:
            _keeps_journal(job)
            return room
        try:
            held = await self.meter.hold(applicant.tenant, principal.quotas, principal.user_class, job.cost.most_counted, job.id)
        except BaseException:
            if room is not None:
                room()
            raise
        _keeps_journal(job)
        if room is None:
            return held
        result_room = room

        def given_back() -> None:
            held()
            result_room()

        return given_back

    def _result_room(self, job: Job, most_result: int | None) -> Callable[[], None] | None:
        """A priced job's result against the surface's bound (413), then the room kept for results
        (what gives it back); None without a room."""
        cost = job.cost
        if most_result is not None and cost.result > most_result:
            raise ApiError(
                Code.TOO_LARGE,
                f"the job's result is priced at {cost.result} bytes, over the {most_result} this surface "
                f"answers with; make {cost.result_field} smaller, or run it with POST /{job.tool}/run",
                field=cost.result_field,
            )
        # Result files are kept where results are (gateway/plumbing/spool.py `adopt`), and a checkpoint's
        # journal beside them while its job runs: held with them.
        return self.room.hold(cost.result + cost.files + cost.journal, cost.result_field) if self.room is not None else None


def _new_job(tool: Tool, params: Any, applicant: Applicant, job_id: str | None, may_go_on: bool, going_on: GoingOn | None) -> Job:
    job = Job(
        tool.name, params, job_id=job_id, owner=applicant.owner, tenant=applicant.tenant, weight=applicant.weight,
        after=going_on.after if going_on is not None else None, priority=applicant.priority, timeout=applicant.timeout,
    )
    job.resumable = may_go_on and checkpoints.resumable(tool, params)
    if going_on is not None:
        job.created = going_on.created or job.created
        job.resumes = 1  # its run goes on from the checkpoint the replica before left
        job.partials_earlier = job.skip_partials = going_on.partials
    return job


def _may_run_on(applicant: Applicant, params: Any) -> Any:
    """`params`, unless their model is one the applicant's token (or its class) may not run on: 403."""
    allowed = applicant.principal.models if applicant.principal is not None else None
    if allowed is not None and hasattr(params, MODEL_FIELD) and (model := getattr(params, MODEL_FIELD)) not in allowed:
        raise ApiError(Code.FORBIDDEN, f"this token may not run jobs on the model {model!r} (it may on {', '.join(sorted(allowed)) or 'none'})")
    return params


def _keeps_journal(job: Job) -> None:
    """A job priced without a journal (over --max-checkpoint-bytes) keeps no checkpoint: no other replica
    can go on with it."""
    if job.resumable and job.cost is not None and not job.cost.journal:
        job.resumable = False


def _refusal(exc: BaseException) -> tuple[Code, str]:
    """What ended an admission, as a span's status says it."""
    if isinstance(exc, ApiError):
        return exc.code, exc.message
    if isinstance(exc, asyncio.CancelledError):  # the client went away meanwhile
        return Code.CANCELLED, "the request was cancelled while it was admitted"
    return Code.INTERNAL, f"{type(exc).__name__}: {exc}"


def _attributes(job: Job) -> dict[str, str]:
    return {
        "streamgate.job.id": job.id,
        "streamgate.tool": job.tool,
        "streamgate.model": job.model or "",
        "streamgate.tenant": job.tenant,
    }
