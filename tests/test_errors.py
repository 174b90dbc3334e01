"""Errors found before the stream opens: status, JSON body, the field at fault, and headers.

Every refusal is an ordinary HTTP response whose body is exactly
`{"error": {"code", "message", "retryable", "field"?}}` (PROTOCOL.md §1), and a
refused request leaves nothing behind: the server goes on serving good ones.

The tests that take `srv` or `kind` run against both kinds of gateway (conftest's
KINDS): the local backend, and the remote backend driving a real executor
process, which relays the executor's refusals (413 too_long, 422 from a tool's
own check, 429 queue_full) as its own. One test compares the two kinds' bodies
for the same bad requests. The tests that reach into the gateway's process
(a model load held back by a patch, a model folder refused at construction, a
load that fails) are about the local backend and use it alone.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

import backends.loading
from backends.loading import ModelError
from tests.conftest import (
    make_remote_server,
    make_server,
    parse_sse,
    run_stream,
    start_any,
    wait_until,
)
from tests.support.processes import free_port, start_executor

MAX_BODY = 4096
MAX_PROMPTS = 4
MAX_TOKENS = 100
CONTEXT = 256  # the tiny model's context, in tokens (one per byte, plus BOS)
TIMEOUT = 60

_ABSENT = object()


LIMITS = {"max_body_bytes": MAX_BODY, "max_prompts": MAX_PROMPTS, "max_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def srv(kind: str, executors: Any, tiny_model_path: Path):
    """The module's server with small limits, local or remote: its tests run once with each."""
    s = start_any(kind, executors, tiny_model_path, **LIMITS)
    yield s
    s.stop()


def post(url: str, path: str, *, json_body: Any = _ABSENT, content: Any = None, **kwargs: Any) -> httpx.Response:
    if json_body is not _ABSENT:
        kwargs["json"] = json_body
    else:
        kwargs["content"] = content
    return httpx.post(url + path, timeout=TIMEOUT, **kwargs)


def assert_error(
    r: httpx.Response,
    status: int,
    code: str,
    *,
    field: Any = _ABSENT,
    retryable: bool | None = False,
) -> dict[str, Any]:
    """The protocol's error shape; `field` absent unless one field is at fault."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) <= {"code", "message", "retryable", "field"}, error
    assert {"code", "message", "retryable"} <= set(error), error
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["retryable"], bool)
    if retryable is not None:
        assert error["retryable"] is retryable, error
    if field is _ABSENT:
        assert "field" not in error, error
    else:
        assert error.get("field") == field, error
        # The message names the field and the rule.
        assert error["message"].startswith(f"{field}: "), error
    return error


def assert_serves(url: str) -> None:
    s = run_stream(url, "generate", {"prompts": ["ok"], "max_tokens": 3})
    assert s.status == 200
    assert s.terminal["event"] == "data", s.events
    assert s.terminal["data"]["usage"]["completion_tokens"] == 3


# -- 400 bad_request ---------------------------------------------------------

BAD_BODIES = [
    pytest.param(b"nope", id="not-json"),
    pytest.param(b"", id="empty"),
    pytest.param(b'{"prompts": ["a"]', id="truncated"),
    pytest.param(b"[1]", id="array"),
    pytest.param(b'"prompts"', id="string"),
    pytest.param(b"null", id="null"),
    pytest.param(b"42", id="number"),
    pytest.param(b'{"prompts": ["\xff\xfe"]}', id="not-utf8"),
    pytest.param(b'{"prompts": ["caf\xe9"]}', id="latin1"),
]


@pytest.mark.parametrize("content", BAD_BODIES)
@pytest.mark.parametrize("tool_name", ["generate", "loglikelihood", "predict"])
def test_unreadable_body_is_400(srv, tool_name, content):
    r = post(srv.url, f"/{tool_name}/run", content=content, headers={"content-type": "application/json"})
    assert_error(r, 400, "bad_request")


def test_not_utf8_says_so(srv):
    r = post(srv.url, "/generate/run", content=b'{"prompts": ["\xff"]}')
    assert "UTF-8" in assert_error(r, 400, "bad_request")["message"]


def test_not_an_object_says_so(srv):
    r = post(srv.url, "/generate/run", content=b"[1]")
    assert "object" in assert_error(r, 400, "bad_request")["message"]


BAD_QUERIES = [
    pytest.param({"params": json.dumps({"prompts": ["a"]}), "max_tokens": "3"}, id="params-and-flat"),
    pytest.param({"params": "[1]"}, id="params-not-object"),
    pytest.param({"params": "{nope"}, id="params-not-json"),
]


@pytest.mark.parametrize("query", BAD_QUERIES)
def test_bad_get_query_is_400(srv, query):
    r = httpx.get(srv.url + "/generate/run", params=query, timeout=TIMEOUT)
    assert_error(r, 400, "bad_request")


def test_get_with_params_and_flat_keys_names_the_rule(srv):
    r = httpx.get(
        srv.url + "/generate/run",
        params={"params": json.dumps({"prompts": ["a"]}), "prompts": "b"},
        timeout=TIMEOUT,
    )
    assert "not both" in assert_error(r, 400, "bad_request")["message"]


# -- 404 / 405 ---------------------------------------------------------------


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_unknown_tool_is_404_and_lists_the_tools(srv, method):
    r = httpx.request(method, srv.url + "/nosuchtool/run", json={"prompts": ["a"]}, timeout=TIMEOUT)
    error = assert_error(r, 404, "unknown_tool")
    assert "nosuchtool" in error["message"]
    for name in ("generate", "loglikelihood", "predict"):
        assert name in error["message"]


def test_unknown_tool_wins_over_a_bad_body(srv):
    # The documented order of checks: the tool first, then the body.
    r = post(srv.url, "/nosuchtool/run", content=b"not json at all")
    assert_error(r, 404, "unknown_tool")


@pytest.mark.parametrize("path", ["/nothing", "/generate", "/generate/run/extra", "/jobs/x/y/z"])
def test_unknown_route_is_404_with_the_json_shape(srv, path):
    r = httpx.get(srv.url + path, timeout=TIMEOUT)
    assert_error(r, 404, "not_found")


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("DELETE", "/generate/run", {"GET", "POST"}),
        ("PUT", "/predict/run", {"GET", "POST"}),
        ("POST", "/tools", {"GET"}),
        ("DELETE", "/readyz", {"GET"}),
        ("PATCH", "/healthz", {"GET"}),
    ],
)
def test_wrong_method_is_405_with_the_json_shape_and_allow(srv, method, path, allowed):
    r = httpx.request(method, srv.url + path, timeout=TIMEOUT)
    assert_error(r, 405, "method_not_allowed")
    # RFC 9110 §15.5.6: a 405 must say which methods the resource takes.
    allow = {m.strip() for m in r.headers.get("allow", "").split(",") if m.strip()}
    assert allowed <= allow, r.headers
    assert method not in allow


# -- 413 too_large / too_long ------------------------------------------------


def _body_of_size(size: int) -> bytes:
    """A valid generate body of exactly `size` bytes (padded with whitespace)."""
    body = json.dumps({"prompts": ["hi"], "max_tokens": 2}).encode()
    assert len(body) <= size
    return body[:-1] + b" " * (size - len(body)) + b"}"


def test_body_at_the_limit_is_accepted(srv):
    s = run_stream(srv.url, "generate", content=_body_of_size(MAX_BODY))
    assert s.status == 200
    assert s.terminal["event"] == "data"


def test_body_over_the_limit_is_413_too_large(srv):
    r = post(srv.url, "/generate/run", content=_body_of_size(MAX_BODY + 1))
    error = assert_error(r, 413, "too_large")
    assert str(MAX_BODY) in error["message"]


def test_body_far_over_the_limit_is_413_too_large(srv):
    r = post(srv.url, "/loglikelihood/run", json_body={"prompts": ["a" * (4 * MAX_BODY)], "continuations": ["b"]})
    assert_error(r, 413, "too_large")


def test_chunked_body_without_content_length_is_counted(srv):
    sent_chunks = []

    def chunks():
        yield b'{"prompts": ["'
        for _ in range(MAX_BODY // 512 + 2):
            sent_chunks.append(1)
            yield b"a" * 512
        yield b'"]}'

    with httpx.Client(timeout=TIMEOUT) as client:
        request = client.build_request("POST", srv.url + "/generate/run", content=chunks())
        assert "content-length" not in request.headers
        assert request.headers["transfer-encoding"] == "chunked"
        r = client.send(request)
    assert_error(r, 413, "too_large")


def test_chunked_body_under_the_limit_is_fine(srv):
    def chunks():
        yield b'{"prompts": '
        yield b'["chunk'
        yield b'ed"], "max_tokens": 2}'

    s = run_stream(srv.url, "generate", content=chunks())  # type: ignore[arg-type]
    assert s.status == 200
    assert s.terminal["data"]["usage"]["completion_tokens"] == 2


TOO_LONG = [
    # generate: prompt tokens (bytes + BOS) + max_tokens must fit the context.
    pytest.param("generate", {"prompts": ["hi", "a" * 200], "max_tokens": 56}, "prompts[1]", id="generate"),
    pytest.param("generate", {"prompts": ["a" * 240]}, "prompts[0]", id="generate-default-max-tokens"),
    # Tokens, not characters: "é" is two bytes, so two tokens.
    pytest.param("generate", {"prompts": ["é" * 100], "max_tokens": 56}, "prompts[0]", id="generate-multibyte"),
    pytest.param(
        "loglikelihood",
        {"prompts": ["a", "b" * 200, "c"], "continuations": ["x", "y" * 56, "z"]},
        "prompts[1]",
        id="loglikelihood",
    ),
    pytest.param("predict", {"prompt": "a" * 256}, "prompt", id="predict"),
]


@pytest.mark.parametrize(("tool_name", "body", "field"), TOO_LONG)
def test_input_longer_than_the_context_is_413_too_long(srv, tool_name, body, field):
    r = post(srv.url, f"/{tool_name}/run", json_body=body)
    error = assert_error(r, 413, "too_long", field=field)
    assert str(CONTEXT) in error["message"]
    assert "257" in error["message"]  # the tokens it would need


FITS_EXACTLY = [
    pytest.param("generate", {"prompts": ["hi", "a" * 200], "max_tokens": 55}, id="generate"),
    pytest.param("generate", {"prompts": ["e" * 100], "max_tokens": 56}, id="generate-ascii"),
    pytest.param(
        "loglikelihood", {"prompts": ["a", "b" * 200], "continuations": ["x", "y" * 55]}, id="loglikelihood"
    ),
    pytest.param("predict", {"prompt": "a" * 255}, id="predict"),
]


@pytest.mark.parametrize(("tool_name", "body"), FITS_EXACTLY)
def test_input_that_just_fits_runs(srv, tool_name, body):
    s = run_stream(srv.url, tool_name, body, timeout=120)
    assert s.status == 200, s.raw
    assert s.terminal["event"] == "data", s.terminal


# -- 422 invalid_params ------------------------------------------------------

INVALID = [
    ("generate", {"prompts": ["a"], "max_tokens": 0}, "max_tokens"),
    ("generate", {"prompts": ["a"], "max_tokens": -3}, "max_tokens"),
    ("generate", {"prompts": ["a"], "max_tokens": MAX_TOKENS + 1}, "max_tokens"),
    ("generate", {"prompts": ["a"], "max_tokens": 1.5}, "max_tokens"),
    ("generate", {"prompts": ["a"], "max_tokens": "3"}, "max_tokens"),
    ("generate", {"prompts": ["a"], "temperature": 2.5}, "temperature"),
    ("generate", {"prompts": ["a"], "temperature": -0.1}, "temperature"),
    ("generate", {"prompts": ["a"], "temperature": "hot"}, "temperature"),
    ("generate", {"prompts": ["a"], "top_p": 0}, "top_p"),
    ("generate", {"prompts": ["a"], "top_p": 1.01}, "top_p"),
    ("generate", {"prompts": ["a"], "top_k": 0}, "top_k"),
    ("generate", {"prompts": ["a"], "top_k": 10_000}, "top_k"),  # over the vocabulary (259)
    ("generate", {"prompts": ["a"], "seed": -1}, "seed"),
    ("generate", {"prompts": ["a"], "seed": 2**53}, "seed"),  # past what a JavaScript client holds exactly
    ("generate", {"prompts": ["a"], "stop": [""]}, "stop[0]"),
    ("generate", {"prompts": ["a"], "stop": ["x", 3]}, "stop[1]"),
    ("generate", {"prompts": ["a"], "stop": ["s"] * 17}, "stop"),
    ("generate", {"prompts": ["a"], "stop": ["ok", "s" * 513]}, "stop[1]"),
    ("generate", {"prompts": ["a"], "stop": "x"}, "stop"),
    ("generate", {"prompts": []}, "prompts"),
    ("generate", {"prompts": ["a"] * (MAX_PROMPTS + 1)}, "prompts"),
    ("generate", {"prompts": "a"}, "prompts"),
    ("generate", {"prompts": ["a", 1]}, "prompts[1]"),
    ("generate", {"prompts": None}, "prompts"),
    ("generate", {"prompts": ["a"], "bogus": 1}, "bogus"),
    ("generate", {"max_tokens": 3}, "prompts"),
    ("generate", {}, "prompts"),
    ("loglikelihood", {"prompts": ["a"], "continuations": ["b", "c"]}, "continuations"),
    ("loglikelihood", {"prompts": ["a", "b"], "continuations": ["c"]}, "continuations"),
    ("loglikelihood", {"prompts": ["a"], "continuations": [""]}, "continuations[0]"),
    ("loglikelihood", {"prompts": ["a", "b"], "continuations": ["c", ""]}, "continuations[1]"),
    ("loglikelihood", {"prompts": ["a"]}, "continuations"),
    ("loglikelihood", {"continuations": ["a"]}, "prompts"),
    ("loglikelihood", {"prompts": [], "continuations": []}, "prompts"),
    ("loglikelihood", {"prompts": ["a"] * 5, "continuations": ["b"] * 5}, "prompts"),
    ("loglikelihood", {"prompts": ["a"], "continuations": [7]}, "continuations[0]"),
    ("loglikelihood", {"prompts": ["a"], "continuations": ["b"], "extra": True}, "extra"),
    ("predict", {"prompt": "a", "top_k": 0}, "top_k"),
    ("predict", {"prompt": "a", "top_k": 500}, "top_k"),  # over the vocabulary (259)
    ("predict", {"prompt": "a", "top_k": 1001}, "top_k"),
    ("predict", {"prompt": 1}, "prompt"),
    ("predict", {"prompt": ["a"]}, "prompt"),
    ("predict", {}, "prompt"),
    ("predict", {"prompt": "a", "prompts": ["a"]}, "prompts"),
]


@pytest.mark.parametrize(
    ("tool_name", "body", "field"),
    [pytest.param(t, b, f, id=f"{t}-{i}-{f}") for i, (t, b, f) in enumerate(INVALID)],
)
def test_invalid_params_is_422_naming_the_field(srv, tool_name, body, field):
    r = post(srv.url, f"/{tool_name}/run", json_body=body)
    assert_error(r, 422, "invalid_params", field=field)


INVALID_QUERIES = [
    ([("prompts", "a"), ("max_tokens", "0")], "max_tokens"),
    ([("prompts", "a"), ("max_tokens", "x")], "max_tokens"),
    ([("prompts", "a"), ("max_tokens", "1"), ("max_tokens", "2")], "max_tokens"),
    ([("prompts", "a"), ("max_tokens", str(MAX_TOKENS + 1))], "max_tokens"),
    ([("prompts", "a")] * (MAX_PROMPTS + 1), "prompts"),
    ([("prompts", "a"), ("zzz", "1")], "zzz"),
    ([("max_tokens", "3")], "prompts"),
    ([("params", json.dumps({"prompts": ["a"], "max_tokens": 0}))], "max_tokens"),
]


@pytest.mark.parametrize(("query", "field"), INVALID_QUERIES)
def test_invalid_get_query_is_422_naming_the_field(srv, query, field):
    r = httpx.get(srv.url + "/generate/run", params=query, timeout=TIMEOUT)
    assert_error(r, 422, "invalid_params", field=field)


@pytest.mark.parametrize(
    ("tool_name", "body", "field", "meant"),
    [
        ("generate", {"prompt": ["a"]}, "prompt", "prompts"),
        ("generate", {"prompts": ["a"], "max_token": 3}, "max_token", "max_tokens"),
        ("generate", {"prompts": ["a"], "temprature": 1}, "temprature", "temperature"),
        ("generate", {"messages": [{"rol": "user", "content": "a"}]}, "messages[0].rol", "role"),
        ("predict", {"prompts": "a"}, "prompts", "prompt"),
        ("generate", {"prompts": ["a"], "bogus": 1}, "bogus", None),
    ],
)
def test_an_unknown_field_near_a_real_one_says_which_was_meant(srv, tool_name, body, field, meant):
    for r in (post(srv.url, f"/{tool_name}/run", json_body=body), httpx.get(srv.url + f"/{tool_name}/run", params={"params": json.dumps(body)}, timeout=TIMEOUT)):
        assert_error(r, 422, "invalid_params", field=field)
        message = r.json()["error"]["message"]
        assert (f"did you mean `{meant}`?" in message) if meant else ("did you mean" not in message), message


def test_an_unknown_query_key_near_a_real_one_says_which_was_meant(srv):
    r = httpx.get(srv.url + "/generate/run", params={"prompt": "a"}, timeout=TIMEOUT)
    assert_error(r, 422, "invalid_params", field="prompt")
    assert "did you mean `prompts`?" in r.json()["error"]["message"]


def test_schema_advertises_the_caps_that_are_enforced(srv):
    tools = {t["name"]: t for t in httpx.get(srv.url + "/tools", timeout=TIMEOUT).json()}
    props = tools["generate"]["params_schema"]["properties"]
    assert props["max_tokens"]["maximum"] == MAX_TOKENS
    (prompts,) = [v for v in props["prompts"]["anyOf"] if v["type"] == "array"]  # prompts, or messages
    assert prompts["maxItems"] == MAX_PROMPTS
    # ... and exactly the cap is accepted.
    s = run_stream(srv.url, "generate", {"prompts": ["a"] * MAX_PROMPTS, "max_tokens": 1})
    assert s.terminal["event"] == "data"


# -- 429 queue_full ----------------------------------------------------------


class Live:
    """A stream read as far as the test needs: `until(...)` reads on, `close()` hangs up."""

    def __init__(self, url: str, tool: str, params: Any) -> None:
        self.client = httpx.Client(timeout=TIMEOUT)
        self.response = self.client.send(self.client.build_request("POST", f"{url}/{tool}/run", json=params), stream=True)
        assert self.response.status_code == 200, self.response.read()
        self.chunks = self.response.iter_raw()
        self.raw = b""

    def events(self) -> list[dict[str, Any]]:
        return parse_sse(self.raw[: self.raw.rfind(b"\n\n") + 2])

    def until(self, status: str) -> None:
        """Read until a status frame says `status`."""
        while not any(e["event"] == "status" and e["data"]["status"] == status for e in self.events()):
            self.raw += next(self.chunks)

    def finish(self) -> dict[str, Any]:
        for chunk in self.chunks:
            self.raw += chunk
        self.close()
        return self.events()[-1]

    def close(self) -> None:
        self.response.close()
        self.client.close()


def test_full_queue_is_429_with_retry_after(serve_any, kind):
    # One job runs (a user tool that takes ~30 s unless cancelled), one waits: the queue of 1 is full.
    s = serve_any(kind, queue_size=1)
    running = Live(s.url, "echo", {"text": "running", "repeat": 600, "delay": 0.05})
    queued = None
    try:
        running.until("RUNNING")
        queued = Live(s.url, "echo", {"text": "queued"})
        queued.until("QUEUED")

        r = post(s.url, "/echo/run", json_body={"text": "refused"})
        error = assert_error(r, 429, "queue_full", retryable=True)
        assert "full" in error["message"]
        retry_after = r.headers.get("retry-after")
        assert retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1
        # The GET form meets the same queue.
        r = httpx.get(s.url + "/echo/run", params={"text": "refused"}, timeout=TIMEOUT)
        assert_error(r, 429, "queue_full", retryable=True)
        assert r.headers["retry-after"].isdigit()
        # A bad request is still judged on its own merits before the queue.
        r = post(s.url, "/echo/run", json_body={"text": 1})
        assert_error(r, 422, "invalid_params", field="text")

        # The running job's client goes away: that job stops, and the queued one runs.
        running.close()
        terminal = queued.finish()
        assert (terminal["event"], terminal["data"]) == ("data", {"text": "queued", "tokens": 7})  # bytes + BOS
    finally:
        running.close()
        if queued is not None:
            queued.close()
    # The refused jobs never existed; the queue has room again.
    after = run_stream(s.url, "echo", {"text": "after"})
    assert after.terminal["data"] == {"text": "after", "tokens": 6}


# -- 503 not_ready -----------------------------------------------------------


def test_not_ready_while_the_model_loads(tiny_model_path, monkeypatch):
    # Local only: the load is held back by patching it in this process (remote: the next test).
    release, loading = threading.Event(), threading.Event()
    real_load = backends.loading.load

    def slow_load(*args: Any, **kwargs: Any) -> Any:
        loading.set()
        if not release.wait(timeout=120):
            raise RuntimeError("the test never released the load")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(backends.loading, "load", slow_load)
    s = make_server(tiny_model_path, ready=False)
    try:
        assert loading.wait(timeout=TIMEOUT)
        assert httpx.get(s.url + "/healthz", timeout=TIMEOUT).status_code == 200

        r = httpx.get(s.url + "/readyz", timeout=TIMEOUT)
        assert r.status_code == 503
        assert r.json()["ready"] is False
        assert "loading" in r.json()["reason"]

        r = post(s.url, "/generate/run", json_body={"prompts": ["a"], "max_tokens": 2})
        error = assert_error(r, 503, "not_ready", retryable=True)
        assert "loading" in error["message"]
        assert r.headers["retry-after"] == "5"
        r = httpx.get(s.url + "/predict/run", params={"prompt": "a"}, timeout=TIMEOUT)
        assert_error(r, 503, "not_ready", retryable=True)
        assert r.headers["retry-after"].isdigit()

        # Checks that need no model still answer first, in the documented order.
        assert_error(post(s.url, "/nosuchtool/run", json_body={}), 404, "unknown_tool")
        assert_error(post(s.url, "/generate/run", content=b"[1]"), 400, "bad_request")
        assert_error(
            post(s.url, "/generate/run", json_body={"prompts": ["a"], "max_tokens": 0}),
            422, "invalid_params", field="max_tokens",
        )
        assert httpx.get(s.url + "/tools", timeout=TIMEOUT).status_code == 200

        release.set()
        s.wait_ready(timeout=120)
        r = httpx.get(s.url + "/readyz", timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["ready"] is True
        assert_serves(s.url)
    finally:
        release.set()
        s.stop()


def test_not_ready_until_an_executor_is_up(tiny_model_path, tmp_path):
    # The remote form of the test above: the gateway starts before its executor does.
    port = free_port()
    s = make_remote_server([f"http://127.0.0.1:{port}"], ready=False)
    try:
        r = httpx.get(s.url + "/readyz", timeout=TIMEOUT)
        assert r.status_code == 503
        assert r.json()["ready"] is False
        assert "no executor is ready" in r.json()["reason"]
        assert httpx.get(s.url + "/healthz", timeout=TIMEOUT).status_code == 200

        r = post(s.url, "/generate/run", json_body={"prompts": ["a"], "max_tokens": 2})
        error = assert_error(r, 503, "not_ready", retryable=True)
        assert "no executor is ready" in error["message"]
        assert r.headers["retry-after"] == "5"
        r = httpx.get(s.url + "/predict/run", params={"prompt": "a"}, timeout=TIMEOUT)
        assert_error(r, 503, "not_ready", retryable=True)
        assert r.headers["retry-after"].isdigit()
        # Unlike a local gateway, which knows its tools while the model loads, a remote one
        # learns them from its executors: until one answers it cannot say that a tool does
        # not exist, or judge params, so every run is not_ready (never 404 unknown_tool).
        assert_error(post(s.url, "/nosuchtool/run", json_body={}), 503, "not_ready", retryable=True)
        assert httpx.get(s.url + "/tools", timeout=TIMEOUT).json() == []

        executor = start_executor(tiny_model_path, tmp_path / "executor.log", port=port)
        try:
            s.wait_ready(timeout=120)
            r = httpx.get(s.url + "/readyz", timeout=TIMEOUT)
            assert r.status_code == 200 and r.json()["ready"] is True
            assert {"generate", "predict", "echo"} <= {t["name"] for t in httpx.get(s.url + "/tools").json()}
            assert_error(post(s.url, "/nosuchtool/run", json_body={}), 404, "unknown_tool")
            assert_serves(s.url)
        finally:
            executor.stop()
    finally:
        s.stop()


def test_not_ready_when_the_model_failed_to_load(tmp_path):
    # Local only: a remote gateway reports its executors, not their models (see the report).
    # A folder that exists but holds no model: construction accepts it, loading fails.
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    s = make_server(empty, ready=False)
    try:
        def failed() -> bool:
            r = httpx.get(s.url + "/readyz", timeout=TIMEOUT)
            assert r.status_code == 503, r.text
            return "failed to load" in r.json().get("reason", "")

        wait_until(failed, timeout=120, what="the load to fail")
        assert httpx.get(s.url + "/healthz", timeout=TIMEOUT).status_code == 200
        r = post(s.url, "/generate/run", json_body={"prompts": ["a"], "max_tokens": 2})
        # A failed load does not heal by waiting: not retryable, no Retry-After.
        error = assert_error(r, 503, "not_ready", retryable=False)
        assert "failed to load" in error["message"]
        assert "retry-after" not in r.headers
        r = post(s.url, "/predict/run", json_body={"prompt": "a"})
        assert_error(r, 503, "not_ready", retryable=False)
    finally:
        s.stop()


def test_nonexistent_model_path_is_refused_at_construction(tmp_path):
    with pytest.raises(ModelError, match="not a model folder"):
        make_server(tmp_path / "does" / "not" / "exist", ready=False)


# -- nothing is left behind --------------------------------------------------


def test_server_still_serves_after_every_bad_request(srv):
    for param in BAD_BODIES:
        (content,) = param.values
        assert post(srv.url, "/generate/run", content=content).status_code == 400
    for param in BAD_QUERIES:
        (query,) = param.values
        assert httpx.get(srv.url + "/generate/run", params=query, timeout=TIMEOUT).status_code == 400
    assert post(srv.url, "/nosuchtool/run", json_body={}).status_code == 404
    assert httpx.get(srv.url + "/nothing", timeout=TIMEOUT).status_code == 404
    assert httpx.delete(srv.url + "/generate/run", timeout=TIMEOUT).status_code == 405
    assert post(srv.url, "/generate/run", content=_body_of_size(MAX_BODY + 1)).status_code == 413
    for param in TOO_LONG:
        tool_name, body, _ = param.values
        assert post(srv.url, f"/{tool_name}/run", json_body=body).status_code == 413
    for tool_name, body, _ in INVALID:
        assert post(srv.url, f"/{tool_name}/run", json_body=body).status_code == 422
    for query, _ in INVALID_QUERIES:
        assert httpx.get(srv.url + "/generate/run", params=query, timeout=TIMEOUT).status_code == 422

    # No refused request queued or started anything ...
    ready = httpx.get(srv.url + "/readyz", timeout=TIMEOUT).json()
    assert ready["ready"] is True
    if srv.kind == "local":
        assert ready["queued"] == 0 and ready["running"] == 0
    else:
        assert [e["jobs"] for e in ready["executors"]] == [0]  # nothing sent on, or left in flight
    # ... and good requests of every tool still run.
    assert_serves(srv.url)
    ll = run_stream(srv.url, "loglikelihood", {"prompts": ["a"], "continuations": ["b"]})
    assert ll.terminal["event"] == "data"
    pr = run_stream(srv.url, "predict", {"prompt": "a", "top_k": 3})
    assert len(pr.terminal["data"]["predictions"]) == 3


# -- the same refusals, whichever backend ----------------------------------------------------


# The model a request names, read by a remote gateway to route it, and a tool of the test modules:
# refused where the tool runs, as a local gateway refuses them.
MODELS_AND_USER_TOOLS: list[tuple[str, Any]] = [
    ("/predict/run", {"prompt": "a", "model": ""}),
    ("/predict/run", {"prompt": "a", "model": 5}),
    ("/predict/run", {"prompt": "a", "model": "nope"}),
    ("/predict/run", {"prompt": 5, "model": None}),
    ("/predict/run", [("prompt", "a"), ("model", "")]),
    ("/predict/run", [("prompt", "a"), ("model", "nope")]),
    ("/predict/run", [("prompt", "a"), ("model", "x"), ("model", "y")]),
    ("/predict/run", [("params", json.dumps({"prompt": "a", "model": "x"})), ("model", "y")]),
    ("/predict/run", [("params", json.dumps({"prompt": "a", "top_k": 0})), ("ticket", "t")]),
    ("/echo/run", {"text": "a", "repeat": "3"}),
    ("/echo/run", {"txt": "a"}),
    ("/echo/run", [("text", "a"), ("repaet", "2")]),
    ("/echo/run", [("text", "a"), ("repeat", "x")]),
]


def test_local_and_remote_refuse_alike(serve_any):
    """Every bad request above gets the very same status, body and Retry-After from both kinds."""
    local, remote = serve_any("local", **LIMITS), serve_any("remote", **LIMITS)
    requests: list[tuple[str, str, dict[str, Any]]] = []
    for param in BAD_BODIES:
        (content,) = param.values
        requests.append(("POST", "/generate/run", {"content": content}))
    for param in BAD_QUERIES:
        (query,) = param.values
        requests.append(("GET", "/generate/run", {"params": query}))
    requests += [
        ("POST", "/nosuchtool/run", {"json": {}}),
        ("GET", "/nothing", {}),
        ("DELETE", "/generate/run", {}),
        ("POST", "/generate/run", {"content": _body_of_size(MAX_BODY + 1)}),
    ]
    for param in TOO_LONG:
        tool_name, body, _ = param.values
        requests.append(("POST", f"/{tool_name}/run", {"json": body}))
    for tool_name, body, _ in INVALID:
        requests.append(("POST", f"/{tool_name}/run", {"json": body}))
    for query, _ in INVALID_QUERIES:
        requests.append(("GET", "/generate/run", {"params": query}))
    requests += [("POST", path, {"json": body}) for path, body in MODELS_AND_USER_TOOLS if isinstance(body, dict)]
    requests += [("GET", path, {"params": query}) for path, query in MODELS_AND_USER_TOOLS if isinstance(query, list)]
    for method, path, kwargs in requests:
        a = httpx.request(method, local.url + path, timeout=TIMEOUT, **kwargs)
        b = httpx.request(method, remote.url + path, timeout=TIMEOUT, **kwargs)
        assert 400 <= a.status_code < 500, (method, path, a.text)
        assert (b.status_code, b.json()) == (a.status_code, a.json()), (method, path, kwargs)
        for header in ("content-type", "retry-after", "allow"):
            assert b.headers.get(header) == a.headers.get(header), (method, path, header)


def test_params_nesting_deeper_than_the_cap_is_a_400_not_a_crash(srv):
    from gateway.params import MAX_NESTING

    for depth in (MAX_NESTING + 1, 2000):  # the second, deeper than the decoder could follow
        body = b'{"prompt": "x", "top_k": ' + b"[" * depth + b"]" * depth + b"}"
        r = httpx.post(f"{srv.url}/predict/run", content=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "bad_request"
        assert f"nests {depth + 1} levels deep" in r.json()["error"]["message"]  # the object around it is one more
    ok = '{"prompt": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", "top_k": 2}'
    assert httpx.post(f"{srv.url}/predict/run", content=ok).status_code == 200


def test_every_answer_of_an_inference_server_is_one_of_the_protocols_refusals() -> None:
    """An inference server's non-2xx answer (backends/server_requests.py) becomes the protocol's error:
    a refusal of the params as the server's, 429 as `overloaded`, anything else (its 5xx, a 404 of a
    path it lacks) as 503 `backend_unavailable`, retryable; never an error in building the error."""
    from backends.server_requests import refusal

    for status in (400, 401, 403, 404, 405, 408, 413, 422, 429, 500, 502, 503, 504):
        error = refusal(status, b'{"error": {"message": "no"}}', "the inference server")
        expected = {400: "invalid_params", 413: "invalid_params", 422: "invalid_params", 429: "overloaded"}.get(status, "backend_unavailable")
        assert error.code.value == expected and error.status == (422 if expected == "invalid_params" else 503)
        assert error.message.startswith("the inference server") and error.message.endswith("no")
        assert error.retryable == (expected != "invalid_params")
