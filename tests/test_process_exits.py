"""A gateway process as its supervisor and its clients see it: every SIGTERM ends in exit 0.

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

from tests.conftest import run_stream, wait_until
from tests.processes import ROOT, ServeProcess, clean_env, free_port, start_serve
from tests.redis_server import RedisServer, start_redis

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


def test_every_sigterm_drain_exits_zero_even_with_a_step_in_flight(
    tiny_model_path: Path, own_redis: RedisServer, tmp_path: Path
) -> None:
    """A step inside torch's native code when the process exits used to end it with SIGABRT
    ("terminate called without an active exception"), after a clean drain."""
    for cycle in range(CYCLES):
        server = serve(tiny_model_path, tmp_path / f"serve{cycle}.log", "--store", own_redis.url,
                       "--tools", "tests.native_tools", "--drain-timeout", "0.5")
        try:
            assert run_stream(server.url, "predict", {"prompt": "x", "top_k": 1}).terminal["event"] == "data"
            thread, outcome = in_thread(run_stream, server.url, "grind", {"seconds": 60})
            wait_until(lambda: httpx.get(server.url + "/readyz").json()["running"] == 1, 10, "the grind to run")
            signalled = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            code = server.proc.wait(timeout=30)
            assert code == 0, f"cycle {cycle}: exit {code}\n{server.output()[-3000:]}"
            assert time.monotonic() - signalled < 10
            thread.join(10)
            assert outcome["result"].terminal["data"]["error"]["code"] == "shutting_down"
        finally:
            server.kill()
