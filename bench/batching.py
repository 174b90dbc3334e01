"""Dynamic batching: jobs/s and latency of `predict`, `loglikelihood` and `generate`, batched vs one job at a time.

Two gateways on the same model, started together and measured in turn, tool
by tool and level by level: one with the default batching (`--max-batch-size`
32, `--batch-wait-ms` 5) and one with `--max-batch-size 1`. At each level, 1,
4, 16 and 64 clients (--quick: 1 and 16) run jobs in a closed loop (each sends
its next job when its last one ends) over raw asyncio connections, following
each job's stream to its `data` event. Latency is from sending the request to
the `data` event; a lone job is the one-client level of the batched gateway.

The model is the default one (SmolLM2-135M-Instruct, what `streamgate serve`
loads with no `--model`; converted once and cached), or `--model PATH`;
--quick uses a tiny random model built for the run. If this `streamgate` has
no `--max-batch-size` flag, only the gateway as it is runs, and the batched
side is reported as unavailable.

Targets, at 16 concurrent clients on CPU: batched jobs/s >= 3x batch size 1,
with a batched p50 latency no worse than 1.5x a lone job's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

TITLE = "batching: jobs/s and latency, batched (defaults) vs --max-batch-size 1"
TARGET_CLIENTS = 16
TARGET_SPEEDUP = 3.0
TARGET_LATENCY = 1.5
# No job starts after this many seconds of one level on one gateway: a busy machine cannot stretch a run unbounded.
DEADLINE_S, DEADLINE_QUICK_S = 40.0, 15.0

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "A group of crows is called a",
    "The first person to walk on the moon was",
    "The chemical symbol for gold is",
    "The tallest mountain on Earth is",
    "Photosynthesis turns sunlight into",
]
CONTINUATIONS = [" Paris", " 100 degrees", " Jupiter", " murder", " Neil Armstrong", " Au", " Everest", " energy"]


def params(tool: str, index: int, max_tokens: int) -> dict:
    i = index % len(PROMPTS)
    if tool == "predict":
        return {"prompt": PROMPTS[i], "top_k": 5}
    if tool == "loglikelihood":
        return {"prompts": [PROMPTS[i]], "continuations": [CONTINUATIONS[i]]}
    return {"prompts": [PROMPTS[i]], "max_tokens": max_tokens}


def options(parser) -> None:
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="OMP_NUM_THREADS for both gateways (default: unset, torch's own choice: one per core).")


def has_batching_flags() -> bool:
    shown = subprocess.run([str(common.STREAMGATE), "serve", "--help"], capture_output=True, text=True, timeout=60)
    return "--max-batch-size" in shown.stdout


async def run(bench: common.Bench, report: common.Report) -> None:
    quick = bench.quick
    levels = [1, TARGET_CLIENTS] if quick else [1, 4, TARGET_CLIENTS, 64]
    max_tokens = 4 if quick else 8
    model = bench.model(default_tiny=False)
    batching = has_batching_flags()
    flags = ["--queue-size", "256", "--max-prompts", "8"]
    threads = bench.args.torch_threads
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    gateways = {"batch 1": bench.streamgate("serve", *flags, *(["--max-batch-size", "1"] if batching else []),
                                            model=model, name="batch-1", env=env)}
    if batching:
        gateways["batched"] = bench.streamgate("serve", *flags, model=model, name="batched", env=env)
    bench.ready(*gateways.values())
    ready = common.readyz(gateways["batch 1"])
    report.fact("machine", common.machine(ready.get("device", "?")))
    report.fact("model", f"{ready.get('model', '?')} ({ready.get('dtype', '?')}); torch threads: "
                + (f"{threads} (OMP_NUM_THREADS)" if threads else "torch's default"))
    report.fact("jobs", f"predict top_k 5; loglikelihood of one continuation; generate {max_tokens} tokens, greedy; "
                f"short prompts ({len(PROMPTS)} in turn)")
    if not batching:
        report.note("this streamgate has no --max-batch-size flag: only the gateway as it is was measured ('batch 1')")
    ports = {name: common.port_of(process) for name, process in gateways.items()}

    async def load(name: str, tool: str, clients: int, jobs: int) -> common.Load:
        return await common.closed_loop(
            clients, jobs, lambda i: common.run_job(ports[name], f"/{tool}/run", params(tool, i, max_tokens)),
            deadline=DEADLINE_QUICK_S if quick else DEADLINE_S,
        )

    rows, verdicts = [], []
    for tool in ("predict", "loglikelihood", "generate"):
        for name in ports:  # warm-up: the first calls of each tool, and a first batch
            await load(name, tool, 1, 3)
            await load(name, tool, 8, 8)
        lone: float | None = None
        for clients in levels:
            jobs = max(12 if quick else 16, 2 * clients)
            common.step(f"{tool}: {clients} clients, {jobs} jobs on each gateway")
            measured = {name: await load(name, tool, clients, jobs) for name in ("batched", "batch 1") if name in ports}
            figures = {}
            for name in ("batched", "batch 1"):
                got = measured.get(name)
                latencies = got.latencies_ms() if got else []
                figures[name] = (got.jobs_per_s if got else None, common.percentile(latencies, 50) if got else None,
                                 common.percentile(latencies, 99) if got else None)
            (b_rate, b_p50, b_p99), (one_rate, one_p50, one_p99) = figures["batched"], figures["batch 1"]
            if clients == 1:
                lone = b_p50
            speedup, slowdown = common.ratio(b_rate, one_rate), common.ratio(b_p50, lone)
            failed = sum(load.failed for load in measured.values())
            done = "/".join(str(len(measured[name].runs)) if name in measured else "-" for name in ("batched", "batch 1"))
            rows.append([tool, clients, done, b_rate, one_rate, _x(speedup), b_p50, b_p99, one_p50, one_p99,
                         _x(slowdown), failed])
            if clients == TARGET_CLIENTS:
                verdicts.append((tool, speedup, slowdown, b_rate, lone))
    report.table(["tool", "clients", "jobs", "batched jobs/s", "batch-1 jobs/s", "speed-up", "batched p50 ms",
                  "batched p99 ms", "batch-1 p50 ms", "batch-1 p99 ms", "p50 / lone", "failed"], rows)
    report.note("jobs: those run on the batched / batch-1 gateway (fewer than planned when a level hit its "
                f"{DEADLINE_QUICK_S if quick else DEADLINE_S:g} s deadline); speed-up: batched jobs/s over batch-1 "
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


def _x(value: float | None) -> str:
    return common.fmt(value, 2) + ("x" if value is not None else "")


if __name__ == "__main__":
    common.main(run, TITLE, __doc__, options)
