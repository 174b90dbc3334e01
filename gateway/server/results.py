"""`GET /jobs/{id}/result`: a finished job's result alone, as a file to download, resumable.

The `data` event of a job's stream carries its result; this route serves the
same bytes by themselves, for a client that wants them as a file (`curl -O`,
a browser's download, a tool that resumes a cut transfer with `Range`). They
come from the one copy the gateway keeps (in memory, the result spool, or
Redis for a job another replica ran), a piece at a time, like every other
reader's: a download holds one piece, whatever its size.

`Range: bytes=a-b` (one range; `a-`, `-n` too) answers 206 with
`Content-Range`; a range past the end 416 `range_not_satisfiable`; several
ranges, or an `If-Range` that is not this result's `ETag`, the whole result
(200), as RFC 9110 allows. The route is scoped to the job's owner like every
job route (another token's job is 404), and gone with the job at its
retention. A job still running, or one that failed, has no result: 409
`no_result`, saying which.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

from gateway.errors import ApiError
from gateway.plumbing.sendbuffer import PIECE, WholeResponse
from gateway.protocol import Code, ErrorFrame, Event, EventType, Kept
from gateway.server.store import JobHandle

import msgspec

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The bytes [start, stop) one `Range` header asks for of `size`; None for the whole (no header,
    or one this route serves whole: several ranges, another unit). 416 for a range past the end."""
    if header is None:
        return None
    found = _RANGE.fullmatch(header.strip())
    if found is None or not (found.group(1) or found.group(2)):
        return None
    first, last = found.group(1), found.group(2)
    if first:
        start = int(first)
        if last and int(last) < start:
            return None  # not a valid range: the header is ignored
        if start >= size:
            raise _unsatisfiable(header, size)
        return start, min(size, int(last) + 1) if last else size
    suffix = int(last)  # `-n`: the last n bytes
    if suffix == 0:
        raise _unsatisfiable(header, size)
    return max(0, size - suffix), size


def _unsatisfiable(header: str, size: int) -> ApiError:
    return ApiError(
        Code.RANGE_NOT_SATISFIABLE,
        f"Range {header!r} is outside the result's {size} bytes",
        headers={"Content-Range": f"bytes */{size}"},
    )


class _KeptRange:
    """Bytes `start`..`stop` of a kept result, as a part of a body (gateway/plumbing/sendbuffer.py)."""

    def __init__(self, kept: Kept, start: int, stop: int) -> None:
        self.kept, self.start, self.stop = kept, start, stop
        self.size = stop - start

    def pieces(self, piece: int = PIECE) -> AsyncIterator[bytes]:
        return self.kept.pieces(piece, self.start, self.stop)


def result_response(job: JobHandle, range_header: str | None, if_range: str | None, **send: Any) -> WholeResponse:
    terminal = _succeeded(job)
    etag = f'"{job.id}-{terminal.seq}-{terminal.size}"'
    body: Kept | bytes = terminal.kept if terminal.kept is not None else terminal.raw
    return _ranged(body, terminal.size, etag, f"{job.id}.json", range_header, if_range, **send)


def file_response(job: JobHandle, name: str, range_header: str | None, if_range: str | None, **send: Any) -> WholeResponse:
    """`GET /jobs/{id}/files/{name}`: one of the files a job wrote beside its result (gateway/tools/files.py)."""
    terminal = _succeeded(job)
    files = getattr(job, "files", None)
    kept = files.kept.get(name) if files is not None else None
    if kept is None:
        where = "" if files is not None else " (result files are served by the gateway replica that ran the job)"
        raise ApiError(Code.NOT_FOUND, f"job {job.id} has no result file {name!r}{where}")
    return _ranged(kept, kept.size, f'"{job.id}-{terminal.seq}-{name}-{kept.size}"', f"{job.id}.{name}", range_header, if_range, **send)


def _succeeded(job: JobHandle) -> Event:
    terminal = job.terminal
    if terminal is None:
        raise ApiError(Code.NO_RESULT, f"job {job.id} has not finished: follow GET /jobs/{job.id}/events until it ends")
    if terminal.type is EventType.ERROR:
        error = msgspec.json.decode(terminal.data, type=ErrorFrame).error
        raise ApiError(Code.NO_RESULT, f"job {job.id} failed ({error.code.value}: {error.message}): it has no result")
    return terminal


def _ranged(
    body: Kept | bytes, size: int, etag: str, filename: str, range_header: str | None, if_range: str | None, **send: Any
) -> WholeResponse:
    """`body`, or the one range of it asked for (206), to download as `filename`."""
    headers = {
        "Accept-Ranges": "bytes",
        "ETag": etag,
        "Content-Disposition": f'attachment; filename="{filename}"',
        "Cache-Control": "private, no-cache",
    }
    wanted = byte_range(range_header, size) if if_range is None or if_range.strip() == etag else None
    start, stop = wanted or (0, size)
    part: bytes | _KeptRange
    if isinstance(body, bytes):
        part = body[start:stop] if wanted else body
    else:
        part = _KeptRange(body, start, stop)
    status = 200
    if wanted is not None:
        status = 206
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
    return WholeResponse([part], status_code=status, headers=headers, **send)  # type: ignore[list-item]  # a part reads as a Kept does
