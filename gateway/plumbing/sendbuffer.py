"""What a response has sent and its client has not read yet: bounded per connection, in the write timeout's sight.

uvicorn's `send` never waits for the bytes it writes: the transport takes any
amount into its buffer, and flow control only makes the *next* `send` wait
while that buffer is over its high-water mark (64 KiB). A body sent in one
`send` went whole into the connection's buffers, however slowly it was read,
and the response ended at once, its handler and its stream slot with it:
twenty followers that never read a 56 MB result held 1.2 GB, in the
transports and in kernel send buffers auto-tuned to 4 MB each, with no write
blocked for the write timeout to see. The one rule here: a connection holds
at most the transport's high-water mark, one `PIECE` and its kernel send
buffer of a response's bytes, and a client that stops reading them is cut by
the write timeout, the last of them included.

- A body over `PIECE` goes out a piece per `send` (`pieces`): flow control
  waits between pieces, so a reader that stopped blocks a `send`, which the
  write timeout sees. Each piece is timed on its own: a slow reader that keeps
  reading is not cut, however big the body.
- Such a body is followed by an empty `send`, which waits as the others do:
  the body counts as sent (a response that it ends ends) once the transport
  has drained below its low-water mark, not once it took the bytes.
- The kernel's send buffer is fixed at `--send-buffer` (`limit_send_buffer`,
  on every connection, by gateway/plumbing/slowclients.py) rather than auto-tuned.
- A connection cut for its write timeout is dropped (`cut`, `drop`), with
  what it has not sent: closed as usual, its transport would hold the unsent
  bytes, and the socket, until the client read them, which it never does.

Bodies up to `PIECE`, which is nearly every event, go out in one `send` as
before: the check costs one length comparison.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.protocol import Kept

log = logging.getLogger("streamgate.sendbuffer")

# Big enough that a multi-MB result takes a few hundred `send`s, not thousands; small
# enough that one piece over the high-water mark is little per connection.
PIECE = 256 * 1024

# The ASGI scope extension gateway/plumbing/slowclients.py puts in every request: `drop`s its connection.
DROP = "streamgate.drop"


async def part_pieces(parts: Sequence[bytes | Kept], more_body: bool) -> AsyncIterator[Message]:
    """`pieces` for a body in parts: bytes, and data kept in the result spool (gateway/plumbing/spool.py),
    read a `PIECE` at a time as it is sent: a reader of a kept result never holds more than a piece of it.
    Small parts are sent together, up to a piece."""
    pending: list[bytes] = []
    held = 0
    for part in parts:
        if isinstance(part, bytes):
            if held + len(part) <= PIECE:
                pending.append(part)
                held += len(part)
                continue
            if pending:
                yield {"type": "http.response.body", "body": b"".join(pending), "more_body": True}
                pending, held = [], 0
            for start in range(0, len(part), PIECE):
                yield {"type": "http.response.body", "body": part[start : start + PIECE], "more_body": True}
            continue
        if pending:
            yield {"type": "http.response.body", "body": b"".join(pending), "more_body": True}
            pending, held = [], 0
        async with contextlib.aclosing(part.pieces(PIECE)) as read:
            async for piece in read:
                yield {"type": "http.response.body", "body": piece, "more_body": True}
    if pending:
        yield {"type": "http.response.body", "body": b"".join(pending), "more_body": True}
    yield {"type": "http.response.body", "body": b"", "more_body": more_body}


def pieces(body: bytes, more_body: bool) -> Iterator[Message]:
    """The `http.response.body` messages that send `body` a `PIECE` at a time, then an empty one
    (with `more_body`): it writes nothing but, as every `send`, waits while the transport's buffer
    is over its high-water mark, so that `body` counts as sent once it has drained."""
    for start in range(0, len(body), PIECE):
        yield {"type": "http.response.body", "body": body[start : start + PIECE], "more_body": True}
    yield {"type": "http.response.body", "body": b"", "more_body": more_body}


async def cut(scope: Scope, count: Callable[[], None], timeout: float | None) -> None:
    """A client that stopped reading for `timeout` seconds: counted (`count`), and its
    connection dropped with the bytes it has not sent, where the server offers it (`DROP`)."""
    # A known end, not an error with a traceback: a half-open connection, a stalled proxy, or a client that never reads.
    count()
    log.warning("a client stopped reading for %g s: its connection is cut", timeout)
    dropper = scope.get("extensions", {}).get(DROP)
    if dropper is not None:
        dropper()
        # The transport tells the server at its next turn: let it, so that the server sees a
        # client gone, not a response left unfinished.
        await asyncio.sleep(0)


def drop(transport: asyncio.BaseTransport) -> None:
    """Close the connection now, discarding what it has not sent: the transport's buffer and the kernel's."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        # Lingering zero seconds: the close resets the connection. Closed the usual way, the kernel
        # would go on offering its buffer to a client that does not read it, for minutes.
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass  # gone already
    transport.abort()


def limit_send_buffer(transport: asyncio.BaseTransport, size: int) -> None:
    """Fix the connection's kernel send buffer (SO_SNDBUF) at `size` bytes (Linux doubles it, for its bookkeeping)."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
    except OSError as exc:  # a socket gone before it was set up: nothing to bound
        log.debug("SO_SNDBUF not set: %s", exc)


class WholeResponse(Response):
    """A whole answer that may be big (a job's snapshot carries its result): a body over
    `PIECE`, or one with parts kept in the result spool (`parts`, gateway/protocol.py `splice`), is
    sent in pieces, each within `send_timeout`, and past it the connection is cut
    (`on_write_timeout` counts it). A body up to `PIECE` is sent as any `Response`."""

    def __init__(
        self,
        content: bytes | Sequence[bytes | Kept],
        *,
        send_timeout: float,
        on_write_timeout: Callable[[], None],
        status_code: int = 200,
        headers: dict[str, str] | None = None,
        media_type: str = "application/json",
    ) -> None:
        parts = [content] if isinstance(content, bytes) else list(content)
        whole = len(parts) == 1 and isinstance(parts[0], bytes)
        super().__init__(parts[0] if whole else b"", status_code=status_code, headers=headers, media_type=media_type)
        self.parts = parts
        if not whole:
            length = sum(len(part) if isinstance(part, bytes) else part.size for part in parts)
            self.headers["content-length"] = str(length)
        self.send_timeout = send_timeout
        self._on_write_timeout = on_write_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        whole = len(self.parts) == 1 and isinstance(self.parts[0], bytes)
        if (whole and len(self.body) <= PIECE) or scope.get("method") == "HEAD":
            await super().__call__(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async with contextlib.aclosing(part_pieces(self.parts, more_body=False)) as messages:
            async for message in messages:
                try:
                    async with asyncio.timeout(self.send_timeout):
                        await send(message)
                except TimeoutError:
                    await cut(scope, self._on_write_timeout, self.send_timeout)
                    return
