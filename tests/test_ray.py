"""`--backend ray`: a real local Ray instance, a Serve application of two replicas on the tiny model.

One Ray instance and one application for the module (starting them takes tens of
seconds); a gateway with the local backend beside it for the streams to equal. The
replicas export their spans to a collector the module holds (tests/support/traces.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray  # the ray extra is part of `make test`'s install: these tests never skip
from ray import serve

from backends.ray_serve import APP_NAME, NAMESPACE, RayBackend
from gateway.server.app import create_app
from gateway.config import Settings
from tests.conftest import USER_TOOLS, Server, make_server, run_stream, wait_until
from tests.support.processes import ROOT, clean_env, free_port, start_serve
from tests.support.redis_server import redis_server  # noqa: F401
from tests.test_redis_replicas import Follower, check_log, events_of, read_some
from tests.test_observability import scrape, value
from tests.test_tools import Reference, result
from tests.support import traces
from tests.test_tracing import GENERATE, collector, the_run_there  # noqa: F401  (collector: a fixture)

pytestmark = pytest.mark.ray

REPLICAS = 2


@pytest.fixture(scope="module")
def other_model_path(tiny: Callable[..., Path]) -> Path:
    """A second model every replica serves beside the tiny one."""
    return tiny("gpt2", seed=1, init=0.2)


@pytest.fixture(scope="module")
def ray_gateway(tiny_model_path: Path, other_model_path: Path, collector: traces.Collector) -> Iterator[Server]:
    # Ray's processes, the replicas among them, have the environment it was started in: the
    # replicas trace as these variables say, and this process goes on without them. Only they are
    # put back: what ray.init sets (the cluster's auth token) is for the gateways started later.
    tracing = collector.env("replica")
    saved = {name: os.environ.get(name) for name in tracing}
    os.environ.update(tracing)
    try:
        ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    settings = Settings(
        model=[str(tiny_model_path), f"other={other_model_path}"], backend="ray", ray_replicas=REPLICAS, ray_cpus_per_replica=0.5,
        tools=[USER_TOOLS], detach_grace=0,
    )
    server = Server(create_app(RayBackend(settings), settings), kind="ray").start()
    try:
        yield server.wait_ready(timeout=240)
    finally:
        server.stop()
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def local_gateway(tiny_model_path: Path) -> Iterator[Server]:
    from gateway.tools import load_module

    server = make_server(tiny_model_path, tools=load_module(USER_TOOLS))
    yield server
    server.stop()


def comparable(events: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """A stream as a client compares two: event types and payloads, less ids, times and DISPATCHED."""
    kept = []
    for event in events:
        data = dict(event["data"])
        if data.get("status") == "DISPATCHED":
            continue
        for key in ("job_id", "seq", "ts", "eta_s"):
            data.pop(key, None)
        kept.append((event["event"], data))
    return kept


def replica_stats() -> list[dict[str, Any]]:
    """Every replica's jobs in flight, asked of each (calls are routed at random: ask until both answered)."""
    handle = serve.get_app_handle(APP_NAME)
    seen: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + 30
    while len(seen) < REPLICAS and time.monotonic() < deadline:
        stats = handle.stats.remote().result(timeout_s=30)
        seen[stats["replica"]] = stats
    return list(seen.values())


@pytest.mark.parametrize(
    ("tool", "params"),
    [
        ("generate", {"prompts": ["hello there", "a b"], "max_tokens": 6}),
        ("predict", {"prompt": "hello world", "top_k": 3}),
        ("echo", {"text": "ab", "repeat": 3}),
        # Sequences over the context (256), in windows: one plan, the same numbers on a replica.
        ("embed", {"texts": ["the quick brown fox " * 40], "window": 100, "overlap": 20, "pooling": "per_token"}),
        ("logprobs", {"prompts": ["jumps over the lazy dog " * 30], "window": 120, "overlap": 30}),
    ],
)
def test_the_stream_equals_the_local_backends(ray_gateway: Server, local_gateway: Server, tool: str, params: Any) -> None:
    on_ray = run_stream(ray_gateway.url, tool, params)
    local = run_stream(local_gateway.url, tool, params)
    assert on_ray.status == local.status == 200, on_ray.raw
    assert comparable(on_ray.events) == comparable(local.events)
    dispatched = [e for e in on_ray.events if e["data"].get("status") == "DISPATCHED"]
    assert len(dispatched) == 1 and dispatched[0]["data"]["message"].startswith("replica ")
    # The result, byte for byte: the data event's JSON.
    def result(raw: bytes) -> bytes:
        return raw.split(b"event: data\ndata: ", 1)[1].split(b"\n", 1)[0]

    assert result(on_ray.raw) == result(local.raw)


def test_a_job_on_a_replica_is_one_trace_with_the_gateways(ray_gateway: Server, collector: traces.Collector) -> None:
    with traces.recording("gateway") as exporter:
        stream = run_stream(ray_gateway.url, "generate", GENERATE)
        assert stream.terminal["event"] == "data", stream.raw
        job_id = stream.headers["x-job-id"]
        wait_until(lambda: traces.named(traces.recorded(exporter), "job"), what="the gateway's job span")
        here = traces.recorded(exporter)
    job = traces.one(here, "job", **{"streamgate.job.id": job_id})
    assert job.status == "OK"
    # The replica's spans reach the collector from its own process, in the trace the call's traceparent named.
    there = collector.wait_for(lambda spans: traces.named(spans, "job", **{"streamgate.job.id": job_id}))
    the_run_there(there, job, job_id)
    assert {s.service for s in there if s.trace_id == job.trace_id} == {"replica"}


def test_a_refusal_is_answered_before_any_stream(ray_gateway: Server, local_gateway: Server) -> None:
    too_long = run_stream(ray_gateway.url, "generate", {"prompts": ["x " * 5000], "max_tokens": 4})
    assert too_long.status == 413 and too_long.body["error"]["code"] == "too_long"
    unknown = run_stream(ray_gateway.url, "predict", {"promt": "x"})
    assert unknown.status == 422 and unknown.body["error"]["field"] == "promt"
    # The replica decodes the params as sent, the GET form's pairs too: a local gateway's refusals.
    for method, path, kwargs in [
        ("POST", "/predict/run", {"content": b"[1]"}),
        ("POST", "/predict/run", {"json": {"prompt": "a", "top_k": 0}}),
        ("POST", "/echo/run", {"json": {"txt": "a"}}),
        ("GET", "/predict/run", {"params": [("prompt", "a"), ("top_k", "x")]}),
        ("GET", "/predict/run", {"params": [("params", json.dumps({"prompt": "a", "top_k": 0}))]}),
        ("GET", "/echo/run", {"params": [("text", "a"), ("repaet", "2")]}),
    ]:
        local = httpx.request(method, local_gateway.url + path, timeout=60, **kwargs)
        on_ray = httpx.request(method, ray_gateway.url + path, timeout=60, **kwargs)
        assert 400 <= local.status_code < 500, local.text
        assert (on_ray.status_code, on_ray.json()) == (local.status_code, local.json()), (method, path, kwargs)


def test_jobs_spread_over_both_replicas(ray_gateway: Server) -> None:
    replicas: set[str] = set()

    def one() -> None:
        stream = run_stream(ray_gateway.url, "echo", {"text": "a", "repeat": 10, "delay": 0.1})
        assert stream.terminal["event"] == "data"
        replicas.update(e["data"]["message"] for e in stream.events if e["data"].get("status") == "DISPATCHED")

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(replicas) == REPLICAS, replicas


def test_batching_happens_inside_a_replica_and_metrics_show_each(ray_gateway: Server) -> None:
    def one(i: int) -> None:
        stream = run_stream(ray_gateway.url, "predict", {"prompt": f"batch {i} " * 8, "top_k": 2})
        assert stream.terminal["event"] == "data"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    def batched() -> bool:
        samples = scrape(ray_gateway.url)
        # Steps of at most one job are the le=1 bucket: any step beyond it batched several.
        return value(samples, "streamgate_batch_size_count") > value(samples, "streamgate_batch_size_bucket", le="1.0")

    wait_until(batched, timeout=15, what="a batch of more than one job in the replicas' histogram")
    replicas = {labels for (name, labels) in scrape(ray_gateway.url) if name == "streamgate_replica_jobs"}
    assert len(replicas) == REPLICAS


def test_cancel_stops_the_work_on_the_replica(ray_gateway: Server) -> None:
    with httpx.Client(timeout=60) as client, client.stream(
        "POST", f"{ray_gateway.url}/echo/run", json={"text": "a", "repeat": 400, "delay": 0.05}
    ) as response:
        job_id = response.headers["x-job-id"]
        wait_until(lambda: any(s["jobs"] for s in replica_stats()), timeout=30, what="the job to run on a replica")
        assert client.delete(f"{ray_gateway.url}/jobs/{job_id}").json()["cancelled"] is True
        raw = response.read()
    assert b'"code":"cancelled"' in raw
    wait_until(lambda: not any(s["jobs"] for s in replica_stats()), timeout=30, what="the replica to stop the work")


def test_a_client_that_leaves_stops_the_work(ray_gateway: Server) -> None:
    with httpx.Client(timeout=60) as client, client.stream(
        "POST", f"{ray_gateway.url}/echo/run", json={"text": "a", "repeat": 400, "delay": 0.05}
    ) as response:
        for _ in response.iter_raw():
            if any(s["jobs"] for s in replica_stats()):
                break
    wait_until(lambda: not any(s["jobs"] for s in replica_stats()), timeout=30, what="the replica to stop the work")


def test_a_replica_that_dies_ends_its_jobs_and_is_replaced(ray_gateway: Server) -> None:
    with httpx.Client(timeout=120) as client, client.stream(
        "POST", f"{ray_gateway.url}/echo/run", json={"text": "a", "repeat": 400, "delay": 0.05}
    ) as response:
        raw = b""
        chunks = response.iter_raw()
        for chunk in chunks:
            raw += chunk
            if b"DISPATCHED" in raw and b'"progress"' in raw:
                break
        replica = raw.split(b'"message":"replica ', 1)[1].split(b'"', 1)[0].decode()
        actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if replica in a["name"]]
        assert len(actors) == 1, actors
        ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=True)
        raw += b"".join(chunks)
    events = [e for e in raw.split(b"\n\n") if b"event: error" in e or b"event: data" in e]
    assert len(events) == 1 and b'"code":"backend_unavailable"' in events[0] and b'"retryable":true' in events[0]
    # Later jobs succeed on the live replica and, once Serve has replaced it, on the new one.
    for _ in range(4):
        assert run_stream(ray_gateway.url, "echo", {"text": "z"}).terminal["event"] == "data"
    wait_until(lambda: httpx.get(f"{ray_gateway.url}/readyz").json()["replicas"] == {"RUNNING": REPLICAS},
               timeout=120, what="Serve to replace the replica")


def test_jobs_go_to_the_model_they_name_on_every_replica(ray_gateway: Server, other_model_path: Path, tiny_model_path: Path) -> None:
    listed = httpx.get(ray_gateway.url + "/models").json()
    assert listed["default"] == tiny_model_path.name
    assert [(m["name"], m["kind"], m["ready"]) for m in listed["models"]] == [
        (tiny_model_path.name, "causal_lm", True), ("other", "causal_lm", True),
    ]
    params = {"prompts": ["Hello", "a"], "continuations": [" there", "bc"]}
    for name, path in ((tiny_model_path.name, tiny_model_path), ("other", other_model_path)):
        ref = Reference(path)
        for _ in range(REPLICAS):  # whichever replica takes it
            got = result(ray_gateway.url, "loglikelihood", {**params, "model": name})["ll"]
            assert got == pytest.approx([ref.loglikelihood(p, c)[0] for p, c in zip(params["prompts"], params["continuations"])], abs=1e-4)
    unknown = httpx.post(ray_gateway.url + "/predict/run", json={"prompt": "a", "model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_model"


def test_gateways_on_redis_share_jobs_that_run_on_ray(ray_gateway: Server, tiny_model_path: Path, redis_server: Any) -> None:
    """Two gateways on one Redis, both attached to the running application: a job started through
    one is resumed through the other, every event once."""
    settings = Settings(model=[str(tiny_model_path)], backend="ray", store=redis_server.url, detach_grace=30)
    a, b = (Server(create_app(RayBackend(settings), settings), kind="ray").start() for _ in range(2))
    try:
        a.wait_ready(timeout=120)
        b.wait_ready(timeout=120)
        headers, first = read_some(a.url, "/echo/run", 4, method="POST", json={"text": "ab", "repeat": 20, "delay": 0.05})
        status, _, rest = events_of(b.url, headers["x-job-id"], first[-1]["id"])
        assert status == 200
        check_log(first + rest, headers["x-job-id"])
        assert rest[-1]["event"] == "data" and rest[-1]["data"]["text"] == "ab" * 20
    finally:
        a.stop()
        b.stop()


def test_a_ray_gateway_drains_on_sigterm(ray_gateway: Server, tiny_model_path: Path, tmp_path: Path) -> None:
    """A `streamgate serve` process joins the cluster and attaches to the running application; on
    SIGTERM its job in flight finishes (Ray's own SIGTERM handling would abort it in 3 s)."""
    port = free_port()
    args = ["--backend", "ray", "--ray-address", ray.get_runtime_context().gcs_address, "--model", str(tiny_model_path),
            "--tools", USER_TOOLS, "--port", str(port), "--log-level", "warning"]
    gateway = start_serve(args, clean_env(), port, tmp_path / "gateway.log")
    try:
        client = Follower(gateway.url, "/echo/run", method="POST", json={"text": "a", "repeat": 50, "delay": 0.1})
        wait_until(lambda: b'"progress"' in client.raw, timeout=60, what="the job to run")
        gateway.proc.send_signal(signal.SIGTERM)
        events = client.join(timeout=60)
        assert events[-1]["event"] == "data" and events[-1]["data"]["text"] == "a" * 50
        assert gateway.proc.wait(timeout=60) == 0, gateway.output()[-3000:]
    finally:
        gateway.stop()


def test_without_ray_the_backend_says_what_to_install(tmp_path: Path) -> None:
    blocked = "import sys; sys.modules['ray'] = None; from gateway.cli.commands import main; main()"
    result = subprocess.run(
        [sys.executable, "-c", blocked, "serve", "--backend", "ray", "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert "pip install 'streamgate[ray]'" in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1, result.stderr
    checked = subprocess.run(
        [sys.executable, "-c", "from gateway.cli.commands import main; main()", "serve", "--backend", "ray", "--ray-replicas", "2", "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert checked.returncode == 0 and "backend: ray" in checked.stdout and "2 replicas" in checked.stdout
    client = subprocess.run(
        [sys.executable, "-c", "from gateway.cli.commands import main; main()", "serve", "--backend", "ray",
         "--ray-address", "ray://head:10001", "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert client.returncode == 2 and "Ray Client" in client.stderr and "--ray-address auto" in client.stderr

