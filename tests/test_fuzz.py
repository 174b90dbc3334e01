"""Fuzzing the gateway: schemathesis from its own `/openapi.json`, and hypothesis with arbitrary input.

Real servers on the tiny model (one open, one with a token), with small caps so
that the jobs fuzzing starts stay cheap. schemathesis generates requests for
every operation the document lists, valid and invalid, and checks each answer
against it: never a 5xx, only documented statuses, content types and headers,
bodies (error bodies, and each event of a stream) that match their schemas. The
hypothesis tests then throw what no schema describes at every route: any JSON
value, any bytes, any query string, any `Last-Event-ID`, `Idempotency-Key` and
`Authorization`. Every answer is held to the protocol: never a 5xx, a 4xx with
the error body, a stream that ends with exactly one terminal event, and no
`tool_error` from a tool that checked its input. Then the bugs fuzzing found,
pinned; last, the server must still be healthy.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

import httpx
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from backends.base import remote_tool
from gateway.server import openapi
from gateway.params import describe
from gateway.protocol import ErrorBody
from gateway.tools import Context, Model, builtin_tools, collect, tool
from tests.conftest import Server, make_server, parse_sse, wait_until

# Small caps: a generated job runs in milliseconds on the tiny model. max_tokens stays at
# generate's default (16): below it, a request that leaves max_tokens out is refused.
CAPS = dict(max_prompts=2, max_tokens=16, max_sequences=2, max_body_bytes=16 * 1024, queue_size=16, detach_grace=0)
TOKEN = "fuzz-token-0123456789abcdef"
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)


class Span(msgspec.Struct, forbid_unknown_fields=True):
    start: int = 0
    end: int | None = None


class SpansParams(msgspec.Struct, forbid_unknown_fields=True):
    text: str
    spans: list[Span]  # a list of objects: the GET form can only carry it as params=<JSON>
    upper: bool = False


class SpansResult(msgspec.Struct):
    pieces: list[str]


@tool
def spans(model: Model, params: SpansParams, ctx: Context) -> SpansResult:
    """Cut pieces out of a text: a user tool with a nested Struct, to show user tools are in the document."""
    pieces = [params.text[s.start : s.end] for s in params.spans]
    return SpansResult([p.upper() for p in pieces] if params.upper else pieces)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_path: Path) -> Iterator[Server]:
    server = make_server(tiny_model_path, tools=[spans], **CAPS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def auth_server(tiny_model_path: Path) -> Iterator[Server]:
    server = make_server(tiny_model_path, tokens=[f"fuzz={TOKEN}"], **CAPS)
    yield server
    server.stop()


ST_CONFIG = schemathesis.Config.from_dict(
    {
        "output": {"sanitization": {"enabled": False}},  # it hides max_tokens, a "token"
        "max-stream-events": 1000,  # read every stream to its end (the default stops at 20 events)
        "checks": {
            # A schema-valid request may be refused 422 for a rule no schema can state
            # (a layer past the model's depth, a string that is not one token), and JSON
            # Schema counts 1.0 as an integer where msgspec does not.
            "positive_data_acceptance": {"enabled": False},
            # Invalid data may be refused before the app sees it: a query of thousands of list
            # items (past a list's cap) makes a request line over --max-header-bytes: 431.
            "negative_data_rejection": {
                "expected-statuses": ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "431"]
            },
        },
    }
)


# -- the document ---------------------------------------------------------------------


def test_document_lists_the_tools_served(fuzz_server: Server) -> None:
    doc = httpx.get(f"{fuzz_server.url}/openapi.json").json()
    listed = httpx.get(f"{fuzz_server.url}/tools").json()
    # The document has the tools the model can run; /tools lists the others too, with the reason.
    served = {t["name"] for t in listed if t["unsupported"] is None}
    assert {p.split("/")[1] for p in doc["paths"] if p.endswith("/run")} == served
    assert {t["name"] for t in listed} - served == {"fill_mask", "pseudo_loglikelihood"}
    schemas = doc["components"]["schemas"]
    # The user tool's nested Struct is a component of its own, referenced from its params.
    assert schemas["spans.params"]["properties"]["spans"]["items"] == {"$ref": "#/components/schemas/spans.Span"}
    assert "spans.Span" in schemas
    # Its list of objects cannot be query keys, so its GET form takes params=<JSON>.
    (query,) = [p for p in doc["paths"]["/spans/run"]["get"]["parameters"] if p["in"] == "query"]
    assert query["name"] == "params" and query["required"]
    # Caps are in the schema exactly as enforced.
    assert schemas["generate.params"]["properties"]["max_tokens"]["maximum"] == CAPS["max_tokens"]
    stream = doc["paths"]["/generate/run"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    assert stream["schema"] == {"$ref": "#/components/schemas/generate.event"}
    assert "securitySchemes" not in doc["components"]


def test_document_of_remote_tools_is_the_same() -> None:
    # A remote gateway knows its tools only from their published schemas; it must describe them alike.
    local = builtin_tools() + [spans]
    limits = {"max_prompts": 2, "max_tokens": 16, "max_sequences": 2}
    remote = [remote_tool(info) for info in describe(local, limits)]
    assert openapi.document(remote, limits) == openapi.document(local, limits)


def test_document_follows_the_backend_tools() -> None:
    class Learning(SimpleNamespace):
        """A backend whose tools change under it, as a remote one's do; its model runs them all."""

        tools_version = property(lambda self: id(self.tools))

        def unsupported(self, tool: Any) -> None:
            return None

    backend = Learning(tools={"spans": spans})
    handler = openapi.endpoint(backend, {"max_prompts": 2, "max_tokens": 16, "max_sequences": 2}, secured=True)  # type: ignore[arg-type]
    first = json.loads(asyncio.run(handler(None)).body)  # type: ignore[arg-type]
    backend.tools = collect(builtin_tools()[:1])  # a remote backend learning its tools
    second = json.loads(asyncio.run(handler(None)).body)  # type: ignore[arg-type]
    assert "/spans/run" in first["paths"] and "/generate/run" not in first["paths"]
    assert "/generate/run" in second["paths"] and "/spans/run" not in second["paths"]
    assert second["paths"]["/jobs/{job_id}"]["get"]["security"] == [{"bearer": []}, {"ticket": []}]
    assert second["paths"]["/generate/run"]["post"]["security"] == [{"bearer": []}]


# -- schemathesis: every operation, valid and invalid requests --------------------------


def test_schemathesis(fuzz_server: Server) -> None:
    run_schemathesis(fuzz_server, examples=10)


def test_schemathesis_with_tokens(auth_server: Server) -> None:
    # The document declares the security schemes; schemathesis also sends requests without the token.
    run_schemathesis(auth_server, examples=3, headers={"Authorization": f"Bearer {TOKEN}"})


def run_schemathesis(server: Server, *, examples: int, headers: dict[str, str] | None = None) -> None:
    """Valid and invalid requests for every operation of the server's document; fails listing every failure."""
    # schemathesis's pytest loader for a schema from a fixture (`from_fixture`) breaks on
    # pytest 9 (it renames the test node), so the operations are walked here, one @given each.
    api = schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=ST_CONFIG)
    failures: list[str] = []
    for result in api.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def call(case: Any) -> None:
                # requests leaves out a query key whose value is None: the "invalid null" is never sent.
                assume(None not in (case.query or {}).values())
                if "Idempotency-Key" in (case.headers or {}):
                    # Keys are not per tool: a key generated twice attaches to the job another
                    # operation started, whose events are not this operation's.
                    case.headers["Idempotency-Key"] = f"{case.headers['Idempotency-Key']}-{uuid.uuid4().hex}"
                response = case.call_and_validate(headers=headers, timeout=30)
                # What a schema cannot say: one terminal event, last; seqs without gaps.
                try:
                    check_answer(response.status_code, response.headers.get("content-type", [""])[0], response.content)
                except AssertionError as exc:
                    raise AssertionError(f"{exc}\n{case.as_curl_command()}") from None

            try:
                call()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # nothing to get wrong in a request without inputs
            except Exception as exc:  # noqa: BLE001 - gather every operation's failures
                failures.append(f"{operation.method.upper()} {operation.path} ({mode}): {exc}")
    assert not failures, "\n\n".join(failures)


# -- hypothesis: what no schema describes ----------------------------------------------


def check_response(response: httpx.Response) -> None:
    check_answer(response.status_code, response.headers.get("content-type", ""), response.content)


def check_answer(status: int, content_type: str, content: bytes) -> None:
    """What every answer promises: no 5xx, the error body on a 4xx, one terminal event closing a stream."""
    assert status < 500, (status, content[:500])
    if status >= 400:
        assert content_type.startswith("application/json"), content_type
        body = json.loads(content)
        assert list(body) == ["error"], body
        error = body["error"]
        assert {"code", "message", "retryable"} <= set(error) <= {"code", "message", "retryable", "field"}, error
        msgspec.convert(body, ErrorBody)  # a known code, and each key of its type
    elif content_type.startswith("text/event-stream"):
        events = parse_sse(content)
        terminal = [i for i, e in enumerate(events) if e["event"] in ("data", "error")]
        assert terminal == [len(events) - 1], [e["event"] for e in events]
        # Every tool served here checks its input: one that raised anyway has a bug.
        assert events[-1]["event"] == "data" or events[-1]["data"]["error"]["code"] not in ("tool_error", "internal"), events[-1]
        seqs = [int(e["id"].rpartition(":")[2]) for e in events]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
FIELDS = sorted({f for t in [*builtin_tools(), spans] for f in t.params.__struct_fields__})
# Objects of real field names are the likeliest to get past decoding, and so to start jobs.
param_objects = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), json_values, max_size=4)

# Params that several tools take as they are, so that a request with odd headers often starts a job.
valid_params = st.sampled_from([{"prompt": "ab"}, {"prompts": ["a"], "max_tokens": 2}, {"texts": ["a"]}])

# Numbers as a header or query may spell them: any size, any length, and every
# character that str.isdigit() takes (superscripts, other scripts' digits).
digits = (
    st.integers(min_value=0).map(str)
    | st.integers(min_value=1, max_value=6000).map(lambda n: "9" * n)
    | st.text(st.characters(categories=["Nd", "No"]), min_size=1, max_size=3)
)
# Header values as HTTP can carry them: latin-1, no control characters, no surrounding space.
header_text = st.text(st.characters(codec="latin-1", exclude_categories=["Cc"]), max_size=40).map(str.strip)


def latin1(value: str) -> bool:
    return value.isprintable() and all(ord(c) < 256 for c in value)


def event_ids(job_id: str) -> st.SearchStrategy[str]:
    """`Last-Event-ID` values: `<job>:<seq>` for the real job, another and junk, with any seq; or anything."""
    job = st.sampled_from([job_id, uuid.uuid4().hex]) | st.text(max_size=8)
    sep = st.sampled_from([":", ":", ":", "", "::"])
    return st.builds("{}{}{}".format, job, sep, digits) | st.text()


# Tickets (`<name>.<expiry>.<signature>`): the right shape (ZnV6eg is the name "fuzz"), parts of any text.
tickets = st.builds("{}.{}.{}".format, st.sampled_from(["ZnV6eg", ""]) | st.text(max_size=6), digits, st.text(max_size=44)) | st.text()


def query_pairs(job_id: str) -> st.SearchStrategy[tuple[str, str]]:
    """Query keys and values: the gateway's own keys with what they parse, params' fields with anything."""
    gateway = (
        st.tuples(st.just("last_event_id"), event_ids(job_id))
        | st.tuples(st.just("ticket"), tickets)
        | st.tuples(st.just("params"), param_objects.map(json.dumps) | st.text())
        | st.tuples(st.sampled_from(["token", "api_key"]), st.text(max_size=8))
    )
    fields = st.tuples(st.sampled_from(FIELDS) | st.text(max_size=6), st.text(max_size=12) | digits | json_values.map(json.dumps))
    return gateway | fields


def run_paths(server: Server) -> list[str]:
    return [f"/{t}/run" for t in server.backend.tools] + ["/no_such_tool/run", "/jobs/run"]


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def finished_job(fuzz_server: Server, client: httpx.Client) -> str:
    """A job that ran, so that resuming, reading and cancelling meet a real one."""
    response = client.post(f"{fuzz_server.url}/predict/run", json={"prompt": "ab", "top_k": 2})
    assert parse_sse(response.content)[-1]["event"] == "data"
    return response.headers["x-job-id"]


@pytest.fixture(scope="module")
def targets(fuzz_server: Server, finished_job: str) -> list[tuple[str, str]]:
    """Every route, by method and path."""
    job = finished_job
    return (
        [("POST", p) for p in run_paths(fuzz_server)]
        + [("GET", p) for p in run_paths(fuzz_server)]
        + [("GET", f"/jobs/{job}"), ("GET", f"/jobs/{job}/events"), ("DELETE", f"/jobs/{job}")]
        + [("GET", f"/jobs/{uuid.uuid4().hex}/events"), ("GET", "/jobs/x%2Fy/events"), ("PUT", f"/jobs/{job}")]
        + [("GET", p) for p in ("/tools", "/healthz", "/readyz", "/metrics", "/openapi.json", "/")]
        + [("POST", "/auth/ticket"), ("POST", "/tools"), ("GET", "/nowhere")]
    )


def test_any_json_body(fuzz_server: Server, client: httpx.Client) -> None:
    paths = run_paths(fuzz_server) + ["/auth/ticket"]

    @FUZZ
    @given(path=st.sampled_from(paths), body=valid_params | param_objects | json_values, ascii=st.booleans())
    def post(path: str, body: Any, ascii: bool) -> None:
        content = json.dumps(body, ensure_ascii=ascii).encode("utf-8", "surrogatepass")
        check_response(client.post(fuzz_server.url + path, content=content))

    post()


def test_any_bytes_body(fuzz_server: Server, client: httpx.Client) -> None:
    over_limit = b'{"prompt": "' + b"a" * CAPS["max_body_bytes"] + b'"}'

    @FUZZ
    @given(path=st.sampled_from(run_paths(fuzz_server)), body=st.binary(max_size=200) | st.just(over_limit))
    def post(path: str, body: bytes) -> None:
        check_response(client.post(fuzz_server.url + path, content=body))

    post()


def test_any_query(
    fuzz_server: Server, auth_server: Server, client: httpx.Client, targets: list[tuple[str, str]], finished_job: str
) -> None:
    encoded = query_pairs(finished_job).map(lambda kv: f"{quote(kv[0])}={quote(kv[1])}")
    junk = st.lists(st.sampled_from(["%", "=", "&", "+", ";", "a", "0", "?", "#", "%00", "%ff", "%C3%28", "é"]), max_size=8)

    @FUZZ
    @given(
        server=st.sampled_from([fuzz_server, auth_server]),
        target=st.sampled_from(targets),
        query=st.lists(encoded | junk.map("".join), max_size=4).map("&".join),
    )
    def get(server: Server, target: tuple[str, str], query: str) -> None:
        method, path = target
        check_response(client.request(method, f"{server.url}{path}?{query}"))

    get()


def test_any_headers(
    fuzz_server: Server, auth_server: Server, client: httpx.Client, targets: list[tuple[str, str]], finished_job: str
) -> None:
    schemes = st.sampled_from(["Bearer", "bearer", "Basic"])
    tokens = st.sampled_from([TOKEN, TOKEN + "x", ""]) | header_text
    authorization = st.just(f"Bearer {TOKEN}") | header_text | st.builds("{} {}".format, schemes, tokens).map(str.strip)
    headers = st.fixed_dictionaries(
        {},
        optional={
            "Last-Event-ID": event_ids(finished_job).map(str.strip).filter(latin1) | header_text,
            "Idempotency-Key": header_text,
            "Authorization": authorization,
        },
    )
    # Half the time a route that reads these headers: the runs, and the finished job's stream.
    readers = [t for t in targets if t[1].endswith(("/run", f"{finished_job}/events"))]

    @FUZZ
    @given(
        server=st.sampled_from([fuzz_server, auth_server]),
        target=st.sampled_from(readers) | st.sampled_from(targets),
        headers=headers,
        body=valid_params | param_objects,
    )
    def send(server: Server, target: tuple[str, str], headers: dict[str, str], body: Any) -> None:
        method, path = target
        content = json.dumps(body).encode() if method == "POST" else None
        encoded = {k: v.encode("latin-1") for k, v in headers.items()}
        check_response(client.request(method, server.url + path, headers=encoded, content=content))

    send()


# -- what fuzzing found ------------------------------------------------------------------


@pytest.mark.parametrize("seq", ["\u00b2", "\u2460", "9" * 5000, "9" * 19])
def test_last_event_id_seq_that_int_refuses(fuzz_server: Server, client: httpx.Client, finished_job: str, seq: str) -> None:
    # str.isdigit() takes "²" and "①", and digits past int()'s 4,300: each was a 500 `internal`.
    # A seq past 18 digits is refused too: no job has that many events, and Redis stream ids stop at 2**64.
    value = f"{finished_job}:{seq}"
    base = fuzz_server.url
    answers = [
        client.get(f"{base}/predict/run", params={"last_event_id": value}),
        client.get(f"{base}/jobs/{finished_job}/events", params={"last_event_id": value}),
    ]
    if latin1(value):
        header = {"Last-Event-ID": value.encode("latin-1")}
        answers += [
            client.get(f"{base}/predict/run", headers=header),
            client.post(f"{base}/predict/run", headers=header, json={"prompt": "a"}),
            client.get(f"{base}/jobs/{finished_job}/events", headers=header),
        ]
    for response in answers:
        assert response.status_code == 400, response.content
        assert response.json()["error"]["code"] == "bad_request"


@pytest.mark.parametrize("ticket", ["ZnV6eg.1.\u00e9", "ZnV6eg.\u00b2.abc", "ZnV6eg.99.\u2460"])
def test_ticket_with_non_ascii_parts(auth_server: Server, client: httpx.Client, ticket: str) -> None:
    # hmac.compare_digest raises TypeError on a non-ASCII str: a ticket's signature was a 500.
    response = client.get(f"{auth_server.url}/predict/run", params={"prompt": "a", "ticket": ticket})
    assert response.status_code == 401, response.content
    assert response.json()["error"]["code"] == "unauthorized"


@pytest.mark.parametrize("temperature, top_p", [(1e-300, 0.5), (5e-324, 0.5), (1.0, 5e-324), (1e-300, 1e-300)])
def test_generate_with_tiny_sampling_params(fuzz_server: Server, client: httpx.Client, temperature: float, top_p: float) -> None:
    # Each sampled from NaN and ended in `tool_error`: logits / 1e-300 overflowed to inf (or
    # divided by float32's 0), and a top_p that is 0 in float32 dropped every token.
    params = {"prompts": ["ab", "c"], "max_tokens": 3, "temperature": temperature, "top_k": 5, "top_p": top_p}
    events = parse_sse(client.post(f"{fuzz_server.url}/generate/run", json=params).content)
    assert events[-1]["event"] == "data", events[-1]
    greedy = parse_sse(client.post(f"{fuzz_server.url}/generate/run", json={**params, "temperature": 0}).content)
    assert events[-1]["data"]["completions"] == greedy[-1]["data"]["completions"]


# -- afterwards ------------------------------------------------------------------------


def test_still_healthy(fuzz_server: Server, client: httpx.Client) -> None:
    # Last in the module: whatever the fuzzing did, the process serves as before.
    assert client.get(f"{fuzz_server.url}/healthz").status_code == 200
    assert client.get(f"{fuzz_server.url}/readyz").status_code == 200
    response = client.post(f"{fuzz_server.url}/predict/run", json={"prompt": "hello", "top_k": 3})
    assert response.status_code == 200
    last = parse_sse(response.content)[-1]
    assert last["event"] == "data" and len(last["data"]["predictions"]) == 3
    wait_until(lambda: fuzz_server.backend.in_flight == 0, timeout=30, what="no job left running")
