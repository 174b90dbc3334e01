"""Streaming vs polling: requests per job, and how late the client learns that its job ended.

The same job every time: `bench.tools.ticks` as a progress step every 50 ms
for a known time (1 s; --quick 0.3 s), on a tiny model. Either the client
follows the job's event stream (one request: the POST), or it submits, lets
go of the stream (the job runs on, detached) and polls `GET /jobs/{id}` every
T ms with one keep-alive httpx client, as a polling client would, until the
snapshot says SUCCEEDED. Its first poll comes at a random point in the first
period (seeded), so that the job's end falls anywhere between two polls.

Delay: the client's clock when the answer saying the job ended arrived (the
`data` event, or the first snapshot showing SUCCEEDED) minus the job's
`finished` time in its snapshot (the moment the terminal event was written,
Unix seconds to the millisecond), both on this machine's clock.

There is no target here; the table shows what a polling period costs.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

import httpx
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

TITLE = "polling: an event stream vs polling GET /jobs/{id}, for the same job"
STEP_MS = 50


async def streamed(port: int, params: dict) -> tuple[str, float, int]:
    """Follow the job's stream: (job id, when the `data` event arrived, requests)."""
    job = await common.run_job(port, "/ticks/run", params)
    assert job.ok, f"the streamed job failed: {job.status} {job.events[-1:]}"
    return job.job_id, job.terminal.at, 1


async def polled(port: int, client, params: dict, period: float, rng: random.Random) -> tuple[str, float, int]:
    """Submit, drop the stream, poll every `period` s: (job id, when the answer saying SUCCEEDED came, requests)."""
    response = await common.Response.open(port, "POST", "/ticks/run", msgspec.json.encode(params))
    job_id = response.headers["x-job-id"]
    response.close()  # the job runs on, detached, for --detach-grace seconds
    start = time.monotonic() + rng.uniform(0, period)
    polls = 0
    while True:
        await asyncio.sleep(max(0.0, start + polls * period - time.monotonic()))
        snapshot = (await client.get(f"/jobs/{job_id}")).json()
        polls += 1
        if snapshot["status"] in ("SUCCEEDED", "FAILED"):
            assert snapshot["status"] == "SUCCEEDED", snapshot
            return job_id, time.time(), 1 + polls


async def run(bench: common.Bench, report: common.Report) -> None:
    quick = bench.quick
    job_ms, jobs = (300, 3) if quick else (1000, 10)
    periods_ms = [50, 250, 1000]
    params = {"count": job_ms // STEP_MS, "interval_ms": STEP_MS, "kind": "progress"}
    gateway = bench.streamgate("serve", model=bench.model(default_tiny=True))
    bench.ready(gateway)
    port = common.port_of(gateway)
    report.fact("machine", common.machine(common.readyz(gateway).get("device", "?")))
    report.fact("job", f"ticks: {params['count']} progress steps of {STEP_MS} ms ({job_ms} ms), {jobs} jobs per row, one at a time")
    rng = random.Random(0)
    rows = []
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        await streamed(port, params)  # warm-up
        methods = [("stream", None)] + [("poll", period / 1000) for period in periods_ms]
        for method, period in methods:
            delays, requests = [], []
            common.step(f"{method}{'' if period is None else f' every {period * 1000:g} ms'}: {jobs} jobs")
            for _ in range(jobs):
                if period is None:
                    job_id, seen, count = await streamed(port, params)
                else:
                    job_id, seen, count = await polled(port, client, params, period, rng)
                finished = (await client.get(f"/jobs/{job_id}")).json()["finished"]
                delays.append((seen - finished) * 1000)
                requests.append(count)
            rows.append([
                "SSE stream" if period is None else "poll",
                "-" if period is None else f"{period * 1000:g}",
                jobs,
                sum(requests) / jobs,
                common.percentile(delays, 50),
                sum(delays) / jobs,
                max(delays),
            ])
    report.table(["client", "period ms", "jobs", "requests/job", "delay p50 ms", "delay mean ms", "delay max ms"], rows)
    report.note("delay resolution is about 1 ms: `finished` is rounded to the millisecond; "
                "a polling client's requests/job is its POST plus every GET until the snapshot said SUCCEEDED")


if __name__ == "__main__":
    common.main(run, TITLE, __doc__)
