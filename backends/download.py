"""Result downloads from an executor: `GET /jobs/{id}/result`, checked against its length and SHA-256.

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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import threading
from typing import Any, NamedTuple

import httpx
import numpy as np

from gateway.encoding import HASH_INLINE, HASHING

HASH_STEP = 1 << 20  # hashing starts once this much more has arrived: few thread hand-offs, a short tail
HEAD_MAX = 1 << 16  # the most an answer's status line and headers may take
ERROR_BODY_MAX = 1 << 16  # of an error answer's body, kept for the message
IDLE_CONNECTIONS = 4  # result connections kept open per executor between downloads


class Downloads:
    """One executor's results, each fetched whole and checked, on connections kept alive between them."""

    def __init__(self, http: httpx.AsyncClient, url: str, uds: str | None) -> None:
        self.http = http  # the link's client: its headers, hooks and timeouts, and the way through a proxy
        self.uds = uds
        self.direct = uds is not None or _direct(http, httpx.URL(url))
        self.idle: list[_ResultConnection] = []  # kept-alive connections, the latest last
        self._ssl: Any = None

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()

    async def fetch(self, job_id: str) -> memoryview:
        """A completed job's result, checked against its length and SHA-256; `Retry` when worth another try."""
        request = self.http.build_request("GET", f"/jobs/{job_id}/result", headers={"Accept-Encoding": "identity"})
        if self.direct:
            for hook in self.http.event_hooks["request"]:  # what httpx's send would have run (the request id)
                await hook(request)
            answer = await self._get(request)
        else:
            answer = await self._get_via_httpx(request)
        if await answer.digest.hexdigest() != answer.expected_hash:
            raise Retry("corrupt: the SHA-256 does not match")
        return answer.body

    async def _get(self, request: httpx.Request) -> _Body:
        lines = [b"GET " + request.url.raw_path + b" HTTP/1.1", *(name + b": " + value for name, value in request.headers.raw)]
        head = b"\r\n".join(lines) + b"\r\n\r\n"
        while True:
            connection, reused = await self._connection(request.url)
            try:
                return await connection.fetch(head, self.http.timeout.read)
            except _Stale:
                if reused:
                    continue  # the executor closed the idle connection as the request went out: the next one
                raise
            finally:
                # Kept for the next download only after a whole answer; cut short, it is out of step.
                if connection.reusable and len(self.idle) < IDLE_CONNECTIONS:
                    self.idle.append(connection)
                else:
                    connection.close()

    async def _connection(self, url: httpx.URL) -> tuple[_ResultConnection, bool]:
        """An idle kept-alive connection (True), else a new one (False)."""
        while self.idle:
            connection = self.idle.pop()
            if connection.reusable:
                return connection, True
        loop = asyncio.get_running_loop()
        if self.uds is not None:
            try:
                async with asyncio.timeout(self.http.timeout.connect):
                    _, connection = await loop.create_unix_connection(_ResultConnection, self.uds)
            except (OSError, TimeoutError) as exc:
                raise Retry(f"cannot connect: {exc or type(exc).__name__}") from None
            return connection, False
        tls = url.scheme == "https"
        if tls and self._ssl is None:
            self._ssl = httpx.create_ssl_context()  # what the link's httpx client verifies with
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel that comes as the connection does.
            async with asyncio.timeout(self.http.timeout.connect):
                _, connection = await loop.create_connection(
                    _ResultConnection, url.host, url.port or (443 if tls else 80),
                    ssl=self._ssl if tls else None, server_hostname=url.host if tls else None,
                )
        except (OSError, TimeoutError) as exc:
            raise Retry(f"cannot connect: {exc or type(exc).__name__}") from None
        return connection, False

    async def _get_via_httpx(self, request: httpx.Request) -> _Body:
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
                        raise Retry(f"longer than its Content-Length of {size} bytes")
                    body[filled:end] = chunk
                    filled = end
                    digest.filled(filled)
            finally:
                await response.aclose()
        except httpx.HTTPError as exc:
            raise Retry(f"{type(exc).__name__}: {exc}") from None
        if filled != size:
            raise Retry(f"truncated: {filled} of {size} bytes")
        return _Body(body, digest, expected_hash)


class Retry(Exception):
    """A download failure worth another try."""


class _Stale(Retry):
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
        return Retry(f"HTTP {status}")
    return ValueError(f"HTTP {status}: {text[:200]}")


def _is_length(value: str) -> bool:
    return value.isascii() and value.isdigit()


def _closes(headers: dict[str, str]) -> bool:
    """Whether an answer's `Connection` header (a list of tokens) says the connection ends after it."""
    return "close" in (token.strip().lower() for token in headers.get("connection", "").split(","))


def _checkable(headers: Any) -> tuple[int, str]:
    """The Content-Length and X-Content-SHA256 of a result's answer; `Retry` without them."""
    size, expected_hash = headers.get("content-length"), headers.get("x-content-sha256")
    if size is None or expected_hash is None or "transfer-encoding" in headers:
        raise Retry("the answer lacks Content-Length or X-Content-SHA256, so it cannot be checked")
    if not _is_length(size):
        raise Retry(f"the answer's Content-Length is {size!r}")
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
        """Send a request and wait for its answer; `Retry` after `read_timeout` seconds without a byte."""
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
                raise Retry(f"timed out: nothing arrived for {read_timeout:g} s")

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
            error = _Stale if not self.answered else Retry
            self._fail(error(f"the connection closed before an answer{why}"))
        elif self._state == "body":
            self._fail(Retry(f"truncated: {self._filled} of {len(self._view)} bytes{why}"))
        elif self._state == "error":
            self._keep_alive = False
            self._finish_error()

    # -- the answer -----------------------------------------------------------

    def _on_head(self, data: bytearray) -> None:
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > HEAD_MAX:
                self._fail(Retry("the answer's headers go on past 64 KiB"))
            return
        rest = self._head[end + 4 :]
        try:
            self._status, headers = _parse_head(self._head[:end])
        except ValueError as exc:
            self._fail(Retry(str(exc)))
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
        except Retry as exc:
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
