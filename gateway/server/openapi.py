"""`GET /openapi.json`: an OpenAPI 3.1 document of the gateway, generated from the code.

Every schema in it comes from a msgspec Struct through
`msgspec.json.schema_components`: the frames and error body of
`gateway/protocol.py`, and each tool's params, result and partial as `GET /tools`
describes them (caps applied, so the document bounds `max_tokens` exactly as the
gateway does). Nothing is written twice by hand, so the document cannot drift
from what the gateway validates and sends; `tests/test_fuzz.py` holds it to that
by running schemathesis against a live server.

Each tool gets its own `POST /{name}/run` (the params as the JSON body) and
`GET /{name}/run` (the params as query keys, or `params=<JSON>` where a field
cannot be a flat key). The stream's `text/event-stream` schema describes one
event, as schemathesis and OpenAPI 3.2's `itemSchema` read it: `event`, `id`,
and `data` as JSON text whose `contentSchema` is the frame's.

The document is built on first request and again whenever the backend's tools
change (a remote backend learns its tools from executors after start-up).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.backend import Backend
from gateway import params as params_mod
from gateway.errors import STATUS_OF
from gateway.server.metering import QuotaLeft, Row
from gateway.server.store import MAX_PAGE, STATES
from gateway.protocol import ErrorBody, ErrorFrame, JobList, JobSnapshot, LogFrame, ModelList, StatusFrame, ToolInfo, encode

OPENAPI_VERSION = "3.1.1"
REF = "#/components/schemas/{name}"
JOB_ID = "^[0-9a-f]{32}$"
EVENT_ID = "^[0-9a-f]{32}:[0-9]+$"


# Bodies that the handlers in app.py build as dicts: Structs here, so their schemas are generated too.
class Health(msgspec.Struct):
    """`GET /healthz`."""

    status: str


class Readiness(msgspec.Struct):
    """`GET /readyz`: `ready`, a `reason` when not, and the backend's facts (which differ by backend)."""

    ready: bool
    reason: str | None = None
    backend: str | None = None
    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    context_length: int | None = None
    queued: int | None = None
    running: int | None = None
    max_batch_size: int | None = None
    max_decoding_jobs: int | None = None
    executors: list[dict[str, Any]] | None = None


class Cancellation(msgspec.Struct):
    """`DELETE /jobs/{id}`: `cancelled` is false for a job that had already ended."""

    job_id: str
    cancelled: bool
    status: str


class Ticket(msgspec.Struct):
    """`POST /auth/ticket`: a ticket for GET streams (`?ticket=`), valid `expires_in` seconds."""

    ticket: str
    expires_in: float


class Allowance(msgspec.Struct):
    """A caller's limits, and what of them is in use in this gateway process."""

    max_concurrent: int | None
    jobs_per_minute: int | None
    running: int
    started_last_minute: int
    max_job_memory: int | None = None  # bytes one job may be priced at (its class's; --max-job-memory bounds it too)
    job_timeout: float | None = None  # seconds one job may run (its class's; --job-timeout bounds it too)


class Me(msgspec.Struct):
    """`GET /me`: who the caller is (name null on a gateway without auth), their class and limits."""

    name: str | None
    tenant: str
    user_class: str | None = msgspec.field(name="class")
    priority: int = 0
    groups: list[str] = []
    admin: bool = False
    weight: float = 1.0
    tools: list[str] | None = None
    models: list[str] | None = None
    usage: Allowance | None = None
    quotas: list[QuotaLeft] = []  # its class's quotas, what of each is used this window, and when it turns


class UsageReport(msgspec.Struct):
    """`GET /usage`: settled use by tenant, class and model (the `by` keys asked for; each row sums
    the others), the largest device-seconds first, at most `limit` rows; `rows_total` before the limit."""

    rows: list[Row]
    rows_total: int


PROTOCOL = (
    StatusFrame, LogFrame, ErrorFrame, ErrorBody, JobSnapshot, JobList, ToolInfo, ModelList, Health, Readiness, Cancellation, Ticket, Me,
    UsageReport,
)

# What each error status means, from the codes that answer it.
ERROR_STATUSES = (400, 401, 403, 404, 408, 409, 413, 416, 422, 429, 431, 503)
# What any request may be answered, whatever its route: its line and headers over --max-header-bytes.
EVERY_ROUTE = (431,)


def endpoint(backend: Backend, limits: Mapping[str, int], *, secured: bool) -> Callable[[Request], Any]:
    """The `GET /openapi.json` handler: the document for the tools `backend` serves now."""
    built: list[Any] = [None, b""]  # the tools and model last described, and their document

    async def openapi_json(request: Request) -> Response:
        if built[0] != backend.tools_version:
            # Only the tools the served model can run: the others answer 422 unsupported_by_model.
            served = [t for t in backend.tools.values() if backend.unsupported(t) is None]
            doc = document(served, limits, secured=secured)
            refused = {t.name: why for t in backend.tools.values() if (why := backend.unsupported(t)) is not None}
            if refused:
                doc["info"]["x-unsupported-tools"] = refused
            built[:] = [backend.tools_version, encode(doc)]
        return Response(built[1], media_type="application/json")

    return openapi_json


def document(tools: Iterable[Any], limits: Mapping[str, int], *, secured: bool = False) -> dict[str, Any]:
    """The OpenAPI document for `tools` (`Tool`s), with `limits` applied to their params."""
    refs, schemas = msgspec.json.schema_components(PROTOCOL, ref_template=REF)
    ref = {tp.__name__: r for tp, r in zip(PROTOCOL, refs)}
    schemas["Event"] = _event_schema(ref, result={}, partial={})
    paths: dict[str, Any] = {}
    for info in params_mod.describe(tools, limits):
        paths[f"/{info.name}/run"] = _run_path(info, ref, schemas)
    paths.update(_other_paths(ref))
    doc: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "streamgate",
            "version": _version(),
            "description": "A streaming job gateway for model tools: `POST /{tool}/run` answers with the job's "
            "Server-Sent Events. The wire protocol is in docs/protocol.md.",
        },
        "paths": paths,
        "components": {"schemas": schemas, "responses": _error_responses(ref)},
    }
    if secured:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "ticket": {
                "type": "apiKey",
                "in": "query",
                "name": "ticket",
                "description": "From `POST /auth/ticket`; GET requests only.",
            },
        }
        for path, item in paths.items():
            for method, op in item.items():
                if "401" in op["responses"]:
                    op["security"] = [{"bearer": []}, {"ticket": []}] if method == "get" else [{"bearer": []}]
    return doc


def _run_path(info: ToolInfo, ref: Mapping[str, Any], schemas: dict[str, Any]) -> dict[str, Any]:
    """`/{name}/run`: POST with a JSON body, GET with query keys; both answer the job's stream."""
    name = info.name
    params = _hoist(schemas, name, "params", info.params_schema)
    result = _hoist(schemas, name, "result", info.result_schema)
    partial = _hoist(schemas, name, "partial", info.partial_schema) if info.partial_schema else None
    schemas[f"{name}.event"] = _event_schema(ref, result=result, partial=partial)
    stream = _stream_responses({"$ref": REF.format(name=f"{name}.event")}, (400, 401, 403, 404, 408, 413, 422, 429, *EVERY_ROUTE, 503))
    idempotency = {
        "name": "Idempotency-Key",
        "in": "header",
        "schema": {"type": "string"},
        "description": "A repeated request with the same key attaches to the job the first one started.",
    }
    resume = {
        "name": "Last-Event-ID",
        "in": "header",
        "schema": {"type": "string"},  # no pattern: the gateway ignores an empty one, as a browser would
        "description": "`<job_id>:<seq>`. On GET: resume that job after that event instead of starting one (what EventSource sends "
        "when it reconnects). On POST, with an Idempotency-Key: where to go on in the job the key started.",
    }
    return {
        "post": {
            "operationId": f"{name}.run",
            "summary": info.description.split("\n", 1)[0],
            "description": info.description,
            "tags": ["tools"],
            "parameters": [idempotency, resume],
            "requestBody": {"required": True, "content": {"application/json": {"schema": params}}},
            "responses": stream,
        },
        "get": {
            "operationId": f"{name}.run.get",
            "summary": f"{name}, for EventSource: params as query keys",
            "description": "Each query key is one param; repeat a key for a list. Or give one key, "
            "`params=<JSON object>`, and nothing else.",
            "tags": ["tools"],
            "parameters": [*_query_parameters(params, schemas), idempotency, resume],
            "responses": stream,
        },
    }


def _hoist(schemas: dict[str, Any], tool: str, role: str, schema: dict[str, Any]) -> dict[str, Any]:
    """Put a self-contained schema (from `GET /tools`) among the components as `{tool}.{role}`; its ref.

    Its `$defs` become `{tool}.{Name}` components, so that two tools' Structs of one
    name never collide, and every `#/$defs/` reference is rewritten to match.
    """
    schema = dict(schema)
    defs = schema.pop("$defs", {})
    rename = lambda name: _component_name(f"{tool}.{name}")  # noqa: E731
    for name, sub in defs.items():
        schemas[rename(name)] = _rewrite_refs(sub, rename)
    schemas[_component_name(f"{tool}.{role}")] = _rewrite_refs(schema, rename)
    return {"$ref": REF.format(name=_component_name(f"{tool}.{role}"))}


def _rewrite_refs(value: Any, rename: Callable[[str], str]) -> Any:
    if isinstance(value, dict):
        out = {k: _rewrite_refs(v, rename) for k, v in value.items()}
        target = out.get("$ref")
        if isinstance(target, str) and target.startswith("#/$defs/"):
            out["$ref"] = REF.format(name=rename(target.removeprefix("#/$defs/")))
        return out
    if isinstance(value, list):
        return [_rewrite_refs(v, rename) for v in value]
    return value


def _component_name(name: str) -> str:
    # OpenAPI allows only these characters in a component's name.
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _query_parameters(params_ref: Mapping[str, Any], schemas: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The GET form's query keys: one per field that fits a flat key, else the one `params=<JSON>` key."""
    schema = _resolve(params_ref, schemas)
    required = set(schema.get("required", ()))
    found = []
    for name, prop in schema.get("properties", {}).items():
        if name in params_mod.GATEWAY_QUERY_KEYS:
            continue
        value = _without_null(prop)
        if not _flat(value, schemas):
            if name in required:  # the flat form cannot carry this tool's params
                return [{"name": "params", "in": "query", "required": True, "content": {"application/json": {"schema": params_ref}}}]
            continue
        found.append({"name": name, "in": "query", "required": name in required, "schema": value, "style": "form", "explode": True})
    return found


def _without_null(prop: Mapping[str, Any]) -> dict[str, Any]:
    """A list field's schema less its `null` alternative, which no query spells (a scalar's is `null`)."""
    variants = prop.get("anyOf")
    if variants is None or not any(v.get("type") == "array" for v in variants):
        return dict(prop)
    kept = [v for v in variants if v.get("type") != "null"]
    out = {k: v for k, v in prop.items() if k != "anyOf" and not (k == "default" and v is None)}
    if len(kept) == 1:
        return {**out, **kept[0]}
    return {**out, "anyOf": kept}


def _flat(schema: Mapping[str, Any], schemas: Mapping[str, Any]) -> bool:
    """Whether a value of `schema` can be query keys: a scalar, or a list of scalars."""
    schema = _resolve(schema, schemas)
    if "anyOf" in schema:
        return all(_flat(v, schemas) for v in schema["anyOf"])
    if schema.get("type") == "array":
        return _scalar(schema.get("items", {}), schemas)
    return _scalar(schema, schemas)


def _scalar(schema: Mapping[str, Any], schemas: Mapping[str, Any]) -> bool:
    schema = _resolve(schema, schemas)
    return "enum" in schema or schema.get("type") in ("string", "integer", "number", "boolean", "null")


def _resolve(schema: Mapping[str, Any], schemas: Mapping[str, Any]) -> Mapping[str, Any]:
    target = schema.get("$ref")
    return _resolve(schemas[target.rsplit("/", 1)[1]], schemas) if isinstance(target, str) else schema


def _event_schema(ref: Mapping[str, Any], *, result: Any, partial: Any | None) -> dict[str, Any]:
    """One event of a job's stream, as an SSE client parses it."""
    data = {"data": result, "error": ref["ErrorFrame"], "status": ref["StatusFrame"], "log": ref["LogFrame"]}
    if partial is not None:
        data["partial"] = partial
    return {
        "description": "One event: `status` and `log` while the job runs, `partial` output where the tool streams "
        "it, then exactly one terminal `data` (the result) or `error`. `data` is JSON text.",
        "oneOf": [
            {
                "type": "object",
                "properties": {
                    "event": {"const": event},
                    "id": {"type": "string", "pattern": EVENT_ID},
                    "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": schema},
                },
                "required": ["event", "id", "data"],
            }
            for event, schema in data.items()
        ],
    }


def _stream_responses(event: Mapping[str, Any], errors: Iterable[int]) -> dict[str, Any]:
    job_id = {"schema": {"type": "string", "pattern": JOB_ID}, "required": True}
    return {
        "200": {
            "description": "The job's event stream, until its terminal event. Starts with `retry: <ms>`; "
            "`: ping` comments keep it open. The schema describes one event.",
            "headers": {"X-Job-Id": job_id},
            "content": {"text/event-stream": {"schema": event}},
        },
        "204": {
            "description": "Resumed after the job's terminal event: nothing more to send.",
            "headers": {"X-Job-Id": job_id},
        },
        **{str(status): {"$ref": f"#/components/responses/{status}"} for status in errors},
    }


def _error_responses(ref: Mapping[str, Any]) -> dict[str, Any]:
    """The protocol's error body for each status, with the codes that answer it."""
    responses: dict[str, Any] = {}
    for status in ERROR_STATUSES:
        codes = ", ".join(f"`{code.value}`" for code, s in STATUS_OF.items() if s == status)
        response: dict[str, Any] = {
            "description": f"Refused before any job started: {codes}.",
            "content": {"application/json": {"schema": ref["ErrorBody"]}},
        }
        if status in (429, 503):
            response["headers"] = {"Retry-After": {"schema": {"type": "string", "pattern": "^[0-9]+$"}}}
        if status == 401:
            response["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
        responses[str(status)] = response
    return responses


def _json(schema: Any, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"$ref": f"#/components/responses/{s}"} for s in statuses}


def _op(op_id: str, summary: str, responses: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"operationId": op_id, "summary": summary, "responses": {**responses, **_errors(*EVERY_ROUTE)}, **more}


def _page(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"text/html": {"schema": {"type": "string"}}}}


_USAGE_QUERY = [
    {"name": "by", "in": "query", "required": False, "schema": {"type": "string"},
     "description": "What rows are kept apart: a comma-separated list of `tenant`, `class`, `model` (default all three)."},
    {"name": "tenant", "in": "query", "required": False, "schema": {"type": "string"}, "description": "Only this tenant's rows (an admin's)."},
    {"name": "limit", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1, "maximum": 10000},
     "description": "Rows at most (default 1000), the largest device-seconds first."},
]
_JOB_ID = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string", "pattern": JOB_ID}}
_RANGES = [
    {"name": "Range", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "`bytes=a-b`, `bytes=a-` or `bytes=-n`: one range (several are answered whole)."},
    {"name": "If-Range", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "The `ETag` of the copy being resumed: the range is sent only if it still matches."},
]
_LAST_EVENT_ID = {
    "name": "Last-Event-ID",
    "in": "header",
    "schema": {"type": "string"},
    "description": "`<job_id>:<seq>`: send only the events after this one (also accepted as the `last_event_id` query key).",
}


def _download(media: str, whole: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The answers of a route that sends a file, whole (`whole` says what it is) or the range asked for."""
    return {
        "200": {"description": whole,
                "headers": {"ETag": {"schema": {"type": "string"}}, "Accept-Ranges": {"schema": {"type": "string"}}},
                "content": {media: {"schema": schema}}},
        "206": {"description": "The bytes the `Range` asked for.",
                "headers": {"Content-Range": {"schema": {"type": "string"}}, "ETag": {"schema": {"type": "string"}}},
                "content": {media: {"schema": {"type": "string", "format": "binary"}}}},
        **_errors(401, 404, 409, 416, 503),
    }


def _other_paths(ref: Mapping[str, Any]) -> dict[str, Any]:
    return {**_job_paths(ref), **_served_paths(ref)}


def _job_paths(ref: Mapping[str, Any]) -> dict[str, Any]:
    """The routes of jobs already made: their list, each one's snapshot, cancel, events, result and files."""
    return {
        "/jobs": {
            "get": _op("jobs", "The caller's jobs (an admin's: everyone's), newest first, a page at a time",
                       {"200": _json(ref["JobList"], "A page of jobs; `next` is the cursor of the next."), **_errors(401, 422, 503)},
                       parameters=[
                           {"name": "state", "in": "query", "required": False, "description": "A status, or `active` or `finished`.",
                            "schema": {"type": "string", "enum": list(STATES)}},
                           {"name": "limit", "in": "query", "required": False,
                            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE, "default": 50}},
                           {"name": "cursor", "in": "query", "required": False, "description": "The `next` of the page before.",
                            "schema": {"type": "string"}},
                       ], tags=["jobs"]),
        },
        "/jobs/{job_id}": {
            "get": _op("job", "Where a job stands", {"200": _json(ref["JobSnapshot"], "The job's snapshot."), **_errors(401, 404, 503)},
                       parameters=[_JOB_ID], tags=["jobs"]),
            "delete": _op("cancel", "Cancel a job", {"200": _json(ref["Cancellation"], "Cancelled, or had ended."), **_errors(401, 404, 503)},
                          parameters=[_JOB_ID], tags=["jobs"]),
        },
        "/jobs/{job_id}/events": {
            "get": _op("events", "A job's stream again, from the start or after Last-Event-ID",
                       _stream_responses({"$ref": REF.format(name="Event")}, (400, 401, 404, 503)),
                       parameters=[_JOB_ID, _LAST_EVENT_ID], tags=["jobs"]),
        },
        "/jobs/{job_id}/result": {
            "get": _op("result", "A finished job's result alone, as a file; Range requests resume a cut download",
                       _download("application/json", "The result's JSON, the `data` event's data byte for byte.", {"type": "object"}),
                       parameters=[_JOB_ID, *_RANGES], tags=["jobs"]),
        },
        "/jobs/{job_id}/files/{name}": {
            "get": _op("file", "One of the files a finished job wrote beside its result (its result's `files`); Range requests resume a cut download",
                       _download("application/octet-stream", "The file as written (safetensors, npy, bigWig, BED).",
                                 {"type": "string", "format": "binary"}),
                       parameters=[_JOB_ID,
                                   {"name": "name", "in": "path", "required": True, "schema": {"type": "string"},
                                    "description": "A name from the result's `files`."},
                                   *_RANGES],
                       tags=["jobs"]),
        },
    }


def _served_paths(ref: Mapping[str, Any]) -> dict[str, Any]:
    """What the gateway serves and how it stands: tools, models, tickets, health, metrics, its documents."""
    return {
        "/tools": {
            "get": _op("tools", "The tools, with their params, result and partial schemas",
                       {"200": _json({"type": "array", "items": ref["ToolInfo"]}, "One entry per tool."), **_errors(404)},
                       parameters=[{"name": "model", "in": "query", "required": False, "schema": {"type": "string"},
                                    "description": "Say which tools this served model cannot run (default: the default model)."}],
                       tags=["discovery"]),
        },
        "/models": {
            "get": _op("models", "The models served, the default first: kind, context length, device, dtype, tools",
                       {"200": _json(ref["ModelList"], "Every model served.")}, tags=["discovery"]),
        },
        "/auth/ticket": {
            "post": _op("ticket", "A short-lived ticket for GET streams",
                        {"200": _json(ref["Ticket"], "The ticket."), **_errors(401, 404)}, tags=["auth"]),
        },
        "/me": {
            "get": _op("me", "Who the caller is: their class, limits and what is in use",
                       {"200": _json(ref["Me"], "The caller."), **_errors(401)}, tags=["auth"]),
        },
        "/usage": {
            "get": _op("usage", "Settled use by tenant, class and model (an admin's: everyone's; others': their own)",
                       {"200": _json(ref["UsageReport"], "The rows."), **_errors(400, 401)}, tags=["auth"],
                       parameters=_USAGE_QUERY),
        },
        "/healthz": {"get": _op("healthz", "The process is up", {"200": _json(ref["Health"], "Up.")}, tags=["operations"])},
        "/readyz": {
            "get": _op("readyz", "Whether runs can start", {
                "200": _json(ref["Readiness"], "Ready."),
                "503": _json(ref["Readiness"], "Not ready: `reason` says why."),
            }, tags=["operations"]),
        },
        "/metrics": {
            "get": _op("metrics", "Prometheus metrics",
                       {"200": {"description": "The Prometheus text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}},
                       tags=["operations"]),
        },
        "/openapi.json": {
            "get": _op("openapi", "This document", {"200": _json({"type": "object"}, "OpenAPI 3.1.")}, tags=["discovery"]),
        },
        "/docs": {"get": _op("docs", "This document as a page to read", {"200": _page("Its page.")}, tags=["discovery"])},
        "/": {"get": _op("dashboard", "The dashboard", {"200": _page("Its page."), **_errors(404)}, tags=["discovery"])},
    }


def _version() -> str:
    try:
        return metadata.version("streamgate")
    except metadata.PackageNotFoundError:
        return "0"
