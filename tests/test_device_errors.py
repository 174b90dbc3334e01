"""A device that runs out of memory fails one job and goes on; a device that fails for good
ends every job and makes the process exit non-zero, for its supervisor to restart it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import msgspec
import torch

from gateway.tools import Context, Model, tool
from gateway.tools.batching import one_pass
from tests.conftest import run_stream, wait_until
from tests.support.device_tools import device_error
from tests.support.processes import clean_env, free_port, start_serve


class Item(msgspec.Struct):
    x: int


class Squared(msgspec.Struct):
    y: int


def _square_many(model: Model, jobs: list[Item], ctxs: list[Context]) -> list[Squared]:
    if len(jobs) > 1:  # a batch too big for the device; one at a time fits
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
    return [Squared(j.x * j.x) for j in jobs]


@tool(batch=one_pass(_square_many))
def square(model: Model, params: Item, ctx: Context) -> Squared:
    """x squared; runs out of memory in any batch of more than one."""
    return _square_many(model, [params], [ctx])[0]


def test_out_of_memory_fails_the_job_and_the_next_one_runs(serve: Any) -> None:
    server = serve(tools=[device_error])
    failed = run_stream(server.url, "device_error", {"kind": "oom"})
    error = failed.terminal["data"]["error"]
    assert error["code"] == "tool_error"
    assert error["message"].startswith("the device ran out of memory running this job")
    assert "Tried to allocate 20.00 GiB" in error["message"]
    assert httpx.get(server.url + "/readyz").status_code == 200
    assert run_stream(server.url, "device_error", {"kind": "none"}).terminal["event"] == "data"


def test_a_batch_out_of_memory_runs_its_jobs_one_by_one(serve: Any) -> None:
    server = serve(tools=[square], batch_wait_ms=200)
    results: list[Any] = [None] * 4

    def go(i: int) -> None:
        results[i] = run_stream(server.url, "square", {"x": i}).terminal

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [r["data"]["y"] for r in results] == [0, 1, 4, 9]
    assert max(server.backend.workers[0].batch_sizes) > 1


def test_a_fatal_device_error_ends_every_job_and_exits_non_zero(tiny_model_path: Path, tmp_path: Path) -> None:
    port = free_port()
    server = start_serve(
        # Threads: the model in the gateway's own process, which exits for its supervisor (with
        # engine processes the gateway restarts the engine itself: tests/test_engines.py).
        ["--model", str(tiny_model_path), "--device", "cpu", "--port", str(port), "--tools", "tests.support.device_tools", "--engine", "thread"],
        clean_env(),
        port,
        tmp_path / "serve.log",
    )
    try:
        results: dict[str, Any] = {}

        def go(name: str, params: dict[str, Any]) -> None:
            results[name] = run_stream(server.url, "device_error", params)

        failing = threading.Thread(target=go, args=("failing", {"kind": "fatal", "delay": 2.0}))
        failing.start()
        wait_until(lambda: httpx.get(server.url + "/readyz").json().get("running") == 1, 10, "the job to run")
        queued = threading.Thread(target=go, args=("queued", {"kind": "none"}))
        queued.start()
        failing.join(20)
        queued.join(20)
        for name in ("failing", "queued"):
            error = results[name].terminal["data"]["error"]
            assert error["code"] == "backend_unavailable", (name, error)
            assert "the device failed" in error["message"]
        assert server.proc.wait(timeout=20) == 70, server.output()
        assert "the device failed" in server.output()
    finally:
        server.kill()
