"""The executor service: runs jobs on this machine's devices for remote gateways.

It is a local backend behind a different front: the same tools, queue and
workers (`backends/workers.py`), with results encoded as msgpack instead of
JSON. What it adds is the session, which fixes what goes wrong in designs that
open a socket per job or lose track of jobs when a socket drops:

- A gateway opens one WebSocket, `WS /session?id=<session id>`, and every job
  it submits with `X-Session-Id` reports on it (`RemoteFrame`s, multiplexed).
- Jobs belong to the session, not to the socket: when the socket drops, they
  run on. When the gateway reconnects with the same id it says `resume` for
  each job with the last `seq` it saw, and gets exactly the frames after it.
- A session left without a socket for `session_grace` seconds is abandoned:
  its jobs are cancelled, so no worker computes for nobody.
- Results are kept until the gateway deletes the job after fetching it, or
  `result_ttl` after the job ended.

A result is served as the msgpack bytes the worker encoded, in large slices of
them (views, not copies), and its SHA-256 is computed once, from the moment the
job ends, on a thread of its own (a small one at once): hashing it for each
download, on the event loop, held back every other session's frames while it
ran and added its time to every download.

Every call, the socket included, needs the shared bearer token when one is set.
A gateway that traces sends its job's `traceparent` with the submit: the job's
spans here, from its admission to its result's encoding, are of that trace
(gateway/plumbing/tracing.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from backends.local import LocalBackend
from gateway import params as params_mod
from gateway.admission import Admission, Applicant
from gateway.config import Settings
from gateway import checkpoints
from gateway.cost import inline_only
from gateway.tools.files import format_of
from gateway.plumbing import tracing
from gateway.plumbing.drain import Drain, on_sigterm
from gateway.encoding import HASH_INLINE, HASHING
from gateway.errors import ApiError, api_error_handler, http_error_handler
from gateway.jobs import Job
from gateway.plumbing.logs import RequestIds, accept_request_id, request_id
from gateway.plumbing.metrics import Metrics
from gateway.protocol import (
    Accepted,
    Code,
    Event,
    EventType,
    ErrorFrame,
    ErrorInfo,
    RemoteFrame,
    RemoteKind,
    Forget,
    Refusal,
    Resume,
    ResultFile,
    SessionOp,
    Submit,
    SubmitRequest,
    SubmitResponse,
    encode,
    remote_frame,
)
from gateway.tenants import SESSION

log = logging.getLogger("streamgate.executor")

# Large enough that a body takes few trips through the ASGI server; not the whole result in
# one write, as a transport keeps what the socket does not take at once (asyncio's, a copy).
RESULT_CHUNK = 1 << 20
# The largest result sent in its `completed` frame (Executor.inline_results); a bigger one is fetched, its
# bytes sent as they are rather than copied into a frame and a message.
INLINE_RESULT_BYTES = 1 << 20
SWEEP_INTERVAL_S = 1.0


@dataclass(eq=False)
class Session:
    """One gateway's jobs, and the socket (if any) their frames go out on.

    Frames are sent in messages of as many as are ready: the frames a batch's step
    gives its members (a token each, say) arrive on the loop together, and go out
    as one message, a JSON array, instead of one message each.
    """

    id: str
    jobs: dict[str, Job] = field(default_factory=dict)
    socket: WebSocket | None = None
    detached_since: float | None = field(default_factory=time.monotonic)
    followed: dict[str, Job] = field(default_factory=dict)  # the jobs whose new events go out on the socket
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    outbox: list[bytes] = field(default_factory=list)  # frames for the next message
    sent: asyncio.Future[None] | None = None  # done when the outbox's message is sent
    inline: bool = False  # results in their `completed` frames (Executor.inline_results)
    taking: set[asyncio.Task[None]] = field(default_factory=set)  # submits on the socket being admitted

    def follow(self, job: Job, after: int) -> None:
        """(Re)start sending `job`'s frames after `after`: those it has now, then each as it comes."""
        self.unfollow(job.id)
        if self.socket is None:
            return
        for event in job.events[after:]:
            self._add(event)
        if job.terminal is None:
            job.listeners.append(self._add)
            self.followed[job.id] = job

    def unfollow(self, job_id: str) -> None:
        job = self.followed.pop(job_id, None)
        if job is not None:
            with contextlib.suppress(ValueError):
                job.listeners.remove(self._add)

    def _add(self, event: Event) -> None:
        """A followed job's event, into the next message (`Job.listeners`: on the loop, as it is appended).

        The events that one hand-off from a device's thread appends (a batch step's tokens) all
        land here before the message's task runs, and go out together. A gateway that reads
        slowly lets the outbox grow by what its jobs' logs hold anyway.
        """
        inline = self.inline and event.size <= INLINE_RESULT_BYTES
        job = self.jobs.get(event.job_id) if event.terminal else None
        files = _files(job) if job is not None and event.type is EventType.DATA and job.files else None
        self.outbox.append(encode(remote_frame(event, inline, files, job.usage if job is not None else None)))
        if event.terminal:
            self.followed.pop(event.job_id, None)
        if self.socket is not None:
            self.sent_for(self.socket)

    def sent_for(self, socket: WebSocket) -> asyncio.Future[None]:
        """The message that will carry the outbox: sent once the frames added with it are in."""
        if self.sent is None:
            self.sent = asyncio.get_running_loop().create_future()
            # A task starts after the callbacks already due, among them the rest of the same step's events.
            asyncio.ensure_future(self._send_outbox(socket, self.sent))
        return self.sent

    async def _send_outbox(self, socket: WebSocket, sent: asyncio.Future[None]) -> None:
        try:
            async with self.send_lock:
                if socket is not self.socket:  # gone while this waited: its frames go out on the next one
                    raise ConnectionError("the socket closed")
                frames, self.outbox, self.sent = self.outbox, [], None
                if frames:
                    await socket.send_bytes(frames[0] if len(frames) == 1 else b"[" + b",".join(frames) + b"]")
        except BaseException as exc:  # the socket closed: the gateway reconnects and resumes
            if self.sent is sent:
                self.sent = None
                if self.outbox and self.socket is not None and self.socket is not socket:
                    self.sent_for(self.socket)  # frames added for the new socket meanwhile go out on it
            sent.set_exception(exc if isinstance(exc, Exception) else ConnectionError("the send was cancelled"))
            sent.exception()  # retrieved: nobody may be waiting
            if not isinstance(exc, Exception):
                raise
        else:
            sent.set_result(None)

    async def send(self, socket: WebSocket, data: bytes) -> None:
        # Every job's frames and the answers share the socket; messages must not interleave.
        async with self.send_lock:
            await socket.send_bytes(data)

    def detach(self, socket: WebSocket) -> None:
        if self.socket is not socket:
            return
        self.socket = None
        self.outbox.clear()  # frames for the socket gone: a resume sends them again
        self.detached_since = time.monotonic()
        for job_id in list(self.followed):
            self.unfollow(job_id)


@dataclass(eq=False)
class Held:
    """A job the executor holds for its gateway: the session that submitted it, when it ended."""

    job: Job
    session: Session
    ended: float | None = None
    _digest: asyncio.Future[str] | None = None

    def digest(self) -> asyncio.Future[str]:
        """The SHA-256 of the job's result (hex), computed once: on the hashing thread, or at once if small."""
        if self._digest is None:
            assert self.job.terminal is not None and self.job.terminal.type is EventType.DATA
            data = self.job.terminal.data
            loop = asyncio.get_running_loop()
            if len(data) <= HASH_INLINE:
                self._digest = loop.create_future()
                self._digest.set_result(hashlib.sha256(data).hexdigest())
            else:
                self._digest = loop.run_in_executor(HASHING, lambda: hashlib.sha256(data).hexdigest())
        return self._digest

    def ended_with(self, job: Job) -> None:
        """`Job.on_end`: start hashing a result now, so that it is ready when the gateway asks."""
        if job.terminal is not None and job.terminal.type is EventType.DATA:
            self.digest()


class ResultResponse(Response):
    """A result's msgpack, sent as slices of the bytes it already is, with its length and SHA-256."""

    media_type = "application/msgpack"

    def __init__(self, data: bytes, digest: str, media_type: str | None = None) -> None:
        super().__init__(headers={"Content-Length": str(len(data)), "X-Content-SHA256": digest}, media_type=media_type)
        self.data = data

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        view = memoryview(self.data) if scope["method"] != "HEAD" else memoryview(b"")
        last = max(0, (len(view) - 1) // RESULT_CHUNK * RESULT_CHUNK)  # where the last slice starts
        for start in range(0, last, RESULT_CHUNK):
            await send({"type": "http.response.body", "body": view[start : start + RESULT_CHUNK], "more_body": True})
        await send({"type": "http.response.body", "body": view[last:] if view else b""})


class Executor:
    """The executor's state: its backend, sessions, and the jobs it holds results for."""

    def __init__(self, backend: LocalBackend, settings: Settings, *, inline_results: bool = False) -> None:
        self.backend = backend
        # Results in the `completed` frame (JSON: an engine's, backends/engines.py), not fetched apart.
        self.inline_results = inline_results
        # On SIGTERM, as a gateway drains: no new jobs; held ones finish and their results are fetched.
        self.drain = Drain(settings.drain_timeout)
        self.token = settings.executor_token
        self.max_body_bytes = settings.max_body_bytes
        self.body_timeout = settings.body_timeout
        self.limits = settings.limits()
        self.result_ttl = settings.result_ttl
        self.session_grace = settings.session_grace
        self.sessions: dict[str, Session] = {}
        self.entries: dict[str, Held] = {}
        self.metrics = Metrics(backend)
        self.admission = Admission(backend, self.limits, drain=self.drain, metrics=self.metrics)

    def authorize(self, conn: HTTPConnection) -> None:
        if not self.token:
            return
        scheme, _, given = conn.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), self.token.encode()):
            raise ApiError(Code.UNAUTHORIZED, "a valid executor token is required (Authorization: Bearer …)")

    def session(self, session_id: str) -> Session:
        found = self.sessions.get(session_id)
        if found is None:
            found = self.sessions[session_id] = Session(session_id, inline=self.inline_results)
        return found

    async def submit(self, request: Request) -> Response:
        self.authorize(request)
        self.admission.refuse_if_draining()
        session_id = request.headers.get("x-session-id")
        if not session_id:
            raise ApiError(Code.BAD_REQUEST, "the X-Session-Id header is required")
        body = await params_mod.read_body(request, self.max_body_bytes, self.body_timeout, self.metrics.client_timeout)
        try:
            submitted = msgspec.json.decode(body, type=SubmitRequest)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ApiError(Code.BAD_REQUEST, f"a job is {{tool, params, job_id}}: {exc}") from None
        return self._accepted(await self.take(session_id, submitted))

    async def take(self, session_id: str, submitted: SubmitRequest) -> Job:
        """Admit a job a gateway submits (by `POST /jobs` or on its socket), or find it if it was submitted already."""
        existing = self.entries.get(submitted.job_id)
        if existing is not None:
            if existing.session.id != session_id:
                raise ApiError(Code.BAD_REQUEST, f"job {submitted.job_id} belongs to another session")
            return existing.job  # a retried submit: the same job
        tool = self.backend.tool(submitted.tool)
        params = await params_mod.decode_relayed(tool, bytes(submitted.params), submitted.query, submitted.model, "params")
        # The gateway's tenant, as its own queue would count it; a gateway that sends none is one tenant.
        tenant = submitted.tenant if submitted.tenant is not None else SESSION + session_id
        inline = inline_only.set(not submitted.files)
        # A folder only an engine's own gateway names: one on this machine, of this user.
        given = checkpoints.given.set(
            checkpoints.Checkpoint(submitted.checkpoint, submitted.resumed) if submitted.checkpoint and self.inline_results else None
        )
        try:
            with tracing.continued(submitted.traceparent):  # the job's spans here are of the gateway's job's trace
                job = await self.admission.admit(tool, params, Applicant(tenant, submitted.weight, priority=submitted.priority, timeout=submitted.timeout), job_id=submitted.job_id)
        finally:
            inline_only.reset(inline)
            checkpoints.given.reset(given)
        # Held from here on, with no await between: the job cannot have ended yet (the executor keeps no store).
        session = self.session(session_id)
        entry = Held(job, session)
        job.on_end.append(entry.ended_with)
        self.entries[job.id] = entry
        session.jobs[job.id] = job
        session.follow(job, 0)
        return job

    @staticmethod
    def _accepted(job: Job) -> Response:
        return Response(encode(SubmitResponse(job.id)), status_code=202, media_type="application/json")

    async def result(self, request: Request) -> Response:
        self.authorize(request)
        entry = self._entry(request.path_params["job_id"])
        terminal = entry.job.terminal
        if terminal is None:
            raise ApiError(Code.BAD_REQUEST, "the job has not finished", status=409)
        if terminal.type is not EventType.DATA:
            raise ApiError(Code.NOT_FOUND, "the job ended with an error; it has no result")
        # Shielded: a gateway that gives up on its request must not cancel the hash it shares with the next.
        media_type = "application/json" if self.inline_results else None  # an engine's results are JSON
        return ResultResponse(terminal.data, await asyncio.shield(entry.digest()), media_type)

    async def file(self, request: Request) -> Response:
        """One of the files a finished job wrote beside its result, for its gateway to fetch."""
        self.authorize(request)
        entry = self._entry(request.path_params["job_id"])
        path = entry.job.files.paths.get(request.path_params["name"]) if entry.job.terminal is not None else None
        if path is None:
            raise ApiError(Code.NOT_FOUND, f"job {entry.job.id} has no result file {request.path_params['name']!r}")
        return FileResponse(path, media_type="application/octet-stream")

    async def delete(self, request: Request) -> Response:
        """Cancel the job if it still runs, and forget it and its result."""
        self.authorize(request)
        entry = self._entry(request.path_params["job_id"])
        return JSONResponse({"job_id": entry.job.id, "cancelled": self._drop(entry)})

    def _drop(self, entry: Held) -> bool:
        """Cancel the job if it still runs (True), and forget it and its result."""
        running = not entry.job.done
        if running:
            self.backend.cancel(entry.job)
        self._forget(entry)
        return running

    def _entry(self, job_id: str) -> Held:
        entry = self.entries.get(job_id)
        if entry is None:
            raise ApiError(Code.NOT_FOUND, f"no job {job_id} here (unknown, deleted or expired)")
        return entry

    def _forget(self, entry: Held) -> None:
        self.entries.pop(entry.job.id, None)
        entry.session.jobs.pop(entry.job.id, None)
        # The entry and its job refer to each other (`Job.on_end`): a cycle that only the cyclic
        # collector frees, at its own pace, with the result in it. Broken here, freed now.
        with contextlib.suppress(ValueError):
            entry.job.on_end.remove(entry.ended_with)
        entry.session.unfollow(entry.job.id)
        entry.job.files.discard()

    async def session_socket(self, websocket: WebSocket) -> None:
        try:
            self.authorize(websocket)
        except ApiError as exc:
            await websocket.send_denial_response(exc.response())
            return
        session_id = websocket.query_params.get("id")
        if not session_id:
            await websocket.send_denial_response(
                ApiError(Code.BAD_REQUEST, "the session id is required: /session?id=…").response()
            )
            return
        await websocket.accept()
        session = self.session(session_id)
        if session.socket is not None:
            # The gateway reconnected before the old socket was seen to drop.
            old = session.socket
            session.detach(old)
            with contextlib.suppress(Exception):
                await old.close()
        session.socket = websocket
        session.detached_since = None
        try:
            while True:
                received = await websocket.receive()
                if received["type"] == "websocket.disconnect":
                    break
                message = received.get("bytes") or received.get("text") or b""
                try:  # an op, or the ops of one turn of the gateway's loop
                    ops = _OPS.decode(message)
                except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                    log.warning("session %s: bad message %r: %s", session_id, message[:200], exc)
                    continue
                for op in ops if isinstance(ops, list) else [ops]:
                    await self._on_op(session, websocket, op)
                ops = op = None  # a submit's params are not held while the socket waits
        except WebSocketDisconnect:
            pass
        finally:
            session.detach(websocket)

    async def _on_op(self, session: Session, websocket: WebSocket, op: Any) -> None:
        """One op from the session's socket. A method of its own, so that the job it names is not
        held (by the socket's loop, waiting for the next op) after it is forgotten."""
        if isinstance(op, Submit):
            # On a task: admission waits for checks, and the socket's other messages must not.
            taking = asyncio.create_task(self._take_on_socket(session, websocket, op))
            session.taking.add(taking)
            taking.add_done_callback(session.taking.discard)
            return
        job = session.jobs.get(op.job_id)
        if job is None:
            if not isinstance(op, Forget):
                await session.send(websocket, encode(_lost(op.job_id)))
        elif isinstance(op, Resume):
            session.follow(job, op.after_seq)
        elif isinstance(op, Forget):
            self._drop(self.entries[job.id])
        else:
            self.backend.cancel(job)

    async def _take_on_socket(self, session: Session, websocket: WebSocket, op: Submit) -> None:
        if op.request_id:  # on this task only: its log lines name the client's request, as a POST's would
            request_id.set(accept_request_id(op.request_id))
        try:
            job = await self.take(session.id, op)
        except ApiError as exc:
            refusal = Refusal(exc.status, exc.info(), exc.retry_after)
            answer = RemoteFrame(op.job_id, 0, RemoteKind.REFUSED, msgspec.Raw(encode(refusal)))
        else:
            # Its price, for the gateway to find its result room (gateway/admission.py), and whether it can go on
            # after a stop: what the gateway, which relays its params undecoded, learns of them.
            accepted = Accepted(msgspec.Raw(encode(job.cost)), job.resumable)
            answer = RemoteFrame(op.job_id, 0, RemoteKind.ACCEPTED, msgspec.Raw(encode(accepted)))
        if session.socket is not websocket:  # gone meanwhile: the gateway fails the submit itself
            return
        # Into the outbox, ahead of the job's first frames (added as it was admitted).
        session.outbox.insert(0, encode(answer))
        with contextlib.suppress(Exception):  # a socket gone: the gateway fails the submit itself
            await asyncio.shield(session.sent_for(websocket))

    async def sweep(self) -> None:
        """Drop expired results; cancel the jobs of sessions abandoned past their grace."""
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self._sweep(time.monotonic())

    def _sweep(self, now: float) -> None:
        # A function of its own: its loops' last entry and job are let go when it returns, not
        # held (with a job's result) by the sweeping coroutine while it sleeps.
        for entry in list(self.entries.values()):
            if entry.job.done and entry.ended is None:
                entry.ended = now
            if entry.ended is not None and now - entry.ended > self.result_ttl:
                self._forget(entry)
        for session in list(self.sessions.values()):
            if session.socket is not None or session.detached_since is None:
                continue
            if now - session.detached_since > self.session_grace:
                for job in list(session.jobs.values()):
                    if not job.done:
                        log.info("session %s abandoned: cancelling job %s", session.id, job.id, extra={"job_id": job.id})
                        self.backend.cancel(job)
                if not session.jobs:
                    del self.sessions[session.id]


_OPS = msgspec.json.Decoder(SessionOp | list[SessionOp])


def _files(job: Job) -> list[ResultFile]:
    """The files a job wrote, as its `completed` frame announces them (their sizes, to check the fetch)."""
    return [ResultFile(name, format_of(name), os.path.getsize(path)) for name, path in job.files.paths.items()]


def _lost(job_id: str) -> RemoteFrame:
    """The answer to a resume or cancel for a job this executor does not have."""
    info = ErrorInfo(Code.BACKEND_UNAVAILABLE, "the executor no longer has this job", retryable=True)
    return RemoteFrame(job_id, 0, RemoteKind.ERROR, msgspec.Raw(encode(ErrorFrame(job_id, 0, info))))


def create_executor_app(executor: Executor) -> Starlette:
    backend = executor.backend
    described: list[object] = [None, b""]

    async def tools(request: Request) -> Response:
        executor.authorize(request)
        if described[0] != backend.tools_version:
            info = params_mod.describe(backend.tools.values(), executor.limits, backend.unsupported)
            described[:] = [backend.tools_version, encode(info)]
        return Response(described[1], media_type="application/json")

    async def models(request: Request) -> Response:
        executor.authorize(request)
        return Response(encode(backend.model_list()), media_type="application/json")

    async def healthz(request: Request) -> Response:
        executor.authorize(request)
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        executor.authorize(request)
        ready = backend.ready and not executor.drain.draining
        body = {"ready": ready, **backend.describe(), "sessions": len(executor.sessions)}
        sizes: dict[int, int] = {}
        for counts in backend.batch_size_counts():
            for size, n in counts.items():
                sizes[size] = sizes.get(size, 0) + n
        body["batch_sizes"] = sizes  # for a gateway that shows them (an engine's: backends/engines.py)
        if executor.drain.draining:
            body["reason"] = "shutting down"
        elif not backend.ready:
            body["reason"] = backend.not_ready_reason
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics(request: Request) -> Response:
        executor.authorize(request)
        return await executor.metrics.endpoint(request)


    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await backend.start()
        sweeper = asyncio.create_task(executor.sweep())
        # Held jobs count until their gateway has fetched (and deleted) their results.
        on_sigterm(executor.drain, lambda: len(executor.entries), backend.stop)
        try:
            yield
        finally:
            sweeper.cancel()
            await backend.stop()

    app = Starlette(
        routes=[
            WebSocketRoute("/session", executor.session_socket),
            Route("/jobs", executor.submit, methods=["POST"]),
            Route("/jobs/{job_id}/result", executor.result, methods=["GET"]),
            Route("/jobs/{job_id}/files/{name}", executor.file, methods=["GET"]),
            Route("/jobs/{job_id}", executor.delete, methods=["DELETE"]),
            Route("/tools", tools, methods=["GET"]),
            Route("/models", models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={ApiError: api_error_handler, HTTPException: http_error_handler},
        lifespan=lifespan,
    )
    app.state.executor = executor
    app.add_middleware(RequestIds)  # a gateway's submit carries its client's X-Request-Id
    return app
