"""Cancellation and the queue, on real servers: a client that goes away stops its job.

- A client that disconnects mid-`generate` frees the worker within a token step,
  and the next job runs.
- A queued job whose client disconnects leaves the queue and never runs; the
  jobs behind it move up.
- Queued jobs are told their position, and told again each time it changes.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from gateway.tools import Context, Model, tool
from tests.conftest import track_jobs, wait_until, open_stream, parse_sse, run_stream

# -- a tool the test opens and closes like a gate ------------------------------------------

GATES: dict[str, threading.Event] = {}
STARTED: list[str] = []  # ids of the `hold` jobs whose run function began


class HoldParams(msgspec.Struct):
    gate: str
    timeout_s: float = 30.0


class HoldResult(msgspec.Struct):
    job_id: str


@tool
def hold(model: Model, params: HoldParams, ctx: Context) -> HoldResult:
    """Wait until the test opens the named gate; stop at once if cancelled."""
    STARTED.append(ctx.job_id)
    gate = GATES[params.gate]
    deadline = time.monotonic() + params.timeout_s
    while not gate.wait(0.01):
        ctx.raise_if_cancelled()
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {params.gate} never opened")
    return HoldResult(ctx.job_id)


def new_gate() -> str:
    name = uuid.uuid4().hex
    GATES[name] = threading.Event()
    return name


# -- helpers ---------------------------------------------------------------------------------




def complete_events(raw: bytes) -> list[dict[str, Any]]:
    """The events of the complete frames received so far."""
    return parse_sse(raw[: raw.rfind(b"\n\n") + 2])


def terminal_of(job: Any) -> tuple[str, Any]:
    assert job.terminal is not None and job.terminal is job.events[-1]
    return job.terminal.type.value, json.loads(job.terminal.data)


def statuses(events: list[dict[str, Any]], status: str | None = None) -> list[dict[str, Any]]:
    found = [e["data"] for e in events if e["event"] == "status"]
    return [s for s in found if status is None or s["status"] == status]


class Follower:
    """One client following one run, on a thread of its own; `disconnect()` drops the connection."""

    def __init__(self, url: str, tool_name: str, params: Any) -> None:
        self.raw = b""
        self.job_id: str | None = None
        self.finished = False
        self._sock: socket.socket | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._follow, args=(url, tool_name, params), daemon=True)
        self._thread.start()
        self.wait_for(lambda: self.job_id is not None, "the response headers")

    def _follow(self, url: str, tool_name: str, params: Any) -> None:
        try:
            with httpx.Client(timeout=60) as client:
                with client.stream("POST", f"{url}/{tool_name}/run", json=params) as response:
                    assert response.status_code == 200, response.read()
                    stream = response.extensions["network_stream"]
                    with self._cond:
                        self._sock = stream.get_extra_info("socket")
                        self.job_id = response.headers["x-job-id"]
                        self._cond.notify_all()
                    for chunk in response.iter_raw():
                        with self._cond:
                            self.raw += chunk
                            self._cond.notify_all()
        except httpx.HTTPError:
            pass  # the connection was dropped on purpose
        finally:
            with self._cond:
                self.finished = True
                self._cond.notify_all()

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._cond:
            return complete_events(self.raw)

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout: float = 30) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: predicate() or self.finished, timeout) or not predicate():
                raise AssertionError(f"timed out waiting for {what}; got {self.raw[-500:]!r}")

    def wait_event(self, check: Callable[[dict[str, Any]], bool], what: str, timeout: float = 30) -> None:
        self.wait_for(lambda: any(check(e) for e in complete_events(self.raw)), what, timeout)

    def wait_done(self, timeout: float = 30) -> list[dict[str, Any]]:
        self._thread.join(timeout)
        assert self.finished, "the stream did not end"
        return self.events

    def disconnect(self) -> None:
        assert self._sock is not None
        self._sock.shutdown(socket.SHUT_RDWR)  # the server sees the connection close
        self._thread.join(10)
        assert self.finished


def is_queued(position: int) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "status" and e["data"].get("position") == position


def is_running(e: dict[str, Any]) -> bool:
    return e["event"] == "status" and e["data"]["status"] == "RUNNING"


# -- the tests -------------------------------------------------------------------------------


def test_disconnect_mid_generate_frees_the_worker_within_a_token_step(serve: Any) -> None:
    server = serve()
    jobs = track_jobs(server)
    backend = server.backend
    forwards = [0]

    def slow_forward(module: Any, args: Any) -> None:
        forwards[0] += 1
        time.sleep(0.02)

    cancels: list[tuple[str, int]] = []  # (job id, forward passes so far) when the server cancels
    cancel = backend.cancel

    def recording_cancel(job: Any) -> None:
        cancels.append((job.id, forwards[0]))
        cancel(job)

    backend.cancel = recording_cancel
    handle = backend.model.module.register_forward_pre_hook(slow_forward)
    try:
        received = b""
        with open_stream(server.url, "generate", {"prompts": ["Hi"], "max_tokens": 200}) as response:
            assert response.status_code == 200
            job_id = response.headers["x-job-id"]
            for chunk in response.iter_raw():
                received += chunk
                if any(e["event"] == "partial" for e in complete_events(received)):
                    break
        # Leaving the block closed the connection in the middle of the stream.
        assert b"event: data" not in received and b"event: error" not in received

        job = jobs[job_id]
        wait_until(lambda: job.done, 30, "the abandoned job to end")
        kind, data = terminal_of(job)
        assert (kind, data["error"]["code"]) == ("error", "cancelled"), data
        assert [c[0] for c in cancels] == [job_id]
        # The worker stopped at its next step: at most the pass under way when the
        # disconnect was seen, and one more if it came between the check and the pass.
        used = forwards[0]
        assert used - cancels[0][1] <= 2, (used, cancels)
        assert used < 100, used  # of the 200 it was asked for
        wait_until(lambda: not backend.workers[0].busy, 10, "the worker to be free")

        # The worker is free: the next job runs to its result.
        second = run_stream(server.url, "generate", {"prompts": ["Hi"], "max_tokens": 4})
        assert second.status == 200 and second.terminal["event"] == "data"
        assert second.terminal["data"]["usage"]["completion_tokens"] == 4
        assert forwards[0] - used == 4
        assert len(cancels) == 1  # a stream read to its end cancels nothing
    finally:
        handle.remove()
        backend.cancel = cancel


def test_a_queued_job_whose_client_disconnects_leaves_the_queue(serve: Any) -> None:
    server = serve(tools=[hold])
    jobs = track_jobs(server)
    queue = server.backend.queue
    g_run, g_a, g_b = new_gate(), new_gate(), new_gate()
    try:
        running = Follower(server.url, "hold", {"gate": g_run})
        running.wait_event(is_running, "the first job to run")
        a = Follower(server.url, "hold", {"gate": g_a})
        a.wait_event(is_queued(1), "A queued first")
        b = Follower(server.url, "hold", {"gate": g_b})
        b.wait_event(is_queued(2), "B queued second")
        assert len(queue) == 2

        a.disconnect()
        job_a = jobs[a.job_id]
        wait_until(lambda: job_a.done, 10, "A to end")
        assert terminal_of(job_a)[1]["error"]["code"] == "cancelled"
        assert job_a not in queue and len(queue) == 1
        # B moved up.
        b.wait_event(is_queued(1), "B at position 1")
        assert [(s["position"], s["queue_size"]) for s in statuses(b.events, "QUEUED")] == [(2, 2), (1, 1)]

        GATES[g_run].set()
        GATES[g_b].set()
        assert running.wait_done()[-1]["event"] == "data"
        b_events = b.wait_done()
        assert b_events[-1]["event"] == "data"
        assert b_events[-1]["data"] == {"job_id": b.job_id}
    finally:
        for gate in (g_run, g_a, g_b):
            GATES[gate].set()

    # A never ran: its run function never began, and its log has no RUNNING.
    assert a.job_id not in STARTED and b.job_id in STARTED
    assert [s["status"] for s in statuses([
        {"event": e.type.value, "data": json.loads(e.data)} for e in job_a.events
    ])] == ["RECEIVED", "QUEUED"]
    assert not any(is_running(e) for e in a.events)
    assert len(queue) == 0


def test_queued_jobs_see_their_position_then_each_move_up(serve: Any) -> None:
    server = serve(tools=[hold])
    gates = [new_gate() for _ in range(4)]
    try:
        running = Follower(server.url, "hold", {"gate": gates[0]})
        running.wait_event(is_running, "the first job to run")
        waiting: list[Follower] = []
        for position in (1, 2, 3):
            follower = Follower(server.url, "hold", {"gate": gates[position]})
            follower.wait_event(is_queued(position), f"a job queued at {position}")
            waiting.append(follower)
        assert len(server.backend.queue) == 3

        # Each job ahead that starts moves the others up by one.
        for step, gate in enumerate(gates[:3]):
            GATES[gate].set()
            waiting[step].wait_event(is_running, f"job {step + 1} to run")
            for behind, follower in enumerate(waiting[step + 1 :], start=1):
                follower.wait_event(is_queued(behind), f"job {step + behind + 1} at {behind}")
        GATES[gates[3]].set()
        finals = [f.wait_done() for f in (running, *waiting)]
    finally:
        for gate in gates:
            GATES[gate].set()

    assert all(events[-1]["event"] == "data" for events in finals)
    # queue_size is the length of the queue when the frame was sent: n when the n-th
    # job joins, then 3 - k once k jobs have left it.
    sizes = {1: [1], 2: [2, 2], 3: [3, 2, 1]}
    for n, events in enumerate(finals[1:], start=1):
        queued = statuses(events, "QUEUED")
        # Position n when queued, then one frame per move, ending at the front.
        assert [s["position"] for s in queued] == list(range(n, 0, -1)), queued
        assert [s["queue_size"] for s in queued] == sizes[n], queued
        kinds = [s["status"] for s in statuses(events)]
        assert kinds == ["RECEIVED"] + ["QUEUED"] * n + ["RUNNING"], kinds
    # Once a job has finished, QUEUED frames carry an estimate, later positions later.
    third = statuses(finals[3], "QUEUED")
    assert "eta_s" not in third[0]  # nothing had finished when it was queued
    assert third[1]["eta_s"] >= statuses(finals[2], "QUEUED")[1]["eta_s"] >= 0
    assert len(server.backend.queue) == 0
