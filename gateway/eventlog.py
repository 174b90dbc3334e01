"""A job's event log, packed: its events' data back to back, and per event its type and where its data ends.

A running job's log (`LiveLog`) was a list of `Event`s, each an object and a bytes object of its own:
about a hundred bytes an event besides its data, held for as long as the job ran. A generation's
thousands of token events, held for clients that read slowly or not at all, cost several times their
data; and those small objects, freed as the job ended, left the interpreter's arenas they had filled
held by the few objects that outlived them (a finished job's bookkeeping), so that each round of long
jobs added its peak to the process's memory for as long as its jobs were kept. Packed, an event costs
its data and 9 bytes, in one growing buffer the allocator maps and unmaps whole.

Once the job has ended its events before the terminal one may move to the result spool
(gateway/server/store.py `FinishedResults`): a `KeptLog` keeps the same index, and its data there.

Both read as the list they replace (`len`, an index, a slice); an `Event` is made for each event read.
"""

from __future__ import annotations

import array
import asyncio
import bisect
from typing import Any

from gateway.protocol import Event, EventType, Kept

PIECE = 256 * 1024  # of a log read at once by a follower, as the spool's own pieces
KEPT_EVENT = 9  # what an event costs in a packed log besides its data: its type and where its data ends

_KINDS = list(EventType)
_KIND_OF = {kind: i for i, kind in enumerate(_KINDS)}


class PackedLog:
    """The index both logs share, and reading events back from it; `_bytes` reads their data."""

    __slots__ = ("job_id", "base", "kinds", "ends", "terminal")

    def __init__(self, job_id: str, base: int, kinds: bytearray, ends: array.array[int], terminal: Event | None) -> None:
        self.job_id = job_id
        self.base = base  # the seq before its first event (`Job.base`)
        self.kinds = kinds
        self.ends = ends
        self.terminal = terminal

    def _bytes(self, start: int, size: int) -> bytes:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.kinds) + (self.terminal is not None)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            assert step == 1, "a log is read forwards"
            return self._read(start, stop)
        events = self._read(*slice(index, index + 1 if index != -1 else None).indices(len(self))[:2])
        if not events:
            raise IndexError(index)
        return events[0]

    def __iter__(self) -> Any:
        return iter(self._read(0, len(self)))

    def __eq__(self, other: object) -> bool:  # as the list of its events
        events = list(other) if isinstance(other, PackedLog) else other
        return list(self) == events if isinstance(events, list) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def count(self, kind: EventType) -> int:
        """How many of its events before the terminal one are of `kind`."""
        return self.kinds.count(_KIND_OF[kind])

    @property
    def data_size(self) -> int:
        """Bytes of data of its events before the terminal one."""
        return self.ends[-1] if self.ends else 0

    def _piece(self, after: int, piece: int) -> tuple[int, int]:
        """The indices of the events with seq > `after` whose data fits in `piece` bytes (at least one)."""
        start, n = max(0, after - self.base), len(self.kinds)
        if start >= n:
            return start, n + (self.terminal is not None)
        base = self.ends[start - 1] if start else 0
        stop = bisect.bisect_right(self.ends, base + piece, lo=start + 1)
        return start, stop if stop < n else n + (self.terminal is not None)

    def _read(self, start: int, stop: int) -> list[Event]:
        """Events at indices `start`..`stop - 1` of the log (the terminal one's is its last)."""
        n = len(self.kinds)
        kept_stop = min(stop, n)
        events = []
        if start < kept_stop:
            ends, kinds, job_id, seq = self.ends, self.kinds, self.job_id, self.base
            base = ends[start - 1] if start else 0
            data = self._bytes(base, ends[kept_stop - 1] - base)
            at = base
            for i in range(start, kept_stop):
                events.append(Event(job_id, seq + i + 1, _KINDS[kinds[i]], data[at - base : ends[i] - base]))
                at = ends[i]
        if stop > n >= start and self.terminal is not None:
            events.append(self.terminal)
        return events


class LiveLog(PackedLog):
    """A job's log while it runs (and after, until its events move to the spool): packed in memory."""

    __slots__ = ("data",)

    def __init__(self, job_id: str, base: int = 0) -> None:
        super().__init__(job_id, base, bytearray(), array.array("Q"), None)
        self.data = bytearray()

    def append(self, event: Event) -> None:
        if event.terminal:
            self.terminal = event
            return
        self.data += event.raw
        self.kinds.append(_KIND_OF[event.type])
        self.ends.append(len(self.data))

    def after(self, after: int, piece: int = PIECE) -> list[Event]:
        """Events with seq > `after`: those whose data fits in `piece` bytes (at least one)."""
        at = after - self.base
        if at == len(self.kinds) - 1 and at >= 0:  # the one new event a follower that keeps up waits for
            ends = self.ends
            return [Event(self.job_id, after + 1, _KINDS[self.kinds[at]], bytes(self.data[ends[at - 1] if at else 0 : ends[at]]))]
        return self._read(*self._piece(after, piece))

    def _bytes(self, start: int, size: int) -> bytes:
        return bytes(memoryview(self.data)[start : start + size])

    def kept_in(self, kept: Kept) -> KeptLog:
        """This log, its events' data now in `kept` (written from `data`)."""
        return KeptLog(self.job_id, self.base, self.kinds, self.ends, self.terminal, kept)


class KeptLog(PackedLog):
    """A finished job's log with its events before the terminal one kept outside memory (the result
    spool, gateway/plumbing/spool.py): 9 bytes an event here. Followers read it a piece at a time,
    on a thread (`after`); `len`, an index or a slice read blocking, for the few that need them."""

    __slots__ = ("kept",)

    def __init__(self, job_id: str, base: int, kinds: bytearray, ends: array.array[int], terminal: Event | None, kept: Kept) -> None:
        super().__init__(job_id, base, kinds, ends, terminal)
        self.kept = kept

    async def after(self, after: int, piece: int = PIECE) -> list[Event]:
        """Events with seq > `after`: those whose data fits in `piece` bytes (at least one), read on a thread."""
        start, stop = self._piece(after, piece)
        if start >= len(self.kinds):
            return self._read(start, stop)
        return await asyncio.to_thread(self._read, start, stop)

    def _bytes(self, start: int, size: int) -> bytes:
        return self.kept.read_at(start, size)
