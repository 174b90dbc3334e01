"""Jobs after the first connection (protocol §3): detach, resume, idempotency, cancel, retention."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from gateway.client import Client
from gateway.tools import Context, Model, tool
from tests.conftest import parse_sse, run_stream, wait_until

GATES: dict[str, threading.Event] = {}


class GatedParams(msgspec.Struct):
    gate: str
    parts: int = 3


class GatedResult(msgspec.Struct):
    parts: list[str]


class Part(msgspec.Struct):
    index: int
    text: str


@tool(partial=Part)
def gated(model: Model, params: GatedParams, ctx: Context) -> GatedResult:
    """Streams its partials at once, then waits for the test to open its gate before it returns."""
    parts = [f"part {i}" for i in range(params.parts)]
    for i, text in enumerate(parts):
        ctx.partial(Part(i, text))
    ctx.log("waiting at the gate")
    gate = GATES[params.gate]
    while not gate.wait(0.01):
        ctx.raise_if_cancelled()
    return GatedResult(parts)


ENTERED: dict[str, threading.Event] = {}


def _checked_at_the_gate(model: Model, params: GatedParams) -> None:
    """A check (run at admission) that waits for the gate: a request held while it is admitted."""
    ENTERED.setdefault(params.gate, threading.Event()).set()
    assert GATES[params.gate].wait(30), "the test did not open the gate"


@tool(check=_checked_at_the_gate)
def admitted_at_the_gate(model: Model, params: GatedParams, ctx: Context) -> GatedResult:
    """`gated`'s result, once its admission (its check) has waited for the gate."""
    return GatedResult([f"part {i}" for i in range(params.parts)])


def new_gate() -> str:
    name = uuid.uuid4().hex
    GATES[name] = threading.Event()
    return name


@pytest.fixture
def gw(serve):
    """A gateway whose jobs outlive their connections (detach grace 30 s)."""
    return serve(tools=[gated, admitted_at_the_gate], detach_grace=30)


@contextlib.contextmanager
def opened(url: str, method: str = "POST", path: str = "/gated/run", **kwargs: Any) -> Iterator[tuple[httpx.Response, Iterator[bytes]]]:
    with httpx.Client(timeout=30) as client:
        with client.stream(method, url + path, **kwargs) as response:
            yield response, response.iter_bytes()


class Reader:
    """Complete events off a byte stream, `n` at a time; what arrives beyond them waits for the next call."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks, self.raw, self.taken = chunks, b"", 0

    def take(self, n: int) -> list[dict[str, Any]]:
        while len(self._complete()) < self.taken + n:
            self.raw += next(self.chunks)
        events = self._complete()[self.taken : self.taken + n]
        self.taken += n
        return events

    def _complete(self) -> list[dict[str, Any]]:
        return parse_sse(self.raw[: self.raw.rfind(b"\n\n") + 2])


def read_events(chunks: Iterator[bytes], n: int) -> list[dict[str, Any]]:
    """The first `n` events of a stream (the rest is dropped with the connection)."""
    return Reader(chunks).take(n)


def full_log(url: str, job_id: str) -> list[dict[str, Any]]:
    """The job's whole event log, read from the start after it ended."""
    s = httpx.get(f"{url}/jobs/{job_id}/events", timeout=30)
    assert s.status_code == 200
    return parse_sse(s.content)


def resume(url: str, job_id: str, last: str | None) -> httpx.Response:
    headers = {"Last-Event-ID": last} if last else {}
    return httpx.get(f"{url}/jobs/{job_id}/events", headers=headers, timeout=30)


@pytest.mark.parametrize("drop_after", ["nothing", "received", "queued", "partials", "log"])
def test_drop_at_any_point_and_resume_gets_every_event_once(gw, drop_after):
    gate = new_gate()
    want = {"nothing": 0, "received": 1, "queued": 2, "partials": 6, "log": 7}[drop_after]
    with opened(gw.url, json={"gate": gate}) as (response, chunks):
        job_id = response.headers["x-job-id"]
        first = read_events(chunks, want) if want else []
    # The client is gone; the job runs on, detached, and waits at its gate.
    snapshot = httpx.get(f"{gw.url}/jobs/{job_id}").json()
    assert snapshot["status"] in ("QUEUED", "RUNNING") and "terminal" not in snapshot
    GATES[gate].set()
    rest = resume(gw.url, job_id, first[-1]["id"] if first else None)
    assert rest.status_code == 200
    assert rest.headers["x-job-id"] == job_id
    events = first + parse_sse(rest.content)
    log = full_log(gw.url, job_id)
    assert events == log
    assert [e["id"] for e in events] == [f"{job_id}:{n}" for n in range(1, len(events) + 1)]
    assert [e["event"] for e in log].count("data") == 1 and log[-1]["event"] == "data"
    assert log[-1]["data"] == {"parts": ["part 0", "part 1", "part 2"]}


def test_resume_after_the_terminal_event_is_204_and_unknown_jobs_are_404(gw):
    gate = new_gate()
    GATES[gate].set()
    s = run_stream(gw.url, "gated", {"gate": gate})
    job_id, last = s.headers["x-job-id"], s.terminal["id"]
    assert resume(gw.url, job_id, last).status_code == 204
    assert httpx.get(f"{gw.url}/jobs/{job_id}/events", params={"last_event_id": last}).status_code == 204
    # From an earlier event: only what came after it.
    after = resume(gw.url, job_id, s.events[-3]["id"])
    assert [e["id"] for e in parse_sse(after.content)] == [e["id"] for e in s.events[-2:]]
    missing = httpx.get(f"{gw.url}/jobs/{'0' * 32}/events")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    bad = resume(gw.url, job_id, "not-an-id")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_request"
    other = resume(gw.url, job_id, f"{'1' * 32}:3")
    assert other.status_code == 400


def test_an_eventsource_reconnecting_to_its_get_url_continues_the_same_job(gw):
    gate = new_gate()
    query = {"gate": gate}
    with opened(gw.url, "GET", params=query) as (response, chunks):
        job_id = response.headers["x-job-id"]
        first = read_events(chunks, 4)
    GATES[gate].set()
    # What a browser does: the same URL again, with the last id it saw.
    again = httpx.get(f"{gw.url}/gated/run", params=query, headers={"Last-Event-ID": first[-1]["id"]}, timeout=30)
    assert again.status_code == 200 and again.headers["x-job-id"] == job_id
    events = first + parse_sse(again.content)
    assert events == full_log(gw.url, job_id)
    # After the terminal event it must not go on reconnecting: 204 ends an EventSource.
    final = httpx.get(f"{gw.url}/gated/run", params=query, headers={"Last-Event-ID": events[-1]["id"]})
    assert final.status_code == 204


def test_the_same_idempotency_key_attaches_to_the_same_job(gw):
    gate = new_gate()
    key = uuid.uuid4().hex
    with opened(gw.url, json={"gate": gate}, headers={"Idempotency-Key": key}) as (first, chunks):
        job_id = first.headers["x-job-id"]
        read_events(chunks, 2)
    with opened(gw.url, json={"gate": gate}, headers={"Idempotency-Key": key}) as (second, chunks):
        assert second.headers["x-job-id"] == job_id
        replayed = read_events(chunks, 2)
        assert [e["id"] for e in replayed] == [f"{job_id}:1", f"{job_id}:2"]  # from the start
    other = new_gate()
    GATES[other].set()
    s = run_stream(gw.url, "gated", {"gate": other}, headers={"Idempotency-Key": uuid.uuid4().hex})
    assert s.headers["x-job-id"] != job_id
    GATES[gate].set()


def test_the_same_idempotency_key_while_its_first_request_is_admitted_is_told_to_come_again(gw):
    """A client's retry that comes while its first request is still being admitted (its price checked):
    429 with Retry-After, never 404 (a client would give up while the job runs on); then it attaches."""
    import concurrent.futures

    gate, key = new_gate(), uuid.uuid4().hex
    ENTERED[gate] = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(run_stream, gw.url, "admitted_at_the_gate", {"gate": gate}, headers={"Idempotency-Key": key})
        assert ENTERED[gate].wait(30), "the first request was not admitted"
        again = httpx.post(f"{gw.url}/admitted_at_the_gate/run", json={"gate": gate}, headers={"Idempotency-Key": key}, timeout=30)
        GATES[gate].set()
        done = first.result(60)
    assert again.status_code == 429 and again.headers["retry-after"] == "1", again.text
    assert again.json()["error"]["retryable"] is True
    attached = run_stream(gw.url, "admitted_at_the_gate", {"gate": gate}, headers={"Idempotency-Key": key})
    assert attached.headers["x-job-id"] == done.headers["x-job-id"] and attached.terminal == done.terminal


def test_an_idempotency_key_sent_with_another_request_is_refused(gw):
    gate = new_gate()
    key = uuid.uuid4().hex
    with opened(gw.url, json={"gate": gate}, headers={"Idempotency-Key": key}) as (first, chunks):
        job_id = first.headers["x-job-id"]
        read_events(chunks, 2)
        other = new_gate()
        for tool, params in (("gated", {"gate": other}), ("gated", {"gate": gate, "parts": 2}), ("predict", {"prompt": "hi"})):
            refused = httpx.post(f"{gw.url}/{tool}/run", json=params, headers={"Idempotency-Key": key})
            assert refused.status_code == 422, refused.text
            error = refused.json()["error"]
            assert error["code"] == "idempotency_key_reused" and error["retryable"] is False
            assert key in error["message"]
        # The same params written another way (the GET form, a default spelt out) are the same request.
        for form in ({"params": '{"parts": 3, "gate": "%s"}' % gate}, {"gate": gate}):
            with httpx.stream("GET", f"{gw.url}/gated/run", params=form, headers={"Idempotency-Key": key}) as same:
                assert same.status_code == 200 and same.headers["x-job-id"] == job_id
    GATES[gate].set()


def test_delete_cancels_a_running_job_and_a_queued_one(gw):
    running, queued = new_gate(), new_gate()
    with opened(gw.url, json={"gate": running}) as (r1, c1), opened(gw.url, json={"gate": queued}) as (r2, c2):
        id1, id2 = r1.headers["x-job-id"], r2.headers["x-job-id"]
        read_events(c1, 4)  # running, at its gate
        read_events(c2, 2)  # queued behind it
        answer = httpx.delete(f"{gw.url}/jobs/{id2}")
        assert answer.json() == {"job_id": id2, "cancelled": True, "status": "FAILED"}
        answer = httpx.delete(f"{gw.url}/jobs/{id1}")
        assert answer.status_code == 200 and answer.json()["cancelled"] is True
        for job_id in (id1, id2):
            wait_until(lambda: "terminal" in httpx.get(f"{gw.url}/jobs/{job_id}").json(), 10, "the cancel")
            log = full_log(gw.url, job_id)
            assert log[-1]["event"] == "error" and log[-1]["data"]["error"]["code"] == "cancelled"
        assert "RUNNING" not in [e["data"].get("status") for e in full_log(gw.url, id2)]
    again = httpx.delete(f"{gw.url}/jobs/{id1}")
    assert again.json()["cancelled"] is False
    # The worker is free for the next job at once.
    done = new_gate()
    GATES[done].set()
    assert run_stream(gw.url, "gated", {"gate": done}, timeout=10).terminal["event"] == "data"


def test_the_snapshot_says_where_a_job_stands(gw):
    gate = new_gate()
    with opened(gw.url, json={"gate": gate}) as (response, chunks):
        job_id = response.headers["x-job-id"]
        reader = Reader(chunks)
        seen = reader.take(7)
        live = httpx.get(f"{gw.url}/jobs/{job_id}").json()
        assert live["job_id"] == job_id and live["tool"] == "gated" and live["status"] == "RUNNING"
        assert live["last_event_id"] == seen[-1]["id"]
        assert "terminal" not in live and "finished" not in live and live["started"] >= live["created"]
        GATES[gate].set()
        assert reader.take(1)[0]["event"] == "data"
    done = httpx.get(f"{gw.url}/jobs/{job_id}").json()
    assert done["status"] == "SUCCEEDED"
    assert done["terminal"] == {"event": "data", "data": {"parts": ["part 0", "part 1", "part 2"]}}
    assert done["finished"] >= done["started"]


def test_a_detached_job_is_cancelled_after_the_grace_and_frees_the_worker(serve):
    gw = serve(tools=[gated], detach_grace=0.5)
    gate = new_gate()
    with opened(gw.url, json={"gate": gate}) as (response, chunks):
        job_id = response.headers["x-job-id"]
        read_events(chunks, 4)
    time.sleep(0.2)
    assert "terminal" not in httpx.get(f"{gw.url}/jobs/{job_id}").json()  # still in its grace
    wait_until(lambda: "terminal" in httpx.get(f"{gw.url}/jobs/{job_id}").json(), 10, "the grace to expire")
    assert full_log(gw.url, job_id)[-1]["data"]["error"]["code"] == "cancelled"
    free = new_gate()
    GATES[free].set()
    assert run_stream(gw.url, "gated", {"gate": free}, timeout=10).terminal["event"] == "data"


def test_reattaching_within_the_grace_keeps_the_job(serve):
    gw = serve(tools=[gated], detach_grace=1.0)
    gate = new_gate()
    with opened(gw.url, json={"gate": gate}) as (response, chunks):
        job_id = response.headers["x-job-id"]
        first = read_events(chunks, 4)
    with opened(gw.url, "GET", f"/jobs/{job_id}/events", headers={"Last-Event-ID": first[-1]["id"]}) as (again, chunks):
        reader = Reader(chunks)
        reader.take(1)
        time.sleep(1.5)  # past the grace, but attached all along
        GATES[gate].set()
        rest = reader.take(3)
    assert rest[-1]["event"] == "data"


def test_finished_jobs_are_forgotten_after_the_retention(serve):
    gw = serve(tools=[gated], retention=0.5)
    gate = new_gate()
    GATES[gate].set()
    job_id = run_stream(gw.url, "gated", {"gate": gate}).headers["x-job-id"]
    assert httpx.get(f"{gw.url}/jobs/{job_id}").status_code == 200
    wait_until(lambda: httpx.get(f"{gw.url}/jobs/{job_id}").status_code == 404, 10, "the retention to expire")
    assert httpx.get(f"{gw.url}/jobs/{job_id}/events").status_code == 404


class DropOnce(httpx.HTTPTransport):
    """A transport whose first answer to a path ending in `suffix` breaks after `after` bytes, like a dropped connection."""

    def __init__(self, after: int, suffix: str = "/run") -> None:
        super().__init__()
        self.after, self.suffix, self.dropped, self.requests = after, suffix, False, []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append((request.method, request.url.path, request.headers.get("last-event-id") or request.headers.get("range")))
        response = super().handle_request(request)
        if self.dropped or not request.url.path.endswith(self.suffix):
            return response
        self.dropped = True
        return httpx.Response(response.status_code, headers=response.headers, stream=_Cut(response.stream, self.after))


class _Cut(httpx.SyncByteStream):
    def __init__(self, stream: Any, after: int) -> None:
        self.stream, self.after = stream, after

    def __iter__(self) -> Iterator[bytes]:
        sent = 0
        for chunk in self.stream:
            if sent + len(chunk) > self.after:
                yield chunk[: self.after - sent]
                raise httpx.ReadError("connection dropped")
            sent += len(chunk)
            yield chunk

    def close(self) -> None:
        self.stream.close()


@pytest.mark.parametrize("after", [40, 200, 500])
def test_the_python_client_resumes_a_dropped_stream(gw, after):
    gate = new_gate()
    transport = DropOnce(after)
    with Client(gw.url, transport=transport) as client:
        threading.Timer(0.5, GATES[gate].set).start()
        events = list(client.stream("gated", {"gate": gate}))
    job_id = client.job_id
    assert events[-1].type == "data" and events[-1].data == {"parts": ["part 0", "part 1", "part 2"]}
    assert [e.id for e in events] == [f"{job_id}:{n}" for n in range(1, len(events) + 1)]
    methods = [(m, p) for m, p, _ in transport.requests]
    assert methods == [("POST", "/gated/run"), ("GET", f"/jobs/{job_id}/events")]
    seen = [last for _, _, last in transport.requests]
    assert seen[1] is None or seen[1] == events[int(seen[1].rsplit(":", 1)[1]) - 1].id


def test_the_python_client_downloads_a_result_and_resumes_a_dropped_download(gw, tmp_path):
    gate = new_gate()
    GATES[gate].set()
    transport = DropOnce(12, suffix="/result")
    with Client(gw.url, transport=transport) as client:
        result = client.run("gated", {"gate": gate})
        size = client.download(tmp_path / "result.json")
    job_id = client.job_id
    assert json.loads((tmp_path / "result.json").read_bytes()) == result
    assert size == (tmp_path / "result.json").stat().st_size and not (tmp_path / "result.json.part").exists()
    assert [(m, p, r) for m, p, r in transport.requests if p.endswith("/result")] == [
        ("GET", f"/jobs/{job_id}/result", None),
        ("GET", f"/jobs/{job_id}/result", "bytes=12-"),
    ]


async def test_a_job_that_ends_before_its_submit_returns_gives_back_what_it_held(tiny_model_path: Any, tmp_path: Any) -> None:
    """An engine's frames may come with its answer to the submit (backends/remote.py applies them as
    the submit returns), so a short job can have ended before admission goes on. What it held is
    given back all the same: its room for results (else the result store fills with promises and
    refuses every job), its token's slot (else the token can run no job again), and its use is settled."""
    import asyncio

    from backends.local import LocalBackend
    from gateway.admission import Admission, Applicant
    from gateway.config import Settings
    from gateway.jobs import Job
    from gateway.plumbing.spool import ResultSpool
    from gateway.server.auth import Limits, Principal
    from gateway.server.metering import Meter
    from gateway.tools import collect, load_module
    from tests.support import result_tools

    class EndedOnReturn(LocalBackend):
        async def submit(self, job: Job) -> None:
            await super().submit(job)
            for _ in range(3000):
                if job.done:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError("the job did not end")

    backend = EndedOnReturn(collect(load_module(result_tools.__name__)), Settings(model=[str(tiny_model_path)], device="cpu"))
    room, limits, meter = ResultSpool(str(tmp_path), 1 << 20), Limits(), Meter()
    admission = Admission(backend, Settings().limits(), quota=limits, room=room, meter=meter)
    principal = Principal("lab", "x" * 16, max_concurrent=1, user_class="lab")
    await backend.start()
    try:
        await backend.wait_ready()
        for _ in range(2):  # the second is refused (429) if the first kept its slot
            job = await admission.admit(backend.tool("sized"), result_tools.SizedParams(size=1000), Applicant.of(principal, "lab"))
            assert job.done and job.terminal is not None and job.terminal.type == "data"
            assert room.held == 0 and not limits.running
        assert [(row.tenant, row.usage.jobs) for row in await meter.rows()] == [("lab", 2)]
    finally:
        await backend.stop()
        room.close()


async def test_a_job_its_store_does_not_take_is_cancelled_and_gives_back_its_key_delivery_and_place(tiny_model_path: Any) -> None:
    """A job is queued before its store records it. Should the store fail then (a 503), or the request be
    cancelled there (its client gone, an MCP call's scope cancelled, which anyio keeps cancelling), the
    job is found by no one: it is cancelled, its token's place given back as it ends, and its key and its
    webhook delivery taken back even under the cancelled scope."""
    import asyncio

    import anyio

    from backends.local import LocalBackend
    from gateway.admission import Admission, Applicant
    from gateway.config import Settings
    from gateway.errors import ApiError
    from gateway.jobs import Job
    from gateway.protocol import Code
    from gateway.server.auth import Limits, Principal
    from gateway.server.store import MemoryStore
    from gateway.server.webhooks import Webhooks
    from gateway.tools import collect, load_module
    from tests.support import script_tools

    class Unrecording(MemoryStore):
        def __init__(self) -> None:
            super().__init__(lambda job: None)
            self.refused: list[Job] = []
            self.hang = False

        async def add(self, job: Job) -> None:
            self.refused.append(job)
            if self.hang:
                await asyncio.Event().wait()
            raise ApiError(Code.STORE_UNAVAILABLE, "the store did not answer", retry_after=5)

        async def release(self, key: str, job_id: str) -> None:
            await asyncio.sleep(0)  # a round trip, as Redis's is: where a still-cancelled scope strikes
            await super().release(key, job_id)

    tools = collect(load_module(script_tools.__name__))
    backend = LocalBackend(tools, Settings(model=[str(tiny_model_path)], device="cpu"))
    store, limits, hooks = Unrecording(), Limits(), Webhooks("whsec_" + "A" * 32, ["127.0.0.1"], per_tenant=3)
    admission = Admission(backend, Settings().limits(), store=store, quota=limits, webhooks=hooks)
    applicant = Applicant.of(Principal("lab", "x" * 16, max_concurrent=1), "lab")
    waits = script_tools.ScriptParams(script=[script_tools.AwaitDisconnectStep()])
    await backend.start()
    try:
        await backend.wait_ready()
        with pytest.raises(ApiError) as refused:
            await admission.admit_once(tools["script"], waits, applicant, "k", callback="http://127.0.0.1:9/hook")
        assert refused.value.status == 503
        store.hang = True
        with anyio.move_on_after(0.5) as scope:
            await admission.admit_once(tools["script"], waits, applicant, "k", callback="http://127.0.0.1:9/hook")
        assert scope.cancelled_caught
        for job in store.refused:
            for _ in range(3000):
                if job.done:
                    break
                await asyncio.sleep(0.01)
            assert job.terminal is not None and msgspec.json.decode(job.terminal.data)["error"]["code"] == "cancelled"
        assert len(store.refused) == 2 and not limits.running and await hooks.outbox.held("lab") == (0, 0, 0)
        assert store.keys == {} and await store.reserve("lab:k", "another", "") is None
    finally:
        await backend.stop()


async def test_a_running_jobs_log_costs_its_data_and_a_few_bytes_an_event() -> None:
    """A job's log is held while it runs, for followers that read slowly or not at all (and their
    resumes): packed, an event costs its data and a few bytes, where an object per event cost about a
    hundred more (a generation's token events several times their data). It reads back as written,
    and a follower far behind takes it a piece at a time."""
    import tracemalloc

    from gateway.eventlog import PIECE
    from gateway.jobs import Job
    from gateway.protocol import EventType

    job = Job("t", None)
    payload = {"i": 0, "text": "y" * 200}
    each = len(msgspec.json.encode(payload))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(20_000):
            job.partial(payload)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    data = 20_000 * each
    assert held < data * 1.2 + 20_000 * 16, (held, data)
    partials = job.events[1:]
    assert len(partials) == 20_000 and [e.seq for e in partials[:3]] == [2, 3, 4]
    assert all(e.type is EventType.PARTIAL and msgspec.json.decode(e.data) == payload for e in partials)
    piece = await job.wait_events(0)
    assert piece == list(job.events[: len(piece)]) and sum(e.size for e in piece) <= PIECE < sum(e.size for e in piece) + each
    assert await job.wait_events(20_000) == [job.events[-1]]
