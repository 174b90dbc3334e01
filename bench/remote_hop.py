"""The remote hop: what a gateway in front of an executor adds, per frame and per result byte.

Three processes on a tiny model, each with `bench.tools`: a local gateway, an
executor, and a remote gateway (`--backend remote --executor URL`) in front of it.
The two that run the model get one torch thread each (OMP_NUM_THREADS=1), so
that the model's run time varies little and the hop shows.

Per frame: `bench.tools.ticks` emits a log event every 10 ms whose message is
the worker thread's `time.time()` at emission, in full precision (a frame's
own `ts` is rounded to the millisecond, and a remote gateway stamps it after
the hop, so it cannot see the hop). The client's clock when the event arrives,
minus that time, is the frame's latency; the remote p50 minus the local p50 is
what the hop adds. Log frames take the path status frames take through a
remote gateway (the executor's session socket, decoded and re-emitted with the
gateway's own seq); status frames themselves carry no emission time and
progress is coalesced, so log frames stand in for them.

Per result byte: an `embed` of many texts with `pooling: none` (one vector per
token; `precision: 6`, so that arrays travel as float64 and the JSON a client
gets is quick to write, leaving the hop as the bulk of the difference).
The gateway logs no download timing, so the download is measured from outside,
two ways: (1) the job is submitted straight to the executor and its result
fetched with the remote backend's own download code (`backends.remote.ExecutorLink`:
the GET read into a buffer of its length, the length and SHA-256 checks, the
hash on its thread included), several times, in turn with the same code going
through httpx (what it does behind a proxy), httpx reading the stream without
checks, a raw asyncio socket reading 64 KiB at a time, and the raw ceiling: a
blocking socket with a 4 MiB SO_RCVBUF reading with `recv_into` into a buffer
allocated beforehand, on a thread, no checks; (2) the same job end to end
through the local and the remote gateway, and the result's msgpack size over
the difference in time.

`--device cuda` (or `cuda:N`) runs the model on the GPU in both processes that
run it, the executor and the local gateway (`--device cuda --dtype bfloat16`,
bench/common.py; `--dtype` for another), so that the end-to-end rows still
compare like with like.

Targets: <= 1 ms p50 added per status frame; result download >= 1 GB/s on loopback (p50; MB = 10^6 bytes).
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import sys
import time
import uuid
from pathlib import Path

import httpx
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.remote import ExecutorLink  # noqa: E402
from bench import common  # noqa: E402
from gateway.encoding import from_msgpack, to_json  # noqa: E402

TITLE = "remote hop: per-frame latency and result download, local vs remote gateway"
TICK_MS = 10
TEXT_CHARS = 250  # the tiny model's byte tokenizer: 251 tokens with BOS, within its 256 context
TARGET_MB_S = 1000
RAW_RCVBUF = 4 << 20  # asked for; the kernel gives at most net.core.rmem_max



def embed_params(texts: int) -> dict:
    words = "the quick brown fox jumps over the lazy dog while streams carry results home "
    return {
        "texts": [(f"{i} " + words * 4)[:TEXT_CHARS] for i in range(texts)],
        "pooling": "none",
        "precision": 6,
    }


async def frame_latencies(port: int, frames: int) -> list[float]:
    job = await common.run_job(port, "/ticks/run", {"count": frames, "interval_ms": TICK_MS, "kind": "log"})
    assert job.ok, f"ticks failed: {job.status} {job.events[-1:]}"
    return [(e.at - float(msgspec.json.decode(e.data)["message"])) * 1000 for e in job.events if e.event == "log"]


async def executor_result(executor_url: str, params: dict) -> str:
    """Run `params` as an embed job straight on the executor (no socket: nobody follows it); its id once done."""
    job_id = uuid.uuid4().hex
    body = {"tool": "embed", "params": params, "job_id": job_id}
    async with httpx.AsyncClient(base_url=executor_url, timeout=60) as client:
        submitted = await client.post("/jobs", json=body, headers={"X-Session-Id": uuid.uuid4().hex})
        assert submitted.status_code == 202, submitted.text
        while (await client.head(f"/jobs/{job_id}/result")).status_code == 409:
            await asyncio.sleep(0.05)
    return job_id


def raw_ceiling(port: int, path: str, buffer: bytearray) -> int:
    """GET `path` on a blocking socket, the body read with `recv_into` into `buffer` (large enough); its length."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RAW_RCVBUF)  # before connect: it sets the window scale
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
        view = memoryview(buffer)
        got = 0
        while (end := bytes(view[:got]).find(b"\r\n\r\n")) < 0:
            got += sock.recv_into(view[got:], 1 << 16)
        head = bytes(view[:end]).decode("latin-1").lower()
        size = int(head.split("content-length:")[1].split("\r\n")[0])
        got -= end + 4
        view[:got] = view[end + 4 : end + 4 + got]
        while got < size:
            received = sock.recv_into(view[got:size])
            if not received:
                raise ConnectionError(f"closed after {got} of {size} bytes")
            got += received
    return size


async def run(bench: common.Bench, report: common.Report) -> None:
    quick = bench.quick
    rounds, frames = (2, 50) if quick else (8, 150)
    texts, downloads = (32, 5) if quick else (256, 20)
    model = bench.model(default_tiny=True)
    caps = ["--max-prompts", str(texts)]
    # One torch thread in each process that runs the model: three processes on a small machine, each with a
    # thread per core, made the same embed job take from 0.8 to 5 s, which buried the hop in the model's noise.
    env = {"OMP_NUM_THREADS": "1"}
    # `--device`/`--dtype` (bench/common.py) reach both: the end-to-end rows compare like with like.
    local = bench.streamgate("serve", *caps, model=model, name="local", env=env)
    executor = bench.streamgate("executor", *caps, model=model, env=env)
    bench.ready(local, executor)
    remote = bench.streamgate("serve", "--backend", "remote", "--executor", executor.url, *caps, model=None, name="remote")
    bench.ready(remote)
    report.fact("machine", common.machine(common.readyz(local).get("device", "?")))
    ports = {"local": common.port_of(local), "remote": common.port_of(remote)}

    common.step(f"per frame: {rounds} jobs of {frames} log frames on each gateway")
    latencies: dict[str, list[float]] = {name: [] for name in ports}
    for name, port in ports.items():  # warm-up
        await frame_latencies(port, 10)
    for _ in range(rounds):
        for name, port in ports.items():
            latencies[name] += await frame_latencies(port, frames)
    rows = [[name, rounds, len(values), *(common.percentile(values, q) for q in (50, 90, 99))]
            for name, values in latencies.items()]
    added = [r - l for r, l in zip(rows[1][3:], rows[0][3:])]
    rows.append(["added by the hop", "-", "-", *added])
    report.table(["gateway", "jobs", "log frames", "emit to client p50 ms", "p90 ms", "p99 ms"], rows,
                 title=f"Per frame: a log event every {TICK_MS} ms, from the tool's clock to the client's")

    params = embed_params(texts)
    common.step(f"per result byte: embed of {texts} texts, {downloads} downloads, then {rounds} jobs each way")
    job_id = await executor_result(executor.url, params)
    link = ExecutorLink(executor.url, token=None, deadline=30, poll_interval=1, on_tools=lambda: None)
    path = f"/jobs/{job_id}/result"
    try:
        data = bytes(await link.downloads.fetch(job_id))
        ceiling_buffer = bytearray(len(data) + (1 << 16))  # allocated (and its pages touched) once, before the clock
        times: dict[str, list[float]] = {name: [] for name in ("link", "via httpx", "plain", "raw", "ceiling")}

        async def via_httpx() -> None:
            link.downloads.direct = False  # the path a proxy between gateway and executor would take
            try:
                await link.downloads.fetch(job_id)
            finally:
                link.downloads.direct = True

        async def plain() -> None:
            async with link.http.stream("GET", path) as response:
                [chunk async for chunk in response.aiter_raw()]

        async def raw() -> None:
            await (await common.Response.open(common.port_of(executor), "GET", path)).body()

        async def ceiling() -> None:
            assert await asyncio.to_thread(raw_ceiling, common.port_of(executor), path, ceiling_buffer) == len(data)

        ways = {"link": lambda: link.downloads.fetch(job_id), "via httpx": via_httpx, "plain": plain, "raw": raw,
                "ceiling": ceiling}
        for _ in range(downloads):  # in turn, so that the machine's moods fall on every way alike
            for name, way in ways.items():
                started = time.perf_counter()
                await way()
                times[name].append(time.perf_counter() - started)
    finally:
        await link.stop()
    size = len(data) / 1e6
    sha = _timed(lambda: hashlib.sha256(data).digest())
    convert = _timed(lambda: to_json(from_msgpack(data)))
    json_size = len(to_json(from_msgpack(data))) / 1e6

    ends: dict[str, list[float]] = {name: [] for name in ports}
    for name, port in ports.items():  # warm-up
        await common.run_job(port, "/embed/run", embed_params(2))
    for _ in range(rounds):
        for name, port in ports.items():
            job = await common.run_job(port, "/embed/run", params)
            assert job.ok, f"{name}: embed failed: {job.status} {job.events[-1:]}"
            ends[name].append(job.latency)
    local_s, remote_s = (common.percentile(ends[name], 50) for name in ports)

    def download(label: str, name: str) -> list:
        p50 = common.percentile(times[name], 50)
        return [label, size, p50 * 1000, size / p50]

    labels = {
        "link": "download, the remote backend's code (recv_into its buffer, checks)",
        "via httpx": "download, the same code through httpx (as behind a proxy)",
        "plain": "download, the ExecutorLink's httpx client, no checks",
        "raw": "download, a raw asyncio socket, 64 KiB reads joined, no checks",
        "ceiling": "download, raw ceiling: blocking recv_into, 4 MiB SO_RCVBUF, no checks",
    }
    rows = [
        *(download(label, name) for name, label in labels.items()),
        ["SHA-256 of the result (one of the checks)", size, sha * 1000, size / sha],
        ["msgpack to JSON at the remote gateway", size, convert * 1000, size / convert],
        ["embed end to end, local gateway", json_size, local_s * 1000, "-"],
        ["embed end to end, remote gateway", json_size, remote_s * 1000, "-"],
        ["remote - local (msgpack MB over the difference)", size, (remote_s - local_s) * 1000,
         size / (remote_s - local_s) if remote_s > local_s else None],
    ]
    report.table(["measure", "MB", "time p50 ms", "MB/s"], rows,
                 title=f"Per result byte: embed of {texts} texts of {TEXT_CHARS} characters, pooling none, precision 6 "
                       f"({downloads} downloads each way, in turn; {rounds} jobs each way end to end)")
    best = ", ".join(f"{name} {size / min(times[name]):.0f}" for name in labels)
    report.note(f"downloads, best of {downloads}, MB/s: {best}")
    report.note("downloads: the same result fetched from the executor's GET /jobs/{id}/result in turn by "
                "backends.download.Downloads.fetch (link: what a remote gateway runs, the body read into a buffer of "
                "its Content-Length, its SHA-256 computed on a thread as it arrives, both checked), by the same code "
                "reading through the ExecutorLink's httpx client (via httpx: the path when a proxy is set), by that httpx "
                "client reading the stream and nothing more (plain), by this script's raw asyncio client (raw), and "
                "by a blocking socket on a thread (ceiling: the most a Python reader gets from this executor here); "
                "SHA-256 and msgpack to JSON are the best of 3 in this process")
    report.note("the JSON a client gets is the MB column of the end-to-end rows; the msgpack between executor and "
                "gateway carries float64 here (precision 6), 8 bytes a number")
    hop = added[0]
    report.target("<= 1 ms p50 added per status frame (log frames, same path)", f"{hop:.2f} ms", hop <= 1)
    rate = size / common.percentile(times["link"], 50)
    report.target(f"result download >= {TARGET_MB_S / 1000:g} GB/s on loopback (p50)", f"{rate:.0f} MB/s",
                  rate >= TARGET_MB_S)


def _timed(work, repeat: int = 3) -> float:
    """The best of `repeat` timings of `work`, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


if __name__ == "__main__":
    common.main(run, TITLE, __doc__)
