"""`/mcp`: the gateway as an MCP server (Streamable HTTP, stateless), on the official `mcp` SDK.

Another surface over the same jobs, as the OpenAI routes are (gateway/server/openai.py): a
`tools/call` is an ordinary job, admitted by `Admission` for the caller's bearer token with
its tenancy, quotas and place in `GET /jobs`; the job's frames become the call's notifications
and its terminal event the call's result. Nothing here runs a job or keeps one.

- **Tools.** One MCP tool per served tool and model: the default model's under the tool's own
  name (`generate`), every other model's as `<tool>__<model>` (`generate__small`; characters
  outside `[A-Za-z0-9_-]` in a model's name become `_`). A tool a model cannot run (`GET
  /models`' `unsupported`) is left out for that model, and one the token may not use for every
  model. `inputSchema` is the tool's params schema as `GET /tools` shows it, less `model`,
  which the tool's name says; `outputSchema` is its result's.
- **Progress.** With a progress token, each batch of the job's events is at most one
  `notifications/progress`, whose value only rises: while queued, the places the job moved up
  in line (its position when first queued, less its position now); once running, the tool's
  `done` and `total` as the tool reports them. Partial text is the notification's message (else
  where the job stands); a message with no rise to report takes a value between the last and
  the next whole step (or the total), and text with no room left rides on the next one
  (`Rising`). Log frames are `notifications/message` at their level (on 2026-07-28 only when
  the request's `_meta` asks for logs, at that level and above).
- **Results.** The `data` event is `structuredContent`, and its JSON the text content (for a
  result of `SPLICE_FROM` bytes or more, on a protocol that has `structuredContent`, a line
  saying where it is instead: the JSON once, not twice, and a text no model could read); an
  `error` event, or a refusal before the job started (the 4xx of `POST /{tool}/run`), is a
  result with `isError`: `<code>: <message>` as its text, the protocol's error object in its
  `_meta` (`streamgate/error`; not `structuredContent`, which clients check against the result
  schema even on an error). The job's id is in the result's `_meta` (`streamgate/job_id`). A
  call whose result is priced over `INLINE_RESULT_BYTES` is refused before it is queued
  (`isError` `too_large`, naming the param); an unpriced tool's result over it answers
  `too_large` naming the job, whose result `GET /jobs/{id}` has. A result of `SPLICE_FROM`
  bytes or more is written into its answer from the job's one copy (`Splicing`), never built
  as Python objects.
- **Cancelling.** A client that leaves (on 2026-07-28, closing the response stream is how a
  client cancels) cancels its job at once, as an OpenAI client's does. On the handshake-era
  wire a `notifications/cancelled` arrives as a request of its own; stateless, nothing ties it
  to the call, so it cancels the call with that request id made by the same tenant (token, or
  address without tokens), and none if that tenant has more than one: request ids are only
  unique per client.
- **Tasks** (gateway/server/mcp_tasks.py): a 2026-07-28 client that declares the tasks
  extension gets every call answered as a task, which is the job.
- **Webhooks.** A request with a `Callback-URL` header has the job of its `tools/call` told
  to that URL as it ends (gateway/server/webhooks.py), checked as on `/run`: a task's client
  then need not poll.
- **HTTP.** Every request needs the gateway's token (the same 401 as every route), takes a
  stream slot of its tenant (503 `overloaded`, 429 `rate_limited`), and its body is read with
  the run's limits (413, 408) before the SDK parses it. A request with an `Origin` header
  that `--cors-origins` does not list is refused 403 (a page elsewhere, DNS rebinding). Each
  write that a client leaves blocked for `--write-timeout` cuts its connection, and a big one
  goes out in pieces (gateway/plumbing/sendbuffer.py).

The SDK's low-level `Server` and its session manager (stateless) serve both wire eras: the
2026-07-28 per-request envelope (the Python SDK's default) and the 2025 initialize handshake
(the Inspector's default). `MCPServer` (FastMCP) was not used: it builds tools from Python
functions and validates arguments with pydantic, where these tools are Structs that
`Admission` decodes, schemas that `GET /tools` already publishes, and a list that changes
with the models served.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import anyio
import msgspec
import mcp_types as types
from mcp.server import CacheHint, Server
from mcp.server.connection import allowed_log_levels
from mcp.server.context import ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.exceptions import MCPError
from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

from gateway import params as params_mod
from gateway.errors import ApiError, ParamError
from gateway.jobs import Job
from gateway.plumbing import sendbuffer
from gateway.plumbing.logs import bind_job
from gateway.protocol import Code, ErrorFrame, ErrorInfo, Event, EventType
from gateway.server import webhooks
from gateway.server.gateway import Caller, Gateway
from gateway.server.mcp_frames import Rising, Splicing, log_lines
from gateway.server.mcp_tasks import Tasks
from gateway.server.stream import follow
from gateway.tools.base import MODEL_FIELD, Tool

log = logging.getLogger("streamgate.mcp")

SEPARATOR = "__"  # between a tool's name and its model's, for a model other than the default
MAX_NAME = 64  # what the model APIs that agents call tools through accept (OpenAI's, Anthropic's)
PAGE = 100  # tools per `tools/list` page
ENVELOPE_BYTES = 64 * 1024  # the JSON-RPC around a call's arguments, over the run's body limit
INLINE_RESULT_BYTES = 8 << 20
SPLICE_FROM = 64 * 1024  # a result this big is spliced into its answer (`Splicing`), not built by the SDK
# The first protocol version with `structuredContent`: from it, a spliced result is sent once.
STRUCTURED_FROM = "2025-06-18"
JOB_META = "streamgate/job_id"
ERROR_META = "streamgate/error"
CALLER = "streamgate.mcp.caller"  # the scope key the HTTP layer leaves the caller under, for the handlers


@dataclass(frozen=True)
class Entry:
    """One MCP tool: a gateway tool on one model (None: the default)."""

    tool: str
    model: str | None
    listed: types.Tool


class McpServer:
    """The `/mcp` endpoint (an ASGI app) and the MCP server behind it; `running()` goes in the app's lifespan."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.tasks = Tasks(
            gateway.store, gateway.auth, gateway.settings.retention, principal=lambda ctx: _caller(ctx).principal, result=self._result
        )
        self._catalog_key: object = None
        self._entries: dict[str, Entry] = {}
        # Calls being followed, by (tenant, request id): what a handshake-era `notifications/cancelled` names.
        self._calls: dict[tuple[str, str], list[Job]] = {}
        self.splicing = Splicing()
        server: Server[Any] = Server(
            "streamgate",
            version=_version(),
            instructions=(
                "Each tool runs a job on a streamgate gateway. Tools named <tool>__<model> run on that model; "
                "the others on the gateway's default model."
            ),
            # Scoped to the token (a token may not use every tool): never shared between callers.
            cache_hints={"tools/list": CacheHint(ttl_ms=0, scope="private")},
            get_tool_input_schema=self._input_schema,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )
        self.tasks.register(server)
        # The 2025 wire's `logging/setLevel`, acknowledged: stateless, no level outlives its request,
        # so a call's logs go out at every level there (2026-07-28 asks per request, in `_meta`).
        server.add_request_handler("logging/setLevel", types.SetLevelRequestParams, _acknowledge)
        server.add_notification_handler("notifications/cancelled", types.CancelledNotificationParams, self._cancelled)
        self.server = server
        self.manager = StreamableHTTPSessionManager(
            server, stateless=True, max_request_body_size=gateway.settings.max_body_bytes + ENVELOPE_BYTES
        )

    def running(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self.manager.run()

    # -- HTTP ------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway = self.gateway
        request = Request(scope, receive)
        try:
            origin = request.headers.get("origin")
            if origin is not None and origin not in gateway.settings.cors_origins:
                raise ApiError(Code.FORBIDDEN, f"/mcp does not take requests from pages at {origin!r} (see --cors-origins)")
            caller = await gateway.caller(request)
            with gateway.streams.slot(caller.tenant):
                body = await gateway.read_body(request, ENVELOPE_BYTES)
                scope[CALLER] = caller
                await self.manager.handle_request(scope, _replay(body, receive), self._bounded(scope, send))
        except ApiError as exc:
            await exc.response()(scope, receive, send)

    def _bounded(self, scope: Scope, send: Send) -> Send:
        """`send`, each write within the write timeout (a big body a piece at a time), or the connection
        cut: what is sent after that goes nowhere, and the SDK learns that its client left, as from any
        client that leaves (an exception would reach it as a server fault, traceback and all)."""
        timeout = self.gateway.settings.write_timeout
        cut = False
        start: Message | None = None  # a JSON answer's head, held until its body shows whether it splices

        async def bounded(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and _content_type(message) == b"application/json":
                start = message
                return
            body = message.get("body", b"") if message["type"] == "http.response.body" else b""
            spliced = self.splicing.parts(body) if message["type"] == "http.response.body" else None
            if start is not None:
                head, start = start, None
                if spliced is not None:  # its length is no longer the body's: sent chunked
                    head = {**head, "headers": [(k, v) for k, v in head["headers"] if k.lower() != b"content-length"]}
                await write(head)
            if spliced is not None:
                async with contextlib.aclosing(sendbuffer.part_pieces(spliced, message.get("more_body", False))) as writes:
                    async for piece in writes:
                        await write(piece)
                return
            writes = sendbuffer.pieces(body, message.get("more_body", False)) if len(body) > sendbuffer.PIECE else (message,)
            for piece in writes:
                await write(piece)

        async def write(message: Message) -> None:
            nonlocal cut
            if cut:
                return
            try:
                with anyio.fail_after(timeout):
                    await send(message)
            except TimeoutError:
                cut = True
                await sendbuffer.cut(scope, lambda: self.gateway.metrics.client_timeout("write"), timeout)

        return bounded

    # -- tools -----------------------------------------------------------------------------------

    def catalog(self) -> dict[str, Entry]:
        """The MCP tools by name, described again whenever the tools or the models served change."""
        backend = self.gateway.backend
        models = tuple(backend.model_names())
        key = (backend.tools_version, models)
        if key != self._catalog_key:
            self._entries = _describe(backend, self.gateway.limits, models)
            self._catalog_key = key
        return self._entries

    def _input_schema(self, name: str) -> Mapping[str, Any] | None:
        entry = self.catalog().get(name)
        return entry.listed.input_schema if entry is not None else None

    async def _list_tools(self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams) -> types.ListToolsResult:
        caller = _caller(ctx)
        mine = [e.listed for e in self.catalog().values() if _may_use(caller, e.tool)]
        start = 0
        if params.cursor is not None:
            if not (params.cursor.isascii() and params.cursor.isdigit() and len(params.cursor) < 10):
                raise MCPError(code=types.INVALID_PARAMS, message="not a cursor this server gave")
            start = int(params.cursor)
        page = mine[start : start + PAGE]
        more = start + PAGE < len(mine)
        return types.ListToolsResult(tools=page, next_cursor=str(start + PAGE) if more else None)

    async def _call_tool(self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> Any:
        caller = _caller(ctx)
        entry = self.catalog().get(params.name)
        if entry is None:
            raise MCPError(code=types.INVALID_PARAMS, message=f"no tool named {params.name[:128]!r}: tools/list names them")
        try:
            job = await self._admit(caller, entry, params.arguments or {}, _callback(ctx))
        except ApiError as exc:
            return _error_result(exc.info(), retry_after=exc.retry_after)
        bind_job(job.id)
        if self.tasks.wanted(ctx):
            return self.tasks.create(job)
        return await self._follow(ctx, caller, job)

    async def _admit(self, caller: Caller, entry: Entry, arguments: dict[str, Any], callback: str | None = None) -> Job:
        """The call's job, admitted as a run of the tool with these arguments as its body would be;
        `callback`: the request's `Callback-URL`, told the job's end (a task's, above all)."""
        gateway = self.gateway
        most = gateway.settings.max_body_bytes

        async def params(tool: Tool) -> Any:
            given = arguments.get(MODEL_FIELD)
            if given is not None and given != (entry.model or gateway.backend.resolve_model(None)):
                on = entry.model or "the default model"
                raise ParamError(MODEL_FIELD, f"this tool runs on {on}; the tool's name chooses the model")
            fields = {**arguments, MODEL_FIELD: entry.model} if entry.model is not None else arguments
            try:
                body = msgspec.json.encode(fields)
            except (msgspec.EncodeError, OverflowError) as exc:
                raise ApiError(Code.INVALID_PARAMS, f"the arguments cannot be read: {exc}") from None
            if len(body) > most:
                raise ApiError(Code.TOO_LARGE, f"the arguments are over the limit of {most} bytes")
            return await gateway.admission.decode(tool, body, what="the arguments")

        job = await gateway.enter(caller, entry.tool, params, most_result=INLINE_RESULT_BYTES, callback=callback)
        assert isinstance(job, Job)  # no key: never attached
        return job

    async def _follow(self, ctx: ServerRequestContext[Any], caller: Caller, job: Job) -> Any:
        """Follow the job to its end, its frames as notifications; the result, or `isError`."""
        store = self.gateway.store
        key = (caller.tenant, _request_key(ctx.request_id))
        self._calls.setdefault(key, []).append(job)
        store.attach(job)  # as a stream's follower: a viewer of the job that leaves does not cancel it
        try:
            rising = Rising()
            logs = allowed_log_levels(ctx.protocol_version, ctx.meta)
            async for batch, _ in follow(job):
                for level, message in log_lines(batch):
                    if level in logs:
                        await ctx.session.send_notification(
                            types.LoggingMessageNotification(
                                params=types.LoggingMessageNotificationParams(level=level, logger="streamgate", data=message)
                            ),
                            related_request_id=ctx.request_id,
                        )
                step = rising.step(batch)
                if step is not None:
                    await ctx.session.report_progress(*step)
            assert job.terminal is not None
            structured_only = (ctx.protocol_version or "") >= STRUCTURED_FROM
            return await self._result(job.id, job.terminal, structured_only)
        finally:
            calls = self._calls.get(key, [])
            if job in calls:
                calls.remove(job)
            if not calls:
                self._calls.pop(key, None)
            if not job.done:  # the client left, or cancelled: nobody will read the answer
                with anyio.CancelScope(shield=True):
                    await store.cancel(job)
            store.detach(job)

    async def _result(self, job_id: str, terminal: Event, structured_only: bool = True) -> types.CallToolResult:
        """A terminal event as a `CallToolResult`; a big result as markers the answer splices it into.
        `structured_only`: the client's protocol has `structuredContent` (2025-06-18 on), and a big result
        is there alone, the text content saying so; else it is the text content too."""
        meta = {JOB_META: job_id}
        if terminal.type is EventType.ERROR:
            return _error_result(msgspec.json.decode(terminal.data, type=ErrorFrame).error, meta=meta)
        if terminal.size > INLINE_RESULT_BYTES:  # an unpriced tool's: refused here, after the fact
            info = ErrorInfo(
                Code.TOO_LARGE,
                f"the result is {terminal.size} bytes, over the {INLINE_RESULT_BYTES} an MCP call returns inline: "
                f"read it from GET /jobs/{job_id}",
                retryable=False,
            )
            return _error_result(info, meta=meta)
        if terminal.kept is not None or terminal.size >= SPLICE_FROM:
            text, structured = self.splicing.stand_in(terminal)
            if structured_only:
                # MCP asks for the JSON as text too (a SHOULD, for clients older than structured
                # content): at this size it is twice the answer, and more than a model's context.
                text = f"{terminal.size} bytes of JSON, in structuredContent (also GET /jobs/{job_id} while it is kept)"
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=text)], structured_content=structured, is_error=False, meta=meta
            )
        data = terminal.raw
        structured = msgspec.json.decode(data)
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=data.decode())],
            structured_content=structured if isinstance(structured, dict) else None,
            is_error=False,
            meta=meta,
        )

    async def _cancelled(self, ctx: ServerRequestContext[Any], params: types.CancelledNotificationParams) -> None:
        if params.request_id is None:
            return
        calls = self._calls.get((_caller(ctx).tenant, _request_key(params.request_id)), [])
        if len(calls) == 1:
            await self.gateway.cancel(calls[0])
        elif calls:
            log.info("notifications/cancelled for request %r: %d calls of that id, none cancelled", params.request_id, len(calls))


def _content_type(start: Message) -> bytes:
    for key, value in start.get("headers", ()):
        if key.lower() == b"content-type":
            return value.split(b";")[0].strip().lower()
    return b""


def _error_result(info: ErrorInfo, *, meta: dict[str, Any] | None = None, retry_after: float | None = None) -> types.CallToolResult:
    """An error event's, or a refusal's, `ErrorInfo` as a `CallToolResult` with `isError` (see the module docstring)."""
    error = msgspec.to_builtins(info)
    if retry_after is not None:
        error["retry_after"] = max(1, math.ceil(retry_after))
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=f"{info.code.value}: {info.message}")],
        is_error=True,
        meta={**(meta or {}), ERROR_META: error},
    )


def _describe(backend: Any, limits: Mapping[str, int], models: tuple[str, ...]) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for i, model in enumerate(models or (None,)):
        infos = params_mod.describe(backend.tools.values(), limits, lambda t, m=model: backend.unsupported(t, m))
        for info in infos:
            if info.unsupported is not None:
                continue
            on = None if i == 0 else model
            name = info.name if on is None else _name(info.name, on, entries)
            inputs = copy.deepcopy(info.params_schema)
            inputs.get("properties", {}).pop(MODEL_FIELD, None)
            if MODEL_FIELD in inputs.get("required", ()):
                inputs["required"] = [r for r in inputs["required"] if r != MODEL_FIELD]
            outputs = info.result_schema if info.result_schema.get("type") == "object" else None
            where = f"the model {on!r}" if on is not None else f"the default model{f' ({model!r})' if model else ''}"
            listed = types.Tool(
                name=name,
                title=f"{info.name} on {on}" if on is not None else info.name,
                description=f"{info.description}\n\nRuns on {where}, as a job of the gateway's `{info.name}` tool.",
                input_schema=inputs,
                output_schema=outputs,
            )
            entries[name] = Entry(info.name, on, listed)
    return entries


def _name(tool: str, model: str, taken: Mapping[str, Entry]) -> str:
    """`<tool>__<model>`, in the characters and length agents' model APIs take, unique among `taken`."""
    name = f"{tool}{SEPARATOR}{re.sub(r'[^A-Za-z0-9_-]', '_', model)}"
    if len(name) <= MAX_NAME and name not in taken:
        return name
    suffix = "_" + hashlib.sha256(model.encode()).hexdigest()[:8]
    return name[: MAX_NAME - len(suffix)] + suffix


def _may_use(caller: Caller, tool: str) -> bool:
    principal = caller.principal
    return principal is None or principal.tools is None or tool in principal.tools


def _caller(ctx: ServerRequestContext[Any]) -> Caller:
    request = ctx.request
    caller = request.scope.get(CALLER) if isinstance(request, Request) else None
    if not isinstance(caller, Caller):  # only the HTTP layer reaches the handlers, and it always sets one
        raise MCPError(code=types.INVALID_REQUEST, message="no caller")
    return caller


def _callback(ctx: ServerRequestContext[Any]) -> str | None:
    """The HTTP request's `Callback-URL`: a completion webhook for the job its `tools/call` starts."""
    request = ctx.request
    return (request.headers.get(webhooks.HEADER) or None) if isinstance(request, Request) else None


def _request_key(request_id: Any) -> str:
    return f"{type(request_id).__name__}:{request_id}"


async def _acknowledge(ctx: ServerRequestContext[Any], params: Any) -> types.EmptyResult:
    return types.EmptyResult()


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for a request whose body was read already: the body once, then the connection's own messages."""
    given = False

    async def replayed() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _version() -> str:
    try:
        return metadata.version("streamgate")
    except metadata.PackageNotFoundError:
        return "0"
