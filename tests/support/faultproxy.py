"""A TCP proxy that speaks just enough HTTP/1.1 to break things on purpose.

It sits between a gateway and an executor on loopback, on an asyncio loop in a
thread of its own, and forwards everything unchanged until told otherwise:

- `cut_sockets()` closes every proxied WebSocket connection at once (no close
  frame: as if the network dropped it) while plain HTTP keeps working;
- `block_sockets(True)` makes new WebSocket handshakes fail (the connection is
  closed before any answer), so a gateway has to retry with backoff;
- `result_fault` breaks the responses to `GET /jobs/{id}/result`: "cut" (the
  body stops half-way and the connection closes), "corrupt" (one byte flipped,
  length and headers kept), "truncate" (the body shortened and its
  Content-Length with it, the SHA-256 header kept), "truncate_close" (no
  Content-Length: a shortened body delimited by closing the connection);
  `result_fault_times` says how many responses to break (None: all of them).

Requests are parsed one at a time per connection (keep-alive works); response
bodies are framed by Content-Length or chunked encoding. WebSocket upgrades
become a raw two-way pipe after the 101 answer.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

RESULT_PATH = re.compile(rb"^GET /jobs/[^/ ]+/result[ ?]")
FAULTS = ("cut", "corrupt", "truncate", "truncate_close")


class _Closed(Exception):
    pass


@dataclass
class _Head:
    first_line: bytes
    headers: list[tuple[bytes, bytes]]

    def get(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value.strip()
        return None

    def without(self, *names: bytes) -> list[tuple[bytes, bytes]]:
        return [(k, v) for k, v in self.headers if k.lower() not in names]

    def encode(self, headers: list[tuple[bytes, bytes]] | None = None) -> bytes:
        lines = [self.first_line] + [k + b": " + v for k, v in (self.headers if headers is None else headers)]
        return b"\r\n".join(lines) + b"\r\n\r\n"


async def _read_head(reader: asyncio.StreamReader) -> _Head:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise _Closed() from exc
    lines = raw[:-4].split(b"\r\n")
    headers = []
    for line in lines[1:]:
        key, _, value = line.partition(b":")
        headers.append((key.strip(), value.strip()))
    return _Head(lines[0], headers)


async def _read_body(reader: asyncio.StreamReader, head: _Head) -> bytes:
    """The body framed by Content-Length or chunked encoding, raw (chunk framing kept)."""
    try:
        length = head.get(b"content-length")
        if length is not None:
            return await reader.readexactly(int(length))
        if (head.get(b"transfer-encoding") or b"").lower() == b"chunked":
            parts = []
            while True:
                size_line = await reader.readuntil(b"\r\n")
                parts.append(size_line)
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    parts.append(await reader.readuntil(b"\r\n"))  # no trailers expected
                    return b"".join(parts)
                parts.append(await reader.readexactly(size + 2))
        return b""
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise _Closed() from exc


@dataclass
class ProxyStats:
    ws_attempts: list[float] = field(default_factory=list)  # monotonic times of WS handshakes seen
    ws_opened: int = 0
    ws_cut: int = 0
    result_requests: int = 0
    results_broken: int = 0
    requests: list[str] = field(default_factory=list)  # "METHOD path" of every HTTP request


class FaultProxy:
    """Forward 127.0.0.1:<port> to `upstream` (host, port), breaking what it is told to break."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.stats = ProxyStats()
        self.result_fault: str | None = None
        self.result_fault_times: int | None = None
        self._blocked = False
        self._ws_pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fault-proxy")
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    # -- control, from the test's thread ----------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            self._cut_all()

        self._call(close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def cut_sockets(self) -> int:
        """Drop every proxied WebSocket connection now; how many there were."""

        async def cut() -> int:
            return self._cut_all()

        return self._call(cut())

    def block_sockets(self, blocked: bool) -> None:
        self._blocked = blocked

    def break_results(self, fault: str | None, times: int | None = None) -> None:
        assert fault is None or fault in FAULTS, fault
        self.result_fault, self.result_fault_times = fault, times

    @property
    def ws_open(self) -> int:
        return len(self._ws_pairs)

    def _call(self, coro: Any, timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- the proxy, on its loop -------------------------------------------------

    def _cut_all(self) -> int:
        pairs = list(self._ws_pairs)
        self._ws_pairs.clear()
        for client, upstream in pairs:
            for writer in (client, upstream):
                writer.transport.abort()  # RST, no close frame
        self.stats.ws_cut += len(pairs)
        return len(pairs)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        up_w: asyncio.StreamWriter | None = None
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
            while True:
                request = await _read_head(client_r)
                body = await _read_body(client_r, request)
                self.stats.requests.append(request.first_line.decode(errors="replace"))
                if (request.get(b"upgrade") or b"").lower() == b"websocket":
                    self.stats.ws_attempts.append(time.monotonic())
                    if self._blocked:
                        return  # closed before any answer: the handshake fails
                    up_w.write(request.encode() + body)
                    response = await _read_head(up_r)
                    client_w.write(response.encode())
                    if response.first_line.split(b" ")[1:2] != [b"101"]:
                        client_w.write(await _read_body(up_r, response))
                        await client_w.drain()
                        continue
                    await self._pipe_websocket(client_r, client_w, up_r, up_w)
                    return
                up_w.write(request.encode() + body)
                response = await _read_head(up_r)
                payload = await _read_body(up_r, response)
                if RESULT_PATH.match(request.first_line) and response.first_line.split(b" ")[1:2] == [b"200"]:
                    self.stats.result_requests += 1
                    if await self._maybe_break(client_w, response, payload):
                        return
                client_w.write(response.encode() + payload)
                await client_w.drain()
                if (response.get(b"connection") or b"").lower() == b"close":
                    return
        except (_Closed, ConnectionError, OSError):
            pass
        finally:
            for writer in (client_w, up_w):
                if writer is not None:
                    writer.close()

    async def _maybe_break(self, client_w: asyncio.StreamWriter, response: _Head, payload: bytes) -> bool:
        """Send a broken answer if a fault is set; True when the connection must then close."""
        fault = self.result_fault
        if fault is None or self.result_fault_times == 0:
            return False
        if self.result_fault_times is not None:
            self.result_fault_times -= 1
        self.stats.results_broken += 1
        half = len(payload) // 2
        if fault == "corrupt":
            flipped = bytearray(payload)
            flipped[half] ^= 0x5A
            client_w.write(response.encode() + bytes(flipped))
            await client_w.drain()
            return False
        if fault == "truncate":
            headers = response.without(b"content-length") + [(b"Content-Length", str(half).encode())]
            client_w.write(response.encode(headers) + payload[:half])
            await client_w.drain()
            return False
        if fault == "truncate_close":
            headers = response.without(b"content-length", b"connection") + [(b"Connection", b"close")]
            client_w.write(response.encode(headers) + payload[:half])
            await client_w.drain()
            return True
        # "cut": the headers and the first part of the body, a pause, then the connection drops.
        client_w.write(response.encode() + payload[: min(half, 1 << 16)])
        await client_w.drain()
        await asyncio.sleep(0.05)
        client_w.transport.abort()
        return True

    async def _pipe_websocket(
        self,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        up_r: asyncio.StreamReader,
        up_w: asyncio.StreamWriter,
    ) -> None:
        pair = (client_w, up_w)
        self._ws_pairs.add(pair)
        self.stats.ws_opened += 1

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(1 << 16):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        try:
            await asyncio.gather(pump(client_r, up_w), pump(up_r, client_w))
        finally:
            self._ws_pairs.discard(pair)


def upstream_of(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").rstrip("/").rpartition(":")
    return host, int(port)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.01)
