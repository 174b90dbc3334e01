"""Dynamic batching: jobs/s and latency of `predict`, `loglikelihood` and `generate`, batched vs one job at a time, or vs LitServe.

Two servers on the same model, started together and measured in turn, tool
by tool and level by level (which goes first alternates). At each level, 1, 4, 16 and 64 clients (--quick:
1 and 16) run jobs in a closed loop (each sends its next job when its last one
ends) over raw asyncio connections, one request per job, reading the whole
answer: the job's stream to its `data` event from streamgate, the JSON body
from a peer. Latency is from sending the request to the end of the answer.

By default the two are streamgate gateways: one with the default batching
(`--max-batch-size` 32, `--batch-wait-ms` 5) and one with `--max-batch-size
1`; a lone job is the one-client level of the batched gateway. If this
`streamgate` has no `--max-batch-size` flag, only the gateway as it is runs,
and the batched side is reported as unavailable.

`--peer litserve` measures the batched gateway against a LitServe server of
the same jobs instead (bench/peers/litserve_server.py: LitServe's own dynamic
batching at the same batch size and wait, padded forward passes, greedy
decoding on a KV cache), run from an environment of its own that the first
such run makes (bench/peers/.venv, about 2.5 minutes, once). Both get the same
model folder, device, dtype and torch threads, and before any figure the
peer's answers are checked against streamgate's, prompt by prompt: the top
tokens, the log-likelihood (within 1e-4 in float32), the generated text. A
peer that answers otherwise fails the run (exit 1): its figures would not be
of the same work.

The model is the default one (SmolLM2-135M-Instruct, what `streamgate serve`
loads with no `--model`; converted once and cached, and that folder is what
the peer loads), or `--model PATH`; --quick uses a tiny random model built for
the run. `--device cuda` runs every server on the GPU in bfloat16 (`--dtype`
for another).

Targets, at 16 concurrent clients on CPU: batched jobs/s >= 3x batch size 1,
with a batched p50 latency no worse than 1.5x a lone job's. With a peer:
streamgate jobs/s >= 1.2x the peer's at every level, for each tool.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

TITLE = "batching: jobs/s and latency, batched (defaults) vs --max-batch-size 1"
PEER_TITLE = "batching: jobs/s and latency, streamgate (batched, defaults) vs {peer} on the same model and jobs"
TARGET_CLIENTS = 16
TARGET_SPEEDUP = 3.0
TARGET_LATENCY = 1.5
TARGET_OVER_PEER = 1.2
# No job starts after this many seconds of one level on one server: a busy machine cannot stretch a run unbounded.
DEADLINE_S, DEADLINE_QUICK_S = 40.0, 15.0
# How far the peer's numbers may be from streamgate's: float32 differs only by summation order; bfloat16 keeps
# about 3 significant digits, so another order of the same sums moves a log-likelihood by a few hundredths.
TOLERANCE = {"float32": 1e-4}
TOLERANCE_HALF = 5e-2
PEERS = {"litserve": "LitServe"}

PROMPTS = common.SHORT_PROMPTS
CONTINUATIONS = [" Paris", " 100 degrees", " Jupiter", " murder", " Neil Armstrong", " Au", " Everest", " energy"]
TOOLS = ("predict", "loglikelihood", "generate")


def params(tool: str, index: int, max_tokens: int) -> dict:
    i = index % len(PROMPTS)
    if tool == "predict":
        return {"prompt": PROMPTS[i], "top_k": 5}
    if tool == "loglikelihood":
        return {"prompts": [PROMPTS[i]], "continuations": [CONTINUATIONS[i]]}
    return {"prompts": [PROMPTS[i]], "max_tokens": max_tokens}


def options(parser) -> None:
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch threads of every server: --torch-threads N (where the gateway has the flag) and "
                             "OMP_NUM_THREADS. Default: each gateway's own choice; with --peer, the gateway's default "
                             "(cores - 1, at least 1) given to both.")
    parser.add_argument("--peer", choices=sorted(PEERS), default=None,
                        help="Measure the batched gateway against this server instead of a batch-1 gateway.")


@cache
def serve_help() -> str:
    return subprocess.run([str(common.STREAMGATE), "serve", "--help"], capture_output=True, text=True, timeout=60).stdout


def has_batching_flags() -> bool:
    return "--max-batch-size" in serve_help()


def default_threads() -> int:
    """The gateway's own default: one core left for the event loop, at least one thread."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def default_model_folder() -> str | None:
    """The converted default model a gateway loads with no --model, if it was converted already."""
    import platformdirs

    from backends.loading import cache_root, converted_path, resolve

    # The gateways run without STREAMGATE_* variables, so in the platform's cache folder.
    path = converted_path(resolve(None), cache_root(platformdirs.user_cache_dir("streamgate")))
    return str(path) if (path / "config.json").exists() else None


async def run(bench: common.Bench, report: common.Report) -> list[str]:
    """The benchmark; what disagreed between streamgate and the peer (empty: nothing, or no peer)."""
    args = bench.args
    quick = bench.quick
    levels = [1, TARGET_CLIENTS] if quick else [1, 4, TARGET_CLIENTS, 64]
    max_tokens = 4 if quick else 8
    model = bench.model(default_tiny=False)
    peer = args.peer
    threads = args.torch_threads or (default_threads() if peer else None)
    thread_flags = ["--torch-threads", str(threads)] if threads and "--torch-threads" in serve_help() else []
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    flags = ["--queue-size", "256", "--max-prompts", "8", *thread_flags]
    if peer:
        from bench import peers

        peer_python = peers.ensure_env(say=common.step)  # before anything starts: the first time takes minutes
        report.title = PEER_TITLE.format(peer=PEERS[peer])
        sides = ("streamgate", PEERS[peer])
        servers = {"streamgate": bench.streamgate("serve", *flags, model=model, name="streamgate", env=env)}
        folder = model or default_model_folder()
        if folder is None:  # the gateway converts the default model on its first start: the peer loads that
            bench.ready(servers["streamgate"])
            folder = default_model_folder()
        common.step(f"starting {sides[1]} on {folder} ({peer_python})")
        peer_argv = ["--model", str(folder), "--torch-threads", str(threads), *common.device_flags(args)]
        servers[sides[1]] = peers.start(bench, peer, peer_argv, common.free_port(), env=env)
    else:
        batching = has_batching_flags()
        sides = ("batched", "batch 1")
        servers = {"batch 1": bench.streamgate("serve", *flags, *(["--max-batch-size", "1"] if batching else []),
                                               model=model, name="batch-1", env=env)}
        if batching:
            servers["batched"] = bench.streamgate("serve", *flags, model=model, name="batched", env=env)
    bench.ready(*servers.values())
    ready = common.readyz(servers["streamgate" if peer else "batch 1"])
    report.fact("machine", common.machine(ready.get("device", "?")))
    report.fact("model", f"{ready.get('model', '?')} ({ready.get('dtype', '?')}); torch threads: "
                + (f"{threads} (" + ("--torch-threads and " if thread_flags else "") + "OMP_NUM_THREADS)"
                   if threads else "the gateway's default"))
    report.fact("jobs", f"predict top_k 5; loglikelihood of one continuation; generate {max_tokens} tokens, greedy; "
                f"short prompts ({len(PROMPTS)} in turn)")
    mismatch: list[str] = []
    if peer:
        about = peers.info(servers[sides[1]]).get("model") or {}
        report.fact("servers", f"streamgate serve (its default batching: max batch 32, batch wait 5 ms); "
                    f"{sides[1]} {about.get('litserve', '?')} (max_batch_size {about.get('max_batch_size', '?')}, "
                    f"batch_timeout {about.get('batch_timeout', '?')} s, fast_queue {_on(about.get('fast_queue'))}, "
                    f"1 worker, 1 API server; torch "
                    f"{about.get('torch', '?')}, device {about.get('device', '?')}, {about.get('dtype', '?')}, "
                    f"{about.get('torch_threads', '?')} torch threads), in its own environment")
        same_place = str(about.get("device", "")).split(":")[0] == str(ready.get("device", "")).split(":")[0]
        if not same_place or about.get("dtype") != ready.get("dtype"):
            raise SystemExit(f"error: streamgate runs on {ready.get('device')} ({ready.get('dtype')}) and "
                             f"{sides[1]} on {about.get('device')} ({about.get('dtype')}): not the same work")
    elif "batched" not in servers:
        report.note("this streamgate has no --max-batch-size flag: only the gateway as it is was measured ('batch 1')")
    ports = {name: common.port_of(process) for name, process in servers.items()}

    def job(name: str, tool: str, index: int, tokens: int = max_tokens):
        if peer and name != "streamgate":
            return peer_job(ports[name], tool, params(tool, index, tokens))
        return common.run_job(ports[name], f"/{tool}/run", params(tool, index, tokens))

    async def load(name: str, tool: str, clients: int, jobs: int) -> common.Load:
        return await common.closed_loop(clients, jobs, lambda i: job(name, tool, i),
                                        deadline=DEADLINE_QUICK_S if quick else DEADLINE_S)

    if peer:
        mismatch = await check_answers(report, sides, job, str(ready.get("dtype", "float32")))

    rows, verdicts = [], []
    for tool in TOOLS:
        for name in ports:  # warm-up: the first calls of each tool, and a first batch
            await load(name, tool, 1, 3)
            await load(name, tool, 8, 8)
        lone: float | None = None
        for clients in levels:
            jobs = max(12 if quick else 16, 2 * clients)
            common.step(f"{tool}: {clients} clients, {jobs} jobs on each server")
            # Who goes first alternates level by level: load that comes and goes on the machine favours neither.
            order = sides if len(rows) % 2 == 0 else sides[::-1]
            measured = {name: await load(name, tool, clients, jobs) for name in order if name in ports}
            figures = {}
            for name in sides:
                got = measured.get(name)
                latencies = got.latencies_ms() if got else []
                figures[name] = (got.jobs_per_s if got else None, common.percentile(latencies, 50) if got else None,
                                 common.percentile(latencies, 99) if got else None)
            (a_rate, a_p50, a_p99), (b_rate, b_p50, b_p99) = figures[sides[0]], figures[sides[1]]
            if clients == 1:
                lone = a_p50
            speedup, slowdown = common.ratio(a_rate, b_rate), common.ratio(a_p50, lone)
            failed = sum(load.failed for load in measured.values())
            done = "/".join(str(len(measured[name].runs)) if name in measured else "-" for name in sides)
            if peer:
                rows.append([tool, clients, done, a_rate, b_rate, _x(speedup), a_p50, a_p99, b_p50, b_p99, failed])
                verdicts.append((tool, clients, speedup))
            else:
                rows.append([tool, clients, done, a_rate, b_rate, _x(speedup), a_p50, a_p99, b_p50, b_p99,
                             _x(slowdown), failed])
                if clients == TARGET_CLIENTS:
                    verdicts.append((tool, speedup, slowdown, a_rate, lone))
    deadline = DEADLINE_QUICK_S if quick else DEADLINE_S
    if peer:
        _peer_report(report, sides, rows, verdicts, deadline, levels)
    else:
        _batching_report(report, rows, verdicts, deadline)
    return mismatch


def _batching_report(report: common.Report, rows: list, verdicts: list, deadline: float) -> None:
    report.table(["tool", "clients", "jobs", "batched jobs/s", "batch-1 jobs/s", "speed-up", "batched p50 ms",
                  "batched p99 ms", "batch-1 p50 ms", "batch-1 p99 ms", "p50 / lone", "failed"], rows)
    report.note("jobs: those run on the batched / batch-1 gateway (fewer than planned when a level hit its "
                f"{deadline:g} s deadline); speed-up: batched jobs/s over batch-1 "
                "jobs/s; p50 / lone: the batched p50 over the batched gateway's p50 with one client; "
                "n/a: not measured (no batching flags)")
    report.note(f"in a closed loop the mean latency is clients / jobs/s (Little's law): a p50 within "
                f"{TARGET_LATENCY:g}x a lone job at {TARGET_CLIENTS} clients needs about "
                f"{TARGET_CLIENTS / TARGET_LATENCY:.1f}x the jobs/s of one client running lone jobs back to back")
    for tool, speedup, slowdown, rate, lone in verdicts:
        report.target(f"{tool}: >= {TARGET_SPEEDUP:g}x batch-1 jobs/s at {TARGET_CLIENTS} clients", _x(speedup),
                      None if speedup is None else speedup >= TARGET_SPEEDUP)
        needed = None if lone is None else TARGET_CLIENTS / (TARGET_LATENCY * lone / 1000)
        report.target(f"{tool}: p50 <= {TARGET_LATENCY:g}x a lone job at {TARGET_CLIENTS} clients",
                      f"{_x(slowdown)} (that needs about {common.fmt(needed)} jobs/s; {common.fmt(rate)} measured)",
                      None if slowdown is None else slowdown <= TARGET_LATENCY)


def _peer_report(report: common.Report, sides: tuple[str, str], rows: list, verdicts: list, deadline: float,
                 levels: list[int]) -> None:
    ours, theirs = sides
    report.table(["tool", "clients", "jobs", f"{ours} jobs/s", f"{theirs} jobs/s", f"{ours}/{theirs}",
                  f"{ours} p50 ms", f"{ours} p99 ms", f"{theirs} p50 ms", f"{theirs} p99 ms", "failed"], rows)
    report.note(f"jobs: those run on {ours} / {theirs} (fewer than planned when a level hit its {deadline:g} s "
                f"deadline); {ours}/{theirs}: {ours} jobs/s over {theirs} jobs/s; one request per job on both, "
                f"the answer read whole: {ours}'s event stream to its data event, {theirs}'s JSON body")
    for tool in TOOLS:
        got = [(clients, ratio) for name, clients, ratio in verdicts if name == tool]
        measured = ", ".join(f"{clients}: {_x(ratio)}" for clients, ratio in got)
        known = [ratio for _, ratio in got if ratio is not None]
        met = None if len(known) < len(got) or not got else min(known) >= TARGET_OVER_PEER
        if known:
            low_clients, low = min(((c, r) for c, r in got if r is not None), key=lambda item: item[1])
            measured += f" (lowest {_x(low)} at {low_clients} clients)"
        report.target(f"{tool}: >= {TARGET_OVER_PEER:g}x {theirs} jobs/s at every level "
                      f"({', '.join(map(str, levels))} clients)", measured, met)


async def peer_job(port: int, tool: str, params: dict) -> common.JobRun:
    """One job on a peer: POST the tool's params (and its name) to /run, and read the JSON answer whole.

    The answer becomes the run's one `data` event, so that its latency is
    measured as a streamgate job's is: from sending to the end of the answer.
    """
    response = await common.Response.open(port, "POST", "/run", msgspec.json.encode({"tool": tool, **params}))
    run = common.JobRun(response.status, "", response.sent)
    try:
        body = await response.body()
    finally:
        response.close()
    if response.status == 200:
        run.events.append(common.SseEvent("data", "", body, time.time()))
    return run


async def check_answers(report: common.Report, sides: tuple[str, str], job, dtype: str) -> list[str]:
    """Each tool on each prompt, one job at a time on each side: the answers compared, in a table.

    Returns the tools whose answers differ. One at a time, both sides compute
    each answer unpadded, so that only the order of sums can differ.
    """
    tolerance = TOLERANCE.get(dtype, TOLERANCE_HALF)
    rows, mismatch = [], []
    for tool in TOOLS:
        same, worst, first_wrong = 0, 0.0, ""
        for index in range(len(PROMPTS)):
            answers = []
            for name in sides:
                got = await job(name, tool, index, 8)
                if not got.ok:
                    raise SystemExit(f"error: {name} did not answer {tool} {params(tool, index, 8)}: status "
                                     f"{got.status}, {got.events[-1].data[:500] if got.events else b''!r}")
                answers.append(json.loads(got.terminal.data))
            diff, problem = compare(tool, answers[0], answers[1], tolerance)
            worst = max(worst, diff)
            if problem is None:
                same += 1
            elif not first_wrong:
                first_wrong = f"{PROMPTS[index]!r}: {problem}"
        if same < len(PROMPTS):
            mismatch.append(tool)
        what = {"predict": "top 5 ids, probabilities", "loglikelihood": "log-likelihood, is_greedy",
                "generate": "8 tokens' text, finish reason"}[tool]
        rows.append([tool, len(PROMPTS), same, f"{worst:.1e}" if tool != "generate" else "-", what, first_wrong or "-"])
    report.table(["tool", "prompts", "same", "max abs diff", "compared", "first difference"], rows,
                 title=f"Checks: {sides[1]}'s answers against {sides[0]}'s, one job at a time "
                       f"(numbers within {tolerance:g} in {dtype})")
    report.target(f"{sides[1]} answers as {sides[0]} does (every prompt, every tool)",
                  "the same" if not mismatch else f"differs on {', '.join(mismatch)}", not mismatch)
    return mismatch


def compare(tool: str, ours: dict[str, Any], theirs: dict[str, Any], tolerance: float) -> tuple[float, str | None]:
    """(the largest difference in a number, what differs beyond the tolerance or None)."""
    if tool == "predict":
        mine = {p["id"]: p["prob"] for p in ours["predictions"]}
        other = {p["id"]: p["prob"] for p in theirs["predictions"]}
        diff = max((abs(mine[i] - other[i]) for i in mine.keys() & other.keys()), default=math.inf)
        # A token in one top 5 only is a difference unless it ties the other's fifth (a near tie at the edge).
        edge = min(other.values())
        outside = [i for i in mine.keys() - other.keys() if abs(mine[i] - edge) > tolerance]
        if outside or diff > tolerance:
            return diff, f"top tokens {list(mine)} vs {list(other)}"
        return diff, None
    if tool == "loglikelihood":
        diff = max(abs(a - b) for a, b in zip(ours["ll"], theirs["ll"], strict=True))
        if diff > tolerance or ours["is_greedy"] != theirs["is_greedy"]:
            return diff, f"ll {ours['ll']} vs {theirs['ll']}, is_greedy {ours['is_greedy']} vs {theirs['is_greedy']}"
        return diff, None
    if ours["completions"] != theirs["completions"] or ours["finish_reasons"] != theirs["finish_reasons"]:
        return 0.0, f"{ours['completions']} vs {theirs['completions']}"
    return 0.0, None


def _on(flag: Any) -> str:
    return "?" if flag is None else "on" if flag else "off"


def _x(value: float | None) -> str:
    return common.fmt(value, 2) + ("x" if value is not None else "")


if __name__ == "__main__":
    common.main(run, TITLE, __doc__, options, disagreed="the peer's answers differ from streamgate's on")
