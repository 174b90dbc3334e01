"""Models on inference servers (backends/inference.py): a real vLLM server the gateway starts
(`--model NAME=vllm:`, the bundled SmolLM2 converted) beside a model in an engine process, and a
second gateway fronting that same server (`--model NAME=openai+http://…/v1`). The job guarantees
hold as for a model here; the numbers are the server's own answer, token for token.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import VLLM_START_S, run_stream, server_url, wait_until
from tests.processes import ServeProcess, clean_env, free_port, start_serve
from tests.test_engines import follow

pytestmark = pytest.mark.vllm

PROMPTS = ["Hello, my name is", "The capital of France is"]


@pytest.fixture(scope="module")
def fronting(vllm_gateway: ServeProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """A second gateway in front of the same server, letting one job at a time reach it."""
    port = free_port()
    args = [
        "--model", f"smol=openai+{server_url(vllm_gateway)}", "--max-decoding-jobs", "1",
        "--port", str(port), "--log-level", "warning",
    ]
    gateway = start_serve(args, clean_env(), port, tmp_path_factory.mktemp("fronting") / "gateway.log")
    yield gateway
    gateway.stop()


def direct(gateway: ServeProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The server's own answer, asked without the gateway."""
    answer = httpx.post(f"{server_url(gateway)}{path}", json={"model": "smol", "temperature": 0, **body}, timeout=120)
    answer.raise_for_status()
    return answer.json()


def server_metric(gateway: ServeProcess, name: str) -> float:
    text = httpx.get(server_url(gateway).removesuffix("/v1") + "/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert found, f"{name} not in the server's metrics"
    return float(found.group(1))


def test_a_vllm_model_serves_beside_a_local_one_and_says_what_it_cannot_run(vllm_gateway: ServeProcess) -> None:
    models = {m["name"]: m for m in httpx.get(f"{vllm_gateway.url}/models", timeout=10).json()["models"]}
    smol, tiny = models["smol"], models["tiny"]
    assert smol["default"] and smol["ready"] and smol["device"] == "vllm server" and smol["context_length"] == 2048
    assert smol["tools"] == ["generate", "loglikelihood", "predict"]
    assert "inference server" in smol["unsupported"]["logit_lens"] and "logprobs" in smol["unsupported"]
    assert "logit_lens" in tiny["tools"]
    refused = httpx.post(f"{vllm_gateway.url}/logit_lens/run", json={"prompt": "a", "model": "smol"}, timeout=30)
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "unsupported_by_model"
    assert run_stream(vllm_gateway.url, "generate", {"prompts": ["a"], "max_tokens": 3, "model": "tiny"}).terminal["event"] == "data"


@pytest.mark.parametrize("gateway_name", ["vllm_gateway", "fronting"])
def test_greedy_completions_are_the_servers_own_token_for_token(
    gateway_name: str, request: pytest.FixtureRequest, vllm_gateway: ServeProcess
) -> None:
    gateway = request.getfixturevalue(gateway_name)
    done = run_stream(gateway.url, "generate", {"prompts": PROMPTS, "max_tokens": 12, "model": "smol"})
    assert [e["event"] for e in done.events].count("data") == 1 and done.terminal["event"] == "data", done.events[-3:]
    statuses = [e["data"]["status"] for e in done.of("status")]
    events = [e["event"] for e in done.events]
    assert "RUNNING" in statuses and events.index("partial") > events.index("status", statuses.index("RUNNING"))
    result = done.terminal["data"]
    own = direct(vllm_gateway, "/completions", {"prompt": PROMPTS, "max_tokens": 12, "return_token_ids": True})
    choices = sorted(own["choices"], key=lambda c: c["index"])
    assert result["completions"] == [c["text"] for c in choices]
    assert result["finish_reasons"] == ["length", "length"]
    assert result["usage"] == {k: own["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    # A partial per chunk: their texts and token ids are the completion's.
    for i, choice in enumerate(choices):
        partials = [e["data"] for e in done.of("partial") if e["data"]["index"] == i]
        assert "".join(p["text"] for p in partials) == choice["text"]
        assert [t for p in partials for t in p["token_ids"]] == choice["token_ids"]

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = run_stream(gateway.url, "generate", {"messages": messages, "max_tokens": 8, "model": "smol"}).terminal["data"]
    assert chat["completions"] == [direct(vllm_gateway, "/chat/completions", {"messages": messages, "max_tokens": 8})["choices"][0]["message"]["content"]]
    ids = [[1, 2, 3, 4]]
    by_ids = run_stream(gateway.url, "generate", {"token_ids": ids, "max_tokens": 4, "model": "smol"}).terminal["data"]
    assert by_ids["completions"] == [direct(vllm_gateway, "/completions", {"prompt": ids, "max_tokens": 4})["choices"][0]["text"]]


# vLLM's float32 CPU kernels against transformers' on the same weights, measured on these prompts:
# at most 3e-5 per token's log-probability and 8e-5 per sum of up to 12 tokens (2026-11-26).
PER_TOKEN_TOLERANCE = 1e-4
PER_SUM_TOLERANCE = 5e-4
PAIRS = [
    ("The capital of France is", " Paris"),
    ("Hello", " world, how are you today?"),
    ("1 2 3 4", " 5 6 7"),
    ("Once upon a time", " there was a princess who lived in a castle."),
]


@pytest.fixture(scope="module")
def plain(vllm_gateway: ServeProcess) -> Any:
    """The same weights in plain transformers (the bundled model, converted once and cached)."""
    import torch
    import transformers as tf

    from backends import model as models

    (spec,) = models.specs([])
    folder = models.converted_folder(spec)
    return tf.AutoTokenizer.from_pretrained(folder), tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_scores_from_vllm_are_transformers_own_within_the_stated_tolerance(vllm_gateway: ServeProcess, plain: Any) -> None:
    import math

    import torch

    tokenizer, model = plain
    got = run_stream(vllm_gateway.url, "loglikelihood", {"prompts": [p for p, _ in PAIRS], "continuations": [c for _, c in PAIRS]})
    assert got.terminal["event"] == "data", got.events[-2:]
    result = got.terminal["data"]
    for (prompt, continuation), ll, greedy in zip(PAIRS, result["ll"], result["is_greedy"]):
        context, cont = tokenizer(prompt)["input_ids"], tokenizer(continuation, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logprobs = model(torch.tensor([context + cont])).logits[0].double().log_softmax(-1)
        rows = [logprobs[len(context) - 1 + k] for k in range(len(cont))]
        assert abs(ll - math.fsum(row[t].item() for row, t in zip(rows, cont))) <= PER_SUM_TOLERANCE, prompt
        assert greedy == all(int(row.argmax()) == t for row, t in zip(rows, cont)), prompt

    prompt = "The capital of France is"
    predicted = run_stream(vllm_gateway.url, "predict", {"prompt": prompt, "top_k": 5}).terminal["data"]["predictions"]
    with torch.no_grad():
        probs = model(torch.tensor([tokenizer(prompt)["input_ids"]])).logits[0, -1].double().softmax(-1)
    top = probs.topk(5)
    assert [p["id"] for p in predicted] == top.indices.tolist()
    assert [p["text"] for p in predicted] == [tokenizer.decode([i]) for i in top.indices.tolist()]
    for p, expected in zip(predicted, top.values.tolist()):
        assert abs(math.log(p["prob"]) - math.log(expected)) <= PER_TOKEN_TOLERANCE, p


def test_the_servers_refusals_are_the_protocols(vllm_gateway: ServeProcess) -> None:
    url = vllm_gateway.url
    before = httpx.get(f"{url}/jobs", timeout=10).json()["jobs"]
    too_long = httpx.post(f"{url}/generate/run", json={"prompts": ["hello " * 3000], "model": "smol"}, timeout=60)
    assert too_long.status_code == 413 and too_long.json()["error"]["code"] == "too_long", too_long.text
    mismatched = httpx.post(f"{url}/loglikelihood/run", json={"prompts": ["a"], "continuations": [" b", " c"], "model": "smol"}, timeout=60)
    assert mismatched.status_code == 422 and mismatched.json()["error"]["field"] == "continuations", mismatched.text
    too_many = httpx.post(f"{url}/predict/run", json={"prompt": "a", "top_k": 500, "model": "smol"}, timeout=60)
    assert too_many.status_code == 422 and too_many.json()["error"]["code"] == "invalid_params", too_many.text  # vLLM's --max-logprobs
    assert "X-Job-Id" not in too_long.headers and httpx.get(f"{url}/jobs", timeout=10).json()["jobs"] == before
    # One vLLM makes once its stream has begun (it checks token ids there): the job's error, with the same code.
    unknown_id = run_stream(url, "generate", {"token_ids": [[10**7]], "model": "smol"})
    assert [e["event"] for e in unknown_id.events].count("error") == 1 and unknown_id.of("data") == []
    error = unknown_id.terminal["data"]["error"]
    assert error["code"] == "invalid_params" and "out of vocabulary" in error["message"], error


def test_a_cancelled_job_stops_the_servers_generation(vllm_gateway: ServeProcess) -> None:
    # What the server generates for this job when nobody stops it (greedy: the same every time).
    whole = direct(vllm_gateway, "/completions", {"prompt": "Once upon a time", "max_tokens": 500})["usage"]["completion_tokens"]
    assert whole >= 100, whole
    generated = server_metric(vllm_gateway, "vllm:generation_tokens_total")
    job = follow(vllm_gateway.url, "generate", {"prompts": ["Once upon a time"], "max_tokens": 500, "model": "smol"})
    wait_until(lambda: sum(e["event"] == "partial" for e in job.events) >= 3, timeout=120, what="the first tokens")
    job_id = job.events[0]["id"].split(":")[0]
    assert httpx.delete(f"{vllm_gateway.url}/jobs/{job_id}", timeout=10).json()["cancelled"] is True
    assert job.ended()["data"]["error"]["code"] == "cancelled"
    wait_until(lambda: server_metric(vllm_gateway, "vllm:num_requests_running") == 0, timeout=120, what="the server to stop")
    # It stopped generating before the end it reaches uncancelled.
    assert server_metric(vllm_gateway, "vllm:generation_tokens_total") - generated < whole


def test_jobs_past_the_servers_share_wait_in_the_gateway_with_their_position(fronting: ServeProcess) -> None:
    url = fronting.url
    first = follow(url, "generate", {"prompts": ["Once upon a time"], "max_tokens": 500})
    wait_until(lambda: "running" in first.statuses(), timeout=120, what="the first job to run")
    second = follow(url, "generate", {"prompts": PROMPTS, "max_tokens": 4})
    wait_until(lambda: "queued" in second.statuses(), timeout=60, what="the second job to wait")
    queued = [e["data"] for e in second.events if e["event"] == "status" and e["data"]["status"] == "QUEUED"]
    assert queued[-1]["position"] == 1
    (server,) = httpx.get(f"{url}/readyz", timeout=10).json()["servers"]
    assert (server["queued"], server["running"], server["jobs"]) == (1, 1, 2)
    httpx.delete(f"{url}/jobs/{first.events[0]['id'].split(':')[0]}", timeout=10).raise_for_status()
    assert first.ended()["data"]["error"]["code"] == "cancelled"
    assert second.ended()["event"] == "data"
    assert second.statuses()[-1] == "running"


def test_a_killed_vllm_server_ends_its_running_jobs_once_and_is_started_again(vllm_gateway: ServeProcess) -> None:
    """Last in the module: the server's restart takes as long as its start."""
    url = vllm_gateway.url
    (before,) = [e for e in httpx.get(f"{url}/readyz", timeout=10).json()["engines"] if e["device"] == "vllm server"]
    job = follow(url, "generate", {"prompts": ["Once upon a time"], "max_tokens": 500, "model": "smol"})
    wait_until(lambda: any(e["event"] == "partial" for e in job.events), timeout=120, what="the first token")
    os.killpg(before["pid"], signal.SIGKILL)  # the server and its engine processes, as a crash would
    error = job.ended()["data"]["error"]
    assert error["code"] == "backend_unavailable" and error["retryable"] is True, error
    # The gateway and its other model go on meanwhile.
    assert run_stream(url, "generate", {"prompts": ["a"], "max_tokens": 2, "model": "tiny"}).terminal["event"] == "data"
    wait_until(lambda: httpx.get(f"{url}/readyz", timeout=10).status_code == 200, timeout=VLLM_START_S, what="the new server")
    (after,) = [e for e in httpx.get(f"{url}/readyz", timeout=10).json()["engines"] if e["device"] == "vllm server"]
    assert after["restarts"] == before["restarts"] + 1 and after["pid"] != before["pid"]
    assert "SIGKILL" in after["last_exit"]
    assert run_stream(url, "generate", {"prompts": PROMPTS, "max_tokens": 4, "model": "smol"}).terminal["event"] == "data"
    # Its lines are the gateway's, naming it.
    assert "[engine=smol (vllm)" in vllm_gateway.output() or '"engine": "smol (vllm)"' in vllm_gateway.output()
