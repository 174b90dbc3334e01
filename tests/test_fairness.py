"""Fairness between tenants: one client's flood does not hold back another's job.

- The queue serves tenants in turn, in proportion to their tokens' weights, each
  tenant's jobs in the order they came; QUEUED positions are places in that order.
- A worker busy with one tenant's long continuous batch runs another tool's job
  waiting at the head of the queue between two of its steps.
- Past `--max-queued-per-owner` or `--max-streams-per-owner` a tenant gets 429
  `rate_limited` with Retry-After, while another is still admitted.
- Without tokens, each client address is a tenant of its own.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from backends.queue import JobQueue
from gateway.server.auth import AuthConfigError, load_principals
from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.protocol import Code
from gateway.tools import Context, Model, tool
from tests.conftest import parse_sse, track_jobs, wait_until

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef00"

# -- a tool the test opens and closes like a gate ------------------------------------------

GATES: dict[str, threading.Event] = {}


class HoldParams(msgspec.Struct):
    gate: str


class Held(msgspec.Struct):
    gate: str


@tool
def hold(model: Model, params: HoldParams, ctx: Context) -> Held:
    """Wait until the test opens the named gate; stop at once if cancelled."""
    gate = GATES[params.gate]
    while not gate.wait(0.01):
        ctx.raise_if_cancelled()
    return Held(params.gate)


def new_gate() -> str:
    name = uuid.uuid4().hex
    GATES[name] = threading.Event()
    return name


# -- helpers ---------------------------------------------------------------------------------


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(f'[tokens.alice]\ntoken = "{ALICE}"\n\n[tokens.bob]\ntoken = "{BOB}"\nweight = 2\n')
    return path


def client(source: str = "127.0.0.1") -> httpx.Client:
    """A client whose connections come from `source` (any 127.x.y.z reaches a loopback server)."""
    return httpx.Client(timeout=60, transport=httpx.HTTPTransport(local_address=source))


def start_job(url: str, tool_name: str, params: Any, headers: dict[str, str] | None = None, source: str = "127.0.0.1") -> str:
    """Start a job and hang up at once (the detach grace keeps it); its id."""
    with client(source) as c, c.stream("POST", f"{url}/{tool_name}/run", json=params, headers=headers or {}) as response:
        assert response.status_code == 200, response.read()
        return response.headers["x-job-id"]


class Follower:
    """One client following one run to its end, on a thread of its own."""

    def __init__(self, url: str, tool_name: str, params: Any, headers: dict[str, str] | None = None,
                 source: str = "127.0.0.1", on_terminal: Callable[[str], None] | None = None) -> None:
        self.raw = b""
        self.status: int | None = None
        self.job_id: str | None = None
        self._on_terminal = on_terminal
        self._thread = threading.Thread(target=self._follow, args=(url, tool_name, params, headers or {}, source), daemon=True)
        self._thread.start()

    def _follow(self, url: str, tool_name: str, params: Any, headers: dict[str, str], source: str) -> None:
        with client(source) as c, c.stream("POST", f"{url}/{tool_name}/run", json=params, headers=headers) as response:
            self.status, self.job_id = response.status_code, response.headers.get("x-job-id")
            for chunk in response.iter_raw():
                self.raw += chunk
                if self._on_terminal is not None and (b"event: data" in self.raw or b"event: error" in self.raw):
                    self._on_terminal(tool_name)
                    self._on_terminal = None

    def events(self) -> list[dict[str, Any]]:
        return parse_sse(self.raw[: self.raw.rfind(b"\n\n") + 2])

    def done(self, timeout: float = 60) -> list[dict[str, Any]]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"
        return self.events()


def places(job: Job) -> list[tuple[int, int]]:
    """(position, queue_size) of each QUEUED frame the job was sent."""
    frames = [json.loads(e.data) for e in job.events if e.type.value == "status"]
    return [(f["position"], f["queue_size"]) for f in frames if f["status"] == "QUEUED"]


def jobs_of(jobs: dict[str, Job], tenant: str) -> list[Job]:
    return sorted((j for j in jobs.values() if j.tenant == tenant), key=lambda j: j.created)


# -- the order, on the queue alone -------------------------------------------------------------


async def drain(queue: JobQueue) -> list[str]:
    served = []
    while len(queue):
        served.append((await queue.get()).params)
    return served


def queued(queue: JobQueue, tenant: str, name: str, tool_name: str = "t", weight: float = 1.0) -> Job:
    job = Job(tool_name, name, tenant=tenant, weight=weight)
    queue.put(job)
    return job


async def test_tenants_take_turns_and_positions_are_places_in_that_order() -> None:
    queue = JobQueue(100)
    a = [queued(queue, "A", f"a{i}") for i in range(4)]
    assert [j.position for j in a] == [1, 2, 3, 4]
    b0 = queued(queue, "B", "b0")
    # B's first job goes after A's first, not after all four; A's later jobs move back and are told.
    assert b0.position == 2 and [j.position for j in a] == [1, 3, 4, 5]
    assert places(a[0]) == [(1, 1)]  # its place never changed: one frame
    assert places(a[3]) == [(4, 4), (5, 5)]
    b1 = queued(queue, "B", "b1")
    assert b1.position == 4
    order = await drain(queue)
    assert order == ["a0", "b0", "a1", "b1", "a2", "a3"]
    # Each job was last told the place it was served from.
    assert [places(j)[-1][0] for j in (*a, b0, b1)] == [1, 1, 1, 1, 1, 1]


async def test_a_tenant_that_flooded_does_not_keep_its_turns_ahead_of_a_newcomer() -> None:
    queue = JobQueue(100)
    for i in range(10):
        queued(queue, "A", f"a{i}")
    assert await queue.get() is not None  # a0 runs
    late = queued(queue, "C", "c0")
    assert late.position == 1  # ahead of a1..a9, A's later turns
    # A tenant with nothing waiting saves no turns: it joins at the queue's clock.
    await drain(queue)
    queued(queue, "B", "b0")
    queued(queue, "B", "b1")
    queued(queue, "A", "a10")
    assert await drain(queue) == ["b0", "a10", "b1"]


async def test_weights_share_the_turns() -> None:
    queue = JobQueue(100)
    for i in range(6):
        queued(queue, "light", f"l{i}")
        queued(queue, "heavy", f"h{i}", weight=2)
    served = (await drain(queue))[:9]
    assert sum(name.startswith("h") for name in served) == 6 and sum(name.startswith("l") for name in served) == 3


async def test_take_gathers_a_batch_in_fair_order_and_in_turn_stops_at_the_first_it_cannot_take() -> None:
    queue = JobQueue(100)
    for i in range(3):
        queued(queue, "A", f"a{i}", "generate")
    queued(queue, "B", "b0", "predict")
    queued(queue, "C", "c0", "generate")
    # Fair order: a0 b0 c0 a1 a2.
    generate = lambda job: job.tool == "generate"  # noqa: E731
    assert [j.params for j in queue.take(generate, 2)] == ["a0", "c0"]
    assert queue.head is not None and queue.head.params == "b0" and queue.head.position == 1
    assert queue.take(generate, 5, in_turn=True) == []  # b0 keeps its turn
    assert [j.params for j in queue.take(lambda job: True, 1)] == ["b0"]
    assert [j.params for j in queue.take(generate, 5, in_turn=True)] == ["a1", "a2"]


async def test_cancelled_last_jobs_give_their_turns_back() -> None:
    queue = JobQueue(100)
    queued(queue, "A", "a0")
    a1, a2 = queued(queue, "A", "a1"), queued(queue, "A", "a2")
    assert queue.remove(a2) and queue.remove(a1) and a1 not in queue and not queue.remove(a1)
    for i in range(3):
        queued(queue, "B", f"b{i}")
    queued(queue, "A", "a1 again")  # A's second turn, not its fourth
    assert await drain(queue) == ["a0", "b0", "b1", "a1 again", "b2"]


async def test_the_queue_refuses_past_its_size_and_past_a_tenants_share() -> None:
    queue = JobQueue(5, eta=lambda position: 2.5 * position)
    assert queue.per_owner == 3  # half the size, rounded up
    for i in range(3):
        queued(queue, "addr:10.0.0.1", f"a{i}")
    with pytest.raises(ApiError) as refused:
        queued(queue, "addr:10.0.0.1", "a3")
    assert refused.value.code is Code.RATE_LIMITED and refused.value.status == 429
    assert refused.value.retry_after == 2.5  # until its first waiting job starts
    assert "the client 10.0.0.1 has 3 jobs waiting" in refused.value.message
    assert "--max-queued-per-owner" in refused.value.message
    queued(queue, "B", "b0")
    queued(queue, "B", "b1")
    with pytest.raises(ApiError) as full:
        queued(queue, "C", "c0")
    assert full.value.code is Code.QUEUE_FULL


def test_a_tokens_weight_is_read_from_the_tokens_file(tmp_path: Path, tokens_file: Path) -> None:
    weights = {p.name: p.weight for p in load_principals(str(tokens_file))}
    assert weights == {"alice": 1.0, "bob": 2.0}
    bad = tmp_path / "bad.toml"
    for value in ("0", "-1", "true", '"2"', "inf"):
        bad.write_text(f'[tokens.x]\ntoken = "{ALICE}"\nweight = {value}\n')
        with pytest.raises(AuthConfigError, match="weight must be a number > 0"):
            load_principals(str(bad))


# -- end to end ----------------------------------------------------------------------------------


def test_one_job_of_another_token_starts_before_a_flooding_tokens_queued_jobs(serve: Any, tokens_file: Path) -> None:
    server = serve(tools=[hold], tokens_file=str(tokens_file), queue_size=100, detach_grace=30)
    jobs = track_jobs(server)
    first, second, rest = new_gate(), new_gate(), new_gate()
    try:
        start_job(server.url, "hold", {"gate": first}, bearer(ALICE))
        wait_until(lambda: server.backend.workers[0].busy, 10, "alice's first job to run")
        start_job(server.url, "hold", {"gate": second}, bearer(ALICE))
        for _ in range(39):
            start_job(server.url, "hold", {"gate": rest}, bearer(ALICE))
        assert len(server.backend.queue) == 40
        bob = Follower(server.url, "predict", {"prompt": "hello", "top_k": 2}, bearer(BOB))
        wait_until(lambda: len(server.backend.queue) == 41, 10, "bob's job to queue")
        alice = jobs_of(jobs, "alice")
        (bob_job,) = jobs_of(jobs, "bob")
        # Bob's one job waits behind alice's next, not behind all forty; hers behind it moved back.
        assert places(bob_job) == [(2, 41)]
        assert places(alice[2]) == [(2, 2), (3, 41)]
        assert places(alice[40]) == [(40, 40), (41, 41)]

        GATES[first].set()
        GATES[second].set()
        events = bob.done()
        assert events[-1]["event"] == "data"
        # Bob's job ran third: alice's first two ended, her third is at its gate or next, the rest wait.
        assert [j.done for j in alice[:2]] == [True, True]
        assert not any(j.done or j.started for j in alice[3:])
        assert [p for p, _ in places(bob_job)] == [2, 1]
    finally:
        for gate in (first, second, rest):
            GATES[gate].set()


class Turnstile:
    """A forward pre-hook that lets the model run one pass per permit the test gives."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.passed = 0

    def __call__(self, module: Any, args: Any) -> None:
        if not self.permits.acquire(timeout=60):
            raise RuntimeError("the test gave no permit")
        self.passed += 1

    def let(self, n: int) -> None:
        self.permits.release(n)


def test_a_predict_waits_one_step_of_another_tokens_long_generation_not_all_of_it(serve: Any, tokens_file: Path) -> None:
    server = serve(tokens_file=str(tokens_file), detach_grace=30)
    jobs = track_jobs(server)
    turnstile = Turnstile()
    handle = server.backend.model.module.register_forward_pre_hook(turnstile)
    ended: list[str] = []  # terminal events as the clients received them
    seen: dict[str, Any] = {}
    try:
        generation = Follower(
            server.url, "generate", {"prompts": ["Once upon a time"], "max_tokens": 200}, bearer(ALICE),
            on_terminal=ended.append,
        )
        turnstile.let(3)  # its prefill and two tokens; it waits at the third
        wait_until(lambda: turnstile.passed == 3, 20, "alice's generation to be under way")
        predict = Follower(server.url, "predict", {"prompt": "hello", "top_k": 2}, bearer(BOB), on_terminal=ended.append)
        wait_until(lambda: len(server.backend.queue) == 1, 20, "bob's predict to queue")
        # And the running batch asked to pause after its step (the loop sees the arrival first): else the step
        # let through next may be the batch's own.
        wait_until(lambda: any(run.pause for run in server.backend.workers[0]._runs), 20, "the batch to pause for it")
        (bob_job,) = jobs_of(jobs, "bob")
        (alice_job,) = jobs_of(jobs, "alice")
        bob_job.on_end.append(lambda _: seen.update(passes=turnstile.passed, alice_done=alice_job.done))
        # Two passes: the step under way when bob's job queued, then bob's predict, between two steps.
        turnstile.let(2)
        assert predict.done(timeout=20)[-1]["event"] == "data"
        assert seen == {"passes": 5, "alice_done": False}
        assert ended == ["predict"] and not any(e["event"] in ("data", "error") for e in generation.events())
        turnstile.let(1000)
        events = generation.done()
    finally:
        handle.remove()
        turnstile.let(1000)
    assert events[-1]["event"] == "data" and events[-1]["data"]["usage"]["completion_tokens"] == 200
    assert ended == ["predict", "generate"]


def test_past_a_tokens_queued_share_it_gets_429_while_another_token_is_admitted(serve: Any, tokens_file: Path) -> None:
    server = serve(tools=[hold], tokens_file=str(tokens_file), queue_size=10, max_queued_per_owner=2, detach_grace=30)
    gate = new_gate()
    try:
        for _ in range(3):  # one runs, two wait
            start_job(server.url, "hold", {"gate": gate}, bearer(ALICE))
        wait_until(lambda: len(server.backend.queue) == 2, 10, "alice's jobs to queue")
        refused = httpx.post(f"{server.url}/hold/run", json={"gate": gate}, headers=bearer(ALICE), timeout=30)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "rate_limited" and error["retryable"] is True
        assert "the token 'alice' has 2 jobs waiting" in error["message"]
        assert refused.headers["retry-after"].isdigit() and int(refused.headers["retry-after"]) >= 1
        start_job(server.url, "hold", {"gate": gate}, bearer(BOB))
        assert len(server.backend.queue) == 3
    finally:
        GATES[gate].set()


def test_past_a_tokens_stream_share_it_gets_429_while_another_token_is_admitted(serve: Any, tokens_file: Path) -> None:
    server = serve(tools=[hold], tokens_file=str(tokens_file), max_streams_per_owner=2, detach_grace=30)
    gate = new_gate()
    try:
        held = [Follower(server.url, "hold", {"gate": gate}, bearer(ALICE)) for _ in range(2)]
        wait_until(lambda: all(f.events() for f in held), 10, "alice's two streams to open")
        job_id = held[0].job_id
        for refused in (
            httpx.post(f"{server.url}/hold/run", json={"gate": gate}, headers=bearer(ALICE), timeout=30),
            httpx.get(f"{server.url}/jobs/{job_id}/events", headers=bearer(ALICE), timeout=30),
        ):
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["code"] == "rate_limited"
            assert "holds 2 event streams" in error["message"] and "--max-streams-per-owner" in error["message"]
            assert 1 <= int(refused.headers["retry-after"]) <= 5
        bob = Follower(server.url, "hold", {"gate": gate}, bearer(BOB))
        wait_until(lambda: bool(bob.events()), 10, "bob's stream to open")
        assert bob.status == 200
        GATES[gate].set()
        assert all(f.done()[-1]["event"] == "data" for f in (*held, bob))
        # Her streams ended (each frees its slot just after its last write): she may open more.
        again = lambda: httpx.post(f"{server.url}/predict/run", json={"prompt": "x"}, headers=bearer(ALICE), timeout=30)  # noqa: E731
        wait_until(lambda: again().status_code == 200, 10, "alice to be admitted again")
    finally:
        GATES[gate].set()


def test_without_tokens_each_client_address_is_an_owner(serve: Any) -> None:
    server = serve(tools=[hold], queue_size=10, max_queued_per_owner=2, detach_grace=30)
    jobs = track_jobs(server)
    gate = new_gate()
    try:
        for _ in range(3):  # one runs, two wait
            start_job(server.url, "hold", {"gate": gate}, source="127.0.0.1")
        wait_until(lambda: len(server.backend.queue) == 2, 10, "the first client's jobs to queue")
        with client("127.0.0.1") as first:
            refused = first.post(f"{server.url}/hold/run", json={"gate": gate})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"
        assert "the client 127.0.0.1 has 2 jobs waiting" in refused.json()["error"]["message"]
        start_job(server.url, "hold", {"gate": gate}, source="127.0.0.2")
        (other,) = jobs_of(jobs, "addr:127.0.0.2")
        assert [j.tenant for j in jobs.values()].count("addr:127.0.0.1") == 3
        # The second address's job waits behind the first's next job only.
        assert places(other) == [(2, 3)]
    finally:
        GATES[gate].set()


def test_an_executor_takes_turns_between_a_remote_gateways_tokens(serve_any: Any, tokens_file: Path) -> None:
    # The executor is told each job's tenant: its queue takes turns between the gateway's tokens.
    server = serve_any("remote", tokens_file=str(tokens_file), detach_grace=30)
    busy = {"text": "busy", "repeat": 600, "delay": 0.05}  # 30 s unless cancelled
    ids = [start_job(server.url, "echo", busy, bearer(ALICE)) for _ in range(4)]
    try:
        bob = Follower(server.url, "echo", {"text": "bob"}, bearer(BOB))
        wait_until(lambda: any(e["data"].get("status") == "QUEUED" for e in bob.events()), 30, "bob's job to queue")
        queued_frames = [e["data"] for e in bob.events() if e["data"].get("status") == "QUEUED"]
        assert (queued_frames[0]["position"], queued_frames[0]["queue_size"]) == (2, 4)
    finally:
        for job_id in ids:
            httpx.delete(f"{server.url}/jobs/{job_id}", headers=bearer(ALICE), timeout=30)
    assert bob.done()[-1]["data"] == {"text": "bob", "tokens": 4}
