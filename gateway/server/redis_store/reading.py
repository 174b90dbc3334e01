"""Reading a job that another replica runs, from Redis: its view (`RedisJobView`), one reader of its
stream per replica shared by every client that follows it here (`Tail`), a big result read a piece
at a time (`InRedis`); and the store's side of it (`Reading`)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, AsyncIterator

import msgspec
import redis
from redis.exceptions import RedisError

from gateway.jobs import terminal_event
from gateway.protocol import Event, EventType, JobSnapshot, Kept
from gateway.plumbing.spool import PIECE
from gateway.server.redis_store.keys import ANSWER_S, NO_MAINT
from gateway.server.store import StoppedFollowing, StoreUnavailable

if TYPE_CHECKING:
    from gateway.server.redis_store.store import RedisStore

READ_COUNT = 1000  # most events one XREAD returns


class InRedis:
    """A big result Redis keeps once, apart from its job's events (`result:{id}`; gateway/protocol.py's
    `Kept`): any replica's readers take it a `PIECE` at a time (`GETRANGE`), none holds it whole."""

    __slots__ = ("store", "job_id", "size")

    def __init__(self, store: RedisStore, job_id: str, size: int) -> None:
        self.store = store
        self.job_id = job_id
        self.size = size

    def read(self) -> bytes:
        """The whole result, through a connection of its own (blocking): only where it must be held whole."""
        return self.read_at(0, self.size)

    def read_at(self, start: int, size: int) -> bytes:
        client = redis.Redis.from_url(self.store.url, socket_timeout=ANSWER_S, socket_connect_timeout=2, **NO_MAINT)
        try:
            return self._checked(client.getrange(self.store.keys.result(self.job_id), start, start + size - 1) if size else b"", size)
        finally:
            client.close()

    async def pieces(self, piece: int = PIECE, start: int = 0, stop: int | None = None) -> AsyncIterator[bytes]:
        key = self.store.keys.result(self.job_id)
        at, last = start, self.size if stop is None else min(stop, self.size)
        while at < last:
            end = min(last, at + piece)
            try:
                async with asyncio.timeout(ANSWER_S):
                    chunk = await self.store._redis.getrange(key, at, end - 1)
            except (RedisError, TimeoutError) as exc:
                raise StoreUnavailable(f"reading the result of job {self.job_id} from Redis failed: {exc!r}") from exc
            yield self._checked(chunk, end - at)
            at = end

    def _checked(self, data: bytes, size: int) -> bytes:
        if len(data) != size:  # expired (retention) while it was read: never a short answer as a whole one
            raise StoreUnavailable(f"the result of job {self.job_id} expired while it was read")
        return data

    def release(self) -> None:
        """Redis lets it go with its job's other keys, at the end of its retention."""


class RedisJobView:
    """A job that runs on another replica, read from Redis (see `JobHandle`)."""

    files: Any = None  # a job this replica took over: its result files are here (gateway/server/results.py)

    def __init__(self, store: RedisStore, job_id: str, fields: dict[bytes, bytes]) -> None:
        self.id = job_id
        self._store = store
        self.owner = ""
        self.idempotency_key = ""
        self._snapshot: JobSnapshot | None = None
        self._terminal: Event | None = None
        self._update(fields)

    def _update(self, fields: dict[bytes, bytes]) -> None:
        self.fields = fields
        self.owner = fields.get(b"owner", b"").decode()
        self.idempotency_key = fields.get(b"key", b"").decode()
        self.last_seq = int(fields.get(b"last_seq", b"0"))
        self._snapshot = msgspec.json.decode(fields[b"snapshot"], type=JobSnapshot)
        tseq = fields.get(b"tseq")
        if tseq and b"tsize" in fields:
            kept = InRedis(self._store, self.id, int(fields[b"tsize"]))
            self._terminal = Event(self.id, int(tseq), EventType(fields[b"ttype"].decode()), b"", kept)
        elif tseq and self._snapshot.terminal is not None:
            data = bytes(self._snapshot.terminal.data)
            self._terminal = Event(self.id, int(tseq), EventType(fields[b"ttype"].decode()), data)

    @property
    def terminal(self) -> Event | None:
        return self._terminal

    @property
    def done(self) -> bool:
        return self._terminal is not None

    def snapshot(self, kept: list[Kept] | None = None) -> JobSnapshot:
        assert self._snapshot is not None
        terminal = self._terminal
        if terminal is None or terminal.kept is None:
            return self._snapshot
        # A result kept apart: its snapshot was stored without it, and is completed here.
        return msgspec.structs.replace(self._snapshot, terminal=terminal_event(terminal, kept))

    async def wait_events(self, after: int, timeout: float | None = None) -> list[Event]:
        """Events with seq > `after`, waiting up to `timeout` for one; [] on timeout."""
        return await self._store._read(self, after, timeout)


class Tail:
    """One replica's reading of a job's Redis stream, shared by every client that follows the job here.

    However many clients follow a job through this replica, one task reads its
    stream (`XREAD BLOCK`, one pooled connection) and keeps the events it read;
    each client takes its own slice. So a reconnect storm of thousands of
    followers costs Redis one reader per job, not one per client. The reader
    stops at the terminal event, after a blocking read in which nobody was
    waiting, or once Redis has been unreachable past the outage grace (then
    every waiter gets `StoreUnavailable`, and the next one starts a new tail).
    """

    def __init__(self, store: RedisStore, view: RedisJobView, fields: dict[bytes, bytes]) -> None:
        self._store = store
        self._view = view
        self._fields = fields
        self.events: list[Event] = []  # seqs 1..n: a job's stream has no gaps
        self.failure: StoreUnavailable | None = None
        self._changed = asyncio.Event()
        self._waiting = 0
        self._used = asyncio.get_running_loop().time()
        self._task = asyncio.create_task(self._run(), name=f"tail {view.id}")
        store._spawned.add(self._task)
        self._task.add_done_callback(self._ended)

    def view_for_another(self) -> RedisJobView:
        """A view of the job for one more client, from what this tail knows."""
        view = RedisJobView(self._store, self._view.id, self._fields)
        if self.events and self.events[-1].terminal:
            view._terminal = self.events[-1]
        return view

    async def wait(self, after: int, timeout: float | None) -> list[Event]:
        """Events with seq > `after`, waiting up to `timeout` for one; [] on timeout."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        self._waiting += 1
        try:
            while True:
                self._used = loop.time()
                if len(self.events) > after:
                    return self.events[after:]
                if self.failure is not None:
                    raise self.failure
                if self._task.done():
                    return []  # ended at its terminal event, which this client holds already
                changed = self._changed
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    return []
                try:
                    await asyncio.wait_for(changed.wait(), left)
                except TimeoutError:
                    return []
        finally:
            self._waiting -= 1

    def stop(self) -> None:
        """End every wait, now and later, with StoppedFollowing."""
        self.failure = StoppedFollowing("this gateway is shutting down")
        self._task.cancel()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _ended(self, task: asyncio.Task[None]) -> None:
        store = self._store
        store._spawned.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = StoreUnavailable(f"reading job {self._view.id} failed: {task.exception()!r}")
        self._notify()
        if self.events and self.events[-1].terminal and self.failure is None:
            # Clients still writing out the last events read the rest from here, not from Redis again.
            asyncio.get_running_loop().call_later(store._block, self._forget)
        else:
            self._forget()

    def _forget(self) -> None:
        if self._store._tails.get(self._view.id) is self:
            del self._store._tails[self._view.id]

    async def _run(self) -> None:
        store, view = self._store, self._view
        loop = asyncio.get_running_loop()
        down_since: float | None = None
        while not store._closing:
            last = len(self.events)
            try:
                reply = await store._reads.xread({store.keys.events(view.id): f"{last}-0"}, count=READ_COUNT, block=store._ms(store._block))
                down_since = None
            except RedisError as exc:
                down_since = down_since or loop.time()
                if loop.time() - down_since > store.outage_grace:
                    self.failure = StoreUnavailable(f"Redis unreachable for {store.outage_grace:g} s: {exc}")
                    return
                await asyncio.sleep(min(0.5, store._block))
                continue
            events = store._events(view.id, reply)
            if events:
                self.events += events
                self._notify()
                if events[-1].terminal:
                    return
                continue
            if not self._waiting and loop.time() - self._used > store._block:
                return  # nobody follows the job here any more
            if view.done:  # the hash has a terminal event that the stream no longer holds
                self.failure = StoreUnavailable(f"job {view.id} expired while it was being read")
                return
            with contextlib.suppress(RedisError):
                if await store._finalize_if_orphan(view) is None:
                    self.failure = StoreUnavailable(f"job {view.id} is no longer in the store")
                    return


class Reading:
    """The store's following of jobs that run elsewhere (a part of `RedisStore`)."""

    async def _read(self, view: RedisJobView, after: int, timeout: float | None) -> list[Event]:
        if not self._following:
            raise StoppedFollowing("this gateway is shutting down")
        tail = self._tails.get(view.id)
        if tail is None or tail.failure is not None:
            tail = self._tails[view.id] = Tail(self, view, view.fields)
        events = await tail.wait(after, timeout)
        if events and events[-1].terminal:
            view._terminal = events[-1]
        return events

    def _events(self, job_id: str, reply: Any) -> list[Event]:
        if not reply:
            return []
        # RESP2: [[stream, entries]]; RESP3: {stream: [entries]}.
        entries = next(iter(reply.values()))[0] if isinstance(reply, dict) else reply[0][1]
        events = []
        for entry_id, fields in entries:
            seq = int(entry_id.split(b"-")[0])
            kind = EventType(fields[b"type"].decode())
            if b"size" in fields:  # a big result, kept apart
                events.append(Event(job_id, seq, kind, b"", InRedis(self, job_id, int(fields[b"size"]))))
            else:
                events.append(Event(job_id, seq, kind, fields[b"data"]))
        return events

    def stop_following(self) -> None:
        self._following = False
        for tail in list(self._tails.values()):
            tail.stop()
