"""The wire protocol: frames, error codes and their encoding as Server-Sent Events.

Every frame is a msgspec Struct, so the same definitions validate, encode and
produce JSON Schema. Events are encoded once, when they happen, and kept as
bytes: a job's event log is replayed verbatim to every client that follows it.
"""

from __future__ import annotations

import enum
import re
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Protocol

import msgspec

from gateway.usage import JobUsage


class Status(str, enum.Enum):
    RECEIVED = "RECEIVED"
    QUEUED = "QUEUED"
    DISPATCHED = "DISPATCHED"
    RUNNING = "RUNNING"


class EventType(str, enum.Enum):
    STATUS = "status"
    LOG = "log"
    PARTIAL = "partial"
    DATA = "data"
    ERROR = "error"


TERMINAL = frozenset({EventType.DATA, EventType.ERROR})


class Code(str, enum.Enum):
    """Error codes, both before the stream (HTTP) and inside it (`error` events)."""

    BAD_REQUEST = "bad_request"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNKNOWN_TOOL = "unknown_tool"
    UNKNOWN_MODEL = "unknown_model"
    TOO_LARGE = "too_large"
    HEADERS_TOO_LARGE = "headers_too_large"
    TOO_LONG = "too_long"
    INVALID_PARAMS = "invalid_params"
    UNSUPPORTED_BY_MODEL = "unsupported_by_model"
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
    NO_RESULT = "no_result"
    RANGE_NOT_SATISFIABLE = "range_not_satisfiable"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    QUEUE_FULL = "queue_full"
    RATE_LIMITED = "rate_limited"
    NOT_READY = "not_ready"
    STORE_UNAVAILABLE = "store_unavailable"
    OVERLOADED = "overloaded"
    REQUEST_TIMEOUT = "request_timeout"
    SHUTTING_DOWN = "shutting_down"
    # In-stream only.
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    TOOL_ERROR = "tool_error"
    REMOTE_ERROR = "remote_error"
    BACKEND_UNAVAILABLE = "backend_unavailable"
    INTERNAL = "internal"


RETRYABLE = frozenset(
    {
        Code.QUEUE_FULL,
        Code.RATE_LIMITED,
        Code.NOT_READY,
        Code.STORE_UNAVAILABLE,
        Code.OVERLOADED,
        Code.SHUTTING_DOWN,
        Code.BACKEND_UNAVAILABLE,
        Code.TIMEOUT,
    }
)


class Progress(msgspec.Struct, omit_defaults=True):
    done: int
    total: int | None = None
    unit: str | None = None


class StatusFrame(msgspec.Struct, omit_defaults=True):
    job_id: str
    seq: int
    status: Status
    ts: float
    message: str | None = None
    position: int | None = None
    queue_size: int | None = None
    eta_s: float | None = None
    progress: Progress | None = None


class LogFrame(msgspec.Struct):
    job_id: str
    seq: int
    ts: float
    level: str
    message: str


class ErrorInfo(msgspec.Struct, omit_defaults=True):
    code: Code
    message: str
    retryable: bool
    field: str | None = None


class ErrorFrame(msgspec.Struct):
    """The terminal `error` event. `seq` repeats the event id's sequence number."""

    job_id: str
    seq: int
    error: ErrorInfo


class ErrorBody(msgspec.Struct):
    """The JSON body of every HTTP error answered before a stream opens."""

    error: ErrorInfo


class ToolInfo(msgspec.Struct):
    """One entry of `GET /tools`."""

    name: str
    description: str
    params_schema: dict[str, Any]
    result_schema: dict[str, Any]
    streams_partial: bool
    partial_schema: dict[str, Any] | None = None
    # Why the served model cannot run the tool (a run answers 422 unsupported_by_model); null when it can.
    unsupported: str | None = None


class ModelInfo(msgspec.Struct):
    """One entry of `GET /models`: a served model, what it is, and which tools it runs."""

    name: str
    default: bool
    ready: bool
    # Why it is not ready (still loading, failed to load); null when it is.
    problem: str | None = None
    kind: str | None = None
    context_length: int | None = None
    device: str | None = None  # its copies' devices, comma-separated
    dtype: str | None = None
    # A protein or DNA model's letters: its sequences are upper-cased, stripped of whitespace and checked against them.
    alphabet: str | None = None
    # The named prefixes a run may put before its sequences with `tag`.
    tags: list[str] = msgspec.field(default_factory=list)
    tools: list[str] = msgspec.field(default_factory=list)
    # The tools it cannot run, and why (a run answers 422 unsupported_by_model).
    unsupported: dict[str, str] = msgspec.field(default_factory=dict)
    queued: int = 0
    running: int = 0


class ModelList(msgspec.Struct):
    """`GET /models`: every model served, the default (what a run without `model` gets) first."""

    default: str | None
    models: list[ModelInfo]


class TerminalEvent(msgspec.Struct):
    event: str
    data: msgspec.Raw


class Callback(msgspec.Struct, omit_defaults=True):
    """A job's completion webhook (`Callback-URL`), as `GET /jobs/{id}` shows it: `state` is `waiting`
    (the job runs), `pending` (its terminal event is being delivered, or waits for its next try),
    `delivered` or `failed` (every try failed, or the receiver refused it for good)."""

    url: str
    state: str
    attempts: int = 0
    last_status: int | None = None  # the receiver's last HTTP status
    last_error: str | None = None
    next_try_in_s: float | None = None


class JobSnapshot(msgspec.Struct, omit_defaults=True):
    """`GET /jobs/{id}`: where a job stands.

    `status` is the last status while the job lives, then `SUCCEEDED` or `FAILED`;
    `terminal` is its terminal event once there is one.
    """

    job_id: str
    tool: str
    status: str
    created: float
    model: str | None = None
    started: float | None = None
    finished: float | None = None
    position: int | None = None
    progress: Progress | None = None
    last_event_id: str | None = None
    terminal: TerminalEvent | None = None
    # The name of the token that started the job (none without tokens): only it, or an admin, sees the job.
    owner: str | None = None
    callback: Callback | None = None


class ResultFile(msgspec.Struct, omit_defaults=True):
    """A file a job wrote beside its result (a per-position array, a feature track), served at
    `GET /jobs/{id}/files/{name}` (Range, resumable) for as long as the job is kept."""

    name: str
    format: str
    """What opens it: safetensors, npy, bigwig, bed, tsv."""
    size: int
    """Its length in bytes."""
    description: str = ""


class JobList(msgspec.Struct):
    """`GET /jobs`: the caller's jobs (an admin's: everyone's), newest first; `next` is the cursor of the next page."""

    jobs: list[JobSnapshot]
    next: str | None = None


class Kept(Protocol):
    """An event's data kept outside this process's memory (a result in the spool,
    gateway/plumbing/spool.py): read a piece at a time, by any number of readers."""

    size: int

    def read(self) -> bytes:
        """The whole data (blocking): only where it must be held whole anyway."""
        ...

    def read_at(self, start: int, size: int) -> bytes:
        """`size` bytes from `start` (blocking)."""
        ...

    def pieces(self, piece: int = ..., start: int = 0, stop: int | None = None) -> AsyncIterator[bytes]:
        """Bytes `start`..`stop` (the end), `piece` at a time."""
        ...

    def release(self) -> None: ...


class Event(msgspec.Struct, frozen=True, gc=False):
    """One event of a job, encoded: `id` is `<job_id>:<seq>`, `data` is JSON.

    `raw` is the JSON in memory; a result moved to the spool has `kept` instead (and `raw` empty),
    and is read a piece at a time (`parts`); `data` reads it whole, for the few that need that.
    """

    job_id: str
    seq: int
    type: EventType
    raw: bytes
    kept: Kept | None = None

    @property
    def id(self) -> str:
        return f"{self.job_id}:{self.seq}"

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL

    @property
    def size(self) -> int:
        return self.kept.size if self.kept is not None else len(self.raw)

    @property
    def data(self) -> bytes:
        return self.kept.read() if self.kept is not None else self.raw

    def sse(self) -> bytes:
        # JSON from msgspec never contains a raw newline, so one `data:` line
        # always carries the whole payload.
        return b"id: %s\nevent: %s\ndata: %s\n\n" % (
            self.id.encode(),
            self.type.value.encode(),
            self.data,
        )

    def sse_parts(self) -> tuple[bytes, bytes | Kept, bytes]:
        """The event as `sse()` frames it, its data apart and uncopied: a head, the data, the end."""
        head = b"id: %s\nevent: %s\ndata: " % (self.id.encode(), self.type.value.encode())
        return head, self.kept if self.kept is not None else self.raw, b"\n\n"

    def spooled(self, kept: Kept) -> Event:
        """This event with its data in `kept` rather than in memory."""
        return Event(self.job_id, self.seq, self.type, b"", kept)


# Where a document (a snapshot, a page of them) names a result kept in the spool: a JSON string no
# client can send (its nonce is this process's), replaced by the result's bytes as it is written.
_KEPT_MARK = b'"\\u0000kept:' + secrets.token_hex(8).encode() + b":"
_KEPT_AT = re.compile(re.escape(_KEPT_MARK) + rb'(\d+)"')


def kept_marker(kept: list[Kept], data: Kept) -> msgspec.Raw:
    """A stand-in for `data` in a document encoded whole, spliced back by `splice`."""
    kept.append(data)
    return msgspec.Raw(_KEPT_MARK + b"%d\"" % (len(kept) - 1))


def splice(document: bytes, kept: list[Kept]) -> list[bytes | Kept]:
    """`document`'s bytes with each `kept_marker` replaced by the data it stands for, as parts to write."""
    if not kept:
        return [document]
    parts: list[bytes | Kept] = []
    at = 0
    for found in _KEPT_AT.finditer(document):
        parts.append(document[at : found.start()])
        parts.append(kept[int(found.group(1))])
        at = found.end()
    parts.append(document[at:])
    return parts


_encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def now() -> float:
    return round(time.time(), 3)


def retry_line(ms: int) -> bytes:
    return b"retry: %d\n\n" % ms


PING = b": ping\n\n"


def parse_event_id(value: str | None) -> tuple[str, int] | None:
    """Split a `Last-Event-ID` of the form `<job_id>:<seq>`; None if malformed."""
    if not value:
        return None
    job_id, sep, seq = value.strip().rpartition(":")
    # ASCII digits only (str.isdigit() also takes "²", which int() refuses), and at most 18 of
    # them: no job has more events, and Redis stream ids end at 2**64.
    if not sep or not job_id or not (seq.isascii() and seq.isdigit()) or len(seq) > 18:
        return None
    return job_id, int(seq)


# -- Section 5: gateway ⇄ executor ---------------------------------------------


class RemoteKind(str, enum.Enum):
    STATUS = "status"
    LOG = "log"
    PARTIAL = "partial"
    COMPLETED = "completed"
    ERROR = "error"
    # The answers to a `submit` op (seq 0): the job was taken, or refused as `POST /jobs` would refuse it.
    ACCEPTED = "accepted"
    REFUSED = "refused"


class RemoteFrame(msgspec.Struct, omit_defaults=True):
    """One event of a job, executor → gateway on the session socket.

    `seq` is the executor's sequence number for the job (what `resume` counts
    from); `data` is the event's JSON (a status, log, partial or error frame).
    `completed` carries `null`, the result to be fetched from `GET /jobs/{id}/result`,
    or, from an executor whose results are JSON (an engine), the result itself; `files`
    names the result files the job wrote beside it, each fetched from `GET /jobs/{id}/files/{name}`
    before the gateway ends the job. A terminal frame (`completed`, `error`) carries what the job
    used (`usage`, gateway/usage.py), for the gateway's meter.
    """

    job_id: str
    seq: int
    kind: RemoteKind
    data: msgspec.Raw
    files: list[ResultFile] | None = None
    usage: JobUsage | None = None


class Accepted(msgspec.Struct):
    """An `accepted` frame's data (an engine's answer to a `submit`): the job's price as the engine set
    it (gateway/cost.py's `Cost`, or null: unpriced), and whether the job keeps a checkpoint that a run
    after this one can go on from: facts of its params, which only the process that decodes them knows."""

    cost: msgspec.Raw
    resumable: bool = False


class Resume(msgspec.Struct, tag_field="op", tag="resume"):
    """Gateway → executor: send this job's events after `after_seq`."""

    job_id: str
    after_seq: int = 0


class Cancel(msgspec.Struct, tag_field="op", tag="cancel"):
    """Gateway → executor: cancel this job."""

    job_id: str


class Forget(msgspec.Struct, tag_field="op", tag="forget"):
    """Gateway → executor: as `DELETE /jobs/{id}`, cancel this job if it runs and drop it and its result."""

    job_id: str


class SubmitRequest(msgspec.Struct):
    """`POST /jobs` on an executor: the job, and the gateway's tenant and weight for it, so that the
    executor's queue takes turns between the gateway's clients (without them, the session is one tenant).

    The params are the gateway's client's, as sent (gateway/params.py's `Relayed`): a JSON object, or
    `null` and the GET form's `query` pairs; `model` is the one the gateway resolved, for params that
    name none. The executor decodes them as that gateway would have: its refusals are the gateway's.
    `traceparent` is the W3C trace context of the gateway's job, for the executor's spans of it to
    join its trace (gateway/plumbing/tracing.py); none from a gateway that does not trace.
    """

    tool: str
    params: msgspec.Raw
    job_id: str
    tenant: str | None = None
    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    priority: int = 0  # the class of the gateway's client: the executor's queue serves higher ones first
    timeout: Annotated[float, msgspec.Meta(gt=0)] | None = None  # its class's job_timeout: bounds the executor's own
    query: list[tuple[str, str]] | None = None
    model: str | None = None
    traceparent: str | None = None
    # False: a part of a job cut over engines (backends/spreading.py), whose result is merged with the
    # others': refused (413) rather than written as files, so that the gateway runs the job whole.
    files: bool = True
    # An engine's job only: the folder of its checkpoint (gateway/checkpoints.py), and whether a run
    # before this one (in an engine that died) left it, to go on from.
    checkpoint: str | None = None
    resumed: bool = False


class Submit(SubmitRequest, tag_field="op", tag="submit"):
    """Gateway → executor: as `POST /jobs`, on the socket; answered by an `accepted` or `refused` frame."""

    request_id: str | None = None  # the client request's X-Request-Id, for the executor's log lines


class Refusal(msgspec.Struct, omit_defaults=True):
    """A `refused` frame's data: the HTTP status `POST /jobs` would have answered, and its error."""

    status: int
    error: ErrorInfo
    retry_after: float | None = None


SessionOp = Resume | Cancel | Forget | Submit


class SubmitResponse(msgspec.Struct):
    job_id: str
    status: Status = Status.RECEIVED


REMOTE_KIND = {
    EventType.STATUS: RemoteKind.STATUS,
    EventType.LOG: RemoteKind.LOG,
    EventType.PARTIAL: RemoteKind.PARTIAL,
    EventType.DATA: RemoteKind.COMPLETED,
    EventType.ERROR: RemoteKind.ERROR,
}


def remote_frame(event: Event, inline: bool = False, files: list[ResultFile] | None = None, usage: JobUsage | None = None) -> RemoteFrame:
    """An executor job's event as a session frame; its result stays behind to be fetched, unless
    `inline` (the result is JSON, and the gateway is an engine's, on the same machine); `files`:
    the result files a `completed` job wrote; `usage`: what it used (a terminal event's)."""
    kind = REMOTE_KIND[event.type]
    data = msgspec.Raw(b"null" if kind is RemoteKind.COMPLETED and not inline else event.data)
    return RemoteFrame(
        event.job_id, event.seq, kind, data, files if kind is RemoteKind.COMPLETED and files else None, usage if event.terminal else None
    )
