"""Idle streams: how many open, quiet event streams one gateway process holds, and the memory each costs.

Two kinds of idle stream, each on a fresh gateway (tiny model, `bench.tools`):

- queued (the realistic one, and the one the target is judged on): a burst of
  clients each POSTs its own job while one long job holds the only worker, as
  when a slow model meets a spike of requests. Each stream costs what a real
  waiting client costs: its connection, its response task and its job (params,
  event log, queue slot). Needs `--queue-size` above the number of streams.
- followers: many clients on `GET /jobs/{id}/events` of that one long job, as
  dashboards watching a shared job: the connection and response alone.

For each: start the long job, open a few warm-up streams, read the gateway's
resident memory (VmRSS from /proc), open N streams (each read up to its first
event, so the gateway holds it), stay quiet for a few ping intervals, read the
memory again; (after - before) / N is the cost of one stream. Every stream is
read to the end by the client, which counts the `: ping` heartbeats each got;
the gateway's CPU time over the quiet spell and one `/healthz` round trip show
what holding them costs. The client is plain asyncio connections writing raw
HTTP/1.1, a few hundred opening at a time; RLIMIT_NOFILE is raised here and
inherited by the gateway. The gateway is then killed (SIGKILL: see the note on
shutdown in bench/RESULTS.md) and every connection closed.

Target: >= 10,000 idle streams at <= 30 KB each (KB = 1024 bytes, as VmRSS counts).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

TITLE = "idle streams: open quiet streams one gateway holds, and memory per stream"
OPENING = 256  # connections being opened at once: within uvicorn's listen backlog
WARM_UP = 32
TARGET_STREAMS = 10_000
TARGET_KB = 30


def options(parser) -> None:
    parser.add_argument("--streams", type=int, default=None, help="Idle streams to open (default 10000; --quick 500).")
    parser.add_argument("--mode", choices=["queued", "followers", "both"], default="both")


class Held:
    """Streams this client holds open, each read to its end in a task of its own."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.streams: list[common.Response] = []
        self.readers: list[asyncio.Task[None]] = []
        self.failures: list[str] = []
        self._opening = asyncio.Semaphore(OPENING)

    async def open(self, method: str, path: str, body: object = None) -> None:
        """Open one stream and wait for its first event; a failure is counted, not raised."""
        async with self._opening:
            try:
                payload = None if body is None else msgspec.json.encode(body)
                response = await common.Response.open(self.port, method, path, payload)
                if response.status != 200:
                    self.failures.append(f"HTTP {response.status}: {(await response.body())[:200]!r}")
                    response.close()
                    return
                events = response.events()
                await asyncio.wait_for(anext(events), 30)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, StopAsyncIteration) as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
                return
        self.streams.append(response)
        self.readers.append(asyncio.create_task(self._drain(events)))

    @staticmethod
    async def _drain(events) -> None:
        async for _ in events:
            pass

    async def open_many(self, count: int, method: str, path: str, body: object = None) -> None:
        await asyncio.gather(*(self.open(method, path, body) for _ in range(count)))

    def close(self) -> None:
        for task in self.readers:
            task.cancel()
        for response in self.streams:
            response.close()


async def measure(bench: common.Bench, mode: str, streams: int, ping: float, hold: float) -> dict[str, object]:
    gateway = bench.streamgate(
        # One client opens them all: one owner, whose share of the queue is the whole of it here.
        "serve", "--queue-size", str(streams + 2 * WARM_UP), "--max-queued-per-owner", str(streams + 2 * WARM_UP),
        "--max-streams", str(streams + 2 * WARM_UP),
        "--ping-interval", str(ping),
        model=bench.model(default_tiny=True), name=f"serve-{mode}",
    )
    bench.ready(gateway)
    pid, port = gateway.proc.pid, common.port_of(gateway)
    held = Held(port)
    try:
        long_job = await common.Response.open(port, "POST", "/wait/run", msgspec.json.encode({"seconds": 3600}))
        async for event in long_job.events():
            if b'"RUNNING"' in event.data:
                break
        held.streams.append(long_job)
        job_id = long_job.headers["x-job-id"]
        if mode == "queued":
            args = ("POST", "/wait/run", {"seconds": 0})
        else:
            args = ("GET", f"/jobs/{job_id}/events", None)
        common.step(f"{mode}: opening {streams} streams")
        await held.open_many(WARM_UP, *args)
        await asyncio.sleep(1)
        before = common.rss_kb(pid)
        started = time.perf_counter()
        await held.open_many(streams, *args)
        opening = time.perf_counter() - started
        opened = len(held.streams) - 1 - WARM_UP
        # Pings come after `ping` seconds of quiet: hold long enough for a few on every stream.
        cpu = common.cpu_seconds(pid)
        common.step(f"{mode}: {opened} streams open; {hold:g} s quiet")
        await asyncio.sleep(hold)
        cpu_share = (common.cpu_seconds(pid) - cpu) / hold
        after = common.rss_kb(pid)
        probe = time.perf_counter()
        await (await common.Response.open(port, "GET", "/healthz")).body()
        healthz_ms = (time.perf_counter() - probe) * 1000
        pings = [r.pings for r in held.streams[1 + WARM_UP:]]
    finally:
        gateway.kill()
        held.close()
    return {
        "mode": mode,
        "streams": opened,
        "failed": len(held.failures),
        "open s": opening,
        "RSS before MB": before / 1024,
        "RSS after MB": after / 1024,
        "KB/stream": (after - before) / opened if opened else None,
        "with pings": sum(p > 0 for p in pings),
        "pings min": min(pings, default=0),
        "pings max": max(pings, default=0),
        "gateway CPU %": cpu_share * 100,
        "healthz ms": healthz_ms,
        "first failure": held.failures[0] if held.failures else "",
    }


async def run(bench: common.Bench, report: common.Report) -> None:
    quick = bench.quick
    streams = bench.args.streams or (500 if quick else TARGET_STREAMS)
    ping, hold = (1.0, 3.5) if quick else (5.0, 16.0)
    modes = ["queued", "followers"] if bench.args.mode == "both" else [bench.args.mode]
    limit = common.raise_fd_limit(streams + 2 * WARM_UP + 1024)
    report.fact("machine", common.machine("cpu (no model work: the long job sleeps)"))
    report.fact("setup", f"--ping-interval {ping:g} s, {hold:g} s quiet after the last stream opened, "
                f"{WARM_UP} warm-up streams before the first reading, RLIMIT_NOFILE {limit}")
    rows = [await measure(bench, mode, streams, ping, hold) for mode in modes]
    columns = [c for c in rows[0] if c != "first failure"]
    report.table(columns, [[row[c] for c in columns] for row in rows])
    for row in rows:
        if row["first failure"]:
            report.note(f"{row['mode']}: first failure: {row['first failure']}")
    judged = rows[0]
    held_all = judged["failed"] == 0 and judged["with pings"] == judged["streams"]
    what = f"{judged['streams']} {judged['mode']} streams, {judged['with pings']} with pings"
    report.target(f">= {TARGET_STREAMS:,} idle streams held, pings on every one", what,
                  None if streams < TARGET_STREAMS else held_all and judged["streams"] >= TARGET_STREAMS)
    kb = judged["KB/stream"]
    report.target(f"<= {TARGET_KB} KB per idle stream ({judged['mode']})", f"{common.fmt(kb)} KB",
                  None if kb is None else kb <= TARGET_KB)


if __name__ == "__main__":
    common.main(run, TITLE, __doc__, options)
