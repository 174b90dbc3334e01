"""A bounded soak: many jobs through a remote gateway with random disconnects, cancels,
resumes and bad inputs, and the executor killed and restarted halfway. Afterwards every job
has exactly one terminal event, and the gateway's tasks, threads, file descriptors and
memory are back near where they started.

Quick by default (CI); `STREAMGATE_SOAK_JOBS=5000` for a longer run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import threading
import time
from pathlib import Path

import httpx

from gateway.protocol import EventType
from tests.conftest import make_remote_server, parse_sse, track_jobs, wait_until
from tests.support.processes import start_executor

JOBS = int(os.environ.get("STREAMGATE_SOAK_JOBS", "600"))
CLIENTS = 8


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _tasks(loop: asyncio.AbstractEventLoop) -> int:
    async def count() -> int:
        return len(asyncio.all_tasks())

    return asyncio.run_coroutine_threadsafe(count(), loop).result(10)


def _one(client: httpx.Client, url: str, rng: random.Random) -> str:
    """One random client action; returns what it did."""
    action = rng.choices(["run", "disconnect", "cancel", "resume", "bad"], [5, 2, 2, 2, 2])[0]
    params = {"text": "soak", "repeat": rng.randint(1, 4), "delay": rng.choice([0.0, 0.01, 0.02])}
    if action == "bad":
        body = rng.choice([b"{", b"[]", b'{"text": 1}', b'{"nope": true}'])
        tool = rng.choice(["echo", "echo", "no_such_tool"])
        answer = client.post(f"{url}/{tool}/run", content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code in (400, 404, 422, 503), answer.text
        assert "error" in answer.json()
        return action
    with client.stream("POST", f"{url}/echo/run", json=params) as response:
        if response.status_code != 200:  # the executor is away: refused before any job
            response.read()
            assert response.status_code in (429, 503), response.text
            return "refused"
        job_id = response.headers["x-job-id"]
        if action == "run":
            events = parse_sse(response.read())
            assert events[-1]["event"] in ("data", "error")
            return action
        lines = response.iter_lines()
        next(lines, None)  # something was read; then the client goes
    if action == "cancel":
        client.delete(f"{url}/jobs/{job_id}")
    elif action == "resume":
        answer = client.get(f"{url}/jobs/{job_id}/events")
        assert answer.status_code in (200, 204, 404)
    return action


def test_soak_every_job_ends_once_and_resources_come_back(tiny_model_path: Path, tmp_path: Path) -> None:
    executor = start_executor(tiny_model_path, tmp_path / "executor-1.log")
    port = int(executor.url.rsplit(":", 1)[1])
    gateway = make_remote_server([executor.url], deadline=2.0, retention=1.0, queue_size=256)
    jobs = track_jobs(gateway)
    restarted = None
    try:
        with httpx.Client(timeout=30) as warm:
            for _ in range(5):
                _one(warm, gateway.url, random.Random(0))
        wait_until(lambda: all(job.done for job in jobs.values()), 30, "the warm-up jobs to end")
        loop = next(iter(jobs.values()))._loop
        time.sleep(1.5)
        base = {"tasks": _tasks(loop), "threads": threading.active_count(), "fds": _fds(), "rss": _rss_mb()}

        done: list[str] = []
        lock = threading.Lock()
        counter = iter(range(JOBS))
        killed = threading.Event()

        def client_loop(seed: int) -> None:
            rng = random.Random(seed)
            with httpx.Client(timeout=30) as client:
                for i in counter:
                    if i == JOBS // 2 and not killed.is_set():
                        killed.set()
                        executor.kill()
                    try:
                        what = _one(client, gateway.url, rng)
                    except httpx.TransportError:
                        what = "dropped"
                    with lock:
                        done.append(what)

        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(client_loop, seed) for seed in range(CLIENTS)]
            wait_until(lambda: killed.is_set(), 600, "the executor to be killed")
            time.sleep(1.0)
            restarted = start_executor(tiny_model_path, tmp_path / "executor-2.log", port=port)
            for future in futures:
                future.result(600)
        assert len(done) == JOBS

        wait_until(lambda: all(job.done for job in jobs.values()), 60, "every job to end")
        for job in jobs.values():
            terminals = [e for e in job.events if e.type in (EventType.DATA, EventType.ERROR)]
            assert len(terminals) == 1 and job.events[-1] is terminals[0], job.id
        outcomes = {job.terminal.type.value for job in jobs.values()}
        assert outcomes == {"data", "error"}
        # Every started job is accounted for: one per action that got a stream (plus, at
        # most, one per request that dropped after its job was accepted).
        started = sum(done.count(what) for what in ("run", "disconnect", "cancel", "resume"))
        assert started + 5 <= len(jobs) <= started + 5 + done.count("dropped"), (len(jobs), started, done.count("dropped"))
        assert started > JOBS // 4

        # Retention (1 s) forgets the jobs; streams, sockets and timers wind down.
        def settled() -> bool:
            return (
                _tasks(loop) <= base["tasks"] + 2
                and threading.active_count() <= base["threads"] + 2
                and _fds() <= base["fds"] + 5
            )

        wait_until(settled, 30, "tasks, threads and descriptors to return to their baseline")
        assert _rss_mb() - base["rss"] < 150, (base["rss"], _rss_mb())
    finally:
        gateway.stop()
        executor.kill()
        if restarted is not None:
            restarted.kill()
