"""Deadlines for what a client sends, where uvicorn has none; and the server stack itself.

uvicorn waits for a request line and headers for as long as the client takes
to send them: a client that sends a byte every few seconds (a slowloris)
holds its connection, and many of them hold every file descriptor the process
has. `SlowClientProtocol` is uvicorn's httptools protocol with one timer more,
for what the client owes at the moment:

- **Headers.** The request line and headers must be complete within
  `--header-timeout` seconds, counted from the connection's start, or on a
  kept-alive connection from the first byte of the next request. Past it the
  client is answered `408 Request Timeout` with the protocol's JSON error body
  (`request_timeout`) and `Connection: close`, and the connection is closed.
- **Headers' size.** A request line and headers over `--max-header-bytes` are
  answered `431 Request Header Fields Too Large` (`headers_too_large`) and the
  connection is closed: httptools sets no bound of its own, and a client could
  otherwise send megabytes of one header for the parser to hold and scan.
- **A body nobody reads.** When the answer went out before the request's body
  was all in (a 404, a 401), uvicorn goes on taking the rest of the body for as
  long as it trickles in. It gets `--body-timeout` seconds from the answer;
  then the connection is closed (there is nothing left to answer).

Each cut is counted through `on_timeout` (`streamgate_client_timeouts_total{phase}`).

What it deliberately leaves alone:

- An idle kept-alive connection (no byte of a new request yet): uvicorn's own
  `timeout_keep_alive` closes it, silently, as before. It asked for nothing, so
  it is not answered.
- A body the app is reading: the app answers the 408 itself, as any other error
  (`read_body` in gateway/params.py, the same `--body-timeout`).
- A slow reader: the stream's `send_timeout` (`--write-timeout`, gateway/server/stream.py).
  The protocol only bounds what a connection may hold unsent, and offers a way
  to drop it (gateway/plumbing/sendbuffer.py): each connection's kernel send buffer is
  fixed at `--send-buffer`, and each request's scope carries a way to drop the
  connection (the `streamgate.drop` extension), for the write timeout's cut.

`uvicorn_options` is the one way to build the server with it, for `streamgate
serve`, `streamgate executor` and the tests alike. It names the protocol and
the event loop rather than uvicorn's "auto", so that the server that runs is
the one measured and tested, whatever else is installed: httptools (a C HTTP
parser) and uvloop (a libuv event loop), which `uvicorn[standard]` brings and
which together carry a stream's bytes for about a fifth less CPU than h11 on
asyncio's loop (bench/streaming.py); asyncio's own loop where uvloop has no
build (Windows).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.config import Settings
from gateway.errors import ApiError
from gateway.protocol import Code, ErrorBody, encode
from gateway.plumbing.sendbuffer import DROP, drop, limit_send_buffer

log = logging.getLogger("streamgate.slowclients")


class SlowClientProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines for a request's headers and for a body nobody reads."""

    def __init__(
        self,
        *args: Any,
        header_timeout: float,
        body_timeout: float,
        max_header_bytes: int = 64 * 1024,
        send_buffer: int | None = None,
        on_timeout: Callable[[str], None] = lambda phase: None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.timeouts = {"headers": header_timeout, "body": body_timeout}
        self.on_timeout = on_timeout
        self._owed: str | None = None  # what the timer waits for: "headers", "body" or nothing
        self._due: asyncio.TimerHandle | None = None
        self._message_done = True  # the current request's body is all in (or there is none yet)
        self.max_header_bytes = max_header_bytes
        self.send_buffer = send_buffer  # SO_SNDBUF of each connection; None: the kernel's auto-tuning
        # The current request's head: its request line and headers as parsed (exact), and the bytes read
        # while it is incomplete (a bound on what the parser buffers of a header not yet whole); None in a body.
        self._head: int | None = 0
        self._head_read = 0
        self._head_refused = False
        self._lingering: int | None = None  # bytes dropped since a 431 went out

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:  # answered 431: the rest is read and dropped (see `_close_lingering`)
            self._lingering += len(data)
            if self._lingering > _LINGER_BYTES:
                self.transport.close()
            return
        super().data_received(data)
        if self._head is not None and not self._head_refused:
            # The read may also carry the end of the last request: a looser bound, for memory only;
            # the exact count is checked when the head ends.
            self._head_read += len(data)
            self._head_refused = self._head_read > self.max_header_bytes + _READ_SLACK
        if self._head_refused and not self.transport.is_closing():
            log.info("%s: the request line and headers are over %d bytes: closed", _peer(self.client), self.max_header_bytes)
            self._expect(None)
            self._answer(431, ApiError(Code.HEADERS_TOO_LARGE, _TOO_BIG.format(self.max_header_bytes)))
            self._close_lingering()

    def _close_lingering(self) -> None:
        """Close after an answer the client is still sending into: the answer and a FIN first, then
        what still arrives is read and dropped for a moment. Closed at once, the socket would still
        hold unread bytes, and the kernel would reset the connection and drop the answer with them."""
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._lingering = 0
        self.loop.call_later(_LINGER_S, self.transport.close)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.send_buffer is not None:
            limit_send_buffer(transport, self.send_buffer)
        self._expect("headers")  # from the start: a connection that never sends a byte is a slowloris too

    # The parser's callbacks, in a request's order.

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {DROP: self._drop}
        self._head, self._head_read = 0, 0
        self._message_done = False
        if self._owed != "headers":
            self._expect("headers")  # the first byte of the next request on a kept-alive connection

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._count_head(len(name) + len(value) + 4)  # ": " and CRLF

    def _count_head(self, n: int) -> None:
        if self._head is not None:
            self._head += n

    def on_headers_complete(self) -> None:
        if self._head is not None and self._head > self.max_header_bytes:
            self._head_refused = True  # answered once this read is parsed; the app never sees the request
        self._head = None
        if self._head_refused:
            return
        super().on_headers_complete()
        self._expect(None)  # the app has the request now (or a WebSocket takes the connection over)

    def on_body(self, body: bytes) -> None:
        if not self._head_refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._head_refused:
            return
        super().on_message_complete()
        self._message_done = True
        if self._owed == "body" and not self.transport.is_closing():
            # The unread body is all in: the connection is idle again, keep-alive's to close.
            self._expect(None)
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self._owed == "headers":
            pass  # part of a pipelined request arrived while the last one was answered
        elif not self._message_done:
            self._expect("body")
        else:
            return
        # Data is owed, so this is no idle connection for keep-alive to close (nor does its
        # timer survive the next byte: uvicorn cancels it on every read).
        self._unset_keepalive_if_required()

    def connection_lost(self, exc: Exception | None) -> None:
        self._expect(None)
        super().connection_lost(exc)

    def _drop(self) -> None:
        drop(self.transport)

    def _expect(self, owed: str | None) -> None:
        if self._due is not None:
            self._due.cancel()
        self._owed = owed
        self._due = self.loop.call_later(self.timeouts[owed], self._timed_out) if owed else None

    def _timed_out(self) -> None:
        owed = self._owed
        self._owed = self._due = None
        if owed is None or self.transport.is_closing():
            return
        timeout = self.timeouts[owed]
        log.info("%s: the request's %s did not arrive within %g s: closed", _peer(self.client), owed, timeout)
        self.on_timeout(owed)
        if owed == "headers" and (self.cycle is None or self.cycle.response_complete):
            # Unless an answer is still going out: then it is only closed.
            self._answer(408, ApiError(Code.REQUEST_TIMEOUT, _MESSAGE.format(timeout)))
        self.transport.close()

    def _answer(self, status: int, error: ApiError) -> None:
        """Write `error` as the protocol's JSON error body, straight to the socket: the app never saw the request."""
        body = encode(ErrorBody(error.info()))
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)


_MESSAGE = "the request line and headers did not arrive within {:g} s"
_TOO_BIG = "the request line and headers are over the limit of {} bytes"
# More than one read of the transport's: how far past the limit an unfinished head may be read.
_READ_SLACK = 256 * 1024
# After a 431: how long, and how much more, a client still sending is read before the close.
_LINGER_S = 1.0
_LINGER_BYTES = 4 << 20


def _peer(client: tuple[str, int] | None) -> str:
    return "%s:%d" % client if client else "a client"


def uvicorn_options(settings: Settings, on_timeout: Callable[[str], None]) -> dict[str, Any]:
    """The `uvicorn.run`/`uvicorn.Config` keyword arguments that put these deadlines in the server;
    `on_timeout(phase)` counts each cut (`Metrics.client_timeout`)."""
    protocol = functools.partial(
        SlowClientProtocol,
        header_timeout=settings.header_timeout,
        body_timeout=settings.body_timeout,
        max_header_bytes=settings.max_header_bytes,
        send_buffer=settings.send_buffer,
        on_timeout=on_timeout,
    )
    return {"http": protocol, "loop": event_loop()}


def event_loop() -> str:
    """uvloop where it is installed (`uvicorn[standard]` installs it wherever it builds), else asyncio's."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
