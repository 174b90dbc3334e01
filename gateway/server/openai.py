"""OpenAI-compatible routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`.

A compatibility layer for clients that speak the OpenAI API (the `openai` SDK,
lm-evaluation-harness's `local-completions` and `local-chat-completions`), not a
second engine: each request becomes an ordinary job of the `generate` or
`logprobs` tool, started through the same checks, per-token limits, queue, batch,
store and metrics as `POST /{tool}/run`. What differs is the wire form, and what
a disconnect means: an OpenAI client does not resume, so a client that goes away
(a stream closed, a request abandoned) cancels its job at once rather than after
the detach grace.

Every request field is either honoured or refused with 400 naming it; none is
accepted and silently dropped. `user` is the one field taken and not used (it is
an end-user id for the provider's own abuse monitoring; it changes no output).
docs/protocol.md lists the fields.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`:
invalid requests are 400 (`code` is the gateway's own code, but for a prompt
that does not fit, which is OpenAI's `context_length_exceeded`), an unknown model
404 `model_not_found`, and limits, readiness and auth keep their status.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import datetime, timezone
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.errors import ApiError, from_validation_error
from gateway.jobs import Job
from gateway.params import check_json, from_fields, off_loop
from gateway.protocol import Code, EventType
from gateway.plumbing.sendbuffer import WholeResponse
from gateway.server.stream import EventStream, follow
from gateway.server.webhooks import HEADER as CALLBACK
from gateway.tools.base import Tool

if TYPE_CHECKING:
    from gateway.server.gateway import Gateway

_STARTED = time.time()  # the `created` of every model in /v1/models

# -- requests ------------------------------------------------------------------------------------

_Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
_TopP = Annotated[float, msgspec.Meta(gt=0, le=1)]
_Seed = Annotated[int, msgspec.Meta(ge=0, le=2**53 - 1)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields both routes take."""

    model: str | None = None
    temperature: _Temperature | None = None  # OpenAI's default is 1
    top_p: _TopP | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: _Seed | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = 16
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class _TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class _Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[_TextPart]
    name: str | None = None


class ChatRequest(_Common, kw_only=True):
    messages: Annotated[list[_Message], msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


def _refuse(field: str, message: str) -> ApiError:
    return ApiError(Code.INVALID_PARAMS, f"{field}: {message}", field=field)


def _refuse_common(request: _Common) -> None:
    """The fields both routes take but cannot honour, unless left at their neutral values."""
    if request.presence_penalty or request.frequency_penalty:
        field = "presence_penalty" if request.presence_penalty else "frequency_penalty"
        raise _refuse(field, "penalties are not supported; leave it 0")
    if request.logit_bias:
        raise _refuse("logit_bias", "not supported; leave it out")


def _stops(stop: str | list[str] | None) -> list[str] | None:
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and any(not s for s in stops):
        raise _refuse("stop", "a stop string must not be empty")
    return stops or None


def _sampling(request: _Common, max_tokens: int) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "stop": _stops(request.stop),
        "seed": request.seed,
        "model": request.model,
        "n": request.n,
    }
    if request.top_p is not None:
        params["top_p"] = request.top_p
    return params


def _prompts(prompt: str | list[Any]) -> tuple[list[str] | None, list[list[int]] | None]:
    """OpenAI's four prompt forms: a string, strings, one token id list, or token id lists."""
    if isinstance(prompt, str):
        return [prompt], None
    if not prompt:
        raise _refuse("prompt", "must not be empty")
    if all(isinstance(p, str) for p in prompt):
        return prompt, None
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return None, [prompt]
    if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
        return None, prompt
    raise _refuse("prompt", "expected a string, an array of strings, an array of token ids, or an array of those arrays")


@dataclass
class _Plan:
    """How one OpenAI request runs as a job, and how its answer is written."""

    tool: str
    params: dict[str, Any]
    chat: bool
    echo: list[str] | None = None  # the prompts, put before each completion (echo without logprobs)
    n: int = 1  # completions per prompt: choice i * n + j is prompt i's j-th
    include_usage: bool = False
    stream: bool = False


def _completion_plan(request: CompletionRequest) -> _Plan:
    _refuse_common(request)
    if request.best_of not in (None, 1):
        raise _refuse("best_of", "only best_of=1 is supported")
    if request.suffix:
        raise _refuse("suffix", "insertion (suffix) is not supported")
    texts, ids = _prompts(request.prompt)
    max_tokens = 16 if request.max_tokens is None else request.max_tokens
    given = {"prompts": texts} if texts is not None else {"token_ids": ids}
    if request.echo and request.logprobs is not None:
        # Scoring the prompt (what evaluation harnesses do): one pass of the `logprobs` tool,
        # which also gives the greedy next token, so max_tokens 1 at temperature 0 is exact.
        # `seed` is taken: nothing is sampled, so it changes nothing.
        if max_tokens > 1 or (max_tokens == 1 and request.temperature != 0):
            raise _refuse(
                "echo",
                "echo with logprobs scores the prompt, with at most one greedy token after it: max_tokens 0, "
                "or 1 with temperature 0 (given: OpenAI's default is 1); for longer completions leave echo out",
            )
        if request.stop:
            raise _refuse("stop", "a stop string has nothing to stop when the prompt is scored")
        if request.top_p not in (None, 1):
            raise _refuse("top_p", "nothing is sampled when the prompt is scored; leave it out")
        if request.n != 1:
            raise _refuse("n", "a prompt is scored once: leave n at 1 with echo and logprobs")
        params = {**given, "top": request.logprobs, "next_token": max_tokens == 1, "model": request.model}
        return _Plan("logprobs", params, chat=False, include_usage=request.include_usage, stream=request.stream)
    if request.logprobs is not None:
        raise _refuse("logprobs", "log-probabilities of generated tokens are not supported; score text with echo and max_tokens 0")
    if max_tokens == 0:
        raise _refuse("max_tokens", "0 generates nothing: it is only for echo with logprobs (scoring the prompt)")
    echo = texts if request.echo else None
    if request.echo and texts is None:
        raise _refuse("echo", "echo without logprobs needs text prompts, not token ids")
    return _Plan(
        "generate", {**given, **_sampling(request, max_tokens)}, chat=False, echo=echo,
        include_usage=request.include_usage, stream=request.stream, n=request.n,
    )


# A chat without max_tokens: OpenAI's own default is "until the model stops", which a
# reply must fit in the context with its conversation to be exact, so a bound is needed.
CHAT_MAX_TOKENS = 256


def _chat_plan(request: ChatRequest, max_tokens_limit: int) -> _Plan:
    _refuse_common(request)
    if request.logprobs or request.top_logprobs:
        raise _refuse("logprobs", "log-probabilities are not supported on chat completions")
    for field, value in (("tools", request.tools), ("tool_choice", request.tool_choice not in (None, "none")),
                         ("parallel_tool_calls", request.parallel_tool_calls)):
        if value:
            raise _refuse(field, "tool calling is not supported")
    if request.response_format is not None and request.response_format.get("type") != "text":
        raise _refuse("response_format", "only {\"type\": \"text\"} is supported")
    if request.max_tokens is not None and request.max_completion_tokens is not None:
        raise _refuse("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    messages = []
    for i, message in enumerate(request.messages):
        if message.name is not None:
            raise _refuse(f"messages[{i}].name", "participant names are not supported")
        content = message.content if isinstance(message.content, str) else "".join(p.text for p in message.content)
        # "developer" is the newer name of "system" (OpenAI's o-series models).
        messages.append({"role": "system" if message.role == "developer" else message.role, "content": content})
    max_tokens = request.max_completion_tokens or request.max_tokens or min(CHAT_MAX_TOKENS, max_tokens_limit)
    return _Plan(
        "generate", {"messages": messages, **_sampling(request, max_tokens)}, chat=True,
        include_usage=request.include_usage, stream=request.stream, n=request.n,
    )


# Gateway field names that differ from the request's, for errors found in the tool's params.
_FIELDS = {"prompts": "prompt", "token_ids": "prompt", "top": "logprobs", "next_token": "max_tokens"}


def _params(tool: Tool, plan: _Plan) -> Any:
    return from_fields(tool, {k: v for k, v in plan.params.items() if v is not None})


def _openai_field(field: str | None) -> str | None:
    """The request's name for a field of the tool's params that an error names."""
    if field is None:
        return None
    head, sep, rest = field.partition("[")
    return _FIELDS.get(head, head) + sep + rest


# -- answers ----------------------------------------------------------------------------------------

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
          408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def error_body(code: str, message: str, field: str | None, status: int) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": field, "code": code}}


def error_response(exc: ApiError) -> Response:
    status = exc.status
    code = exc.code.value
    if exc.code is Code.TOO_LONG:
        status, code = 400, "context_length_exceeded"
    elif exc.code is Code.UNKNOWN_MODEL:
        code = "model_not_found"
    elif status == 422:
        status = 400  # OpenAI answers every invalid request 400
    body = error_body(code, exc.message, _openai_field(exc.field), status)
    headers = dict(exc.headers)
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    return Response(msgspec.json.encode(body), status_code=status, headers=headers, media_type="application/json")


def _failure(data: bytes) -> tuple[int, dict[str, Any]]:
    """A job's `error` event as an OpenAI error and its status."""
    error = msgspec.json.decode(data).get("error", {})
    code = error.get("code", "internal")
    status = {"cancelled": 499, "timeout": 504, "backend_unavailable": 503, "shutting_down": 503}.get(code, 500)
    return status, error_body(code, error.get("message", ""), None, status)


def _usage(result: dict[str, Any]) -> dict[str, int]:
    usage = result.get("usage")
    if usage is not None:
        return usage
    prompt = sum(len(s["token_ids"]) for s in result["sequences"])
    completion = sum(1 for s in result["sequences"] if s.get("next_token"))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _scored_choices(result: dict[str, Any], prompts: list[str] | None) -> list[dict[str, Any]]:
    """`logprobs` results as echoed completion choices with OpenAI's logprobs object; a text
    prompt is echoed as it was written, token ids as their tokens' text."""
    choices = []
    for i, seq in enumerate(result["sequences"]):
        tokens, token_logprobs = list(seq["tokens"]), list(seq["logprobs"])
        top: list[dict[str, float] | None] = [None] + [{t["text"]: t["logprob"] for t in row} for row in seq.get("top") or []]
        if not seq.get("top"):
            top = [None] + [{tok: lp} for tok, lp in zip(tokens[1:], token_logprobs[1:])]
        finish = "length"  # scoring stops where the prompt does, as a completion of max_tokens would
        if seq.get("next_token"):
            nxt = seq["next_token"]
            tokens.append(nxt["text"])
            token_logprobs.append(nxt["logprob"])
            top.append({t["text"]: t["logprob"] for t in seq.get("next_top") or [nxt]})
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        logprobs = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
        text = prompts[i] + (tokens[-1] if seq.get("next_token") else "") if prompts else "".join(tokens)
        choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish})
    return choices


def _answer(plan: _Plan, job: Job, model: str, result: dict[str, Any]) -> dict[str, Any]:
    created = int(job.created)
    if plan.chat:
        replies = [
            {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": reason}
            for i, (text, reason) in enumerate(zip(result["completions"], result["finish_reasons"]))
        ]
        return {"id": f"chatcmpl-{job.id}", "object": "chat.completion", "created": created, "model": model,
                "choices": replies, "usage": result["usage"]}
    if plan.tool == "logprobs":
        choices = _scored_choices(result, plan.params.get("prompts"))
    else:
        choices = [
            {"index": i, "text": (plan.echo[i // plan.n] if plan.echo else "") + text, "logprobs": None, "finish_reason": reason}
            for i, (text, reason) in enumerate(zip(result["completions"], result["finish_reasons"]))
        ]
    return {"id": f"cmpl-{job.id}", "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": _usage(result)}


def _chunk(plan: _Plan, job: Job, model: str, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
    chunk: dict[str, Any] = {
        "id": f"{'chatcmpl' if plan.chat else 'cmpl'}-{job.id}",
        "object": "chat.completion.chunk" if plan.chat else "text_completion",
        "created": int(job.created),
        "model": model,
        "choices": choices,
    }
    if plan.include_usage:
        chunk["usage"] = usage
    return msgspec.json.encode(chunk)


def _sse(data: str) -> bytes:
    return ServerSentEvent(data).encode()


async def _events(job: Job, ping_interval: float = 0) -> AsyncIterator[tuple[EventType | None, bytes]]:
    """The job's events; `(None, b"")` where a ping is due."""
    async for batch, _ in follow(job, 0, ping_interval):
        if not batch:
            yield None, b""
        for event in batch:
            yield event.type, event.data


async def _stream(plan: _Plan, job: Job, model: str, ping_interval: float) -> AsyncIterator[tuple[bytes, bool]]:
    """The job's events as OpenAI's chunks, `data: [DONE]` last; an error as a chunk of its own, the last."""
    if plan.chat:
        for i in range(plan.n):
            yield _sse(_chunk(plan, job, model, [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]).decode()), False
    elif plan.echo:
        for i in range(len(plan.echo) * plan.n):
            yield _sse(_chunk(plan, job, model, [{"index": i, "text": plan.echo[i // plan.n], "logprobs": None, "finish_reason": None}]).decode()), False
    async for kind, data in _events(job, ping_interval):
        if kind is None:
            yield ServerSentEvent(comment=f"ping - {datetime.now(timezone.utc)}").encode(), False
        elif kind is EventType.PARTIAL:
            partial = msgspec.json.decode(data)
            if not partial.get("text"):
                continue
            if plan.chat:
                choice = {"index": partial["index"], "delta": {"content": partial["text"]}, "logprobs": None, "finish_reason": None}
            else:
                choice = {"index": partial["index"], "text": partial["text"], "logprobs": None, "finish_reason": None}
            yield _sse(_chunk(plan, job, model, [choice]).decode()), False
        elif kind is EventType.DATA:
            result = msgspec.json.decode(data)
            if plan.tool == "logprobs":
                finals = _scored_choices(result, plan.params.get("prompts"))
            else:
                blank: dict[str, Any] = {"delta": {}} if plan.chat else {"text": ""}
                finals = [
                    {"index": i, **blank, "logprobs": None, "finish_reason": reason}
                    for i, reason in enumerate(result["finish_reasons"])
                ]
            yield _sse(_chunk(plan, job, model, finals).decode()), False
            if plan.include_usage:
                yield _sse(_chunk(plan, job, model, [], _usage(result)).decode()), False
            yield _sse("[DONE]"), True
        elif kind is EventType.ERROR:
            _, body = _failure(data)
            yield _sse(msgspec.json.encode(body).decode()), True


async def _result(job: Job, request: Request) -> bytes | None:
    """The job's terminal event data, or None if the client went away first."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def terminal() -> None:
        async for _ in _events(job):
            pass

    waiting = asyncio.ensure_future(terminal())
    leaving = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({waiting, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (waiting, leaving):
            task.cancel()
        await asyncio.gather(waiting, leaving, return_exceptions=True)
    return job.terminal.data if waiting.done() and not waiting.cancelled() and job.terminal is not None else None


def _checked(kind: type[msgspec.Struct], body: bytes) -> Any:
    check_json(body)
    return msgspec.json.decode(body, type=kind)


def routes(gateway: Gateway) -> list[Route]:
    """The `/v1/…` routes, every answer (errors included) in OpenAI's shape."""
    settings = gateway.settings

    async def decode(request: Request, kind: type[msgspec.Struct]) -> Any:
        body = await gateway.read_body(request)
        try:
            return await off_loop(_checked, body, kind)
        except msgspec.ValidationError as exc:
            raise from_validation_error(exc) from None
        except msgspec.DecodeError as exc:
            raise ApiError(Code.BAD_REQUEST, f"the body is not valid JSON: {exc}") from None

    async def run(request: Request, plan_of: Callable[[Any], _Plan], kind: type[msgspec.Struct]) -> Response:
        try:
            caller = await gateway.caller(request)  # before the body is read: a client without a token learns only that
            with gateway.streams.slot(caller.tenant) as slot:
                plan = plan_of(await decode(request, kind))

                async def params(tool: Tool) -> Any:
                    return _params(tool, plan)

                # Its answer is made of the result: refused (413) rather than written as files.
                job = await gateway.enter(caller, plan.tool, params, inline=True, callback=request.headers.get(CALLBACK) or None)
                assert isinstance(job, Job)  # no key: never attached
                if not plan.stream:
                    return await _whole(request, plan, job)

                async def ended() -> None:
                    if not job.done:  # the client closed the stream: nobody will read the rest
                        with contextlib.suppress(Exception):
                            await gateway.cancel(job)

                return EventStream(
                    _stream(plan, job, job.model or "", settings.ping_interval),  # 0: no pings
                    slot=slot,
                    job_id=job.id,
                    metrics=gateway.metrics,
                    headers={"X-Job-Id": job.id, "Cache-Control": "no-cache"},
                    send_timeout=settings.write_timeout,
                    on_end=lambda: asyncio.ensure_future(ended()),
                )
        except ApiError as exc:
            return error_response(exc)

    async def _whole(request: Request, plan: _Plan, job: Job) -> Response:
        headers = {"X-Job-Id": job.id}
        try:
            data = await _result(job, request)
        finally:
            if not job.done:  # the client went away, or this request was cancelled
                await gateway.cancel(job)
        if data is None:  # the client went away: nobody will read the answer
            return Response(status_code=499)
        assert job.terminal is not None
        if job.terminal.type is EventType.ERROR:
            status, body = _failure(data)
            return Response(msgspec.json.encode(body), status_code=status, headers=headers, media_type="application/json")
        answer = _answer(plan, job, job.model or "", msgspec.json.decode(data))
        # Big with echo and logprobs (lm-eval's loglikelihood): sent as a stream's big event is.
        return WholeResponse(msgspec.json.encode(answer), headers=headers, **gateway.sending)

    async def completions(request: Request) -> Response:
        return await run(request, _completion_plan, CompletionRequest)

    async def chat_completions(request: Request) -> Response:
        return await run(request, lambda chat: _chat_plan(chat, settings.max_tokens), ChatRequest)

    async def models(request: Request) -> Response:
        # Open, as `GET /models` is: what is served is no secret.
        data = [
            {"id": m.name, "object": "model", "created": int(_STARTED), "owned_by": "streamgate"} for m in gateway.backend.models()
        ]
        return Response(msgspec.json.encode({"object": "list", "data": data}), media_type="application/json")

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]

