"""Streaming overhead: a no-op job through the gateway vs a bare sse-starlette endpoint sending the same frames.

The gateway serves `bench.tools.noop` (8 partials of 64 characters, then a
small result) on a tiny model. The bare endpoint is a Starlette app in this
script, under uvicorn in its own process like the gateway, that answers each
POST with the very bytes the gateway sent for one such job (recorded at the
start of the run, with a fresh job id each time): same event names, ids and
data sizes, but no job, queue, worker thread or store behind them.

Measured, alternating between the two so that both see the same machine:
time from sending the request to the first event (one client, one job at a
time), jobs/s with several concurrent clients, and events/s on one long stream
(thousands of partials). Clients are raw asyncio connections in this process,
one per job, so the client costs little next to the servers.

Both servers run the same stack, the gateway's (gateway/plumbing/slowclients.py): uvicorn
with httptools and uvloop.

Tracing (gateway/plumbing/tracing.py) is measured in the same run: the gateway
above has no OTEL variable (tracing off, the figures the targets are about), and
a second one, alike but for `OTEL_EXPORTER_OTLP_ENDPOINT`, records every job's
spans and exports them over OTLP/HTTP to a sink in a process of its own, which
counts them; its engine process inherits the variable and traces too. The two
are compared in a table of their own, with the engines' CPU time beside the
gateways'.

Targets: time to first event p50 < 5 ms; gateway jobs/s >= 0.8x the bare
endpoint; the gateway's CPU time per job <= 0.35 ms (its engine process apart).
"""

from __future__ import annotations

import importlib.metadata
import sys
import threading
import uuid
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import msgspec
import uvicorn
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from tests.support import loopback_http  # noqa: E402

TITLE = "streaming: the gateway vs a bare sse-starlette endpoint, same frames"
TARGET_CPU_MS = 0.35  # with the engine process, the default
PLACEHOLDER = "0" * 32  # stands for the job id in the recorded frames


def bare_app(frames_file: Path):
    """POST /noop/run answers the recorded frames; the long stream's, when asked for more partials."""
    recorded: dict[str, list[bytes]] = {}

    async def noop_run(request: Request) -> EventSourceResponse:
        params = msgspec.json.decode(await request.body())
        if not recorded:
            recorded.update({k: [f.encode() for f in v] for k, v in msgspec.json.decode(frames_file.read_bytes()).items()})
        frames = recorded[str(params.get("partials", 8))]
        job_id = uuid.uuid4().hex.encode()

        async def events():
            for frame in frames:
                yield frame.replace(PLACEHOLDER.encode(), job_id)

        return EventSourceResponse(events(), ping=0, sep="\n", headers={"Cache-Control": "no-cache", "X-Job-Id": job_id.decode()})

    async def ready(request: Request) -> JSONResponse:
        return JSONResponse({"ready": True})

    return Starlette(routes=[Route("/noop/run", noop_run, methods=["POST"]), Route("/readyz", ready)])


def serve_bare(port: int, frames_file: Path) -> None:
    from gateway.plumbing.slowclients import event_loop

    uvicorn.run(bare_app(frames_file), host="127.0.0.1", port=port, log_level="warning", http="httptools", loop=event_loop())


def serve_sink(port: int) -> None:
    """An OTLP/HTTP endpoint that takes spans and counts them: `GET /spans` answers how many so far."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    count = [0]
    lock = threading.Lock()

    class Sink(loopback_http.Handler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            request = ExportTraceServiceRequest()
            request.ParseFromString(self.body())
            with lock:
                count[0] += sum(len(scope.spans) for spans in request.resource_spans for scope in spans.scope_spans)
            self.answer(b"", "application/x-protobuf")

        def do_GET(self) -> None:  # noqa: N802
            self.answer(str(count[0]).encode() if self.path == "/spans" else b"{}", "application/json")

    ThreadingHTTPServer(("127.0.0.1", port), Sink).serve_forever()


async def record(port: int, partials: int) -> list[str]:
    """The gateway's bytes for one noop job, event by event, with the job id replaced by PLACEHOLDER."""
    run = await common.run_job(port, "/noop/run", {"partials": partials})
    assert run.ok, f"the recording job failed: {run}"
    frames = ["retry: 3000\n\n"]
    for event in run.events:
        frames.append(f"id: {event.id}\nevent: {event.event}\ndata: {event.data.decode()}\n\n")
    return [frame.replace(run.job_id, PLACEHOLDER) for frame in frames]


async def run(bench: common.Bench, report: common.Report) -> None:
    quick = bench.quick
    clients = 8
    sequential, concurrent, rounds = (40, 150, 2) if quick else (300, 3000, 3)
    long_partials, long_reps = (1000, 2) if quick else (5000, 3)

    frames_file = bench.dir / "frames.json"
    model = bench.model(default_tiny=True)
    gateway = bench.streamgate("serve", model=model)
    bare_port, sink_port = common.free_port(), common.free_port()
    bare = bench.start([sys.executable, __file__, "--bare-server", str(bare_port), str(frames_file)], bare_port, "bare")
    sink = bench.start([sys.executable, __file__, "--otlp-sink", str(sink_port)], sink_port, "otlp-sink")
    traced = bench.streamgate(
        "serve", model=model, name="traced", env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}", "OTEL_SERVICE_NAME": "bench"}
    )
    bench.ready(gateway, traced, bare, sink)
    report.fact("machine", common.machine(common.readyz(gateway).get("device", "?")))
    from gateway.plumbing.slowclients import event_loop

    report.fact("server stack", f"uvicorn {importlib.metadata.version('uvicorn')}, httptools, {event_loop()} loop (every endpoint)")

    ports = {"gateway": common.port_of(gateway), "traced": common.port_of(traced), "bare": bare_port}
    pids = {"gateway": gateway.proc.pid, "traced": traced.proc.pid, "bare": bare.proc.pid}
    # The gateways' engine processes, where the no-op tool runs (and, traced, its queue, run and step spans are made).
    engines = {name: [e["pid"] for e in common.readyz(server).get("engines", []) if e.get("pid")] for name, server in (("gateway", gateway), ("traced", traced))}
    frames = {str(k): await record(ports["gateway"], k) for k in (8, long_partials)}
    frames_file.write_bytes(msgspec.json.encode(frames))
    ran: dict[str, int] = dict.fromkeys(ports, 0)

    async def one(name: str, partials: int = 8) -> common.JobRun:
        job = await common.run_job(ports[name], "/noop/run", {"partials": partials})
        assert job.ok, f"{name}: a job failed: status {job.status}, events {job.events[-1:]}"
        ran[name] += 1
        return job

    for name in ports:  # warm-up: imports, first connections, the worker thread
        for _ in range(20):
            await one(name)

    first: dict[str, list[float]] = {name: [] for name in ports}
    latency: dict[str, list[float]] = {name: [] for name in ports}
    jobs: dict[str, int] = dict.fromkeys(ports, 0)
    wall: dict[str, float] = dict.fromkeys(ports, 0.0)
    cpu: dict[str, float] = dict.fromkeys(ports, 0.0)
    engine_cpu: dict[str, float] = dict.fromkeys(ports, 0.0)
    events: dict[str, int] = dict.fromkeys(ports, 0)
    long_events: dict[str, float] = dict.fromkeys(ports, 0.0)
    long_wall: dict[str, float] = dict.fromkeys(ports, 0.0)
    for round_ in range(rounds):
        common.step(f"round {round_ + 1} of {rounds}")
        for name in ports:
            for _ in range(sequential // rounds):
                job = await one(name)
                first[name].append(job.first_event * 1000)
                latency[name].append(job.latency * 1000)
            used = common.cpu_seconds(pids[name])
            used_there = sum(map(common.cpu_seconds, engines.get(name, [])))
            load = await common.closed_loop(clients, concurrent // rounds, lambda i, name=name: one(name))
            cpu[name] += common.cpu_seconds(pids[name]) - used
            engine_cpu[name] += sum(map(common.cpu_seconds, engines.get(name, []))) - used_there
            jobs[name] += len(load.ok)
            wall[name] += load.wall
            events[name] += sum(len(r.events) for r in load.ok)
            for _ in range(max(1, long_reps // rounds)):
                job = await one(name, long_partials)
                long_events[name] += len(job.events)
                long_wall[name] += job.latency

    figures = {
        name: {
            "jobs/s": jobs[name] / wall[name],
            "events/s": events[name] / wall[name],
            "server CPU ms/job": cpu[name] / jobs[name] * 1000,
            "first event p50 ms": common.percentile(first[name], 50),
            "first event p99 ms": common.percentile(first[name], 99),
            "job p50 ms": common.percentile(latency[name], 50),
            "long stream events/s": long_events[name] / long_wall[name],
        }
        for name in ports
    }
    rows = [[name, clients, jobs[name], *figures[name].values()] for name in ("gateway", "bare")]
    shares = [f"{g / b:.2f}" for g, b in zip(figures["gateway"].values(), figures["bare"].values())]
    rows.append(["gateway/bare", "-", "-", *shares])
    report.fact("frames per job", f"{len(frames['8']) - 1} events (RECEIVED, QUEUED, RUNNING, 8 partials of 64 "
                f"characters, data), {sum(map(len, frames['8']))} bytes; the long stream: {long_partials} partials")
    report.table(["endpoint", "clients", "jobs", *figures["gateway"]], rows)
    report.note(f"first event and job p50: one client, one job at a time ({sequential} jobs each); jobs/s and "
                f"events/s: {clients} clients in a closed loop, and the CPU time (user + system) the server process used meanwhile; long stream: one job of {long_partials} partials; "
                f"each measured in turn on every endpoint, {rounds} rounds")

    # Tracing off and on: the gateway above, and the one exporting every job's spans.
    for name in ("gateway", "traced"):
        figures[name]["engine CPU ms/job"] = engine_cpu[name] / jobs[name] * 1000
    common.stop(traced)  # its last spans are exported as it stops
    spans = int(httpx.get(f"http://127.0.0.1:{sink_port}/spans", timeout=10).text)
    report.fact("tracing on", f"OTEL_EXPORTER_OTLP_ENDPOINT to a sink process (OTLP/HTTP, protobuf), every job sampled; "
                f"{spans} spans exported by the gateway and its engine for {ran['traced']} jobs, {spans / max(1, ran['traced']):.1f} a job")
    columns = ["jobs/s", "server CPU ms/job", "engine CPU ms/job", "first event p50 ms", "job p50 ms", "long stream events/s"]
    off, on = ([figures[name][c] for c in columns] for name in ("gateway", "traced"))
    report.table(
        ["tracing", *columns],
        [["off", *off], ["on", *on], ["on/off", *(f"{b / a:.2f}" if a else "-" for a, b in zip(off, on))]],
        title="tracing: the same gateway without OTEL variables, and exporting every job's spans",
    )
    ttfe = common.percentile(first["gateway"], 50)
    report.target("time to first event p50 < 5 ms", f"{ttfe:.2f} ms", ttfe < 5)
    share = figures["gateway"]["jobs/s"] / figures["bare"]["jobs/s"]
    report.target("gateway jobs/s >= 0.8x the bare endpoint", f"{share:.2f}x", share >= 0.8)
    cpu_ms = figures["gateway"]["server CPU ms/job"]
    report.target(f"gateway CPU per job <= {TARGET_CPU_MS} ms", f"{cpu_ms:.2f} ms", cpu_ms <= TARGET_CPU_MS)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bare-server"]:
        serve_bare(int(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1:2] == ["--otlp-sink"]:
        serve_sink(int(sys.argv[2]))
    else:
        common.main(run, TITLE, __doc__)
