"""End to end on a real server: the stream's framing, headers and the built-in tools.

Every test runs against both kinds of gateway (conftest's KINDS): the local
backend, and the remote backend driving a real executor process. The last test
runs the same requests through both and compares the streams event by event.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import opening_statuses, run_stream, without_dispatched


@pytest.fixture(scope="module")
def server(any_server):
    """The module's server, local or remote: each test here runs once with each."""
    return any_server


def test_generate_streams_status_partials_and_one_result(server):
    s = run_stream(server.url, "generate", {"prompts": ["Hello there"], "max_tokens": 12})
    assert s.status == 200
    assert s.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert s.headers["cache-control"] == "no-cache"
    assert s.headers["x-accel-buffering"] == "no"
    job_id = s.headers["x-job-id"]
    assert s.raw.startswith(b"retry: 3000\n\n")

    statuses = [e["data"]["status"] for e in s.of("status")]
    opening = opening_statuses(server.kind)
    assert statuses[: len(opening)] == opening
    assert all(s == "RUNNING" for s in statuses[len(opening) :])
    ids = [e["id"] for e in s.events]
    assert ids == [f"{job_id}:{n}" for n in range(1, len(ids) + 1)]
    assert s.terminal["event"] == "data"
    result = s.terminal["data"]
    partial_text = "".join(e["data"]["text"] for e in s.of("partial"))
    assert partial_text == result["completions"][0]
    assert result["usage"]["completion_tokens"] == 12
    assert result["usage"]["prompt_tokens"] == len("Hello there") + 1  # bytes + BOS
    assert result["usage"]["total_tokens"] == 12 + 12
    assert sum(len(e["data"]["token_ids"]) for e in s.of("partial")) == 12


def test_get_form_maps_query_keys_onto_params(server):
    post = run_stream(server.url, "generate", {"prompts": ["ab", "cd"], "max_tokens": 3})
    get = run_stream(server.url, "generate", method="GET",
                     query=[("prompts", "ab"), ("prompts", "cd"), ("max_tokens", "3")])
    assert get.status == 200
    assert get.terminal["data"]["completions"] == post.terminal["data"]["completions"]
    as_json = run_stream(server.url, "generate", method="GET",
                         query={"params": json.dumps({"prompts": ["ab", "cd"], "max_tokens": 3})})
    assert as_json.terminal["data"] == post.terminal["data"]


def test_a_head_of_a_run_url_starts_no_job(server):
    """Starlette answers HEAD on every GET route, and a run's GET starts a job: a HEAD (a link
    checker's, a proxy's) is refused, never a job that no one follows and nothing would cancel."""
    def ids() -> set[str]:
        return {job["job_id"] for job in httpx.get(f"{server.url}/jobs", timeout=10).json()["jobs"]}

    before = ids()
    head = httpx.head(f"{server.url}/generate/run", params=[("prompts", "ab"), ("max_tokens", "3")], timeout=10)
    assert head.status_code == 405 and "x-job-id" not in head.headers
    assert ids() == before


def test_same_seed_same_completions_different_seed_differs(server):
    params = {"prompts": ["x", "y"], "max_tokens": 16, "temperature": 1.5, "seed": 7}
    a = run_stream(server.url, "generate", params).terminal["data"]
    b = run_stream(server.url, "generate", params).terminal["data"]
    c = run_stream(server.url, "generate", {**params, "seed": 8}).terminal["data"]
    assert a["completions"] == b["completions"]
    assert a["completions"] != c["completions"]


def test_tools_lists_generated_schemas(server):
    tools = httpx.get(server.url + "/tools").json()
    by_name = {t["name"]: t for t in tools}
    assert {"generate", "loglikelihood", "predict"} <= set(by_name)
    gen = by_name["generate"]
    assert gen["streams_partial"] is True
    props = gen["params_schema"]["properties"]
    assert props["max_tokens"]["maximum"] == 512  # the server's cap, applied to the schema
    (prompts,) = [v for v in props["prompts"]["anyOf"] if v["type"] == "array"]  # prompts, or messages
    assert prompts["maxItems"] == 32
    assert props["temperature"]["maximum"] == 2
    assert not gen["params_schema"].get("required")  # prompts or messages: the tool checks there is one
    assert set(gen["result_schema"]["properties"]) == {"completions", "usage", "finish_reasons"}
    assert by_name["predict"]["streams_partial"] is False


def test_health_and_ready(server):
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(server.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json()["ready"] is True
    if server.kind == "local":
        assert ready.json()["device"] == "cpu"
    else:
        (executor,) = ready.json()["executors"]
        assert executor["ready"] is True and executor["jobs"] == 0


# -- local and remote, side by side ---------------------------------------------------------

# Deterministic requests: greedy decoding, the tools without sampling, and a user tool
# that logs, reports progress and fails. Each (tool, params) is run on both backends.
SAME_REQUESTS = [
    ("generate", {"prompts": ["Hello there", "", "caf\u00e9 \u2603"], "max_tokens": 12}),
    ("generate", {"prompts": ["The quick brown fox", "ab"], "max_tokens": 20, "stop": ["e", "o"]}),
    ("generate", {"prompts": ["x"], "max_tokens": 8, "temperature": 1.3, "seed": 5}),
    ("predict", {"prompt": "Hello", "top_k": 20}),
    ("loglikelihood", {"prompts": ["Hello", "a"], "continuations": [" there", "bc"]}),
    ("logit_lens", {"prompt": "The quick", "top_k": 3, "track": ["e"]}),
    ("lens_grid", {"prompt": "Hi there", "stat": "rank"}),
    ("activation_patching", {"src_prompt": "The cat", "tgt_prompt": "The dog"}),
    ("embed", {"texts": ["Hello there", "a"], "pooling": "none"}),
    ("embed", {"texts": ["Hello there", "a"], "normalize": True, "precision": 4}),
    ("echo", {"text": "hi", "repeat": 2}),
    ("fail", {"message": "no luck"}),
]


def comparable(events: list[dict[str, Any]]) -> tuple[list[Any], list[dict[str, Any]]]:
    """The events without what differs from run to run by design: ids, seqs, times, ETAs.

    Progress frames are returned apart: how many there are depends on timing (they
    are coalesced to one per 100 ms), so only the first and the last are compared.
    """
    kept, progress = [], []
    for e in events:
        data = e["data"]
        if e["event"] == "status" and "progress" in data:
            progress.append(data["progress"])
            continue
        if e["event"] in ("status", "log", "error"):
            data = {k: v for k, v in data.items() if k not in ("job_id", "seq", "ts", "eta_s")}
        kept.append((e["event"], data))
    return kept, progress


def test_local_and_remote_streams_are_the_same_event_for_event(serve_any):
    local, remote = serve_any("local"), serve_any("remote")
    for tool, params in SAME_REQUESTS:
        a = run_stream(local.url, tool, params)
        b = run_stream(remote.url, tool, params)
        assert a.status == b.status == 200
        per_request = ("date", "x-job-id", "x-request-id")
        assert {k: v for k, v in a.headers.items() if k not in per_request} == {
            k: v for k, v in b.headers.items() if k not in per_request
        }
        assert a.raw.startswith(b"retry: 3000\n\n") and b.raw.startswith(b"retry: 3000\n\n")
        assert [e["id"] for e in b.events] == [f"{b.headers['x-job-id']}:{n}" for n in range(1, len(b.events) + 1)]
        events_a, progress_a = comparable(without_dispatched(a.events, "local"))
        events_b, progress_b = comparable(without_dispatched(b.events, "remote"))
        if a.terminal["event"] == "error":
            # The one difference by design: a tool that raised on an executor is a remote error.
            (_, local_error), (_, remote_error) = events_a.pop(), events_b.pop()
            assert local_error["error"]["code"] == "tool_error"
            assert remote_error["error"] == {**local_error["error"], "code": "remote_error"}
        assert events_b == events_a, tool
        # Progress: the same first and newest updates, the same non-decreasing steps in between.
        assert bool(progress_a) == bool(progress_b), tool
        if progress_a:
            assert progress_b[0] == progress_a[0] and progress_b[-1] == progress_a[-1], (tool, progress_a, progress_b)
            for progress in (progress_a, progress_b):
                done = [p["done"] for p in progress]
                assert done == sorted(done), (tool, progress)
        if a.terminal["event"] == "data":
            # The result's very bytes: arrays that crossed as msgpack buffers print the same JSON.
            assert last_frame(b.raw)[1:] == last_frame(a.raw)[1:], tool


def last_frame(raw: bytes) -> list[bytes]:
    """The lines of a complete stream's last frame: id, event, data."""
    return raw.split(b"\n\n")[-2].split(b"\n")
