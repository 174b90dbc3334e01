"""Several models behind one gateway: `GET /models`, runs routed by their `model` param, and
each result equal to that model's own computation in plain transformers.

Two tiny causal LMs of different families ("base", the default, and "other") and a
tiny ESM-2 masked LM ("esm") are served at once by one gateway; the remote tests
put the same models on executor processes, one model each, behind one gateway.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import make_remote_server, make_server, run_stream, wait_until
from tests.support.processes import start_executor
from tests.test_observability import scrape, value
from tests.test_tools import Reference, result

PAIRS = [("Hello", " there"), ("The quick brown", " fox"), ("a", "bc")]


@pytest.fixture(scope="module")
def paths(tiny: Callable[..., Path], tiny_model_path: Path) -> dict[str, Path]:
    return {
        "base": tiny_model_path,
        "other": tiny("gpt2", seed=1, init=0.2),
        "esm": tiny("esm_mlm"),
    }


@pytest.fixture(scope="module")
def refs(paths: dict[str, Path]) -> dict[str, Reference]:
    return {name: Reference(paths[name]) for name in ("base", "other")}


@pytest.fixture(scope="module")
def server(paths: dict[str, Path]):
    s = make_server([f"{name}={path}" for name, path in paths.items()], max_batch_size=4)
    yield s
    s.stop()


def loglikelihood(url: str, model: str | None) -> list[float]:
    params: dict[str, Any] = {"prompts": [p for p, _ in PAIRS], "continuations": [c for _, c in PAIRS]}
    if model is not None:
        params["model"] = model
    return result(url, "loglikelihood", params)["ll"]


def expected(ref: Reference) -> list[float]:
    return [ref.loglikelihood(p, c)[0] for p, c in PAIRS]


def test_models_lists_each_model_with_its_facts_and_tools(server) -> None:
    listed = httpx.get(server.url + "/models").json()
    assert listed["default"] == "base"
    by_name = {m["name"]: m for m in listed["models"]}
    assert [m["name"] for m in listed["models"]] == ["base", "other", "esm"]
    assert [m["default"] for m in listed["models"]] == [True, False, False]
    for name, kind in (("base", "causal_lm"), ("other", "causal_lm"), ("esm", "masked_lm")):
        m = by_name[name]
        assert (m["kind"], m["device"], m["dtype"], m["ready"]) == (kind, "cpu", "float32", True)
    assert by_name["base"]["context_length"] == by_name["other"]["context_length"] == 256
    assert by_name["esm"]["context_length"] > 0
    assert "generate" in by_name["other"]["tools"] and "fill_mask" not in by_name["other"]["tools"]
    assert "fill_mask" in by_name["esm"]["tools"] and "generate" not in by_name["esm"]["tools"]
    assert "generate" in by_name["esm"]["unsupported"]
    assert set(by_name["esm"]["tools"]) | set(by_name["esm"]["unsupported"]) == set(by_name["base"]["tools"]) | set(
        by_name["base"]["unsupported"]
    )


def test_each_run_goes_to_the_model_it_names(server, refs) -> None:
    base, other = expected(refs["base"]), expected(refs["other"])
    assert loglikelihood(server.url, "other") == pytest.approx(other, abs=1e-4)
    assert loglikelihood(server.url, "base") == pytest.approx(base, abs=1e-4)
    assert loglikelihood(server.url, None) == pytest.approx(base, abs=1e-4)  # no model: the default
    assert base != pytest.approx(other, abs=1e-2)  # the two really differ, so routing is what is checked


def test_generate_on_each_model_equals_its_greedy_decoding(server, refs) -> None:
    for name in ("base", "other"):
        out = result(server.url, "generate", {"prompts": ["Hello"], "max_tokens": 6, "model": name})
        assert out["completions"] == [refs[name].decode(refs[name].greedy("Hello", 6))], name


def test_the_get_form_takes_the_model_too(server, refs) -> None:
    s = run_stream(
        server.url, "loglikelihood", method="GET",
        query=[("prompts", "Hello"), ("continuations", " there"), ("model", "other")],
    )
    assert s.terminal["event"] == "data", s.raw
    assert s.terminal["data"]["ll"] == pytest.approx([refs["other"].loglikelihood("Hello", " there")[0]], abs=1e-4)
    # Beside params=<JSON>, model= picks the model for the same JSON.
    params = json.dumps({"prompts": ["Hello"], "continuations": [" there"]})
    beside = run_stream(server.url, "loglikelihood", method="GET", query=[("params", params), ("model", "other")])
    assert beside.terminal["data"] == s.terminal["data"]
    clash = httpx.get(server.url + "/loglikelihood/run", params={"params": json.dumps({**json.loads(params), "model": "base"}), "model": "other"})
    assert clash.status_code == 422 and clash.json()["error"]["field"] == "model"


def test_a_batch_never_mixes_models(server, refs) -> None:
    """Jobs of both models at once: each gets its own model's numbers, whatever was batched with what."""
    out: dict[int, list[float]] = {}

    def one(i: int) -> None:
        out[i] = loglikelihood(server.url, ("base", "other")[i % 2])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    base, other = expected(refs["base"]), expected(refs["other"])
    for i in range(8):
        assert out[i] == pytest.approx(base if i % 2 == 0 else other, abs=1e-4), i


def test_an_unknown_model_is_404_naming_those_served(server) -> None:
    for response in (
        httpx.post(server.url + "/predict/run", json={"prompt": "a", "model": "gpt-5"}),
        httpx.get(server.url + "/predict/run", params={"prompt": "a", "model": "gpt-5"}),
        httpx.get(server.url + "/tools", params={"model": "gpt-5"}),
    ):
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert error["code"] == "unknown_model"
        assert "base, other, esm" in error["message"] and "gpt-5" in error["message"]
    assert httpx.post(server.url + "/predict/run", json={"prompt": "a", "model": "gpt-5"}).json()["error"]["field"] == "model"
    empty = httpx.post(server.url + "/predict/run", json={"prompt": "a", "model": ""})
    assert empty.status_code == 422 and empty.json()["error"]["field"] == "model"
    assert httpx.get(server.url + "/healthz").status_code == 200


def test_a_tool_the_named_model_cannot_run_is_422(server) -> None:
    response = httpx.post(server.url + "/generate/run", json={"prompts": ["a"], "model": "esm"})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "unsupported_by_model" and "generate" in error["message"]
    masked = httpx.post(server.url + "/fill_mask/run", json={"texts": ["a"]})  # the default model is causal
    assert masked.status_code == 422 and masked.json()["error"]["code"] == "unsupported_by_model"
    # The same tool on the model that can run it.
    filled = result(server.url, "fill_mask", {"texts": ["MK<mask>AY"], "model": "esm"})
    assert filled


def test_tools_follow_the_model_asked_about(server) -> None:
    default = {t["name"]: t["unsupported"] for t in httpx.get(server.url + "/tools").json()}
    esm = {t["name"]: t["unsupported"] for t in httpx.get(server.url + "/tools", params={"model": "esm"}).json()}
    assert default["generate"] is None and default["fill_mask"] is not None
    assert esm["generate"] is not None and esm["fill_mask"] is None


def test_a_job_records_its_model_and_metrics_carry_it(server) -> None:
    s = run_stream(server.url, "predict", {"prompt": "a", "model": "other"})
    snapshot = httpx.get(f"{server.url}/jobs/{s.headers['x-job-id']}").json()
    assert snapshot["model"] == "other"
    s = run_stream(server.url, "predict", {"prompt": "a"})
    assert httpx.get(f"{server.url}/jobs/{s.headers['x-job-id']}").json()["model"] == "base"
    samples = scrape(server.url)
    assert value(samples, "streamgate_jobs_total", tool="predict", model="other", outcome="succeeded") >= 1
    assert value(samples, "streamgate_jobs_total", tool="predict", model="base", outcome="succeeded") >= 1
    assert value(samples, "streamgate_job_run_seconds_count", tool="predict", model="other") >= 1
    assert {labels for name, labels in samples if name == "streamgate_queue_depth"} >= {
        frozenset({("model", m)}) for m in ("base", "other", "esm")
    }


def test_the_default_model_named_or_not_is_one_request(server) -> None:
    """The model is resolved before the request is keyed: the same key with and without it attaches."""
    key = {"Idempotency-Key": "same-request"}
    first = run_stream(server.url, "predict", {"prompt": "a"}, headers=key)
    again = run_stream(server.url, "predict", {"prompt": "a", "model": "base"}, headers=key)
    assert again.headers["x-job-id"] == first.headers["x-job-id"]
    other = httpx.post(server.url + "/predict/run", json={"prompt": "a", "model": "other"}, headers=key)
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"


def test_each_model_has_its_own_workers_and_queue(server) -> None:
    """A model kept busy does not hold up the other: its jobs run on their own worker."""
    base = server.backend.served["base"]
    hook = base.model.module.register_forward_pre_hook(lambda *_: time.sleep(0.05))
    try:
        with httpx.Client(timeout=60) as client, client.stream(
            "POST", server.url + "/generate/run", json={"prompts": ["a"], "max_tokens": 200}
        ) as slow:
            wait_until(lambda: base.workers[0].busy, 10, "the base model's job to run")
            started = time.monotonic()
            result(server.url, "predict", {"prompt": "a", "model": "other"})
            assert time.monotonic() - started < 5
            assert base.workers[0].busy  # still on its long job
            slow.close()
    finally:
        hook.remove()
    assert server.backend.served["other"].workers[0] is not base.workers[0]


# -- the remote backend: executors publish their models, and jobs go where theirs is ------------


@pytest.fixture(scope="module")
def remote(paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("model-executors")
    first = start_executor([f"base={paths['base']}", f"other={paths['other']}"], logs / "first.log")
    second = start_executor([f"other={paths['other']}", f"esm={paths['esm']}"], logs / "second.log")
    gateway = make_remote_server([first.url, second.url])
    yield gateway, first, second
    gateway.stop()
    first.stop()
    second.stop()


def test_a_remote_gateway_lists_and_routes_by_model(remote, refs) -> None:
    gateway, first, second = remote
    listed = httpx.get(gateway.url + "/models").json()
    assert listed["default"] == "base"
    assert [m["name"] for m in listed["models"]] == ["base", "other", "esm"]
    assert all(m["ready"] for m in listed["models"])
    assert loglikelihood(gateway.url, "other") == pytest.approx(expected(refs["other"]), abs=1e-4)
    assert loglikelihood(gateway.url, None) == pytest.approx(expected(refs["base"]), abs=1e-4)
    # esm is on the second executor only: its job can only have run there.
    assert result(gateway.url, "fill_mask", {"texts": ["MK<mask>AY"], "model": "esm"})
    there = scrape(second.url)
    assert value(there, "streamgate_jobs_total", tool="fill_mask", model="esm", outcome="succeeded") == 1
    assert value(scrape(first.url), "streamgate_jobs_total", tool="fill_mask") == 0
    refused = httpx.post(gateway.url + "/generate/run", json={"prompts": ["a"], "model": "esm"})
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "unsupported_by_model"
    unknown = httpx.post(gateway.url + "/generate/run", json={"prompts": ["a"], "model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_model"


def test_a_remote_gateway_keys_a_request_by_its_params_as_json(remote) -> None:
    """Its tools' Structs are on the executors: a request is keyed by its params as JSON, its model
    resolved, so key order, spacing, the default named or not and `params=<JSON>` are one request."""
    gateway, _, _ = remote
    key = {"Idempotency-Key": uuid.uuid4().hex}
    job_id = run_stream(gateway.url, "predict", {"prompt": "a", "top_k": 2}, headers=key).headers["x-job-id"]
    params = '{ "top_k": 2,  "prompt": "a" }'
    again = [
        run_stream(gateway.url, "predict", content=params.replace("}", ', "model": "base"}').encode(), headers=key),
        run_stream(gateway.url, "predict", method="GET", query=[("params", params)], headers=key),
        run_stream(gateway.url, "predict", method="GET", query=[("params", params), ("model", "base")], headers=key),
    ]
    assert [s.headers["x-job-id"] for s in again] == [job_id] * 3
    for other in ({"prompt": "a", "top_k": 3}, {"prompt": "a", "top_k": 2, "model": "other"}):
        refused = httpx.post(gateway.url + "/predict/run", json=other, headers=key)
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "idempotency_key_reused"
