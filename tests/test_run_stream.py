"""End to end on a real server: the stream's framing, headers and the built-in tools."""

from __future__ import annotations

import json

import httpx

from tests.conftest import run_stream


def test_generate_streams_status_partials_and_one_result(server):
    s = run_stream(server.url, "generate", {"prompts": ["Hello there"], "max_tokens": 12})
    assert s.status == 200
    assert s.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert s.headers["cache-control"] == "no-cache"
    assert s.headers["x-accel-buffering"] == "no"
    job_id = s.headers["x-job-id"]
    assert s.raw.startswith(b"retry: 3000\n\n")

    statuses = [e["data"]["status"] for e in s.of("status")]
    assert statuses[:3] == ["RECEIVED", "QUEUED", "RUNNING"]
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
    assert props["prompts"]["maxItems"] == 32
    assert props["temperature"]["maximum"] == 2
    assert gen["params_schema"]["required"] == ["prompts"]
    assert set(gen["result_schema"]["properties"]) == {"completions", "usage", "finish_reasons"}
    assert by_name["predict"]["streams_partial"] is False


def test_health_and_ready(server):
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(server.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json()["ready"] is True
    assert ready.json()["device"] == "cpu"
