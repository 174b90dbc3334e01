"""Observability: `/metrics` as jobs succeed, fail, wait, batch and stream; `X-Request-Id`; log lines.

Every test runs against real servers on loopback. Metrics are read the way
Prometheus reads them: `GET /metrics`, parsed with prometheus_client's parser.
"""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.plumbing.logs import UVICORN_LOGGERS, RequestContext, configure_logging, redact
from gateway.tools import Context, Model, load_module, tool
from tests.conftest import Server, make_remote_server, open_stream, run_stream, track_jobs, wait_until
from tests.support.processes import free_port

USER_TOOLS = load_module("tests.support.user_tools")  # echo (slow with `delay`) and fail
SLOW = {"text": "s", "repeat": 400, "delay": 0.05}  # 20 s at most; every test cancels it


class BoomParams(msgspec.Struct):
    pass


def _broken_check(model: Model, params: BoomParams) -> None:
    raise RuntimeError("a bug in a check")


@tool(check=_broken_check)
def boom(model: Model, params: BoomParams, ctx: Context) -> BoomParams:
    """Its check raises something other than an ApiError: the gateway answers 500."""
    return params


# -- reading /metrics ----------------------------------------------------------------------


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of `GET /metrics`, by (name, labels)."""
    response = httpx.get(url + "/metrics", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (as PromQL's `sum(name{labels})`);
    0 when there are none (a labelled counter that never moved)."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and wanted <= have)


def first_running(response: httpx.Response) -> Iterator[str]:
    """The stream's lines, read until the job runs; keep the iterator to keep the connection."""
    lines = response.iter_lines()
    for line in lines:
        if '"status":"RUNNING"' in line:
            break
    return lines


# -- metrics -------------------------------------------------------------------------------


def test_job_counters_and_times_follow_success_failure_and_cancellation(serve: Any) -> None:
    server = serve(tools=USER_TOOLS)
    before = scrape(server.url)
    assert value(before, "streamgate_jobs_total", tool="echo", outcome="succeeded", code="") == 0
    assert value(before, "streamgate_model_ready") == 1

    assert run_stream(server.url, "echo", {"text": "hi"}).terminal["event"] == "data"
    assert run_stream(server.url, "fail", {}).terminal["data"]["error"]["code"] == "tool_error"
    with open_stream(server.url, "echo", SLOW) as response:
        lines = first_running(response)
        httpx.delete(f"{server.url}/jobs/{response.headers['x-job-id']}", timeout=30)
        assert '"code":"cancelled"' in "".join(lines)

    after = scrape(server.url)
    assert value(after, "streamgate_jobs_total", tool="echo", outcome="succeeded", code="") == 1
    assert value(after, "streamgate_jobs_total", tool="fail", outcome="failed", code="tool_error") == 1
    assert value(after, "streamgate_jobs_total", tool="echo", outcome="cancelled", code="cancelled") == 1
    # Both echo jobs ran, so both have a queue wait and a run time; the cancelled one ran longest.
    assert value(after, "streamgate_job_run_seconds_count", tool="echo") == 2
    assert value(after, "streamgate_job_queue_wait_seconds_count", tool="echo") == 2
    # Measured from when the loop hears the job began, so a 50 ms step may read a few ms short of it.
    assert value(after, "streamgate_job_run_seconds_sum", tool="echo") > 0.02
    assert value(after, "streamgate_job_run_seconds_count", tool="fail") == 1
    # Every event went out on a stream: three terminals, and statuses before each.
    assert value(after, "streamgate_events_sent_total", event="data") == 1
    assert value(after, "streamgate_events_sent_total", event="error") == 2
    assert value(after, "streamgate_events_sent_total", event="status") >= 9
    assert value(after, "streamgate_events_sent_total", event="log") >= 2  # echo and fail log a line each


def test_queue_depth_counts_the_jobs_waiting(serve: Any) -> None:
    server = serve(tools=USER_TOOLS)
    jobs = track_jobs(server)
    threads = [threading.Thread(target=run_stream, args=(server.url, "echo", SLOW)) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        # One runs on the only worker; two wait behind it.
        wait_until(lambda: value(scrape(server.url), "streamgate_queue_depth") == 2, 20, "two jobs queued")
        samples = scrape(server.url)
        assert value(samples, "streamgate_jobs_running") == 1
    finally:
        wait_until(lambda: len(jobs) == 3, 20, "three jobs")
        # The waiting ones first, so that none starts when the running one ends.
        for job in sorted(jobs.values(), key=lambda job: job.started is not None):
            httpx.delete(f"{server.url}/jobs/{job.id}", timeout=30)
        for t in threads:
            t.join(30)
    samples = scrape(server.url)
    assert value(samples, "streamgate_queue_depth") == 0
    assert value(samples, "streamgate_jobs_total", tool="echo", outcome="cancelled", code="cancelled") == 3
    # Two were cancelled while queued: they never started, so they have no wait or run time.
    assert value(samples, "streamgate_job_run_seconds_count", tool="echo") == 1


def test_batch_sizes_are_a_histogram_of_the_workers_batches(serve: Any) -> None:
    server = serve(tools=USER_TOOLS, batch_wait_ms=0)
    jobs = track_jobs(server)
    assert value(scrape(server.url), "streamgate_batch_size_count") == 0
    results: list[Any] = []
    with open_stream(server.url, "echo", SLOW) as response:
        lines = first_running(response)
        # Four predict jobs wait behind the slow one, then run as one batch of four.
        threads = [
            threading.Thread(target=lambda p=p: results.append(run_stream(server.url, "predict", {"prompt": p})))
            for p in ("a", "bb", "ccc", "dddd")
        ]
        for t in threads:
            t.start()
        wait_until(lambda: value(scrape(server.url), "streamgate_queue_depth") == 4, 20, "four predict jobs queued")
        slow = next(job_id for job_id, job in jobs.items() if job.tool == "echo")
        httpx.delete(f"{server.url}/jobs/{slow}", timeout=30)
        del lines
    for t in threads:
        t.join(60)
    assert [r.terminal["event"] for r in results] == ["data"] * 4
    samples = scrape(server.url)
    assert value(samples, "streamgate_batch_size_count") == 1
    assert value(samples, "streamgate_batch_size_sum") == 4
    assert value(samples, "streamgate_batch_size_bucket", le="2.0") == 0
    assert value(samples, "streamgate_batch_size_bucket", le="4.0") == 1
    assert value(samples, "streamgate_batch_size_bucket", le="+Inf") == 1


def test_active_streams_counts_open_streams(serve: Any) -> None:
    server = serve(tools=USER_TOOLS, detach_grace=30)
    assert value(scrape(server.url), "streamgate_active_streams") == 0
    with open_stream(server.url, "echo", SLOW) as response:
        lines = first_running(response)
        job_id = response.headers["x-job-id"]
        assert value(scrape(server.url), "streamgate_active_streams") == 1
        # A second client following the same job is a second stream.
        with httpx.Client(timeout=30) as other:
            with other.stream("GET", f"{server.url}/jobs/{job_id}/events") as follower:
                following = follower.iter_lines()  # kept: a collected iterator closes the connection
                next(following)
                assert value(scrape(server.url), "streamgate_active_streams") == 2
                del following
        wait_until(lambda: value(scrape(server.url), "streamgate_active_streams") == 1, 10, "the follower's stream to close")
        del lines
    httpx.delete(f"{server.url}/jobs/{job_id}", timeout=30)
    wait_until(lambda: value(scrape(server.url), "streamgate_active_streams") == 0, 10, "every stream to close")


def test_executor_health_and_the_executors_own_metrics(executors: Any, tiny_model_path: Path) -> None:
    executor = executors.get(tiny_model_path, flags=("--log-level", "info", "--log-format", "json"))
    dead = f"http://127.0.0.1:{free_port()}"
    server = make_remote_server([executor.url, dead])
    try:
        samples = scrape(server.url)
        assert value(samples, "streamgate_model_ready") == 1  # one executor is enough
        assert value(samples, "streamgate_executor_up", executor=executor.url) == 1
        assert value(samples, "streamgate_executor_up", executor=dead) == 0

        stream = run_stream(server.url, "echo", {"text": "far"}, headers={"X-Request-Id": "remote-req-1"})
        assert stream.terminal["event"] == "data"
        assert stream.headers["x-request-id"] == "remote-req-1"
        gateway = scrape(server.url)
        assert value(gateway, "streamgate_jobs_total", tool="echo", outcome="succeeded", code="") == 1
        there = scrape(executor.url)
        assert value(there, "streamgate_jobs_total", tool="echo", outcome="succeeded", code="") == 1
        assert value(there, "streamgate_job_run_seconds_count", tool="echo") == 1
        assert value(there, "streamgate_queue_depth") == 0
    finally:
        server.stop()
    # `--log-format json`: the executor's log lines are JSON, and its access line for the
    # submit carries the request id the gateway's client sent.
    lines = [json.loads(line) for line in executor.output().splitlines() if line.startswith('{"ts"')]
    assert lines and all({"ts", "level", "logger", "message"} <= set(line) for line in lines)
    submits = [line for line in lines if line["logger"] == "uvicorn.access" and "POST /jobs" in line["message"]]
    assert [line.get("request_id") for line in submits] == ["remote-req-1"]

    # Without a ready executor, the gateway says so.
    alone = make_remote_server([dead], ready=False)
    try:
        samples = scrape(alone.url)
        assert value(samples, "streamgate_model_ready") == 0
        assert value(samples, "streamgate_executor_up", executor=dead) == 0
    finally:
        alone.stop()


# -- request ids ---------------------------------------------------------------------------


def test_a_sane_request_id_is_echoed_on_every_answer(serve: Any) -> None:
    server = serve(tools=USER_TOOLS)
    mine = {"X-Request-Id": "client-42.a:b_c"}
    stream = run_stream(server.url, "echo", {"text": "x"}, headers=mine)
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert stream.headers["x-request-id"] == "client-42.a:b_c"
    for response in (
        httpx.post(server.url + "/nope/run", json={}, headers=mine),  # 404 unknown_tool
        httpx.post(server.url + "/echo/run", json={"text": 1}, headers=mine),  # 422
        httpx.get(server.url + "/no/such/route", headers=mine),  # Starlette's 404
        httpx.get(server.url + "/healthz", headers=mine),
        httpx.get(server.url + "/metrics", headers=mine),
    ):
        assert response.headers["x-request-id"] == "client-42.a:b_c", response.request.url


@pytest.mark.parametrize("given", [None, "", "has space", "x" * 129, "-starts-with-a-dash", "quote\"d"])
def test_a_missing_or_odd_request_id_is_replaced(serve: Any, given: str | None) -> None:
    server = serve()
    headers = {} if given is None else {"X-Request-Id": given}
    first = httpx.get(server.url + "/healthz", headers=headers).headers["x-request-id"]
    second = httpx.get(server.url + "/healthz", headers=headers).headers["x-request-id"]
    assert len(first) == 32 and int(first, 16) >= 0
    assert first != second


def test_a_500_carries_its_request_id_and_so_does_its_log_record(serve: Any, caplog: pytest.LogCaptureFixture) -> None:
    server = serve(tools=[boom])
    caplog.handler.addFilter(RequestContext())  # what configure_logging puts on its handler
    caplog.set_level(logging.INFO)
    response = httpx.post(server.url + "/boom/run", json={}, headers={"X-Request-Id": "req-500"})
    assert response.status_code == 500 and response.json()["error"]["code"] == "internal"
    assert response.headers["x-request-id"] == "req-500"
    records = [r for r in caplog.records if r.name == "streamgate.app" and "unhandled error" in r.getMessage()]
    assert [r.request_id for r in records] == ["req-500"]


# -- log lines -----------------------------------------------------------------------------


@pytest.fixture
def configured_logs() -> Iterator[Any]:
    """`configure(fmt)` sets logging up as the CLI does, into a buffer; undone after the test."""
    root = logging.getLogger()
    saved_root = (root.level, list(root.handlers))
    saved = {name: (lg.level, lg.propagate, list(lg.handlers)) for name in UVICORN_LOGGERS if (lg := logging.getLogger(name))}
    buffer = io.StringIO()

    def configure(fmt: str) -> io.StringIO:
        configure_logging("info", fmt, stream=buffer)
        return buffer

    yield configure
    root.setLevel(saved_root[0])
    root.handlers[:] = saved_root[1]
    for name, (level, propagate, handlers) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.propagate = propagate
        logger.handlers[:] = handlers


def _requests_with_secrets(server: Server) -> str:
    """A run and a snapshot whose URLs carry credentials; the job's id."""
    with httpx.Client(timeout=30) as client:
        run = client.post(
            f"{server.url}/echo/run?ticket=t1cket&token=s3cret&max_tokens=3",
            json={"text": "y"},
            headers={"X-Request-Id": "req-logs"},
        )
        assert b"event: data" in run.content
        job_id = run.headers["x-job-id"]
        snapshot = client.get(f"{server.url}/jobs/{job_id}?access_token=acc3ss&api_key=k3y", headers={"X-Request-Id": "req-snap"})
    assert snapshot.status_code == 200
    return job_id


def test_json_log_lines_carry_request_and_job_ids_and_no_credentials(serve: Any, configured_logs: Any) -> None:
    server = serve(tools=USER_TOOLS)
    buffer = configured_logs("json")
    job_id = _requests_with_secrets(server)
    text = buffer.getvalue()
    lines = [json.loads(line) for line in text.splitlines()]  # every line is one JSON object
    assert all({"ts", "level", "logger", "message"} <= set(line) for line in lines)
    access = {line["request_id"]: line for line in lines if line["logger"] == "uvicorn.access"}
    assert set(access) >= {"req-logs", "req-snap"}
    run = access["req-logs"]
    assert run["level"] == "info" and run["ts"].endswith("Z")
    assert run["job_id"] == job_id  # the stream's job, named on its request's lines
    assert "ticket=REDACTED&token=REDACTED&max_tokens=3" in run["message"]
    assert "access_token=REDACTED&api_key=REDACTED" in access["req-snap"]["message"]
    for secret in ("t1cket", "s3cret", "acc3ss", "k3y"):
        assert secret not in text


def test_text_log_lines_end_with_the_ids(serve: Any, configured_logs: Any) -> None:
    server = serve(tools=USER_TOOLS)
    buffer = configured_logs("text")
    _requests_with_secrets(server)
    text = buffer.getvalue()
    line = next(line for line in text.splitlines() if "POST /echo/run" in line and "req-logs" in line)
    assert " INFO uvicorn.access: " in line
    assert "ticket=REDACTED&token=REDACTED" in line
    assert line.endswith("]") and "[request_id=req-logs job_id=" in line
    assert "s3cret" not in text and "acc3ss" not in text


def test_redact_leaves_ordinary_parameters_alone() -> None:
    assert redact("GET /generate/run?max_tokens=8&prompts=a&token=abc") == "GET /generate/run?max_tokens=8&prompts=a&token=REDACTED"
    assert redact("GET /x?Access_Token=abc HTTP/1.1") == "GET /x?Access_Token=REDACTED HTTP/1.1"
    assert redact("cannot reach redis://:hunter2@cache:6379/0") == "cannot reach redis://:REDACTED@cache:6379/0"
    assert redact("Authorization: Bearer abc.def") == "Authorization: Bearer REDACTED"
    assert redact("tokens=5 ticketing=1") == "tokens=5 ticketing=1"
