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
- a job's result is priced before it is queued, by its tool's own `cost` and against the same
  `--max-result-bytes` as on a model here (413 `too_large`, naming the field to shrink); its
  memory is the server's (its KV cache, its context-length refusal 413 `too_long`);
- only the tools the server can answer are offered: `generate`, and `loglikelihood`,
  `logprobs` and `predict` where it has vLLM's extensions (backends/server_requests.py),
  each shown on the server once it is up (backends/server_probes.py); the others are
  refused before queueing with 422 `unsupported_by_model`, saying why;
- traced (gateway/plumbing/tracing.py), a job's request is a client span of its trace, its
  time in the gateway's queue another, and the request's `traceparent` header names it:
  a server that traces (vLLM with `--otlp-traces-endpoint`) puts its spans under it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import msgspec
from opentelemetry.trace import SpanKind

from backends import server_probes
from backends.queue import JobQueue
from gateway.cost import DEFAULT_RESULT_BYTES, Budget
from gateway.errors import ApiError
from gateway.jobs import Job, end_span, time_limit
from gateway.plumbing import tracing
from gateway import params as params_mod
from gateway.protocol import Code, ModelInfo, Status, ToolInfo
from backends.server_requests import WORKS, StreamedChunk, Work, refusal
from gateway.tools.base import Tool

log = logging.getLogger("streamgate.inference")

ROOT_PATHS = ("/tokenize", "/detokenize")  # vLLM's, beside /v1 rather than under it
POLL_S = 0.5
PROBE_S = 120.0  # to show what a server that has just come up can answer
# A server busy with long prompts answers its health poll late; it is gone once it has not answered
# for this long (or, for one the gateway started, once its process ends: `lost`).
STALL_S = 30.0
# JSON requests (tokenizing, detokenizing, probes) open at once to one server, whatever the jobs and
# tenants: a job's texts are capped, the jobs being admitted at once are not, and they tokenize before
# they hold a slot (--max-decoding-jobs counts completions, up to 256 of them, each of which is far more
# work for the server than a /tokenize). The server's API process is one, and a few requests at a time
# keep it busy; more only queue there, out of the gateway's sight, ahead of the running jobs' streams.
JSON_REQUESTS = 16
CONNECT_S = 10.0  # to open a request; a request's own time is bounded by --job-timeout


def free_port() -> int:
    """A loopback port free now, for a server the gateway starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class _Models(msgspec.Struct):
    class _Model(msgspec.Struct):
        id: str
        max_model_len: int | None = None  # vLLM's

    data: list[_Model]


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
        deadline: float,
        on_tools: Callable[[], None],
        max_result_bytes: int = DEFAULT_RESULT_BYTES,
        code: Mapping[str, Tool] | None = None,
        limits: Mapping[str, int] | None = None,
    ) -> None:
        self.name = name  # the model's name in this gateway
        self.url = url.rstrip("/")
        self.kind = kind  # "vllm" or "openai"
        self.upstream: str | None = None  # the server's own name of the model, from GET /models
        # What it was shown to give once it was up (backends/server_probes.py), and why not the rest.
        self.have: set[str] = set()
        self.missing: dict[str, str] = {"stream": "not contacted yet"}
        self.root = self.url.removesuffix("/v1")
        self.context_length: int | None = None
        self.http = httpx.AsyncClient(
            base_url=self.url,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
            timeout=httpx.Timeout(CONNECT_S, read=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=max(1, min(max_jobs, 256))),
        )
        self.all_tools = tools
        # The tools' code and the server's caps: this gateway makes the server's requests, so it is where
        # the params are decoded (they arrive relayed, as every engine's do).
        self.code = code or {}
        self.limits = limits or {}
        self.queue = JobQueue(queue_size, per_owner=per_owner)
        self.slots = asyncio.Semaphore(max_jobs)
        self.requests = asyncio.Semaphore(JSON_REQUESTS)
        # Only the result is bounded here: a job's memory is the server's own (its KV cache), and what
        # does not fit there is refused by it (its context-length error, 413 `too_long`).
        self.budget = Budget(memory=sys.maxsize, result=max_result_bytes)
        self.job_timeout = job_timeout
        self.jobs: dict[str, Job] = {}  # queued here or running there
        self.running: dict[str, asyncio.Task[None]] = {}
        self.prepared: dict[str, Work] = {}  # the queued jobs' requests, ready to send
        self.supervised = kind == "vllm"  # its process is the gateway's: `lost` says when it ends
        self.deadline = deadline  # how long jobs queued for a server not the gateway's wait while it is down
        self.down_since = time.monotonic()
        self.answered = time.monotonic()  # when its health poll was last answered
        self.healthy = False
        self.problem = "not contacted yet"
        self.failed: str | None = None  # why the server's supervisor gave up on it (`give_up`)
        self.refused = False
        self.waiting: list[Job] = []  # (an engine's: jobs kept over a restart; these stay in `queue`)
        self.ready_since_start = False
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
        # As an engine's: /readyz names the default model by them, whichever kind serves it.
        return {
            "model": self.name, "kind": "causal_lm", "context_length": self.context_length,
            "queued": len(self.queue), "running": len(self.running),
        }

    @property
    def tools(self) -> list[ToolInfo]:
        return self.all_tools if self.healthy else []

    @property
    def served(self) -> list[str]:
        """The tools this server's answers make: those whose needs it has shown."""
        return [name for name, work in WORKS.items() if work.needs <= self.have]

    @property
    def models(self) -> list[ModelInfo]:
        if not self.healthy:
            return []
        served = self.served
        reasons = {
            t.name: f"{t.name} needs what the model {self.name} does not give: it is served by an inference server "
            f"({self.kind}, {self.url}), whose answers are generated text and log-probabilities, not the model's internals"
            for t in self.all_tools
            if t.name not in WORKS
        } | {
            name: f"{name} needs from the inference server of the model {self.name} ({self.url}) what it was not shown to give: "
            + "; ".join(self.missing.get(need, need) for need in sorted(work.needs - self.have))
            for name, work in WORKS.items()
            if name not in served
        }
        return [
            ModelInfo(
                name=self.name, default=False, ready=True, kind="causal_lm", context_length=self.context_length,
                device=f"{self.kind} server", tools=[t.name for t in self.all_tools if t.name in served], unsupported=reasons,
            )
        ]

    def start(self) -> None:
        self._spawn(self._poll_loop())
        self._spawn(self._dispatch_loop())

    async def stop(self) -> None:
        for job in list(self.jobs.values()):  # before their requests are closed, which would end them otherwise
            job.fail(Code.SHUTTING_DOWN, "the gateway is shutting down")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.jobs.clear()
        await self.http.aclose()

    def lost(self, reason: str) -> None:
        """The server's process ended: its running jobs end (retryable); those waiting here stay queued
        for the next one, unless this one never got ready (a crash loop: nothing waits on it)."""
        self._went_away(reason)
        for job_id, task in list(self.running.items()):
            job = self.jobs.get(job_id)
            if job is not None and not job.done:
                job.fail(Code.BACKEND_UNAVAILABLE, f"the inference server {reason}; it is restarting: try again")
            task.cancel()
        if not self.ready_since_start:
            self._fail_queued(f"the inference server {reason} before it was ready; try again")
        self.ready_since_start = False

    def _fail_queued(self, message: str) -> None:
        while (job := self.queue.head) is not None:
            self.queue.remove(job)
            self.jobs.pop(job.id, None)
            self.prepared.pop(job.id, None)
            job.fail(Code.BACKEND_UNAVAILABLE, message)

    # -- health -----------------------------------------------------------------

    async def _poll_loop(self) -> None:
        while True:
            try:
                try:
                    answer = await self.http.get("/models", timeout=10.0)
                except httpx.TimeoutException:
                    if self.healthy and time.monotonic() - self.answered < STALL_S:
                        await asyncio.sleep(POLL_S)
                        continue
                    raise
                self.answered = time.monotonic()
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
                    async with asyncio.timeout(PROBE_S):
                        self.have, self.missing = await server_probes.prove(self)
                    if self.missing:
                        log.info("the inference server of model %s: %s", self.name, "; ".join(self.missing.values()))
                self.healthy, self.problem = True, ""
                self.ready_since_start = True
                self._ready.set()
                if not was:
                    self._on_tools()
            except (httpx.HTTPError, ValueError, msgspec.DecodeError, TimeoutError, ApiError) as exc:
                self._went_away(f"{self.url}: {str(exc) or type(exc).__name__}")
                if not self.supervised and len(self.queue) and time.monotonic() - self.down_since > self.deadline:
                    self._fail_queued(f"the inference server of model {self.name} has been unreachable for over {self.deadline:g} s")
            await asyncio.sleep(POLL_S)

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        """A JSON request to the server and its decoded answer; raises the protocol's refusal."""
        url = (self.root if path in ROOT_PATHS else self.url) + path
        try:
            async with self.requests:
                answer = await self.http.post(url, json=body)
        except httpx.HTTPError as exc:
            raise ApiError(Code.BACKEND_UNAVAILABLE, f"the inference server of model {self.name} could not be reached: {exc}", retry_after=5) from None
        if answer.status_code != 200:
            raise refusal(answer.status_code, answer.content, f"the inference server of model {self.name}")
        return answer.json()

    # -- jobs -------------------------------------------------------------------

    async def submit(self, job: Job, tool: Tool) -> None:
        """Check and prepare the job (its refusals are this call's); send it now if the server has room,
        else queue it here."""
        if tool.name not in self.served:
            raise ApiError(Code.UNSUPPORTED_BY_MODEL, f"{tool.name} cannot run on the inference server of model {self.name}")
        tool = self.code.get(tool.name, tool)
        job.params = await params_mod.decoded(tool, job.params, self.limits)
        work = WORKS[tool.name](
            job.params, self.upstream or self.name, self.post, token_ids="token_ids" in self.have, context=self.context_length
        )
        work.refuse_windows()
        work.check()
        # Priced before the server is asked anything: a hostile job costs it no request. A job whose
        # result grows with its texts' tokens (logprobs of prompts) is priced again once the server has
        # tokenized them, still before it is queued or its completion is sent.
        self.price(tool, work)
        try:
            await work.prepare()
        except (KeyError, IndexError, TypeError, ValueError) as exc:  # an answer of the server's that is not what vLLM's is
            raise ApiError(
                Code.BACKEND_UNAVAILABLE, f"the inference server of model {self.name} answered something that could not be read: {exc!r}",
                retry_after=5,
            ) from None
        if work.tokenized:
            self.price(tool, work)
        if self.healthy and not len(self.queue) and not self.slots.locked():
            await self.slots.acquire()
            try:
                response = await self._open(work, job)
            except BaseException:
                self.slots.release()
                raise
            self.jobs[job.id] = job
            self._begin(job, work, response)  # (a cancel while it was sent ends it there)
            return
        self.queue.put(job)
        self.jobs[job.id] = job
        self.prepared[job.id] = work

    def price(self, tool: Tool, work: Work) -> None:
        """413 `too_large` for a job whose result is over `--max-result-bytes`, priced as on a model here."""
        if tool.cost is not None:
            self.budget.admit(work.price(tool.cost))

    def cancel(self, job: Job) -> bool:
        if job.id not in self.jobs:
            return False
        job.cancel()
        if self.queue.remove(job):
            self.jobs.pop(job.id, None)
            self.prepared.pop(job.id, None)
            job.fail(Code.CANCELLED, "the job was cancelled")
            return True
        task = self.running.get(job.id)
        if task is not None:
            task.cancel()  # closes the request: the server stops generating
        return True

    async def _dispatch_loop(self) -> None:
        while True:
            await self._ready.wait()
            await self.slots.acquire()
            try:
                job = await self.queue.get()
            except BaseException:
                self.slots.release()
                raise
            work = self.prepared.pop(job.id, None)
            if job.done or work is None or job.id not in self.jobs:
                self.slots.release()
                continue
            tracing.queued(job)
            try:
                response = await self._open(work, job)
            except Exception as exc:
                self.slots.release()
                if isinstance(exc, ApiError) and exc.code is Code.BACKEND_UNAVAILABLE and not job.cancel_requested.is_set():
                    # The server went away under it: the job waits for it again, not fails.
                    self._went_away(str(exc))
                    self._requeue(job, work)
                    continue
                self.jobs.pop(job.id, None)
                code, message = (exc.code, exc.message) if isinstance(exc, ApiError) else (Code.REMOTE_ERROR, repr(exc))
                job.fail(code, message)
                continue
            self._begin(job, work, response)

    def _requeue(self, job: Job, work: Work) -> None:
        try:
            self.queue.put(job)
        except ApiError as exc:
            self.jobs.pop(job.id, None)
            job.fail(exc.code, exc.message)
            return
        self.prepared[job.id] = work

    def _went_away(self, problem: str) -> None:
        if self.healthy:
            log.warning("the inference server of model %s went away: %s", self.name, problem)
            self.down_since = time.monotonic()
        self.healthy, self.problem = False, self.failed or problem
        self._ready.clear()

    def counts(self) -> tuple[int, int]:
        """Jobs waiting here for the server's share, and those the server is running: current when read."""
        return len(self.queue), len(self.running)

    def give_up(self, reason: str) -> None:
        """The server cannot start, and starting it again would not help: say why from now on."""
        self.failed = reason
        self._went_away(reason)
        self._fail_queued(reason)

    async def _open(self, work: Work, job: Job) -> httpx.Response:
        """The request sent and its answer's head read (a span of `job`'s trace until the job ends);
        raises the protocol's refusal."""
        span = tracing.child(job.span, "inference", SpanKind.CLIENT, **{"http.request.method": "POST", "url.full": self.url + work.path})
        # A server shown to schedule by request priority (server_probes.py) is sent the job's class's:
        # vLLM serves lower values first.
        body = {**work.body, "priority": -job.priority} if job.priority and "priority" in self.have else work.body
        request = self.http.build_request("POST", work.path, json=body, headers=tracing.headers(span))
        try:
            response = await self.http.send(request, stream=True)
        except httpx.HTTPError as exc:
            error = ApiError(Code.BACKEND_UNAVAILABLE, f"the inference server of model {self.name} could not be reached: {exc}", retry_after=5)
            end_span(span, error.code, error.message)
            raise error from None
        span.set_attribute("http.response.status_code", response.status_code)
        if response.status_code != 200:
            try:
                body = await response.aread()
            except httpx.HTTPError as exc:
                body = str(exc).encode()
            finally:
                await response.aclose()
            error = refusal(response.status_code, body, f"the inference server of model {self.name}")
            end_span(span, error.code, error.message)
            raise error
        if span.is_recording():
            job.when_ended(lambda _: span.end())
        return response

    def _begin(self, job: Job, work: Work, response: httpx.Response) -> None:
        if not work.stream:
            job.set_status(Status.RUNNING)  # its answer comes whole: it runs from being sent
        task = asyncio.create_task(self._follow(job, work, response))
        self.running[job.id] = task
        self._tasks.add(task)
        # Whatever ends the task, even a cancel before its first step: the slot, the books, the request.
        task.add_done_callback(lambda done: self._ended(job, response, done))
        if job.cancel_requested.is_set():  # cancelled while it was being sent
            task.cancel()

    def _ended(self, job: Job, response: httpx.Response, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self.running.pop(job.id, None)
        self.jobs.pop(job.id, None)
        self.slots.release()
        if not job.done:
            job.fail(Code.CANCELLED, "the job was cancelled") if job.cancel_requested.is_set() else job.fail(
                Code.BACKEND_UNAVAILABLE, f"the inference server of model {self.name} stopped answering"
            )
        if not response.is_closed:
            self._spawn(response.aclose())

    async def _follow(self, job: Job, work: Work, response: httpx.Response) -> None:
        """Read the answer into the job's events; whatever ends it, the request is closed and the slot freed."""
        started = time.monotonic()
        server = f"the inference server of model {self.name}"
        limit = time_limit(self.job_timeout, job)
        try:
            async with asyncio.timeout(limit or None):
                if work.stream:
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        chunk = msgspec.json.decode(data, type=StreamedChunk)
                        if chunk.error is not None:
                            status = chunk.error.code if isinstance(chunk.error.code, int) else 400
                            raise refusal(status, msgspec.json.encode({"error": {"message": chunk.error.message}}), server)
                        work.take(chunk, job)
                    result = work.result()
                else:
                    result = await work.answer(msgspec.json.decode(await response.aread()))
            job.succeed(result)
        except asyncio.CancelledError:
            if job.cancel_requested.is_set():
                job.fail(Code.CANCELLED, "the job was cancelled")
            else:
                job.fail(Code.BACKEND_UNAVAILABLE, "the inference server's request was stopped")
        except ApiError as exc:
            job.fail(exc.code, exc.message)
        except TimeoutError:
            job.fail(Code.TIMEOUT, f"the job ran past its limit of {limit:g} s")
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            job.fail(Code.BACKEND_UNAVAILABLE, f"{server} broke off its answer: {exc}")
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            job.fail(Code.REMOTE_ERROR, f"{server} answered something that could not be read: {exc!r}")
        finally:
            log.debug("job %s on %s took %.3f s", job.id, self.name, time.monotonic() - started, extra={"job_id": job.id})

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def api_key(name: str, keys: Mapping[str, str]) -> str | None:
    """A model's API key: the variable `--model-api-key NAME=VAR` names, else OPENAI_API_KEY."""
    return os.environ.get(keys[name]) if name in keys else os.environ.get("OPENAI_API_KEY")
