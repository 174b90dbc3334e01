"""A remote gateway's result download, against a small executor stand-in that misbehaves on request.

The stand-in answers `GET /jobs/{id}/result` on a real loopback socket, one
answer per request from a script of modes (well-formed, corrupt, cut, stalled,
without its checks, an error status, a connection dropped as the request
arrives, bytes past the body). Each download runs both ways an `ExecutorLink` has: its
own reader (`recv_into` a buffer of the Content-Length) and httpx, the way it
takes behind a proxy. Also here: the executor's `ResultResponse` slices.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from backends import download
from backends.executor import RESULT_CHUNK, ResultResponse
from backends.download import Retry
from backends.remote import ExecutorLink
from gateway.plumbing.logs import request_id

BODY = os.urandom(5 * download.HASH_STEP + 12345)  # several hashing drains, and a ragged end
TOKEN = "download-token"


class StandIn:
    """An executor's result endpoint on loopback; `modes` says how to answer each request in turn."""

    def __init__(self, body: bytes = BODY) -> None:
        self.body = body
        self.modes: list[str] = []
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._handlers.add(asyncio.current_task())  # type: ignore[arg-type]
        try:
            while True:
                self.requests.append(await reader.readuntil(b"\r\n\r\n"))
                if not await self._answer(self.modes.pop(0) if self.modes else "ok", reader, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.transport.abort()

    async def _answer(self, mode: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Write one answer; False when the connection is to close."""
        body = self.body
        headers = {"Content-Length": str(len(body)), "X-Content-SHA256": hashlib.sha256(body).hexdigest()}
        status = "200 OK"
        if mode == "drop":
            return False
        if mode == "corrupt":
            body = bytearray(body)
            body[len(body) // 2] ^= 0x5A
        elif mode == "no_hash":
            del headers["X-Content-SHA256"]
        elif mode == "chunked":
            del headers["Content-Length"]
            headers["Transfer-Encoding"] = "chunked"
            body = b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
        elif mode in ("404", "503", "404_chunked"):
            status = f"{mode[:3]} Nope"
            body = b'{"error": {"code": "not_found", "message": "no job j1 here"}}'
            headers = {"Content-Length": str(len(body)), "Content-Type": "application/json"}
            if mode == "404_chunked":
                del headers["Content-Length"]
                headers["Transfer-Encoding"] = "chunked"
                body = b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
        elif mode == "extra":
            body = body + b"garbage"
        elif mode == "close":
            headers["Connection"] = "keep-alive, close"
        interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" if mode == "interim" else b""
        if mode == "silent":  # the request arrived and nothing ever comes back
            await reader.read()
            return False
        head = interim.decode() + f"HTTP/1.1 {status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        writer.write(head.encode())
        if mode == "cut":
            writer.write(body[: len(body) // 2])
            await writer.drain()
            return False
        if mode == "stall":
            writer.write(body[:1000])
            await writer.drain()
            await reader.read()  # until the client gives up
            return False
        writer.write(body)
        await writer.drain()
        return True

    async def __aenter__(self) -> StandIn:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self.server is not None
        self.server.close()
        for handler in self._handlers:
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)


@pytest.fixture
async def stand_in() -> AsyncIterator[StandIn]:
    async with StandIn() as server:
        yield server


@pytest.fixture(params=["direct", "httpx"])
async def link(request: pytest.FixtureRequest, stand_in: StandIn) -> AsyncIterator[ExecutorLink]:
    made = ExecutorLink(stand_in.url, token=TOKEN, deadline=30, poll_interval=1, on_tools=lambda: None)
    made.downloads.direct = request.param == "direct"
    try:
        yield made
    finally:
        await made.stop()


async def test_an_intact_result_arrives_whole_and_the_connection_is_kept(link: ExecutorLink, stand_in: StandIn) -> None:
    for _ in range(3):
        assert bytes(await link.downloads.fetch("j1")) == BODY
    assert stand_in.connections == 1
    request = stand_in.requests[0].decode("latin-1")
    assert request.startswith("GET /jobs/j1/result HTTP/1.1\r\n")
    assert f"Authorization: Bearer {TOKEN}" in request


@pytest.mark.parametrize("size", [0, 1, download.HASH_INLINE, download.HASH_STEP, download.HASH_STEP + 1])
async def test_results_of_every_size_arrive_whole(link: ExecutorLink, stand_in: StandIn, size: int) -> None:
    stand_in.body = os.urandom(size)
    assert bytes(await link.downloads.fetch("j1")) == stand_in.body


async def test_the_request_id_goes_along(link: ExecutorLink, stand_in: StandIn) -> None:
    token = request_id.set("rid-123")
    try:
        await link.downloads.fetch("j1")
    finally:
        request_id.reset(token)
    assert "x-request-id: rid-123" in stand_in.requests[0].decode("latin-1").lower()


@pytest.mark.parametrize(
    ("mode", "error", "says"),
    [
        ("corrupt", Retry, "corrupt"),
        ("cut", Retry, None),
        ("no_hash", Retry, "cannot be checked"),
        ("chunked", Retry, "cannot be checked"),
        ("503", Retry, "HTTP 503"),
        ("404", ValueError, "no job j1 here"),
        ("404_chunked", ValueError, "HTTP 404"),
    ],
)
async def test_a_broken_answer_is_an_error_and_the_next_one_arrives(
    link: ExecutorLink, stand_in: StandIn, mode: str, error: type[Exception], says: str | None
) -> None:
    stand_in.modes = [mode]
    with pytest.raises(error, match=says):
        await link.downloads.fetch("j1")
    assert bytes(await link.downloads.fetch("j1")) == BODY


async def test_a_cut_body_says_how_much_came(stand_in: StandIn) -> None:
    link = ExecutorLink(stand_in.url, token=None, deadline=30, poll_interval=1, on_tools=lambda: None)
    stand_in.modes = ["cut"]
    try:
        with pytest.raises(Retry, match=rf"truncated: \d+ of {len(BODY)} bytes"):
            await link.downloads.fetch("j1")
    finally:
        await link.stop()


async def test_a_stalled_answer_times_out(link: ExecutorLink, stand_in: StandIn) -> None:
    link.http.timeout = httpx.Timeout(5.0, read=0.3)
    stand_in.modes = ["stall"]
    started = asyncio.get_running_loop().time()
    with pytest.raises(Retry):
        await link.downloads.fetch("j1")
    assert asyncio.get_running_loop().time() - started < 3


async def test_a_kept_connection_dropped_as_the_request_arrives_is_replaced(stand_in: StandIn) -> None:
    link = ExecutorLink(stand_in.url, token=None, deadline=30, poll_interval=1, on_tools=lambda: None)
    try:
        await link.downloads.fetch("j1")
        stand_in.modes = ["drop"]  # the executor's keep-alive ran out just as the request went
        assert bytes(await link.downloads.fetch("j1")) == BODY
        assert stand_in.connections == 2
        stand_in.modes = ["drop", "drop"]  # kept, then fresh: a fresh one that drops is a failure
        with pytest.raises(Retry, match="closed before an answer"):
            await link.downloads.fetch("j1")
    finally:
        await link.stop()


async def test_interim_answers_are_passed_over(link: ExecutorLink, stand_in: StandIn) -> None:
    stand_in.modes = ["interim"]
    assert bytes(await link.downloads.fetch("j1")) == BODY


async def test_an_answer_that_closes_its_connection_is_not_kept(stand_in: StandIn) -> None:
    link = ExecutorLink(stand_in.url, token=None, deadline=30, poll_interval=1, on_tools=lambda: None)
    try:
        stand_in.modes = ["close"]
        assert bytes(await link.downloads.fetch("j1")) == BODY
        assert not link.downloads.idle
        assert bytes(await link.downloads.fetch("j1")) == BODY
        assert (stand_in.connections, len(stand_in.requests)) == (2, 2)
    finally:
        await link.stop()


async def test_silence_on_a_kept_connection_is_one_try_not_a_request_per_connection(stand_in: StandIn) -> None:
    link = ExecutorLink(stand_in.url, token=None, deadline=30, poll_interval=1, on_tools=lambda: None)
    link.http.timeout = httpx.Timeout(5.0, read=0.3)
    try:
        await asyncio.gather(*(link.downloads.fetch("j1") for _ in range(download.IDLE_CONNECTIONS)))
        assert len(link.downloads.idle) == download.IDLE_CONNECTIONS
        sent = len(stand_in.requests)
        stand_in.modes = ["silent"] * 10
        with pytest.raises(Retry, match="timed out"):
            await link.downloads.fetch("j1")
        assert len(stand_in.requests) == sent + 1, "a timeout is a try: the request is not sent again"
    finally:
        await link.stop()


async def test_no_more_than_a_few_connections_are_kept(stand_in: StandIn) -> None:
    link = ExecutorLink(stand_in.url, token=None, deadline=30, poll_interval=1, on_tools=lambda: None)
    try:
        many = download.IDLE_CONNECTIONS + 2
        results = await asyncio.gather(*(link.downloads.fetch("j1") for _ in range(many)))
        assert all(bytes(r) == BODY for r in results)
        assert stand_in.connections == many
        assert len(link.downloads.idle) == download.IDLE_CONNECTIONS
    finally:
        await link.stop()


@pytest.mark.parametrize(
    ("no_proxy", "url", "direct"),
    [  # httpx's NO_PROXY rules, which differ from urllib's on the first and the last
        (".example.com", "http://example.com:8000", False),  # a leading dot: subdomains only
        ("example.com", "http://example.com:8000", True),
        ("example.com:8000", "http://example.com:8000", True),
        ("other.org", "http://example.com:8000", False),
        ("", "http://127.0.0.1:8000", False),
        ("127.0.0.1", "http://127.0.0.1:8000", True),
        ("*", "http://example.com:8000", True),
    ],
)
def test_downloads_take_a_proxy_where_httpx_would(
    monkeypatch: pytest.MonkeyPatch, no_proxy: str, url: str, direct: bool
) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("NO_PROXY", no_proxy)
    link = ExecutorLink(url, token=None, deadline=30, poll_interval=1, on_tools=lambda: None)
    assert link.downloads.direct is direct


def test_without_a_proxy_downloads_are_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert ExecutorLink("http://example.com:8000", token=None, deadline=30, poll_interval=1, on_tools=lambda: None).downloads.direct


async def test_bytes_past_the_body_retire_the_connection(stand_in: StandIn) -> None:
    link = ExecutorLink(stand_in.url, token=None, deadline=30, poll_interval=1, on_tools=lambda: None)
    try:
        stand_in.modes = ["extra"]
        assert bytes(await link.downloads.fetch("j1")) == BODY
        assert bytes(await link.downloads.fetch("j1")) == BODY
        assert stand_in.connections == 2
    finally:
        await link.stop()


async def test_a_download_cancelled_midway_leaves_no_connection_out_of_step(stand_in: StandIn) -> None:
    link = ExecutorLink(stand_in.url, token=None, deadline=30, poll_interval=1, on_tools=lambda: None)
    try:
        stand_in.modes = ["stall"]
        download = asyncio.ensure_future(link.downloads.fetch("j1"))
        await asyncio.sleep(0.2)
        download.cancel()
        with pytest.raises(asyncio.CancelledError):
            await download
        assert not link.downloads.idle
        assert bytes(await link.downloads.fetch("j1")) == BODY
    finally:
        await link.stop()


@pytest.mark.parametrize("size", [0, 1, RESULT_CHUNK - 1, RESULT_CHUNK, RESULT_CHUNK + 1, 3 * RESULT_CHUNK + 7])
@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_the_executor_sends_a_result_as_slices_of_it(size: int, method: str) -> None:
    data = os.urandom(size)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        raise AssertionError("a result answer reads nothing")

    await ResultResponse(data, "feed")({"type": "http", "method": method}, receive, send)
    start, *body = sent
    assert dict(start["headers"])[b"content-length"] == str(size).encode()
    assert dict(start["headers"])[b"x-content-sha256"] == b"feed"
    assert b"".join(bytes(m["body"]) for m in body) == (data if method == "GET" else b"")
    assert [m.get("more_body", False) for m in body] == [True] * (len(body) - 1) + [False]
    assert all(len(m["body"]) <= RESULT_CHUNK for m in body)
