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

Results do not come through httpx, whose reads of 64 KiB, each parsed, copied
and finally joined, held a download to a few hundred MB/s. `_ResultConnection`
is an HTTP/1.1 client for that one GET: the body goes by `recv_into` straight
into a buffer of its Content-Length, and its SHA-256 is computed on a thread of
its own while the rest arrives (hashlib lets go of the GIL), so that neither the
copies nor the hash stand between the last byte and the result, and the event
loop stays free for every other stream. Its connections are kept alive between
downloads, as httpx's would be. Where httpx would go through a proxy (the
`*_PROXY` variables), the download goes through httpx still, into the same
buffer and hash.

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
import threading
import time
import uuid
from typing import Any, NamedTuple

import httpx
import msgspec
import numpy as np
import websockets
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.asyncio.client import unix_connect as ws_unix_connect

from backends.base import Relaying
from backends.frames import failure, relay
from gateway.encoding import HASH_INLINE, HASHING, from_msgpack, to_json
from gateway.errors import ApiError
from gateway.jobs import Job
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
    Status,
    SubmitRequest,
    ToolInfo,
    encode,
)
from gateway.tools.base import Tool

log = logging.getLogger("streamgate.remote")

DOWNLOAD_TRIES = 4
BACKOFF_MAX_S = 2.0
HASH_STEP = 1 << 20  # hashing starts once this much more has arrived: few thread hand-offs, a short tail
HEAD_MAX = 1 << 16  # the most an answer's status line and headers may take
ERROR_BODY_MAX = 1 << 16  # of an error answer's body, kept for the message
IDLE_CONNECTIONS = 4  # result connections kept open per executor between downloads
_NULL = msgspec.Raw(b"null")
_FRAMES = msgspec.json.Decoder(RemoteFrame | list[RemoteFrame])  # a message holds one frame, or several
UNIX = "unix:"  # an executor URL of a Unix socket: unix:/PATH
ON_SOCKET = "http://executor"  # the URL requests on a Unix socket are made to (the socket decides where they go)


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
        if self.link.says_dispatched:
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
            self.link.finish(self, *failure(frame, self.link.passes_codes))
        elif frame.kind is RemoteKind.COMPLETED:
            # A big result stays behind (`null`), to be fetched as the other executors' are.
            if self.link.inline_results and frame.data != _NULL:
                self.link.succeed(self, frame.data)
            else:
                self.link.spawn(self.link.deliver(self))
        else:
            relay(self.job, frame)


class Link:
    """One executor: the session socket, its health, and this gateway's jobs there."""

    inline_results = False  # results come in their `completed` frames (an engine's, as JSON)
    says_dispatched = True  # a job's stream says DISPATCHED when the executor takes it
    passes_codes = False  # an executor's error codes other than frames.PASSED_THROUGH become `remote_error`

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
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_tools = on_tools
        self._direct = self.uds is not None or _direct(self.http, httpx.URL(self.url))
        self._idle: list[_ResultConnection] = []  # kept-alive result connections, the latest last
        self._ssl: Any = None

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
        while self._idle:
            self._idle.pop().close()
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
                        self.spawn(self._forget(job_id))
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

    def _send(self, data: bytes) -> None:
        socket = self._socket
        if socket is not None:
            # A send fails only if the socket is closing; the reconnect resumes everything.
            self.spawn(_quietly(socket.send(data.decode())))

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
            self.spawn(self._forget(job.id))
            return
        remote.accept()

    async def _submit(self, job: Job, tool: Tool) -> None:
        """`POST /jobs`: returns once the executor took the job; raises `Unreachable`, or its refusal."""
        body = encode(SubmitRequest(tool.name, msgspec.Raw(encode(job.params)), job.id, job.tenant, job.weight))
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

    def succeed(self, remote: RemoteJob, result: msgspec.Raw) -> None:
        """End a job with the result its `completed` frame carried (JSON already)."""
        if self.jobs.pop(remote.job.id, None) is not None:
            remote.job.succeed(result)
            self.spawn(self._forget(remote.job.id))

    async def deliver(self, remote: RemoteJob) -> None:
        """Fetch a completed job's result, check it, and end the job with it as JSON."""
        job_id = remote.job.id
        problem = ""
        for attempt in range(DOWNLOAD_TRIES):
            if attempt:
                await asyncio.sleep(0.2 * 2**attempt)
            try:
                data = await self._download(job_id)
                # A small one on the loop: a thread hop costs more, and each one the default pool runs concurrently leaves it a thread larger.
                result = self.as_json(data) if len(data) <= HASH_INLINE else await asyncio.to_thread(self.as_json, data)
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

    async def _download(self, job_id: str) -> memoryview:
        """A completed job's result, checked against its length and SHA-256; `_Retry` when worth another try."""
        request = self.http.build_request("GET", f"/jobs/{job_id}/result", headers={"Accept-Encoding": "identity"})
        if self._direct:
            for hook in self.http.event_hooks["request"]:  # what httpx's send would have run (the request id)
                await hook(request)
            answer = await self._fetch(request)
        else:
            answer = await self._fetch_via_httpx(request)
        if await answer.digest.hexdigest() != answer.expected_hash:
            raise _Retry("corrupt: the SHA-256 does not match")
        return answer.body

    async def _fetch(self, request: httpx.Request) -> _Body:
        lines = [b"GET " + request.url.raw_path + b" HTTP/1.1", *(name + b": " + value for name, value in request.headers.raw)]
        head = b"\r\n".join(lines) + b"\r\n\r\n"
        while True:
            connection, reused = await self._result_connection(request.url)
            try:
                return await connection.fetch(head, self.http.timeout.read)
            except _Stale:
                if reused:
                    continue  # the executor closed the idle connection as the request went out: the next one
                raise
            finally:
                # Kept for the next download only after a whole answer; cut short, it is out of step.
                if connection.reusable and len(self._idle) < IDLE_CONNECTIONS:
                    self._idle.append(connection)
                else:
                    connection.close()

    async def _result_connection(self, url: httpx.URL) -> tuple[_ResultConnection, bool]:
        """An idle kept-alive connection (True), else a new one (False)."""
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable:
                return connection, True
        loop = asyncio.get_running_loop()
        if self.uds is not None:
            try:
                async with asyncio.timeout(self.http.timeout.connect):
                    _, connection = await loop.create_unix_connection(_ResultConnection, self.uds)
            except (OSError, TimeoutError) as exc:
                raise _Retry(f"cannot connect: {exc or type(exc).__name__}") from None
            return connection, False
        tls = url.scheme == "https"
        if tls and self._ssl is None:
            self._ssl = httpx.create_ssl_context()  # what the Link's httpx client verifies with
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel that comes as the connection does.
            async with asyncio.timeout(self.http.timeout.connect):
                _, connection = await loop.create_connection(
                    _ResultConnection, url.host, url.port or (443 if tls else 80),
                    ssl=self._ssl if tls else None, server_hostname=url.host if tls else None,
                )
        except (OSError, TimeoutError) as exc:
            raise _Retry(f"cannot connect: {exc or type(exc).__name__}") from None
        return connection, False

    async def _fetch_via_httpx(self, request: httpx.Request) -> _Body:
        """The same download through httpx (and its proxy), into the same kind of buffer and hash."""
        try:
            response = await self.http.send(request, stream=True)
            try:
                if response.status_code != 200:
                    await response.aread()
                    raise _refusal(response.status_code, response.text)
                size, expected_hash = _checkable(response.headers)
                body = memoryview(np.empty(size, np.uint8))
                digest = _Digest(body)
                filled = 0
                async for chunk in response.aiter_raw():
                    end = filled + len(chunk)
                    if end > size:
                        raise _Retry(f"longer than its Content-Length of {size} bytes")
                    body[filled:end] = chunk
                    filled = end
                    digest.filled(filled)
            finally:
                await response.aclose()
        except httpx.HTTPError as exc:
            raise _Retry(f"{type(exc).__name__}: {exc}") from None
        if filled != size:
            raise _Retry(f"truncated: {filled} of {size} bytes")
        return _Body(body, digest, expected_hash)

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



class _Retry(Exception):
    """A download failure worth another try."""


class _Stale(_Retry):
    """The connection closed before a byte of the answer: on a kept-alive one, the executor's
    idle timeout met the request, which then goes on the next connection without counting as a try."""


class _Body(NamedTuple):
    body: memoryview
    digest: _Digest
    expected_hash: str


def _direct(client: httpx.AsyncClient, url: httpx.URL) -> bool:
    """Whether `client` reaches `url` without a proxy: the transport it picks itself, so that the
    `*_PROXY` and `NO_PROXY` rules are httpx's own. Unable to ask, it says no: the httpx path is
    never wrong, only slower."""
    pick = getattr(client, "_transport_for_url", None)
    return pick is not None and pick(url) is getattr(client, "_transport", None)


def _refusal(status: int, text: str) -> Exception:
    """A result answered with an error status: a server error is worth another try, the rest not."""
    if status >= 500:
        return _Retry(f"HTTP {status}")
    return ValueError(f"HTTP {status}: {text[:200]}")


def _is_length(value: str) -> bool:
    return value.isascii() and value.isdigit()


def _closes(headers: dict[str, str]) -> bool:
    """Whether an answer's `Connection` header (a list of tokens) says the connection ends after it."""
    return "close" in (token.strip().lower() for token in headers.get("connection", "").split(","))


def _checkable(headers: Any) -> tuple[int, str]:
    """The Content-Length and X-Content-SHA256 of a result's answer; `_Retry` without them."""
    size, expected_hash = headers.get("content-length"), headers.get("x-content-sha256")
    if size is None or expected_hash is None or "transfer-encoding" in headers:
        raise _Retry("the answer lacks Content-Length or X-Content-SHA256, so it cannot be checked")
    if not _is_length(size):
        raise _Retry(f"the answer's Content-Length is {size!r}")
    return int(size), expected_hash


class _Digest:
    """The SHA-256 of a buffer as it fills, computed on the hashing thread while the rest arrives.

    `filled` (on the event loop) says how far the buffer holds data; once HASH_STEP
    bytes wait, a drain on the hashing thread hashes up to where it is filled, again
    until it has caught up, so the ranges go in order with at most one drain at a time.
    """

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._sha = hashlib.sha256()
        self._lock = threading.Lock()
        self._filled = 0
        self._hashed = 0
        self._draining: concurrent.futures.Future[None] | None = None

    def filled(self, upto: int) -> None:
        with self._lock:
            self._filled = upto
            if self._draining is None and upto - self._hashed >= HASH_STEP:
                self._draining = HASHING.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                start, end = self._hashed, self._filled
                if start == end:
                    self._draining = None
                    return
            self._sha.update(self._view[start:end])
            with self._lock:
                self._hashed = end

    async def hexdigest(self) -> str:
        """The digest of all that was filled: after the drain under way, the rest, on the hashing thread."""
        with self._lock:
            draining = self._draining
        if draining is None and self._filled - self._hashed <= HASH_INLINE:
            return self._final()  # quicker than the hand-off to the thread and back
        if draining is not None:
            await asyncio.wrap_future(draining)
        return await asyncio.get_running_loop().run_in_executor(HASHING, self._final)

    def _final(self) -> str:
        self._drain()
        return self._sha.hexdigest()


class _ResultConnection(asyncio.BufferedProtocol):
    """One HTTP/1.1 connection to an executor for result downloads, kept alive between them.

    The answer's head is read into a small scratch buffer; a 200's body then goes by
    `recv_into` straight into a buffer of its Content-Length (uninitialised memory:
    a zeroed one would be written twice), each arrival handed to the `_Digest`. An
    error's body is kept, up to ERROR_BODY_MAX, for the message. Bytes that arrive
    when no answer is awaited put the connection out of step: it is closed.
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._scratch = bytearray(HEAD_MAX)
        self._head = bytearray()
        self._state = "idle"  # or "head", "body", "error"
        self._answer: asyncio.Future[_Body] | None = None
        self._view = memoryview(b"")
        self._filled = 0
        self._digest: _Digest | None = None
        self._expected_hash = ""
        self._status = 0
        self._error_body = bytearray()
        self._error_length: int | None = None
        self._keep_alive = True
        self.closed = False
        self.answered = False  # a byte of the answer came: the request reached the executor
        self.last_read = 0.0

    @property
    def reusable(self) -> bool:
        return not self.closed and self._keep_alive and self._state == "idle"

    def close(self) -> None:
        self.closed = True
        self._state = "idle"
        if self._answer is not None and not self._answer.done():
            self._answer.cancel()  # nobody awaits it any more (timed out, or cancelled)
        if self._transport is not None:
            self._transport.abort()

    async def fetch(self, head: bytes, read_timeout: float | None) -> _Body:
        """Send a request and wait for its answer; `_Retry` after `read_timeout` seconds without a byte."""
        assert self._state == "idle" and self._transport is not None
        self._answer = self._loop.create_future()
        self._state, self.answered, self._keep_alive = "head", False, True
        self.last_read = self._loop.time()
        self._transport.write(head)
        while True:
            wait = None if read_timeout is None else max(0.0, self.last_read + read_timeout - self._loop.time())
            done, _ = await asyncio.wait({self._answer}, timeout=wait)
            if done:
                # Not kept: an idle connection would hold the last result's buffer until its next download.
                answer, self._answer = self._answer, None
                return answer.result()
            if self._loop.time() - self.last_read >= read_timeout:  # type: ignore[operator]
                raise _Retry(f"timed out: nothing arrived for {read_timeout:g} s")

    # -- asyncio's side -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        if self._state == "body":
            return self._view[self._filled :]
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        self.last_read = self._loop.time()
        self.answered = True
        if self._state == "body":
            self._filled += nbytes
            self._digest.filled(self._filled)  # type: ignore[union-attr]
            if self._filled == len(self._view):
                self._complete()
        elif self._state == "head":
            self._on_head(self._scratch[:nbytes])
        elif self._state == "error":
            self._on_error_body(self._scratch[:nbytes])
        else:
            self.close()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost says what that means

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        why = f" ({exc})" if exc else ""
        if self._state == "head":
            error = _Stale if not self.answered else _Retry
            self._fail(error(f"the connection closed before an answer{why}"))
        elif self._state == "body":
            self._fail(_Retry(f"truncated: {self._filled} of {len(self._view)} bytes{why}"))
        elif self._state == "error":
            self._keep_alive = False
            self._finish_error()

    # -- the answer -----------------------------------------------------------

    def _on_head(self, data: bytearray) -> None:
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > HEAD_MAX:
                self._fail(_Retry("the answer's headers go on past 64 KiB"))
            return
        rest = self._head[end + 4 :]
        try:
            self._status, headers = _parse_head(self._head[:end])
        except ValueError as exc:
            self._fail(_Retry(str(exc)))
            return
        finally:
            self._head = bytearray()
        if 100 <= self._status < 200 and self._status != 101:
            # An interim answer (100 Continue, 103 Early Hints, from a proxy or ingress): the real one follows.
            if rest:
                self._on_head(rest)
            return
        self._keep_alive = not _closes(headers)
        if self._status != 200:
            length = headers.get("content-length", "")
            self._error_length = int(length) if _is_length(length) and "transfer-encoding" not in headers else None
            self._error_body = bytearray()
            self._state = "error"
            self._on_error_body(rest)
            return
        try:
            size, self._expected_hash = _checkable(headers)
        except _Retry as exc:
            self._fail(exc)
            return
        self._view = memoryview(np.empty(size, np.uint8))
        self._digest = _Digest(self._view)
        self._filled = min(len(rest), size)
        self._view[: self._filled] = rest[: self._filled]
        if len(rest) > size:
            self._keep_alive = False  # more than the body: the connection is out of step
        self._digest.filled(self._filled)
        self._state = "body"
        if self._filled == size:
            self._complete()

    def _on_error_body(self, data: bytearray) -> None:
        self._error_body += data[: ERROR_BODY_MAX - len(self._error_body)]
        if self._error_length is None:
            # No length (chunked, or up to the close): what came with the head is message enough.
            self._keep_alive = False
            self._finish_error()
        elif len(self._error_body) >= min(self._error_length, ERROR_BODY_MAX):
            if len(self._error_body) != self._error_length:
                self._keep_alive = False  # longer than kept, or than said: out of step
            self._finish_error()

    def _finish_error(self) -> None:
        text = self._error_body[: self._error_length].decode("utf-8", "replace")
        self._state = "idle"
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(_refusal(self._status, text))
        if not self._keep_alive:
            self.close()

    def _complete(self) -> None:
        self._state = "idle"
        assert self._answer is not None and self._digest is not None
        if not self._answer.done():
            self._answer.set_result(_Body(self._view, self._digest, self._expected_hash))
        self._view, self._digest = memoryview(b""), None
        if not self._keep_alive:
            self.close()

    def _fail(self, exc: Exception) -> None:
        self._state = "idle"
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(exc)
        self.close()


def _parse_head(head: bytearray) -> tuple[int, dict[str, str]]:
    """The status and headers (names in lower case) of an HTTP/1.1 answer's head."""
    status_line, *lines = head.decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise ValueError(f"not an HTTP/1.1 answer: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon:
            raise ValueError(f"a malformed header line: {line[:80]!r}")
        name, value = name.strip().lower(), value.strip()
        if name in headers and name == "content-length" and headers[name] != value:
            raise ValueError("two different Content-Lengths")
        headers[name] = value
    return int(code), headers


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

    link_class: type[Link] = Link

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
            self.link_class(url, token=token, deadline=deadline, poll_interval=poll_interval, on_tools=self._learn_tools)
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
        await self._submit_first(job, tool, self._candidates(job, tool))

    def _candidates(self, job: Job, tool: Tool) -> list[Link]:
        """The ready links that run the job's model and tool, the least loaded first."""
        serving = [link for link in self._serving(job.model) if any(t.name == tool.name for t in link.tools)]
        return sorted(serving, key=self._order)

    def _order(self, link: Link) -> Any:
        return link.load

    async def _submit_first(self, job: Job, tool: Tool, links: list[Link]) -> None:
        """Submit to the first of `links` that can be reached."""
        for link in links:
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
