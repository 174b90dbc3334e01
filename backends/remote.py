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

The tools, and their JSON Schema, are learned from the executors; requests
are validated against Structs rebuilt from that schema (`schema_structs.py`)
before they travel, by the same code as for local tools.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import time
import uuid
from typing import Any

import httpx
import msgspec
import websockets
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from backends.base import Relaying
from backends.frames import failure, relay
from gateway.encoding import from_msgpack, to_json
from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.logs import forward_request_id
from gateway.protocol import (
    Code,
    ErrorBody,
    ModelInfo,
    ModelList,
    RemoteFrame,
    RemoteKind,
    Resume,
    Status,
    SubmitRequest,
    ToolInfo,
    encode,
)
from gateway.tools.base import Tool

log = logging.getLogger("streamgate.remote")

DOWNLOAD_TRIES = 4
BACKOFF_MAX_S = 2.0



class Unreachable(Exception):
    """The executor could not be reached to submit a job."""


class RemoteJob:
    """A gateway job running on an executor: the last executor `seq` applied, and frames held back."""

    def __init__(self, job: Job, link: Link) -> None:
        self.job = job
        self.link = link
        self.last_seq = 0
        self.accepted = False
        self.epoch = link.epoch
        self.early: list[RemoteFrame] = []

    def accept(self) -> None:
        """The executor took the job: say DISPATCHED, then apply what arrived before its answer."""
        self.accepted = True
        self.job.set_status(Status.DISPATCHED)
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
        if frame.kind is RemoteKind.ERROR:
            self.link.finish(self, *failure(frame))
        elif frame.kind is RemoteKind.COMPLETED:
            self.link.spawn(self.link.deliver(self))
        else:
            relay(self.job, frame)


class Link:
    """One executor: the session socket, its health, and this gateway's jobs there."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        deadline: float,
        poll_interval: float,
        on_tools: Any,
    ) -> None:
        self.url = url.rstrip("/")
        self.session_id = uuid.uuid4().hex
        self.deadline = deadline
        self.poll_interval = poll_interval
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(
            base_url=self.url,
            headers=self.headers,
            timeout=httpx.Timeout(10.0, read=60.0),
            event_hooks={"request": [forward_request_id]},
        )
        self.jobs: dict[str, RemoteJob] = {}
        self.tools: list[ToolInfo] = []
        self.models: list[ModelInfo] = []
        self.healthy = False
        self.connected = False
        self.epoch = 0
        self.problem = "not contacted yet"
        self.refused = False  # the executor answers 401 to our token: waiting will not help
        self.abandoned: set[str] = set()  # jobs given up on while unreachable, to delete there
        self.down_since = time.monotonic()
        self._socket: ClientConnection | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_tools = on_tools

    @property
    def ready(self) -> bool:
        return self.healthy and self.connected

    @property
    def load(self) -> int:
        return len(self.jobs)

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
        await self.http.aclose()

    # -- health ---------------------------------------------------------------

    async def _poll_loop(self) -> None:
        while True:
            try:
                ready = await self.http.get("/readyz", timeout=5.0)
                healthy = ready.status_code == 200
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
        ws_url = "ws" + self.url.removeprefix("http") + f"/session?id={self.session_id}"
        backoff = 0.1
        while True:
            try:
                async with ws_connect(
                    ws_url,
                    additional_headers=self.headers,
                    ping_interval=5,
                    ping_timeout=10,
                    max_size=None,
                    open_timeout=10,
                ) as socket:
                    self._socket, self.connected = socket, True
                    self.epoch += 1
                    backoff = 0.1
                    for remote in list(self.jobs.values()):
                        if remote.accepted:
                            self.resume(remote)
                    for job_id in self.abandoned:
                        self.spawn(self._forget(job_id))
                    self.abandoned.clear()
                    async for message in socket:
                        self._on_message(message)
            except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as exc:
                if not self.refused:
                    self.problem = f"session socket: {exc or type(exc).__name__}"
            finally:
                if self.connected:
                    self.down_since = time.monotonic()
                self._socket, self.connected = None, False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _on_message(self, message: str | bytes) -> None:
        try:
            frame = msgspec.json.decode(message, type=RemoteFrame)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("executor %s sent a bad frame: %s", self.url, exc)
            return
        remote = self.jobs.get(frame.job_id)
        if remote is not None:
            remote.receive(frame)

    def resume(self, remote: RemoteJob) -> None:
        self._send(encode(Resume(remote.job.id, remote.last_seq)))

    def _send(self, data: bytes) -> None:
        socket = self._socket
        if socket is not None:
            # A send fails only if the socket is closing; the reconnect resumes everything.
            self.spawn(_quietly(socket.send(data.decode())))

    # -- jobs -----------------------------------------------------------------

    async def submit(self, job: Job, tool: Tool) -> None:
        remote = RemoteJob(job, self)
        self.jobs[job.id] = remote  # before the POST: its frames may arrive before the answer
        body = encode(SubmitRequest(tool.name, msgspec.Raw(encode(job.params)), job.id))
        try:
            response = await self.http.post(
                "/jobs", content=body, headers={"X-Session-Id": self.session_id, "Content-Type": "application/json"}
            )
        except httpx.HTTPError as exc:
            self.jobs.pop(job.id, None)
            self.healthy = False
            self.problem = f"unreachable: {exc or type(exc).__name__}"
            raise Unreachable(str(exc)) from None
        if response.status_code != 202:
            self.jobs.pop(job.id, None)
            raise _relayed(response, self.url)
        if job.id not in self.jobs:  # cancelled while the submit was in flight
            self.spawn(self._forget(job.id))
            return
        remote.accept()

    async def deliver(self, remote: RemoteJob) -> None:
        """Fetch a completed job's result, check it, and end the job with it as JSON."""
        job_id = remote.job.id
        problem = ""
        for attempt in range(DOWNLOAD_TRIES):
            if attempt:
                await asyncio.sleep(0.2 * 2**attempt)
            try:
                data = await self._download(job_id)
                result = await asyncio.to_thread(as_json, data)
            except _Retry as exc:
                problem = str(exc)
                log.warning("job %s: result download failed (%s), try %d", job_id, exc, attempt + 1, extra={"job_id": job_id})
                continue
            except (msgspec.DecodeError, ValueError) as exc:
                self.finish(remote, Code.REMOTE_ERROR, f"the executor sent a result that is not valid: {exc}")
                return
            if self.jobs.pop(job_id, None) is not None:
                remote.job.succeed(result)
                self.spawn(self._forget(job_id))
            return
        self.finish(remote, Code.BACKEND_UNAVAILABLE, f"the result could not be downloaded intact: {problem}")

    async def _download(self, job_id: str) -> bytes:
        try:
            async with self.http.stream("GET", f"/jobs/{job_id}/result") as response:
                if response.status_code != 200:
                    await response.aread()
                    if response.status_code >= 500:
                        raise _Retry(f"HTTP {response.status_code}")
                    raise ValueError(f"HTTP {response.status_code}: {response.text[:200]}")
                chunks = [chunk async for chunk in response.aiter_raw()]
                expected_size = response.headers.get("content-length")
                expected_hash = response.headers.get("x-content-sha256")
        except httpx.HTTPError as exc:
            raise _Retry(f"{type(exc).__name__}: {exc}") from None
        data = b"".join(chunks)
        if expected_size is None or expected_hash is None:
            raise _Retry("the answer lacks Content-Length or X-Content-SHA256, so it cannot be checked")
        if len(data) != int(expected_size):
            raise _Retry(f"truncated: {len(data)} of {expected_size} bytes")
        # Off the event loop: hashing a large result would stall every other stream. One
        # thread of its own, not the loop's default pool, which grows to a thread per core.
        digest = await asyncio.get_running_loop().run_in_executor(_HASHING, lambda: hashlib.sha256(data).hexdigest())
        if digest != expected_hash:
            raise _Retry("corrupt: the SHA-256 does not match")
        return data

    def finish(self, remote: RemoteJob, code: Code, message: str) -> None:
        """End a job here with an error; the executor is told to forget it."""
        if self.jobs.pop(remote.job.id, None) is None:
            return
        remote.job.fail(code, message)
        if self.connected:
            self.spawn(self._forget(remote.job.id))
        else:
            # It may still run there: delete it once the executor is back (if it is).
            self.abandoned.add(remote.job.id)

    def cancel(self, remote: RemoteJob) -> None:
        remote.job.cancel()
        self.finish(remote, Code.CANCELLED, "the job was cancelled")

    async def _forget(self, job_id: str) -> None:
        """`DELETE /jobs/{id}`: cancels the job there if it still runs, and frees its result."""
        with contextlib.suppress(httpx.HTTPError):
            await self.http.delete(f"/jobs/{job_id}")


def as_json(data: bytes) -> msgspec.Raw:
    """A msgpack result as the JSON a local backend would have sent."""
    return msgspec.Raw(to_json(from_msgpack(data)))


_HASHING = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="streamgate-hash")


class _Retry(Exception):
    """A download failure worth another try."""


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


class RemoteBackend(Relaying):
    """Runs jobs on one or more executors; new jobs go to the least-loaded ready one."""

    def __init__(
        self,
        executors: list[str],
        *,
        token: str | None = None,
        deadline: float = 30.0,
        poll_interval: float = 1.0,
    ) -> None:
        if not executors:
            raise ValueError("the remote backend needs at least one --executor URL")
        super().__init__()
        self.links = [
            Link(url, token=token, deadline=deadline, poll_interval=poll_interval, on_tools=self._learn_tools)
            for url in executors
        ]

    @property
    def in_flight(self) -> int:
        return sum(link.load for link in self.links)

    def _learn_tools(self) -> None:
        # The executors in the order given: the first one's default model is the gateway's.
        models: dict[str, ModelInfo] = {}
        for link in self.links:
            for info in link.models:
                if info.name not in models:
                    # Queue figures are the executor's at that moment, of every gateway's jobs: not kept.
                    models[info.name] = msgspec.structs.replace(info, default=not models, queued=0, running=0)
        self.learn((info for link in self.links for info in link.tools), list(models.values()))

    def _serving(self, model: str | None) -> list[Link]:
        return [link for link in self.links if link.ready and (model is None or any(m.name == model for m in link.models))]

    def ready_for(self, model: str | None) -> bool:
        return bool(self._serving(model))

    def models(self) -> list[ModelInfo]:
        served = []
        for model in self._models:
            ready = self.ready_for(model.name)
            served.append(msgspec.structs.replace(model, ready=ready, problem=None if ready else "no executor serving it is ready"))
        return served

    @property
    def ready(self) -> bool:
        return any(link.ready for link in self.links)

    def not_ready_error(self, model: str | None = None) -> ApiError:
        if all(link.refused for link in self.links):
            # Every executor refuses our token: that needs an operator, not a retry.
            return ApiError(Code.NOT_READY, self.not_ready_reason, retryable=False)
        return super().not_ready_error(model)

    @property
    def not_ready_reason(self) -> str:
        problems = "; ".join(f"{link.url}: {link.problem}" for link in self.links if not link.ready)
        return f"no executor is ready ({problems})"

    async def start(self) -> None:
        for link in self.links:
            link.start()

    async def stop(self) -> None:
        await asyncio.gather(*(link.stop() for link in self.links))

    async def submit(self, job: Job) -> None:
        tool = self.tool(job.tool)
        candidates = sorted(
            (link for link in self._serving(job.model) if any(t.name == tool.name for t in link.tools)),
            key=lambda link: link.load,
        )
        for link in candidates:
            try:
                await link.submit(job, tool)
                return
            except Unreachable:
                continue
        raise ApiError(Code.NOT_READY, self.not_ready_reason, retry_after=5)

    def cancel(self, job: Job) -> None:
        for link in self.links:
            remote = link.jobs.get(job.id)
            if remote is not None:
                link.cancel(remote)
                return
        job.cancel()

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "remote",
            "executors": [
                {"url": link.url, "ready": link.ready, "jobs": link.load}
                | ({} if link.ready else {"problem": link.problem})
                for link in self.links
            ],
        }
