"""Readers that never read: a big result written to a client that stopped reading is cut by
the write timeout, its terminal event included, and what a connection holds unsent is bounded
(gateway/plumbing/sendbuffer.py), for event streams, snapshots and the OpenAI routes alike.

A real gateway on loopback (uvicorn, the protocol of gateway/plumbing/slowclients.py, as
`streamgate serve` builds it), followed through raw sockets whose receive buffer is
set small before connecting, so that the window they offer stays small.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import socket
import struct
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from gateway.plumbing.sendbuffer import PIECE
from gateway.server.stream import WATCH_PERIOD_S
from gateway.tools import Context, Model, tool
from tests.conftest import Server, make_server, parse_sse, run_stream, wait_until
from tests.test_observability import scrape, value
from tests.test_slow_clients import timeouts

TIMEOUT = 1.0  # the write timeout of the servers under test
RESULT = 8 << 20  # characters of the big result: many times what a connection may hold
HIGH_WATER = 64 * 1024  # the transport's, where uvicorn's flow control pauses a response (uvloop and asyncio alike)
SEND_BUFFER = 512 * 1024  # --send-buffer's default
# What one connection may hold unsent: the transport's high-water mark and a piece, and the
# kernel's send buffer (Linux books twice SO_SNDBUF, payload and its overhead together).
PER_CONNECTION = HIGH_WATER + PIECE + 2 * SEND_BUFFER


class BigParams(msgspec.Struct, forbid_unknown_fields=True):
    size: int


class BigResult(msgspec.Struct):
    text: str


@tool
def big(model: Model, params: BigParams, ctx: Context) -> BigResult:
    """A result of `size` characters."""
    return BigResult("x" * params.size)


@pytest.fixture(scope="module")
def server(tiny_model_path: Path) -> Any:
    s = make_server(tiny_model_path, tools=[big], write_timeout=TIMEOUT)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def job_id(server: Server) -> str:
    """A finished job with a big result, read whole once."""
    done = run_stream(server.url, "big", {"size": RESULT})
    assert done.terminal["event"] == "data" and len(done.terminal["data"]["text"]) == RESULT
    return done.headers["x-job-id"]


def never_reads(server: Server, request: bytes) -> socket.socket:
    """A client that sends `request` and reads nothing."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window stays small
    sock.connect((host, int(port)))
    sock.sendall(request)
    return sock


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def post(path: str, body: Any) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


def held(server: Server, socks: list[socket.socket]) -> list[int]:
    """The bytes the server holds unsent for each of `socks` it still has a connection with: in its
    transport's buffer and (on Linux) in its socket's kernel send queue."""
    ports = {sock.getsockname()[1] for sock in socks}
    connections = server._server.server_state.connections  # type: ignore[union-attr]
    if not (some := next(iter(list(connections)), None)):
        return []

    async def measure() -> list[int]:  # on the server's loop, where no connection ends meanwhile
        sizes = []
        for protocol in connections:
            if not (protocol.client and protocol.client[1] in ports):
                continue
            transport = protocol.transport
            sock = transport.get_extra_info("socket")
            if sock is None or sock.fileno() < 0:
                continue  # dropped, and told at the loop's next turn: it holds nothing
            queued = 0
            if sys.platform == "linux":
                queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
            sizes.append(transport.get_write_buffer_size() + queued)
        return sizes

    return asyncio.run_coroutine_threadsafe(measure(), some.loop).result(timeout=10)


def read_until_reset(sock: socket.socket) -> int:
    """The bytes `sock` still gets before the server's reset: a connection dropped with what it had
    not sent, not closed (a close would deliver the rest, then end it)."""
    sock.settimeout(10)
    got = 0
    with pytest.raises(ConnectionResetError):
        while chunk := sock.recv(1 << 20):
            got += len(chunk)
        raise AssertionError(f"the connection was closed, not reset, after {got} bytes")
    return got


@contextlib.contextmanager
def server_errors() -> Iterator[list[str]]:
    """What uvicorn logs as errors meanwhile: a response its app left unfinished, for one."""
    errors: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        yield errors
    finally:
        logger.removeHandler(handler)


def open_streams(server: Server) -> float:
    return value(scrape(server.url), "streamgate_active_streams")


def test_a_follower_that_never_reads_a_big_result_is_cut_at_the_write_timeout_and_frees_its_slot(
    server: Server, job_id: str
) -> None:
    before = timeouts(server)["write"]
    started = time.monotonic()
    with server_errors() as errors, never_reads(server, get(f"/jobs/{job_id}/events")) as sock:
        # The result's pieces stall at once; the stalled write is cut one write timeout later,
        # on the watcher's next look.
        wait_until(lambda: timeouts(server)["write"] > before, TIMEOUT + WATCH_PERIOD_S + 5, "the stalled follower to be cut")
        assert time.monotonic() - started >= TIMEOUT * 0.9
        wait_until(lambda: not held(server, [sock]), 5, "the server to drop the connection")
        assert open_streams(server) == 0
        got = read_until_reset(sock)
    assert got < RESULT  # cut, not a result delivered late
    assert not errors  # to the server, a client gone: not a response left unfinished


def test_followers_that_never_read_hold_a_bounded_amount_until_they_are_cut(server: Server, job_id: str) -> None:
    followers = [never_reads(server, get(f"/jobs/{job_id}/events")) for _ in range(16)]
    try:
        wait_until(lambda: len(held(server, followers)) == len(followers), 10, "the followers to be connected")
        wait_until(lambda: open_streams(server) == len(followers), 10, "their streams to open")
        # Sampled until the write timeout has cut them all.
        peak, each, deadline = 0, 0, time.monotonic() + TIMEOUT + WATCH_PERIOD_S + 10
        while sizes := held(server, followers):
            peak, each = max(peak, sum(sizes)), max(each, *sizes)
            assert time.monotonic() < deadline, f"{len(sizes)} followers not cut"
            time.sleep(0.02)
        assert open_streams(server) == 0
        # Unbounded, each held its copy of the result: 16 x 8 MB. Bounded, a connection holds
        # a piece and the buffers' marks, and the largest sampled held at least a piece.
        assert PIECE <= each <= PER_CONNECTION, each
        assert peak <= len(followers) * PER_CONNECTION, peak
    finally:
        for sock in followers:
            sock.close()


def test_a_slow_reader_that_keeps_reading_gets_the_whole_result(server: Server, job_id: str) -> None:
    """Each piece is timed on its own: a result that takes longer than the write timeout to read is not cut."""
    pace = 3 << 20  # bytes a second: the 8 MB result takes nearly 3 write timeouts
    with never_reads(server, get(f"/jobs/{job_id}/events")) as sock:
        sock.settimeout(10)
        raw, started = bytearray(), time.monotonic()
        while not raw.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's end
            chunk = sock.recv(64 * 1024)
            assert chunk, f"the server closed the stream after {len(raw)} bytes"
            raw += chunk
            time.sleep(max(0.0, len(raw) / pace - (time.monotonic() - started)))
    assert time.monotonic() - started > 2 * TIMEOUT
    events = parse_sse(dechunk(bytes(raw)))
    assert events[-1]["event"] == "data" and events[-1]["data"]["text"] == "x" * RESULT


def dechunk(raw: bytes) -> bytes:
    """The body of a whole HTTP/1.1 response with a chunked body."""
    rest = raw.partition(b"\r\n\r\n")[2]
    body = bytearray()
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(body)
        body += rest[:size]
        rest = rest[size + 2 :]


def test_a_snapshot_of_a_big_result_to_a_client_that_never_reads_is_cut(server: Server, job_id: str) -> None:
    """`GET /jobs/{id}` carries the result: a whole answer is written as a stream's big event is."""
    before = timeouts(server)["write"]
    with never_reads(server, get(f"/jobs/{job_id}")) as sock:
        wait_until(lambda: timeouts(server)["write"] > before, TIMEOUT + 5, "the stalled answer to be cut")
        wait_until(lambda: not held(server, [sock]), 5, "the server to drop the connection")
        got = read_until_reset(sock)
    assert got < RESULT
    # Read at once, it arrives whole.
    response = httpx.get(f"{server.url}/jobs/{job_id}", timeout=30)
    assert response.status_code == 200 and response.json()["terminal"]["data"]["text"] == "x" * RESULT


# The OpenAI routes: echo and logprobs of every prompt token (lm-eval's loglikelihood) make an
# answer of about 1.5 MB on the tiny model; a send buffer of 64 KiB makes that many times what
# a connection holds.
SCORING = {"prompt": ["abcdefghij" * 25] * 32, "max_tokens": 0, "echo": True, "logprobs": 20, "temperature": 0}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_openai_answer_to_a_client_that_never_reads_is_cut(tiny_model_path: Path, stream: bool) -> None:
    server = make_server(tiny_model_path, write_timeout=TIMEOUT, send_buffer=64 * 1024)
    try:
        before = timeouts(server)["write"]
        with never_reads(server, post("/v1/completions", {**SCORING, "stream": stream})) as sock:
            wait_until(lambda: timeouts(server)["write"] > before, 30, "the stalled answer to be cut")
            wait_until(lambda: not held(server, [sock]), 5, "the server to drop the connection")
            assert open_streams(server) == 0
            got = read_until_reset(sock)
        assert got < 1_000_000
    finally:
        server.stop()
