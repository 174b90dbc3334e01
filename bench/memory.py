"""Memory over sequences of requests, turns in time, and an engine no request can crash.

bench/safety.py tries one hostile request at a time; this one tries what ordinary and busy use
does over many. One `streamgate serve` on the default model (SmolLM2-135M-Instruct; `--model
PATH` for another; in --quick the tests' wide tiny Llama, hidden 256 and an 8k context) with its
defaults, and its engine process; memory is the resident memory of the gateway and its engines
together, read from /proc. The cases, one after the other:

1. sequential: `logit_lens` results of about 35 MB (90 layers and 90 positions, `top_k` 100;
   --quick: a few MB), one after the other, each read to its end by its client: the memory
   after every 10th, against the idle memory (after three warm-up results).
2. followers: one such result followed by 200 clients (--quick 50) that never read (a 4 KiB
   receive buffer): the memory while they hold their streams, over what it was before.
3. MCP, never read: 40 `tools/call` (--quick 10) of a lens result of about 7.6 MB (under the
   8 MiB an MCP answer inlines) by clients that send the call and never read the answer: the
   memory once every job ended, over before.
4. MCP against /run: the same 24 calls (--quick 6) at once through `/mcp` and through
   `/logit_lens/run`, each read to its end: wall time and the peak memory over idle, each way.
5. turns: the largest job of each tool that one text at the model's context makes (embed,
   logprobs, the lens at its last position, generate's prefill with one token, predict), started
   by one tenant; meanwhile another tenant's `predict`s, one after another: their slowest.
6. hostile: a second gateway with `--engine-memory-limit 3GiB` and `--max-body-bytes 64 MiB`,
   sent a 20 MB text to each tool that tokenizes, three times each: the answers, and the
   engine's restarts (from `/readyz`).
7. another replica: two gateways sharing a redis-server (`--store`); the big result of case 1 run
   on the first, then followed on the second by 200 clients (--quick 50) that never read: the
   second's memory while they hold their streams, over before (it reads Redis's one copy of the
   result a piece at a time, gateway/server/redis_store/).

8. windowed jobs: jobs over a text several windows long (window 512, overlap 128), one after
   another and each read to its end, in turn `logprobs` with `partials` (an event a window),
   `loglikelihood` and `embed` per token (each keeping a checkpoint in its engine): the memory
   after every 10th, against the idle memory; then one such `logprobs` job followed by 100 clients
   (--quick 30) that never read its partial events: the memory while they hold their streams.

Targets (the issue's): after the sequential results, memory <= idle + the in-memory budget
(`--result-memory-bytes`, 64 MiB); followers (on either replica) and never-reading MCP clients < +300 MB; MCP within
1.2x /run's time and memory; another tenant's predict behind any one job <= 1 s plus its own time
alone; 0 engine restarts and every hostile text a 413; after the windowed jobs, memory <= idle + the
in-memory budget, and their never-reading followers < +300 MB.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

TITLE = "memory: many results, idle readers, MCP, turns in time, and an engine under hostile texts"
MIB = 1 << 20
BUDGET_MIB = 64  # --result-memory-bytes' default
ATTACKER, BYSTANDER = "127.0.0.1", "127.0.0.2"
PREDICT = {"prompt": "The capital of France is", "top_k": 5}
FILLER = "The quick brown fox jumps over the lazy dog. "
EVENT = re.compile(rb"(?:^|\n)event: (\w+)\n")
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-11-25"}


def options(parser: Any) -> None:
    parser.add_argument("--results", type=int, default=None, help="Sequential results (default 500; --quick 30).")
    parser.add_argument("--cases", default="1,2,4,5,6,7,8", help="Which cases to run, by number (2 runs 2 and 3; default all).")
    parser.add_argument("--windowed", type=int, default=None, help="Windowed jobs of case 8 (default 300; --quick 30).")


def text(chars: int) -> str:
    return (FILLER * (chars // len(FILLER) + 1))[:chars]


def resident_mb(pids: list[int], field: str = "VmRSS") -> float:
    return sum(common.rss_kb(pid, field) for pid in pids) / 1024


def processes(gateway: common.ServeProcess) -> list[int]:
    """The gateway's pid and its engines'."""
    engines = common.readyz(gateway).get("engines", [])
    return [gateway.proc.pid, *(e["pid"] for e in engines if e.get("pid"))]


async def read_to_end(port: int, path: str, body: bytes, headers: dict[str, str] | None = None,
                      source: str | None = None) -> tuple[int, int, str, float]:
    """Send the request and read its answer to the end, keeping none of it: its status, bytes, the
    last event's name (or the answer's first bytes) and its seconds."""
    started = time.time()
    response = await common.Response.open(port, "POST", path, body, headers=headers, source=source)
    total, carry, first, last = 0, b"", b"", ""
    try:
        async for chunk in response.chunks():
            total += len(chunk)
            first = first or chunk[:4096]  # an error's JSON, whole
            seen = EVENT.findall(carry + chunk)  # an `event:` line cut between two chunks is found whole
            if seen:
                last = seen[-1].decode()
            carry = chunk[-32:]
    finally:
        response.close()
    return response.status, total, last or first.decode(errors="replace"), time.time() - started


def never_reading(port: int, request: bytes, source: str | None = None) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    if source is not None:  # another tenant: one owner may have only so many jobs waiting
        sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    sock.sendall(request)
    return sock


def mcp_call(tool: str, arguments: dict[str, Any], call_id: int) -> bytes:
    return msgspec.json.encode({"jsonrpc": "2.0", "id": call_id, "method": "tools/call",
                                "params": {"name": tool, "arguments": arguments}})


class Lens:
    """Lens params whose result is about `mb` MB on this model: sized by one run, then scaled."""

    def __init__(self, layers: int, prompt_tokens: int) -> None:
        self.layers, self.prompt_tokens = layers, prompt_tokens

    def params(self, rows: int, top_k: int = 100) -> dict[str, Any]:
        return {"prompt": text(self.prompt_tokens * 6), "top_k": top_k,
                "layers": [i % self.layers for i in range(rows)], "positions": [i % self.prompt_tokens for i in range(rows)]}

    async def sized(self, port: int, mb: float, inline: bool = False) -> tuple[dict[str, Any], float]:
        """Params of a result near `mb` MB, and its size; `inline`: one whose price an MCP call takes
        (the price is an upper bound: the result itself is smaller)."""
        probe = 20
        _, total, _, _ = await read_to_end(port, "/logit_lens/run", msgspec.json.encode(self.params(probe)))
        per_cell = total / (probe * probe)
        rows = max(2, int((mb * MIB / per_cell) ** 0.5))
        while inline and rows > 2:
            response = await common.Response.open(port, "POST", "/mcp", mcp_call("logit_lens", self.params(rows), 1), MCP_HEADERS)
            answer = await response.body()
            response.close()
            if b'"code":"too_large"' not in answer[:4096]:
                break
            rows = int(rows * 0.95)
        params = self.params(rows)
        _, total, last, _ = await read_to_end(port, "/logit_lens/run", msgspec.json.encode(params))
        assert last == "data", last
        return params, total / MIB


async def sequential(port: int, pids: list[int], lens: dict[str, Any], count: int) -> tuple[float, list[tuple[int, float]]]:
    body = msgspec.json.encode(lens)
    for _ in range(3):
        await read_to_end(port, "/logit_lens/run", body)
    await asyncio.sleep(1)
    idle = resident_mb(pids)
    samples = []
    for n in range(1, count + 1):
        status, _, last, _ = await read_to_end(port, "/logit_lens/run", body)
        assert status == 200 and last == "data", (status, last)
        if n % 10 == 0 or n == count:
            samples.append((n, resident_mb(pids)))
    return idle, samples


async def followers(port: int, pids: list[int], lens: dict[str, Any], count: int,
                    on: tuple[int, list[int]] | None = None, tool: str = "logit_lens") -> tuple[float, float, int]:
    """`count` never-reading followers of one big result (of `tool`, with `lens` its params); `on`: the
    port and processes of another replica that follows it (the memory and /healthz measured are theirs)."""
    response = await common.Response.open(port, "POST", f"/{tool}/run", msgspec.json.encode(lens))
    job_id = response.headers["x-job-id"]
    await response.body()
    response.close()
    port, pids = on or (port, pids)
    await asyncio.sleep(1)
    before = resident_mb(pids)
    request = f"GET /jobs/{job_id}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    socks = [await asyncio.to_thread(never_reading, port, request) for _ in range(count)]
    try:
        await asyncio.sleep(2)
        held = resident_mb(pids)
        healthz = time.time()
        await asyncio.to_thread(httpx.get, f"http://127.0.0.1:{port}/healthz", timeout=30)
        return before, held, round((time.time() - healthz) * 1000)
    finally:
        for sock in socks:
            sock.close()


WINDOW = {"window": 512, "overlap": 128}


def windowed_jobs(chars: int) -> list[tuple[str, dict[str, Any]]]:
    """Case 8's jobs, in turn: each tool's over a text of `chars` characters, in windows."""
    long = text(chars)
    return [
        ("logprobs", {"prompts": [long], "partials": True, **WINDOW}),
        ("loglikelihood", {"prompts": [long], "continuations": [" and the cat sat on the mat"], **WINDOW}),
        ("embed", {"texts": [long], "pooling": "per_token", **WINDOW}),
    ]


async def windowed(port: int, pids: list[int], chars: int, count: int) -> tuple[float, list[tuple[int, float]]]:
    """Case 8's sequence: `count` windowed jobs one after another, each read to its end."""
    jobs = [(f"/{tool}/run", msgspec.json.encode(params)) for tool, params in windowed_jobs(chars)]
    for path, body in jobs:
        await read_to_end(port, path, body)
    await asyncio.sleep(1)
    idle = resident_mb(pids)
    samples = []
    for n in range(1, count + 1):
        path, body = jobs[n % len(jobs)]
        status, _, last, _ = await read_to_end(port, path, body)
        assert status == 200 and last == "data", (path, status, last)
        if n % 10 == 0 or n == count:
            samples.append((n, resident_mb(pids)))
    return idle, samples


async def active_jobs(port: int) -> int:
    response = await common.Response.open(port, "GET", "/jobs?state=active")
    return len(json.loads(await response.body())["jobs"])


async def newest_jobs(port: int) -> dict[str, str]:
    """The newest 100 jobs' statuses, by id."""
    response = await common.Response.open(port, "GET", "/jobs?limit=100")
    return {job["job_id"]: job["status"] for job in json.loads(await response.body())["jobs"]}


async def mcp_never_read(port: int, pids: list[int], lens: dict[str, Any], count: int) -> tuple[float, float]:
    await asyncio.sleep(1)
    before = resident_mb(pids)
    earlier = set(await newest_jobs(port))
    # The SDK checks the Host header (DNS rebinding): the gateway's own address.
    head = "".join(f"{k}: {v}\r\n" for k, v in {**MCP_HEADERS, "Content-Type": "application/json", "Host": f"127.0.0.1:{port}"}.items())
    socks = []
    for i in range(count):
        body = mcp_call("logit_lens", lens, i + 1)
        request = f"POST /mcp HTTP/1.1\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
        socks.append(await asyncio.to_thread(never_reading, port, request, f"127.0.0.{3 + i % 8}"))
    try:
        deadline = time.time() + 600
        # Every call's job made and ended (listed as finished): the answers are then all the gateway's to hold.
        while time.time() < deadline:
            calls = {i: status for i, status in (await newest_jobs(port)).items() if i not in earlier}
            if len(calls) >= count and all(status in ("SUCCEEDED", "FAILED") for status in calls.values()):
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(1)
        return before, resident_mb(pids)
    finally:
        for sock in socks:
            sock.close()


async def concurrently(port: int, pids: list[int], way: str, lens: dict[str, Any], count: int) -> tuple[float, float, int]:
    """`count` lens calls at once, `way` /mcp or /run, each read to its end: seconds, peak MB over before, answers ok."""
    await asyncio.sleep(1)
    before = resident_mb(pids)
    for pid in pids:
        common.reset_peak_rss(pid)
    started = time.time()
    if way == "mcp":
        calls = [read_to_end(port, "/mcp", mcp_call("logit_lens", lens, i + 1), MCP_HEADERS) for i in range(count)]
    else:
        calls = [read_to_end(port, "/logit_lens/run", msgspec.json.encode(lens)) for _ in range(count)]
    answers = await asyncio.gather(*calls)
    seconds = time.time() - started
    peak = resident_mb(pids, "VmHWM")
    ok = sum(1 for status, total, _, _ in answers if status == 200 and total > 1000)
    return seconds, peak - before, ok


async def turns(port: int, tool: str, params: dict[str, Any]) -> tuple[str, float, float, int]:
    """The tool's big job from one tenant; another's predicts meanwhile: the big job's seconds, the
    predicts' p99 and max ms, and how many ran."""
    big = await common.Response.open(port, "POST", f"/{tool}/run", msgspec.json.encode(params), source=ATTACKER)
    if big.status != 200:
        answer = (await big.body())[:120].decode(errors="replace")
        big.close()
        return f"{big.status} {answer}", 0.0, 0.0, 0
    events = big.events()
    last = "none"
    async for event in events:
        last = event.event
        if last == "error":
            error = msgspec.json.decode(event.data).get("error", {})
            last = f"error {error.get('code')}: {str(error.get('message'))[:80]}"
        if event.event in ("data", "error"):  # a short job can end before the reader sees it running
            big.close()
            return last, 0.0, 0.0, 0
        if b'"RUNNING"' in event.data:
            break
    waits: list[float] = []
    done = asyncio.Event()

    async def bystander() -> None:
        while not done.is_set():
            run = await common.run_job(port, "/predict/run", PREDICT, source=BYSTANDER)
            if run.ok:
                waits.append(run.latency * 1000)

    side = asyncio.create_task(bystander())
    async for event in events:
        last = event.event
        if event.event == "error":  # its code and message say why
            error = msgspec.json.decode(event.data).get("error", {})
            last = f"error {error.get('code')}: {str(error.get('message'))[:80]}"
        if event.event in ("data", "error"):
            break
    done.set()
    await side
    big.close()
    return last, common.percentile(waits, 99) if waits else 0.0, max(waits, default=0.0), len(waits)


async def longest(port: int, tool: str, make: Any, most: int) -> int:
    """The most characters of the filler text `tool` takes (a 413 too_long past the context), within 10%:
    each try that is taken is cancelled at once."""
    low, high = 1, most
    while high > low * 1.1:
        chars = (low + high) // 2
        probe = await common.Response.open(port, "POST", f"/{tool}/run", msgspec.json.encode(make(chars)))
        job_id = probe.headers.get("x-job-id")
        probe.close()
        if probe.status == 200 and job_id:
            await asyncio.to_thread(httpx.delete, f"http://127.0.0.1:{port}/jobs/{job_id}", timeout=30)
            low = chars
        else:
            high = chars
    while await active_jobs(port):
        await asyncio.sleep(0.2)
    return low


TRIES = 3  # each hostile text sent this many times (--quick: once)


async def hostile(bench: common.Bench, model: str | None) -> tuple[list[tuple[str, str]], int]:
    gateway = bench.streamgate("serve", "--engine-memory-limit", "3GiB", "--max-body-bytes", str(64 * MIB), model=model, name="hostile")
    bench.ready(gateway)
    port = common.port_of(gateway)
    hostile_text = text(20 * MIB)
    cases = {
        "embed": {"texts": [hostile_text]},
        "predict": {"prompt": hostile_text},
        "generate": {"prompts": [hostile_text], "max_tokens": 1},
        "generate (messages)": {"messages": [{"role": "user", "content": hostile_text}], "max_tokens": 1},
        "logprobs": {"prompts": [hostile_text]},
        "loglikelihood": {"prompts": ["a"], "continuations": [hostile_text]},
        "logit_lens": {"prompt": hostile_text},
    }
    answers = []
    for name, params in cases.items():
        tool = name.split()[0]
        seen = set()
        for _ in range(1 if bench.quick else TRIES):
            status, _, last, seconds = await read_to_end(port, f"/{tool}/run", msgspec.json.encode(params))
            try:
                code = json.loads(last)["error"]["code"] if status != 200 else last
            except (ValueError, KeyError, TypeError):
                code = last
            seen.add(f"{status} {code} in {seconds * 1000:.0f} ms" if status != 200 else f"{status} {code}")
        answers.append((name, " / ".join(sorted(seen))))
    restarts = sum(e.get("restarts", 0) for e in common.readyz(gateway).get("engines", []))
    common.stop(gateway)
    return answers, restarts


async def replicas(bench: common.Bench, model: str | None, lens: dict[str, Any], readers: int) -> tuple[float, float, int]:
    """Case 7: `followers` of a result run on one replica, on the other."""
    from tests.support.redis_server import RedisServer

    folder = bench.dir / "redis"
    folder.mkdir()
    store = RedisServer(folder, common.free_port()).start()
    try:
        first, second = (bench.streamgate("serve", "--store", store.url, model=model, name=f"replica {n}") for n in (1, 2))
        bench.ready(first, second)
        try:
            return await followers(common.port_of(first), [], lens, readers,
                                   on=(common.port_of(second), processes(second)))
        finally:
            common.stop(first)
            common.stop(second)
    finally:
        store.stop()


async def run(bench: common.Bench, report: common.Report) -> None:
    quick = bench.quick
    model = bench.model(default_tiny=False, wide=True)
    gateway = bench.streamgate("serve", model=model)
    bench.ready(gateway)
    info = common.readyz(gateway)
    port, pids = common.port_of(gateway), processes(gateway)
    context = info["context_length"]
    layers = httpx.get(f"{gateway.url}/models", timeout=10).json()["models"][0].get("layers") or 2
    lens = Lens(layers, 100)

    common.step("sizing the lens results")
    big, big_mb = await lens.sized(port, 4 if quick else 35)
    inline, inline_mb = await lens.sized(port, 2 if quick else 7.6, inline=True)

    cases = {case.strip() for case in bench.args.cases.split(",")}
    if "1" in cases:
        count = bench.args.results or (30 if quick else 500)
        common.step(f"sequential: {count} results of {big_mb:.1f} MB")
        idle, samples = await sequential(port, pids, big, count)
        report.table(["results read", "RSS MB", "over idle MB"], [[n, mb, mb - idle] for n, mb in samples],
                     title=f"1. sequential lens results of {big_mb:.1f} MB, each read to its end (idle {idle:.0f} MB)")
        last = samples[-1][1] - idle
        report.target(f"after {count} results, gateway + engines <= idle + {BUDGET_MIB} MiB (--result-memory-bytes)",
                      f"+{last:.0f} MB (most +{max(mb for _, mb in samples) - idle:.0f} MB)", last <= BUDGET_MIB)

    if "2" in cases:
        readers = 50 if quick else 200
        common.step(f"followers: {readers} that never read")
        before, held, healthz_ms = await followers(port, pids, big, readers)
        mcp_clients = 10 if quick else 40
        common.step(f"MCP: {mcp_clients} calls never read")
        mcp_before, mcp_after = await mcp_never_read(port, pids, inline, mcp_clients)
        report.table(["readers", "of a result MB", "before MB", "while held MB", "over before MB"], [
            [f"{readers} followers, never reading", big_mb, before, held, held - before],
            [f"{mcp_clients} MCP calls, never read", inline_mb, mcp_before, mcp_after, mcp_after - mcp_before],
        ], title=f"2-3. idle readers (/healthz answered in {healthz_ms} ms while the followers were held)")
        report.target(f"{readers} never-reading followers of one result < +300 MB", f"+{held - before:.0f} MB", held - before < 300)
        report.target(f"{mcp_clients} never-reading MCP clients of one result < +300 MB", f"+{mcp_after - mcp_before:.0f} MB",
                      mcp_after - mcp_before < 300)

    if "4" in cases:
        calls = 6 if quick else 24
        common.step(f"MCP against /run: {calls} calls at once each way")
        rows = {}
        for way in ("run", "mcp"):
            rows[way] = await concurrently(port, pids, way, inline, calls)
        report.table(["way", "calls", "answered", "seconds", "peak over before MB"],
                     [[f"/{way}" if way == "mcp" else "/logit_lens/run", calls, rows[way][2], rows[way][0], rows[way][1]] for way in rows],
                     title=f"4. {calls} lens calls of {inline_mb:.1f} MB at once")
        time_ratio = rows["mcp"][0] / rows["run"][0]
        memory_ratio = rows["mcp"][1] / max(rows["run"][1], 1.0)
        report.target("MCP within 1.2x /run's time and peak memory for the same calls",
                      f"time {time_ratio:.2f}x, memory {memory_ratio:.2f}x", time_ratio <= 1.2 and memory_ratio <= 1.2)

    if "5" in cases:
        common.step("turns: another tenant's predicts behind one big job of each tool")
        alone = [(await common.run_job(port, "/predict/run", PREDICT, source=BYSTANDER)).latency * 1000 for _ in range(5)]
        alone_ms = common.percentile(alone, 50)
        jobs = {
            "embed": lambda chars: {"texts": [text(chars)]},
            "logprobs": lambda chars: {"prompts": [text(chars)]},
            "logit_lens": lambda chars: {"prompt": text(chars), "positions": [-1]},
            "generate": lambda chars: {"prompts": [text(chars)], "max_tokens": 1},
            "predict": lambda chars: {"prompt": text(chars)},
        }
        turn_rows = []
        worst = 0.0
        for tool, make in jobs.items():
            chars = await longest(port, tool, make, context * 8)
            answer, p99, most, n = await turns(port, tool, make(chars))
            worst = max(worst, most)
            turn_rows.append([tool, chars, answer, n, p99, most])
        report.table(["tool", "text chars", "its end", "predicts", "p99 ms", "max ms"], turn_rows,
                     title=f"5. another tenant's predicts behind one job of each tool (predict alone: p50 {alone_ms:.0f} ms)")
        report.target("another tenant's predict behind any one job <= 1 s plus its own time alone",
                      f"worst {worst:.0f} ms", worst <= 1000 + alone_ms)

    common.stop(gateway)
    if "6" in cases:
        common.step("hostile: 20 MB texts under --engine-memory-limit 3GiB")
        answers, restarts = await hostile(bench, model)
        tries = 1 if bench.quick else TRIES
        report.table(["tool", "answers"], [list(a) for a in answers],
                     title=f"6. a 20 MB text to each tool, {tries} {'try' if tries == 1 else 'tries'} each, --engine-memory-limit 3GiB")
        refused = all(answer.startswith("413 too_long") for _, answer in answers)
        report.target("0 engine restarts and every 20 MB text a 413 too_long", f"{restarts} restarts", restarts == 0 and refused)
    if "7" in cases:
        readers = 50 if quick else 200
        common.step(f"another replica: {readers} followers that never read, through Redis")
        before, held, healthz_ms = await replicas(bench, model, big, readers)
        report.table(["readers", "of a result MB", "before MB", "while held MB", "over before MB"],
                     [[f"{readers} followers on the other replica", big_mb, before, held, held - before]],
                     title=f"7. followers on another replica, through Redis (/healthz answered in {healthz_ms} ms meanwhile)")
        report.target(f"{readers} never-reading followers on another replica < +300 MB", f"+{held - before:.0f} MB",
                      held - before < 300)
    if "8" in cases:
        gateway = bench.streamgate("serve", model=model, name="windowed")
        bench.ready(gateway)
        port, pids = common.port_of(gateway), processes(gateway)
        chars = 8000 if quick else 6000  # SmolLM2: about 1,350 tokens, four windows
        count = bench.args.windowed or (30 if quick else 300)
        common.step(f"windowed: {count} jobs over {chars} characters in windows of 512")
        idle, samples = await windowed(port, pids, chars, count)
        readers = 30 if quick else 100
        common.step(f"windowed: {readers} followers of a logprobs job's partials that never read")
        before, held, healthz_ms = await followers(port, pids, windowed_jobs(chars)[0][1], readers, tool="logprobs")
        common.stop(gateway)
        report.table(["jobs read", "RSS MB", "over idle MB"], [[n, mb, mb - idle] for n, mb in samples],
                     title=f"8. windowed jobs over {chars} characters (logprobs with partials, loglikelihood, embed per token; "
                     f"window 512, overlap 128), each read to its end (idle {idle:.0f} MB)")
        report.table(["readers", "before MB", "while held MB", "over before MB"],
                     [[f"{readers} followers of a windowed logprobs job's partials, never reading", before, held, held - before]],
                     title=f"8. idle readers of partial events (/healthz answered in {healthz_ms} ms meanwhile)")
        last = samples[-1][1] - idle
        report.target(f"after {count} windowed jobs, gateway + engines <= idle + {BUDGET_MIB} MiB",
                      f"+{last:.0f} MB (most +{max(mb for _, mb in samples) - idle:.0f} MB)", last <= BUDGET_MIB)
        report.target(f"{readers} never-reading followers of a windowed job's partials < +300 MB", f"+{held - before:.0f} MB",
                      held - before < 300)
    report.fact("machine", common.machine(f"{info['device']} ({info['dtype']}), model {info['model']}"))
    report.fact("gateway", "defaults (--result-memory-bytes 64 MiB, --retention 600 s, the result spool in the system's "
                "temporary folder); memory: the gateway's and its engine's resident memory summed")


if __name__ == "__main__":
    common.main(run, TITLE, __doc__, options)
