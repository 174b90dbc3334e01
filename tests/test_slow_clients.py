"""Slow and half-open clients: headers or a body trickled past their deadline get 408
`request_timeout` and are cut, a client that stops reading is detached, each counted
in `/metrics`; none of them holds a job slot, and the server serves others meanwhile.

A real gateway on loopback (uvicorn, the protocol of gateway/plumbing/slowclients.py, as
`streamgate serve` builds it), driven through raw sockets.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from gateway.cli import commands as cli
from gateway.plumbing.slowclients import SlowClientProtocol
from tests.conftest import Server, make_server, run_stream, track_jobs, wait_until
from tests.test_deadlines import flood
from tests.test_observability import scrape, value
from tests.support.user_tools import echo

TIMEOUT = 1.0  # the header, body and write timeouts of the server under test
EVERY = 0.3  # seconds between trickled bytes, so that no deadline falls right on a send
COUNTER = "streamgate_client_timeouts_total"


@pytest.fixture(scope="module")
def server(tiny_model_path: Path) -> Iterator[Server]:
    """A gateway with 1 s deadlines and room for one waiting job."""
    s = make_server(
        tiny_model_path, tools=[echo, flood], header_timeout=TIMEOUT, body_timeout=TIMEOUT, write_timeout=TIMEOUT,
        queue_size=1,
    )
    yield s
    s.stop()


def connect(server: Server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def trickle(sock: socket.socket, data: bytes) -> bytes:
    """Send `data` one byte every EVERY s, reading what the server sends meanwhile, until it
    closes the connection; all it sent."""
    sock.settimeout(EVERY)
    received = b""
    try:
        for byte in data:
            sock.sendall(bytes([byte]))
            try:
                while chunk := sock.recv(65536):
                    received += chunk
                return received
            except TimeoutError:
                continue
    except (BrokenPipeError, ConnectionResetError):  # a byte sent as it closed
        return received
    raise AssertionError(f"the server took the whole trickle without closing; it sent {received!r}")


def read_to_end(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response with a Content-Length, leaving the connection open."""
    sock.settimeout(5)
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += sock.recv(65536)
    head, _, body = raw.partition(b"\r\n\r\n")
    status, headers = parse_head(head)
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return status, headers, body


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    status_line, *lines = head.decode("latin-1").split("\r\n")
    fields = (line.split(":", 1) for line in lines)
    return int(status_line.split()[1]), {name.strip().lower(): v.strip() for name, v in fields}


def assert_408(raw: bytes) -> dict[str, Any]:
    """`raw` is a whole 408 answer that closes the connection; its JSON error."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status, headers = parse_head(head)
    assert status == 408, raw
    assert headers["connection"] == "close"
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and error["retryable"] is False, error
    return error


def timeouts(server: Server) -> dict[str, float]:
    samples = scrape(server.url)
    return {phase: value(samples, COUNTER, phase=phase) for phase in ("headers", "body", "write")}


def request(path: str = "/healthz", body: bytes | None = None) -> bytes:
    """A GET of `path`, or with `body` the head of a POST of it (the body is the caller's to send)."""
    if body is None:
        return f"GET {path} HTTP/1.1\r\nHost: x\r\nUser-Agent: a-slow-one\r\n\r\n".encode()
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()


@contextlib.contextmanager
def cut(server: Server, phase: str, clients: int = 1) -> Iterator[dict[str, float]]:
    """The block's `clients` are cut in `phase`, about TIMEOUT after it starts, and nobody else is;
    gives the counts from before."""
    started = time.monotonic()  # before the scrape, which a busy machine may take a while to answer
    before = timeouts(server)
    yield before
    assert TIMEOUT * 0.9 <= time.monotonic() - started < TIMEOUT + 2
    assert timeouts(server) == {**before, phase: before[phase] + clients}


def test_headers_trickled_or_never_sent_get_408_and_are_closed_while_others_are_served(server: Server) -> None:
    with connect(server) as trickling, connect(server) as silent, ThreadPoolExecutor(2) as pool:
        with cut(server, "headers", clients=2):
            trickled = pool.submit(trickle, trickling, request())
            said_nothing = pool.submit(read_to_end, silent)
            # Meanwhile the server answers everyone else.
            assert httpx.get(server.url + "/healthz").status_code == 200
            assert not trickled.done() and not said_nothing.done()
            error = assert_408(trickled.result())
            assert_408(said_nothing.result())  # read to the end: the server closed the connection
    assert error["message"] == "the request line and headers did not arrive within 1 s"


def test_a_kept_alive_connection_idle_between_requests_is_not_cut_but_a_slow_next_request_is(server: Server) -> None:
    with connect(server) as sock:
        sock.sendall(request())
        assert read_response(sock)[0] == 200
        # Idle past the header timeout: nothing is sent and the connection stays open
        # (uvicorn's keep-alive timeout, 5 s, governs idle connections).
        sock.settimeout(TIMEOUT + 0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1)
        sock.sendall(request("/readyz"))
        assert read_response(sock)[0] == 200
        with cut(server, "headers"):  # the next request's clock starts at its first byte
            assert_408(trickle(sock, request()))


def test_a_trickled_body_gets_408_and_never_becomes_a_job(server: Server) -> None:
    jobs = track_jobs(server)
    body = json.dumps({"text": "slow"}).encode()
    with connect(server) as sock, ThreadPoolExecutor(1) as pool:
        sock.sendall(request("/echo/run", body))
        with cut(server, "body"):
            trickled = pool.submit(trickle, sock, body)
            # With one waiting job allowed, jobs still run while the trickle waits: it holds no slot.
            assert run_stream(server.url, "echo", {"text": "a", "repeat": 3}).terminal["event"] == "data"
            assert not trickled.done()
            error = assert_408(trickled.result())
    assert error["message"].startswith("the request body did not arrive within 1 s")
    assert [job.params.repeat for job in jobs.values()] == [3]  # the trickled request made none


def test_a_body_trickled_after_its_answer_is_cut_after_the_body_timeout(server: Server) -> None:
    with connect(server) as sock, cut(server, "body"):
        # Answered 404 at once, unread; without a deadline uvicorn would take the trickle for ever.
        sock.sendall(request("/nowhere", b"x" * 40))
        head, _, body = trickle(sock, b"x" * 40).partition(b"\r\n\r\n")
    assert parse_head(head)[0] == 404 and json.loads(body)["error"]["code"] == "not_found"


def test_a_client_that_stops_reading_is_cut_after_the_write_timeout(server: Server) -> None:
    with connect(server) as sock, cut(server, "write") as before:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # full at once: the server's writes block
        sock.sendall(request("/flood/run"))
        wait_until(lambda: timeouts(server)["write"] > before["write"], 10, "the stalled stream to be cut")


@pytest.mark.parametrize("command", ["serve", "executor"])
def test_the_commands_build_their_servers_with_the_deadlines(
    command: str, monkeypatch: pytest.MonkeyPatch, tiny_model_path: Path
) -> None:
    import uvicorn

    started: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: started.update(app=app, **kwargs))
    monkeypatch.setattr("gateway.plumbing.logs.configure_logging", lambda *args, **kwargs: None)
    where = ["--backend", "remote", "--executor", "http://127.0.0.1:9"] if command == "serve" else ["--model", str(tiny_model_path)]
    result = CliRunner().invoke(
        cli.main,
        [command, *where, "--header-timeout", "2.5", "--body-timeout", "7", "--send-buffer", "256KiB"],
        env={name: None for name in os.environ if name.startswith("STREAMGATE_")},
    )
    assert result.exit_code == 0, result.output
    http = started["http"]
    assert http.func is SlowClientProtocol and started["loop"] == "uvloop"
    assert (http.keywords["header_timeout"], http.keywords["body_timeout"]) == (2.5, 7)
    assert http.keywords["send_buffer"] == 256 * 1024
    state = started["app"].state
    assert (state.settings.body_timeout if command == "serve" else state.executor.body_timeout) == 7
