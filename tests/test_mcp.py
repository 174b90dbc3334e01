"""`/mcp`, driven by the official `mcp` SDK's own client against a live gateway on loopback.

Both wire eras the SDK speaks: the 2026-07-28 per-request envelope (its default, `mode="auto"`)
and the 2025 initialize handshake (`mode="legacy"`, the Inspector's default; web/test/mcp.test.ts
drives the Inspector itself). Long jobs are held by gate files the test creates when it has seen
what it waits for, never by timing. The SDK has no client for the tasks extension (SEP-2663):
`TasksExtension` below is one, on the SDK's own extension seam (`ClientExtension`, `ResultClaim`),
and its requests go through the SDK's session as any other. Only the hostile-input tests write
requests by hand: HTTP that no client would send, and a client that stops reading.
"""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal

import anyio
import httpx
import httpx2
import msgspec
import mcp_types as types
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp import Client
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from gateway.protocol import Event, EventType, Progress, Status, StatusFrame, encode
from gateway.server.mcp import INLINE_RESULT_BYTES
from gateway.server.mcp_frames import Rising
from gateway.tools import Context, Model, tool
from tests.conftest import make_server, wait_until
from tests.support.processes import ROOT
from tests.support.result_tools import sized
from tests.test_slow_readers import big
from tests.test_tools import result as run_result

TASKS = "io.modelcontextprotocol/tasks"


# -- tools whose jobs last as long as the test wants -------------------------------------------------


def _web_tool(module: str, name: str) -> Any:
    """A tool of the web tests' support folder (loaded there with `--tools`): one definition for both suites."""
    spec = importlib.util.spec_from_file_location(module, ROOT / "web" / "test" / "support" / f"{module}.py")
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[module] = loaded  # where msgspec resolves its Structs' annotations
    spec.loader.exec_module(loaded)
    return getattr(loaded, name)


held = _web_tool("held_tools", "held")  # holds the model's worker until its gate file exists


class StepParams(msgspec.Struct, forbid_unknown_fields=True):
    gates: str  # a folder: step i waits for the file named i in it
    steps: int = 3


class StepPartial(msgspec.Struct):
    index: int
    text: str


class StepResult(msgspec.Struct):
    steps: int


@tool(partial=StepPartial)
def stepped(model: Model, params: StepParams, ctx: Context) -> StepResult:
    """Take each step once its gate exists: a log line, its text as a partial, and its progress."""
    for i in range(params.steps):
        while not (Path(params.gates) / str(i)).exists():
            ctx.raise_if_cancelled()
            time.sleep(0.01)
        ctx.log(f"step {i}", level="warning" if i == 0 else "info")
        ctx.partial(StepPartial(0, f"step {i};"))
        ctx.progress(i + 1, params.steps, "steps")
    return StepResult(params.steps)


# -- the tasks extension, on the SDK's client --------------------------------------------------------


class CreateTaskResult(types.Result):
    result_type: Literal["task"] = "task"
    task_id: str
    status: str
    status_message: str | None = None
    created_at: str
    last_updated_at: str
    ttl_ms: int | None = None
    poll_interval_ms: int | None = None


class TaskState(types.Result):
    task_id: str
    status: str
    status_message: str | None = None
    ttl_ms: int | None = None
    poll_interval_ms: int | None = None
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class TaskId(types.RequestParams):
    task_id: str


class GetTask(types.Request[TaskId, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    params: TaskId
    name_param = "taskId"


class CancelTask(types.Request[TaskId, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    params: TaskId
    name_param = "taskId"


async def start_task(client: Client, name: str, arguments: dict[str, Any]) -> CreateTaskResult:
    """A call answered as a task, not finished by the extension: the task as created."""
    created = await client.session.call_tool(name, arguments, allow_claimed=True)
    assert isinstance(created, CreateTaskResult), created
    return created


async def get_task(client: Client, task_id: str) -> TaskState:
    return await client.session.send_request(GetTask(params=TaskId(task_id=task_id)), TaskState)


async def cancel_task(client: Client, task_id: str) -> None:
    await client.session.send_request(CancelTask(params=TaskId(task_id=task_id)), types.EmptyResult)


async def until_task(client: Client, task_id: str, done: Any) -> TaskState:
    """Poll `tasks/get` at the task's interval until `done(state)`."""
    with anyio.fail_after(60):
        while not done(state := await get_task(client, task_id)):
            await anyio.sleep((state.poll_interval_ms or 1000) / 1000)
    return state


class TasksExtension(ClientExtension):
    """Declares the extension; a task a call is answered with is polled to its end, as SEP-2663 asks of clients."""

    identifier = TASKS

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=CreateTaskResult, resolve=self._resolve)]

    async def _resolve(self, created: CreateTaskResult, ctx: ClaimContext) -> types.CallToolResult:
        with anyio.fail_after(60):
            while True:
                state = await ctx.session.send_request(GetTask(params=TaskId(task_id=created.task_id)), TaskState)
                if state.status == "completed":
                    return types.CallToolResult.model_validate(state.result)
                if state.status in ("cancelled", "failed"):
                    return types.CallToolResult(content=[types.TextContent(type="text", text=state.status)], is_error=True)
                await anyio.sleep((state.poll_interval_ms or 1000) / 1000)


# -- the gateway ------------------------------------------------------------------------------------

TOKENS = """
[tokens.alice]
token = "alice-token-0123456789"
[tokens.bob]
token = "bob-token-0123456789ab"
tools = ["held"]
[tokens.carol]
token = "carol-token-0123456789"
max_concurrent = 1
"""


@pytest.fixture(scope="module")
def paths(tiny: Callable[..., Path], tiny_model_path: Path) -> dict[str, Path]:
    return {"base": tiny_model_path, "other": tiny("gpt2", seed=1, init=0.2)}


@pytest.fixture(scope="module")
def server(paths: dict[str, Path]):
    # One job at a time on a model: a held job keeps those sent after it in line.
    s = make_server([f"{name}={path}" for name, path in paths.items()], tools=[held, stepped], max_batch_size=1)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def secured(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens.toml"
    tokens.write_text(TOKENS)
    s = make_server([f"base={tiny_model_path}"], tools=[held], max_batch_size=1, tokens_file=str(tokens))
    yield s
    s.stop()


@contextlib.asynccontextmanager
async def connect(url: str, *, token: str | None = None, tasks: bool = False, **options: Any) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=120)) as http:
        transport = streamable_http_client(url + "/mcp", http_client=http)
        async with Client(transport, extensions=[TasksExtension()] if tasks else None, **options) as client:
            yield client


def jobs(url: str, token: str | None = None, **query: str) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(f"{url}/jobs", params=query, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["jobs"]


async def until_job(url: str, job_id: str, done: Any, token: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with anyio.fail_after(60):
        while not done(job := httpx.get(f"{url}/jobs/{job_id}", headers=headers, timeout=30).json()):
            await anyio.sleep(0.05)
    return job


def cancelled(job: dict[str, Any]) -> bool:
    return job["status"] == "FAILED" and job["terminal"]["data"]["error"]["code"] == "cancelled"


# -- the docs' example -----------------------------------------------------------------------------


def test_the_python_example_of_the_docs_runs_as_written(server) -> None:
    """docs/agents.md's "From Python", against a gateway on the tiny model: the tools listed, a call
    with its progress printed, and its completion and job id."""
    import re
    import subprocess

    page = (ROOT / "docs" / "agents.md").read_text()
    example = re.search(r"## From Python\n.*?```python\n(.*?)```", page, re.S).group(1)
    assert "http://127.0.0.1:8000/mcp" in example
    run = subprocess.run(
        [sys.executable, "-c", example.replace("http://127.0.0.1:8000", server.url)], capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert "'generate'" in lines[0] and "'generate__other'" in lines[0]
    assert any(re.match(r"\d+(\.\d+)?/\d+(\.\d+)?: ", line) for line in lines[1:-1])  # progress, value/total
    completions, job_id = lines[-1].rsplit(" ", 1)
    assert completions.startswith("[") and httpx.get(f"{server.url}/jobs/{job_id}", timeout=30).json()["status"] == "SUCCEEDED"


# -- tools -----------------------------------------------------------------------------------------


async def test_each_tool_is_listed_for_each_model_that_runs_it_with_the_tools_schemas(server) -> None:
    async with connect(server.url) as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
    for model, suffix in (("base", ""), ("other", "__other")):
        described = httpx.get(f"{server.url}/tools", params={"model": model}).json()
        runnable = [d for d in described if d["unsupported"] is None]
        assert sorted(n for n in listed if n.endswith(suffix) and (suffix or "__" not in n)) == sorted(
            d["name"] + suffix for d in runnable
        )
        for d in runnable:
            tool = listed[d["name"] + suffix]
            expected = {**d["params_schema"], "properties": dict(d["params_schema"]["properties"])}
            del expected["properties"]["model"]  # the tool's name chooses the model
            assert tool.input_schema == expected
            assert tool.output_schema == d["result_schema"]
            assert d["description"] in tool.description and repr(model) in tool.description
        # What the model cannot run is not a tool: the tiny causal model has no masked-LM tools.
        for d in described:
            if d["unsupported"] is not None:
                assert d["name"] + suffix not in listed


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_a_call_answers_what_the_same_run_answers(server, mode) -> None:
    calls = [
        ("generate", {"prompts": ["Hello", "The quick"], "max_tokens": 6}),
        ("logprobs", {"prompts": ["Hello there"], "top": 3}),
    ]
    async with connect(server.url, mode=mode) as client:
        for name, arguments in calls:
            for model, suffix in (("base", ""), ("other", "__other")):
                answer = await client.call_tool(name + suffix, arguments)
                assert not answer.is_error, answer
                expected = run_result(server.url, name, {**arguments, "model": model})
                assert answer.structured_content == expected
                assert msgspec.json.decode(answer.content[0].text) == expected
                job_id = answer.meta["streamgate/job_id"]
                snapshot = httpx.get(f"{server.url}/jobs/{job_id}").json()
                assert snapshot["tool"] == name and snapshot["model"] == model and snapshot["terminal"]["data"] == expected


# -- progress and logs -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_progress_rises_through_the_queue_and_the_run_with_partials_and_logs(server, tmp_path, mode) -> None:
    gates = tmp_path / "steps"
    gates.mkdir()
    (gates / "0").touch()
    first, second = tmp_path / "first", tmp_path / "second"
    seen: list[tuple[float, float | None, str | None]] = []
    logs: list[tuple[str, str]] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append((value, total, message))
        text = message or ""
        if "queued: 2 in line" in text:
            first.touch()  # the job ahead of the one ahead ends: this one moves up a place
        if "queued: 1 in line" in text:
            second.touch()
        for i in range(3):
            if f"step {i};" in text:
                (gates / str(i + 1)).touch()

    async def log(params: types.LoggingMessageNotificationParams) -> None:
        logs.append((params.level, params.data))

    async with connect(server.url, tasks=True) as holder:
        # Two jobs ahead on the base model's one worker: one running, one waiting.
        running = await start_task(holder, "held", {"gate": str(first)})
        await until_task(holder, running.task_id, lambda s: (s.status_message or "").startswith("running"))
        waiting = await start_task(holder, "held", {"gate": str(second)})
        await until_task(holder, waiting.task_id, lambda s: s.status_message == "queued: 1 in line")
        async with connect(server.url, mode=mode, log_level="debug", logging_callback=log) as client:
            answer = await client.call_tool("stepped", {"gates": str(gates)}, progress_callback=progress)

    assert not answer.is_error and answer.structured_content == {"steps": 3}
    values = [value for value, _, _ in seen]
    assert values == sorted(set(values)), seen  # every notification rises
    # Queued: places moved up, from 0.
    assert seen[0][0] == 0 and "queued: 2 in line" in seen[0][2]
    assert next(value for value, _, message in seen if "queued: 1 in line" in (message or "")) == 1
    # Running: the tool's done and total as it reports them, the last one its whole.
    assert seen[-1][:2] == (3, 3)
    messages = "".join(message or "" for _, _, message in seen)
    assert messages.index("step 0;") < messages.index("step 1;") < messages.index("step 2;")
    assert logs == [("warning", "step 0"), ("info", "step 1"), ("info", "step 2")]


def test_progress_only_rises_and_never_passes_the_total() -> None:
    def status(seq: int, state: Status, **fields: Any) -> Event:
        return Event("j", seq, EventType.STATUS, encode(StatusFrame("j", seq, state, 0.0, **fields)))

    def partial(seq: int, obj: Any) -> Event:
        return Event("j", seq, EventType.PARTIAL, msgspec.json.encode(obj))

    rising = Rising()
    batches = [
        [status(1, Status.RECEIVED), status(2, Status.QUEUED, position=2, queue_size=2)],
        [status(3, Status.QUEUED, position=1)],
        [status(4, Status.RUNNING)],
        [partial(5, {"index": 0, "text": "a"})],
        [status(6, Status.RUNNING, progress=Progress(1, 2, "steps"))],  # 1 is no rise: its message only
        [status(7, Status.RUNNING, progress=Progress(2, 2, "steps"))],
        [partial(8, {"index": 1, "text": "tail"})],  # at the total: no room, the text waits
        [partial(9, [1, 2]), partial(10, {"text": 3})],  # a tool's own partials, no text in them
        [status(11, Status.RUNNING, progress=Progress(3, 4))],  # the text rides on the next rise
    ]
    assert [rising.step(batch) for batch in batches] == [
        (0.0, None, "received: job j; queued: 2 in line of 2"),
        (1.0, None, "queued: 1 in line"),
        (1.5, None, "running"),
        (1.75, None, "a"),
        (1.875, 2, "running: 1/2 steps"),
        (2.0, 2, "running: 2/2 steps"),
        None,
        None,
        (3.0, 4, "[1] tail"),
    ]


# -- refusals and errors ---------------------------------------------------------------------------


async def test_a_refusal_is_an_error_result_with_the_runs_code(server) -> None:
    async with connect(server.url) as client:
        cases = [
            ("generate", {"prompts": ["Hello"], "max_tokens": 0}, "invalid_params", "max_tokens"),
            ("generate", {"prompts": ["Hello"], "max_tokkens": 3}, "invalid_params", "max_tokkens"),
            ("generate__other", {"prompts": ["Hello"], "model": "base"}, "invalid_params", "model"),
            ("generate", {"prompts": ["x" * 5000], "max_tokens": 2}, "too_long", "prompts[0]"),
        ]
        for name, arguments, code, field in cases:
            answer = await client.call_tool(name, arguments)
            assert answer.is_error and answer.structured_content is None
            error = answer.meta["streamgate/error"]
            assert (error["code"], error.get("field")) == (code, field), error
            assert answer.content[0].text == f"{code}: {error['message']}"
            if field != "model":  # a run names its model in the body: there a model is no refusal
                run = httpx.post(f"{server.url}/{name}/run", json=arguments)
                assert 400 <= run.status_code < 500 and run.json()["error"] == error
        # A tool nobody serves is the protocol's error, as MCP has it.
        with pytest.raises(MCPError) as raised:
            await client.call_tool("fill_mask", {"texts": ["a [MASK]"]})
        assert raised.value.error.code == types.INVALID_PARAMS


async def test_an_error_event_is_an_error_result_with_its_code(server, tmp_path) -> None:
    before = {j["job_id"] for j in jobs(server.url)}
    async with connect(server.url) as client:
        async def progress(value: float, total: float | None, message: str | None) -> None:
            if message and "running" in message:
                (new,) = [j for j in jobs(server.url, state="active") if j["job_id"] not in before]
                assert httpx.delete(f"{server.url}/jobs/{new['job_id']}").json()["cancelled"]

        answer = await client.call_tool("held", {"gate": str(tmp_path / "never")}, progress_callback=progress)
    assert answer.is_error and answer.meta["streamgate/error"]["code"] == "cancelled"
    assert cancelled(await until_job(server.url, answer.meta["streamgate/job_id"], lambda j: j["status"] == "FAILED"))


# -- cancelling ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_a_call_the_client_cancels_cancels_its_job(server, tmp_path, mode) -> None:
    """2026-07-28: the client closes the call's stream. The handshake era: it posts `notifications/cancelled`."""
    before = {j["job_id"] for j in jobs(server.url)}
    async with connect(server.url, mode=mode) as client:
        with anyio.CancelScope() as scope:
            async def progress(value: float, total: float | None, message: str | None) -> None:
                if message and "running" in message:
                    scope.cancel()

            await client.call_tool("held", {"gate": str(tmp_path / "never")}, progress_callback=progress)
        assert scope.cancelled_caught
        (job,) = [j for j in jobs(server.url) if j["job_id"] not in before]
        assert cancelled(await until_job(server.url, job["job_id"], lambda j: j["status"] == "FAILED"))


# -- tasks -----------------------------------------------------------------------------------------


async def test_a_task_is_the_job_got_resumed_and_answered(server, tmp_path) -> None:
    gate = tmp_path / "gate"
    async with connect(server.url, tasks=True) as client:
        assert TASKS in client.server_capabilities.extensions  # advertised in server/discover
        created = await start_task(client, "held", {"gate": str(gate)})
        assert isinstance(created, CreateTaskResult) and created.status == "working"
        state = await get_task(client, created.task_id)
        assert state.status == "working" and state.ttl_ms is None and state.poll_interval_ms
        # The task's id is the job's: listed with the others, and resumable over SSE. A follower
        # that leaves does not cancel it (this gateway's detach grace is 0): the task holds it.
        assert created.task_id in {j["job_id"] for j in jobs(server.url)}
        with httpx.stream("GET", f"{server.url}/jobs/{created.task_id}/events", timeout=30) as events:
            first = next(events.iter_lines())
        assert first.startswith("retry:")
        assert (await get_task(client, created.task_id)).status == "working"
        gate.touch()
        done = await until_task(client, created.task_id, lambda s: s.status != "working")
        assert done.status == "completed" and done.ttl_ms > 0
        answer = types.CallToolResult.model_validate(done.result)
        assert not answer.is_error and answer.structured_content == {"gate": str(gate)}
        replay = httpx.get(f"{server.url}/jobs/{created.task_id}/events", timeout=30).text
        assert "event: data" in replay and str(gate) in replay
        # A client that lets the SDK finish the task itself gets the ordinary result.
        again = tmp_path / "again"
        again.touch()
        answer = await client.call_tool("held", {"gate": str(again)})
        assert isinstance(answer, types.CallToolResult) and answer.structured_content == {"gate": str(again)}


async def test_tasks_cancel_cancels_the_job(server, tmp_path) -> None:
    async with connect(server.url, tasks=True) as client:
        created = await start_task(client, "held", {"gate": str(tmp_path / "never")})
        await cancel_task(client, created.task_id)
        state = await until_task(client, created.task_id, lambda s: s.status != "working")
        assert state.status == "cancelled" and state.result is None
    assert cancelled(await until_job(server.url, created.task_id, lambda j: j["status"] == "FAILED"))


async def test_tasks_need_the_extension_and_a_known_id(server) -> None:
    async with connect(server.url) as client:
        with pytest.raises(MCPError) as raised:
            await get_task(client, "0" * 32)
        assert raised.value.error.code == types.MISSING_REQUIRED_CLIENT_CAPABILITY
    async with connect(server.url, tasks=True) as client:
        for task_id in ("0" * 32, "x" * 256):
            with pytest.raises(MCPError) as raised:
                await get_task(client, task_id)
            assert raised.value.error.code == types.INVALID_PARAMS


# -- auth and tenancy ------------------------------------------------------------------------------


async def test_without_a_token_mcp_is_refused_as_every_route_is(secured) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    refused = httpx.post(f"{secured.url}/mcp", json=body, headers={"Accept": "application/json, text/event-stream"})
    elsewhere = httpx.get(f"{secured.url}/jobs")
    assert refused.status_code == elsewhere.status_code == 401
    assert refused.json() == elsewhere.json() and refused.json()["error"]["code"] == "unauthorized"
    assert refused.headers["www-authenticate"] == elsewhere.headers["www-authenticate"]
    with pytest.raises(Exception):
        async with connect(secured.url) as client:
            await client.list_tools()
    with pytest.raises(Exception):
        async with connect(secured.url, token="not-a-token-0123456789") as client:
            await client.list_tools()


async def test_a_call_is_the_tokens_job(secured, tmp_path) -> None:
    gate = tmp_path / "gate"
    async with connect(secured.url, token="alice-token-0123456789", tasks=True) as alice:
        created = await start_task(alice, "held", {"gate": str(gate)})
        assert created.task_id in {j["job_id"] for j in jobs(secured.url, "alice-token-0123456789")}
        assert created.task_id not in {j["job_id"] for j in jobs(secured.url, "bob-token-0123456789ab")}
        async with connect(secured.url, token="bob-token-0123456789ab", tasks=True) as bob:
            # Another token's task is no task at all; its tools are only those it may use.
            with pytest.raises(MCPError) as raised:
                await get_task(bob, created.task_id)
            assert raised.value.error.code == types.INVALID_PARAMS
            with pytest.raises(MCPError):
                await cancel_task(bob, created.task_id)
            assert [t.name for t in (await bob.list_tools()).tools] == ["held"]
            answer = await bob.call_tool("generate", {"prompts": ["Hi"], "max_tokens": 1})
            assert answer.is_error and answer.meta["streamgate/error"]["code"] == "forbidden"
        assert (await get_task(alice, created.task_id)).status == "working"
        gate.touch()
        assert (await until_task(alice, created.task_id, lambda s: s.status != "working")).status == "completed"


async def test_the_tokens_quota_holds_for_calls(secured, tmp_path) -> None:
    gate = tmp_path / "gate"
    async with connect(secured.url, token="carol-token-0123456789", tasks=True) as carol:
        created = await start_task(carol, "held", {"gate": str(gate)})
        async with connect(secured.url, token="carol-token-0123456789") as again:
            answer = await again.call_tool("held", {"gate": str(gate)})
        assert answer.is_error
        error = answer.meta["streamgate/error"]
        assert error["code"] == "rate_limited" and error["retryable"] and error["retry_after"] >= 1
        gate.touch()
        assert (await until_task(carol, created.task_id, lambda s: s.status != "working")).status == "completed"


# -- hostile input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("era", ["2025-11-25", None, "2026-07-28"])
def test_a_client_that_stops_reading_is_cut_and_frees_its_slot(tiny_model_path, era) -> None:
    server = make_server([f"base={tiny_model_path}"], tools=[big], write_timeout=1.0)
    try:
        headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
        meta = {}
        if era is not None:
            headers["MCP-Protocol-Version"] = era
        if era == "2026-07-28":
            headers.update({"Mcp-Method": "tools/call", "Mcp-Name": "big"})
            meta = {"io.modelcontextprotocol/protocolVersion": era, "io.modelcontextprotocol/clientCapabilities": {}}
        params = {"name": "big", "arguments": {"size": 6_000_000}, "_meta": meta}
        body = msgspec.json.encode({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params})
        host, port = server.url.removeprefix("http://").split(":")
        head = "".join(f"{k}: {v}\r\n" for k, v in {**headers, "Host": host, "Content-Length": len(body)}.items())
        streams = server.app.state.gateway.streams
        with socket.create_connection((host, int(port))) as reader:
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            reader.sendall(f"POST /mcp HTTP/1.1\r\n{head}\r\n".encode() + body)
            wait_until(lambda: streams.open == 1, what="the call to hold its slot")
            # It never reads: its connection is cut once a write has waited the write timeout.
            wait_until(lambda: streams.open == 0, what="the stalled call to be cut")
        assert 'streamgate_client_timeouts_total{phase="write"} 1.0' in httpx.get(f"{server.url}/metrics").text
    finally:
        server.stop()

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_METHODS = st.sampled_from(
    ["tools/list", "tools/call", "tasks/get", "tasks/cancel", "tasks/update", "server/discover", "initialize",
     "logging/setLevel", "ping", "resources/list", "nope"]
)
_PARAMS = st.fixed_dictionaries(
    {},
    optional={
        "name": st.sampled_from(["generate", "generate__other", "logprobs", "nope", ""]) | st.text(max_size=8),
        "arguments": _JSON,
        "taskId": _JSON,
        "cursor": _JSON,
        "_meta": st.fixed_dictionaries(
            {},
            optional={
                "io.modelcontextprotocol/protocolVersion": st.sampled_from(["2026-07-28", "2025-11-25", "x"]),
                "io.modelcontextprotocol/clientCapabilities": st.just({"extensions": {TASKS: {}}}) | _JSON,
                "progressToken": _JSON,
            },
        ),
    },
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    method=_METHODS,
    params=_PARAMS | _JSON,
    version=st.sampled_from(["2026-07-28", "2025-11-25", "1999-01-01", None]),
    raw=st.none() | st.binary(max_size=64) | st.sampled_from([b"[" * 5000, b"{}", b"[]", b'{"jsonrpc":"2.0"}']),
)
def test_no_request_gets_a_5xx(server, method, params, version, raw) -> None:
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    if version is not None:
        headers["MCP-Protocol-Version"] = version
    body = raw if raw is not None else msgspec.json.encode({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
    response = httpx.post(f"{server.url}/mcp", content=body, headers=headers, timeout=60)
    assert response.status_code < 500, (body, response.text)


# -- big results -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sized_server(tiny_model_path: Path):
    s = make_server([f"base={tiny_model_path}"], tools=[sized])
    yield s
    s.stop()


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_a_big_result_is_spliced_into_its_answer_from_the_one_copy_it_has(sized_server, mode) -> None:
    """Over 64 KiB a result is not built by the SDK: its JSON is written into the answer a piece at a
    time, as `structuredContent`, equal to what the same run answers, the text content a line saying
    where it is; a task's answer too. A client on a protocol without `structuredContent` gets the
    JSON as the text (escaped: quotes, backslashes, and characters past ASCII in the result)."""
    arguments = {"size": 40_000, "fill": 'é"\\'}
    expected = {"text": 'é"\\' * 40_000}
    size = len(msgspec.json.encode(expected))
    splicing = sized_server.app.state.mcp.splicing
    before = splicing._next
    async with connect(sized_server.url, mode=mode) as client:
        answer = await client.call_tool("sized", arguments)
        assert not answer.is_error, answer.content[0].text[:300]
        assert answer.structured_content == expected
        job_id = answer.meta["streamgate/job_id"]
        assert answer.content[0].text == f"{size} bytes of JSON, in structuredContent (also GET /jobs/{job_id} while it is kept)"
        assert httpx.get(f"{sized_server.url}/jobs/{job_id}").json()["terminal"]["data"] == expected
    async with connect(sized_server.url, tasks=True) as client:
        created = await start_task(client, "sized", arguments)
        done = await until_task(client, created.task_id, lambda s: s.status != "working")
        answer = types.CallToolResult.model_validate(done.result)
        assert answer.structured_content == expected and answer.content[0].text.startswith(f"{size} bytes of JSON")
    # The 2025-03-26 protocol, before structured content: the JSON is the text.
    headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-03-26"}
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "sized", "arguments": arguments}}
    response = httpx.post(f"{sized_server.url}/mcp", json=call, headers=headers, timeout=60)
    assert response.status_code == 200, response.text[:300]
    message = response.json() if response.headers["content-type"].startswith("application/json") else next(
        msgspec.json.decode(line[5:]) for line in response.text.splitlines() if line.startswith("data:") and '"result"' in line
    )
    assert msgspec.json.decode(message["result"]["content"][0]["text"]) == expected
    assert splicing._next - before == 3 and not splicing._waiting  # every answer spliced, every stand-in written


async def test_a_result_priced_over_the_inline_bound_is_refused_before_it_is_queued(sized_server) -> None:
    before = {j["job_id"] for j in jobs(sized_server.url)}
    async with connect(sized_server.url) as client:
        answer = await client.call_tool("sized", {"size": INLINE_RESULT_BYTES})
    assert answer.is_error
    error = answer.meta["streamgate/error"]
    assert error["code"] == "too_large" and error["field"] == "size" and "POST /sized/run" in error["message"]
    assert {j["job_id"] for j in jobs(sized_server.url)} == before  # no job was made
