"""Two gateway replicas sharing one Redis (`--store redis://…`): any replica serves any job.

Each replica is its own in-process gateway (app, LocalBackend, RedisStore) on a
loopback port; both talk to one real redis-server. Jobs are the `echo` user tool
with a `delay`, long enough to be resumed, read, cancelled and abandoned on the
replica that does not run them.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from click.testing import CliRunner

from gateway.cli.commands import main as cli_main
from gateway.tools import load_module
from tests.conftest import Server, make_server, parse_sse, run_stream, track_jobs, wait_until
from tests.support.processes import free_port
from tests.support.redis_server import RedisServer, redis_server, start_redis  # noqa: F401

USER_TOOLS = "tests.support.user_tools"


@pytest.fixture
def replicas(tiny_model_path: Path, redis_server: RedisServer) -> Any:
    """`replicas(n=2, **settings)`: gateways on the tiny model, all with `--store` the test Redis."""
    started: list[Server] = []

    def start(n: int = 2, **settings: Any) -> list[Server]:
        settings.setdefault("store", redis_server.url)
        tools = load_module(USER_TOOLS)
        for _ in range(n):
            started.append(make_server(tiny_model_path, tools=tools, **settings))
        return started[-n:]

    yield start
    for server in started:
        server.stop()


def read_some(url: str, path: str, n: int, *, method: str = "GET", **kwargs: Any) -> tuple[httpx.Headers, list[dict[str, Any]]]:
    """Open a stream, read its first `n` events, and hang up."""
    raw = b""
    with httpx.Client(timeout=30) as client:
        with client.stream(method, url + path, **kwargs) as response:
            assert response.status_code == 200, response.read()
            for chunk in response.iter_raw():
                raw += chunk
                if len([e for e in parse_sse(raw[: raw.rfind(b"\n\n") + 2]) if "id" in e]) >= n:
                    break
            headers = response.headers
    complete = raw[: raw.rfind(b"\n\n") + 2]
    return headers, [e for e in parse_sse(complete) if "id" in e][:n]


def events_of(url: str, job_id: str, last_event_id: str | None = None) -> tuple[int, bytes, list[dict[str, Any]]]:
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    with httpx.Client(timeout=60) as client:
        response = client.get(f"{url}/jobs/{job_id}/events", headers=headers)
    return response.status_code, response.content, parse_sse(response.content) if response.status_code == 200 else []


def snapshot(url: str, job_id: str) -> httpx.Response:
    return httpx.get(f"{url}/jobs/{job_id}", timeout=30)


class Follower:
    """A client following a job's stream in a thread until told to hang up (or the stream ends)."""

    def __init__(self, url: str, path: str, **kwargs: Any) -> None:
        self.raw = b""
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url + path,), kwargs=kwargs, daemon=True)
        self._thread.start()

    def _run(self, url: str, method: str = "GET", **kwargs: Any) -> None:
        with httpx.Client(timeout=60) as client:
            with client.stream(method, url, **kwargs) as response:
                self.status, self.headers = response.status_code, response.headers
                for chunk in response.iter_raw():
                    self.raw += chunk
                    if self._stop.is_set():
                        return

    @property
    def events(self) -> list[dict[str, Any]]:
        return parse_sse(self.raw[: self.raw.rfind(b"\n\n") + 2])

    def hang_up(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def join(self, timeout: float = 60) -> list[dict[str, Any]]:
        self._thread.join(timeout=timeout)
        assert not self._thread.is_alive(), "the stream did not end"
        return self.events


def slow_echo(repeat: int, delay: float = 0.05) -> dict[str, Any]:
    return {"text": "ab", "repeat": repeat, "delay": delay}


def check_log(events: list[dict[str, Any]], job_id: str) -> None:
    """One job's events: seqs 1..n without gaps, one terminal event, last."""
    assert [e["id"] for e in events] == [f"{job_id}:{i}" for i in range(1, len(events) + 1)]
    assert [e["event"] in ("data", "error") for e in events].count(True) == 1
    assert events[-1]["event"] in ("data", "error")


def test_resume_on_the_other_replica_loses_and_doubles_nothing(replicas: Any) -> None:
    a, b = replicas(detach_grace=30)
    headers, first = read_some(a.url, "/echo/run", 4, method="POST", json=slow_echo(30))
    job_id = headers["x-job-id"]
    status, _, rest = events_of(b.url, job_id, first[-1]["id"])
    assert status == 200
    resumed = first + rest
    check_log(resumed, job_id)
    assert resumed[-1]["event"] == "data" and resumed[-1]["data"]["text"] == "ab" * 30
    # The whole log, from the replica that ran it and from the other: the same bytes.
    status_a, raw_a, whole = events_of(a.url, job_id)
    status_b, raw_b, whole_b = events_of(b.url, job_id)
    assert status_a == status_b == 200 and raw_a == raw_b
    assert resumed == whole == whole_b
    # An EventSource reconnecting to the URL it first opened, on the other replica: the same job.
    again = run_stream(b.url, "echo", method="GET", query={"text": "zz"}, headers={"Last-Event-ID": whole[5]["id"]})
    assert again.headers["x-job-id"] == job_id and again.events == whole[6:]
    # Holding the terminal event already: 204, wherever it is asked.
    assert events_of(b.url, job_id, whole[-1]["id"])[0] == 204


def test_snapshot_on_the_other_replica(replicas: Any) -> None:
    a, b = replicas(detach_grace=30)
    follower = Follower(a.url, "/echo/run", method="POST", json=slow_echo(20))
    wait_until(lambda: follower.headers is not None and len(follower.events) >= 3, what="the job to start")
    job_id = follower.headers["x-job-id"]
    running = snapshot(b.url, job_id)
    assert running.status_code == 200
    assert running.json()["tool"] == "echo" and running.json()["status"] in ("QUEUED", "RUNNING")
    follower.join()
    wait_until(lambda: snapshot(b.url, job_id).json()["status"] == "SUCCEEDED", timeout=10, what="the end, seen from B")
    assert snapshot(b.url, job_id).json() == snapshot(a.url, job_id).json()
    assert snapshot(b.url, "0" * 32).status_code == 404


def test_cancel_from_the_other_replica_stops_the_work(replicas: Any) -> None:
    a, b = replicas(detach_grace=30)
    follower = Follower(a.url, "/echo/run", method="POST", json=slow_echo(400))  # 20 s of work
    wait_until(lambda: any(e["data"].get("progress") for e in follower.events), what="the job to run")
    job_id = follower.headers["x-job-id"]
    started = time.monotonic()
    answer = httpx.delete(f"{b.url}/jobs/{job_id}", timeout=30)
    assert answer.status_code == 200 and answer.json()["cancelled"] is True
    events = follower.join(timeout=30)
    assert time.monotonic() - started < 10
    assert events[-1]["event"] == "error" and events[-1]["data"]["error"]["code"] == "cancelled"
    done = max(e["data"]["progress"]["done"] for e in events if e["event"] == "status" and e["data"].get("progress"))
    assert done < 400
    # The owner's worker is free again: a short job on it finishes at once.
    quick = run_stream(a.url, "echo", {"text": "q"}, timeout=30)
    assert quick.terminal["event"] == "data"
    wait_until(lambda: snapshot(b.url, job_id).json()["status"] == "FAILED", timeout=10, what="B to see the end")
    # Cancelling again: nothing left to cancel.
    assert httpx.delete(f"{b.url}/jobs/{job_id}", timeout=30).json()["cancelled"] is False


def test_idempotency_key_attaches_across_replicas(replicas: Any) -> None:
    a, b = replicas(detach_grace=30)
    ran_a, ran_b = track_jobs(a), track_jobs(b)
    key = {"Idempotency-Key": uuid.uuid4().hex}
    first = Follower(a.url, "/echo/run", method="POST", json=slow_echo(10), headers=key)
    wait_until(lambda: first.headers is not None, what="the first POST")
    again = run_stream(b.url, "echo", slow_echo(10), headers=key)
    assert again.status == 200 and again.headers["x-job-id"] == first.headers["x-job-id"]
    assert again.events == first.join()
    check_log(again.events, again.headers["x-job-id"])
    assert list(ran_a) == [again.headers["x-job-id"]] and ran_b == {}  # one job, run once


def test_detach_grace_counts_clients_on_every_replica(replicas: Any) -> None:
    a, b = replicas(detach_grace=1.0)
    headers, _ = read_some(a.url, "/echo/run", 3, method="POST", json=slow_echo(400))  # 20 s of work
    job_id = headers["x-job-id"]
    on_b = Follower(b.url, f"/jobs/{job_id}/events")
    time.sleep(2.5)  # well past the grace: the client on B keeps the job alive
    assert snapshot(a.url, job_id).json()["status"] == "RUNNING"
    assert on_b.events and on_b.events[-1]["event"] == "status"
    on_b.hang_up()
    gone = time.monotonic()
    wait_until(lambda: snapshot(a.url, job_id).json()["status"] == "FAILED", timeout=15, what="the cancel")
    assert time.monotonic() - gone >= 0.9  # not before the grace
    terminal = snapshot(b.url, job_id).json()["terminal"]
    assert terminal["event"] == "error" and terminal["data"]["error"]["code"] == "cancelled"


def test_retention_expiry_is_404_everywhere(replicas: Any) -> None:
    a, b = replicas(retention=1.0)
    done = run_stream(a.url, "echo", {"text": "x"})
    job_id = done.headers["x-job-id"]
    assert snapshot(a.url, job_id).status_code == 200 and snapshot(b.url, job_id).status_code == 200
    wait_until(
        lambda: snapshot(a.url, job_id).status_code == 404 and snapshot(b.url, job_id).status_code == 404,
        timeout=15,
        what="the job to be forgotten",
    )
    assert events_of(b.url, job_id)[0] == 404 and events_of(a.url, job_id)[0] == 404
    assert httpx.delete(f"{b.url}/jobs/{job_id}").status_code == 404


def test_unreachable_redis_answers_503(tiny_model_path: Path) -> None:
    server = make_server(
        tiny_model_path, tools=load_module(USER_TOOLS), ready=False, store=f"redis://127.0.0.1:{free_port()}/0"
    )
    try:
        wait_until(lambda: server.backend.ready, what="the model")
        ready = httpx.get(f"{server.url}/readyz")
        assert ready.status_code == 503 and "Redis" in ready.json()["reason"]
        started = time.monotonic()
        refused = run_stream(server.url, "echo", {"text": "x"}, timeout=30)
        assert refused.status == 503 and refused.body["error"]["code"] == "store_unavailable"
        assert refused.headers["retry-after"] and time.monotonic() - started < 10
        assert snapshot(server.url, "0" * 32).status_code == 503
    finally:
        server.stop()


# -- Redis faults: each test has a redis-server of its own to stop, restart or pause ----------


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path)
    yield server
    server.stop()


def with_ids(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if "id" in e]


def followed_on_both(a: Server, b: Server, repeat: int, **kwargs: Any) -> tuple[Follower, Follower, str]:
    """A slow echo job run on A by one client and followed from B by another, both a few events in."""
    owner = Follower(a.url, "/echo/run", method="POST", json=slow_echo(repeat, 0.1), **kwargs)
    wait_until(lambda: owner.headers is not None and len(with_ids(owner.events)) >= 3, what="the job to start")
    job_id = owner.headers["x-job-id"]
    follower = Follower(b.url, f"/jobs/{job_id}/events")
    wait_until(lambda: len(with_ids(follower.events)) >= 3, what="B to follow")
    return owner, follower, job_id


def assert_refused_quickly(url: str) -> None:
    """A new run while Redis is away: 503 store_unavailable with Retry-After, in about ANSWER_S at most."""
    started = time.monotonic()
    refused = run_stream(url, "echo", {"text": "x"}, timeout=30)
    assert refused.status == 503, refused.raw
    assert refused.body["error"]["code"] == "store_unavailable" and refused.body["error"]["retryable"] is True
    assert int(refused.headers["retry-after"]) >= 1
    assert time.monotonic() - started < 5


def test_a_redis_restart_mid_stream_loses_and_doubles_nothing(replicas: Any, own_redis: RedisServer) -> None:
    a, b = replicas(store=own_redis.url, detach_grace=30, store_outage_grace=20)
    key = {"Idempotency-Key": uuid.uuid4().hex}
    owner, follower, job_id = followed_on_both(a, b, 50, headers=key)

    own_redis.stop()
    wait_until(lambda: httpx.get(f"{a.url}/readyz").status_code == 503, timeout=10, what="A to say it is not ready")
    assert "Redis" in httpx.get(f"{a.url}/readyz").json()["reason"]
    assert_refused_quickly(a.url)
    assert_refused_quickly(b.url)
    seen = len(with_ids(owner.events))
    wait_until(lambda: len(with_ids(owner.events)) > seen + 3, timeout=10, what="the job to go on without Redis")
    own_redis.start()  # empty: it keeps nothing

    events = with_ids(owner.join())
    check_log(events, job_id)
    assert events[-1]["event"] == "data" and events[-1]["data"]["text"] == "ab" * 50
    assert with_ids(follower.join()) == events  # every seq once on the other replica
    wait_until(lambda: httpx.get(f"{b.url}/readyz").status_code == 200, timeout=10, what="B to be ready again")
    # Redis has it all again: the snapshot, the whole log, the listing, and the idempotency key.
    assert snapshot(b.url, job_id).json() == snapshot(a.url, job_id).json()
    assert events_of(b.url, job_id)[2] == events
    assert job_id in [j["job_id"] for j in httpx.get(f"{b.url}/jobs").json()["jobs"]]
    again = run_stream(b.url, "echo", slow_echo(50, 0.1), headers=key)
    assert again.headers["x-job-id"] == job_id and again.events == events


def test_a_stalled_redis_delays_nothing_and_loses_nothing(replicas: Any, own_redis: RedisServer) -> None:
    a, b = replicas(store=own_redis.url, detach_grace=30, store_outage_grace=20)
    owner, follower, job_id = followed_on_both(a, b, 60)

    with redis.Redis(port=own_redis.port) as admin:
        admin.client_pause(5000, all=True)  # every client's commands wait: a stall, not a refusal
    seen = len(with_ids(owner.events))
    assert_refused_quickly(a.url)  # never a hang
    assert len(with_ids(owner.events)) > seen  # the job's own clients were served meanwhile

    events = with_ids(owner.join())
    check_log(events, job_id)
    assert events[-1]["event"] == "data"
    assert with_ids(follower.join()) == events
    assert snapshot(b.url, job_id).json()["status"] == "SUCCEEDED"


def test_past_the_outage_grace_each_replica_ends_cleanly(replicas: Any, own_redis: RedisServer) -> None:
    a, b = replicas(store=own_redis.url, detach_grace=30, store_outage_grace=1.5)
    owner, follower, job_id = followed_on_both(a, b, 50)

    own_redis.stop()
    # B gives up on the job past the grace: its stream ends, with no terminal event, for the client to reconnect.
    partial = with_ids(follower.join(timeout=20))
    assert partial and all(e["event"] == "status" or e["event"] == "log" for e in partial), partial[-1]
    # A's own client still gets the whole job, ended once.
    events = with_ids(owner.join())
    check_log(events, job_id)
    assert events[-1]["event"] == "data"
    assert partial == events[: len(partial)]

    own_redis.start()
    wait_until(lambda: httpx.get(f"{b.url}/readyz").status_code == 200, timeout=10, what="B to be ready again")
    wait_until(lambda: snapshot(b.url, job_id).status_code == 200, timeout=10, what="the job to be copied back")
    status, _, rest = events_of(b.url, job_id, partial[-1]["id"])
    assert status == 200 and partial + rest == events  # the reconnect reads on: every seq once


def test_store_flag() -> None:
    runner = CliRunner()
    shown = runner.invoke(cli_main, ["serve", "--help"], terminal_width=200)
    assert "--store" in shown.output and "STREAMGATE_STORE" in shown.output
    assert "--store-outage-grace" in shown.output and "STREAMGATE_STORE_OUTAGE_GRACE" in shown.output
    bad = runner.invoke(cli_main, ["serve", "--store", "postgres://x"])
    assert bad.exit_code == 2 and "Redis URL" in bad.output
    bad = runner.invoke(cli_main, ["serve"], env={"STREAMGATE_STORE": "somewhere"})
    assert bad.exit_code == 2


def test_a_big_result_is_kept_in_the_owners_spool_and_in_redis_and_every_replica_serves_it(
    tiny_model_path: Path, redis_server: RedisServer
) -> None:
    """Which copy serves a result with Redis: the replica that ran the job reads its own (in its
    spool once big, its memory bounded as with the memory store); the others read Redis's copy,
    which is kept once, in a key of its own, neither in the job's stream nor in its snapshot."""
    from tests.support.result_tools import result_bytes, sized
    from tests.test_observability import scrape, value

    a, b = (make_server(tiny_model_path, tools=[sized], store=redis_server.url) for _ in range(2))
    try:
        size = 1 << 20
        done = run_stream(a.url, "sized", {"size": size, "fill": "é"})
        expected = done.terminal["data"]
        assert expected == {"text": "é" * size}
        job_id = done.headers["x-job-id"]
        wait_until(lambda: value(scrape(a.url), "streamgate_result_spool_results") == 1, 10, "A to spool its copy")
        assert value(scrape(a.url), "streamgate_result_spool_bytes") == result_bytes(size, "é")
        assert value(scrape(a.url), "streamgate_results_memory_bytes") < 64 * 1024
        kept = redis.Redis.from_url(redis_server.url)
        encoded = result_bytes(size, "é")
        assert kept.strlen(f"streamgate:result:{job_id}") == encoded
        assert len(kept.hget(f"streamgate:job:{job_id}", "snapshot") or b"") < 4096
        assert int(kept.hget(f"streamgate:job:{job_id}", "tsize") or 0) == encoded
        (_, last), = kept.xrevrange(f"streamgate:events:{job_id}", count=1)
        assert last == {b"type": b"data", b"size": str(encoded).encode()}
        assert 0 < kept.pttl(f"streamgate:result:{job_id}") <= kept.pttl(f"streamgate:job:{job_id}") + 1000
        for url in (a.url, b.url):
            status, _, events = events_of(url, job_id)
            assert status == 200 and events[-1]["data"] == expected, url
            assert snapshot(url, job_id).json()["terminal"]["data"] == expected, url
            listed = httpx.get(f"{url}/jobs", timeout=30).json()["jobs"]
            assert [job["terminal"]["data"] for job in listed if job["job_id"] == job_id] == [expected], url
            whole = httpx.get(f"{url}/jobs/{job_id}/result", timeout=30)
            assert whole.status_code == 200 and whole.json() == expected, url
            part = httpx.get(f"{url}/jobs/{job_id}/result", headers={"Range": "bytes=300000-300009"}, timeout=30)
            assert part.status_code == 206 and part.content == whole.content[300000:300010], url
        # Resumed on B from the event before the result: the result alone, whole.
        last_seq = int(events[-1]["id"].split(":")[1])
        status, _, events = events_of(b.url, job_id, f"{job_id}:{last_seq - 1}")
        assert status == 200 and [e["data"] for e in events] == [expected]
        assert value(scrape(b.url), "streamgate_result_spool_results") == 0  # B ran nothing: it kept nothing
    finally:
        a.stop()
        b.stop()
