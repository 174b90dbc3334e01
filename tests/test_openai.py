"""The OpenAI-compatible routes, driven by the real `openai` SDK against a live gateway serving two models.

Every answer is checked against the gateway's own tools on the same model (their
numbers are checked against plain transformers in test_tools.py and test_models.py),
and `echo` + `logprobs` against the loglikelihood tool and a forward pass by hand.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import make_remote_server, make_server, wait_until
from tests.support.processes import start_executor
from tests.test_observability import scrape, value
from tests.test_tools import Reference, result


@pytest.fixture(scope="module")
def paths(tiny: Callable[..., Path], tiny_model_path: Path) -> dict[str, Path]:
    return {"base": tiny_model_path, "other": tiny("gpt2", seed=1, init=0.2)}


@pytest.fixture(scope="module")
def server(paths: dict[str, Path]):
    s = make_server([f"{name}={path}" for name, path in paths.items()], max_tokens=64)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def refs(paths: dict[str, Path]) -> dict[str, Reference]:
    return {name: Reference(path) for name, path in paths.items()}


def test_models_lists_the_served_models(client) -> None:
    assert [m.id for m in client.models.list()] == ["base", "other"]


@pytest.mark.parametrize("model", ["base", "other"])
def test_a_completion_is_generate_on_that_model(server, client, model) -> None:
    answer = client.completions.create(model=model, prompt=["Hello", "The quick"], max_tokens=6, temperature=0)
    expected = result(server.url, "generate", {"prompts": ["Hello", "The quick"], "max_tokens": 6, "model": model})
    assert [c.text for c in answer.choices] == expected["completions"]
    assert [c.finish_reason for c in answer.choices] == expected["finish_reasons"]
    assert answer.model == model and answer.object == "text_completion"
    assert answer.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == expected["usage"]


def test_sampling_fields_are_honoured(server, client) -> None:
    args: dict[str, Any] = {"model": "base", "prompt": "Hello", "max_tokens": 8, "temperature": 1.3, "top_p": 0.9, "seed": 7}
    first, again = client.completions.create(**args), client.completions.create(**args)
    assert first.choices[0].text == again.choices[0].text
    expected = result(server.url, "generate", {"prompts": ["Hello"], "max_tokens": 8, "temperature": 1.3, "top_p": 0.9, "seed": 7})
    assert first.choices[0].text == expected["completions"][0]
    greedy = client.completions.create(model="base", prompt="Hello", max_tokens=8, temperature=0).choices[0].text
    stop = greedy[2:4]
    stopped = client.completions.create(model="base", prompt="Hello", max_tokens=8, temperature=0, stop=stop).choices[0]
    assert stopped.text == greedy[: greedy.index(stop)] and stopped.finish_reason == "stop"


def test_n_choices_per_prompt_are_generates_n(server, client) -> None:
    args: dict[str, Any] = {"model": "base", "max_tokens": 6, "temperature": 1.5, "seed": 9}
    answer = client.completions.create(prompt=["Hello", "The quick"], n=2, **args)
    expected = result(server.url, "generate", {"prompts": ["Hello", "The quick"], "n": 2, **args})
    assert [(c.index, c.text) for c in answer.choices] == list(enumerate(expected["completions"]))
    streamed = client.completions.create(prompt=["Hello", "The quick"], n=2, stream=True, **args)
    texts = ["", "", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == expected["completions"]
    messages = [{"role": "user", "content": "Hi there"}]
    chat = client.chat.completions.create(messages=messages, n=3, **args)
    expected = result(server.url, "generate", {"messages": messages, "n": 3, **args})
    assert [(c.index, c.message.content) for c in chat.choices] == list(enumerate(expected["completions"]))
    replies = ["", "", ""]
    for chunk in client.chat.completions.create(messages=messages, n=3, stream=True, **args):
        for choice in chunk.choices:
            replies[choice.index] += choice.delta.content or ""
    assert replies == expected["completions"]


def test_token_id_prompts_are_completed_as_given(server, client, refs) -> None:
    ids = refs["base"].encode("Hello")
    answer = client.completions.create(model="base", prompt=ids, max_tokens=5, temperature=0)
    assert answer.choices[0].text == refs["base"].decode(refs["base"].greedy_ids(ids, 5))


def test_a_streamed_completion_adds_up_to_the_whole(client) -> None:
    whole = client.completions.create(model="other", prompt="Hello", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(
        model="other", prompt="Hello", max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
    ))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_echo_puts_the_prompt_before_the_completion(client) -> None:
    plain = client.completions.create(model="base", prompt="Hello", max_tokens=4, temperature=0).choices[0].text
    echoed = client.completions.create(model="base", prompt="Hello", max_tokens=4, temperature=0, echo=True).choices[0].text
    assert echoed == "Hello" + plain
    streamed = client.completions.create(model="base", prompt="Hello", max_tokens=4, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed


def test_chat_is_generate_with_messages(server, client) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    answer = client.chat.completions.create(model="other", messages=messages, max_tokens=7, temperature=0)
    expected = result(server.url, "generate", {"messages": messages, "max_tokens": 7, "model": "other"})
    assert answer.choices[0].message.content == expected["completions"][0]
    assert answer.choices[0].message.role == "assistant" and answer.object == "chat.completion"
    assert answer.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    same = client.chat.completions.create(model="other", messages=[messages[0], *parts], max_tokens=7, temperature=0)
    assert same.choices[0].message.content == expected["completions"][0]


def test_a_streamed_chat_adds_up_to_the_whole(client) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model="base", messages=messages, max_tokens=9, temperature=0)
    chunks = list(client.chat.completions.create(model="base", messages=messages, max_tokens=9, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_stream_is_openais_wire_form_and_holds_a_stream_slot(paths) -> None:
    """`data: {chunk}` frames in CRLF, `: ping - <time>` comments while the job is quiet, `data: [DONE]`
    last, no event names or ids; the stream holds one of --max-streams, as a job's stream does."""
    server = make_server([f"base={paths['base']}"], max_streams=1, ping_interval=0.1)
    gate = threading.Event()

    def wait(*_: Any) -> None:
        gate.wait(30)

    hook = server.backend.served["base"].model.module.register_forward_pre_hook(wait)
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http, http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200 and response.headers["x-job-id"]
            assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
            assert response.headers["cache-control"] == "no-cache" and response.headers["x-accel-buffering"] == "no"
            chunks, raw = response.iter_raw(), b""
            while b": ping - " not in raw:  # the model waits at the gate: the stream is quiet
                raw += next(chunks)
            refused = http.post("/v1/completions", json=body)
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert refused.json()["error"]["code"] == "overloaded" and refused.json()["error"]["type"] == "server_error"
            assert http.post("/generate/run", json={"prompts": ["Hi"]}).json()["error"]["code"] == "overloaded"
            gate.set()
            raw += b"".join(chunks)
        wait_until(lambda: value(scrape(server.url), "streamgate_active_streams") == 0, 10, "the stream's slot to be freed")
    finally:
        gate.set()
        hook.remove()
        server.stop()
    assert raw.endswith(b"\r\n\r\n") and b"\n" not in raw.replace(b"\r\n", b"")
    frames = raw.split(b"\r\n\r\n")[:-1]
    assert all(f.startswith((b"data: ", b": ping - ")) and b"\r\n" not in f for f in frames), frames
    data = [f.removeprefix(b"data: ") for f in frames if f.startswith(b"data: ")]
    assert data[-1] == b"[DONE]"
    chunks_ = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks_)
    assert [c["choices"][0]["finish_reason"] for c in chunks_][-1] == "length"


PAIRS = [("The capital of", " France"), ("Hello", " there"), ("a", "b")]


@pytest.mark.parametrize("model", ["base", "other"])
def test_echo_logprobs_score_the_prompt_as_loglikelihood_does(server, client, refs, model) -> None:
    """What evaluation harnesses send: context and continuation as token ids, max_tokens 0, echo, logprobs."""
    ref = refs[model]
    expected = result(
        server.url, "loglikelihood",
        {"prompts": [p for p, _ in PAIRS], "continuations": [c for _, c in PAIRS], "model": model},
    )
    rows = [(ref.encode(p), ref.encode_continuation(c)) for p, c in PAIRS]
    answer = client.completions.create(
        model=model, prompt=[ctx + cont for ctx, cont in rows], max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    for choice, (ctx, cont), ll, greedy in zip(answer.choices, rows, expected["ll"], expected["is_greedy"]):
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ctx) + len(cont)
        assert sum(lp.token_logprobs[len(ctx):]) == pytest.approx(ll, abs=1e-4)
        # By hand: each token's log-probability from one forward pass.
        by_hand = ref.logprobs(ctx + cont)
        for t in range(1, len(ctx) + len(cont)):
            assert lp.token_logprobs[t] == pytest.approx(by_hand[t - 1, (ctx + cont)[t]].item(), abs=1e-4)
        is_greedy = all(lp.token_logprobs[t] == max(lp.top_logprobs[t].values()) for t in range(len(ctx), len(ctx) + len(cont)))
        assert is_greedy == greedy


def test_one_greedy_token_after_an_echoed_prompt_is_generates_first(server, client, refs) -> None:
    """lm-evaluation-harness asks for max_tokens 1 and drops the last token: that token is generate's first."""
    ids = refs["base"].encode("Hello")
    answer = client.completions.create(model="base", prompt=ids, max_tokens=1, echo=True, logprobs=3, temperature=0)
    lp = answer.choices[0].logprobs
    # Up to 3 alternatives: OpenAI keys them by text, and byte tokens that are not whole characters share "\ufffd".
    assert len(lp.tokens) == len(ids) + 1 and 1 <= len(lp.top_logprobs[-1]) <= 3
    first = result(server.url, "generate", {"token_ids": [ids], "max_tokens": 1})["completions"][0]
    assert lp.tokens[-1] == first
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()))
    assert answer.usage.completion_tokens == 1 and answer.usage.prompt_tokens == len(ids)
    scored = client.completions.create(model="base", prompt="Hello", max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == "Hello"
    assert math.isclose(sum(scored.choices[0].logprobs.token_logprobs[1:]), sum(lp.token_logprobs[1:-1]), abs_tol=1e-4)


@pytest.mark.parametrize(
    ("args", "status", "param"),
    [
        ({"model": "gpt-9"}, 404, "model"),
        ({"n": 17}, 400, "n"),
        ({"n": 2, "echo": True, "logprobs": 1, "max_tokens": 0}, 400, "n"),
        ({"logprobs": 2}, 400, "logprobs"),
        ({"presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"logit_bias": {"5": 1.0}}, 400, "logit_bias"),
        ({"best_of": 3}, 400, "best_of"),
        ({"suffix": "end"}, 400, "suffix"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 65}, 400, "max_tokens"),
        ({"temperature": 3}, 400, "temperature"),
        ({"echo": True, "logprobs": 1, "max_tokens": 5}, 400, "echo"),
        ({"extra_body": {"frobnicate": 1}}, 400, "frobnicate"),
        ({"prompt": [[1, 2], "x"]}, 400, "prompt"),
        ({"prompt": [[100000]]}, 400, "prompt[0]"),
    ],
)
def test_what_cannot_be_honoured_is_refused_in_openais_shape(server, client, args, status, param) -> None:
    request: dict[str, Any] = {"model": "base", "prompt": "Hello", "max_tokens": 4, **args}
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(**request)
    error = caught.value
    assert error.status_code == status, error.body
    assert error.body["type"] == ("invalid_request_error") and error.body["param"] == param
    if status == 404:
        assert error.body["code"] == "model_not_found" and "base, other" in error.body["message"]
    assert httpx.get(server.url + "/healthz").status_code == 200


def test_a_remote_gateway_answers_and_refuses_as_a_local_one(server, paths, tmp_path) -> None:
    """Its tools run on an executor, which decodes the params the routes build: the same answers, the same refusals."""
    executor = start_executor([f"{name}={path}" for name, path in paths.items()], tmp_path / "executor.log", extra=["--max-tokens", "64"])
    gateway = make_remote_server([executor.url], max_tokens=64)
    try:
        for args in ({}, {"model": "other"}, {"max_tokens": 0}, {"temperature": 3}, {"prompt": [[100000]]},
                     {"prompt": "x" * 300}, {"model": "nope"}):
            body = {"model": "base", "prompt": "Hello", "max_tokens": 4, "temperature": 0, **args}
            local, remote = (httpx.post(url + "/v1/completions", json=body, timeout=60) for url in (server.url, gateway.url))
            assert remote.status_code == local.status_code, (args, remote.text)
            if local.status_code == 200:
                assert [c["text"] for c in remote.json()["choices"]] == [c["text"] for c in local.json()["choices"]]
            else:
                assert remote.json() == local.json(), args
    finally:
        gateway.stop()
        executor.stop()


def test_a_prompt_too_long_is_context_length_exceeded(client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="base", prompt="x" * 300, max_tokens=4)
    assert caught.value.body["code"] == "context_length_exceeded" and caught.value.body["param"] == "prompt[0]"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="base", messages=[{"role": "user", "content": "x" * 300}])
    assert caught.value.body["code"] == "context_length_exceeded"


def test_chat_refuses_what_it_cannot_do(client) -> None:
    for extra, param in (
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"logprobs": True}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}], **extra)
        assert caught.value.body["param"] == param


def test_openai_jobs_are_ordinary_jobs_in_the_metrics(server, client) -> None:
    before = value(scrape(server.url), "streamgate_jobs_total", tool="generate", model="other", outcome="succeeded")
    client.completions.create(model="other", prompt="Hello", max_tokens=2)
    after = value(scrape(server.url), "streamgate_jobs_total", tool="generate", model="other", outcome="succeeded")
    assert after == before + 1


def _slow(server):
    return server.backend.served["base"].model.module.register_forward_pre_hook(lambda *_: time.sleep(0.05))


def _cancelled(server, job_id: str) -> bool:
    snapshot = httpx.get(f"{server.url}/jobs/{job_id}").json()
    return snapshot["status"] == "FAILED" and snapshot["terminal"]["data"]["error"]["code"] == "cancelled"


def test_a_client_that_leaves_a_stream_cancels_its_job(server, client) -> None:
    hook = _slow(server)
    try:
        stream = client.completions.create(model="base", prompt="Hello", max_tokens=60, temperature=0, stream=True)
        job_id = stream.response.headers["x-job-id"]
        next(iter(stream))
        stream.close()
        wait_until(lambda: _cancelled(server, job_id), 10, "the job to be cancelled")
    finally:
        hook.remove()


def test_a_client_that_leaves_before_the_answer_cancels_its_job(server) -> None:
    hook = _slow(server)
    try:
        # Greedy: sampled at OpenAI's default temperature, the tiny model may end early on EOS.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                server.url + "/v1/completions",
                json={"model": "base", "prompt": "Hi", "max_tokens": 60, "temperature": 0},
                timeout=1.0,
            )
        jobs = httpx.get(server.url + "/jobs", params={"tool": "generate"}).json()["jobs"]
        job_id = jobs[0]["job_id"]
        wait_until(lambda: _cancelled(server, job_id), 10, "the job to be cancelled")
    finally:
        hook.remove()


# -- no request makes a 5xx -------------------------------------------------------------------------

_COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed", "echo",
                      "logprobs", "best_of", "suffix", "presence_penalty", "logit_bias", "user", "stream_options", "frob"]
_CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "stream", "stop", "logprobs",
                "top_logprobs", "tools", "tool_choice", "response_format", "n", "frob"]
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 300), st.floats(-1, 3, allow_nan=False), st.text(max_size=12),
    st.sampled_from(["base", "other", "nope", "Hello", "text", "json_object"]),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "include_usage"]), inner, max_size=3),
    max_leaves=8,
)
_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]), "content": st.text(max_size=8)}), max_size=3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    route=st.sampled_from(["completions", "chat/completions"]),
    body=st.dictionaries(st.sampled_from(sorted(set(_COMPLETION_FIELDS + _CHAT_FIELDS))), _VALUES | _MESSAGES, max_size=6),
    base=st.booleans(),
)
def test_no_request_gets_a_5xx(server, route, body, base) -> None:
    if base:  # a valid core, so that the fields beside it are reached too
        body = {**({"prompt": "Hi"} if route == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}),
                "max_tokens": 2, **body}
    response = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)
    assert response.status_code < 500, (body, response.text)
    if response.status_code != 200:
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], (body, error)
