"""Classes in the queue (backends/queue.py): a higher class's job goes ahead of every lower one's,
tenants take turns within their class, and a lower class keeps its minimum share of the turns.
On the queue alone, then through a real gateway whose tokens are in two classes."""

from __future__ import annotations

from pathlib import Path
from typing import Any


from backends.queue import JobQueue
from backends.workers import PREEMPTED
from gateway.jobs import Job
from tests.conftest import LAB, STUDENT, wait_until
from tests.test_fairness import GATES, Follower, bearer, drain, hold, jobs_of, new_gate, places, start_job, track_jobs



def queued(queue: JobQueue, tenant: str, name: str, priority: int = 0) -> Job:
    job = Job("t", name, tenant=tenant, priority=priority)
    queue.put(job)
    return job


async def test_a_higher_class_goes_first_and_tenants_take_turns_within_theirs() -> None:
    queue = JobQueue(100, min_share=0)
    low = [queued(queue, "S", f"s{i}") for i in range(3)]
    high = [queued(queue, "L", "l0", priority=10), queued(queue, "M", "m0", priority=10)]
    # The lab's jobs are ahead of the students' queued before them, and were told so.
    assert [j.position for j in high] == [1, 2] and [j.position for j in low] == [3, 4, 5]
    assert places(low[0])[-1] == (3, 5)
    queued(queue, "L", "l1", priority=10)
    assert await drain(queue) == ["l0", "m0", "l1", "s0", "s1", "s2"]


async def test_a_lower_class_keeps_its_minimum_share_while_a_higher_one_floods() -> None:
    queue = JobQueue(1000, per_owner=1000, min_share=0.25)  # a turn in four at least
    for i in range(5):
        queued(queue, "S", f"s{i}")
    for i in range(40):
        queued(queue, "L", f"l{i}", priority=10)
    # The head of the line is the lab's; the students' first is promised the fourth turn, and so on.
    assert queue.head is not None and queue.head.params == "l0"
    served = await drain(queue)
    first_twenty = served[:20]
    assert sum(name.startswith("s") for name in first_twenty) == 5  # one in four, never more
    assert first_twenty[:8] == ["l0", "l1", "l2", "s0", "l3", "l4", "l5", "s1"]
    assert [name for name in served if name.startswith("s")] == [f"s{i}" for i in range(5)]
    # Half the turns at most: the classes alternate while both wait.
    even = JobQueue(100, min_share=0.5)
    for i in range(3):
        queued(even, "S", f"s{i}")
    for i in range(3):
        queued(even, "L", f"l{i}", priority=10)
    assert await drain(even) == ["l0", "s0", "l1", "s1", "l2", "s2"]
    # Strictly by class with min_share 0.
    strict = JobQueue(1000, per_owner=1000, min_share=0)
    for i in range(3):
        queued(strict, "S", f"s{i}")
    for i in range(10):
        queued(strict, "L", f"l{i}", priority=10)
    assert (await drain(strict))[:10] == [f"l{i}" for i in range(10)]


async def test_one_class_orders_as_before_classes() -> None:
    queue = JobQueue(100)
    for i in range(3):
        queued(queue, "A", f"a{i}", priority=5)
    queued(queue, "B", "b0", priority=5)
    assert await drain(queue) == ["a0", "b0", "a1", "a2"]


def test_a_higher_class_job_starts_before_a_lower_class_backlog(serve: Any, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[classes.lab]\npriority = 10\n[classes.students]\ndefault = true\n'
        f'[tokens.lab]\ntoken = "{LAB}"\nclass = "lab"\n[tokens.student]\ntoken = "{STUDENT}"\n'
    )
    server = serve(tools=[hold], tokens_file=str(tokens), queue_size=100, detach_grace=30)
    jobs = track_jobs(server)
    first, rest = new_gate(), new_gate()
    try:
        start_job(server.url, "hold", {"gate": first}, bearer(STUDENT))
        wait_until(lambda: server.backend.workers[0].busy, 10, "the student's first job to run")
        for _ in range(10):
            start_job(server.url, "hold", {"gate": rest}, bearer(STUDENT))
        assert len(server.backend.queue) == 10
        lab = Follower(server.url, "predict", {"prompt": "hello", "top_k": 2}, bearer(LAB))
        wait_until(lambda: len(server.backend.queue) == 11, 10, "the lab's job to queue")
        (lab_job,) = jobs_of(jobs, "lab")
        students = jobs_of(jobs, "student")
        # The lab's job is first in line, ahead of the ten the students queued before it.
        assert places(lab_job) == [(1, 11)]
        assert places(students[1])[-1] == (2, 11)
        GATES[first].set()
        assert lab.done()[-1]["event"] == "data"
        # It ran right after the job that was running: no job the students queued started before it.
        assert lab_job.started is not None
        assert all(j.started is None or j.started >= lab_job.started for j in students[1:])
        assert not any(j.started for j in students[2:])
    finally:
        for gate in (first, rest):
            GATES[gate].set()


def test_an_engine_process_queues_by_the_class_the_gateway_sends(classed_engine: Any) -> None:
    """The job's class travels with it to the engine, whose queue orders by it."""
    import httpx

    from tests.test_engines import follow

    gateway = classed_engine
    blocker = follow(gateway.url, "nap", {"seconds": 60, "tag": "blocker"}, bearer(STUDENT))
    wait_until(lambda: "running" in blocker.statuses(), 60, "the student's first nap to run")
    waiting = [follow(gateway.url, "nap", {"seconds": 0, "tag": f"s{i}"}, bearer(STUDENT)) for i in range(3)]
    for i, follower in enumerate(waiting):
        wait_until(lambda f=follower: "queued" in f.statuses(), 60, f"the student's nap s{i} to queue")
    lab = follow(gateway.url, "nap", {"seconds": 0, "tag": "lab"}, bearer(LAB))
    wait_until(lambda: "queued" in lab.statuses(), 60, "the lab's nap to queue")
    # The engine put the lab's job first in line, ahead of the three queued before it.
    first = next(e["data"] for e in lab.events if e["event"] == "status" and e["data"]["status"] == "QUEUED")
    assert first["position"] == 1, first
    job = blocker.events[0]["data"]["job_id"]
    assert httpx.delete(f"{gateway.url}/jobs/{job}", headers=bearer(STUDENT)).status_code == 200
    assert lab.ended()["event"] == "data"
    ends = {f.params["tag"]: f.ended() for f in waiting}
    assert all(end["event"] == "data" for end in ends.values())


def test_an_engine_process_preempts_and_its_client_is_told(classed_engine: Any) -> None:
    """The default set-up: the class travels to the engine, whose worker preempts; the reason reaches
    the client through the gateway, and the completion is the one the job makes alone. The student's
    generation is hundreds of steps long (seconds): the lab's job, sent once its first token streamed, finds
    it decoding."""
    from tests.test_engines import follow

    gateway = classed_engine
    params = {"prompts": ["the cat sat on the mat"], "max_tokens": 300}
    alone = follow(gateway.url, "generate", params, bearer(STUDENT)).ended()
    student = follow(gateway.url, "generate", params, bearer(STUDENT))
    wait_until(lambda: any(e["event"] == "partial" for e in student.events), 60, "the student's first token")
    lab = follow(gateway.url, "generate", {"prompts": ["hello"], "max_tokens": 4}, bearer(LAB))
    assert lab.ended()["event"] == "data"
    assert student.ended()["data"] == alone["data"]
    told = [e["data"] for e in student.events if e["event"] == "status" and e["data"]["status"] == "QUEUED"]
    assert told and told[-1]["message"] == PREEMPTED and told[-1]["position"] == 1, told
    assert student.statuses()[-1] == "running"
