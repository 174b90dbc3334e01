"""A job's events as MCP answers (gateway/server/mcp.py): its frames as rising progress and log
notifications, and a big result spliced into the answer that carries it from the one copy the job
keeps, never built as Python objects.
"""

from __future__ import annotations

import contextlib
import math
import re
import secrets
import time
from collections.abc import AsyncIterator, Sequence

import msgspec

from gateway.plumbing import sendbuffer
from gateway.protocol import Event, EventType, Kept, LogFrame, Status, StatusFrame

SPLICE_KEEP_S = 600.0  # how long a stand-in waits for its answer to be written
# A progress message's most characters: the newest text of a batch of partials that a slow client let
# pile up (the result has all of it).
MESSAGE_CHARS = 16 * 1024
MCP_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")


class Splicing:
    """Big results into the answers that carry them, from the one copy the job keeps.

    The SDK builds a result as Python objects and encodes them (a 7.6 MB result of floats took
    ~105 MB a call). A result of `SPLICE_FROM` bytes or more is given to it as two stand-ins, a
    marker string as the text content and a one-key object as `structuredContent`; as the answer
    is written (`McpServer._bounded`), each is replaced by the result itself: its JSON as a JSON
    string, and its JSON as it is, read a piece at a time from memory or the result spool. A
    marker is this process's (a nonce and a count), so no client's text can be taken for one; one
    whose answer is never written (its client left first) is dropped `keep_s` later.
    """

    def __init__(self, keep_s: float = SPLICE_KEEP_S) -> None:
        self._nonce = secrets.token_hex(8)
        self._next = 0
        self.keep_s = keep_s
        self._waiting: dict[str, tuple[Event, float]] = {}  # oldest first
        self._mark = re.compile(rb'"sg-(?:text|json)-' + self._nonce.encode() + rb'-(\d+)"(?:\s*:\s*0\s*\})?')

    def stand_in(self, terminal: Event) -> tuple[str, dict[str, int]]:
        now = time.monotonic()
        # Stand-ins whose answer was never written (the client left first) go after a while.
        while self._waiting and next(iter(self._waiting.values()))[1] < now - self.keep_s:
            del self._waiting[next(iter(self._waiting))]
        self._next += 1
        key = str(self._next)
        self._waiting[key] = (terminal, now)
        return f"sg-text-{self._nonce}-{key}", {f"sg-json-{self._nonce}-{key}": 0}

    def parts(self, body: bytes) -> list[bytes | Kept | Escaped] | None:
        """`body` with its stand-ins replaced, as parts to write; None if it has none."""
        if self._nonce.encode() not in body:
            return None
        parts: list[bytes | Kept | Escaped] = []
        at = 0
        for found in self._mark.finditer(body):
            waiting = self._waiting.get(found.group(1).decode())
            if waiting is None:
                continue
            terminal = waiting[0]
            as_json = found.group(0).endswith(b"}")
            start = found.start()
            if as_json:  # `{"sg-json-…":0}`: the object, braces and all
                start = body.rindex(b"{", 0, start)
            data: bytes | Kept = terminal.kept if terminal.kept is not None else terminal.raw
            if as_json:
                parts += [body[at:start], data]
            else:  # the marker's quotes stay, around the escaped JSON
                parts += [body[at : start + 1], Escaped(data), b'"']
            at = found.end()
        parts.append(body[at:])
        for key in {m.group(1).decode() for m in self._mark.finditer(body)}:
            self._waiting.pop(key, None)
        return parts


class Escaped:
    """JSON as a JSON string's contents, a piece at a time: JSON that msgspec or orjson wrote holds no
    raw control character, so escaping its quotes and backslashes is all it takes, piece by piece."""

    def __init__(self, data: bytes | Kept) -> None:
        self.data = data
        self.size = len(data) if isinstance(data, bytes) else data.size  # before escaping: a hint only

    async def pieces(self, piece: int = sendbuffer.PIECE) -> AsyncIterator[bytes]:
        if isinstance(self.data, bytes):
            for start in range(0, len(self.data), piece):
                yield _escape(self.data[start : start + piece])
            return
        async with contextlib.aclosing(self.data.pieces(piece)) as read:
            async for chunk in read:
                yield _escape(chunk)


def _escape(chunk: bytes) -> bytes:
    return chunk.replace(b"\\", b"\\\\").replace(b'"', b'\\"')


class Rising:
    """A job's frames as MCP progress: at most one (value, total, message) per batch, the value always rising.

    Queued, the value is the places moved up in line; running, the tool's `done` as it reports it. A
    message with no rise to report takes a value halfway to the next whole step (or the total); with
    no room left, partial text waits to ride on the next notification (its newest `MESSAGE_CHARS`).
    """

    def __init__(self) -> None:
        self.last: float | None = None
        self.total: float | None = None
        self.first_position: int | None = None
        self.held = ""

    def step(self, batch: Sequence[Event]) -> tuple[float, float | None, str | None] | None:
        value: float | None = None
        said: list[str] = []
        texts: list[str] = []
        for event in batch:
            if event.type is EventType.STATUS:
                frame = msgspec.json.decode(event.data, type=StatusFrame)
                value, status = self._status(frame, value)
                said.append(status)
            elif event.type is EventType.PARTIAL:
                try:
                    partial = msgspec.json.decode(event.data, type=_TextPartial)
                except msgspec.ValidationError:  # a tool's own partial, with no text of this shape
                    continue
                if partial.text:
                    texts.append(partial.text if partial.index == 0 else f"[{partial.index}] {partial.text}")
        text = (self.held + "".join(texts))[-MESSAGE_CHARS:]
        message = text or "; ".join(said) or None
        if value is None or (self.last is not None and value <= self.last):
            if message is None:
                return None
            value = self._between()
            if value is None:  # text waits for the next notification; a status, the next status says better
                self.held = text
                return None
        self.held = ""
        self.last = value
        return value, self.total, message

    def _status(self, frame: StatusFrame, value: float | None) -> tuple[float | None, str]:
        if frame.status is Status.QUEUED and frame.position is not None:
            if self.first_position is None:
                self.first_position = frame.position
            in_line = f"queued: {frame.position} in line" + (f" of {frame.queue_size}" if frame.queue_size else "")
            return float(max(self.first_position - frame.position, 0)), in_line
        if frame.status is Status.RUNNING and frame.progress is not None:
            done, self.total = frame.progress.done, frame.progress.total
            unit = f" {frame.progress.unit}" if frame.progress.unit else ""
            return float(done), f"running: {done}" + (f"/{self.total}" if self.total is not None else "") + unit
        if frame.status is Status.RECEIVED:
            return value, f"received: job {frame.job_id}"
        return value, frame.status.value.lower()

    def _between(self) -> float | None:
        """A value above the last and below the next whole step (and the total); None if there is none."""
        if self.last is None:
            return 0.0
        ceiling = math.floor(self.last) + 1.0
        if self.total is not None:
            ceiling = min(ceiling, float(self.total))
        value = self.last + (ceiling - self.last) / 2
        return value if self.last < value < ceiling else None


class _TextPartial(msgspec.Struct):
    """What a partial frame may carry as text (generate's `{"index", "text", ...}`); other partials have none."""

    index: int = 0
    text: str | None = None


def log_lines(batch: Sequence[Event]) -> list[tuple[str, str]]:
    found = []
    for event in batch:
        if event.type is EventType.LOG:
            frame = msgspec.json.decode(event.data, type=LogFrame)
            level = frame.level.lower()
            level = "warning" if level == "warn" else level if level in MCP_LEVELS else "info"
            found.append((level, frame.message))
    return found
