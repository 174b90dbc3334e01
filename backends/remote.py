"""The remote backend: jobs run on executor services, reached by HTTP and one WebSocket each.

For each executor the gateway keeps a `Link`: one long-lived session socket
that carries the frames of all this gateway's jobs there, a health poll, and
the jobs in flight. A job is submitted with `POST /jobs`; its status, logs and
partials arrive on the socket and are re-emitted on the gateway's own job (with
the gateway's own `seq`); on `completed` the result is downloaded as msgpack,
checked against its length and SHA-256, and sent to the client as JSON.

What can go wrong, and what happens:

- the socket drops while the executor lives: it is reopened with backoff and
  every job is resumed after the last executor `seq` seen, so nothing is lost
  or doubled (frames at or below that `seq` are dropped);
- the executor dies: after `deadline` seconds without a socket its jobs end
  with `backend_unavailable`; an executor that comes back without a job says
  so, and that job ends at once;
- the client goes away: the remote job is deleted, which cancels it there;
- a result download breaks or arrives corrupt: it is fetched again, and after
  the last try the job ends with an error rather than with garbage.

A result is fetched by one GET of its own (backends/download.py says how it
is kept fast). The tools are learned from the executors with their JSON
Schema; a request's params travel as its client sent them, for the executor to
decode with the tool's own Structs and refuse as a gateway running it would
(gateway/params.py's `Relayed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import httpx
import msgspec
import websockets
from opentelemetry.trace import StatusCode
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.asyncio.client import unix_connect as ws_unix_connect

from backends.base import answers_inline, files_folder, remove_files_folder, sent
from backends.download import Downloads, Retry
from backends.frames import failure, relay
from backends.routing import Routing, Unreachable
from gateway.encoding import HASH_INLINE, from_msgpack, to_json
from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.plumbing import tracing
from gateway.plumbing.logs import forward_request_id
from gateway.params import INLINE_BYTES, off_loop
from gateway.protocol import (
    Code,
    ErrorBody,
    ModelInfo,
    ModelList,
    RemoteFrame,
    RemoteKind,
    Resume,
    ResultFile,
    Status,
    SubmitRequest,
    ToolInfo,
    encode,
)
from gateway.tools.base import Tool
from gateway.tools.files import MAX_FILES

log = logging.getLogger("streamgate.remote")

DOWNLOAD_TRIES = 4
FILE_PIECE = 1 << 20  # of a result file written at once while it is fetched
BACKOFF_MAX_S = 2.0
# How long a `forget` of a job that ended waits for the next op to share its message: under load it
# rides with the next submit, and the executor wakes once for both.
FORGET_WAIT_S = 0.05
_FRAMES = msgspec.json.Decoder(RemoteFrame | list[RemoteFrame])  # a message holds one frame, or several
UNIX = "unix:"  # an executor URL of a Unix socket: unix:/PATH
ON_SOCKET = "http://executor"  # the URL requests on a Unix socket are made to (the socket decides where they go)


class RemoteJob:
    """A gateway job running on an executor: the last executor `seq` applied, and frames held back."""

    def __init__(self, job: Job, link: ExecutorLink) -> None:
        self.job = job
        self.link = link
        self.last_seq = 0
        self.accepted = False
        self.epoch = link.epoch
        self.early: list[RemoteFrame] = []

    def accept(self) -> None:
        """The executor took the job: say DISPATCHED, then apply what arrived before its answer."""
        self.accepted = True
        self.link.taken(self.job)
        early, self.early = self.early, []
        for frame in early:
            self.receive(frame)
        if self.link.epoch != self.epoch or not self.link.connected:
            # The socket was reopened while the submit was in flight: ask for what it missed.
            self.link.resume(self)

    def receive(self, frame: RemoteFrame) -> None:
        if not self.accepted:
            self.early.append(frame)
            return
        if frame.seq == 0:  # the executor does not have the job (it restarted)
            self.link.finish(self, Code.BACKEND_UNAVAILABLE, "the executor lost the job (it restarted)")
            return
        if frame.seq <= self.last_seq:
            return  # already applied: a resume may repeat frames
        if frame.seq != self.last_seq + 1:
            log.warning("job %s: frame %d after %d; resuming", self.job.id, frame.seq, self.last_seq, extra={"job_id": self.job.id})
            self.link.resume(self)
            return
        self.last_seq = frame.seq
        self._apply(frame)

    def _apply(self, frame: RemoteFrame) -> None:
        if frame.usage is not None:  # a terminal frame's: counted where the job ran
            self.job.usage.add(frame.usage)
        if frame.kind is RemoteKind.ERROR:
            self.link.finish(self, *self.link.failure(frame))
        elif frame.kind is RemoteKind.COMPLETED:
            self.link.completed(self, frame)
        else:
            relay(self.job, frame)


class ExecutorLink:
    """One executor (backends/routing.py's `Link`): the session socket, its health, and this gateway's jobs there."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        deadline: float,
        poll_interval: float,
        on_tools: Any,
        files_folder: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.files_folder = files_folder  # where the result files of its jobs are fetched to
        # unix:/PATH: an executor on this machine's Unix socket (an engine process, backends/engines.py).
        self.uds = self.url.removeprefix(UNIX) if self.url.startswith(UNIX) else None
        self.session_id = uuid.uuid4().hex
        self.deadline = deadline
        self.poll_interval = poll_interval
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(
            base_url=ON_SOCKET if self.uds else self.url,
            transport=httpx.AsyncHTTPTransport(uds=self.uds) if self.uds else None,
            headers=self.headers,
            timeout=httpx.Timeout(10.0, read=60.0),
            event_hooks={"request": [forward_request_id]},
        )
        self.jobs: dict[str, RemoteJob] = {}
        self.tools: list[ToolInfo] = []
        self.models: list[ModelInfo] = []
        self.facts: dict[str, Any] = {}  # its last /readyz answer when ready: its model, device, queue
        self.healthy = False
        self.connected = False
        self.epoch = 0
        self.problem = "not contacted yet"
        self.refused = False  # the executor answers 401 to our token: waiting will not help
        self.abandoned: set[str] = set()  # jobs given up on while unreachable, to delete there
        self.down_since = time.monotonic()
        self._socket: ClientConnection | None = None
        self._outbox: list[bytes] = []  # ops for the socket's next message
        self._forgetting: list[str] = []  # the jobs the outbox's `forget` ops name
        self._flush: asyncio.Handle | None = None  # when the outbox goes out
        self._flush_soon = False  # it goes out after this turn of the loop (not after FORGET_WAIT_S)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_tools = on_tools
        self.downloads = Downloads(self.http, self.url, self.uds)

    @property
    def ready(self) -> bool:
        return self.healthy and self.connected

    @property
    def load(self) -> int:
        return len(self.jobs)

    @property
    def backlog(self) -> int:
        return sum(1 for remote in self.jobs.values() if remote.job.started is None)

    def counts(self) -> tuple[int, int]:
        """This gateway's jobs there waiting, and running, as their own frames said: current when
        read, where the executor's `/readyz` figures are a poll old (and count other gateways' too)."""
        running = sum(1 for remote in self.jobs.values() if remote.job.status is Status.RUNNING)
        return len(self.jobs) - running, running

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def start(self) -> None:
        for loop in (self._socket_loop(), self._poll_loop(), self._watchdog()):
            self.spawn(loop)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for remote in list(self.jobs.values()):
            self.finish(remote, Code.SHUTTING_DOWN, "the gateway is shutting down")
        self.downloads.close()
        await self.http.aclose()

    # -- health ---------------------------------------------------------------

    async def _poll_loop(self) -> None:
        while True:
            try:
                ready = await self.http.get("/readyz", timeout=5.0)
                healthy = ready.status_code == 200
                if healthy:
                    self.facts = ready.json()
                self.refused = ready.status_code == 401
                if self.refused:
                    self.problem = "the executor refused the token"
                elif not healthy:
                    self.problem = ready.json().get("reason", f"/readyz answered {ready.status_code}")
                if healthy and (not self.healthy or not self.tools):
                    # Tools first, healthy after: a gateway must not say ready while it
                    # would still answer its tools' runs with not_ready.
                    listed = await self.http.get("/tools", timeout=5.0)
                    listed.raise_for_status()
                    served = await self.http.get("/models", timeout=5.0)
                    served.raise_for_status()
                    self.tools = msgspec.json.decode(listed.content, type=list[ToolInfo])
                    self.models = msgspec.json.decode(served.content, type=ModelList).models
                    self._on_tools()
                self.healthy = healthy
            except (httpx.HTTPError, ValueError, msgspec.DecodeError) as exc:
                self.healthy = False
                self.problem = f"unreachable: {exc or type(exc).__name__}"
            await asyncio.sleep(self.poll_interval)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(0.5, self.deadline / 4))
            if self.connected or not self.jobs:
                continue
            if time.monotonic() - self.down_since > self.deadline:
                for remote in list(self.jobs.values()):
                    self.finish(
                        remote,
                        Code.BACKEND_UNAVAILABLE,
                        f"the executor has been unreachable for over {self.deadline:g} s",
                    )

    # -- the session socket ---------------------------------------------------

    async def _socket_loop(self) -> None:
        ws_url = "ws" + (ON_SOCKET if self.uds else self.url).removeprefix("http") + f"/session?id={self.session_id}"
        options: dict[str, Any] = {"additional_headers": self.headers, "ping_interval": 5, "ping_timeout": 10, "max_size": None, "open_timeout": 10}
        if self.uds:  # a socket on this machine: compressing its frames only costs both ends CPU
            options["compression"] = None
        backoff = 0.1
        while True:
            try:
                async with (ws_unix_connect(self.uds, ws_url, **options) if self.uds else ws_connect(ws_url, **options)) as socket:
                    self._socket, self.connected = socket, True
                    self.epoch += 1
                    backoff = 0.1
                    for remote in list(self.jobs.values()):
                        if remote.accepted:
                            self.resume(remote)
                    for job_id in self.abandoned:
                        self.forget(job_id)
                    self.abandoned.clear()
                    async for message in socket:
                        if len(message) <= INLINE_BYTES:
                            self._on_frames(_decode_frames(self.url, message))
                        else:  # a big result inline: decoded on the parsing thread, the frames after it waiting
                            self._on_frames(await off_loop(_decode_frames, message, self.url))
                        del message  # not held until the next one comes: it may be a big result
            except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as exc:
                if not self.refused:
                    self.problem = f"session socket: {exc or type(exc).__name__}"
            finally:
                if self.connected:
                    self.down_since = time.monotonic()
                self._socket, self.connected = None, False
                # Ops for the socket gone: a resume does their work on the next, the jobs to forget wait for it.
                self.abandoned.update(self._forgetting)
                self._outbox, self._forgetting = [], []
                self._closed()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _on_frames(self, frames: list[RemoteFrame]) -> None:
        for frame in frames:
            remote = self.jobs.get(frame.job_id)
            if remote is not None:
                remote.receive(frame)

    def _closed(self) -> None:
        """The session socket just closed (it is reopened with backoff)."""

    def resume(self, remote: RemoteJob) -> None:
        self._send(encode(Resume(remote.job.id, remote.last_seq)))

    def _send(self, op: bytes, *, urgent: bool = True) -> None:
        """`op` into the socket's next message: the ops of one turn of the loop (submits from many
        requests) go out as one message, a JSON array, and wake the executor once; one that is not
        `urgent` (the `forget` of a job that ended) waits up to FORGET_WAIT_S for others."""
        if self._socket is None:
            return
        self._outbox.append(op)
        if urgent and not self._flush_soon:
            if self._flush is not None:
                self._flush.cancel()
            self._flush_soon = True
            self._flush = asyncio.get_running_loop().call_soon(self._send_outbox)
        elif self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(FORGET_WAIT_S, self._send_outbox)

    def _send_outbox(self) -> None:
        ops, self._outbox, self._forgetting = self._outbox, [], []
        self._flush, self._flush_soon = None, False
        socket = self._socket
        if socket is not None and ops:
            # A send fails only if the socket is closing; the reconnect resumes everything.
            self.spawn(_quietly(socket.send(ops[0] if len(ops) == 1 else b"[" + b",".join(ops) + b"]")))

    def forget(self, job_id: str, *, urgent: bool = True) -> None:
        """Have the executor drop `job_id`, cancelling it if it still runs there (not `urgent`: it ended)."""
        self.spawn(self._forget(job_id))

    # -- jobs -----------------------------------------------------------------

    async def submit(self, job: Job, tool: Tool) -> None:
        remote = RemoteJob(job, self)
        self.jobs[job.id] = remote  # before the submit: its frames may arrive before the answer
        try:
            await self._submit(job, tool)
        except BaseException:
            self.jobs.pop(job.id, None)
            raise
        if job.id not in self.jobs:  # cancelled while the submit was in flight
            self.forget(job.id)
            return
        remote.accept()

    async def _submit(self, job: Job, tool: Tool) -> None:
        """`POST /jobs`: returns once the executor took the job; raises `Unreachable`, or its refusal."""
        body = encode(SubmitRequest(
            tool.name, job_id=job.id, tenant=job.tenant, weight=job.weight, priority=job.priority, timeout=job.timeout, traceparent=tracing.traceparent(job.span),
            files=not answers_inline(job), **sent(job.params),
        ))
        try:
            response = await self.http.post(
                "/jobs", content=body, headers={"X-Session-Id": self.session_id, "Content-Type": "application/json"}
            )
        except httpx.HTTPError as exc:
            self.healthy = False
            self.problem = f"unreachable: {exc or type(exc).__name__}"
            raise Unreachable(str(exc)) from None
        if response.status_code != 202:
            raise _relayed(response, self.url)

    @staticmethod
    def as_json(data: bytes | memoryview) -> msgspec.Raw:
        """A downloaded result as the JSON a local backend would have sent (an executor's is msgpack)."""
        return as_json(data)

    def _take(self, remote: RemoteJob) -> bool:
        """Take `remote` out of the jobs here to end it: False if it is not there any more, or if the
        job there is a newer submit of it (one going on in a new engine: backends/engines.py), which
        what was left of the old one (a download) must not end."""
        if self.jobs.get(remote.job.id) is not remote:
            return False
        del self.jobs[remote.job.id]
        return True

    def taken(self, job: Job) -> None:
        """The executor took `job`: its stream says so."""
        job.set_status(Status.DISPATCHED)

    @staticmethod
    def failure(frame: RemoteFrame) -> tuple[Code, str]:
        """An `error` frame's code and message, as this gateway passes them on: the executor's codes
        other than frames.PASSED_THROUGH become `remote_error`."""
        return failure(frame)

    def completed(self, remote: RemoteJob, frame: RemoteFrame) -> None:
        """A `completed` frame: the job's files fetched first, then its result; the job ends with both here."""
        if frame.files:
            self.spawn(self.collect(remote, frame))
        else:
            self.spawn(self.deliver(remote))

    def succeed(self, remote: RemoteJob, result: msgspec.Raw) -> None:
        """End a job with the result its `completed` frame carried (JSON already)."""
        if self._take(remote):
            remote.job.succeed(result)
            self.forget(remote.job.id, urgent=False)

    async def deliver(self, remote: RemoteJob) -> None:
        """Fetch a completed job's result, check it, and end the job with it as JSON."""
        job_id = remote.job.id
        problem = ""
        for attempt in range(DOWNLOAD_TRIES):
            if attempt:
                await asyncio.sleep(0.2 * 2**attempt)
            span = tracing.child(remote.job.span, "download", **{"streamgate.attempt": attempt})
            try:
                data = await self.downloads.fetch(job_id)
                span.set_attribute("streamgate.result.bytes", len(data))
                # A small one on the loop: a thread hop costs more, and each one the default pool runs concurrently leaves it a thread larger.
                result = self.as_json(data) if len(data) <= HASH_INLINE else await asyncio.to_thread(self.as_json, data)
            except Retry as exc:
                span.set_status(StatusCode.ERROR, str(exc))
                problem = str(exc)
                log.warning("job %s: result download failed (%s), try %d", job_id, exc, attempt + 1, extra={"job_id": job_id})
                continue
            except (msgspec.DecodeError, ValueError) as exc:
                self.finish(remote, Code.REMOTE_ERROR, f"the executor sent a result that is not valid: {exc}")
                return
            finally:
                span.end()
            if self._take(remote):
                remote.job.succeed(result)
                self.forget(job_id, urgent=False)
            return
        self.finish(remote, Code.BACKEND_UNAVAILABLE, f"the result could not be downloaded intact: {problem}")

    async def collect(self, remote: RemoteJob, frame: RemoteFrame) -> None:
        """Fetch the files a completed job wrote (`frame.files`) into the job's own here, then end it
        with its result as a frame without files would have; a file that cannot be had ends it failed."""
        job = remote.job
        job.files.folder = self.files_folder
        files = frame.files or []
        problem = "this gateway keeps no result files" if self.files_folder is None else ""
        if len(files) > MAX_FILES:
            problem = f"the executor names {len(files)} result files, more than {MAX_FILES}"
        for file in files if not problem else ():
            for attempt in range(DOWNLOAD_TRIES):
                if attempt:
                    await asyncio.sleep(0.2 * 2**attempt)
                try:
                    await self._fetch_file(job, file)
                    problem = ""
                    break
                except (httpx.HTTPError, OSError, ValueError) as exc:
                    problem = str(exc) or type(exc).__name__
                    log.warning("job %s: result file %s download failed (%s), try %d", job.id, file.name, problem, attempt + 1)
                except Exception as exc:  # not worth a retry (a name no file may have): the job ends with it
                    problem = f"{type(exc).__name__}: {exc}"
                    break
            if problem:
                break
        if problem:
            self.finish(remote, Code.BACKEND_UNAVAILABLE, f"the job's result files could not be downloaded: {problem}")
        else:  # the files are here: the result, as a completed frame without files brings it
            self.completed(remote, msgspec.structs.replace(frame, files=None))

    async def _fetch_file(self, job: Job, file: ResultFile) -> None:
        """One result file, a piece at a time onto disk (each write on a thread), checked for its length."""
        async with self.http.stream("GET", f"/jobs/{job.id}/files/{file.name}") as response:
            if response.status_code != 200:
                raise ValueError(f"the executor answered {response.status_code}")
            out = await asyncio.to_thread(job.files.open, file.name)
            try:
                got = 0
                async for piece in response.aiter_raw(FILE_PIECE):
                    await asyncio.to_thread(out.write, piece)
                    got += len(piece)
            finally:
                out.close()
        if got != file.size:
            raise ValueError(f"{got} bytes of {file.size}")

    def finish(self, remote: RemoteJob, code: Code, message: str) -> None:
        """End a job here with an error; the executor is told to forget it."""
        if not self._take(remote):
            return
        remote.job.fail(code, message)
        if self.connected:
            self.forget(remote.job.id)
        else:
            # It may still run there: delete it once the executor is back (if it is).
            self.abandoned.add(remote.job.id)

    def cancel(self, job: Job) -> bool:
        remote = self.jobs.get(job.id)
        if remote is None:
            return False
        job.cancel()
        self.finish(remote, Code.CANCELLED, "the job was cancelled")
        return True

    async def _forget(self, job_id: str) -> None:
        """`DELETE /jobs/{id}`: cancels the job there if it still runs, and frees its result."""
        with contextlib.suppress(httpx.HTTPError):
            await self.http.delete(f"/jobs/{job_id}")


def _decode_frames(url: str, message: str | bytes) -> list[RemoteFrame]:
    """A socket message's frames (one, or an array of them); none from a message that is not frames."""
    try:
        frames = _FRAMES.decode(message)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        log.warning("executor %s sent a bad frame: %s", url, exc)
        return []
    return frames if isinstance(frames, list) else [frames]


def as_json(data: bytes | memoryview) -> msgspec.Raw:
    """A msgpack result as the JSON a local backend would have sent."""
    return msgspec.Raw(to_json(from_msgpack(data)))


async def _quietly(coro: Any) -> None:
    with contextlib.suppress(Exception):
        await coro


def _relayed(response: httpx.Response, url: str) -> ApiError:
    """An executor's refusal of a job, as the gateway's own pre-stream error."""
    retry_after = response.headers.get("retry-after")
    try:
        error = msgspec.json.decode(response.content, type=ErrorBody).error
    except (msgspec.ValidationError, msgspec.DecodeError):
        return ApiError(Code.NOT_READY, f"the executor answered HTTP {response.status_code}", retry_after=5)
    if error.code in (Code.UNAUTHORIZED, Code.FORBIDDEN):
        log.error("executor %s refused the gateway's token", url)
        return ApiError(Code.NOT_READY, "the executor refused this gateway's credentials", retryable=False)
    return ApiError(
        error.code,
        error.message,
        field=error.field,
        status=response.status_code,
        retry_after=float(retry_after) if retry_after and retry_after.isdigit() else None,
    )


class RemoteBackend(Routing):
    """Runs jobs on one or more executors; new jobs go to the least-loaded ready one."""

    def __init__(
        self,
        executors: list[str],
        *,
        token: str | None = None,
        deadline: float = 30.0,
        poll_interval: float = 1.0,
        result_files: str | None = None,
    ) -> None:
        if not executors:
            raise ValueError("the remote backend needs at least one --executor URL")
        self.files_folder = files_folder(result_files)
        super().__init__([
            ExecutorLink(
                url, token=token, deadline=deadline, poll_interval=poll_interval, on_tools=self._learn_tools, files_folder=self.files_folder
            )
            for url in executors
        ])

    def not_ready_error(self, model: str | None = None) -> ApiError:
        if all(link.refused for link in self.links):
            # Every executor refuses our token: that needs an operator, not a retry.
            return ApiError(Code.NOT_READY, self.not_ready_reason, retryable=False)
        return super().not_ready_error(model)

    @property
    def not_ready_reason(self) -> str:
        problems = "; ".join(f"{link.url}: {link.problem}" for link in self.links if not link.ready)
        return f"no executor is ready ({problems})"

    async def stop(self) -> None:
        await super().stop()
        remove_files_folder(self.files_folder)

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "remote",
            "executors": [
                {"url": link.url, "ready": link.ready, "jobs": link.load}
                | ({} if link.ready else {"problem": link.problem})
                for link in self.links
            ],
        }
