"""Whose job is whose: every job route answers another token as for an unknown job, an admin
sees them all, and a resume is checked like a run (its tool, its owner). Real servers on
loopback; across two gateway replicas on a real Redis too."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import KINDS, Executors, run_stream, start_any, track_jobs, wait_until
from tests.support.redis_server import redis_server  # noqa: F401
from tests.test_redis_replicas import read_some, replicas, slow_echo  # noqa: F401

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef00"
CAROL = "carol-token-0123456789abcdef"  # an operator: admin = true
TOKENS = f"""
[tokens.alice]
token = "{ALICE}"

[tokens.bob]
token = "{BOB}"
tools = ["predict", "echo"]

[tokens.carol]
token = "{CAROL}"
admin = true
"""


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokens") / "tokens.toml"
    path.write_text(TOKENS)
    return path


@pytest.fixture(scope="module", params=KINDS)
def gateway(request: pytest.FixtureRequest, tiny_model_path: Path, tokens_file: Path, executors: Executors) -> Any:
    """A gateway with tokens, the model in process or on an executor: ownership is the gateway's either way."""
    server = start_any(request.param, executors, tiny_model_path, tokens_file=str(tokens_file), detach_grace=30)
    yield server
    server.stop()


def started(url: str, token: str, tool: str = "echo", params: Any = None, n: int = 3) -> tuple[str, list[dict[str, Any]]]:
    """Start a job as `token`, read its first `n` events and hang up (it runs on); its id and events."""
    headers, events = read_some(url, f"/{tool}/run", n, method="POST", json=params or slow_echo(40), headers=bearer(token))
    return headers["x-job-id"], events


def test_another_tokens_job_is_answered_as_an_unknown_one(gateway: Any) -> None:
    job_id, events = started(gateway.url, ALICE)
    unknown = uuid.uuid4().hex
    for method, path, headers in (
        ("GET", f"/jobs/{job_id}", {}),
        ("GET", f"/jobs/{job_id}/events", {}),
        ("GET", f"/jobs/{job_id}/result", {}),
        ("DELETE", f"/jobs/{job_id}", {}),
        ("GET", "/echo/run", {"Last-Event-ID": events[-1]["id"]}),
        ("POST", "/echo/run", {"Last-Event-ID": events[-1]["id"]}),
    ):
        theirs = httpx.request(method, gateway.url + path, headers={**bearer(BOB), **headers}, timeout=30)
        none = httpx.request(
            method, gateway.url + path.replace(job_id, unknown), timeout=30,
            headers={**bearer(BOB), **{k: v.replace(job_id, unknown) for k, v in headers.items()}},
        )
        assert (theirs.status_code, none.status_code) == (404, 404), (method, path, theirs.text)
        assert theirs.json()["error"]["message"].replace(job_id, unknown) == none.json()["error"]["message"], (method, path)
    # Bob's attempts changed nothing: the job is alice's, running, and hers to read.
    mine = httpx.get(f"{gateway.url}/jobs/{job_id}", headers=bearer(ALICE)).json()
    assert mine["owner"] == "alice" and mine["status"] in ("QUEUED", "RUNNING")
    running = httpx.get(f"{gateway.url}/jobs/{job_id}/result", headers=bearer(ALICE))
    assert running.status_code == 409 and running.json()["error"]["code"] == "no_result", running.text
    assert httpx.delete(f"{gateway.url}/jobs/{job_id}", headers=bearer(ALICE)).json()["cancelled"] is True


def test_an_admin_sees_and_cancels_any_job(gateway: Any) -> None:
    job_id, _ = started(gateway.url, ALICE)
    assert httpx.get(f"{gateway.url}/jobs/{job_id}", headers=bearer(CAROL)).json()["owner"] == "alice"
    _, events = read_some(gateway.url, f"/jobs/{job_id}/events", 2, headers=bearer(CAROL))
    assert [e["id"] for e in events] == [f"{job_id}:1", f"{job_id}:2"]
    assert httpx.delete(f"{gateway.url}/jobs/{job_id}", headers=bearer(CAROL)).json()["cancelled"] is True
    snapshot = lambda: httpx.get(f"{gateway.url}/jobs/{job_id}", headers=bearer(ALICE)).json()  # noqa: E731
    wait_until(lambda: snapshot()["status"] == "FAILED", what="the cancel")
    assert snapshot()["terminal"]["data"]["error"]["code"] == "cancelled"


def test_a_tool_limited_token_cannot_follow_another_tools_job(gateway: Any) -> None:
    job_id, events = started(gateway.url, ALICE, "generate", {"prompts": ["a"], "max_tokens": 64})
    # Bob may not use generate at all, and alice's job is not his to read by id either.
    resumed = httpx.get(f"{gateway.url}/generate/run", headers={**bearer(BOB), "Last-Event-ID": events[-1]["id"]})
    assert resumed.status_code == 403 and resumed.json()["error"]["code"] == "forbidden"
    assert httpx.get(f"{gateway.url}/jobs/{job_id}/events", headers=bearer(BOB)).status_code == 404


def test_a_resume_through_another_tools_url_is_a_400_naming_both(gateway: Any) -> None:
    job_id, events = started(gateway.url, ALICE)
    for method in ("GET", "POST"):
        answer = httpx.request(method, f"{gateway.url}/predict/run", headers={**bearer(ALICE), "Last-Event-ID": events[-1]["id"]})
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert "echo" in message and "predict" in message and job_id in message
    httpx.delete(f"{gateway.url}/jobs/{job_id}", headers=bearer(ALICE))


def test_a_post_sent_again_with_last_event_id_resumes_its_job(gateway: Any) -> None:
    """What fetch-event-source sends after a cut: the same POST, Last-Event-ID, no Idempotency-Key."""
    ran = track_jobs(gateway)
    body = {"prompts": ["Once upon a time"], "max_tokens": 40}
    job_id, first = started(gateway.url, ALICE, "generate", body, n=6)
    assert any(e["event"] == "partial" for e in first)  # the premise: some text came before the cut
    again = run_stream(gateway.url, "generate", body, headers={**bearer(ALICE), "Last-Event-ID": first[-1]["id"]})
    assert again.status == 200 and again.headers["x-job-id"] == job_id
    seqs = [int(e["id"].rsplit(":", 1)[1]) for e in first + [e for e in again.events if "id" in e]]
    assert seqs == list(range(1, len(seqs) + 1))  # every event once: none again, none missing
    assert list(ran) == [job_id]  # one job: the POST did not start a duplicate
    text = "".join(e["data"]["text"] for e in first + again.events if e.get("event") == "partial")
    assert text == again.terminal["data"]["completions"][0]  # the text once, whole


# -- across replicas --------------------------------------------------------------------


def test_ownership_holds_on_every_replica(replicas: Any, tokens_file: Path) -> None:  # noqa: F811
    a, b = replicas(tokens_file=str(tokens_file), detach_grace=30)
    job_id, events = started(a.url, ALICE)
    assert httpx.get(f"{b.url}/jobs/{job_id}", headers=bearer(BOB)).status_code == 404
    assert httpx.delete(f"{b.url}/jobs/{job_id}", headers=bearer(BOB)).status_code == 404
    assert httpx.get(f"{b.url}/echo/run", headers={**bearer(BOB), "Last-Event-ID": events[-1]["id"]}).status_code == 404
    assert httpx.get(f"{b.url}/jobs/{job_id}", headers=bearer(ALICE)).json()["owner"] == "alice"
    assert httpx.get(f"{b.url}/jobs/{job_id}", headers=bearer(CAROL)).status_code == 200
    assert httpx.delete(f"{b.url}/jobs/{job_id}", headers=bearer(ALICE)).json()["cancelled"] is True


def test_admin_is_true_or_false(tmp_path: Path) -> None:
    from gateway.server.auth import AuthConfigError, load_principals

    path = tmp_path / "tokens.toml"
    path.write_text(f'[tokens.ops]\ntoken = "{CAROL}"\nadmin = "yes"\n')
    with pytest.raises(AuthConfigError, match=r"\[tokens.ops\]: admin must be true or false"):
        load_principals(str(path))
    path.write_text(TOKENS)
    assert {p.name: p.admin for p in load_principals(str(path))} == {"alice": False, "bob": False, "carol": True}


# -- listing ----------------------------------------------------------------------------


def listed(url: str, token: str, **query: Any) -> dict[str, Any]:
    answer = httpx.get(f"{url}/jobs", params=query, headers=bearer(token))
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_get_jobs_lists_the_callers_own_jobs_newest_first_a_page_at_a_time(gateway: Any) -> None:
    # Two events each (RECEIVED, QUEUED): the jobs wait behind one another, all of them active.
    alices = [started(gateway.url, ALICE, n=2)[0] for _ in range(3)]
    bobs = started(gateway.url, BOB, n=2)[0]
    running = listed(gateway.url, ALICE, state="active")["jobs"]
    assert [j["job_id"] for j in running if j["job_id"] in alices] == alices[::-1]  # newest first
    assert all(j["owner"] == "alice" for j in listed(gateway.url, ALICE)["jobs"])
    assert bobs not in [j["job_id"] for j in listed(gateway.url, ALICE)["jobs"]]
    assert [j["job_id"] for j in listed(gateway.url, BOB, state="active")["jobs"]] == [bobs]
    everyone = {j["job_id"] for j in listed(gateway.url, CAROL, state="active", limit=500)["jobs"]}
    assert set(alices) | {bobs} <= everyone  # an admin's list: every token's jobs
    # Pages: each job once, in order, until `next` runs out.
    seen, cursor = [], None
    while True:
        page = listed(gateway.url, ALICE, limit=2, **({"cursor": cursor} if cursor else {}))
        assert len(page["jobs"]) <= 2
        seen += [j["job_id"] for j in page["jobs"]]
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == [j["job_id"] for j in listed(gateway.url, ALICE, limit=500)["jobs"]] and len(set(seen)) == len(seen)
    for job_id in [*alices, bobs]:
        httpx.delete(f"{gateway.url}/jobs/{job_id}", headers=bearer(CAROL))
    wait_until(lambda: not {*alices, bobs} & {j["job_id"] for j in listed(gateway.url, CAROL, state="active")["jobs"]},
               what="the cancels")
    assert set(alices) <= {j["job_id"] for j in listed(gateway.url, ALICE, state="failed")["jobs"]}


@pytest.mark.parametrize(("query", "field"), [({"state": "sleeping"}, "state"), ({"limit": "0"}, "limit"),
                                              ({"limit": "x"}, "limit"), ({"cursor": "nope"}, "cursor")])
def test_get_jobs_names_a_bad_query_key(gateway: Any, query: dict[str, str], field: str) -> None:
    answer = httpx.get(f"{gateway.url}/jobs", params=query, headers=bearer(ALICE))
    assert answer.status_code == 422 and answer.json()["error"]["field"] == field


def test_get_jobs_lists_the_jobs_of_every_replica(replicas: Any, tokens_file: Path) -> None:  # noqa: F811
    a, b = replicas(tokens_file=str(tokens_file), detach_grace=30)
    mine = started(a.url, ALICE, n=2)[0]
    theirs = started(b.url, BOB, n=2)[0]
    assert mine in [j["job_id"] for j in listed(b.url, ALICE, state="active")["jobs"]]
    assert theirs not in [j["job_id"] for j in listed(b.url, ALICE)["jobs"]]
    assert {mine, theirs} <= {j["job_id"] for j in listed(a.url, CAROL)["jobs"]}
    for job_id in (mine, theirs):
        httpx.delete(f"{a.url}/jobs/{job_id}", headers=bearer(CAROL))
