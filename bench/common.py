"""What every benchmark shares: servers on loopback, a cheap raw SSE client, load, percentiles, the report.

Each benchmark starts real `streamgate` processes (uvicorn on 127.0.0.1, on
free ports, from the repository root so that `--tools bench.tools` imports),
sends bounded loopback traffic, and prints one plain-text report: the machine,
tables of figures measured side by side in the same run, and a `target:` line
per target ending in `met`, `missed` or `unavailable`. Nothing is downloaded:
the quick mode builds a tiny random model like the tests do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import io
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from gateway.server.stream import raise_fd_limit  # noqa: F401  (the benchmarks' clients need what the gateway does)
from tests.support.processes import ROOT, STREAMGATE, ServeProcess, clean_env, free_port

# Short prompts the model benchmarks send in turn (batching.py, ray_serve.py, generation.py).
SHORT_PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "A group of crows is called a",
    "The first person to walk on the moon was",
    "The chemical symbol for gold is",
    "The tallest mountain on Earth is",
    "Photosynthesis turns sunlight into",
]

STOP_GRACE_S = 10.0  # then SIGKILL: a gateway with a long queue may take its time to drain


# -- the run: arguments, scratch folder, processes -------------------------------------


def arguments(doc: str | None, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """`--quick` and `--model`, plus what `extra` adds; the description is the script's docstring."""
    parser = argparse.ArgumentParser(
        description=(doc or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        conflict_handler="resolve",  # a script may define a flag of its own over one of these
    )
    parser.add_argument("--quick", action="store_true", help="A small, fast run (CI).")
    parser.add_argument("--model", default=None, help="A model folder for the gateway (default: see the script).")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:N… for every process that runs the model (default: the gateway's "
                             "choice, the best available).")
    parser.add_argument("--dtype", default=None,
                        help="float32, float16 or bfloat16 (default: bfloat16 on CUDA, else the gateway's float32).")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


class Bench:
    """One benchmark run: its arguments, a scratch folder, and the processes it started.

    Used as a context manager: every process is stopped and the folder removed on
    the way out, whatever happened.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick: bool = args.quick
        self.dir = Path(tempfile.mkdtemp(prefix="streamgate-bench-"))
        self.processes: list[ServeProcess] = []
        self._tiny: dict[bool, Path] = {}

    def __enter__(self) -> Bench:
        return self

    def __exit__(self, *exc: Any) -> None:
        for process in reversed(self.processes):
            stop(process)
        shutil.rmtree(self.dir, ignore_errors=True)

    def tiny_model(self, wide: bool = False) -> Path:
        """A tiny random Llama (2 layers, hidden 32, byte tokenizer), built once per run; `wide`: hidden
        256 and an 8k context, as the tests' `wide_model_path` (a long input's pass takes tens of MB
        and a good part of a second)."""
        if wide not in self._tiny:
            from tests.conftest import build_tiny_model  # imports torch: only when a tiny model is needed

            shape = {"hidden": 256, "context": 8192} if wide else {}
            with contextlib.redirect_stderr(io.StringIO()):  # transformers' progress bar while saving
                self._tiny[wide] = build_tiny_model(self.dir / ("wide-model" if wide else "tiny-model"), **shape)
        return self._tiny[wide]

    def model(self, *, default_tiny: bool, wide: bool = False) -> str | None:
        """`--model`, else the tiny model (`wide`: the wide one) where the figures do not depend on it
        (or in --quick), else the default."""
        if self.args.model:
            return self.args.model
        if default_tiny or self.quick:
            return str(self.tiny_model(wide))
        return None

    def start(self, argv: Sequence[str], port: int, name: str, env: dict[str, str] | None = None) -> ServeProcess:
        """Start `argv` from the repository root (environment: ours less STREAMGATE_*, plus `env`); not yet waited for."""
        log = self.dir / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(list(argv), cwd=ROOT, env=clean_env(**(env or {})), stdout=out, stderr=subprocess.STDOUT)
        process = ServeProcess(proc, f"http://127.0.0.1:{port}", log)
        self.processes.append(process)
        return process

    def streamgate(
        self, command: str, *flags: str, model: str | None, name: str | None = None, env: dict[str, str] | None = None
    ) -> ServeProcess:
        """`streamgate serve|executor` with the bench tools on a free port; not yet waited for."""
        port = free_port()
        argv = [str(STREAMGATE), command, "--port", str(port), "--log-level", "warning", *flags]
        if command == "executor" or _backend(flags) in ("local", "ray"):  # it runs the tools, or its Ray replicas do
            argv += ["--tools", "bench.tools", *(["--model", model] if model else [])]
            if not {"--device", "--devices", "--dtype"} & set(flags):  # `--device cuda` reaches every such process
                argv += device_flags(self.args)
        return self.start(argv, port, name or command, env)

    def ready(self, *processes: ServeProcess) -> None:
        """Wait until each answers `/readyz` 200 (started together, they load in parallel)."""
        for process in processes:
            process.wait_ready()


def device_flags(args: argparse.Namespace) -> list[str]:
    """`--device` and `--dtype` as every server takes them: bfloat16 on CUDA unless told otherwise."""
    device, dtype = getattr(args, "device", None), getattr(args, "dtype", None)
    dtype = dtype or ("bfloat16" if device and device.startswith("cuda") else None)
    return [*(["--device", device] if device else []), *(["--dtype", dtype] if dtype else [])]


def _backend(flags: Sequence[str]) -> str:
    """The `--backend` among `flags` (`local` when none is given)."""
    flags = list(flags)
    return flags[flags.index("--backend") + 1] if "--backend" in flags[:-1] else "local"


def stop(process: ServeProcess) -> None:
    """SIGTERM, then SIGKILL after STOP_GRACE_S."""
    proc = process.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def reset_peak_rss(pid: int) -> None:
    """Set a process's peak (VmHWM) back to its resident memory now, so that the next reading of
    VmHWM is the peak since this call (Linux; a process of the same user)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def rss_kb(pid: int, field: str = "VmRSS") -> int:
    """Resident memory of a process, in KiB: now (VmRSS), or its peak so far (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for process {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def readyz(process: ServeProcess) -> dict[str, Any]:
    return httpx.get(process.url + "/readyz", headers=process.headers, timeout=10).json()


def port_of(process: ServeProcess) -> int:
    return int(process.url.rsplit(":", 1)[1])


# -- a raw HTTP/1.1 client: cheap enough for thousands of streams in one process --------


@dataclass
class SseEvent:
    event: str
    id: str
    data: bytes
    at: float  # time.time() when the bytes that completed it arrived


@dataclass
class Response:
    """One request on its own connection (`Connection: close`), the answer read as it arrives."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    status: int
    headers: dict[str, str]
    sent: float  # time.time() just before the request was written
    pings: int = 0
    _chunked: bool = False

    @classmethod
    async def open(
        cls, port: int, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
        source: str | None = None,
    ) -> Response:
        """`source`: the loopback address to connect from (127.0.0.2…): without tokens, the gateway's
        owner of the request is its client's address, so each source is another tenant."""
        local = (source, 0) if source else None
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24, local_addr=local)
        lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        sent = time.time()
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except BaseException:
            writer.close()
            raise
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        found = {}
        for line in header_lines:
            if line:
                name, _, value = line.partition(":")
                found[name.strip().lower()] = value.strip()
        response = cls(reader, writer, int(status_line.split()[1]), found, sent)
        response._chunked = found.get("transfer-encoding", "").lower() == "chunked"
        return response

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, de-chunked."""
        if not self._chunked:
            while chunk := await self.reader.read(1 << 16):
                yield chunk
            return
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                return
            data = await self.reader.readexactly(size + 2)
            yield data[:-2]

    async def body(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def events(self) -> AsyncIterator[SseEvent]:
        """The body as SSE events (LF line ends, as both servers here write them); counts `: ping` comments."""
        buffer = b""
        async for chunk in self.chunks():
            at = time.time()
            buffer += chunk
            *blocks, buffer = buffer.split(b"\n\n")
            for block in blocks:
                event = self._parse(block, at)
                if event is not None:
                    yield event

    def _parse(self, block: bytes, at: float) -> SseEvent | None:
        fields: dict[bytes, bytes] = {}
        for line in block.split(b"\n"):
            if line.startswith(b":"):
                self.pings += line.strip() == b": ping"
                continue
            name, _, value = line.partition(b":")
            fields[name] = value[1:] if value.startswith(b" ") else value
        if b"data" not in fields:
            return None
        return SseEvent(fields.get(b"event", b"message").decode(), fields.get(b"id", b"").decode(), fields[b"data"], at)

    def close(self) -> None:
        self.writer.close()


@dataclass
class JobRun:
    """One job followed to its end: when it was sent, its events, and how it ended."""

    status: int
    job_id: str
    sent: float
    events: list[SseEvent] = field(default_factory=list)
    pings: int = 0
    body: bytes = b""  # the answer, when it was not a stream (an error's JSON)
    headers: dict[str, str] = field(default_factory=dict)  # the answer's, when it was not a stream

    @property
    def terminal(self) -> SseEvent | None:
        last = self.events[-1] if self.events else None
        return last if last is not None and last.event in ("data", "error") else None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.terminal is not None and self.terminal.event == "data"

    @property
    def latency(self) -> float:
        """Seconds from sending the request to the terminal event."""
        assert self.terminal is not None
        return self.terminal.at - self.sent

    @property
    def first_event(self) -> float:
        """Seconds from sending the request to its first event."""
        return self.events[0].at - self.sent


async def run_job(
    port: int, path: str, params: Any, *, method: str = "POST", source: str | None = None, headers: dict[str, str] | None = None
) -> JobRun:
    """POST `params` to `path` and follow the stream to its terminal event (or its end)."""
    response = await Response.open(port, method, path, msgspec.json.encode(params), headers=headers, source=source)
    run = JobRun(response.status, response.headers.get("x-job-id", ""), response.sent)
    try:
        if response.status != 200:
            run.body, run.headers = await response.body(), dict(response.headers)
            return run
        async for event in response.events():
            run.events.append(event)
            if event.event in ("data", "error"):
                break
    finally:
        run.pings = response.pings
        response.close()
    return run


class Probe:
    """One GET (`/healthz`) over and over on a kept-alive connection of its own, `gap` seconds apart,
    from `start()` to `stop()`: when each was sent and how long its answer took, read per span of
    the run with `between`. A probe still unanswered at `stop()` counts with the time it had waited."""

    def __init__(self, port: int, path: str = "/healthz", gap: float = 0.01) -> None:
        self.port = port
        self.request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
        self.gap = gap
        self.samples: list[tuple[float, float]] = []  # (time.time() sent, seconds to the whole answer)
        self.failures = 0  # answers other than 200, and connections lost
        self._sent: float | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self._sent is not None:
            self.samples.append((self._sent, time.time() - self._sent))

    def between(self, start: float, end: float) -> list[float]:
        """Milliseconds of the probes sent from `start` to `end` (time.time())."""
        return [seconds * 1000 for sent, seconds in self.samples if start <= sent <= end]

    async def _loop(self) -> None:
        while True:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            try:
                while True:
                    self._sent = time.time()
                    writer.write(self.request)
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                                   if line.startswith(b"content-length:")), 0)
                    await reader.readexactly(length)
                    self.samples.append((self._sent, time.time() - self._sent))
                    self._sent = None
                    self.failures += b" 200 " not in head.split(b"\r\n", 1)[0] + b" "
                    await asyncio.sleep(self.gap)
            except (OSError, asyncio.IncompleteReadError):
                self.failures += 1
                self._sent = None
            finally:
                writer.close()


@dataclass
class Load:
    """What a closed loop of clients did: every run, and the wall time it took."""

    runs: list[JobRun]
    wall: float

    @property
    def ok(self) -> list[JobRun]:
        return [run for run in self.runs if run.ok]

    @property
    def failed(self) -> int:
        return len(self.runs) - len(self.ok)

    @property
    def jobs_per_s(self) -> float:
        return len(self.ok) / self.wall

    def latencies_ms(self) -> list[float]:
        return [run.latency * 1000 for run in self.ok]


async def closed_loop(
    clients: int, jobs: int, one: Callable[[int], Awaitable[JobRun]], deadline: float | None = None
) -> Load:
    """`clients` concurrent clients, each starting its next job as soon as its last ended, `jobs` in all.

    With a `deadline` (seconds), no job starts after it, so that a slow or busy
    machine cannot stretch a run without bound; jobs under way still finish.
    """
    runs: list[JobRun] = []
    counter = iter(range(jobs))
    start = time.perf_counter()

    async def client() -> None:
        for index in counter:
            runs.append(await one(index))
            if deadline is not None and time.perf_counter() - start > deadline:
                return

    await asyncio.gather(*(client() for _ in range(clients)))
    return Load(runs, time.perf_counter() - start)


# -- figures -------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks; nan when there are no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def fmt(value: Any, digits: int = 1) -> str:
    """A table cell: numbers rounded to `digits`, None or nan as `n/a`."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


# -- the report ---------------------------------------------------------------------


def step(message: str) -> None:
    """Where a run is, on stderr: the report on stdout stays clean."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def machine(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    torch = importlib.metadata.version("torch")
    return f"{cpu}, {os.cpu_count()} cores, torch {torch}, device {device}, Python {platform.python_version()}"


class Report:
    """The printed result: a header, tables, notes, and one `target:` line per target."""

    def __init__(self, title: str, bench: Bench) -> None:
        self.title = title
        self.bench = bench
        self.facts: list[tuple[str, str]] = []
        self.blocks: list[str] = []
        self.targets: list[str] = []
        self.load = os.getloadavg()  # other work on the machine skews every figure: say how much there was

    def fact(self, name: str, value: str) -> None:
        self.facts.append((name, value))

    def table(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> None:
        """Columns separated by two spaces (cells never hold two in a row), under a line of dashes."""
        cells = [[fmt(c) if not isinstance(c, str) else c for c in row] for row in rows]
        widths = [max([len(col)] + [len(row[i]) for row in cells]) for i, col in enumerate(columns)]
        lines = [title] if title else []
        lines.append("  ".join(col.ljust(w) for col, w in zip(columns, widths)).rstrip())
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in cells]
        self.blocks.append("\n".join(lines))

    def note(self, text: str) -> None:
        self.blocks.append(f"note: {text}")

    def target(self, what: str, measured: str, met: bool | None) -> None:
        """`met` None: the figure could not be measured in this run."""
        verdict = "unavailable" if met is None else "met" if met else "missed"
        self.targets.append(f"target: {what}: {measured}: {verdict}")

    def print(self) -> None:
        mode = "quick" if self.bench.quick else "full"
        out = [f"# {self.title}", f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}", f"mode: {mode}",
               "load average (1, 5, 15 min) at start: {:.2f} {:.2f} {:.2f}; at end: {:.2f} {:.2f} {:.2f}".format(
                   *self.load, *os.getloadavg())]
        out += [f"{name}: {value}" for name, value in self.facts]
        targets = ["\n".join(self.targets)] if self.targets else []
        print("\n".join(out), *self.blocks, *targets, sep="\n\n", flush=True)


def main(run: Callable[[Bench, Report], Awaitable[list[str] | None]], title: str, doc: str | None,
         extra: Callable[[argparse.ArgumentParser], None] | None = None, disagreed: str = "results disagree") -> None:
    """Parse the arguments, run the benchmark in a `Bench`, and print its report.

    A run that checks numbers as well as timing them returns what disagreed: then
    the script says so after the report and exits 1, as wrong numbers must not
    pass for figures.
    """
    args = arguments(doc, extra)
    with Bench(args) as bench:
        report = Report(title, bench)
        failed = asyncio.run(run(bench, report))
    report.print()
    sys.stdout.flush()
    if failed:
        print(f"error: {disagreed}: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)
