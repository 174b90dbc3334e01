"""Traces (gateway/plumbing/tracing.py): one trace per job, across the processes it runs through.

- A job on a real executor (a `streamgate executor` subprocess exporting OTLP to a
  collector on loopback) is one trace: the gateway's request, admission, job and
  download spans, recorded here in the SDK's in-memory exporter, and under the
  gateway's job the executor's admission, job, queued, run, a step span per device
  step and encoding, joined only by the `traceparent` the submit carried.
- A client's `traceparent` is honoured, and JSON log lines name the span they were
  written under.
- A job its client detached from stays in the trace of the request that started it;
  the request that resumes it is a span of its own, naming the job.
- (A job's request to an inference server carries a `traceparent` naming its `inference`
  span: tests/test_inference_servers.py, on a real vLLM server.)
- Without the OTEL variables nothing is recorded, and no log line names a trace.
- The console example of docs/operations.md ("Traces"), run as written: a `streamgate
  serve` subprocess whose engine process inherits its variables; the gateway's and
  the engine's spans of the job, one JSON line each on stdout, in one trace.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.plumbing import tracing
from tests.support import traces
from tests.conftest import make_remote_server, run_stream, wait_until
from tests.support.processes import ROOT, STREAMGATE, clean_env, free_port, start_executor
from tests.test_mcp import held
from tests.test_observability import configured_logs  # noqa: F401  (a fixture)
from tests.support.traces import Span, children, named, one

GIVEN_TRACE = "0af7651916cd43dd8448eb211c80319c"
GIVEN_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{GIVEN_TRACE}-{GIVEN_SPAN}-01"
GENERATE = {"prompts": ["hello there"], "max_tokens": 3}


@pytest.fixture(scope="module")
def collector() -> Iterator[traces.Collector]:
    found = traces.Collector()
    yield found
    found.close()


def the_job_here(spans: list[Span], job_id: str, model: str) -> tuple[Span, Span]:
    """The request span and the job span of `job_id` among a gateway's spans, checked as every job's are."""
    request = one(spans, "POST /{tool}/run", **{"streamgate.job.id": job_id})
    assert request.kind == "SERVER" and request.attributes["http.response.status_code"] == 200
    admission = one(spans, "admission")
    job = one(spans, "job")
    assert admission.parent == job.parent == request.span_id
    assert admission.trace_id == job.trace_id == request.trace_id
    assert job.attributes == {
        "streamgate.job.id": job_id, "streamgate.tool": "generate", "streamgate.model": model, "streamgate.tenant": "addr:127.0.0.1"
    }
    assert job.status == "OK" and admission.status == "UNSET"
    return request, job


def the_run_there(spans: list[Span], parent: Span, job_id: str) -> list[Span]:
    """Under the gateway's job `parent`, the other process's spans of the job: checked, the step spans returned."""
    theirs = [s for s in spans if s.trace_id == parent.trace_id]
    job, admission = one(theirs, "job", **{"streamgate.job.id": job_id}), one(theirs, "admission")
    assert job.parent == admission.parent == parent.span_id
    assert job.service == admission.service != parent.service
    assert [s.name for s in children(theirs, job)] == ["queued", "run"]
    run = one(theirs, "run")
    assert run.attributes == {"streamgate.device": "cpu"}
    under_run = children(theirs, run)
    steps = named(under_run, "step")
    assert [s.name for s in under_run] == ["step"] * len(steps) + ["encoding"]
    assert len(steps) >= 2  # a prompt's pass, then a token at a time
    assert [s.attributes["streamgate.step"] for s in steps] == list(range(len(steps)))
    assert {s.attributes["streamgate.batch.size"] for s in steps} == {1}
    assert one(theirs, "encoding").attributes["streamgate.result.bytes"] > 0
    assert job.status == "OK"
    return steps


def test_a_job_on_a_remote_executor_is_one_trace_joined_by_the_traceparent_it_was_submitted_with(
    tiny_model_path: Path, tmp_path: Path, collector: traces.Collector
) -> None:
    executor = start_executor(tiny_model_path, tmp_path / "executor.log", env=collector.env("executor"))
    try:
        with traces.recording("gateway") as exporter:
            gateway = make_remote_server([executor.url])
            try:
                stream = run_stream(gateway.url, "generate", GENERATE)
                model = gateway.backend.resolve_model(None)
            finally:
                gateway.stop()  # once it is down, every span of its requests has ended
            here = traces.recorded(exporter)
        assert stream.terminal["event"] == "data", stream.raw
        job_id = stream.headers["x-job-id"]
        there = collector.wait_for(lambda spans: named(spans, "job", **{"streamgate.job.id": job_id}))
    finally:
        executor.stop()

    request, job = the_job_here(here, job_id, model)
    assert request.parent is None  # the client sent no traceparent: the trace starts here
    assert {s.trace_id for s in here} == {request.trace_id}  # nothing else the gateway did is traced
    assert [s.name for s in children(here, job)] == ["download"]
    the_run_there(there, job, job_id)
    # The executor's spans came over the wire, from another process: only the traceparent joined them.
    assert {s.service for s in there if s.trace_id == job.trace_id} == {"executor"}


def test_a_clients_traceparent_is_honoured_and_json_log_lines_name_the_span(serve: Any, configured_logs: Any) -> None:
    with traces.recording() as exporter:
        server = serve()
        buffer = configured_logs("json")
        stream = run_stream(server.url, "generate", GENERATE, headers={"traceparent": TRACEPARENT, "X-Request-Id": "traced-1"})
        assert stream.terminal["event"] == "data"
        wait_until(lambda: named(traces.recorded(exporter), "POST /{tool}/run"), what="the request's span")
        spans = traces.recorded(exporter)
    request, job = the_job_here(spans, stream.headers["x-job-id"], server.backend.resolve_model(None))
    assert (request.trace_id, request.parent) == (GIVEN_TRACE, GIVEN_SPAN)
    assert request.attributes["streamgate.request.id"] == "traced-1"
    # With the model in this process (threads), its queue and device spans are the gateway's own.
    assert [s.name for s in children(spans, job)] == ["queued", "run"]
    assert [s.name for s in children(spans, one(spans, "run"))][-1] == "encoding"
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    access = [line for line in lines if line["logger"] == "uvicorn.access" and line.get("request_id") == "traced-1"]
    assert [(line["trace_id"], line["span_id"]) for line in access] == [(GIVEN_TRACE, request.span_id)]


def test_a_detached_job_stays_in_the_trace_of_the_request_that_started_it(serve: Any, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    with traces.recording() as exporter:
        server = serve(tools=[held], detach_grace=60)
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{server.url}/held/run", json={"gate": str(gate)}) as response:
            job_id = response.headers["x-job-id"]
            for line in response.iter_lines():
                if '"status":"RUNNING"' in line:
                    break  # and the client leaves, the job held on its worker
        wait_until(lambda: named(traces.recorded(exporter), "POST /{tool}/run"), what="the first request's span to end")
        gate.touch()
        wait_until(lambda: httpx.get(f"{server.url}/jobs/{job_id}").json()["status"] == "SUCCEEDED", what="the job to end")
        resumed = httpx.get(f"{server.url}/jobs/{job_id}/events", timeout=60)
        assert b"event: data" in resumed.content
        wait_until(lambda: named(traces.recorded(exporter), "GET /jobs/{job_id}/events"), what="the resuming request's span")
        spans = traces.recorded(exporter)
    first, job = one(spans, "POST /{tool}/run"), one(spans, "job")
    assert job.parent == first.span_id and job.trace_id == first.trace_id
    assert first.end < job.end and job.status == "OK"  # it ended after its request, in its trace
    again = one(spans, "GET /jobs/{job_id}/events")
    assert again.trace_id != job.trace_id and again.attributes["streamgate.job.id"] == job_id


@pytest.mark.parametrize(
    "environ",
    [{}, {"OTEL_TRACES_EXPORTER": "none"}, {"OTEL_EXPORTER_OTLP_ENDPOINT": ""}, {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"}],
    ids=["nothing set", "none", "an empty endpoint", "disabled"],
)
def test_without_the_otel_variables_nothing_is_recorded(serve: Any, configured_logs: Any, environ: dict[str, str]) -> None:
    with traces.recording() as exporter:
        assert tracing.configure("streamgate", environ) is False and not tracing.enabled()
        server = serve()
        buffer = configured_logs("json")
        stream = run_stream(server.url, "generate", GENERATE, headers={"traceparent": TRACEPARENT})
        assert stream.terminal["event"] == "data"
        assert server.app.state.backend.in_flight == 0
        assert exporter.get_finished_spans() == ()
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    assert lines and not [line for line in lines if "trace_id" in line or "span_id" in line]


def test_an_exporter_it_does_not_have_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="otlp, console or none"):
        tracing.configure("streamgate", {"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ValueError, match="http/protobuf"):
        tracing.configure("streamgate", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert not tracing.enabled()


# -- the console example in docs/operations.md -------------------------------------------------


def the_docs_example() -> tuple[dict[str, str], list[str], str, dict[str, Any]]:
    """The "Traces" section's commands: the server's variables and flags, and the job curl sends."""
    section = (ROOT / "docs" / "operations.md").read_text().split("\n## Traces\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    serve, curl = shlex.split(block[0]), shlex.split(block[1])
    variables = dict(word.split("=", 1) for word in serve[: serve.index("streamgate")])
    flags = serve[serve.index("serve") + 1 : serve.index(">")]
    assert serve[serve.index(">") + 1] == "spans.jsonl"  # stdout: the spans alone
    path = re.sub(r"^localhost:8000", "", curl[curl.index("-N") + 1])
    return variables, flags, path, json.loads(curl[curl.index("-d") + 1])


def from_console(line: dict[str, Any]) -> Span:
    """A span as the console exporter wrote it."""
    context = line["context"]
    return Span(
        line["name"], context["trace_id"].removeprefix("0x"), context["span_id"].removeprefix("0x"),
        (line["parent_id"] or "").removeprefix("0x") or None, line["resource"]["attributes"]["service.name"],
        line["kind"].removeprefix("SpanKind."), line["status"]["status_code"], 0, 0, line["attributes"],
    )


def test_the_console_example_of_the_docs_prints_the_gateways_and_the_engines_spans_in_one_trace(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    variables, flags, path, body = the_docs_example()
    assert variables == {"OTEL_TRACES_EXPORTER": "console"} and flags == ["--log-format", "json"]
    port = free_port()
    out, err = tmp_path / "spans.jsonl", tmp_path / "stderr.log"
    # The example's server, on the tiny model; its batch exporter sends at once rather than every 5 s.
    env = clean_env(**variables, OTEL_BSP_SCHEDULE_DELAY="50")
    argv = [str(STREAMGATE), "serve", *flags, "--model", f"tiny={tiny_model_path}", "--device", "cpu", "--port", str(port)]
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=stdout, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _ready(url):
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.2)
        stream = run_stream(url, path.removeprefix("/").removesuffix("/run"), body)
        assert stream.terminal["event"] == "data", stream.raw
        job_id = stream.headers["x-job-id"]

        def spans() -> list[Span]:
            lines = out.read_text().splitlines()
            return [from_console(json.loads(line)) for line in lines if line.startswith('{"name"')]

        # The engine's job span ends with its job, before the gateway's; the request's, last.
        wait_until(lambda: named(spans(), "POST /{tool}/run"), timeout=60, what="the request's span on stdout")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    found = spans()
    request, job = the_job_here([s for s in found if s.service == "streamgate"], job_id, "tiny")
    the_run_there([s for s in found if s.service == "streamgate-engine"], job, job_id)
    logged = [json.loads(line) for line in err.read_text().splitlines() if line.startswith('{"ts"')]
    assert [line["trace_id"] for line in logged if line["logger"] == "uvicorn.access" and path in line["message"]] == [request.trace_id]


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
