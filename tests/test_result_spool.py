"""Results kept once, on disk: the result spool (gateway/plumbing/spool.py) and the store's memory bound.

The spool on its own first: records written and read back byte for byte, a segment closed only
once its records are released and its readers done, and the room promised to admitted jobs.
A finished job's many events (a long generation's partials) go to the spool too, and read back
the same from any point. Then a real `streamgate serve` with its engine process: a big result is
spooled, and read back whole by its stream, a resume and its snapshot; so are a long log's events; a full spool refuses a job before it is queued
(503 with Retry-After) and one that could never fit with 413; a gateway's memory stays flat over
many big results read in turn, and under a hundred followers of one result that never read.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.errors import ApiError
from gateway.eventlog import KeptLog
from gateway.jobs import Job
from gateway.plumbing.spool import PIECE, SEGMENT_BYTES, ResultSpool
from gateway.protocol import Code
from gateway.server.store import FinishedResults
from tests.conftest import parse_sse, run_stream, wait_until
from tests.support.processes import ServeProcess, clean_env, free_port, start_serve
from tests.support.result_tools import result_bytes
from tests.test_observability import scrape, value

MIB = 1 << 20


# -- the spool ------------------------------------------------------------------


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_kept_result_reads_back_whole_and_in_pieces(tmp_path: Path) -> None:
    spool = ResultSpool(str(tmp_path), 64 * MIB)
    data = os.urandom(3 * PIECE + 17)
    small = b'{"a":1}'
    kept, other = await spool.keep(data), await spool.keep(small)
    assert kept.read() == data and other.read() == small
    got = [piece async for piece in kept.pieces()]
    assert b"".join(got) == data and max(map(len, got)) == PIECE
    assert spool.describe()["results"] == 2 and spool.describe()["bytes"] == len(data) + len(small)
    # Unnamed files: nothing is left in the folder, whatever the process does next.
    assert os.listdir(tmp_path) == []
    spool.close()


async def test_a_segment_closes_once_released_and_unread_never_under_a_reader(tmp_path: Path) -> None:
    spool = ResultSpool(str(tmp_path), 1 << 40)
    before = open_fds()
    big = await spool.keep(b"y" * SEGMENT_BYTES)  # a segment of its own, sealed at once
    assert open_fds() == before + 1
    reader = big.pieces()
    first = await reader.__anext__()
    big.release()  # retention ends while a reader is half way
    assert open_fds() == before + 1, "a segment closed under its reader"
    rest = [piece async for piece in reader]
    assert len(first) + sum(map(len, rest)) == SEGMENT_BYTES
    assert open_fds() == before  # the last reader done: closed, its space freed
    assert spool.used == 0 and spool.describe()["results"] == 0
    spool.close()


async def test_the_room_promised_to_jobs_refuses_what_cannot_fit(tmp_path: Path) -> None:
    spool = ResultSpool(str(tmp_path), 10 * MIB, retention=600)
    with pytest.raises(ApiError) as never:
        spool.hold(11 * MIB, "size")
    assert never.value.code is Code.TOO_LARGE and never.value.field == "size"
    give_back = spool.hold(6 * MIB)
    await spool.keep(b"z" * (3 * MIB))
    with pytest.raises(ApiError) as full:
        spool.hold(2 * MIB)  # 3 kept + 6 promised + 2 > 10
    assert full.value.code is Code.OVERLOADED and full.value.status == 503
    assert 590 <= full.value.retry_after <= 600  # when the oldest result leaves
    give_back()
    give_back()  # once only
    assert spool.held == 0
    spool.hold(2 * MIB)()
    spool.close()


async def test_a_finished_jobs_many_events_go_to_the_spool_and_read_back_the_same_from_any_point(tmp_path: Path) -> None:
    spool = ResultSpool(str(tmp_path), 64 * MIB)
    finished = FinishedResults(spool, memory_budget=64 * MIB)
    job = Job("chatty", None)
    for i in range(5000):
        job.partial({"i": i, "text": "y" * (i % 97)})
    job.succeed({"text": "done"})
    written = list(job.events)
    finished.ended(job)
    await asyncio.gather(*finished._spooling)
    assert isinstance(job.events, KeptLog), "a log of 5,000 events stayed in memory"
    assert spool.describe()["results"] == 1  # the log; the result is small and stays
    # Counted at what it costs now: its terminal event and 9 bytes an event.
    assert finished.in_memory < 5000 * 10 + 1000, finished.in_memory
    assert len(job.events) == len(written) and job.events[-1] is job.terminal
    assert job.events[1234] == written[1234] and job.events[100:103] == written[100:103]
    for after in (0, 1, 2500, 4999, 5000, 5001):
        read: list[Any] = []
        while not read or not read[-1].terminal:
            batch = await job.wait_events(after + len(read))
            assert batch and sum(e.size for e in batch[:-1]) <= PIECE  # a piece at a time
            read += batch
        assert read == written[after:], after
    assert await job.wait_events(len(written)) == []
    assert job.snapshot().last_event_id == written[-1].id
    finished.forget(job)
    assert spool.describe()["results"] == 0
    spool.close()


# -- a gateway and its engine ---------------------------------------------------------


def start(tiny_model_path: Path, log: Path, *extra: str) -> ServeProcess:
    port = free_port()
    args = ["--model", str(tiny_model_path), "--port", str(port), "--device", "cpu", "--log-level", "warning",
            "--tools", "tests.support.result_tools", *extra]
    return start_serve(args, clean_env(), port, log)


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    folder = tmp_path_factory.mktemp("spool")
    server = start(tiny_model_path, folder / "serve.log", "--result-spool", str(folder), "--result-store-bytes", str(512 * MIB))
    yield server
    server.stop()


def rss(server: ServeProcess) -> int:
    """The gateway process's resident memory, in bytes."""
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def kept(server: ServeProcess) -> dict[str, float]:
    samples = scrape(server.url)
    return {
        "memory": value(samples, "streamgate_results_memory_bytes"),
        "spooled": value(samples, "streamgate_result_spool_bytes"),
        "results": value(samples, "streamgate_result_spool_results"),
        "promised": value(samples, "streamgate_result_spool_promised_bytes"),
    }


def test_a_big_result_is_spooled_and_read_back_whole_by_every_way_in(gateway: ServeProcess) -> None:
    before = kept(gateway)
    size = 2 * MIB
    done = run_stream(gateway.url, "sized", {"size": size, "fill": "é"})  # two bytes a character
    assert done.terminal["event"] == "data" and done.terminal["data"]["text"] == "é" * size
    job_id = done.headers["x-job-id"]
    wait_until(lambda: kept(gateway)["results"] == before["results"] + 1, 10, "the result to be spooled")
    after = kept(gateway)
    assert after["spooled"] - before["spooled"] == result_bytes(size, "é")
    assert after["memory"] - before["memory"] < 64 * 1024  # its status frames alone
    assert after["promised"] == 0  # the promise given back as it ended
    # A resume from before the terminal event reads it from the spool.
    last = done.events[-2]["id"]
    with httpx.stream("GET", f"{gateway.url}/jobs/{job_id}/events", headers={"Last-Event-ID": last}, timeout=30) as r:
        resumed = parse_sse(r.read())
    assert [e["event"] for e in resumed] == ["data"] and resumed[0]["data"] == done.terminal["data"]
    snapshot = httpx.get(f"{gateway.url}/jobs/{job_id}", timeout=30)
    assert snapshot.headers["content-length"] == str(len(snapshot.content))
    assert snapshot.json()["terminal"] == {"event": "data", "data": done.terminal["data"]}
    page = httpx.get(f"{gateway.url}/jobs?state=succeeded", timeout=30).json()
    mine = next(s for s in page["jobs"] if s["job_id"] == job_id)
    assert mine["terminal"]["data"] == done.terminal["data"]


def test_a_long_logs_events_are_spooled_and_every_resume_reads_them_back(gateway: ServeProcess) -> None:
    before = kept(gateway)
    done = run_stream(gateway.url, "chatty", {"partials": 3000})
    assert done.terminal["data"] == {"text": "done"}
    partials = [e for e in done.events if e["event"] == "partial"]
    assert [e["data"]["i"] for e in partials] == list(range(3000))
    job_id = done.headers["x-job-id"]
    wait_until(lambda: kept(gateway)["results"] == before["results"] + 1, 10, "its events to be spooled")
    assert kept(gateway)["memory"] - before["memory"] < 64 * 1024  # 9 bytes an event, and its result
    for last in (None, done.events[0]["id"], partials[1500]["id"], done.events[-2]["id"]):
        headers = {"Last-Event-ID": last} if last else {}
        with httpx.stream("GET", f"{gateway.url}/jobs/{job_id}/events", headers=headers, timeout=30) as r:
            resumed = parse_sse(r.read())
        at = 0 if last is None else [e["id"] for e in done.events].index(last) + 1
        assert resumed == done.events[at:], last


def test_a_result_downloads_alone_whole_or_by_ranges_from_the_one_copy(gateway: ServeProcess) -> None:
    for size in (2 * MIB, 1000):  # in the spool; in memory
        done = run_stream(gateway.url, "sized", {"size": size, "fill": "é"})
        job_id = done.headers["x-job-id"]
        if size > 1000:
            wait_until(lambda: kept(gateway)["promised"] == 0, 10, "the result to be spooled")
        url = f"{gateway.url}/jobs/{job_id}/result"
        whole = httpx.get(url, timeout=30)
        assert whole.status_code == 200 and whole.json() == done.terminal["data"]
        assert whole.headers["content-length"] == str(result_bytes(size, "é")) and whole.headers["accept-ranges"] == "bytes"
        etag, body = whole.headers["etag"], whole.content
        # A cut download resumed: the pieces put together are the whole, byte for byte.
        got = b""
        for start, stop in ((0, 99), (100, len(body) // 2), (len(body) // 2 + 1, None)):
            asked = f"bytes={start}-{'' if stop is None else stop}"
            part = httpx.get(url, headers={"Range": asked, "If-Range": etag}, timeout=30)
            assert part.status_code == 206, (asked, part.text)
            end = len(body) - 1 if stop is None else stop
            assert part.headers["content-range"] == f"bytes {start}-{end}/{len(body)}"
            got += part.content
        assert got == body
        assert httpx.get(url, headers={"Range": "bytes=-10"}, timeout=30).content == body[-10:]
        # Another copy's ETag, or several ranges: the whole result.
        assert httpx.get(url, headers={"Range": "bytes=0-9", "If-Range": '"x"'}, timeout=30).content == body
        assert httpx.get(url, headers={"Range": "bytes=0-1,5-6"}, timeout=30).status_code == 200
        past = httpx.get(url, headers={"Range": f"bytes={len(body)}-"}, timeout=30)
        assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{len(body)}"
        assert past.json()["error"]["code"] == "range_not_satisfiable"
        head = httpx.head(url, timeout=30)
        assert head.status_code == 200 and head.headers["content-length"] == str(len(body)) and head.content == b""
    failed = run_stream(gateway.url, "chatty", {"partials": 1, "fail": True})
    assert failed.terminal["event"] == "error"
    refused = httpx.get(f"{gateway.url}/jobs/{failed.headers['x-job-id']}/result", timeout=30)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "no_result"
    assert "failed (tool_error" in refused.json()["error"]["message"]


def test_a_full_spool_refuses_a_job_before_it_is_queued_and_one_that_never_fits_with_413(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    budget = 5 * MIB
    server = start(tiny_model_path, tmp_path / "serve.log", "--result-spool", str(tmp_path), "--result-store-bytes", str(budget),
                   "--retention", "300")
    try:
        with httpx.Client(timeout=30) as client:
            never = client.post(f"{server.url}/sized/run", json={"size": budget})
            assert never.status_code == 413 and never.json()["error"]["field"] == "size"
            for _ in range(2):  # 4 MiB kept of 5
                assert run_stream(server.url, "sized", {"size": 2 * MIB}).terminal["event"] == "data"
            wait_until(lambda: kept(server)["results"] == 2, 10, "both results to be spooled")
            jobs = len(client.get(f"{server.url}/jobs").json()["jobs"])
            full = client.post(f"{server.url}/sized/run", json={"size": 2 * MIB})
            assert full.status_code == 503, full.text
            error = full.json()["error"]
            assert error["code"] == "overloaded" and error["retryable"] and "--result-store-bytes" in error["message"]
            assert 250 <= int(full.headers["retry-after"]) <= 300
            assert len(client.get(f"{server.url}/jobs").json()["jobs"]) == jobs  # no job was made
            # A small one still fits, and the kept results are all still there.
            assert run_stream(server.url, "sized", {"size": 1000}).terminal["event"] == "data"
            assert kept(server)["results"] == 2
    finally:
        server.stop()


def test_memory_stays_flat_over_many_big_results_each_read_to_its_end(gateway: ServeProcess) -> None:
    size = 4 * MIB
    for _ in range(3):  # the allocator's and the loop's own working set, before measuring
        run_stream(gateway.url, "sized", {"size": size})
    wait_until(lambda: kept(gateway)["promised"] == 0, 10, "the warm-up jobs to end")
    idle = rss(gateway)
    jobs = 12  # 48 MB of results: held in memory, they would be all of it and more
    for _ in range(jobs):
        done = run_stream(gateway.url, "sized", {"size": size})
        assert len(done.terminal["data"]["text"]) == size
    wait_until(lambda: kept(gateway)["results"] >= jobs + 3, 20, "the results to be spooled")
    grown = rss(gateway) - idle
    assert grown < 3 * size, f"the gateway grew by {grown / MIB:.0f} MiB over {jobs} results of {size / MIB:.0f} MiB"


def never_reads(server: ServeProcess, path: str) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window stays small
    sock.connect((host, int(port)))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return sock


def test_a_hundred_followers_that_never_read_share_one_copy(gateway: ServeProcess) -> None:
    size = 8 * MIB
    done = run_stream(gateway.url, "sized", {"size": size})
    job_id = done.headers["x-job-id"]
    wait_until(lambda: kept(gateway)["promised"] == 0, 10, "the job to end")
    idle = rss(gateway)
    followers = [never_reads(gateway, f"/jobs/{job_id}/events") for _ in range(100)]
    try:
        wait_until(lambda: value(scrape(gateway.url), "streamgate_active_streams") == len(followers), 30, "every follower's stream")
        # Each stalled on its first pieces; a copy each would be 800 MB.
        grown = rss(gateway) - idle
        assert grown < 100 * MIB, f"100 idle followers of one {size / MIB:.0f} MiB result took {grown / MIB:.0f} MiB"
        health = httpx.get(gateway.url + "/healthz", timeout=5)
        assert health.status_code == 200
    finally:
        for sock in followers:
            sock.close()
    # A reader after them reads it whole.
    with httpx.stream("GET", f"{gateway.url}/jobs/{job_id}/events", timeout=30) as r:
        events = parse_sse(r.read())
    assert len(events[-1]["data"]["text"]) == size
