"""Classes of users under load: a higher class's short job against a lower class keeping the engine
full, the lower class's minimum share, and what classes cost when nobody uses them.

One gateway (the default set-up: the model in an engine process) on a tiny random Llama, its
tokens file two classes: `lab` (priority 10) and `students` (the default), `--class-min-share 0.1`
and `--max-decoding-jobs` a quarter of the clients of one class (16 for 64: a batch that fills up,
and a queue in front of it). Three measures:

- Wait. `--clients` (default 64) students each run `generate` jobs back to back (`--tokens`
  each, default 64), keeping the batch full and the queue long; meanwhile the lab sends
  `predict` jobs one after another. Each predict's latency (request to `data`) is set against
  its latency on the idle gateway (the same job, sent alone: its own run time, with the HTTP
  round trip) and the students' decoding step (the median time between two of a job's
  `partial` events). Target: the predict's p99 under load <= one step + its idle median. The
  same is measured inside the gateway too (from its admission to its end, `created` and
  `finished` of `GET /jobs/{id}`): the clients share the 2 cores and one event loop with the
  64 flooding clients, whose token events delay the lab client's own reading.
- Share. The lab floods too (as many clients as the students): the students' share of the
  `generate` jobs that finished over the window. Target: >= the configured minimum share (0.1).
- Cost unused. Only students, on the gateway with classes and on one whose tokens file has the
  same tokens and no classes, round by round in turn: jobs/s. Target: with classes >= 0.95x
  without (the scheduler costs nothing unused; a faster side is the rounds' noise).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402

from bench import common  # noqa: E402

TITLE = "priority: a higher class's predict against a lower class's full engine"
LAB = "lab-token-0123456789abcdef00"
STUDENT = "student-token-0123456789abcd"
# The same two tokens, in two classes or in none.
CLASSED = (
    '[classes.lab]\npriority = 10\n[classes.students]\ndefault = true\n'
    f'[tokens.lab]\ntoken = "{LAB}"\nclass = "lab"\n[tokens.student]\ntoken = "{STUDENT}"\n'
)
PLAIN = f'[tokens.lab]\ntoken = "{LAB}"\n[tokens.student]\ntoken = "{STUDENT}"\n'
MIN_SHARE = 0.1
TARGET_COST = 0.05


def options(parser: Any) -> None:
    parser.add_argument("--clients", type=int, default=64, help="Clients of each class keeping the engine busy.")
    parser.add_argument("--tokens", type=int, default=64, help="Tokens each generate job asks for.")
    parser.add_argument("--seconds", type=float, default=10.0, help="How long each loaded window lasts.")


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def job(port: int, tool: str, params: Any, token: str) -> common.JobRun:
    return await common.run_job(port, f"/{tool}/run", params, headers=auth(token))


def step_gaps(runs: list[common.JobRun]) -> list[float]:
    """Seconds between two consecutive `partial` events of one job, over every job."""
    gaps: list[float] = []
    for run in runs:
        times = [event.at for event in run.events if event.event == "partial"]
        gaps += [b - a for a, b in zip(times, times[1:])]
    return gaps


class Flood:
    """Clients of one token running `generate` back to back until stopped; what finished."""

    def __init__(self, port: int, token: str, clients: int, tokens: int) -> None:
        self.port, self.token, self.tokens = port, token, tokens
        self.runs: list[common.JobRun] = []
        self.stopping = False
        self.tasks = [asyncio.create_task(self._client(i)) for i in range(clients)]

    async def _client(self, index: int) -> None:
        n = 0
        while not self.stopping:
            n += 1
            params = {"prompts": [f"client {index} job {n}: once upon a time"], "max_tokens": self.tokens}
            self.runs.append(await job(self.port, "generate", params, self.token))

    def finished_between(self, start: float, end: float) -> list[common.JobRun]:
        return [run for run in self.runs if run.ok and start <= run.terminal.at <= end]  # type: ignore[union-attr]

    async def stop(self) -> None:
        self.stopping = True
        await asyncio.gather(*self.tasks)


async def predicts(port: int, count: int, gap: float) -> tuple[list[float], list[float], list[float]]:
    """`count` lab predicts one after another: each one's latency in seconds as its client saw it,
    in the gateway (admitted to ended, from its snapshot), and of that the time it waited to run."""
    latencies, inside, waits = [], [], []
    for i in range(count):
        run = await job(port, "predict", {"prompt": f"the lab asks {i}", "top_k": 3}, LAB)
        if run.ok:
            latencies.append(run.latency)
            snapshot = await common.Response.open(port, "GET", f"/jobs/{run.job_id}", headers=auth(LAB))
            times = msgspec.json.decode(await snapshot.body())
            snapshot.close()
            inside.append(times["finished"] - times["created"])
            waits.append(times["started"] - times["created"])
        await asyncio.sleep(gap)
    return latencies, inside, waits


async def run(bench: common.Bench, report: common.Report) -> None:
    args = bench.args
    clients, tokens, seconds = (8, 16, 2.0) if bench.quick else (args.clients, args.tokens, args.seconds)
    model = bench.model(default_tiny=True)
    rows = max(2, clients // 4)  # a batch the flooding classes overfill, and the queue orders
    flags = ["--max-decoding-jobs", str(rows), "--class-min-share", str(MIN_SHARE), "--max-tokens", str(max(tokens, 16)),
             "--queue-size", str(8 * clients), "--max-queued-per-owner", str(4 * clients)]
    classed, plain = bench.dir / "classed.toml", bench.dir / "plain.toml"
    classed.write_text(CLASSED)
    plain.write_text(PLAIN)
    common.step("starting the gateway with classes, and one without")
    gateway = bench.streamgate("serve", *flags, "--tokens-file", str(classed), model=model, name="classed")
    bare = bench.streamgate("serve", *flags, "--tokens-file", str(plain), model=model, name="plain")
    bench.ready(gateway, bare)
    port, bare_port = common.port_of(gateway), common.port_of(bare)
    report.fact("machine", common.machine(common.readyz(gateway).get("device", "cpu")))
    report.fact("load", f"{clients} clients a class, generate of {tokens} tokens, windows of {seconds:g} s, "
                f"--max-decoding-jobs {rows}, --class-min-share {MIN_SHARE}")

    common.step("predict on the idle gateway")
    for _ in range(3):  # warm
        await job(port, "predict", {"prompt": "warm", "top_k": 3}, LAB)
    idle, idle_inside, _ = await predicts(port, 10 if bench.quick else 30, 0.01)

    common.step("predict while the students keep the engine full")
    students = Flood(port, STUDENT, clients, tokens)
    await asyncio.sleep(seconds / 4)
    loaded, loaded_inside, loaded_waits = await predicts(port, 10 if bench.quick else 40, seconds / 80)
    await students.stop()
    step = statistics.median(step_gaps(students.runs)) if step_gaps(students.runs) else float("nan")
    idle_p50, loaded_p99 = statistics.median(idle), common.percentile(loaded, 99)
    bound = step + idle_p50
    inside_bound, inside_p99 = step + statistics.median(idle_inside), common.percentile(loaded_inside, 99)
    report.table(
        ["measure", "ms"],
        [["predict alone, p50", idle_p50 * 1000], ["predict alone, p99", common.percentile(idle, 99) * 1000],
         ["predict under load, p50", statistics.median(loaded) * 1000], ["predict under load, p99", loaded_p99 * 1000],
         ["students' decoding step, p50", step * 1000], ["bound: a step + predict alone", bound * 1000],
         ["in the gateway: predict alone, p50", statistics.median(idle_inside) * 1000],
         ["in the gateway: predict under load, p50", statistics.median(loaded_inside) * 1000],
         ["in the gateway: predict under load, p99", inside_p99 * 1000],
         ["in the gateway: of which waiting to run, p50", statistics.median(loaded_waits) * 1000],
         ["in the gateway: of which waiting to run, p99", common.percentile(loaded_waits, 99) * 1000],
         ["in the gateway: bound, a step + predict alone", inside_bound * 1000]],
        title="wait of a higher class's predict",
    )
    report.target("a lab predict's p99 under a full engine <= one decoding step + its run alone",
                  f"{loaded_p99 * 1000:.1f} ms against {bound * 1000:.1f} ms", loaded_p99 <= bound)
    report.target("the same in the gateway (admitted to ended): p99 <= one decoding step + its run alone there",
                  f"{inside_p99 * 1000:.1f} ms against {inside_bound * 1000:.1f} ms", inside_p99 <= inside_bound)

    common.step("both classes flooding")
    lab, students = Flood(port, LAB, clients, tokens), Flood(port, STUDENT, clients, tokens)
    await asyncio.sleep(seconds / 4)
    start = time.time()
    await asyncio.sleep(seconds)
    end = time.time()
    await asyncio.gather(lab.stop(), students.stop())
    done_lab, done_students = len(lab.finished_between(start, end)), len(students.finished_between(start, end))
    share = done_students / max(1, done_lab + done_students)
    report.table(["class", "jobs finished", "share"],
                 [["lab", done_lab, f"{done_lab / max(1, done_lab + done_students):.3f}"], ["students", done_students, f"{share:.3f}"]],
                 title=f"both classes flooding, {seconds:g} s")
    report.target(f"the students' share of finished jobs >= the minimum share {MIN_SHARE}", f"{share:.3f}", share >= MIN_SHARE)

    common.step("students alone, with and without classes, in turn")
    rates: dict[str, list[float]] = {"classes": [], "no classes": []}
    rounds = 2 if bench.quick else 4
    for i in range(rounds):
        for name, at in (("classes", port), ("no classes", bare_port))[:: 1 if i % 2 == 0 else -1]:
            flood = Flood(at, STUDENT, clients, tokens)
            await asyncio.sleep(seconds / 4)
            start = time.time()
            await asyncio.sleep(seconds / 2)
            rates[name].append(len(flood.finished_between(start, time.time())) / (time.time() - start))
            await flood.stop()
    with_classes, without = statistics.median(rates["classes"]), statistics.median(rates["no classes"])
    report.table(["gateway", "jobs/s (median)", "rounds"], [["classes", with_classes, rounds], ["no classes", without, rounds]],
                 title="students alone")
    # The scheduler unused costs nothing: with classes no more than 5 % slower (faster is the rounds' noise).
    report.target("the students' jobs/s with classes unused, against without: at least 0.95x", f"{with_classes / without:.3f}x" if without else "n/a",
                  with_classes / without >= 1 - TARGET_COST if without else None)
    if any(not r.ok for flood in (lab, students) for r in flood.runs if r.status != 200):
        report.note("some jobs were refused: " + msgspec.json.encode([r.status for r in lab.runs + students.runs if r.status != 200][:5]).decode())


if __name__ == "__main__":
    common.main(run, TITLE, __doc__, options)
