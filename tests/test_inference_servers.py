"""Models on inference servers (backends/inference.py): a real vLLM server the gateway starts
(`--model NAME=vllm:`, the bundled SmolLM2 converted) beside a model in an engine process, and a
second gateway fronting that same server (`--model NAME=openai+http://…/v1`). The job guarantees
hold as for a model here; the numbers are the server's own answer, token for token.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from backends.vllm_server import KV_CACHE_CPU
from tests.support import traces
from tests.conftest import VLLM_START_S, run_stream, server_url, wait_until
from tests.support.processes import ROOT, STREAMGATE, ServeProcess, clean_env, free_port, start_serve
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401
from tests.test_engines import follow
from tests.test_redis_replicas import events_of, read_some, snapshot

pytestmark = pytest.mark.vllm

PROMPTS = ["Hello, my name is", "The capital of France is"]


class Front:
    """A loopback front to the vLLM server: it forwards every request as it is, except that it can
    drop the fields only vLLM knows (a server without vLLM's extensions), and hold one streamed
    completion after its first token until the client leaves, so that a test decides how long a job
    runs rather than the model's end-of-text. It counts the POSTs by path, and the most requests of
    each path that were open at once, streams aside (an answer not streamed is read whole before it is
    sent on, so that the next request its client sends never overlaps it here); `delay` holds each
    request of a path that long first, as a busy server would, so that requests sent together overlap."""

    def __init__(self, upstream: str, drop: tuple[str, ...] = ()) -> None:
        self.drop, self.holding = drop, False
        self.traceparents: list[str | None] = []  # each completion request's, as it came
        self.priorities: list[Any] = []  # each completion request's `priority` field (None: none), as it came
        self.posts: Counter[str] = Counter()
        self.open: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self.delay: dict[str, float] = {}
        self.client = httpx.AsyncClient(base_url=upstream.removesuffix("/v1"), timeout=None)
        app = Starlette(routes=[Route("/{path:path}", self.forward, methods=["GET", "POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, timeout=30, what="the front to start")
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}/v1"

    def hold_next(self) -> None:
        """The next streamed completion passes its first token, then waits until its client leaves."""
        self.holding = True

    def reset(self) -> None:
        self.posts.clear()
        self.peak.clear()
        self.delay.clear()

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        held = streamed = False
        if path.endswith("/completions"):
            self.traceparents.append(request.headers.get("traceparent"))
        if body:
            fields = json.loads(body)
            if path.endswith("/completions"):
                self.priorities.append(fields.get("priority"))
            streamed = bool(fields.get("stream"))
            held, self.holding = self.holding and streamed, self.holding and not streamed
            body = json.dumps({k: v for k, v in fields.items() if k not in self.drop}).encode()
        sent = self.client.build_request(request.method, path, content=body or None, headers={"content-type": "application/json"})
        if request.method == "POST":
            self.posts[path] += 1
        if not streamed:
            self.open[path] += 1
            self.peak[path] = max(self.peak[path], self.open[path])
            try:
                await asyncio.sleep(self.delay.get(path, 0))
                whole = await self.client.send(sent)
            finally:
                self.open[path] -= 1
            return Response(whole.content, whole.status_code, media_type=whole.headers.get("content-type"))
        answer = await self.client.send(sent, stream=True)
        media_type = answer.headers.get("content-type")
        if not held:
            return StreamingResponse(answer.aiter_raw(), answer.status_code, media_type=media_type, background=BackgroundTask(answer.aclose))

        async def first_token_then_hold() -> AsyncIterator[bytes]:
            try:
                async for line in answer.aiter_lines():
                    yield f"{line}\n".encode()
                    if line.startswith("data: {") and any(c.get("text") for c in json.loads(line[6:])["choices"]):
                        yield b"\n"
                        await asyncio.Event().wait()  # until the client leaves (the response is cancelled)
            finally:
                await answer.aclose()  # so the server aborts the request

        return StreamingResponse(first_token_then_hold(), answer.status_code, media_type=media_type)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def front(vllm_gateway: ServeProcess) -> Iterator[Front]:
    started = Front(server_url(vllm_gateway))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def fronting(front: Front, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """A second gateway in front of the same server, letting one job at a time reach it."""
    port = free_port()
    args = ["--model", f"smol=openai+{front.url}", "--max-decoding-jobs", "1", "--port", str(port), "--log-level", "warning"]
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
    assert smol["tools"] == ["generate", "loglikelihood", "logprobs", "predict"]
    assert "inference server" in smol["unsupported"]["logit_lens"] and "embed" in smol["unsupported"]
    assert "logit_lens" in tiny["tools"]
    # Its memory is the budget the gateway gave it, on a machine with other work on it (vLLM's own
    # default would reserve 92% of the host's memory, or refuse to start).
    (server,) = [e for e in httpx.get(f"{vllm_gateway.url}/readyz", timeout=10).json()["engines"] if e["device"] == "vllm server"]
    assert server["kv_cache_bytes"] == KV_CACHE_CPU and server["dtype"] == "float32"
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


def test_n_sampled_completions_of_each_prompt_are_the_servers_own(vllm_gateway: ServeProcess) -> None:
    sampling = {"n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 3}
    done = run_stream(vllm_gateway.url, "generate", {"prompts": PROMPTS, "model": "smol", **sampling})
    own = sorted(direct(vllm_gateway, "/completions", {"prompt": PROMPTS, **sampling})["choices"], key=lambda c: c["index"])
    assert done.terminal["data"]["completions"] == [c["text"] for c in own] and len(own) == 4
    for i, choice in enumerate(own):
        assert "".join(e["data"]["text"] for e in done.of("partial") if e["data"]["index"] == i) == choice["text"]
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = run_stream(vllm_gateway.url, "generate", {"messages": messages, "model": "smol", **sampling}).terminal["data"]
    replies = sorted(direct(vllm_gateway, "/chat/completions", {"messages": messages, **sampling})["choices"], key=lambda c: c["index"])
    assert chat["completions"] == [c["message"]["content"] for c in replies]


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

    from backends import loading as models

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

    scored_texts = ["The capital of France is Paris.", "Once upon a time there was"]
    got = run_stream(vllm_gateway.url, "logprobs", {"prompts": scored_texts, "top": 3, "next_token": True})
    assert got.terminal["event"] == "data", got.events[-2:]
    for text, sequence in zip(scored_texts, got.terminal["data"]["sequences"]):
        ids = tokenizer(text)["input_ids"]
        assert sequence["token_ids"] == ids and sequence["tokens"] == [tokenizer.decode([i]) for i in ids]
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        assert sequence["logprobs"][0] is None
        for t in range(1, len(ids)):
            assert abs(sequence["logprobs"][t] - logprobs[t - 1, ids[t]].item()) <= PER_TOKEN_TOLERANCE, (text, t)
        for row, alternatives in zip([*logprobs[: len(ids) - 1], logprobs[-1]], [*sequence["top"], sequence["next_top"]]):
            best = row.topk(3)
            assert [a["id"] for a in alternatives] == best.indices.tolist()
            assert [a["text"] for a in alternatives] == [tokenizer.decode([i]) for i in best.indices.tolist()]
            assert max(abs(a["logprob"] - v) for a, v in zip(alternatives, best.values.tolist())) <= PER_TOKEN_TOLERANCE
        assert sequence["next_token"]["id"] == int(logprobs[-1].argmax())
    # Token ids are scored as given, and OpenAI's echo with logprobs (what evaluation harnesses send) is the same numbers.
    ids = tokenizer(scored_texts[0])["input_ids"]
    by_ids = run_stream(vllm_gateway.url, "logprobs", {"token_ids": [ids]}).terminal["data"]["sequences"][0]
    # (Another batch on the server: equal to float32 rounding.)
    same = pytest.approx(got.terminal["data"]["sequences"][0]["logprobs"][1:], abs=PER_TOKEN_TOLERANCE)
    assert by_ids["logprobs"][0] is None and by_ids["logprobs"][1:] == same and "top" not in by_ids
    echoed = httpx.post(
        f"{vllm_gateway.url}/v1/completions", json={"model": "smol", "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0}, timeout=60,
    ).json()["choices"][0]["logprobs"]
    assert echoed["token_logprobs"][0] is None and echoed["token_logprobs"][1:] == same

    prompt = "The capital of France is"
    predicted = run_stream(vllm_gateway.url, "predict", {"prompt": prompt, "top_k": 5}).terminal["data"]["predictions"]
    with torch.no_grad():
        probs = model(torch.tensor([tokenizer(prompt)["input_ids"]])).logits[0, -1].double().softmax(-1)
    top = probs.topk(5)
    assert [p["id"] for p in predicted] == top.indices.tolist()
    assert [p["text"] for p in predicted] == [tokenizer.decode([i]) for i in top.indices.tolist()]
    for p, expected in zip(predicted, top.values.tolist()):
        assert abs(math.log(p["prob"]) - math.log(expected)) <= PER_TOKEN_TOLERANCE, p


# What only vLLM knows of a completion request; an OpenAI-compatible server without its extensions ignores them.
VLLM_ONLY = ("return_token_ids", "prompt_logprobs", "return_tokens_as_token_ids", "priority")


@pytest.fixture
def plain_server(vllm_gateway: ServeProcess) -> Iterator[Front]:
    """An OpenAI-compatible server without vLLM's extensions: the vLLM server behind a front that drops
    the fields only vLLM knows from each request (its /tokenize still there)."""
    started = Front(server_url(vllm_gateway), drop=VLLM_ONLY)
    yield started
    started.stop()


def test_a_server_without_vllms_extensions_runs_generate_alone_and_says_why_not_the_others(
    vllm_gateway: ServeProcess, plain_server: Front, tmp_path: Path
) -> None:
    port = free_port()
    gateway = start_serve(["--model", f"smol=openai+{plain_server.url}", "--port", str(port)], clean_env(), port, tmp_path / "gateway.log")
    try:
        (smol,) = httpx.get(f"{gateway.url}/models", timeout=10).json()["models"]
        assert smol["tools"] == ["generate"]
        # Each refused tool names the check on the server that it needs and that failed.
        unsupported = smol["unsupported"]
        assert "log-probabilities keyed by token id: the tokens are given as ' Paris', not by id" in unsupported["predict"]
        assert "prompt log-probabilities: not checked" in unsupported["loglikelihood"]
        assert "each streamed chunk's token ids" not in unsupported["loglikelihood"]
        refused = httpx.post(f"{gateway.url}/logprobs/run", json={"prompts": ["a b"]}, timeout=30)
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "unsupported_by_model"
        # generate: the server's own text, its partials without token ids (the server gives none).
        done = run_stream(gateway.url, "generate", {"prompts": PROMPTS, "max_tokens": 6})
        own = sorted(direct(vllm_gateway, "/completions", {"prompt": PROMPTS, "max_tokens": 6})["choices"], key=lambda c: c["index"])
        assert done.terminal["data"]["completions"] == [c["text"] for c in own]
        assert done.of("partial") and all(e["data"]["token_ids"] == [] for e in done.of("partial"))
    finally:
        gateway.stop()


def lm_eval(base_url: str, tokenizer: Path) -> dict[str, Any]:
    """lm-evaluation-harness's `local-completions` on the test task, as tests/test_lm_eval.py runs it."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "lm_eval_run.py"), base_url, "smol", str(tokenizer)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.lm_eval
def test_lm_eval_through_the_gateway_scores_as_on_the_vllm_server_itself(vllm_gateway: ServeProcess, plain: Any) -> None:
    """The model-comparison recipe: one harness run through the gateway's /v1, one on the server's own."""
    tokenizer = Path(plain[0].name_or_path)
    through, own = lm_eval(vllm_gateway.url, tokenizer), lm_eval(server_url(vllm_gateway).removesuffix("/v1"), tokenizer)
    assert len(through["scored"]) == len(own["scored"]) == 80  # 20 questions, 4 choices each
    for ours, theirs in zip(through["scored"], own["scored"]):
        assert (ours["context"], ours["continuation"]) == (theirs["context"], theirs["continuation"])
        assert ours["ll"] == pytest.approx(theirs["ll"], abs=PER_SUM_TOLERANCE), ours
        assert ours["is_greedy"] == theirs["is_greedy"], ours
    assert through["acc"] == own["acc"]


def test_a_jobs_class_is_its_requests_priority_on_a_server_shown_to_take_one_and_on_no_other(
    front: Front, plain_server: Front, tmp_path: Path
) -> None:
    """The gateway's probe shows whether a server reads and takes a request `priority` (the vLLM server
    behind `front` does; one that drops the field, as a server without vLLM's extensions, does not).
    A lab job's request then carries its class's priority (10, sent as vLLM's -10: served first), a
    student's (priority 0) none; to the other server, no job's request carries one."""
    from tests.conftest import CLASSES, LAB, STUDENT

    (tmp_path / "tokens.toml").write_text(CLASSES)
    sent: dict[str, list[Any]] = {}
    for name, server in (("front", front), ("plain", plain_server)):
        port = free_port()
        args = ["--model", f"smol=openai+{server.url}", "--tokens-file", str(tmp_path / "tokens.toml"), "--port", str(port)]
        gateway = start_serve(args, clean_env(), port, tmp_path / f"{name}.log", headers={"Authorization": f"Bearer {LAB}"})
        try:
            for token in (LAB, STUDENT):
                before = len(server.priorities)
                done = run_stream(gateway.url, "generate", {"prompts": ["Hello"], "max_tokens": 2}, headers={"Authorization": f"Bearer {token}"})
                assert done.terminal["event"] == "data", done.raw[-300:]
                sent.setdefault(name, []).extend(server.priorities[before:])
        finally:
            gateway.stop()
    # A generate job is one completion request (what it tokenizes aside, on /tokenize).
    assert sent == {"front": [-10, None], "plain": [None, None]}


def test_the_servers_refusals_are_the_protocols(vllm_gateway: ServeProcess) -> None:
    url = vllm_gateway.url
    before = httpx.get(f"{url}/jobs", timeout=10).json()["jobs"]
    too_long = httpx.post(f"{url}/generate/run", json={"prompts": ["hello " * 3000], "model": "smol"}, timeout=60)
    assert too_long.status_code == 413 and too_long.json()["error"]["code"] == "too_long", too_long.text
    mismatched = httpx.post(f"{url}/loglikelihood/run", json={"prompts": ["a"], "continuations": [" b", " c"], "model": "smol"}, timeout=60)
    assert mismatched.status_code == 422 and mismatched.json()["error"]["field"] == "continuations", mismatched.text
    # Windows are passes run by the gateway over a model's own states: refused on a server, naming the param.
    windowed = httpx.post(f"{url}/logprobs/run", json={"prompts": ["a b"], "window": 0, "model": "smol"}, timeout=60)
    assert windowed.status_code == 422 and windowed.json()["error"]["field"] == "window", windowed.text
    too_many = httpx.post(f"{url}/predict/run", json={"prompt": "a", "top_k": 500, "model": "smol"}, timeout=60)
    assert too_many.status_code == 422 and too_many.json()["error"]["code"] == "invalid_params", too_many.text  # vLLM's --max-logprobs
    assert "X-Job-Id" not in too_long.headers and httpx.get(f"{url}/jobs", timeout=10).json()["jobs"] == before
    # One vLLM makes once its stream has begun (it checks token ids there): the job's error, with the same code.
    unknown_id = run_stream(url, "generate", {"token_ids": [[10**7]], "model": "smol"})
    assert [e["event"] for e in unknown_id.events].count("error") == 1 and unknown_id.of("data") == []
    error = unknown_id.terminal["data"]["error"]
    assert error["code"] == "invalid_params" and "out of vocabulary" in error["message"], error


# --max-result-bytes of the gateway that prices jobs on a server (`priced`): 64 KiB.
RESULT_BOUND = 64 * 1024


@pytest.fixture(scope="module")
def priced(front: Front, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """A gateway in front of the server that bounds results to RESULT_BOUND, a model of its own beside it."""
    port = free_port()
    args = [
        "--model", f"smol=openai+{front.url}", "--model", f"tiny={tiny_model_path}", "--max-result-bytes", str(RESULT_BOUND),
        "--device", "cpu", "--torch-threads", "1", "--port", str(port), "--log-level", "warning",
    ]
    gateway = start_serve(args, clean_env(), port, tmp_path_factory.mktemp("priced") / "gateway.log")
    yield gateway
    gateway.stop()


def test_a_result_over_the_bound_is_refused_as_on_a_local_model_before_the_server_is_asked_anything(priced: ServeProcess, front: Front) -> None:
    url = priced.url
    ids = [list(range(10, 70))]
    over = [
        ("generate", {"prompts": PROMPTS, "n": 16, "max_tokens": 200, "temperature": 1.0}, "max_tokens"),  # 2 × 16 × 200 tokens
        ("logprobs", {"token_ids": ids, "top": 20}, "top"),  # 60 positions of 20 alternatives each
    ]
    for tool, params, field in over:
        asked = sum(front.posts.values())
        messages = {}
        # A model here writes the scores over the bound as a file instead (tests/test_result_files.py);
        # a job on the server keeps no files.
        for model in ("smol", "tiny") if tool == "generate" else ("smol",):
            refused = httpx.post(f"{url}/{tool}/run", json={**params, "model": model}, timeout=60)
            assert refused.status_code == 413, refused.text
            error = refused.json()["error"]
            assert error["code"] == "too_large" and error["field"] == field, error
            assert "(--max-result-bytes)" in error["message"] and "the limit is 64 KiB" in error["message"], error
            messages[model] = error["message"]
        assert sum(front.posts.values()) == asked, f"{tool}: the server was asked {front.posts}"
        # Priced the same on either kind of model: the tool's own price, the same bound.
        assert len(set(messages.values())) == 1, messages
    assert "X-Job-Id" not in refused.headers and httpx.get(f"{url}/jobs", timeout=10).json()["jobs"] == []
    here = run_stream(url, "logprobs", {"token_ids": ids, "top": 20, "model": "tiny"})
    assert [f["name"] for f in here.terminal["data"]["files"]] == ["logprobs.jsonl"], here.events[-2:]

    # Under the bound, the same jobs run there.
    front.reset()
    ran = run_stream(url, "generate", {"prompts": PROMPTS, "max_tokens": 4, "model": "smol"})
    assert ran.terminal["event"] == "data", ran.events[-2:]
    scored = run_stream(url, "logprobs", {"token_ids": ids, "top": 2, "model": "smol"})
    assert scored.terminal["event"] == "data", scored.events[-2:]
    assert len(scored.terminal["data"]["sequences"][0]["top"]) == len(ids[0]) - 1
    assert front.posts["/v1/completions"] == 2

    # Texts are priced once the server has tokenized them, before the job is queued or its completion sent.
    front.reset()
    refused = httpx.post(f"{url}/logprobs/run", json={"prompts": ["hello " * 60], "top": 20, "model": "smol"}, timeout=60)
    assert refused.status_code == 413 and refused.json()["error"]["field"] == "top", refused.text
    assert (front.posts["/tokenize"], front.posts["/v1/completions"]) == (1, 0), front.posts


def test_many_jobs_tokenizing_at_once_put_a_bounded_number_of_requests_on_the_server(fronting: ServeProcess, front: Front) -> None:
    """Jobs tokenize their texts as they are admitted, before they wait for the server's share: however
    many are admitted at once, their /tokenize requests reach the server a few at a time."""
    from backends.inference import JSON_REQUESTS

    jobs, pairs = 12, 32

    def one(j: int) -> Any:
        prompts = [f"Question {j}.{i}: what number comes after {i}?" for i in range(pairs)]
        return run_stream(fronting.url, "loglikelihood", {"prompts": prompts, "continuations": [f" {i + 1}" for i in range(pairs)]}, timeout=600)

    front.reset()
    front.delay["/tokenize"] = 0.05
    try:
        with ThreadPoolExecutor(jobs) as pool:
            done = list(pool.map(one, range(jobs)))
    finally:
        front.delay.clear()
    assert all(d.terminal["event"] == "data" for d in done), [d.events[-1:] for d in done]
    assert front.posts["/tokenize"] == jobs * pairs * 2
    assert 1 < front.peak["/tokenize"] <= JSON_REQUESTS, front.peak


def test_a_cancelled_job_stops_the_servers_generation(vllm_gateway: ServeProcess) -> None:
    # What the server generates for this job when nobody stops it (greedy: the same every time).
    whole = direct(vllm_gateway, "/completions", {"prompt": "Once upon a time", "max_tokens": 500})["usage"]["completion_tokens"]
    assert whole >= 100, whole
    generated = server_metric(vllm_gateway, "vllm:generation_tokens_total")
    job = follow(vllm_gateway.url, "generate", {"prompts": ["Once upon a time"], "max_tokens": 500, "model": "smol"})
    wait_until(lambda: any(e["event"] == "partial" for e in job.events), timeout=120, what="the first token")
    job_id = job.events[0]["id"].split(":")[0]
    assert httpx.delete(f"{vllm_gateway.url}/jobs/{job_id}", timeout=10).json()["cancelled"] is True
    assert job.ended()["data"]["error"]["code"] == "cancelled"
    wait_until(lambda: server_metric(vllm_gateway, "vllm:num_requests_running") == 0, timeout=120, what="the server to stop")
    # It stopped generating before the end it reaches uncancelled.
    assert server_metric(vllm_gateway, "vllm:generation_tokens_total") - generated < whole


def test_jobs_past_the_servers_share_wait_in_the_gateway_with_their_position(fronting: ServeProcess, front: Front) -> None:
    url = fronting.url
    front.hold_next()
    first = follow(url, "generate", {"prompts": ["Once upon a time"], "max_tokens": 500})
    wait_until(lambda: "running" in first.statuses(), timeout=120, what="the first job to run")
    second = follow(url, "generate", {"prompts": PROMPTS, "max_tokens": 4})
    wait_until(lambda: "queued" in second.statuses(), timeout=60, what="the second job to wait")
    queued = [e["data"] for e in second.events if e["event"] == "status" and e["data"]["status"] == "QUEUED"]
    assert queued[-1]["position"] == 1
    ready = httpx.get(f"{url}/readyz", timeout=10).json()
    (server,) = ready["servers"]
    assert (server["queued"], server["running"], server["jobs"]) == (1, 1, 2)
    # The default model is named as one in an engine is, though a server serves it.
    assert (ready["model"], ready["kind"], ready["queued"], ready["running"]) == ("smol", "causal_lm", 1, 1)
    httpx.delete(f"{url}/jobs/{first.events[0]['id'].split(':')[0]}", timeout=10).raise_for_status()
    assert first.ended()["data"]["error"]["code"] == "cancelled"
    assert second.ended()["event"] == "data"
    assert second.statuses()[-1] == "running"


def test_a_jobs_request_to_the_server_carries_the_jobs_trace(front: Front, tmp_path: Path) -> None:
    """A traced gateway (docs/operations.md, "Traces") in front of the server: the job's request to it
    carries a `traceparent` naming its `inference` span, in the trace the client's own request began."""
    given_trace = "0af7651916cd43dd8448eb211c80319c"
    collector = traces.Collector()
    port = free_port()
    env = clean_env(**collector.env("gateway"))
    gateway = start_serve(["--model", f"smol=openai+{front.url}", "--port", str(port)], env, port, tmp_path / "gateway.log")
    try:
        front.traceparents.clear()
        headers = {"traceparent": f"00-{given_trace}-b7ad6b7169203331-01"}
        done = run_stream(gateway.url, "generate", {"prompts": PROMPTS, "max_tokens": 4}, headers=headers)
        assert done.terminal["event"] == "data", done.events[-2:]
        job_id = done.headers["x-job-id"]
    finally:
        gateway.stop()  # its spans flushed as it exits
    try:
        spans = collector.wait_for(lambda spans: traces.named(spans, "job", **{"streamgate.job.id": job_id}) and traces.named(spans, "inference"))
    finally:
        collector.close()
    (sent,) = front.traceparents
    job = traces.one(spans, "job", **{"streamgate.job.id": job_id})
    inference = traces.one(spans, "inference")
    assert job.trace_id == inference.trace_id == given_trace and inference.parent == job.span_id and inference.kind == "CLIENT"
    assert sent is not None and sent.startswith(f"00-{given_trace}-{inference.span_id}-")


def test_a_job_on_a_vllm_model_is_one_job_per_key_outlives_its_client_and_resumes_where_it_was_left(vllm_gateway: ServeProcess) -> None:
    url, key = vllm_gateway.url, uuid.uuid4().hex
    params = {"prompts": ["Once upon a time"], "max_tokens": 40, "model": "smol"}
    headers, first = read_some(url, "/generate/run", 4, method="POST", json=params, headers={"Idempotency-Key": key})
    job_id = headers["x-job-id"]
    # The client left; the job goes on, detached, and the same key finds it rather than starting another.
    again, _ = read_some(url, "/generate/run", 1, method="POST", json=params, headers={"Idempotency-Key": key})
    assert again["x-job-id"] == job_id
    status, _, rest = events_of(url, job_id, first[-1]["id"])
    assert status == 200 and [e["event"] for e in rest].count("data") == 1 and rest[-1]["event"] == "data"
    assert [int(e["id"].split(":")[1]) for e in rest] == list(range(int(first[-1]["id"].split(":")[1]) + 1, int(rest[-1]["id"].split(":")[1]) + 1))
    text = "".join(e["data"]["text"] for e in first + rest if e["event"] == "partial")
    assert text == rest[-1]["data"]["completions"][0] == direct(vllm_gateway, "/completions", {"prompt": params["prompts"], "max_tokens": 40})["choices"][0]["text"]
    record = snapshot(url, job_id).json()
    assert (record["status"], record["tool"], record["model"]) == ("SUCCEEDED", "generate", "smol"), record
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert re.search(r'^streamgate_jobs_total\{code="",model="smol",outcome="succeeded",tool="generate"\} [1-9]', metrics, re.M)


def test_a_batch_file_runs_on_a_vllm_model_each_line_its_own_job(vllm_gateway: ServeProcess, tmp_path: Path) -> None:
    rows = [{"id": "name", "prompts": [PROMPTS[0]]}, {"id": "long", "prompts": ["hello " * 3000]}, {"id": "capital", "prompts": [PROMPTS[1]]}]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out.jsonl"
    run = subprocess.run(
        [str(STREAMGATE), "run", "generate", "model=smol", "max_tokens=6", "--input", str(source), "--output", str(out), "--url", vllm_gateway.url],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 1, run.stderr  # one line failed
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == ["name", "long", "capital"]
    assert lines[1]["error"]["code"] == "too_long" and lines[1]["error"]["status"] == 413
    own = sorted(direct(vllm_gateway, "/completions", {"prompt": PROMPTS, "max_tokens": 6})["choices"], key=lambda c: c["index"])
    assert [lines[0]["result"]["completions"][0], lines[2]["result"]["completions"][0]] == [c["text"] for c in own]


@pytest.fixture(scope="module")
def replicas(front: Front, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServeProcess]]:
    """Two gateways in front of the same vLLM server, sharing their jobs through one Redis."""
    started = []
    for n in range(2):
        port = free_port()
        args = ["--model", f"smol=openai+{front.url}", "--store", redis_server.url, "--port", str(port), "--log-level", "warning"]
        started.append(start_serve(args, clean_env(), port, tmp_path_factory.mktemp(f"replica{n}") / "gateway.log"))
    yield started
    for gateway in started:
        gateway.stop()


def test_replicas_sharing_redis_read_and_cancel_each_others_vllm_jobs(vllm_gateway: ServeProcess, replicas: list[ServeProcess], front: Front) -> None:
    a, b = replicas
    front.hold_next()
    job = follow(a.url, "generate", {"prompts": ["Once upon a time"], "max_tokens": 500})
    wait_until(lambda: any(e["event"] == "partial" for e in job.events), timeout=120, what="the first token")
    job_id = job.events[0]["id"].split(":")[0]
    assert snapshot(b.url, job_id).json()["status"] == "RUNNING"
    assert httpx.delete(f"{b.url}/jobs/{job_id}", timeout=10).json()["cancelled"] is True
    assert job.ended()["data"]["error"]["code"] == "cancelled"
    wait_until(lambda: server_metric(vllm_gateway, "vllm:num_requests_running") == 0, timeout=120, what="the server to stop")
    # A job run on one replica is read whole, event for event, on the other.
    done = run_stream(a.url, "generate", {"prompts": PROMPTS, "max_tokens": 6})
    job_id = done.events[0]["id"].split(":")[0]
    status, _, replayed = events_of(b.url, job_id)
    assert status == 200 and [(e["id"], e["event"], e["data"]) for e in replayed] == [(e["id"], e["event"], e["data"]) for e in done.events]


ALICE, BOB = "alice-token-0123456789abcdef", "bob-token-0123456789abcdef00"


@pytest.fixture(scope="module")
def tenants(front: Front, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """A gateway with two tenants in front of the server, one job at a time there, two waiting per tenant."""
    port = free_port()
    args = [
        "--model", f"smol=openai+{front.url}", "--max-decoding-jobs", "1", "--max-queued-per-owner", "2",
        "--port", str(port), "--log-level", "warning",
    ]
    env = clean_env(STREAMGATE_TOKENS=f"alice={ALICE} bob={BOB}")
    gateway = start_serve(args, env, port, tmp_path_factory.mktemp("tenants") / "gateway.log", headers={"Authorization": f"Bearer {ALICE}"})
    yield gateway
    gateway.stop()


def test_tenants_take_turns_for_the_servers_share_and_one_past_its_quota_is_refused(tenants: ServeProcess, front: Front) -> None:
    url = tenants.url
    alice, bob = {"Authorization": f"Bearer {ALICE}"}, {"Authorization": f"Bearer {BOB}"}

    def position(job: Any) -> int | None:
        queued = [e["data"].get("position") for e in job.events if e["event"] == "status" and e["data"]["status"] == "QUEUED"]
        return queued[-1] if queued else None

    front.hold_next()
    long = follow(url, "generate", {"prompts": ["Once upon a time"], "max_tokens": 500}, alice)
    wait_until(lambda: "running" in long.statuses(), timeout=120, what="alice's first job to run")
    short = {"prompts": PROMPTS, "max_tokens": 4}
    second = follow(url, "generate", short, alice)
    wait_until(lambda: position(second) == 1, timeout=60, what="alice's second job to wait")
    third = follow(url, "generate", short, alice)
    wait_until(lambda: position(third) == 2, timeout=60, what="alice's third job to wait")
    over = httpx.post(f"{url}/generate/run", json=short, headers=alice, timeout=30)
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limited", over.text
    # Bob's one job waits behind alice's next one only, not behind both.
    theirs = follow(url, "generate", short, bob)
    wait_until(lambda: position(theirs) == 2, timeout=60, what="bob's job to wait")
    wait_until(lambda: position(third) == 3, timeout=60, what="alice's third job to be told it moved back")
    httpx.delete(f"{url}/jobs/{long.events[0]['id'].split(':')[0]}", headers=alice, timeout=10).raise_for_status()
    started = {}
    for name, job, headers in (("second", second, alice), ("bob", theirs, bob), ("third", third, alice)):
        assert job.ended()["event"] == "data"
        started[name] = snapshot_of(url, job.events[0]["id"].split(":")[0], headers)["started"]
    assert started["second"] < started["bob"] < started["third"]


def snapshot_of(url: str, job_id: str, headers: dict[str, str]) -> dict[str, Any]:
    answer = httpx.get(f"{url}/jobs/{job_id}", headers=headers, timeout=10)
    answer.raise_for_status()
    return answer.json()


def test_a_vllm_server_is_sized_and_typed_for_its_device_in_flags_vllm_takes() -> None:
    """On a CPU: a KV cache of the gateway's budget (never a share of the host's memory), and float32
    where the CPU has no bfloat16 instructions; --vllm-args and --dtype win; on a GPU, vLLM sizes its
    cache itself unless told. vLLM's own parser reads every one of these command lines."""
    from backends.vllm_server import vllm_command, vllm_python

    plain = "flags : fpu avx2 fma"
    bf16 = "flags : fpu avx2 avx512f avx512_bf16"
    python = vllm_python(None)

    def args(**kwargs: Any) -> list[str]:
        command = vllm_command(python, "/m", "m", 8001, kwargs.pop("dtype", None), kwargs.pop("extra", []), **kwargs)
        return command[command.index("--model"):]

    cases = {
        "cpu": args(on_gpu=False, cpuinfo=plain),
        "cpu_bf16": args(on_gpu=False, cpuinfo=bf16),
        "cpu_sized": args(on_gpu=False, cpuinfo=plain, kv_cache_bytes=3 << 30),
        "cpu_told": args(on_gpu=False, cpuinfo=plain, dtype="bfloat16", extra=["--gpu-memory-utilization", "0.5"]),
        "gpu": args(on_gpu=True, cpuinfo=plain),
        "gpu_sized": args(on_gpu=True, kv_cache_bytes=8 << 30),
        "fcfs": args(on_gpu=False, cpuinfo=plain, extra=["--scheduling-policy", "fcfs"]),
    }
    script = (
        "import json, sys\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "cases = json.loads(sys.argv[1])\n"
        "print(json.dumps({k: {f: vars(make_arg_parser(FlexibleArgumentParser()).parse_args(a))[f] for f in "
        "('dtype', 'kv_cache_memory_bytes', 'gpu_memory_utilization', 'scheduling_policy')} for k, a in cases.items()}))\n"
    )
    run = subprocess.run([python, "-c", script, json.dumps(cases)], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    parsed = json.loads(run.stdout.splitlines()[-1])
    assert parsed["cpu"]["dtype"] == "float32" and parsed["cpu"]["kv_cache_memory_bytes"] == KV_CACHE_CPU
    assert parsed["cpu_bf16"]["dtype"] == "auto" and parsed["cpu_bf16"]["kv_cache_memory_bytes"] == KV_CACHE_CPU
    assert parsed["cpu_sized"]["kv_cache_memory_bytes"] == 3 << 30
    assert parsed["cpu_told"]["dtype"] == "bfloat16" and parsed["cpu_told"]["kv_cache_memory_bytes"] is None
    assert parsed["cpu_told"]["gpu_memory_utilization"] == 0.5
    assert parsed["gpu"]["dtype"] == "auto" and parsed["gpu"]["kv_cache_memory_bytes"] is None
    assert parsed["gpu_sized"]["kv_cache_memory_bytes"] == 8 << 30
    # Scheduled by request priority (the job's class of users), unless --vllm-args says otherwise.
    assert {k: v["scheduling_policy"] for k, v in parsed.items()} == {**dict.fromkeys(cases, "priority"), "fcfs": "fcfs"}


def test_a_vllm_server_that_cannot_start_is_not_started_again_and_readyz_says_why(tmp_path: Path) -> None:
    """A server that fails before it is ready, twice the same way, fails for its settings: it is not
    started again in a loop; /readyz is 503 with the reason, and the log says so once."""
    port = free_port()
    args = ["--model", "smol=vllm:", "--vllm-args", "--max-model-len 100000000", "--port", str(port), "--log-level", "warning"]
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(STREAMGATE), "serve", *args], cwd=ROOT, env=clean_env(), stdout=out, stderr=subprocess.STDOUT)
    gateway = ServeProcess(proc, f"http://127.0.0.1:{port}", log)
    try:
        def engine() -> dict[str, Any]:
            try:
                return httpx.get(f"{gateway.url}/readyz", timeout=10).json()["engines"][0]
            except httpx.HTTPError:
                return {}

        wait_until(lambda: engine().get("state") == "given up", timeout=VLLM_START_S, what="the gateway to give up on the server")
        ready = httpx.get(f"{gateway.url}/readyz", timeout=10)
        assert ready.status_code == 503
        failed = engine()
        assert failed["restarts"] == 1 and "max_model_len" in failed["last_exit"], failed
        assert "not started again" in failed["problem"] and "max_model_len" in failed["problem"]
        refused = httpx.post(f"{gateway.url}/generate/run", json={"prompts": ["a"], "max_tokens": 1}, timeout=10)
        assert refused.status_code == 503 and "not started again" in refused.json()["error"]["message"]
        assert gateway.output().count("not started again") == 1
    finally:
        gateway.stop()


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
