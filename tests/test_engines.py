"""Engine processes (`--engine process`, backends/engines.py): each model in a child process the
gateway supervises. A killed engine ends its running jobs once (retryable), runs its queued ones
on the engine started in its place, and leaves the gateway, its streams and the other model alone.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncio

import httpx
import msgspec
import pytest

from backends import loading as models
from backends.engine_processes import engine_devices, engine_settings
from backends.engines import EngineBackend, EngineLink
from backends.remote import FORGET_WAIT_S
from gateway.config import Settings
from gateway.params import Relayed
from gateway.server.app import create_app
from tests.conftest import Server, make_server, parse_sse, run_stream, wait_until
from tests.test_observability import scrape, value
from tests.support.processes import ROOT, STREAMGATE, ServeProcess, clean_env, free_port, start_serve
from tests.support.tiny_models import build_tiny_model


class Follower(threading.Thread):
    """One job's stream, read on a thread, its events kept as they arrive."""

    def __init__(self, url: str, tool: str, params: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.tool, self.params, self.headers = url, tool, params, headers
        self.events: list[dict[str, Any]] = []
        self.status: int | None = None

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/{self.tool}/run", json=self.params, headers=self.headers, timeout=120) as response:
            self.status = response.status_code
            pending = b""
            for chunk in response.iter_bytes():
                pending += chunk
                while b"\n\n" in pending:
                    block, pending = pending.split(b"\n\n", 1)
                    self.events.extend(parse_sse(block + b"\n\n"))

    def statuses(self) -> list[str]:
        return [e["data"]["status"].lower() for e in self.events if e["event"] == "status"]

    def terminals(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] in ("data", "error")]

    def ended(self) -> dict[str, Any]:
        self.join(timeout=120)
        assert not self.is_alive(), "the stream did not end"
        (terminal,) = self.terminals()  # exactly one
        return terminal


def follow(url: str, tool: str, params: dict[str, Any], headers: dict[str, str] | None = None) -> Follower:
    follower = Follower(url, tool, params, headers)
    follower.start()
    return follower


def engines(gateway: ServeProcess) -> dict[str, dict[str, Any]]:
    body = httpx.get(f"{gateway.url}/readyz", timeout=10).json()
    return {e["model"]: e for e in body["engines"]}


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (dead, not yet reaped) counts as gone.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def start_gateway(tmp: Path, *models: str, extra: tuple[str, ...] = ()) -> ServeProcess:
    port = free_port()
    args = [
        *(arg for model in models for arg in ("--model", model)),
        "--engine", "process", "--tools", "tests.support.engine_tools", "--port", str(port),
        *(() if "--devices" in extra else ("--device", "cpu")), "--torch-threads", "1", "--log-level", "warning", *extra,
    ]
    return start_serve(args, clean_env(), port, tmp / f"gateway-{port}.log")


@pytest.fixture(scope="module")
def other_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("other") / "other", seed=1)


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path, other_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    # A batch wait long enough that naps sent together run as one batch.
    s = start_gateway(
        tmp_path_factory.mktemp("engines"), f"a={tiny_model_path}", f"b={other_model_path}",
        extra=("--batch-wait-ms", "300", "--tools", "tests.support.device_tools"),
    )
    yield s
    s.stop()


@pytest.mark.parametrize(
    ("given", "loaders"),
    [([], []), (["./tests"], []), (["a=./tests", "b=org/some-model"], ["b=tests.support.custom_model:load"])],
    ids=["the bundled default", "a folder", "named, a loader"],
)
def test_each_engine_is_given_its_own_model_as_the_gateway_resolved_it(given: list[str], loaders: list[str]) -> None:
    """Without loading anything: each engine's settings name one model, which resolves in the engine
    to what it was in the gateway (the bundled default by its GGUF, not by a name the hub would be asked for)."""
    settings = Settings(model=given, model_loader=loaders, devices=["cuda:0", "cuda:1"])
    specs = models.specs(settings.model, settings.model_loader, settings.model_devices)
    for i, spec in enumerate(specs):
        # A copy on each device, each in an engine told that device alone.
        assert engine_devices(settings, spec) == ["cuda:0", "cuda:1"]
        for device in engine_devices(settings, spec):
            child = engine_settings(settings, spec, i == 0, "token", device)
            (again,) = models.specs(child.model, child.model_loader, child.model_devices)
            assert (again.name, again.gguf, again.loader, again.devices) == (spec.name, spec.gguf, spec.loader, (device,))
            assert again.source == (str(spec.gguf) if spec.gguf else spec.source)
            assert child.devices == [device] and child.device is None


def test_each_model_runs_in_an_engine_process_of_the_gateway_and_gives_what_a_thread_gives(
    gateway: ServeProcess, tiny_model_path: Path
) -> None:
    found = engines(gateway)
    assert set(found) == {"a", "b"} and all(e["state"] == "ready" and e["restarts"] == 0 for e in found.values())
    pids = {e["pid"] for e in found.values()}
    assert len(pids) == 2 and gateway.proc.pid not in pids
    assert all(parent_of(pid) == gateway.proc.pid for pid in pids)
    params = {"prompts": ["hello there", "a"], "max_tokens": 12, "model": "a"}
    in_engine = run_stream(gateway.url, "generate", params)
    thread = make_server(tiny_model_path)
    try:
        in_thread = run_stream(thread.url, "generate", {**params, "model": None})
    finally:
        thread.stop()
    assert in_engine.terminal["event"] == "data", in_engine.events
    assert in_engine.terminal["data"] == in_thread.terminal["data"]
    # The engine's batches in the gateway's /metrics (a step per token at least), once it has polled the engine again.
    def steps() -> float:
        found = re.search(r"^streamgate_batch_size_count (\S+)$", httpx.get(f"{gateway.url}/metrics", timeout=10).text, re.M)
        return float(found.group(1)) if found else 0.0

    wait_until(lambda: steps() >= 12, timeout=10, what="the engine's batch sizes in /metrics")
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    assert re.search(r'^streamgate_engine_queue_depth\{copy="0",device="cpu",model="a"\} 0\.0$', metrics, re.M), metrics


def test_a_refusal_only_the_engine_can_make_comes_back_before_the_stream(gateway: ServeProcess) -> None:
    """The prompt's length is known where the tokenizer is: the engine refuses the submit on its
    socket, and the client gets that 413 as an ordinary answer, with no job left behind."""
    before = httpx.get(f"{gateway.url}/jobs", timeout=10).json()["jobs"]
    refused = httpx.post(f"{gateway.url}/generate/run", json={"prompts": ["a" * 400], "model": "a"}, timeout=30)
    assert refused.status_code == 413, refused.text
    assert refused.json()["error"]["code"] == "too_long" and "X-Job-Id" not in refused.headers
    assert httpx.get(f"{gateway.url}/jobs", timeout=10).json()["jobs"] == before
    assert all(e["jobs"] == 0 for e in engines(gateway).values())


def test_a_request_is_decoded_once_in_the_engine_that_runs_it(tiny_model_path: Path) -> None:
    """The gateway reads a body's model and passes its bytes on as the client sent them; the engine
    decodes, checks and prices the params, and says what only a decode tells: the price, and whether
    the job keeps a checkpoint it can go on from (the tool's own rule, applied to the decoded params)."""
    settings = Settings(model=[str(tiny_model_path)], device="cpu", torch_threads=1, detach_grace=0)
    backend = EngineBackend(settings)
    taken: dict[str, Any] = {}
    submit = backend.submit

    async def recorded(job: Any) -> None:
        await submit(job)
        taken[job.id] = (job.params, job.resumable, job.cost)

    backend.submit = recorded  # type: ignore[method-assign]
    server = Server(create_app(backend, settings)).start().wait_ready(timeout=120)
    try:
        (model,) = backend.model_names()
        for tool, body in (
            ("embed", b'{ "texts": ["abc", "de"],\n  "pooling":"mean" }'),  # its spacing kept: never re-encoded
            ("generate", b'{"prompts": ["hi"], "max_tokens": 2}'),
        ):
            ran = run_stream(server.url, tool, content=body)
            assert ran.terminal["event"] == "data", ran.events
            params, resumable, cost = taken[ran.headers["x-job-id"]]
            assert isinstance(params, Relayed) and bytes(params.body) == body and params.model == model
            local = backend.local[tool]
            decoded = msgspec.json.decode(body, type=local.params)
            assert resumable == (local.resumable is not None and local.resumable(decoded)), tool
            assert cost is not None and cost.result > 0  # priced where it was decoded
        assert taken and any(resumable for _, resumable, _ in taken.values())
    finally:
        server.stop()


class _Socket:
    """What the link writes its messages on (a websockets connection's `send`)."""

    def __init__(self) -> None:
        self.messages: list[bytes] = []

    async def send(self, message: bytes) -> None:
        self.messages.append(message)


async def test_the_ops_of_one_turn_of_the_loop_go_to_an_engine_in_one_message() -> None:
    """Submits made in one turn of the loop (many clients' requests) share a message, and so one wake-up
    of the engine; a finished job's `forget` waits a little for company, and an urgent op takes it along."""
    link = EngineLink("unix:/nowhere", token=None, deadline=1.0, poll_interval=1.0, on_tools=lambda: None)
    socket = link._socket = _Socket()  # type: ignore[assignment]
    link._send(b'{"op":"resume","job_id":"a"}')
    link._send(b'{"op":"resume","job_id":"b"}')
    await asyncio.sleep(0.01)
    assert socket.messages == [b'[{"op":"resume","job_id":"a"},{"op":"resume","job_id":"b"}]']
    link.forget("c", urgent=False)
    await asyncio.sleep(FORGET_WAIT_S / 5)
    assert len(socket.messages) == 1  # not yet: it waits for company
    link._send(b'{"op":"resume","job_id":"d"}')
    await asyncio.sleep(0.01)
    assert msgspec.json.decode(socket.messages[-1]) == [{"op": "forget", "job_id": "c"}, {"op": "resume", "job_id": "d"}]
    link.forget("e", urgent=False)
    await asyncio.sleep(FORGET_WAIT_S * 2)
    assert msgspec.json.decode(socket.messages[-1]) == {"op": "forget", "job_id": "e"}  # alone, once it has waited
    assert len(socket.messages) == 3


def test_a_tools_error_keeps_its_code_through_the_engine(gateway: ServeProcess) -> None:
    """The engine is the gateway's own: a tool's failure reads as it does with threads, not as `remote_error`."""
    failed = run_stream(gateway.url, "device_error", {"kind": "oom", "model": "a"})
    error = failed.terminal["data"]["error"]
    assert error["code"] == "tool_error" and error["message"].startswith("the device ran out of memory running this job")
    assert engines(gateway)["a"]["state"] == "ready"


def test_serve_checks_the_tool_modules_before_it_starts_any_engine(tiny_model_path: Path) -> None:
    args = ["serve", "--model", str(tiny_model_path), "--engine", "process", "--tools", "no_such_module_here", "--port", str(free_port())]
    done = subprocess.run([str(STREAMGATE), *args], capture_output=True, text=True, timeout=120, env=clean_env(), cwd=ROOT)
    assert done.returncode != 0 and "no_such_module_here: cannot import it" in done.stderr, done.stderr


def test_a_killed_engine_ends_its_running_jobs_once_runs_its_queued_ones_anew_and_touches_nothing_else(
    gateway: ServeProcess,
) -> None:
    before = engines(gateway)
    url = gateway.url
    # Three naps run as one batch on a; two more wait behind them; one runs on b meanwhile.
    running = [follow(url, "nap", {"seconds": 60, "tag": f"run{i}", "model": "a"}) for i in range(3)]
    wait_until(lambda: all("running" in f.statuses() for f in running), timeout=60, what="the batch to run")
    queued = [follow(url, "nap", {"seconds": 0.2, "tag": f"queued{i}", "model": "a"}) for i in range(2)]
    wait_until(lambda: all("queued" in f.statuses() for f in queued), timeout=60, what="the others to queue")
    other = follow(url, "nap", {"seconds": 3, "tag": "other", "model": "b"})
    wait_until(lambda: "running" in other.statuses(), timeout=60, what="b's nap to run")

    os.kill(before["a"]["pid"], signal.SIGKILL)
    # Not ready while a restarts (the restart waits half a second before it even starts a process). Before the
    # gateway has reaped the process its link may already be down: never "running" then, and once reaped, why.
    readiness: list[httpx.Response] = []
    wait_until(lambda: readiness.append(httpx.get(f"{url}/readyz", timeout=10)) or readiness[-1].status_code == 503, what="503")
    assert "is running" not in readiness[-1].json()["reason"]
    wait_until(lambda: readiness.append(httpx.get(f"{url}/readyz", timeout=10)) or "SIGKILL" in readiness[-1].json()["reason"],
               what="the exit named")
    assert "the engine of model a on cpu is restarting" in readiness[-1].json()["reason"]

    for follower in running:
        terminal = follower.ended()
        assert terminal["event"] == "error", terminal
        error = terminal["data"]["error"]
        assert error["code"] == "backend_unavailable" and error["retryable"] is True
        assert "SIGKILL" in error["message"]
    for i, follower in enumerate(queued):
        terminal = follower.ended()
        assert terminal == {"event": "data", "data": {"tag": f"queued{i}", "batch": terminal["data"]["batch"]}, "id": terminal["id"]}
        # Told they wait for the new engine, and then queued or running there.
        assert any(
            e["event"] == "status" and e["data"].get("message") == "the engine is restarting" for e in follower.events
        ), follower.events
    assert other.ended()["data"] == {"tag": "other", "batch": 1}

    after = engines(gateway)
    assert after["a"]["restarts"] == 1 and after["a"]["pid"] not in (None, before["a"]["pid"])
    assert after["b"]["restarts"] == 0 and after["b"]["pid"] == before["b"]["pid"]
    assert gateway.proc.poll() is None
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert re.search(r'^streamgate_engine_restarts_total\{copy="0",device="cpu",model="a"\} 1\.0$', metrics, re.M), metrics
    assert re.search(r'^streamgate_engine_restarts_total\{copy="0",device="cpu",model="b"\} 0\.0$', metrics, re.M)
    # And the new engine serves as the old one did.
    assert run_stream(url, "nap", {"seconds": 0, "tag": "again", "model": "a"}).terminal["data"] == {"tag": "again", "batch": 1}


def test_a_run_whose_submit_its_engine_never_answered_is_refused_once_and_never_run_later(gateway: ServeProcess) -> None:
    """The engine stops (SIGSTOP) with a run's submit unanswered, then dies: the run is refused (503,
    retryable: no job was made), and its job is not also kept for the next engine, where it would run
    with no one to answer to (or twice, with another engine to try)."""
    import concurrent.futures

    url = gateway.url
    pid = engines(gateway)["b"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            answer = pool.submit(httpx.post, f"{url}/nap/run", json={"seconds": 0, "tag": "unanswered", "model": "b"}, timeout=60)
            wait_until(lambda: engines(gateway)["b"]["jobs"] == 1, 30, "the submit to be sent")
        finally:
            os.kill(pid, signal.SIGKILL)
        refused = answer.result()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready", refused.text
    assert engines(gateway)["b"]["waiting"] == 0
    wait_until(lambda: engines(gateway)["b"]["state"] == "ready", timeout=120, what="b's new engine")
    assert run_stream(url, "nap", {"seconds": 0, "tag": "after", "model": "b"}).terminal["data"] == {"tag": "after", "batch": 1}
    assert engines(gateway)["b"]["jobs"] == 0


def test_a_job_cancelled_while_its_engine_restarts_ends_cancelled(gateway: ServeProcess) -> None:
    url = gateway.url
    blocker = follow(url, "nap", {"seconds": 60, "tag": "blocker", "model": "b"})
    wait_until(lambda: "running" in blocker.statuses(), timeout=60, what="the blocker to run")
    waiting = follow(url, "nap", {"seconds": 0, "tag": "waits", "model": "b"})
    wait_until(lambda: "queued" in waiting.statuses(), timeout=60, what="a queued nap")
    os.kill(engines(gateway)["b"]["pid"], signal.SIGKILL)
    wait_until(
        lambda: any(e["event"] == "status" and e["data"].get("message") == "the engine is restarting" for e in waiting.events),
        what="the nap to wait for the new engine",
    )
    job_id = waiting.events[0]["id"].split(":")[0]
    assert httpx.delete(f"{url}/jobs/{job_id}", timeout=10).json()["cancelled"] is True
    assert waiting.ended()["data"]["error"]["code"] == "cancelled"
    assert blocker.ended()["data"]["error"]["code"] == "backend_unavailable"
    wait_until(lambda: engines(gateway)["b"]["state"] == "ready", timeout=120, what="b's new engine")


def test_a_device_that_fails_for_good_restarts_its_engine_and_the_jobs_waiting_there_run_on_the_next(gateway: ServeProcess) -> None:
    url = gateway.url
    restarts = engines(gateway)["b"]["restarts"]
    wait_until(lambda: engines(gateway)["b"]["state"] == "ready", timeout=120, what="b ready")
    failing = follow(url, "device_error", {"kind": "fatal", "delay": 2, "model": "b"})
    wait_until(lambda: "running" in failing.statuses(), timeout=60, what="the failing job to run")
    waiting = follow(url, "nap", {"seconds": 0, "tag": "after", "model": "b"})
    wait_until(lambda: "queued" in waiting.statuses(), timeout=60, what="a nap queued behind it")
    error = failing.ended()["data"]["error"]
    assert error["code"] == "backend_unavailable" and error["retryable"] is True
    assert waiting.ended()["data"] == {"tag": "after", "batch": 1}
    after = engines(gateway)["b"]
    assert after["restarts"] == restarts + 1 and after["last_exit"] == "exited after its device failed"
    assert engines(gateway)["a"]["state"] == "ready"


def test_an_engine_over_its_memory_limit_fails_the_job_not_the_host_and_dies_with_its_gateway(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    gateway = start_gateway(tmp_path, str(tiny_model_path), extra=("--engine-memory-limit", "4GiB"))
    try:
        hog = run_stream(gateway.url, "hog", {"gib": 6})
        assert hog.terminal["event"] == "error", hog.events
        assert "allocate" in hog.terminal["data"]["error"]["message"].lower()
        small = run_stream(gateway.url, "hog", {"gib": 0.01})
        assert small.terminal["data"] == {"bytes": int(0.01 * (1 << 30))}
        (engine,) = engines(gateway).values()
        assert engine["restarts"] == 0
        # A gateway killed outright takes its engines with it: nothing is left holding a model.
        gateway.kill()
        wait_until(lambda: not alive(engine["pid"]), timeout=30, what="the engine to die with its gateway")
    finally:
        gateway.stop()


def test_hostile_bodies_under_an_engine_memory_limit_are_refused_before_tokenizing_and_restart_nothing(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """20 MB texts to every tool that tokenizes, with the body limit raised to take them: each one
    a 413 `too_long` from its length in characters, before a tokenizer allocates for it (the
    tokenizer's failed allocation under RLIMIT_AS was an abort, and every tenant's running jobs
    with it). The engine's pid and restart count stay as they were."""
    gateway = start_gateway(tmp_path, str(tiny_model_path), extra=("--engine-memory-limit", "3GiB", "--max-body-bytes", str(64 << 20)))
    try:
        (before,) = engines(gateway).values()
        text = "hostile " * ((20 << 20) // 8)
        hostile = [  # each with the param the refusal names
            ("embed", {"texts": ["a", text]}, "texts[1]"),
            ("predict", {"prompt": text}, "prompt"),
            ("generate", {"prompts": [text], "max_tokens": 1}, "prompts[0]"),
            ("generate", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}, "messages"),
            ("loglikelihood", {"prompts": ["a"], "continuations": [text]}, "continuations[0]"),
            ("logprobs", {"prompts": [text]}, "prompts[0]"),
            ("logit_lens", {"prompt": text}, "prompt"),
        ]
        with httpx.Client(timeout=120) as client:
            for tool, params, field in hostile:
                refused = client.post(f"{gateway.url}/{tool}/run", json=params)
                assert refused.status_code == 413, (tool, refused.text[:500])
                error = refused.json()["error"]
                assert error["code"] == "too_long" and "characters" in error["message"], (tool, error)
                assert error["field"] == field, (tool, error)
        (after,) = engines(gateway).values()
        assert (after["pid"], after["restarts"]) == (before["pid"], 0)
        assert run_stream(gateway.url, "predict", {"prompt": "x", "top_k": 1}).terminal["event"] == "data"
        assert "Traceback" not in gateway.output()
    finally:
        gateway.stop()


def test_readyz_and_metrics_count_an_engines_jobs_as_their_streams_tell_them(gateway: ServeProcess) -> None:
    """Counted from the jobs' own frames, not from the engine's last poll: a client that has seen its
    job run (and another's queue behind it) finds them so in /readyz and /metrics at once."""
    url = gateway.url
    wait_until(lambda: engines(gateway)["b"]["state"] == "ready", timeout=120, what="b ready")
    running = follow(url, "nap", {"seconds": 3, "tag": "r", "model": "b"})
    wait_until(lambda: "running" in running.statuses(), timeout=60, what="the nap to run")
    waiting = follow(url, "device_error", {"kind": "none", "delay": 0, "model": "b"})
    wait_until(lambda: "queued" in waiting.statuses(), timeout=60, what="the next job to queue")
    b = engines(gateway)["b"]
    assert (b["running"], b["queued"]) == (1, 1)
    samples = scrape(url)
    assert value(samples, "streamgate_jobs_running", model="b") == 1
    assert value(samples, "streamgate_queue_depth", model="b") == 1
    running.ended()
    waiting.ended()
    b = engines(gateway)["b"]
    assert (b["running"], b["queued"]) == (0, 0)


def test_the_gateways_polls_of_its_engines_are_not_logged_at_info(tiny_model_path: Path, tmp_path: Path) -> None:
    """The gateway asks each engine's /readyz five times a second: at --log-level info, the engines'
    access lines for them would be 70 MB a day each. The gateway's own access lines stay."""
    port = free_port()
    args = ["--model", str(tiny_model_path), "--engine", "process", "--tools", "tests.support.engine_tools", "--port", str(port),
            "--device", "cpu", "--torch-threads", "1", "--log-level", "info"]
    gateway = start_serve(args, clean_env(), port, tmp_path / "gateway.log")
    try:
        # Ready: the gateway has had an answer from the engine's /readyz by now, and a job's counts are current.
        assert run_stream(gateway.url, "nap", {"seconds": 0, "tag": "t"}).terminal["event"] == "data"
        assert httpx.get(gateway.url + "/readyz").json()["running"] == 0
    finally:
        gateway.stop()
    lines = gateway.output().splitlines()
    assert any("uvicorn.access" in line and "POST /nap/run" in line for line in lines)
    assert not [line for line in lines if "GET /readyz" in line and "engine=" in line]


def test_a_gateway_that_stops_stops_its_engines(tiny_model_path: Path, tmp_path: Path) -> None:
    gateway = start_gateway(tmp_path, str(tiny_model_path))
    (engine,) = engines(gateway).values()
    gateway.stop()
    assert gateway.proc.returncode == 0, gateway.output()
    assert not alive(engine["pid"])
    assert "Traceback" not in gateway.output(), gateway.output()


def test_a_body_as_big_as_the_gateway_takes_reaches_the_engine_and_its_result_comes_back(tiny_model_path: Path, tmp_path: Path) -> None:
    """20 MB of params on the engine's socket (over the 16 MiB a WebSocket message may have by
    default), and 20 MB of result fetched rather than sent in a frame; the other jobs' socket stays up."""
    gateway = start_gateway(tmp_path, str(tiny_model_path), extra=("--max-body-bytes", str(32 << 20)))
    try:
        tag = "x" * (20 << 20)
        done = run_stream(gateway.url, "nap", {"seconds": 0, "tag": tag}, timeout=120)
        assert done.terminal["event"] == "data" and done.terminal["data"] == {"tag": tag, "batch": 1}
        assert run_stream(gateway.url, "nap", {"seconds": 0, "tag": "small"}).terminal["data"] == {"tag": "small", "batch": 1}
        (engine,) = engines(gateway).values()
        assert engine["restarts"] == 0 and engine["state"] == "ready"
    finally:
        gateway.stop()


async def test_what_a_backend_loaded_is_out_of_the_collectors_passes(tiny_model_path: Path) -> None:
    """A full collection walked every module and model object (300-400 thousand in a gateway), holding
    the event loop for a fifth of a second; loaded, they are frozen out of its generations."""
    import gc

    from backends.local import LocalBackend
    from gateway.tools import builtin_tools, collect

    gc.unfreeze()
    backend = LocalBackend(collect(builtin_tools()), Settings(model=[str(tiny_model_path)], device="cpu"))
    await backend.start()
    try:
        await backend.wait_ready()
        frozen = gc.get_freeze_count()
        assert frozen > 10_000, frozen  # torch's and transformers' modules, and the model's
    finally:
        await backend.stop()
        gc.unfreeze()


def test_generate_jobs_decode_together_past_a_batch_of_32(tiny_model_path: Path, tmp_path: Path) -> None:
    """A continuous batch takes every waiting generate job its memory allows (--max-decoding-jobs 256),
    not --max-batch-size's 32: 40 jobs queued behind a nap start decoding as one batch."""
    gateway = start_gateway(tmp_path, str(tiny_model_path), extra=("--queue-size", "128", "--max-queued-per-owner", "64"))
    try:
        url = gateway.url
        holder = follow(url, "nap", {"seconds": 120})
        wait_until(lambda: "running" in holder.statuses(), timeout=60, what="the nap to hold the engine")
        jobs = [follow(url, "generate", {"prompts": [f"prompt {i}"], "max_tokens": 3}) for i in range(40)]
        wait_until(lambda: all("queued" in f.statuses() for f in jobs), timeout=60, what="the generate jobs to queue")
        httpx.delete(f"{url}/jobs/{holder.events[0]['id'].split(':')[0]}", timeout=10).raise_for_status()
        assert holder.ended()["data"]["error"]["code"] == "cancelled"
        for follower in jobs:
            assert follower.ended()["event"] == "data"

        def steps_over_32() -> float:
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
            upto = {m[0]: float(m[1]) for m in re.findall(r'^streamgate_batch_size_bucket\{le="([^"]+)"\} (\S+)$', metrics, re.M)}
            return upto.get("64.0", 0.0) - upto.get("32.0", 0.0)

        # The engine's facts reach the gateway within a fraction of a second.
        wait_until(lambda: steps_over_32() >= 3, timeout=10, what="steps of 40 jobs in the batch sizes")
    finally:
        gateway.stop()


# -- a model on two devices: an engine each -------------------------------------------------------


@pytest.fixture(scope="module")
def esm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support import tiny_models

    return tiny_models.build("esm_mlm", tmp_path_factory.mktemp("esm") / "esm")


@pytest.fixture(scope="module")
def two_copies(esm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """A masked LM with a copy on each of two devices (two CPU copies here): an engine process each."""
    s = start_gateway(tmp_path_factory.mktemp("copies"), f"esm={esm_path}", extra=("--model-devices", "esm=cpu,cpu"))
    yield s
    s.stop()


def copies(gateway: ServeProcess, model: str = "esm") -> list[dict[str, Any]]:
    return [e for e in httpx.get(f"{gateway.url}/readyz", timeout=10).json()["engines"] if e["model"] == model]


def pll_of(path: Path, sequence: str) -> float:
    """Plain transformers: each own token masked in turn, its log-probability summed."""
    import torch
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    model = tf.AutoModelForMaskedLM.from_pretrained(path).eval()
    ids = tokenizer(sequence, return_tensors="pt").input_ids[0]
    total = 0.0
    with torch.no_grad():
        for at in range(1, len(ids) - 1):  # <cls> and <eos> are not scored
            masked = ids.clone()
            masked[at] = tokenizer.mask_token_id
            total += model(masked[None]).logits[0, at].double().log_softmax(-1)[ids[at]].item()
    return total


def test_a_model_on_two_devices_runs_an_engine_on_each_and_one_job_is_cut_over_both(two_copies: ServeProcess, esm_path: Path) -> None:
    import random

    url = two_copies.url
    found = copies(two_copies)
    assert [(e["copy"], e["device"], e["state"]) for e in found] == [(0, "cpu", "ready"), (1, "cpu", "ready")]
    assert len({e["pid"] for e in found}) == 2 and all(parent_of(e["pid"]) == two_copies.proc.pid for e in found)
    (model,) = httpx.get(f"{url}/models", timeout=10).json()["models"]
    assert model["device"] == "cpu,cpu"

    rng = random.Random(0)
    sequences = ["".join(rng.choice("LAGVSERTIDPKQNFYMHWC") for _ in range(rng.randint(3, 60))) for _ in range(70)]
    alone = make_server(esm_path)  # one device, on a thread: the job uncut
    try:
        for tool, params, unit, total in [
            ("embed", {"texts": sequences, "pooling": "per_token"}, "texts", len(sequences)),
            ("pseudo_loglikelihood", {"sequences": sequences[:12], "per_position": True}, "positions",
             sum(len(s) for s in sequences[:12])),
            ("fill_mask", {"texts": [s[:2] + "<mask>" + s[3:] for s in sequences[:20]], "top_k": 3}, "texts", 20),
        ]:
            before = [e["batches"] for e in copies(two_copies)]
            cut = run_stream(url, tool, params)
            uncut = run_stream(alone.url, tool, params).terminal["data"]
            assert cut.terminal["event"] == "data", cut.events[-3:]
            assert [e["event"] for e in cut.events].count("data") == 1
            got = cut.terminal["data"]
            # Each input's result in the order sent; only padding (which inputs share a pass) may move the last bits.
            assert got.keys() == uncut.keys()
            for key in got:
                if key == "fills":  # per text, per mask, the top tokens: each probability as the numbers below
                    probs = [[[p.pop("prob") for fill in text for p in fill["predictions"]] for text in fills] for fills in (got[key], uncut[key])]
                    assert (torch_flat(probs[0]) - torch_flat(probs[1])).abs().max() <= 1e-4
                if key in ("embeddings", "per_position", "pll"):
                    flat = lambda v: torch_flat(v)  # noqa: E731
                    assert flat(got[key]).shape == flat(uncut[key]).shape
                    assert (flat(got[key]) - flat(uncut[key])).abs().max() <= 1e-4, key
                else:
                    assert got[key] == uncut[key], key
            frames = [e["data"]["progress"] for e in cut.of("status") if "progress" in e["data"]]
            assert frames[-1] == {"done": total, "total": total, "unit": unit}
            assert [f["done"] for f in frames] == sorted(f["done"] for f in frames)
            # Both engines ran a part of it.
            wait_until(
                lambda: all(e["batches"] > b for e, b in zip(copies(two_copies), before)), timeout=10, what="both engines' steps"
            )
        # And the numbers are the model's: an independent computation of two sequences' scores.
        scored = result_of(url, "pseudo_loglikelihood", {"sequences": sequences[:2]})
        for sequence, pll in zip(sequences[:2], scored["pll"]):
            assert abs(pll - pll_of(esm_path, sequence)) <= 1e-4
    finally:
        alone.stop()


def torch_flat(value: Any) -> Any:
    import torch

    def walk(v: Any) -> list[float]:
        return [x for item in v for x in walk(item)] if isinstance(v, list) else [float(v)]

    return torch.tensor(walk(value), dtype=torch.float64)


def result_of(url: str, tool: str, params: dict[str, Any]) -> Any:
    done = run_stream(url, tool, params)
    assert done.terminal["event"] == "data", done.events[-3:]
    return done.terminal["data"]


def test_a_cut_job_puts_its_parts_back_in_order_and_ends_once_when_a_part_fails(two_copies: ServeProcess) -> None:
    url = two_copies.url
    pids = {e["pid"] for e in copies(two_copies)}
    texts = [f"t{i}" * (i % 7 + 1) for i in range(30)]
    got = result_of(url, "lengths", {"texts": texts})
    assert got["lengths"] == [len(t) for t in texts] and got["unit"] == "characters"
    assert set(got["pids"]) == pids  # measured in both engines

    failed = run_stream(url, "lengths", {"texts": [*texts, "boom"]})
    assert [e["event"] for e in failed.events].count("error") == 1 and failed.of("data") == []
    assert failed.terminal["data"]["error"]["code"] == "tool_error" and "boom" in failed.terminal["data"]["error"]["message"]
    # The other part ended too: nothing is left in either engine, and both serve the next job.
    wait_until(lambda: all(e["jobs"] == 0 for e in copies(two_copies)), timeout=10, what="the engines to be empty")
    assert result_of(url, "lengths", {"texts": texts}) == got | {"pids": result_of(url, "lengths", {"texts": texts})["pids"]}
    # A refusal that only the engine can make (a text past the context) reads as for the job uncut, index and all.
    refused = httpx.post(f"{url}/embed/run", json={"texts": ["MKT", "A" * 2000]}, timeout=30)
    assert refused.status_code == 413 and refused.json()["error"]["field"] == "texts[1]", refused.text


def test_a_cut_job_cancelled_ends_once_and_stops_every_part(two_copies: ServeProcess, tmp_path: Path) -> None:
    url = two_copies.url
    trace = tmp_path / "chunks"
    # 20 slow texts a part: 5 chunks of 4, 2 s each, were it not cancelled.
    job = follow(url, "lengths", {"texts": ["slow"] * 40, "trace": str(trace)})
    # The follower's own thread records the stream's events: its first may come after the engines run.
    wait_until(lambda: job.events and all(e["running"] == 1 for e in copies(two_copies)), timeout=60, what="a part running on each engine")
    # Its parts' price is the job's: its result's room is held while it runs, as any job's.
    assert value(scrape(url), "streamgate_result_spool_promised_bytes") > 0
    job_id = job.events[0]["id"].split(":")[0]
    assert httpx.delete(f"{url}/jobs/{job_id}", timeout=10).json()["cancelled"] is True
    assert job.ended()["data"]["error"]["code"] == "cancelled"
    wait_until(lambda: all(e["running"] == 0 and e["jobs"] == 0 for e in copies(two_copies)), timeout=60, what="both parts to stop")
    assert value(scrape(url), "streamgate_result_spool_promised_bytes") == 0
    ran = trace.read_text().split() if trace.exists() else []
    assert len(ran) < 10, ran  # the parts stopped before their last chunks


def test_with_every_engine_busy_a_job_goes_whole_to_the_one_with_the_fewest_waiting(two_copies: ServeProcess) -> None:
    url = two_copies.url
    blockers = [follow(url, "nap", {"seconds": 60, "tag": f"b{i}"}) for i in range(2)]
    wait_until(lambda: all("running" in b.statuses() for b in blockers), timeout=60, what="a nap on each engine")
    assert sorted(e["jobs"] for e in copies(two_copies)) == [1, 1]  # one each: the least loaded took the second
    first = follow(url, "lengths", {"texts": ["a", "bb", "ccc"]})
    wait_until(lambda: "queued" in first.statuses(), timeout=60, what="the job to queue")
    second = follow(url, "lengths", {"texts": ["dddd", "e"]})
    wait_until(lambda: "queued" in second.statuses(), timeout=60, what="the next to queue")
    assert sorted(e["jobs"] for e in copies(two_copies)) == [2, 2]  # the next went where none waited
    for blocker in blockers:
        httpx.delete(f"{url}/jobs/{blocker.events[0]['id'].split(':')[0]}", timeout=10).raise_for_status()
        assert blocker.ended()["data"]["error"]["code"] == "cancelled"
    one, two = first.ended()["data"], second.ended()["data"]
    assert one["lengths"] == [1, 2, 3] and two["lengths"] == [4, 1]
    assert len(set(one["pids"])) == 1 and len(set(two["pids"])) == 1 and one["pids"][0] != two["pids"][0]


def test_one_long_sequence_is_cut_over_both_engines_by_its_windows_with_the_one_engine_numbers(
    two_copies: ServeProcess, esm_path: Path
) -> None:
    """One protein of 1,000 residues in windows of 100: each engine computes one run of consecutive
    windows (`part`), and the gateway puts them back in order. Per residue the states equal the same
    windows run here in transformers (1e-5); the answer is the one-engine job's, plan and context
    exactly; the pooled mean is the stitched states' mean; the score is the one engine's sum."""
    import numpy as np

    from tests.test_windows import protein, windowed_states

    sequence = protein(1000, seed=7)
    windowed = {"window": 100, "overlap": 30}
    alone = make_server(esm_path)  # one device, on a thread: the job uncut
    try:
        for tool, params in [
            ("embed", {"texts": [sequence], "pooling": "per_token", **windowed}),
            ("embed", {"texts": [sequence], "pooling": "mean", "stitch": "mean", **windowed}),
            ("embed", {"texts": [sequence], "pooling": "last", "stitch": "left", **windowed}),
            ("pseudo_loglikelihood", {"sequences": [sequence[:300]], "per_position": True, "window": 60, "overlap": 20}),
        ]:
            before = [e["batches"] for e in copies(two_copies)]
            cut = run_stream(two_copies.url, tool, params)
            assert cut.terminal is not None and cut.terminal["event"] == "data", cut.events[-3:]
            assert [e["event"] for e in cut.events].count("data") == 1
            got, uncut = cut.terminal["data"], result_of(alone.url, tool, params)
            assert got.keys() == uncut.keys(), (got.keys(), uncut.keys())
            for key in got:
                if key in ("embeddings", "per_position", "pll"):
                    # Which windows share a pass may move the last bits, as with batching.
                    assert (torch_flat(got[key]) - torch_flat(uncut[key])).abs().max() <= 1e-5, (tool, params, key)
                else:
                    assert got[key] == uncut[key], (tool, params, key)
            frames = [e["data"]["progress"] for e in cut.of("status") if "progress" in e["data"]]
            assert frames[-1]["done"] == frames[-1]["total"] and [f["done"] for f in frames] == sorted(f["done"] for f in frames)
            wait_until(
                lambda: all(e["batches"] > b for e, b in zip(copies(two_copies), before)), timeout=10, what="both engines' steps"
            )
            if params.get("pooling") == "per_token":
                want = windowed_states(esm_path, sequence, 100, 30, "center")
                assert np.abs(np.array(got["embeddings"][0]) - want).max() <= 1e-5
                assert "".join(got["tokens"][0]) == sequence and len(got["context"][0]) == 1000
            if params.get("stitch") == "mean":  # the parts' sums over the whole length
                want = windowed_states(esm_path, sequence, 100, 30, "mean").mean(0)
                assert np.abs(np.array(got["embeddings"][0]) - want).max() <= 1e-5

        # A client's own part is the part it asked for, not cut again.
        mine = {"texts": [sequence], "pooling": "per_token", "part": [1, 3], **windowed}
        got = result_of(two_copies.url, "embed", mine)
        assert got["span"] == result_of(alone.url, "embed", mine)["span"] and got["span"][0][0] > 0
        # A sequence of one window runs whole, on one engine.
        before = [e["batches"] for e in copies(two_copies)]
        short = result_of(two_copies.url, "embed", {"texts": [sequence[:90]], "pooling": "mean", **windowed})
        assert short["plans"][0]["windows"] == [[0, 90]]
        wait_until(lambda: sum(e["batches"] > b for e, b in zip(copies(two_copies), before)) == 1, timeout=10, what="one engine's step")
        assert sorted(e["batches"] - b for e, b in zip(copies(two_copies), before))[0] == 0
    finally:
        alone.stop()


def test_a_job_that_streams_its_windows_is_not_cut_and_each_texts_rows_come_in_order(two_copies: ServeProcess) -> None:
    """Cut over engines, a job's parts would number their texts from 0: a job with `partials` runs whole."""
    from tests.test_windows import protein

    texts = [protein(300, seed=1), protein(260, seed=2), protein(90, seed=3)]
    done = run_stream(two_copies.url, "embed", {"texts": texts, "window": 100, "overlap": 20, "pooling": "per_token", "partials": True})
    assert done.terminal is not None and done.terminal["event"] == "data", done.events[-3:]
    result = done.terminal["data"]
    parts = [e["data"] for e in done.of("partial")]
    for i, text in enumerate(texts):
        mine = [p for p in parts if p["text"] == i]
        assert [p["start"] for p in mine] == [0, *(p["end"] for p in mine[:-1])] and mine[-1]["end"] == len(text)
        assert [row for p in mine for row in p["embeddings"]] == result["embeddings"][i]
        assert [t for p in mine for t in p["tokens"]] == result["tokens"][i]


def test_a_killed_copy_leaves_the_models_other_copy_serving(two_copies: ServeProcess) -> None:
    url = two_copies.url
    first, second = copies(two_copies)
    os.kill(first["pid"], signal.SIGKILL)
    wait_until(lambda: copies(two_copies)[0]["state"] != "ready", timeout=30, what="the copy to be seen gone")
    # While it restarts, the model's jobs go to its other copy.
    got = result_of(url, "lengths", {"texts": ["abc", "de"]})
    assert got["pids"] == [second["pid"]] * 2
    wait_until(lambda: copies(two_copies)[0]["state"] == "ready", timeout=120, what="the copy's new engine")
    after = copies(two_copies)
    assert after[0]["restarts"] == 1 and after[0]["pid"] != first["pid"]
    assert after[1]["restarts"] == 0 and after[1]["pid"] == second["pid"]


def test_a_model_on_an_inference_server_is_told_apart_by_its_source(tiny_model_path: Path) -> None:
    """Without starting anything: `vllm:` takes what a model here takes (the bundled GGUF included),
    `openai+` a server's base URL and needs a name; neither runs on a gateway's own threads."""
    from backends.local import LocalBackend
    from gateway.tools import builtin_tools, collect

    on_vllm, fronted, here = models.specs(
        [f"vllm:{tiny_model_path}", "base=openai+http://127.0.0.1:9/v1", f"here={tiny_model_path}"]
    )
    assert (on_vllm.name, on_vllm.source, on_vllm.server) == (tiny_model_path.name, str(tiny_model_path), "vllm")
    assert (fronted.name, fronted.source, fronted.server) == ("base", "http://127.0.0.1:9/v1", "openai")
    assert here.server is None
    (default,) = models.specs(["smol=vllm:"])
    assert default.server == "vllm" and default.gguf is not None and default.name == "smol"
    # The bundled model by its name, to serve it here beside a baseline on a server.
    candidate, baseline = models.specs([f"candidate={models.DEFAULT_MODEL}", f"baseline=vllm:{models.DEFAULT_MODEL}"])
    assert candidate.gguf == baseline.gguf == default.gguf and (candidate.server, baseline.server) == (None, "vllm")
    with pytest.raises(models.ModelError, match="name the model it serves here"):
        models.specs(["openai+http://127.0.0.1:9/v1"])
    with pytest.raises(models.ModelError, match="expected openai"):
        models.specs(["x=openai+ftp://host/v1"])
    with pytest.raises(ValueError, match="need --engine process"):
        LocalBackend(collect(builtin_tools()), Settings(model=["base=openai+http://127.0.0.1:9/v1"], device="cpu"))
