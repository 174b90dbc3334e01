"""MCP Tasks over the gateway's jobs: the `io.modelcontextprotocol/tasks` extension (SEP-2663).

The `mcp` SDK (2.3) does not implement this extension: it carries its vocabulary (the open
`resultType`, the `Mcp-Name` header) and the 2025-11-25 experimental tasks' types, which the
2026-07-28 revision removed, but no `tasks/*` methods and no `CreateTaskResult` on the
2026-07-28 wire. So it is implemented here, against SEP-2663's text
(modelcontextprotocol/modelcontextprotocol, seps/2663-tasks-extension.md), as extension methods
of the SDK's low-level server. The one rule: a task is a job, its id the job's id.

- **Created** when a 2026-07-28 `tools/call` declares the extension in its per-request client
  capabilities: the server decides (SEP-2663), and this one answers every such call with a
  `CreateTaskResult` (`resultType: "task"`) once the job is admitted, which is when `tasks/get`
  finds it. A call that does not declare it blocks, with progress, as before; the 2025-11-25
  experimental `task` param is not served.
- **`tasks/get`** reads the job's snapshot: RECEIVED to RUNNING are `working`, with where the job
  stands as `statusMessage`; the `data` event is `completed`, its `result` what the blocking
  call would have returned; an `error` event is `completed` too, with that `isError` result
  (SEP-2663 keeps `failed` for JSON-RPC errors, and a job's error is the tool's), except
  `cancelled`, which is `cancelled`.
- **`tasks/cancel`** is `DELETE /jobs/{id}`'s cancel, acknowledged at once (cooperative: the
  task is `cancelled` once the job has stopped). **`tasks/update`** is acknowledged: no job asks
  its client for input.
- **Lifetime.** The task holds its job as a stream's follower does, until the job ends, so a
  client that follows the same job over SSE (`GET /jobs/{id}/events`, resumable as any job's)
  and leaves does not cancel it; the job's timeout bounds it. `ttlMs` is null while the job
  runs, then its age at its end plus the store's retention, after which the task is unknown.
- **Auth binding.** Each request is the caller's token's, checked as the job routes check it:
  another token's job (an admin's token sees all) is not found (-32602), as an unknown id is.
  Any job of the token's, however started, is a task to `tasks/get` and `tasks/cancel`.
- Task status notifications (`notifications/tasks` on `subscriptions/listen`) are not served:
  polling is the extension's default, and `pollIntervalMs` says how often.
"""

from __future__ import annotations

import datetime
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import msgspec
import mcp_types as types
from mcp.server import Server
from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import Field

from gateway.protocol import Code, ErrorFrame, Event, EventType, JobSnapshot
from gateway.server.auth import Auth, Principal
from gateway.server.store import JobHandle, JobStore

TASKS = "io.modelcontextprotocol/tasks"
POLL_INTERVAL_MS = 1000


class TaskParams(types.RequestParams):
    task_id: Annotated[str, Field(max_length=256)]


class UpdateTaskParams(TaskParams):
    input_responses: dict[str, Any] | None = None


class Tasks:
    """The extension's methods over the job store; `create` answers a call with its job's task."""

    def __init__(
        self,
        store: JobStore,
        auth: Auth,
        retention: float,
        *,
        principal: Callable[[ServerRequestContext[Any]], Principal | None],
        result: Callable[[str, Event], Awaitable[types.CallToolResult]],
    ) -> None:
        self.store = store
        self.auth = auth
        self.retention = retention
        self._principal = principal
        self._result = result

    def register(self, server: Server[Any]) -> None:
        server.extensions = {**server.extensions, TASKS: {}}
        server.add_request_handler("tasks/get", TaskParams, self._get)
        server.add_request_handler("tasks/cancel", TaskParams, self._cancel)
        server.add_request_handler("tasks/update", UpdateTaskParams, self._update)

    @staticmethod
    def wanted(ctx: ServerRequestContext[Any]) -> bool:
        """Whether this request's client declared the extension, on the wire that defines it."""
        if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            return False
        capabilities = (ctx.meta or {}).get(types.CLIENT_CAPABILITIES_META_KEY)
        extensions = capabilities.get("extensions") if isinstance(capabilities, dict) else None
        return isinstance(extensions, dict) and TASKS in extensions

    def create(self, job: Any) -> dict[str, Any]:
        """The `CreateTaskResult` of an admitted job, which the task now holds (see the module docstring)."""
        if not job.done:
            self.store.attach(job)
            job.when_ended(self.store.detach)
        return {"resultType": "task", **self._task(job.snapshot(kept=[]))}

    async def _get(self, ctx: ServerRequestContext[Any], params: TaskParams) -> dict[str, Any]:
        job = await self._job(ctx, params.task_id)
        # A result in the spool is a marker here, never read whole: the answer splices it in (gateway/server/mcp.py).
        snapshot = job.snapshot(kept=[])
        state = self._task(snapshot)
        if job.terminal is not None and state["status"] == "completed":
            result = await self._result(snapshot.job_id, job.terminal)
            state["result"] = result.model_dump(by_alias=True, mode="json", exclude_none=True)
        return state

    async def _cancel(self, ctx: ServerRequestContext[Any], params: TaskParams) -> types.EmptyResult:
        job = await self._job(ctx, params.task_id)
        if not job.done:
            await self.store.cancel(job)
        return types.EmptyResult()

    async def _update(self, ctx: ServerRequestContext[Any], params: UpdateTaskParams) -> types.EmptyResult:
        await self._job(ctx, params.task_id)
        return types.EmptyResult()

    async def _job(self, ctx: ServerRequestContext[Any], task_id: str) -> JobHandle:
        if not self.wanted(ctx):
            raise MCPError(
                code=types.MISSING_REQUIRED_CLIENT_CAPABILITY,
                message="Missing required client capability",
                data={"requiredCapabilities": {"extensions": {TASKS: {}}}},
            )
        job = await self.store.get(task_id)
        if job is None or not self.auth.sees(self._principal(ctx), job.snapshot(kept=[]).owner):
            raise MCPError(code=types.INVALID_PARAMS, message="Failed to retrieve task: Task not found")
        return job

    def _task(self, snapshot: JobSnapshot) -> dict[str, Any]:
        """The `Task` fields of a job's snapshot (`tasks/get` adds the result)."""
        updated = snapshot.finished or snapshot.started or snapshot.created
        task: dict[str, Any] = {
            "taskId": snapshot.job_id,
            "createdAt": _iso(snapshot.created),
            "lastUpdatedAt": _iso(updated),
            "ttlMs": None,
            "pollIntervalMs": POLL_INTERVAL_MS,
        }
        if snapshot.terminal is None:
            task.update(status="working", statusMessage=_standing(snapshot))
            return task
        task["ttlMs"] = round((updated - snapshot.created + self.retention) * 1000)
        if snapshot.terminal.event == EventType.ERROR.value:
            error = msgspec.json.decode(bytes(snapshot.terminal.data), type=ErrorFrame).error
            if error.code is Code.CANCELLED:
                task.update(status="cancelled", statusMessage=error.message)
                return task
            task["statusMessage"] = f"{error.code.value}: {error.message}"
        task["status"] = "completed"
        return task


def _standing(snapshot: JobSnapshot) -> str:
    if snapshot.status == "QUEUED" and snapshot.position is not None:
        return f"queued: {snapshot.position} in line"
    progress = snapshot.progress
    if snapshot.status == "RUNNING" and progress is not None:
        total = f"/{progress.total}" if progress.total is not None else ""
        return f"running: {progress.done}{total}" + (f" {progress.unit}" if progress.unit else "")
    return snapshot.status.lower()


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
