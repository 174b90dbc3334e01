"""Preemption that loses nothing (backends/workers.py, `Preemptible` in gateway/tools/batching.py):
a higher class's `generate` that finds the continuous batch full takes a lower class's member's
place at a step boundary; the member is queued again at the head of its class (its client told
so, with where and why), goes on where it stopped, and completes exactly as it would have alone.

The device is held at a chosen step by the test (a forward hook that waits on an event), so the
higher class's job arrives mid-generation by construction, not by timing."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from backends.queue import JobQueue
from backends.workers import PREEMPTED
from gateway.errors import ApiError
from gateway.jobs import Job
from tests.conftest import CLASSES, LAB, STUDENT, wait_until
from tests.test_fairness import Follower, bearer, places, track_jobs



def statuses(job: Job) -> list[dict[str, Any]]:
    return [json.loads(e.data) for e in job.events if e.type.value == "status"]


async def test_a_job_put_back_goes_first_in_its_class_told_why_and_is_never_refused() -> None:
    queue = JobQueue(2, per_owner=1, min_share=0)
    waiting = [Job("t", "s1", tenant="S"), Job("t", "l1", tenant="L", priority=10)]
    for job in waiting:
        queue.put(job)
    with pytest.raises(ApiError):
        queue.put(Job("t", "s2", tenant="S"))
    back = Job("t", "s0", tenant="S")
    queue.put_back(back, PREEMPTED)  # full, and its tenant at its share: it was admitted before
    again = Job("t", "s-1", tenant="T")
    queue.put_back(again, PREEMPTED)
    # Behind the higher class, ahead of its own class's waiting job; in the order they were put back.
    assert [await queue.get() for _ in range(4)] == [waiting[1], back, again, waiting[0]]
    told = [f for f in statuses(back) if f["status"] == "QUEUED"]
    assert told[0]["message"] == PREEMPTED and told[0]["position"] == 2
    assert "message" not in statuses(waiting[0])[-1]


class Holder:
    """Holds the device's thread in the model's `at`-th forward pass (and each of `then`'s), or in the
    first pass once `hold_when`'s condition holds, until let go (`go`, then `release` for the last)."""

    def __init__(self, module: torch.nn.Module, at: int, *then: int) -> None:
        self.calls, self.points = 0, [at, *then]
        self.when: Callable[[], bool] | None = None
        self.reached = threading.Event()
        self.go = threading.Event()
        self.handle = module.register_forward_pre_hook(self._hook)

    def hold_when(self, condition: Callable[[], bool]) -> None:
        """Hold the first pass (from the device's thread's next one) at which `condition()` is true."""
        self.when = condition

    def _hook(self, *_: Any) -> None:
        self.calls += 1
        due = bool(self.points) and self.calls == self.points[0]
        if due:
            self.points.pop(0)
        elif self.when is not None and self.when():
            self.when, due = None, True
        if due:
            self.go.clear()
            self.reached.set()
            assert self.go.wait(60), "the test did not let the step go on"

    def step_on(self) -> None:
        """Let the held pass go on, to the next hold point."""
        self.reached.clear()
        self.go.set()

    def release(self) -> None:
        self.points.clear()
        self.go.set()
        self.handle.remove()


def classed(serve: Any, tmp_path: Path, tokens_toml: str = CLASSES, **settings: Any) -> tuple[Any, Any, dict[str, Job]]:
    """A gateway with the lab and students classes (a member at a time unless `settings` say), its
    worker and the jobs it admits."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(tokens_toml)
    settings = {"max_decoding_jobs": 1, "class_min_share": 0, **settings}
    server = serve(tokens_file=str(tokens), detach_grace=30, **settings)
    return server, server.backend.workers[0], track_jobs(server)


def completed(follower: Follower) -> dict[str, Any]:
    events = follower.done()
    assert events[-1]["event"] == "data", events[-1]
    return events[-1]["data"]


@pytest.mark.parametrize(
    "params",
    [
        {"prompts": ["the cat sat on"], "max_tokens": 40},
        {"prompts": ["a b c", "one two three four five"], "n": 2, "max_tokens": 40, "temperature": 1.0, "top_k": 50, "seed": 7},
    ],
    ids=["greedy", "sampled-with-seed"],
)
def test_a_preempted_generation_completes_as_it_would_have_alone(serve: Any, tmp_path: Path, params: dict[str, Any]) -> None:
    server, worker, jobs = classed(serve, tmp_path)  # one member at a time: the lab's job finds the batch full
    alone = completed(Follower(server.url, "generate", params, bearer(STUDENT)))
    jobs.clear()
    holder = Holder(worker.model.module, at=6)  # its prefill, and four decoding steps, then held in the fifth
    try:
        student = Follower(server.url, "generate", params, bearer(STUDENT))
        assert holder.reached.wait(60), "the student's job did not reach its fifth step"
        lab = Follower(server.url, "generate", {"prompts": ["hello"], "max_tokens": 4}, bearer(LAB))
        # The worker asks for the student's member to leave after the step under way.
        wait_until(lambda: any(run.evict for run in worker._runs), 30, "the lab's job to preempt the student's")
    finally:
        holder.release()
    assert completed(lab)["usage"]["completion_tokens"] == 4
    assert completed(student) == alone
    (student_job,) = [j for j in jobs.values() if j.tenant == "student"]
    (lab_job,) = [j for j in jobs.values() if j.tenant == "lab"]
    # Its client saw it running, then queued again first in line and told why, then running again.
    frames = [(f["status"], f.get("message")) for f in statuses(student_job) if "progress" not in f]
    first_run = frames.index(("RUNNING", None))
    again = frames[first_run + 1 :]
    assert again[-1] == ("RUNNING", None) and again[:-1] and set(again[:-1]) == {("QUEUED", PREEMPTED)}, frames
    # Second behind the lab's job that took its place, then first once that one started.
    assert places(student_job)[-2:] == [(2, 2), (1, 1)]
    assert student_job.preemptions == 1
    assert lab_job.finished is not None and student_job.finished is not None and lab_job.finished < student_job.finished
    # Every token streamed once: the partials add up to the completions.
    streamed: dict[int, list[int]] = {}
    for event in student.events():
        if event["event"] == "partial":
            streamed.setdefault(event["data"]["index"], []).extend(event["data"]["token_ids"])
    assert sum(len(ids) for ids in streamed.values()) == alone["usage"]["completion_tokens"]


def test_a_member_cancelled_as_it_is_preempted_ends_cancelled_and_is_not_queued_again(serve: Any, tmp_path: Path) -> None:
    """The student's member is asked to leave for the lab's job, and its client cancels it before the
    step under way ends: taken out, it ends cancelled there, not queued again behind the lab's job
    (where it would hold a place, and its client wait, until a worker reached it)."""
    server, worker, jobs = classed(serve, tmp_path)
    holder = Holder(worker.model.module, at=6)
    try:
        student = Follower(server.url, "generate", {"prompts": ["the cat sat on"], "max_tokens": 40}, bearer(STUDENT))
        assert holder.reached.wait(60), "the student's job did not reach its fifth step"
        lab = Follower(server.url, "generate", {"prompts": ["hello"], "max_tokens": 4}, bearer(LAB))
        wait_until(lambda: any(run.evict for run in worker._runs), 30, "the lab's job to preempt the student's")
        (student_job,) = [j for j in jobs.values() if j.tenant == "student"]
        cancelled = httpx.delete(f"{server.url}/jobs/{student_job.id}", headers=bearer(STUDENT), timeout=10)
        assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True
    finally:
        holder.release()
    assert student.done()[-1]["data"]["error"]["code"] == "cancelled"
    assert completed(lab)["usage"]["completion_tokens"] == 4
    (lab_job,) = [j for j in jobs.values() if j.tenant == "lab"]
    assert not any(f["status"] == "QUEUED" and f.get("message") == PREEMPTED for f in statuses(student_job))
    assert student_job.finished is not None and lab_job.finished is not None and student_job.finished < lab_job.finished


def test_no_member_is_preempted_for_a_job_of_its_own_class(serve: Any, tmp_path: Path) -> None:
    other_student = "student2-token-0123456789abc"
    server, worker, jobs = classed(serve, tmp_path, CLASSES + f'[tokens.student2]\ntoken = "{other_student}"\n')
    holder = Holder(worker.model.module, at=3)
    try:
        first = Follower(server.url, "generate", {"prompts": ["the cat"], "max_tokens": 8}, bearer(STUDENT))
        assert holder.reached.wait(60)
        second = Follower(server.url, "generate", {"prompts": ["a dog"], "max_tokens": 8}, bearer(other_student))
        wait_until(lambda: len(server.backend.queue) == 1, 30, "the second job to queue")
        assert not any(run.evict for run in worker._runs)
    finally:
        holder.release()
    completed(first), completed(second)
    assert [job.preemptions for job in jobs.values()] == [0, 0]


def test_the_lower_class_keeps_its_minimum_share_of_the_places(serve: Any, tmp_path: Path) -> None:
    """Two students decoding in a batch of two, --class-min-share 0.5: the lab's first job preempts
    one of them (the one started last), its second none (the other is the students' share)."""
    server, worker, jobs = classed(serve, tmp_path, max_decoding_jobs=2, class_min_share=0.5, batch_wait_ms=0)
    params = {"prompts": ["the cat sat on"], "max_tokens": 40}
    holder = Holder(worker.model.module, 1, 4)  # the first student's prefill; then a step with both decoding
    try:
        first = Follower(server.url, "generate", params, bearer(STUDENT))
        assert holder.reached.wait(60)
        second = Follower(server.url, "generate", {**params, "prompts": ["a dog ran to"]}, bearer(STUDENT))
        wait_until(lambda: sum(j.tenant == "student" for j in jobs.values()) == 2 and not server.backend.queue, 30,
                   "the second student's job to join")
        holder.step_on()
        assert holder.reached.wait(60), "the two students did not decode together"
        lab = Follower(server.url, "generate", {"prompts": ["hello"], "max_tokens": 30}, bearer(LAB))
        wait_until(lambda: any(run.evict for run in worker._runs), 30, "the lab's job to preempt a student's")
        # Held again as the lab's job is in the batch: its second comes while it runs (not once it has
        # ended and the preempted student is back, which the second would preempt again).
        (lab_id,) = [j.id for j in jobs.values() if j.tenant == "lab"]
        holder.hold_when(lambda: any(ctx.job_id == lab_id for run in list(worker._runs) for ctx in run.live))
        holder.step_on()
        assert holder.reached.wait(60), "the lab's job did not join the batch"
        wait_until(lambda: sum(j.tenant == "lab" and j.started is not None for j in jobs.values()) == 1, 30, "the lab's job to start")
        again = Follower(server.url, "generate", {"prompts": ["hello again"], "max_tokens": 4}, bearer(LAB))
        # Queued behind nothing but the preempted student's: the batch is full, and the other student is its class's share.
        wait_until(lambda: sum(j.tenant == "lab" for j in jobs.values()) == 2 and len(server.backend.queue) == 2, 30,
                   "the lab's second job to queue")
        assert not any(run.evict for run in worker._runs)
    finally:
        holder.release()
    for follower in (first, second, lab, again):
        completed(follower)
    students = sorted((j for j in jobs.values() if j.tenant == "student"), key=lambda j: j.created)
    assert [j.preemptions for j in students] == [0, 1]
    assert all(j.preemptions == 0 for j in jobs.values() if j.tenant == "lab")
