"""Safety: a hostile tenant's attacks on one gateway with its caps in force, and what the others saw meanwhile.

One `streamgate serve` on the default model (SmolLM2-135M-Instruct; `--model
PATH` for another; in --quick a tiny random Llama of hidden 256 and an 8k
context, wide and long enough for a long input to take memory and time) with no
tokens, so that a tenant is a client address: the attacker connects from
127.0.0.1, the bystander from 127.0.0.2. Its caps, stated in the report:
`--max-job-memory` (1 GiB; --quick 256 MiB; `--budget`), and the defaults
`--max-result-bytes` 64 MiB, `--max-body-bytes` 1 MiB, `--max-header-bytes`
64 KiB, `--queue-size` 64 with `--max-queued-per-owner` 32, and
`--max-streams-per-owner` 64, and `--write-timeout` 5 s (for attack 8).

The attacks, one after the other:

1. body: 1 MiB of `"\\` (one unterminated string of escapes) to /predict/run: 400;
2. header: a 4 MiB header: 431;
3. lens: logit_lens with 400 layers and 400 positions (zeros) and top_k 100: 413, its result;
4. embed over: 16 texts as long as the context, priced far over the budget: 413;
5. embed under: 32 texts priced just under the budget (two chunks of 16): it runs;
6. flood: 200 `generate` streams of 64 tokens at once: some run, the rest 429;
7. cancel: an embed of 128 such texts, cancelled with DELETE /jobs/{id} once
   running, the bystander's job queued behind it;
8. followers: 10 `GET /jobs/{id}/events` of an embed with a result of about
   8 MB (per-token vectors), on sockets with a 4 KiB receive buffer that are
   never read: the gateway's RSS over what the same job left without followers,
   0.5 s after the job ended and after `--write-timeout` (which should let them go).

The refusals (1-4) are sent `--tries` times each (3; --quick 2). Throughout, a
`/healthz` probe runs on a kept-alive connection of its own (every 10 ms); an
attack's p50/p99 is of the probes sent during it. During each attack the
bystander sends `predict` jobs one after the other; its slowest, request to
`data` event, is set against the same job's p50 on the idle server: allowed 2x
that plus one step of the attack's work, the longest gap between events of the
attacker's running job (an embed chunk, a generate step; none for a refusal),
since a job waits for the step under way and is let through after it. For the
cancel, the bystander's time counts from the DELETE, and the step allowed is
the time from the DELETE to the cancelled job's end. Each refusal must leave no
job in `GET /jobs`. The gateway's peak resident memory during each attack
(VmHWM, reset before it) is given over its idle RSS (after warm-up jobs).

Jobs are priced in this process with the gateway's own code (gateway/cost.py,
the same model loaded here), so that the big jobs are sized to the budget.

Targets: /healthz p99 < 100 ms under every attack; every bystander within 2x its
idle p50 plus one step; every refusal a 4xx with no job made; peak RSS <= idle +
budget + a third of the budget (what tests/test_cost.py allows a measured peak
over its estimate: an estimate >= 3/4 of it); DELETE to the cancelled event <= 1 s;
never-reading followers let go by `--write-timeout`: RSS held after it <= one result.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

TITLE = "safety: a hostile tenant's attacks, and what the gateway and its other tenants saw"
MIB = 1 << 20
ATTACKER, BYSTANDER = "127.0.0.1", "127.0.0.2"
WRITE_TIMEOUT = 5
CAPS = ["--queue-size", "64", "--max-queued-per-owner", "32", "--max-streams-per-owner", "64",
        "--write-timeout", str(WRITE_TIMEOUT)]
PREDICT = {"prompt": "The capital of France is", "top_k": 5}
FILLER = "The quick brown fox jumps over the lazy dog. "
FLOOD, FLOOD_TOKENS = 200, 64
FOLLOWERS, FOLLOWER_RCVBUF = 10, 4096
RESULT_MB = 8  # the followed job's result, about
HEALTHZ_MS = 100
CANCEL_S = 1.0
IDLE_RUNS = 5


def options(parser) -> None:
    parser.add_argument("--budget", type=int, default=None,
                        help="--max-job-memory of the gateway, in MiB (default 1024; --quick 256).")
    parser.add_argument("--tries", type=int, default=None, help="Times each refusal is sent (default 3; --quick 2).")


def text(chars: int) -> str:
    return (FILLER * (chars // len(FILLER) + 1))[:chars]


class Prices:
    """Jobs priced as the gateway prices them (gateway/cost.py), on the same model loaded in this process."""

    def __init__(self, model: str | None, dtype: str | None) -> None:
        from backends import loading as models
        from gateway.tools import builtin_tools

        self.model = models.load(models.resolve(model), "cpu", dtype)
        self.tools = {t.name: t for t in builtin_tools()}

    def cost(self, tool: str, raw: dict[str, Any]) -> Any:
        """Its price (a gateway.cost.Cost); None where the tool's own check refuses it (longer than the context)."""
        from gateway.errors import ApiError

        t = self.tools[tool]
        params = msgspec.convert(raw, t.params)
        try:
            if t.check is not None:
                t.check(self.model, params)
        except ApiError:
            return None
        return t.cost(self.model, params)

    def largest(self, make: Callable[[int], tuple[str, dict[str, Any]]], within: Callable[[Any], bool], top: int) -> int:
        """The largest n <= top whose job make(n) the tool takes, at a price `within` what is wanted."""
        def fits(n: int) -> bool:
            price = self.cost(*make(n))
            return price is not None and within(price)

        low, high = 1, top
        assert fits(low), make(low)
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle) else (low, middle - 1)
        return low


@dataclass
class Outcome:
    """What the attacker got: its answer, how fast, the steps its work ran in, and what else it measured."""

    answer: str
    seconds: float
    step: float = 0.0  # the longest gap between its running job's events (a refusal: none)
    refusal: bool = False
    bystander: list[float] | None = None  # the bystander's times, where the attack measures its own (cancel)
    others: set[str] = field(default_factory=set)  # the job ids of that bystander
    held: tuple[float, float] | None = None  # MB held after the write timeout, and the result's MB (followers)
    notes: list[str] = field(default_factory=list)


@dataclass
class Row:
    attack: str
    outcome: Outcome
    jobs: int  # the attacker's jobs GET /jobs shows after it
    peak_mb: float
    healthz: list[float]
    bystander: list[float]
    allowed: float


def error_code(body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return body[:60].decode(errors="replace")
    return error["code"] + (f": {error['field']}" if error.get("field") else "")


def longest_gap(events: list[common.SseEvent]) -> float:
    """The longest time between two events from the job's first RUNNING on: its longest step."""
    running = [e.at for e in events if b'"RUNNING"' in e.data or e.event != "status"]
    return max((b - a for a, b in zip(running, running[1:])), default=0.0)


class Safety:
    """The gateway under attack, the probe on its /healthz, and the bystander's jobs."""

    def __init__(self, gateway: common.ServeProcess, idle_kb: int, idle_ms: float) -> None:
        self.pid = gateway.proc.pid
        self.port = common.port_of(gateway)
        self.idle_kb = idle_kb
        self.idle_ms = idle_ms
        self.probe = common.Probe(self.port)
        self.rows: list[Row] = []

    async def job_ids(self) -> set[str]:
        response = await common.Response.open(self.port, "GET", "/jobs?limit=500")
        return {job["job_id"] for job in json.loads(await response.body())["jobs"]}

    async def bystander(self, underway: asyncio.Event, done: asyncio.Event) -> list[common.JobRun]:
        """`predict` jobs from the other tenant, one after the other, from `underway` until `done` (none
        if the attack ends before it is under way: it measures its own bystander)."""
        waits = [asyncio.create_task(underway.wait()), asyncio.create_task(done.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        runs: list[common.JobRun] = []
        if not underway.is_set():
            return runs
        while True:
            runs.append(await common.run_job(self.port, "/predict/run", PREDICT, source=BYSTANDER))
            if done.is_set():
                return runs
            await asyncio.sleep(0.02)

    async def attack(self, name: str, work: Callable[[asyncio.Event], Awaitable[Outcome]]) -> Row:
        """Run one attack with the bystander's jobs beside it; its row of the table."""
        common.step(f"attack: {name}")
        before = await self.job_ids()
        common.reset_peak_rss(self.pid)
        underway, done = asyncio.Event(), asyncio.Event()
        started = time.time()
        bystander = asyncio.create_task(self.bystander(underway, done))
        try:
            outcome = await work(underway)
        finally:
            done.set()
        runs = await bystander
        # An attack answered within the probe's gap (a refusal in milliseconds) is judged by the probe that
        # follows it: every row has /healthz figures.
        while not self.probe.between(started, time.time()) and time.time() - started < 5:
            await asyncio.sleep(self.probe.gap)
        ended = time.time()
        peak = common.rss_kb(self.pid, "VmHWM")
        made = await self.job_ids() - before - {run.job_id for run in runs} - outcome.others
        times = outcome.bystander if outcome.bystander is not None else [r.latency * 1000 for r in runs if r.ok]
        if outcome.bystander is None and len(times) < len(runs):
            outcome.notes.append(f"{len(runs) - len(times)} of the bystander's {len(runs)} jobs failed")
        row = Row(name, outcome, len(made), (peak - self.idle_kb) / 1024, self.probe.between(started, ended), times,
                  2 * self.idle_ms + outcome.step * 1000)
        self.rows.append(row)
        return row

    # -- the attacks ---------------------------------------------------------------------

    async def refused(self, underway: asyncio.Event, tries: int, send: Callable[[], Awaitable[tuple[str, float]]]) -> Outcome:
        """`send` `tries` times, one after the other: the answers seen, the slowest time to one."""
        underway.set()
        answers, slowest = [], 0.0
        for _ in range(tries):
            answer, seconds = await send()
            answers.append(answer)
            slowest = max(slowest, seconds)
        return Outcome(" / ".join(sorted(set(answers))), slowest, refusal=True)

    async def post(self, path: str, body: bytes) -> tuple[str, float]:
        response = await common.Response.open(self.port, "POST", path, body, source=ATTACKER)
        answered = time.time() - response.sent
        text = await response.body()
        response.close()
        return f"{response.status} {error_code(text) if response.status != 200 else 'stream'}", answered

    async def header(self, size: int) -> tuple[str, float]:
        head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * size + b"\r\n\r\n"
        answer, seconds = await asyncio.to_thread(send_raw, self.port, head)
        status = answer.split(b"\r\n", 1)[0].split(b" ")
        if len(status) < 2:
            return "closed without an answer", seconds
        _, _, body = answer.partition(b"\r\n\r\n")
        return f"{int(status[1])} {error_code(body)}", seconds

    async def runs(self, tool: str, params: dict[str, Any], underway: asyncio.Event) -> Outcome:
        """One job of the attacker's, followed to its end; the bystander starts when it runs."""
        job = await AttackerJob.post(self.port, tool, params)
        if await job.running():
            underway.set()
        return await job.outcome()

    async def flood(self, underway: asyncio.Event) -> Outcome:
        """FLOOD generate streams at once; the bystander starts once each has its answer's head."""
        answered = 0
        refusals: list[float] = []  # seconds from each refused request to its answer

        async def one(index: int) -> common.JobRun:
            nonlocal answered
            params = {"prompts": [common.SHORT_PROMPTS[index % len(common.SHORT_PROMPTS)]], "max_tokens": FLOOD_TOKENS}
            response = await common.Response.open(self.port, "POST", "/generate/run", msgspec.json.encode(params), source=ATTACKER)
            run = common.JobRun(response.status, response.headers.get("x-job-id", ""), response.sent)
            answered += 1
            if answered == FLOOD:
                underway.set()
            if response.status != 200:
                refusals.append(time.time() - response.sent)
                run.body = await response.body()
            else:
                async for event in response.events():
                    run.events.append(event)
                    if event.event in ("data", "error"):
                        break
            response.close()
            return run

        runs = await asyncio.gather(*(one(i) for i in range(FLOOD)))
        ran = [r for r in runs if r.ok]
        refused = [r for r in runs if r.status != 200]
        codes = sorted({f"{r.status} {error_code(r.body)}" for r in refused})
        failed = len(runs) - len(ran) - len(refused)
        answer = f"{len(ran)} ran; {len(refused)} got {' / '.join(codes) or 'none'}" + (f"; {failed} failed" if failed else "")
        slowest = max(refusals, default=max((r.latency for r in ran), default=0.0))
        outcome = Outcome(answer, slowest, max((longest_gap(r.events) for r in ran), default=0.0))
        outcome.notes.append(
            f"flood: {FLOOD} generate streams of {FLOOD_TOKENS} tokens; the answer time is the slowest refusal's; "
            f"the jobs that ran took {common.fmt(common.percentile([r.latency for r in ran], 50), 2)} s p50, "
            f"{common.fmt(max((r.latency for r in ran), default=None), 2)} s at most"
        )
        return outcome

    async def cancel(self, params: dict[str, Any], delay: float) -> Outcome:
        """A long job, DELETEd `delay` s after it runs, with the bystander's job sent just after it started."""
        job = await AttackerJob.post(self.port, "embed", params)
        if not await job.running():
            return await job.outcome()
        waiting = asyncio.create_task(common.run_job(self.port, "/predict/run", PREDICT, source=BYSTANDER))
        await asyncio.sleep(delay)
        deleted = time.time()
        gone = await common.Response.open(self.port, "DELETE", f"/jobs/{job.job_id}")
        await gone.body()
        outcome = await job.outcome()
        bystander = await waiting
        outcome.seconds = outcome.step = job.events[-1].at - deleted
        outcome.others = {bystander.job_id}
        if bystander.ok:
            outcome.bystander = [(bystander.latency + bystander.sent - deleted) * 1000]
        starts = [e.at - deleted for e in bystander.events if b'"RUNNING"' in e.data]
        outcome.notes.append(
            f"cancel: DELETE answered {gone.status}; DELETE to the cancelled job's last event "
            f"{outcome.seconds * 1000:.0f} ms; to the queued bystander's start "
            + (f"{starts[0] * 1000:.0f} ms" if starts else "never")
            + (" (it started before the DELETE: let through)" if starts and starts[0] < 0 else "")
        )
        return outcome

    async def followers(self, underway: asyncio.Event, params: dict[str, Any]) -> Outcome:
        """The job, and FOLLOWERS streams of it that never read; the memory they hold once it ended, over
        what the same job left with none (run just before, so that the allocator holds its pages already)."""
        await (await AttackerJob.post(self.port, "embed", params)).outcome()
        before = common.rss_kb(self.pid)
        job = await AttackerJob.post(self.port, "embed", params)
        if job.response.status != 200:
            return await job.outcome()
        request = f"GET /jobs/{job.job_id}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
        sockets = [await asyncio.to_thread(never_reading, self.port, request) for _ in range(FOLLOWERS)]
        underway.set()
        try:
            outcome = await job.outcome()
            await asyncio.sleep(0.5)
            held, held_streams = common.rss_kb(self.pid), await self.streams()
            await asyncio.sleep(WRITE_TIMEOUT + 1)
            after, after_streams = common.rss_kb(self.pid), await self.streams()
        finally:
            for sock in sockets:
                sock.close()
        result = len(job.events[-1].data) / MIB
        outcome.held = ((after - before) / 1024, result)
        outcome.notes.append(
            f"followers: {FOLLOWERS} never-reading streams (SO_RCVBUF {FOLLOWER_RCVBUF}) of a "
            f"{result:.1f} MB result: RSS {(held - before) / 1024:.0f} MB over the same "
            f"job's without followers 0.5 s after it ended (streams the gateway counts open: {held_streams}), "
            f"{(after - before) / 1024:.0f} MB after --write-timeout {WRITE_TIMEOUT} s ({after_streams})"
        )
        return outcome

    async def streams(self) -> str:
        """The event streams the gateway holds open (`streamgate_active_streams`)."""
        response = await common.Response.open(self.port, "GET", "/metrics")
        for line in (await response.body()).decode().splitlines():
            if line.startswith("streamgate_active_streams "):
                return f"{float(line.split()[1]):.0f}"
        return "n/a"


class AttackerJob:
    """One job of the attacker's, its events read as wanted: up to its start, then to its end."""

    def __init__(self, response: common.Response) -> None:
        self.response = response
        self.events: list[common.SseEvent] = []
        self._events = response.events()

    @classmethod
    async def post(cls, port: int, tool: str, params: dict[str, Any]) -> AttackerJob:
        return cls(await common.Response.open(port, "POST", f"/{tool}/run", msgspec.json.encode(params), source=ATTACKER))

    @property
    def job_id(self) -> str:
        return self.response.headers.get("x-job-id", "")

    async def running(self) -> bool:
        """Read up to its first RUNNING event; False if it was refused or ended first."""
        if self.response.status == 200:
            async for event in self._events:
                self.events.append(event)
                if b'"RUNNING"' in event.data:
                    return True
                if event.event in ("data", "error"):
                    break
        return False

    async def outcome(self) -> Outcome:
        """Read to its end: its answer, the time from the request to it, and its longest step."""
        sent = self.response.sent
        if self.response.status != 200:
            body = await self.response.body()
            self.response.close()
            return Outcome(f"{self.response.status} {error_code(body)}", time.time() - sent)
        if not self.events or self.events[-1].event not in ("data", "error"):
            async for event in self._events:
                self.events.append(event)
                if event.event in ("data", "error"):
                    break
        self.response.close()
        if not self.events or self.events[-1].event not in ("data", "error"):
            return Outcome("200 ended without a terminal event", time.time() - sent)
        last = self.events[-1]
        answer = "200 data" if last.event == "data" else f"200 error {error_code(last.data)}"
        return Outcome(answer, last.at - sent, longest_gap(self.events))


def send_raw(port: int, data: bytes) -> tuple[bytes, float]:
    """`data` on a socket of its own; what comes back until the server closes, and the time to its first byte."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        started = time.perf_counter()
        first = None
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # cut off mid-send: what it answered first is still to be read
        answer = b""
        try:
            while chunk := sock.recv(65536):
                first = first or time.perf_counter()
                answer += chunk
        except ConnectionResetError:
            pass
    return answer, (first or time.perf_counter()) - started


def never_reading(port: int, request: bytes) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, FOLLOWER_RCVBUF)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request)
    return sock


async def run(bench: common.Bench, report: common.Report) -> None:
    quick = bench.quick
    budget = (bench.args.budget or (256 if quick else 1024)) * MIB
    tries = bench.args.tries or (2 if quick else 3)
    model = bench.model(default_tiny=False, wide=True)
    gateway = bench.streamgate("serve", "--max-job-memory", str(budget), *CAPS, model=model)
    bench.ready(gateway)
    info = common.readyz(gateway)
    common.step("pricing jobs in this process")
    flags = common.device_flags(bench.args)
    prices = Prices(model, flags[flags.index("--dtype") + 1] if "--dtype" in flags else None)
    context = info["context_length"]

    def embed(count: int, pooling: str = "mean") -> Callable[[int], tuple[str, dict[str, Any]]]:
        return lambda chars: ("embed", {"texts": [text(chars)] * count, "pooling": pooling})

    under_chars = prices.largest(embed(32), lambda cost: cost.memory <= budget, 8 * context)
    under = embed(32)(under_chars)[1]
    over_chars = prices.largest(embed(16), lambda cost: True, 8 * context)  # as long as the context allows
    over = embed(16)(over_chars)[1]
    cancel_chars = prices.largest(embed(128), lambda cost: cost.memory <= budget, 8 * context)
    cancelled = embed(128)(cancel_chars)[1]
    per_token = prices.largest(embed(4, "per_token"), lambda cost: cost.result <= RESULT_MB * MIB and cost.memory <= budget,
                               8 * context)
    followed = embed(4, "per_token")(per_token)[1]
    lens = {"prompt": "The capital of France is", "layers": [0] * 400, "positions": [0] * 400, "top_k": 100}

    pid, port = gateway.proc.pid, common.port_of(gateway)
    for _ in range(2):  # warm-up: each kind of job, twice
        await common.run_job(port, "/predict/run", PREDICT)
        await common.run_job(port, "/generate/run", {"prompts": ["Hello"], "max_tokens": 4})
        await common.run_job(port, "/embed/run", {"texts": ["Hello"]})
    idle_runs = [await common.run_job(port, "/predict/run", PREDICT, source=BYSTANDER) for _ in range(IDLE_RUNS)]
    idle_ms = common.percentile([r.latency * 1000 for r in idle_runs], 50)
    idle_kb = common.rss_kb(pid)

    safety = Safety(gateway, idle_kb, idle_ms)
    safety.probe.start()
    await asyncio.sleep(0.3)
    idle_healthz = safety.probe.between(0, time.time())
    body = b'"\\' * (MIB // 2)
    await safety.attack("body: 1 MiB of \"\\", lambda u: safety.refused(u, tries, lambda: safety.post("/predict/run", body)))
    await safety.attack("header: 4 MiB", lambda u: safety.refused(u, tries, lambda: safety.header(4 * MIB)))
    await safety.attack("lens: 400x400, top_k 100", lambda u: safety.refused(
        u, tries, lambda: safety.post("/logit_lens/run", msgspec.json.encode(lens))))
    await safety.attack("embed over the budget", lambda u: safety.refused(
        u, tries, lambda: safety.post("/embed/run", msgspec.json.encode(over))))
    await safety.attack("embed under the budget", lambda u: safety.runs("embed", under, u))
    await safety.attack(f"flood: {FLOOD} streams", safety.flood)
    await safety.attack("cancel a long embed", lambda u: safety.cancel(cancelled, 0.3))
    await safety.attack(f"{FOLLOWERS} never-reading followers", lambda u: safety.followers(u, followed))
    await safety.probe.stop()

    report.fact("machine", common.machine(f"{info['device']} ({info['dtype']}), model {info['model']}"))
    report.fact("caps", f"--max-job-memory {budget // MIB} MiB, {' '.join(CAPS)}; defaults otherwise "
                "(--max-result-bytes 64 MiB, --max-body-bytes 1 MiB, --max-header-bytes 64 KiB)")
    report.fact("idle", f"RSS {idle_kb / 1024:.0f} MB; the bystander's predict p50 {idle_ms:.1f} ms (of {IDLE_RUNS}); "
                f"/healthz p50 {common.fmt(common.percentile(idle_healthz, 50), 2)} ms")
    report.fact("jobs", f"embed under: 32 texts of {under_chars} characters, priced "
                f"{prices.cost(*embed(32)(under_chars)).memory / MIB:.0f} MiB; embed over: 16 of {over_chars}, priced "
                f"{prices.cost(*embed(16)(over_chars)).memory / MIB:.0f} MiB; cancel: 128 of {cancel_chars}; "
                f"followers: 4 of {per_token}, per token")
    report.fact("tries", f"each refusal sent {tries} times; its answer time is the slowest")
    columns = ["attack", "answer", "answer ms", "jobs made", "peak RSS over idle MB", "healthz p50 ms", "healthz p99 ms",
               "bystander max ms", "allowed ms"]
    report.table(columns, [
        [r.attack, r.outcome.answer, r.outcome.seconds * 1000, r.jobs, r.peak_mb, common.percentile(r.healthz, 50),
         common.percentile(r.healthz, 99), max(r.bystander, default=None), r.allowed]
        for r in safety.rows
    ])
    for row in safety.rows:
        for note in row.outcome.notes:
            report.note(note)
    if safety.probe.failures:
        report.note(f"/healthz: {safety.probe.failures} probes failed")

    worst = max(safety.rows, key=lambda r: common.percentile(r.healthz, 99))
    report.target(f"/healthz p99 < {HEALTHZ_MS} ms under every attack",
                  f"worst {common.fmt(common.percentile(worst.healthz, 99))} ms ({worst.attack})",
                  common.percentile(worst.healthz, 99) < HEALTHZ_MS and not safety.probe.failures)
    late = [f"{r.attack} ({max(r.bystander) / r.allowed:.2f}x)" if r.bystander else f"{r.attack} (none measured)"
            for r in safety.rows if not r.bystander or max(r.bystander) > r.allowed]
    report.target("every bystander within 2x its idle p50 plus one step",
                  f"over it: {', '.join(late)}" if late else f"all {len(safety.rows)}", not late)
    refusals = [r for r in safety.rows if r.outcome.refusal]
    wrong = [r for r in refusals if r.jobs or not all(a.startswith("4") for a in r.outcome.answer.split(" / "))]
    report.target("every refusal a 4xx before queueing (no job in GET /jobs)",
                  f"{len(refusals) - len(wrong)} of {len(refusals)}" + (f"; not: {', '.join(r.attack for r in wrong)}" if wrong else ""),
                  not wrong)
    margin = budget / 3
    highest = max(safety.rows, key=lambda r: r.peak_mb)
    report.target(f"peak RSS <= idle + --max-job-memory + {margin / MIB:.0f} MiB margin",
                  f"highest {highest.peak_mb:.0f} MB over idle ({highest.attack}), limit {(budget + margin) / MIB:.0f} MB",
                  highest.peak_mb * MIB <= budget + margin)
    cancel = next(r for r in safety.rows if r.attack.startswith("cancel"))
    report.target(f"DELETE to the cancelled event <= {CANCEL_S:g} s", f"{cancel.outcome.seconds * 1000:.0f} ms, {cancel.outcome.answer}",
                  cancel.outcome.seconds <= CANCEL_S and "cancelled" in cancel.outcome.answer)
    held = safety.rows[-1].outcome.held
    report.target("never-reading followers let go by --write-timeout: RSS held after it <= one result",
                  "n/a" if held is None else f"{held[0]:.0f} MB held, the result {held[1]:.1f} MB",
                  None if held is None else held[0] <= held[1])


if __name__ == "__main__":
    common.main(run, TITLE, __doc__, options)
