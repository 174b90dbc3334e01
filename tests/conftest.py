"""Shared fixtures: a tiny random model on disk, and real servers on loopback, local or remote (with executors)."""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from backends.workers import set_torch_threads
from gateway import checkpoints
from gateway.plumbing.memory import bound_heap
from backends.local import LocalBackend
from backends.remote import RemoteBackend
from gateway.server.app import create_app
from gateway.config import Settings
from gateway.plumbing.slowclients import uvicorn_options
from gateway.tools import Tool, builtin_tools, collect, load_module
from tests.support.processes import ServeProcess, clean_env, free_port, start_executor, start_serve

# The thread count every gateway and executor this suite starts gives torch (`--torch-threads`'s
# default): the same here, so that what a test computes by hand and what a server returns are
# summed in the same order, bit for bit.
set_torch_threads(None)
# And the heap's bound every server sets (gateway/plumbing/memory.py): peaks measured here are a server's.
bound_heap()

from tests.support import tiny_models
from tests.support.tiny_models import (  # noqa: F401  (the tests' names for them)
    CHAT_TEMPLATE,
    FAMILIES,
    TINY_CONTEXT,
    TINY_SOFTCAP,
    build_tiny_model,
    byte_tokenizer,
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test`: `--dist loadgroup`), each file's tests run in one process, so
    that its module fixtures start once; every test of the one vLLM server (`vllm_gateway`, and the
    benchmark that starts its own) in one process, first, as they take longest; Ray's in one; those of
    the gateway with classes (`classed_engine`) in one."""
    for item in items:
        if item.get_closest_marker("vllm") is not None or "vllm_gateway" in getattr(item, "fixturenames", ()):
            group = "vllm"
        elif item.get_closest_marker("ray") is not None:
            group = "ray"
        elif "classed_engine" in getattr(item, "fixturenames", ()):
            group = "classed"
        else:
            group = item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: item.get_closest_marker("xdist_group").args[0] != "vllm")  # type: ignore[union-attr]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """The tiny models of tests/support/tiny_models.py, each (kind, seed, options) built once a
    session: `tiny("esm_mlm")`, `tiny("gpt2", seed=1, init=0.2)`. Served as they are, never written to."""
    built: dict[tuple[Any, ...], Path] = {}

    def build(kind: str, seed: int = 0, **options: Any) -> Path:
        key = (kind, seed, *sorted(options.items()))
        if key not in built:
            built[key] = tiny_models.build(kind, tmp_path_factory.mktemp(kind), seed, **options)
        return built[key]

    return build


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def wide_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wider, longer tiny Llama (hidden 256, 8k context): a pass over thousands of tokens takes
    tens of MB and a good part of a second, as a long input does on a real model."""
    return build_tiny_model(tmp_path_factory.mktemp("wide-llama"), hidden=256, context=8192)


@pytest.fixture(scope="session", params=FAMILIES)
def arch_model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model of each family in FAMILIES, built once per session (init 0.2, 2 layers; gemma2 3)."""
    family = request.param
    layers = 3 if family == "gemma2" else 2  # gemma2: sliding and global attention layers both
    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family=family, layers=layers, init=0.2)


@dataclass
class Server:
    """A gateway running under uvicorn on a free loopback port, in a thread of its own."""

    app: Any
    url: str = ""
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None
    events: list[Any] = field(default_factory=list)
    kind: str = "local"  # or "remote": the RemoteBackend, driving executor processes

    @property
    def backend(self) -> Any:
        return self.app.state.backend

    def start(self) -> Server:
        # As `streamgate serve` builds it: the same protocol, with the app's slow-client deadlines.
        options = uvicorn_options(self.app.state.settings, self.app.state.metrics.client_timeout)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", **options)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def wait_ready(self, timeout: float = 60) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if httpx.get(self.url + "/readyz").status_code == 200:
                return self
            time.sleep(0.05)
        raise RuntimeError("the server did not become ready")

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)


def make_server(
    model_path: Path | str | list[str] | None, *, tools: list[Tool] | None = None, ready: bool = True, **settings: Any
) -> Server:
    """A gateway on the local backend, in this process: one model, or several as ["NAME=SOURCE", …]."""
    # Most tests check that a client leaving ends its job; those about detaching set a grace.
    settings.setdefault("detach_grace", 0)
    for key in ("model_loader", "model_devices"):
        if isinstance(settings.get(key), str):
            settings[key] = [settings[key]]
    models = model_path if isinstance(model_path, list) else [str(model_path)] if model_path else []
    settings_obj = Settings(model=models, **settings)
    if not settings_obj.devices:
        settings_obj.device = "cpu"
    backend = LocalBackend(
        collect(builtin_tools() + (tools or [])),
        settings_obj,
        result_files=settings_obj.result_spool or tempfile.gettempdir(),
        checkpoint_folder=checkpoints.lasting_folder(settings_obj.result_spool, settings_obj.store),
    )
    server = Server(create_app(backend, settings_obj)).start()
    return server.wait_ready() if ready else server


def make_remote_server(
    executors: list[str], *, token: str | None = None, deadline: float = 30.0, ready: bool = True, **settings: Any
) -> Server:
    """A gateway with the remote backend, in this process, driving real executor processes."""
    backend = RemoteBackend(executors, token=token, deadline=deadline, poll_interval=0.2)
    settings.setdefault("detach_grace", 0)  # as in make_server
    app = create_app(backend, Settings(backend="remote", executors=executors, **settings))
    server = Server(app, kind="remote").start()
    return server.wait_ready() if ready else server


@pytest.fixture
def serve(tiny_model_path: Path) -> Iterator[Any]:
    """Start servers on the tiny model: `serve(tools=[...], queue_size=2, ...)`; stopped after the test."""
    started: list[Server] = []

    def start(**kwargs: Any) -> Server:
        kwargs.setdefault("model_path", tiny_model_path)
        server = make_server(kwargs.pop("model_path"), **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def server(tiny_model_path: Path) -> Iterator[Server]:
    """One shared server on the tiny model with the built-in tools."""
    s = make_server(tiny_model_path)
    yield s
    s.stop()


# -- either backend: the same gateway, with the model in process or on an executor --------
#
# A test that takes `kind` (or `any_server`, or a module fixture built on them) runs
# twice: "local" (LocalBackend in the gateway) and "remote" (an in-process gateway
# with the RemoteBackend, driving a real `streamgate executor` subprocess over
# loopback HTTP and a WebSocket). Both serve the built-in tools, the tools of
# USER_TOOLS, and those of the modules named by the `tool_modules` fixture (which a
# test module overrides to add its own), so the two are interchangeable to a client.

KINDS = ("local", "remote")
USER_TOOLS = "tests.support.user_tools"  # every executor loads it (processes.start_executor)

# Settings of the process that holds the model, as `streamgate executor` flags; the
# rest (max_body_bytes, ping_interval, retry_ms, …) belong to the gateway alone.
EXECUTOR_FLAGS = {
    "queue_size": "--queue-size", "max_queued_per_owner": "--max-queued-per-owner", "max_prompts": "--max-prompts", "max_tokens": "--max-tokens",
    "max_sequences": "--max-sequences",
}
# Caps that bind both: the gateway checks them and shows them in its schemas, the executor enforces them.
SHARED_SETTINGS = {"max_prompts", "max_tokens", "max_sequences"}


class Executors:
    """Executor processes, started on first use and shared by every gateway that asks for the same ones.

    One executor per (model, tool modules, executor flags); each start costs a few
    seconds, so a module's tests share them, and all are stopped with the module.
    An executor found dead (a test killed it) is started afresh.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: dict[tuple[Any, ...], ServeProcess] = {}

    def get(self, model_path: Path | str, modules: tuple[str, ...] = (), flags: tuple[str, ...] = ()) -> ServeProcess:
        key = (str(model_path), modules, flags)
        process = self.started.get(key)
        if process is None or process.proc.poll() is not None:
            extra = [*flags, *(arg for module in modules for arg in ("--tools", module))]
            log = self.log_dir / f"executor-{len(self.started)}.log"
            process = self.started[key] = start_executor(model_path, log, extra=extra)
        return process

    def stop(self) -> None:
        for process in self.started.values():
            process.stop()
        self.started.clear()


@pytest.fixture(scope="module")
def executors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Executors]:
    pool = Executors(tmp_path_factory.mktemp("executors"))
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def tool_modules() -> tuple[str, ...]:
    """Modules of test tools that servers of either kind load besides USER_TOOLS; override per module."""
    return ()


def start_any(
    kind: str,
    executors: Executors,
    model_path: Path | str,
    modules: tuple[str, ...] = (),
    **settings: Any,
) -> Server:
    """A ready gateway of `kind` on `model_path` with the built-in tools, USER_TOOLS and `modules`' tools.

    Settings go where they belong: model-side ones (EXECUTOR_FLAGS) to the executor's
    command line, gateway-side ones to the gateway, caps (SHARED_SETTINGS) to both.
    """
    if kind == "local":
        tools = [t for module in (USER_TOOLS, *modules) for t in load_module(module)]
        return make_server(model_path, tools=tools, **settings)
    assert kind == "remote", kind
    flags: list[str] = []
    for name, flag in EXECUTOR_FLAGS.items():
        if name in settings:
            value = settings[name] if name in SHARED_SETTINGS else settings.pop(name)
            flags += [flag, str(value)]
    executor = executors.get(model_path, tuple(modules), tuple(flags))
    return make_remote_server([executor.url], **settings)


@pytest.fixture(scope="module", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    """"local" or "remote": a module's tests run once with each, grouped by kind."""
    return request.param


@pytest.fixture(scope="module")
def any_server(
    kind: str, executors: Executors, tiny_model_path: Path, tool_modules: tuple[str, ...]
) -> Iterator[Server]:
    """The shared server of `server`, of either kind (see KINDS)."""
    s = start_any(kind, executors, tiny_model_path, tool_modules)
    yield s
    s.stop()


@pytest.fixture
def serve_any(executors: Executors, tiny_model_path: Path, tool_modules: tuple[str, ...]) -> Iterator[Any]:
    """`serve_any(kind, queue_size=1, ping_interval=0.25, …)`: like `serve`, for either kind.

    Gateways are stopped after the test; executors are kept for the module's other tests.
    """
    started: list[Server] = []

    def start(kind: str, *, model_path: Path | str | None = None, **settings: Any) -> Server:
        server = start_any(kind, executors, model_path or tiny_model_path, tool_modules, **settings)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def opening_statuses(kind: str) -> list[str]:
    """The statuses a job's stream opens with: a remote gateway says DISPATCHED once the executor took it."""
    return ["RECEIVED", "QUEUED", "RUNNING"] if kind == "local" else ["RECEIVED", "DISPATCHED", "QUEUED", "RUNNING"]


def tool_error_code(kind: str) -> str:
    """A tool that raised: `tool_error` where it ran; `remote_error`, same message, through a remote gateway."""
    return "tool_error" if kind == "local" else "remote_error"


def without_dispatched(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """A stream's events as the local backend would send them (ids and seqs aside).

    For "remote", asserts that the one DISPATCHED status comes right after RECEIVED,
    and leaves it out.
    """
    if kind == "local":
        assert all(e["data"].get("status") != "DISPATCHED" for e in events if e["event"] == "status")
        return events
    dispatched = [i for i, e in enumerate(events) if e["event"] == "status" and e["data"]["status"] == "DISPATCHED"]
    assert dispatched == [1], [e["event"] for e in events[:4]]
    assert events[0]["event"] == "status" and events[0]["data"]["status"] == "RECEIVED"
    return events[:1] + events[2:]


@dataclass
class Stream:
    """A finished SSE response: status, headers, raw bytes, and the parsed events."""

    status: int
    headers: httpx.Headers
    raw: bytes
    events: list[dict[str, Any]]

    def of(self, type: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == type]

    @property
    def terminal(self) -> dict[str, Any]:
        return self.events[-1]

    @property
    def body(self) -> Any:
        return json.loads(self.raw)


def parse_sse(raw: bytes) -> list[dict[str, Any]]:
    """A WHATWG-conformant SSE parse of a complete stream (fields per event, comments dropped)."""
    text = raw.decode("utf-8")
    if text.startswith("\ufeff"):
        text = text[1:]
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    data: list[str] = []
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if line == "":
            if data:
                current["data"] = json.loads("\n".join(data))
                current.setdefault("event", "message")
                events.append(current)
            current, data = {}, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data.append(value)
        elif name in ("event", "id", "retry"):
            current[name] = value
    return events


def run_stream(url: str, tool: str, params: Any = None, *, method: str = "POST", query: Any = None,
               headers: dict[str, str] | None = None, content: bytes | None = None, timeout: float = 60) -> Stream:
    with httpx.Client(timeout=timeout) as client:
        kwargs: dict[str, Any] = {"headers": headers or {}}
        if method == "POST":
            if content is not None:
                kwargs["content"] = content
            else:
                kwargs["json"] = params
        else:
            kwargs["params"] = query
        with client.stream(method, f"{url}/{tool}/run", **kwargs) as response:
            raw = response.read()
    is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
    return Stream(response.status_code, response.headers, raw, parse_sse(raw) if is_sse else [])


@contextlib.contextmanager
def open_stream(url: str, tool: str, params: Any) -> Iterator[httpx.Response]:
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{url}/{tool}/run", json=params) as response:
            yield response


def track_jobs(server: Server) -> dict[str, Any]:
    """Record every job the backend accepts, by id (the gateway keeps no registry)."""
    jobs: dict[str, Any] = {}
    submit = server.backend.submit

    async def recording_submit(job: Any) -> None:
        await submit(job)
        jobs[job.id] = job

    server.backend.submit = recording_submit
    return jobs


def wait_until(predicate: Callable[[], bool], timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def floats_not_float32_shortest(value: Any) -> list[float]:
    """The floats in a decoded JSON value that are not a float32 in its shortest form (protocol: numbers)."""
    import numpy as np

    if isinstance(value, float):
        return [] if value != value or float(str(np.float32(value))) == value else [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return [bad for item in items for bad in floats_not_float32_shortest(item)]


# A first start compiles the model's graphs (about 100 s on 2 cores; cached in ~/.cache/vllm for the next).
VLLM_START_S = 900


@pytest.fixture(scope="session")
def vllm_gateway(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """One vLLM server for every test that needs one: the bundled model, started by a gateway that serves
    a tiny model in an engine process beside it."""
    port = free_port()
    args = [
        "--model", "smol=vllm:", "--model", f"tiny={tiny_model_path}", "--dtype", "float32",
        "--vllm-args", "--max-model-len 2048", "--port", str(port), "--device", "cpu", "--torch-threads", "1",
        "--log-level", "warning",
    ]
    log = tmp_path_factory.mktemp("vllm") / "gateway.log"
    # No VLLM_CPU_KVCACHE_SPACE: the gateway sizes the server's KV cache itself (--vllm-kv-cache-bytes).
    gateway = start_serve(args, clean_env(), port, log, timeout=VLLM_START_S)
    yield gateway
    gateway.stop()


def server_url(gateway: ServeProcess) -> str:
    """The URL of the vLLM server a gateway started."""
    (engine,) = [e for e in httpx.get(f"{gateway.url}/readyz", timeout=10).json()["engines"] if e["device"] == "vllm server"]
    return engine["url"]


# -- classes of users: two tokens in two classes, and a gateway with its engine process on them ------

LAB = "lab-token-0123456789abcdef00"
STUDENT = "student-token-0123456789abcd"
CLASSES = (
    '[classes.lab]\npriority = 10\n[classes.students]\ndefault = true\n'
    f'[tokens.lab]\ntoken = "{LAB}"\nclass = "lab"\n[tokens.student]\ntoken = "{STUDENT}"\n'
)


@pytest.fixture(scope="session")
def classed_engine(wide_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The default set-up (a gateway and its engine process) with the lab and students classes, one
    job running at a time (--max-batch-size 1: one member a continuous batch too), strictly by class."""
    from tests.test_engines import start_gateway

    tmp = tmp_path_factory.mktemp("classed")
    tokens = tmp / "tokens.toml"
    tokens.write_text(CLASSES)
    gateway = start_gateway(
        tmp, str(wide_model_path),
        extra=("--tokens-file", str(tokens), "--max-batch-size", "1", "--class-min-share", "0", "--max-tokens", "300"),
    )
    yield gateway
    gateway.stop()
