"""The result spool: finished results on disk, written once, read by any number of readers in pieces.

A gateway keeps a finished job's events for `--retention` seconds, for its
client to resume and for `GET /jobs/{id}`. Held in memory, 80 ordinary
`logit_lens` results of 35 MB took a gateway from 0.4 to 3.1 GB, and every
follower sent its own copy. Here a result over `SPOOL_FROM` bytes (any result,
once the store's in-memory part is past `--result-memory-bytes`) is written
once, as the JSON it is sent as, to a spool on disk; the job's terminal event
then refers to it (`Spooled`, the core's `Kept`), and each reader reads it a
`PIECE` at a time with `pread` on a thread: a reader holds one piece, the loop
never copies a whole result, and the file's pages are the kernel's cache, not
this process's memory.

Records are appended to segment files of `SEGMENT_BYTES` (a bigger result has a
segment of its own): a descriptor per segment, not per result. A segment is an
unnamed file (`O_TMPFILE`): nothing is left on disk by a process that dies, and
its space is the kernel's to free once the segment is closed, which happens when
its last record is released (retention) and its last reader is done, never
before: a descriptor closed under a reader could be reused by another file.

A job's result files (gateway/jobs.py `ResultFiles`: a per-position result
written in parts) are kept where its run wrote them, by name (`KeptFile`), and
opened for each read: thousands kept hold no descriptor. Their bytes count
here, and they are deleted when released.

The spool's bytes are bounded by `--result-store-bytes`: a job is admitted only
if its priced result fits beside what is kept and what the jobs admitted before
it may still write (`hold`); otherwise it is refused before it is queued, with
503 `overloaded` and a `Retry-After` of when the oldest result leaves. A job's
hold is given back when it ends, whatever it wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable

from gateway.errors import ApiError
from gateway.tools.files import read_all, write_all
from gateway.protocol import Code

log = logging.getLogger("streamgate.spool")

MIB = 1 << 20
# A result this big or bigger goes to disk: below it, a write and a thread hop cost more than the bytes kept.
SPOOL_FROM = 64 * 1024
SEGMENT_BYTES = 64 * MIB
PIECE = 256 * 1024  # what a reader holds at once (gateway/plumbing/sendbuffer.py's piece)
DEFAULT_SHARE = 0.5  # of the folder's free space at start, without --result-store-bytes


class Segment:
    """One spool file: records appended, read with `pread`, closed once nothing refers to it."""

    def __init__(self, folder: str) -> None:
        # Unnamed where the filesystem can (O_TMPFILE), else unlinked at once: gone with its descriptor.
        self._file = tempfile.TemporaryFile(dir=folder, prefix="streamgate-results-")
        self.fd = self._file.fileno()
        self.size = 0
        self.live = 0  # records not released
        self.readers = 0
        self.sealed = False  # no more records: closed when `live` and `readers` are both 0
        self.closed = False

    def close_if_unused(self) -> bool:
        if self.closed or not self.sealed or self.live or self.readers:
            return False
        self.closed = True
        self._file.close()
        return True


class Spooled:
    """A result in the spool: `size` bytes at `offset` of `segment` (gateway/protocol.py's `Kept`)."""

    __slots__ = ("spool", "segment", "offset", "size", "kept_at", "released")

    def __init__(self, spool: ResultSpool, segment: Segment, offset: int, size: int) -> None:
        self.spool = spool
        self.segment = segment
        self.offset = offset
        self.size = size
        self.kept_at = time.monotonic()
        self.released = False

    def read(self) -> bytes:
        """The whole result (blocking): for the few that need it whole and small enough to hold."""
        with self._reading():
            return read_all(self.segment.fd, self.size, self.offset)

    def read_at(self, start: int, size: int) -> bytes:
        """`size` bytes from `start` (blocking): a part of a kept log (gateway/jobs.py `KeptLog`)."""
        if start < 0 or start + size > self.size:
            raise ValueError(f"bytes {start}-{start + size} of a {self.size}-byte record")
        with self._reading():
            return read_all(self.segment.fd, size, self.offset + start)

    async def pieces(self, piece: int = PIECE, start: int = 0, stop: int | None = None) -> AsyncIterator[bytes]:
        """The result (bytes `start`..`stop` of it), `piece` bytes at a time, each read on a thread."""
        with self._reading():
            end = self.offset + (self.size if stop is None else min(stop, self.size))
            at = self.offset + start
            while at < end:
                n = min(piece, end - at)
                chunk = await asyncio.to_thread(read_all, self.segment.fd, n, at)
                at += n
                yield chunk

    @contextlib.contextmanager
    def _reading(self):  # type: ignore[no-untyped-def]
        with self.spool.lock:
            if self.segment.closed:
                raise RuntimeError("a spooled result was read after its segment closed")
            self.segment.readers += 1
        try:
            yield
        finally:
            with self.spool.lock:
                self.segment.readers -= 1
                self.spool._close_if_unused(self.segment)

    def release(self) -> None:
        """Its job is forgotten: its bytes may go once no reader is left on its segment."""
        self.spool.release(self)


class KeptFile:
    """A job's result file kept by name where its run wrote it (`ResultSpool.adopt`; the core's `Kept`)."""

    __slots__ = ("spool", "path", "size", "released")

    def __init__(self, spool: ResultSpool, path: str, size: int) -> None:
        self.spool, self.path, self.size = spool, path, size
        self.released = False

    def read(self) -> bytes:
        return self.read_at(0, self.size)

    def read_at(self, start: int, size: int) -> bytes:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return read_all(fd, size, start)
        finally:
            os.close(fd)

    async def pieces(self, piece: int = PIECE, start: int = 0, stop: int | None = None) -> AsyncIterator[bytes]:
        fd = await asyncio.to_thread(os.open, self.path, os.O_RDONLY)  # held by this reader alone, until it is done
        try:
            at, end = start, self.size if stop is None else min(stop, self.size)
            while at < end:
                n = min(piece, end - at)
                yield await asyncio.to_thread(read_all, fd, n, at)
                at += n
        finally:
            os.close(fd)

    def release(self) -> None:
        self.spool.release_file(self)


class ResultSpool:
    """Finished results on disk, within `budget` bytes (see the module docstring)."""

    def __init__(self, folder: str | None = None, budget: int | None = None, *, retention: float = 600.0) -> None:
        self.folder = folder or tempfile.gettempdir()
        os.makedirs(self.folder, exist_ok=True)
        if budget is None:
            budget = int(shutil.disk_usage(self.folder).free * DEFAULT_SHARE)
        self.budget = budget
        self.retention = retention
        self.lock = threading.Lock()  # readers count on threads' behalf, releases on the loop
        self._write = asyncio.Lock()
        self._current: Segment | None = None
        self._segments: list[Segment] = []  # open ones, oldest first
        self._records: set[Spooled] = set()
        self.held = 0  # bytes promised to admitted jobs not ended
        self.written = 0  # results written, in all
        self.stored = 0  # bytes of the records not released
        self.files_kept = 0  # bytes of the jobs' result files kept (`adopt`)

    # -- room -------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Bytes of the open segments and the files kept: what the spool takes on disk."""
        return sum(s.size for s in self._segments if not s.closed) + self.files_kept

    def hold(self, size: int, field: str = "") -> Callable[[], None]:
        """Promise `size` bytes to a job about to be queued, or refuse it: 413 `too_large` if it could
        never fit, 503 `overloaded` (Retry-After: when the oldest result leaves) if it cannot now.
        Returns what gives the promise back (once)."""
        if size > self.budget:
            raise ApiError(
                Code.TOO_LARGE,
                f"the job's result is priced at {size} bytes, more than this gateway keeps of all results "
                f"({self.budget}, --result-store-bytes)" + (f"; make {field} smaller" if field else ""),
                field=field or None,
            )
        if self.used + self.held + size > self.budget:
            raise ApiError(
                Code.OVERLOADED,
                f"the result store is full ({self.used} bytes kept, {self.held} promised to running jobs, "
                f"of {self.budget}, --result-store-bytes): this job's result, priced at {size} bytes, "
                "would not fit; try again once older results leave",
                retry_after=self._retry_after(),
            )
        self.held += size
        given = False

        def give_back() -> None:
            nonlocal given
            if not given:
                given = True
                self.held -= size

        return give_back

    def _retry_after(self) -> int:
        oldest = min((r.kept_at for r in self._records), default=None)
        if oldest is None:
            return 5
        return max(1, math.ceil(oldest + self.retention - time.monotonic()))

    # -- records ----------------------------------------------------------------

    async def keep(self, data: bytes | memoryview) -> Spooled:
        """Write `data` once (on a thread), in order with the other writes; its record."""
        size = len(data)
        async with self._write:
            segment = self._segment_for(size)
            offset = segment.size
            segment.size += size  # counted at once: `used` must not lag a write under way
            segment.live += 1
            try:
                await asyncio.to_thread(write_all, segment.fd, data, offset)
            except BaseException:
                segment.live -= 1  # its bytes stay counted in the segment until it closes
                with self.lock:
                    self._close_if_unused(segment)
                raise
        record = Spooled(self, segment, offset, size)
        self._records.add(record)
        self.written += 1
        self.stored += size
        return record

    def adopt(self, path: str) -> KeptFile:
        """Keep the file at `path` (a job's result file, written in parts by its run) where it is, by
        name: read by opening it, so that thousands kept hold no descriptor; deleted when released.
        Its bytes count here (the job's files were priced and held with its result)."""
        record = KeptFile(self, path, os.stat(path).st_size)
        self.files_kept += record.size
        self.stored += record.size
        return record

    def release_file(self, record: KeptFile) -> None:
        if record.released:
            return
        record.released = True
        self.files_kept -= record.size
        self.stored -= record.size
        with contextlib.suppress(FileNotFoundError):
            os.unlink(record.path)  # a reader that has it open reads on

    def _segment_for(self, size: int) -> Segment:
        current = self._current
        if current is not None and current.size + size <= SEGMENT_BYTES:
            return current
        if current is not None:
            current.sealed = True
            with self.lock:
                self._close_if_unused(current)
        segment = Segment(self.folder)
        self._segments.append(segment)
        if size >= SEGMENT_BYTES:  # a result of its own: sealed at once, closed with it
            segment.sealed = True
            self._current = None
        else:
            self._current = segment
        return segment

    def release(self, record: Spooled) -> None:
        if record.released:
            return
        record.released = True
        self._records.discard(record)
        self.stored -= record.size
        with self.lock:
            record.segment.live -= 1
            self._close_if_unused(record.segment)

    def _close_if_unused(self, segment: Segment) -> None:
        """(Under `lock`.) Close `segment` if it is sealed, released and unread."""
        if segment.close_if_unused():
            with contextlib.suppress(ValueError):
                self._segments.remove(segment)

    def close(self) -> None:
        """Close every segment (the process is done)."""
        for segment in list(self._segments):
            segment.sealed = True
            segment.live = segment.readers = 0
            with self.lock:
                self._close_if_unused(segment)
        self._current = None

    def describe(self) -> dict[str, int]:
        return {
            "results": len(self._records), "bytes": self.stored, "files_bytes": self.files_kept, "disk_bytes": self.used,
            "promised_bytes": self.held, "budget_bytes": self.budget,
        }
