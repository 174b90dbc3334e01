"""A gateway process as its supervisor and its clients see it: every SIGTERM ends in exit 0,
a killed replica's job reads as lost, and the memory a big job took is given back.

Real `streamgate serve` processes on the tiny model, and a redis-server of each test's own.
They run this checkout's code (PYTHONPATH), wherever the console script's
editable install points.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.common import rss_kb
from gateway.tools import load_module
from tests.conftest import make_server, parse_sse, run_stream, wait_until
from tests.support.processes import ROOT, ServeProcess, clean_env, free_port, start_serve
from tests.support.redis_server import RedisServer, start_redis

CYCLES = 6


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own: its job index holds this test's jobs alone."""
    server = start_redis(tmp_path)
    yield server
    server.stop()


def serve(model: Path, log: Path, *args: str) -> ServeProcess:
    port = free_port()
    flags = ["--model", str(model), "--device", "cpu", "--port", str(port), "--log-level", "info", *args]
    return start_serve(flags, clean_env(PYTHONPATH=str(ROOT)), port, log)


def in_thread(fn: Any, *args: Any, **kwargs: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """`fn(*args, **kwargs)` on a thread of its own; its result, or what it raised, lands in the dict."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = fn(*args, **kwargs)
        except Exception as exc:  # a client whose server was killed under it
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def follow_until_running(url: str, tool: str, params: Any, running: threading.Event) -> list[dict[str, Any]]:
    """A job's stream read to its end, `running` set as soon as it says RUNNING; its events."""
    raw = b""
    with httpx.Client(timeout=120) as client, client.stream("POST", f"{url}/{tool}/run", json=params) as response:
        assert response.status_code == 200, response.read()
        for chunk in response.iter_bytes():
            raw += chunk
            if not running.is_set() and b'"status":"RUNNING"' in raw:
                running.set()
    return parse_sse(raw)


def test_every_sigterm_drain_exits_zero_even_with_a_step_in_flight(
    tiny_model_path: Path, own_redis: RedisServer, tmp_path: Path
) -> None:
    """A step inside torch's native code when the process exits used to end it with SIGABRT
    ("terminate called without an active exception"), after a clean drain."""
    for cycle in range(CYCLES):
        server = serve(tiny_model_path, tmp_path / f"serve{cycle}.log", "--store", own_redis.url,
                       "--tools", "tests.support.native_tools", "--drain-timeout", "0.5")
        try:
            assert run_stream(server.url, "predict", {"prompt": "x", "top_k": 1}).terminal["event"] == "data"
            running = threading.Event()
            thread, outcome = in_thread(follow_until_running, server.url, "grind", {"seconds": 60}, running)
            # Its own stream says it runs: not a count polled from the engine, which may still be the last job's.
            assert running.wait(30), f"cycle {cycle}: the grind did not start: {outcome}"
            signalled = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            code = server.proc.wait(timeout=30)
            assert code == 0, f"cycle {cycle}: exit {code}\n{server.output()[-3000:]}"
            assert time.monotonic() - signalled < 10
            thread.join(10)
            assert outcome["result"][-1]["data"]["error"]["code"] == "shutting_down"
        finally:
            server.kill()


def test_a_killed_replica_s_job_reads_as_lost_not_as_long_finished(
    tiny_model_path: Path, own_redis: RedisServer, tmp_path: Path
) -> None:
    """kill -9 of the replica running a job: every other replica reads the job as ended with
    backend_unavailable (retryable), in the listing, its snapshot and its events, never 404
    "unknown, or finished more than N s ago". A retention shorter than the outage grace
    used to let the job's record expire before its owner counted as gone."""
    retention, grace = 5, 6  # the record used to expire 5 + 3 s after the kill, its owner to count as gone at 6 + 3
    flags = ["--store", own_redis.url, "--tools", "tests.support.user_tools", "--detach-grace", "60",
             "--retention", str(retention), "--store-outage-grace", str(grace)]
    a = serve(tiny_model_path, tmp_path / "a.log", *flags)
    b = None
    try:
        b = make_server(tiny_model_path, tools=load_module("tests.support.user_tools"), store=own_redis.url,
                        retention=retention, store_outage_grace=grace)
        follower, _ = in_thread(run_stream, a.url, "echo", {"text": "ab", "repeat": 600, "delay": 0.05}, timeout=120)
        wait_until(lambda: listed(b.url), 10, "the job to be listed on B")
        (job_id,) = listed(b.url)
        wait_until(lambda: listed(b.url)[job_id]["status"] == "RUNNING", 10, "the job to run")
        a.kill()
        follower.join(10)
        killed = time.monotonic()
        while listed(b.url).get(job_id, {}).get("status") == "RUNNING":
            assert time.monotonic() - killed < 30, "the job still reads as running"
            time.sleep(0.2)
        shown = listed(b.url)
        assert job_id in shown, "the lost job was forgotten before it read as lost"
        for snapshot in (shown[job_id], httpx.get(f"{b.url}/jobs/{job_id}").json()):
            assert snapshot["status"] == "FAILED"
            error = snapshot["terminal"]["data"]["error"]
            assert error["code"] == "backend_unavailable" and error["retryable"] is True
        answer = httpx.get(f"{b.url}/jobs/{job_id}/events", timeout=30)
        assert answer.status_code == 200, answer.text
        events = [e for e in parse_sse(answer.content) if "id" in e]
        assert [e["id"] for e in events] == [f"{job_id}:{i}" for i in range(1, len(events) + 1)]
        assert events[-1]["event"] == "error" and events[-1]["data"]["error"]["code"] == "backend_unavailable"
        # Then forgotten, as a finished job is, once its retention is over.
        wait_until(lambda: httpx.get(f"{b.url}/jobs/{job_id}").status_code == 404, 15, "the lost job to be forgotten")
    finally:
        a.kill()
        if b is not None:
            b.stop()


def listed(url: str) -> dict[str, Any]:
    return {job["job_id"]: job for job in httpx.get(f"{url}/jobs", timeout=30).json()["jobs"]}


# A big job's own memory back within this of where the process was before it; without giving
# back, over 100 MiB of this one's stays resident.
MARGIN_MIB = 48


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_the_memory_a_big_job_took_is_given_back_once_idle(tiny_model_path: Path, tmp_path: Path, engine: str) -> None:
    """By every process it went through: with `--engine process`, the engine that did the work and
    the gateway that fetched and streamed its result, each back near where it was."""
    # No retention: the result itself is forgotten at once, so that what is measured is the work's memory.
    server = serve(
        tiny_model_path, tmp_path / "serve.log", "--retention", "0", "--log-level", "warning", "--max-result-bytes", "512MiB",
        "--engine", engine,
    )
    try:
        assert run_stream(server.url, "embed", {"texts": ["warm"], "pooling": "per_token"}).terminal["event"] == "data"
        engines = [e["pid"] for e in httpx.get(f"{server.url}/readyz", timeout=10).json().get("engines", [])]
        pids = {"gateway": server.proc.pid, **{"engine": pid for pid in engines}}
        time.sleep(1.5)
        before = {role: rss_kb(pid) >> 10 for role, pid in pids.items()}
        texts = [("abcdefghij" * 25) + str(i) for i in range(2000)]  # ~170 MiB of per-token vectors
        with httpx.stream("POST", f"{server.url}/embed/run", json={"texts": texts, "pooling": "per_token"}, timeout=300) as answer:
            assert answer.status_code == 200
            size = sum(len(chunk) for chunk in answer.iter_raw())
        assert size > 100 << 20
        for role, pid in pids.items():
            peak = rss_kb(pid, "VmHWM") >> 10
            assert peak - before[role] > 150, (role, before[role], peak)  # the job did take memory here
            settled = time.monotonic() + 10
            while (after := rss_kb(pid) >> 10) > before[role] + MARGIN_MIB and time.monotonic() < settled:
                time.sleep(0.5)
            assert after <= before[role] + MARGIN_MIB, f"{role}: resident {before[role]} MiB before, {peak} at peak, {after} idle after"
    finally:
        server.stop()
