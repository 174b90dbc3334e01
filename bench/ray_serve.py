"""Ray Serve: `predict` jobs/s at 16 clients, the local backend vs Ray with one replica vs two, and Ray's first event.

Three `streamgate serve` gateways on the same model and settings: the local
backend (the model in the gateway's process), and `--backend ray` with
`--ray-replicas 1` and then 2 (`--ray-cpus-per-replica 1` by default, so that
two replicas fit on 2 cores; each replica is a local backend with its own copy
of the model, its own queue and batching). With no `--ray-address` (and
RAY_ADDRESS empty) a Ray gateway starts its own local Ray instance (the script
stops if one joined a running cluster instead: two gateways on one cluster
share the `streamgate` application, whatever their replica counts), so the two
Ray gateways run one after the other, each stopped (SIGTERM) before the next
starts. For each, a table gives the CPU and memory of its Ray instance at
rest, how it exited, and which of its Ray processes outlived it (they are then
stopped here, so that the next one starts clean). The local gateway runs
throughout (started with ray x1, the two loading together) and is measured
again beside each Ray gateway, alternating with it round by round, so that
each Ray-over-local ratio comes from the same minutes of the machine; one
replica against two compares two phases, and the two local rows show how far
the machine drifted in between.

On each: a lone client sends `predict` jobs one at a time (time from the
request to the first event, the `received` status, and to the `data` event),
then 16 clients run `predict` in a closed loop (each sends its next job when
its last one ends) for a fixed time: jobs/s and latency p50/p99. On the Ray
backend the first event waits for a replica to accept the job (the gateway's
call to it and the replica's answer, before the response starts), so the
difference in first-event p50 is what Ray adds to it.

Torch threads: `--torch-threads N` (default 1) sets OMP_NUM_THREADS in every
gateway, which Ray's replicas inherit (without it Ray sets a replica's to its
CPUs, floor 1, while the local backend takes a thread per core): one thread
per model copy, so the local backend and one replica do the same work with
the same threads and two replicas have twice the threads; `--torch-threads 0`
leaves each its own default. The model is the default one
(SmolLM2-135M-Instruct), or `--model PATH`; --quick uses a tiny random model.
`--seconds` sets the loaded time per round (default 20; --quick: 4, one round).

No numeric target in the issue: the ratios and the added time are reported.
Targets (sanity): every job succeeds on every gateway; two replicas give at
least one replica's jobs/s at 16 clients. On 2 cores the second can fail
without a fault in Ray: two one-thread replicas, the gateway, Ray's own
processes and the 16 clients share the same 2 cores.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import signal
import sys
import time
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import batching, common  # noqa: E402

TITLE = "ray serve: predict jobs/s at 16 clients, local backend vs --backend ray with 1 and 2 replicas"
CLIENTS = 16
READY_TIMEOUT_S = 600  # Ray's start, then each replica loading its own model copy, on a busy 2-core machine
LEFTOVER_WAIT_S = 5.0  # after a Ray gateway exits, how long its Ray processes may take to follow it


def options(parser) -> None:
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="OMP_NUM_THREADS for every gateway and so every replica (default 1; 0: leave unset).")
    parser.add_argument("--ray-cpus-per-replica", default="1", help="--ray-cpus-per-replica of the Ray gateways.")
    parser.add_argument("--seconds", type=float, default=None,
                        help=f"How long {CLIENTS} clients run on a gateway in each round (default 20; --quick 4).")


def predict(port: int) -> Callable[[int], Awaitable[common.JobRun]]:
    """One `predict` job (batching.py's prompts, in turn), followed to its end."""
    return lambda index: common.run_job(port, "/predict/run", batching.params("predict", index, 0))


# -- Ray gateways: wait for every replica, and make sure their Ray instance goes with them --------


def wait_ready(process: common.ServeProcess, replicas: int | None, start: float) -> float:
    """Seconds from `start` (monotonic) until `/readyz` answers 200 (for Ray, with `replicas` replicas RUNNING)."""
    while time.monotonic() - start < READY_TIMEOUT_S:
        if process.proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {process.proc.returncode}:\n{process.output()[-4000:]}")
        try:
            answer = httpx.get(process.url + "/readyz", timeout=5)
            running = answer.json().get("replicas", {}).get("RUNNING", 0)
            if answer.status_code == 200 and (replicas is None or running >= replicas):
                return time.monotonic() - start
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the gateway was not ready in {READY_TIMEOUT_S} s:\n{process.output()[-4000:]}")


def _started(pid: int) -> str | None:
    """A process's start time (field 22 of its stat), None when it is gone: with the pid, it names one process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def descendants(pid: int) -> dict[int, str]:
    """Every live process under `pid` (children, theirs, …), with its start time."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int(Path(entry, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found: dict[int, str] = {}
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        started = _started(child)
        if started is not None:
            found[child] = started
            todo += children.get(child, [])
    return found


def process_name(pid: int) -> str:
    """`ray::ServeReplica:…` as Ray names its workers, else the program (gcs_server, raylet, dashboard.py, …)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    if argv[0].startswith("ray::"):
        return argv[0].split()[0]
    program = next((arg for arg in argv[1:] if arg.endswith(".py")), argv[0]) if "python" in argv[0] else argv[0]
    return Path(program).name


class RayTree:
    """A Ray gateway's process and the Ray processes under it (its local Ray instance)."""

    def __init__(self, process: common.ServeProcess) -> None:
        self.process = process
        self.cpu = 0.0  # CPU seconds used in the windows `at_rest` measured
        self.wall = 0.0

    def pids(self) -> list[int]:
        return [self.process.proc.pid, *descendants(self.process.proc.pid)]

    def _total(self, read: Callable[[int], float]) -> float:
        """`read` summed over the tree's processes, less those gone meanwhile."""
        total = 0.0
        for pid in self.pids():
            with contextlib.suppress(OSError, IndexError, RuntimeError):
                total += read(pid)
        return total

    def cpu_now(self) -> float:
        return self._total(common.cpu_seconds)

    def rss_mb(self) -> float:
        return self._total(common.rss_kb) / 1024

    def replica_threads(self) -> list[str]:
        """OMP_NUM_THREADS in each Serve replica's environment (`unset` where it has none)."""
        found = []
        for pid in descendants(self.process.proc.pid):
            if process_name(pid).startswith("ray::ServeReplica"):
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                values = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"OMP_NUM_THREADS=")]
                found.append(values[0] if values else "unset")
        return found

    @contextlib.contextmanager
    def at_rest(self):
        """Count the CPU the tree uses meanwhile (while another gateway is measured)."""
        cpu, start = self.cpu_now(), time.monotonic()
        yield
        self.cpu += self.cpu_now() - cpu
        self.wall += time.monotonic() - start

    def stop(self) -> tuple[float, str, list[str]]:
        """SIGTERM the gateway (SIGKILL after the harness's grace): seconds to exit, how it exited, Ray processes left.

        A gateway that started its own Ray instance should take it down as it
        exits; any of its processes still alive LEFTOVER_WAIT_S later are named,
        then stopped here (SIGTERM, then SIGKILL), so the next gateway starts clean.
        """
        ray_processes = descendants(self.process.proc.pid)
        names = {pid: process_name(pid) for pid in ray_processes}
        start = time.monotonic()
        common.stop(self.process)
        took = time.monotonic() - start
        code = self.process.proc.returncode
        exit_status = f"{code}" if code >= 0 else signal.Signals(-code).name

        def alive() -> list[int]:
            return [pid for pid, started in ray_processes.items() if _started(pid) == started]

        deadline = time.monotonic() + LEFTOVER_WAIT_S
        while alive() and time.monotonic() < deadline:
            time.sleep(0.25)
        left = alive()
        for sig, wait in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)):
            for pid in alive():
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while alive() and time.monotonic() < deadline:
                time.sleep(0.1)
        return took, exit_status, sorted(names[pid] for pid in left)


# -- the run -------------------------------------------------------------------------------------


async def run(bench: common.Bench, report: common.Report) -> None:
    quick = bench.quick
    seconds = bench.args.seconds or (4.0 if quick else 20.0)
    rounds, lone_jobs = (1, 10) if quick else (2, 20)
    threads = bench.args.torch_threads
    cpus = bench.args.ray_cpus_per_replica
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    model = bench.model(default_tiny=False)

    def ray_gateway(replicas: int) -> common.ServeProcess:
        common.step(f"ray x{replicas}: starting (Ray, then {replicas} replica(s) loading the model)")
        started[replicas] = time.monotonic()
        return bench.streamgate("serve", "--backend", "ray", "--ray-replicas", str(replicas), "--ray-cpus-per-replica",
                                cpus, model=model, name=f"ray-{replicas}", env={**(env or {}), "RAY_ADDRESS": ""})

    started: dict[int, float] = {0: time.monotonic()}  # when each gateway started, by replicas (0: local)
    common.step("local gateway: starting")
    local = bench.streamgate("serve", model=model, name="local", env=env)
    first = ray_gateway(1)  # loads beside the local gateway: both are up sooner
    local_ready = wait_ready(local, None, started[0])
    ready = common.readyz(local)
    report.fact("machine", common.machine(ready.get("device", "?")))
    report.fact("model", f"{ready.get('model', '?')} ({ready.get('dtype', '?')}); torch threads: "
                + (f"{threads} per model copy (OMP_NUM_THREADS, inherited by Ray's replicas)" if threads
                   else "each's default (local: torch's, a thread per core; Ray: the replica's CPUs, floor 1)"))
    report.fact("ray", f"ray {importlib.metadata.version('ray')}, a local instance started by each Ray gateway "
                f"(no --ray-address), --ray-cpus-per-replica {cpus}, Ray gateways one after the other")
    report.fact("jobs", f"predict top_k 5, short prompts ({len(batching.PROMPTS)} in turn); lone: {lone_jobs} jobs "
                f"one at a time per round; loaded: {CLIENTS} clients in a closed loop for {seconds:g} s per round; "
                f"{rounds} round(s), local and Ray in turn")

    rows, measured, trees, replica_threads = [], {}, [], []
    for replicas in (1, 2):
        name = f"ray x{replicas}"
        gateway = first if replicas == 1 else ray_gateway(replicas)
        ready_s = wait_ready(gateway, replicas, started[replicas])
        tree = RayTree(gateway)
        if not any(process_name(pid) == "gcs_server" for pid in tree.pids()):
            raise RuntimeError(f"{name} joined a running Ray cluster (`ray start` on this machine?) instead of "
                               "starting its own instance: its figures would not be this benchmark's")
        replica_threads += tree.replica_threads()
        ports = {"local": common.port_of(local), name: common.port_of(gateway)}
        for port in ports.values():  # warm-up: first calls, a first batch, Ray's first routes to each replica
            await common.closed_loop(1, 3, predict(port))
            await common.closed_loop(CLIENTS, 2 * CLIENTS, predict(port))
        lone_runs: dict[str, list[common.JobRun]] = {key: [] for key in ports}
        loads: dict[str, list[common.Load]] = {key: [] for key in ports}
        for round_ in range(rounds):
            for key, port in ports.items():
                common.step(f"{name} phase, round {round_ + 1} of {rounds}: {key}")
                with tree.at_rest() if key == "local" else contextlib.nullcontext():
                    lone_runs[key] += (await common.closed_loop(1, lone_jobs, predict(port))).runs
                    loads[key].append(await common.closed_loop(CLIENTS, 1_000_000, predict(port), deadline=seconds))
        rss = {"local": common.rss_kb(local.proc.pid) / 1024, name: tree.rss_mb()}
        common.step(f"{name}: stopping")
        trees.append((name, len(tree.pids()), 100 * tree.cpu / tree.wall, rss[name], *tree.stop()))
        for key in ports:
            runs = lone_runs[key]
            ok = [r for r in runs if r.ok]
            latencies = [x for load in loads[key] for x in load.latencies_ms()]
            wall = sum(load.wall for load in loads[key])
            jobs = sum(len(load.ok) for load in loads[key])
            figures = {
                "first event p50": common.percentile([r.first_event * 1000 for r in ok], 50),
                "first event p99": common.percentile([r.first_event * 1000 for r in ok], 99),
                "lone p50": common.percentile([r.latency * 1000 for r in ok], 50),
                "jobs/s": jobs / wall if wall else None,
                "failed": (len(runs) - len(ok)) + sum(load.failed for load in loads[key]),
            }
            label = key if key != "local" else f"local (beside {name})"
            measured[label] = figures
            shown = ready_s if key != "local" else local_ready if replicas == 1 else "-"
            rows.append([label, replicas if key != "local" else "-", shown,
                         rss[key], len(runs), figures["first event p50"], figures["first event p99"],
                         figures["lone p50"], jobs, figures["jobs/s"], common.percentile(latencies, 50),
                         common.percentile(latencies, 99), figures["failed"]])
    if replica_threads:
        report.fact("replicas' OMP_NUM_THREADS", ", ".join(replica_threads) + " (read from each replica's environment)")
    report.table(["gateway", "replicas", "ready s", "RSS MB", "lone jobs", "first event p50 ms", "first event p99 ms",
                  "lone job p50 ms", "loaded jobs", "jobs/s", "p50 ms", "p99 ms", "failed"], rows,
                 title=f"predict: a lone client, then {CLIENTS} clients in a closed loop")
    report.note("ready s: from the process's start to /readyz 200 with every replica RUNNING (the local gateway and "
                "ray x1 started together); RSS: the gateway's resident memory, for Ray with every process of its Ray "
                "instance (shared pages counted in each); first event: from sending the request to the first event "
                "(status received); lone job: to the data event, one client, one job at a time; jobs/s, p50, p99: "
                f"{CLIENTS} clients, request to data event; failed: jobs not ending with data, lone and loaded")

    one, two = measured["ray x1"], measured["ray x2"]
    local1, local2 = measured["local (beside ray x1)"], measured["local (beside ray x2)"]

    def added(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
        return None if a[key] is None or b[key] is None else a[key] - b[key]

    def compared(label: str, a: dict[str, Any], b: dict[str, Any], how: str) -> list[Any]:
        return [label, _x(common.ratio(a["jobs/s"], b["jobs/s"])), added(a, b, "first event p50"),
                added(a, b, "lone p50"), how]

    report.table(["compared", f"jobs/s ratio at {CLIENTS} clients", "first event p50 added ms",
                  "lone job p50 added ms", "measured"],
                 [compared("ray x1 / local", one, local1, "same phase, alternating"),
                  compared("ray x2 / local", two, local2, "same phase, alternating"),
                  compared("ray x2 / ray x1", two, one, "two phases"),
                  compared("local, 2nd / 1st phase", local2, local1, "the machine's drift")],
                 title="Ratios and differences")
    each = common.ratio(common.ratio(two["jobs/s"], local2["jobs/s"]), common.ratio(one["jobs/s"], local1["jobs/s"]))
    report.note(f"ray x2 / ray x1 with each first divided by the local gateway beside it: {_x(each)}; added: the "
                "first row's p50 minus the second's")
    report.table(["gateway", "processes", "CPU % at rest", "RSS MB", "stop s", "exit", "left after exit"],
                 [[name, n, cpu_pct, mb, took, status, ", ".join(left) or "none"]
                  for name, n, cpu_pct, mb, took, status, left in trees],
                 title="Each Ray gateway with its Ray instance: at rest, and stopped (SIGTERM)")
    report.note("processes: the gateway and every process under it; CPU % at rest: their CPU time (100 = one core) "
                "while the local gateway was measured beside them; stop s: from SIGTERM to the gateway's exit (SIGKILL "
                f"after {common.STOP_GRACE_S:g} s); exit: its exit status, or the signal that ended it; left after "
                f"exit: its Ray processes still alive {LEFTOVER_WAIT_S:g} s after it exited (then stopped here)")

    failed = sum(figures["failed"] for figures in measured.values())
    report.target("every job succeeds on every gateway", f"{failed} failed", failed == 0)
    scale = common.ratio(two["jobs/s"], one["jobs/s"])
    report.target(f"ray x2 jobs/s >= ray x1 at {CLIENTS} clients (sanity; 2 cores may not give it)", _x(scale),
                  None if scale is None else scale >= 1.0)


def _x(value: float | None) -> str:
    return common.fmt(value, 2) + ("x" if value is not None else "")


if __name__ == "__main__":
    common.main(run, TITLE, __doc__, options)
