"""Models served by an inference server: a vLLM server the gateway starts, or any OpenAI-compatible one.

`--model NAME=vllm:PATH` starts `python -m vllm.entrypoints.openai.api_server` on a
loopback port, from vLLM's own environment (`--vllm-python`), as an engine the gateway
supervises (backends/engines.py: restarts with backoff, its lines in the gateway's log);
`--model NAME=openai+http(s)://HOST/v1` fronts one already running (vLLM, SGLang, TGI's
OpenAI route, llama.cpp's server), its key from `--model-api-key NAME=ENV_VAR` or
`OPENAI_API_KEY`. Either sits beside models in engine processes, behind the same tools.

Deliberately the gateway's job model over the server's API, not a proxy of it:

- a job is one streamed request (`/completions`, or `/chat/completions` for `messages`);
  up to `--max-decoding-jobs` run on the server at once, and the rest wait in the
  gateway's queue (backends/queue.py: fair between tenants, each told its position), so
  that a server's own unbounded queue never hides a job's place;
- `RUNNING` at the first token, a partial per chunk the server streams, one terminal event;
- a cancel, a timeout or a client that leaves closes the request, which is how an
  OpenAI-compatible server is told to stop generating (vLLM aborts the sequence);
- the server's refusals are the protocol's: its context-length error is 413 `too_long`,
  its other validation errors 422 `invalid_params`; answered before the stream when the
  job is sent at once, as the job's error when it waited; an unreachable or dead server
  ends its running jobs with `backend_unavailable` (retryable);
- only the tools the server can answer are offered (`generate`); the others are refused
  before queueing with 422 `unsupported_by_model`, saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import msgspec

from backends.queue import JobQueue
from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.protocol import Code, ModelInfo, Status, ToolInfo
from gateway.tools.base import Tool
from gateway.tools.generate import GeneratePartial, GenerateResult, Usage

log = logging.getLogger("streamgate.inference")

SERVED = ("generate",)  # the tools an inference server's answers make
POLL_S = 0.5
CONNECT_S = 10.0  # to open a request; a request's own time is bounded by --job-timeout


def free_port() -> int:
    """A loopback port free now, for a server the gateway starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class _Chunk(msgspec.Struct):
    """What one streamed chunk of `/completions` or `/chat/completions` carries that a job reads."""

    class _Delta(msgspec.Struct):
        content: str | None = None

    class _Choice(msgspec.Struct):
        index: int = 0
        text: str | None = None  # /completions
        delta: _Chunk._Delta | None = None  # /chat/completions
        finish_reason: str | None = None
        token_ids: list[int] | None = None  # vLLM's, with `return_token_ids`

    class _Usage(msgspec.Struct):
        prompt_tokens: int = 0
        completion_tokens: int = 0

    class _Error(msgspec.Struct):
        message: str = ""
        code: int | str | None = None

    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    # A refusal the server makes once its stream has begun (vLLM checks token ids there).
    error: _Error | None = None


class _Models(msgspec.Struct):
    class _Model(msgspec.Struct):
        id: str
        max_model_len: int | None = None  # vLLM's

    data: list[_Model]


def refusal(status: int, body: bytes, server: str) -> ApiError:
    """The protocol's error for a server's non-2xx answer to a request."""
    message = ""
    with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError):
        decoded = msgspec.json.decode(body)
        error = decoded.get("error", decoded) if isinstance(decoded, dict) else {}
        message = str(error.get("message", "")) if isinstance(error, dict) else str(error)
    message = message or body[:500].decode(errors="replace") or f"HTTP {status}"
    if status in (400, 413, 422):
        lowered = message.lower()
        if "context length" in lowered or "maximum model length" in lowered or "too long" in lowered:
            return ApiError(Code.TOO_LONG, f"{server}: {message}")
        return ApiError(Code.INVALID_PARAMS, f"{server}: {message}")
    if status == 429:
        return ApiError(Code.OVERLOADED, f"{server} is overloaded: {message}", retry_after=1)
    return ApiError(Code.BACKEND_UNAVAILABLE, f"{server} answered {status}: {message}", retry_after=5)


class _Generation:
    """A `generate` job's request, and its result assembled from the streamed chunks."""

    def __init__(self, params: Any, model: str, token_ids: bool) -> None:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for key in ("top_k", "seed", "stop"):
            if getattr(params, key) is not None:
                body[key] = getattr(params, key)
        if token_ids:
            body["return_token_ids"] = True  # each chunk's token ids, as a local model's partials carry
        if params.messages is not None:
            self.path = "/chat/completions"
            body["messages"] = [msgspec.structs.asdict(m) for m in params.messages]
            rows = 1
        else:
            self.path = "/completions"
            body["prompt"] = params.token_ids if params.token_ids is not None else params.prompts
            rows = len(body["prompt"])
        self.body = body
        self.texts = [""] * rows
        self.finish = ["length"] * rows
        self.usage = Usage(0, 0, 0)
        self.started = False

    def take(self, chunk: _Chunk, job: Job) -> None:
        for choice in chunk.choices:
            i = choice.index
            if not 0 <= i < len(self.texts):
                continue
            text = choice.text if choice.text is not None else (choice.delta.content if choice.delta else None) or ""
            if choice.finish_reason is not None:
                self.finish[i] = "length" if choice.finish_reason == "length" else "stop"
            if not text and not choice.token_ids:
                continue
            if not self.started:
                self.started = True
                job.set_status(Status.RUNNING)
            self.texts[i] += text
            job.partial(GeneratePartial(i, text, choice.token_ids or []))
        if chunk.usage is not None:
            prompt, completion = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            self.usage = Usage(prompt, completion, prompt + completion)

    def result(self) -> GenerateResult:
        return GenerateResult(self.texts, self.usage, self.finish)


class ServerLink:
    """One inference server serving one of the gateway's models: its health, the gateway's queue
    for it, and the jobs running there. Driven by backends/engines.py as an engine's link is."""

    def __init__(
        self,
        name: str,
        url: str,
        kind: str,
        *,
        api_key: str | None,
        tools: list[ToolInfo],
        max_jobs: int,
        queue_size: int,
        per_owner: int | None,
        job_timeout: float,
        on_tools: Callable[[], None],
    ) -> None:
        self.name = name  # the model's name in this gateway
        self.url = url.rstrip("/")
        self.kind = kind  # "vllm" or "openai"
        self.upstream: str | None = None  # the server's own name of the model, from GET /models
        self.token_ids = False  # whether its chunks carry their token ids (probed once it is up)
        self.context_length: int | None = None
        self.http = httpx.AsyncClient(
            base_url=self.url,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
            timeout=httpx.Timeout(CONNECT_S, read=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=max(1, min(max_jobs, 256))),
        )
        self.all_tools = tools
        self.queue = JobQueue(queue_size, per_owner=per_owner)
        self.slots = asyncio.Semaphore(max_jobs)
        self.job_timeout = job_timeout
        self.jobs: dict[str, Job] = {}  # queued here or running there
        self.running: dict[str, asyncio.Task[None]] = {}
        self.healthy = False
        self.problem = "not contacted yet"
        self.refused = False
        self.waiting: list[Job] = []  # (an engine's: jobs kept over a restart; these stay in `queue`)
        self.ready_since_start = False
        self.tool_of: Any = None
        self._on_tools = on_tools
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ready = asyncio.Event()

    # -- what backends/engines.py reads -----------------------------------------

    @property
    def ready(self) -> bool:
        return self.healthy

    @property
    def load(self) -> int:
        return len(self.jobs)

    @property
    def backlog(self) -> int:
        return len(self.queue)

    @property
    def facts(self) -> dict[str, Any]:
        return {"queued": len(self.queue), "running": len(self.running)}

    @property
    def tools(self) -> list[ToolInfo]:
        return self.all_tools if self.healthy else []

    @property
    def models(self) -> list[ModelInfo]:
        if not self.healthy:
            return []
        reasons = {
            t.name: f"{t.name} needs what the model {self.name} does not give: it is served by an inference server "
            f"({self.kind}, {self.url}), whose answers are generated text, not the model's internals"
            for t in self.all_tools
            if t.name not in SERVED
        }
        return [
            ModelInfo(
                name=self.name, default=False, ready=True, kind="causal_lm", context_length=self.context_length,
                device=f"{self.kind} server", tools=[t.name for t in self.all_tools if t.name in SERVED], unsupported=reasons,
            )
        ]

    def withdraw(self, job: Job) -> bool:
        return False

    def start(self) -> None:
        self._spawn(self._poll_loop())
        self._spawn(self._dispatch_loop())

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for job in list(self.jobs.values()):
            job.fail(Code.SHUTTING_DOWN, "the gateway is shutting down")
        self.jobs.clear()
        await self.http.aclose()

    def lost(self, reason: str) -> None:
        """The server's process ended: its running jobs end (retryable); those waiting here stay queued."""
        self.healthy, self.problem = False, reason
        self._ready.clear()
        self.ready_since_start = False
        for job_id, task in list(self.running.items()):
            job = self.jobs.pop(job_id, None)
            task.cancel()
            if job is not None:
                job.fail(Code.BACKEND_UNAVAILABLE, f"the inference server {reason}; it is restarting: try again")
        self.running.clear()

    # -- health -----------------------------------------------------------------

    async def _poll_loop(self) -> None:
        while True:
            try:
                answer = await self.http.get("/models", timeout=5.0)
                self.refused = answer.status_code in (401, 403)
                if answer.status_code != 200:
                    raise ValueError(f"GET /models answered {answer.status_code}")
                listed = msgspec.json.decode(answer.content, type=_Models).data
                ids = [m.id for m in listed]
                chosen = next((m for m in listed if m.id == self.name), listed[0] if len(listed) == 1 else None)
                if chosen is None:
                    raise ValueError(f"it serves {', '.join(ids) or 'no model'}; name this model after one of them")
                was = self.healthy
                self.upstream, self.context_length = chosen.id, chosen.max_model_len
                if not was:
                    self.token_ids = await self._probe()
                self.healthy, self.problem = True, ""
                self.ready_since_start = True
                self._ready.set()
                if not was:
                    self._on_tools()
            except (httpx.HTTPError, ValueError, msgspec.DecodeError) as exc:
                if self.healthy:
                    log.warning("the inference server of model %s went away: %s", self.name, exc)
                self.healthy = False
                self._ready.clear()
                self.problem = f"{self.url}: {exc or type(exc).__name__}"
            await asyncio.sleep(POLL_S)

    async def _probe(self) -> bool:
        """Whether the server streams each chunk's token ids (vLLM's `return_token_ids`): asked once it is up."""
        body = {"model": self.upstream, "prompt": "a", "max_tokens": 1, "temperature": 0, "return_token_ids": True}
        try:
            answer = await self.http.post("/completions", json=body, timeout=60.0)
            choices = answer.json().get("choices") if answer.status_code == 200 else None
            return bool(choices) and isinstance(choices[0].get("token_ids"), list)
        except (httpx.HTTPError, ValueError, AttributeError):
            return False

    # -- jobs -------------------------------------------------------------------

    async def submit(self, job: Job, tool: Tool) -> None:
        """Send the job now if the server has room (its refusal is this call's), else queue it here."""
        if tool.name not in SERVED:
            raise ApiError(Code.UNSUPPORTED_BY_MODEL, f"{tool.name} cannot run on the inference server of model {self.name}")
        if self.healthy and not len(self.queue) and not self.slots.locked():
            await self.slots.acquire()
            try:
                generation = _Generation(job.params, self.upstream or self.name, self.token_ids)
                response = await self._open(generation)
            except BaseException:
                self.slots.release()
                raise
            self.jobs[job.id] = job
            self._begin(job, generation, response)
            return
        self.queue.put(job)
        self.jobs[job.id] = job

    def cancel(self, job: Job) -> None:
        job.cancel()
        if self.queue.remove(job):
            self.jobs.pop(job.id, None)
            job.fail(Code.CANCELLED, "the job was cancelled")
            return
        task = self.running.get(job.id)
        if task is not None:
            task.cancel()  # closes the request: the server stops generating

    async def _dispatch_loop(self) -> None:
        while True:
            await self._ready.wait()
            await self.slots.acquire()
            try:
                job = await self.queue.get()
            except BaseException:
                self.slots.release()
                raise
            if job.done or job.id not in self.jobs:
                self.slots.release()
                continue
            try:
                generation = _Generation(job.params, self.upstream or self.name, self.token_ids)
                response = await self._open(generation)
            except ApiError as exc:
                self.slots.release()
                self.jobs.pop(job.id, None)
                job.fail(exc.code, exc.message)
                continue
            self._begin(job, generation, response)

    async def _open(self, generation: _Generation) -> httpx.Response:
        """The request sent and its answer's head read; raises the protocol's refusal."""
        request = self.http.build_request("POST", generation.path, json=generation.body)
        try:
            response = await self.http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise ApiError(Code.BACKEND_UNAVAILABLE, f"the inference server of model {self.name} could not be reached: {exc}", retry_after=5) from None
        if response.status_code != 200:
            body = await response.aread()
            await response.aclose()
            raise refusal(response.status_code, body, f"the inference server of model {self.name}")
        return response

    def _begin(self, job: Job, generation: _Generation, response: httpx.Response) -> None:
        task = asyncio.create_task(self._follow(job, generation, response))
        self.running[job.id] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _follow(self, job: Job, generation: _Generation, response: httpx.Response) -> None:
        """Read the stream into the job's events; whatever ends it, the request is closed and the slot freed."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.job_timeout or None):
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = msgspec.json.decode(data, type=_Chunk)
                    if chunk.error is not None:
                        status = chunk.error.code if isinstance(chunk.error.code, int) else 400
                        refused = refusal(status, msgspec.json.encode({"error": {"message": chunk.error.message}}), f"the inference server of model {self.name}")
                        job.fail(refused.code, refused.message)
                        return
                    generation.take(chunk, job)
            job.succeed(generation.result())
        except asyncio.CancelledError:
            if job.cancel_requested.is_set():
                job.fail(Code.CANCELLED, "the job was cancelled")
            else:
                job.fail(Code.BACKEND_UNAVAILABLE, "the inference server's request was stopped")
        except TimeoutError:
            job.fail(Code.TIMEOUT, f"the job ran past --job-timeout ({self.job_timeout:g} s)")
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            job.fail(Code.BACKEND_UNAVAILABLE, f"the inference server of model {self.name} broke off the stream: {exc}")
        finally:
            await response.aclose()
            self.running.pop(job.id, None)
            self.jobs.pop(job.id, None)
            self.slots.release()
            log.debug("job %s on %s took %.3f s", job.id, self.name, time.monotonic() - started, extra={"job_id": job.id})

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


MODEL_PLACEHOLDER = "<converted>"  # in a vLLM command, the GGUF's folder once converted
# The environment `make vllm` builds beside the project's (vLLM pins its own transformers and companions).
VLLM_ENV = Path(__file__).resolve().parents[1] / ".vllm"


def vllm_python(given: str | None) -> str:
    """The interpreter of vLLM's environment: `--vllm-python`, else the project's `.vllm`."""
    if given:
        return given
    python = VLLM_ENV / "bin" / "python"
    if not python.exists():
        raise ValueError(f"vLLM's environment is not at {VLLM_ENV}: `make vllm` builds it, or give --vllm-python")
    return str(python)


async def relay_lines(stream: asyncio.StreamReader, engine: str) -> None:
    """A server's output, line by line, as the gateway's log lines naming it."""
    out = logging.getLogger("streamgate.vllm")
    while line := await stream.readline():
        text = line.decode(errors="replace").rstrip()
        if text:
            level = logging.WARNING if " WARNING " in text else logging.ERROR if " ERROR " in text or "Traceback" in text else logging.INFO
            out.log(level, "%s", text, extra={"engine": engine})


# vLLM's OpenAI server, started so that it dies with the gateway (Linux: PR_SET_PDEATHSIG, SIGTERM so
# that it stops its own engine processes), however the gateway dies.
_LAUNCH = (
    "import ctypes, os, runpy, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(0)\n"
    "sys.argv = ['vllm-openai-server', *sys.argv[2:]]\n"
    "runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__', alter_sys=True)\n"
)


def vllm_command(python: str, path: str, name: str, port: int, dtype: str | None, extra: list[str]) -> list[str]:
    """The command line of a vLLM OpenAI server on `path`, called `name`, on a loopback port."""
    command = [
        python, "-c", _LAUNCH, str(os.getpid()), "--model", path, "--served-model-name", name,
        "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
    ]
    if dtype and dtype != "auto":
        command += ["--dtype", dtype]
    return command + extra


def api_key(name: str, keys: Mapping[str, str]) -> str | None:
    """A model's API key: the variable `--model-api-key NAME=VAR` names, else OPENAI_API_KEY."""
    return os.environ.get(keys[name]) if name in keys else os.environ.get("OPENAI_API_KEY")
