"""Stopping well: a job's execution deadline, a stream's write deadline, and SIGTERM drains
the gateway (503 to new work, running jobs finish or end with shutting_down, exit 0)."""

from __future__ import annotations

import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec

from gateway.tools import Context, Model, tool
from tests.conftest import make_remote_server, run_stream, track_jobs, wait_until
from tests.support.processes import clean_env, free_port, start_executor, start_serve
from tests.support.user_tools import echo


class FloodParams(msgspec.Struct):
    chunks: int = 2000
    size: int = 65536


class FloodResult(msgspec.Struct):
    sent: int


@tool(partial=dict)
def flood(model: Model, params: FloodParams, ctx: Context) -> FloodResult:
    """Partials as fast as they can be made: more than any socket buffer holds."""
    for i in range(params.chunks):
        ctx.raise_if_cancelled()
        ctx.partial({"i": i, "pad": "x" * params.size})
        time.sleep(0.001)
    return FloodResult(params.chunks)


def test_a_job_past_its_deadline_ends_with_timeout_and_frees_the_worker(serve: Any) -> None:
    server = serve(tools=[echo], job_timeout=0.5)
    started = time.monotonic()
    slow = run_stream(server.url, "echo", {"text": "a", "repeat": 200, "delay": 0.05})
    assert slow.terminal["event"] == "error"
    error = slow.terminal["data"]["error"]
    assert error["code"] == "timeout"
    assert "limit of 0.5 s" in error["message"]
    assert time.monotonic() - started < 5
    # The work stopped: the worker is free again and the next job runs.
    wait_until(lambda: not server.backend.workers[0].busy, 5, "the worker to be free")
    assert run_stream(server.url, "echo", {"text": "b"}).terminal["event"] == "data"


def test_a_batched_generation_past_its_deadline_leaves_its_batch(serve: Any) -> None:
    server = serve(job_timeout=2.5)
    # 20 ms a forward pass: the long job needs over 5 s, the short one a few passes.
    hook = server.backend.model.module.register_forward_pre_hook(lambda *_: time.sleep(0.02))
    outcome: dict[str, Any] = {}
    long = threading.Thread(
        target=lambda: outcome.update(long=run_stream(server.url, "generate", {"prompts": ["Once"], "max_tokens": 250}))
    )
    try:
        long.start()
        wait_until(lambda: server.backend.workers[0].busy, 10, "the long job to run")
        short = run_stream(server.url, "generate", {"prompts": ["Hi"], "max_tokens": 3})
        assert short.terminal["event"] == "data", short.terminal
        long.join(30)
    finally:
        hook.remove()
    assert outcome["long"].terminal["data"]["error"]["code"] == "timeout"
    assert max(server.backend.workers[0].batch_sizes) == 2


def test_a_client_that_stops_reading_is_detached_after_the_write_timeout(serve: Any) -> None:
    server = serve(tools=[flood], write_timeout=1.0, detach_grace=0)
    jobs = track_jobs(server)
    host, port = server.url.removeprefix("http://").split(":")
    body = b"{}"
    with socket.create_connection((host, int(port))) as sock:
        # A small receive buffer fills fast; then the server's writes block.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(
            b"POST /flood/run HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: len(jobs) == 1, 10, "the job to start")
        (job,) = jobs.values()
        # Never read: the gateway gives up on the write, detaches, and (grace 0) cancels the job.
        wait_until(lambda: job.done, 30, "the stalled stream to be detached and its job cancelled")
    assert job.terminal.type.value == "error"
    assert b'"cancelled"' in job.terminal.data
    assert run_stream(server.url, "predict", {"prompt": "x", "top_k": 1}).terminal["event"] == "data"


def test_sigterm_drains_then_exits_zero(tiny_model_path: Path, tmp_path: Path) -> None:
    port = free_port()
    server = start_serve(
        ["--model", str(tiny_model_path), "--device", "cpu", "--port", str(port), "--tools", "tests.support.user_tools",
         "--drain-timeout", "3", "--log-level", "info"],
        clean_env(),
        port,
        tmp_path / "serve.log",
    )
    results: dict[str, Any] = {}

    def follow(name: str, params: dict[str, Any]) -> None:
        results[name] = run_stream(server.url, "echo", params)

    # `short` finishes within the drain; `long`, queued behind it, does not.
    threads = [
        threading.Thread(target=follow, args=("short", {"text": "s", "repeat": 10, "delay": 0.1})),
        threading.Thread(target=follow, args=("long", {"text": "l", "repeat": 1000, "delay": 0.1})),
    ]
    threads[0].start()
    wait_until(lambda: httpx.get(server.url + "/readyz").json()["running"] == 1, 10, "the short job to run")
    threads[1].start()
    wait_until(lambda: httpx.get(server.url + "/readyz").json()["queued"] == 1, 10, "the long job to queue")
    server.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    wait_until(lambda: httpx.get(server.url + "/readyz").status_code == 503, 5, "readyz to say 503")
    ready = httpx.get(server.url + "/readyz")
    assert ready.json()["reason"] == "shutting down"
    refused = httpx.post(server.url + "/echo/run", json={"text": "new"})
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "shutting_down"
    assert refused.headers["retry-after"] == "5"
    for t in threads:
        t.join(30)
    assert server.proc.wait(timeout=30) == 0, server.output()
    assert time.monotonic() - signalled < 15
    assert results["short"].terminal["event"] == "data"
    assert results["long"].terminal["event"] == "error"
    assert results["long"].terminal["data"]["error"]["code"] == "shutting_down"


def test_sigterm_drains_an_executor_its_jobs_results_still_reach_the_gateway(tiny_model_path: Path, tmp_path: Path) -> None:
    executor = start_executor(tiny_model_path, tmp_path / "executor.log", extra=["--drain-timeout", "10"])
    gateway = make_remote_server([executor.url])
    try:
        outcome: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: outcome.update(job=run_stream(gateway.url, "echo", {"text": "e", "repeat": 15, "delay": 0.1}))
        )
        thread.start()
        wait_until(lambda: httpx.get(executor.url + "/readyz").json()["running"] == 1, 20, "the job to run on the executor")
        executor.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(executor.url + "/readyz").status_code == 503, 5, "the executor's readyz to say 503")
        assert httpx.get(executor.url + "/readyz").json()["reason"] == "shutting down"
        thread.join(30)
        # The job ran to its end and its result was fetched before the executor went away.
        assert outcome["job"].terminal["event"] == "data", outcome["job"].terminal
        assert outcome["job"].terminal["data"]["text"] == "e" * 15
        assert executor.proc.wait(timeout=20) == 0, executor.output()
    finally:
        gateway.stop()
        executor.kill()
