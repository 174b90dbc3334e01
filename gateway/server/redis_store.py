"""Jobs shared by every gateway replica through Redis: `streamgate serve --store redis://host:port/db`.

With this store any number of gateways behind a load balancer serve the same
jobs without sticky sessions: a client may start a job on one replica, resume
its stream (`Last-Event-ID`), read its snapshot or cancel it on any other, and
an `Idempotency-Key` binds once across all of them.

**Who owns a job.** The replica whose backend runs a job owns it: it holds the
in-process `Job` and is the only one that ever writes the job's events. `add`
records the job and starts a *mirror* task that follows the `Job`'s log and
copies every event into the job's Redis Stream under the explicit id
`<seq>-0`, fields `type` and `data` (the event's JSON, byte for byte), together
with the job's snapshot. The copy is a Lua script that skips seqs already
written, so a write retried after a lost reply doubles nothing. Other replicas
see the job through a `RedisJobView`: `wait_events` is `XREAD BLOCK` from
`<after>-0`, the snapshot and the terminal event come from the job's hash. The
owner itself serves its jobs from memory (a big result from its spool), but
for those that can go on in another replica (below).

**Big results: Redis keeps them, every replica streams them.** A result of
`SPOOL_FROM` bytes or more is written once, to its own key; its stream entry
and the hash say only its size, and the snapshot in the hash goes without it.
Another replica's readers (followers, snapshots, listings) read it from there
a `PIECE` at a time (`InRedis`, `GETRANGE`): however many follow it, none holds
more than a piece, and nothing copies it whole. It counts against Redis's own
memory (its `maxmemory`), once, for the job's retention.

Keys (prefix `streamgate:`): `job:{id}` (hash: owner, snapshot, last_seq,
terminal seq, type and size, idempotency key, cancel flag, partial events
copied, and for a job that can go on elsewhere its request and times taken
over), `events:{id}` (stream), `resumable` (see below),
`result:{id}` (a result of `SPOOL_FROM` bytes or more, kept once),
`attached:{id}` (sorted set of replicas following the job, scored by
deadline), `jobs` (sorted set of every job's id, scored by when its owner last
wrote or re-leased it: a job running for hours stays listed, and one whose
owner died leaves once its keys have expired), `key:{idempotency key}` (the job id and a digest of its request), `replica:{replica id}` (the
owner's liveness key; also the name of the channel the owner listens on).

**Expiry.** While a job runs its owner re-leases its keys every `heartbeat` s
(and on every copy) for its liveness (below) plus `retention`; the terminal
event sets every key to expire `retention` s later, after which `get` answers
None (404) everywhere. A job whose owner dies is therefore forgotten by itself,
never pinned in Redis, but not before it has read as lost for `retention` s.

**Idempotency keys** are `SET NX` (atomic across replicas) with the same
lease; `release` is a compare-and-delete.

**Cancel.** A local job is cancelled through the backend. For a remote one
the replica sets the job's `cancel` flag and `PUBLISH`es to the owner's
channel; the owner cancels at once on the message, and its heartbeat also
reads the flag, so a message lost while its subscription reconnects still
cancels within one heartbeat.

**Detach grace across replicas.** Deliberately per replica, not per client,
and leased: a replica with clients following a remote job keeps its member
in `attached:{id}` with a deadline `3 × heartbeat` ahead (Redis server time,
so clocks need not agree) and refreshes it every heartbeat; when its last
client leaves it removes the member and tells the owner. The owner counts its
own clients in memory. A job is cancelled once, for `detach_grace` s, it had
no client here and no live member in the set: the owner checks when a client
leaves, on the remote replica's notice, and every heartbeat. A replica that
crashes stops refreshing, its member lapses after at most `3 × heartbeat`,
and the grace starts then: a crash never pins a job forever (and never
cancels a followed job early, since a live member always counts). As with the
memory store, only a job that had a client is ever cancelled for having none.
While Redis cannot be read the owner cancels nothing for want of clients.

**An owner that dies.** Its liveness key lapses once it has been silent for
the outage grace (`--store-outage-grace`, plus `3 × heartbeat`): deliberately
no sooner, since a replica cut off from a stalled or restarting Redis looks
just like a dead one, and its jobs must outlive such an outage. Any replica
that then reads the unfinished job (`get`, a listing, or a follower waiting on
its stream) ends it with `error` `backend_unavailable` at the next seq — a
compare-and-set in Lua, so it happens once and only if the owner is really
silent. Its keys last that long and `retention` more (see Expiry): for
`retention` s after its owner counts as gone it reads as lost, never as
unknown, whenever it is first asked for. An owner that was only cut off from Redis for longer than the grace
and finds its job ended that way cancels the work (its own clients get that
one terminal event). A replica that shuts down leaves its jobs that can go on
elsewhere to another (below), and ends its other unfinished jobs with
`shutting_down`, copies those events out (for up to 2 s), then drops its
liveness key, so nobody waits out a grace for it.

**A job that goes on in another replica.** A job that can go on from its
checkpoint (gateway/checkpoints.py: `embed`'s and `pseudo_loglikelihood`'s
windows) has its request kept in its hash (`request`: tool, params as
admitted, tenant) and its id in `resumable` (a sorted set, scored by when its
owner last re-leased it). Its own clients follow it in Redis too, as other
replicas' do (`followed`): no client ever reads an event Redis lacks. When its
owner stops (killed: once it counts as gone, as above; or shut down: it leaves
its jobs at once, `hand_off`, after its drain), any ready replica that finds
it (every heartbeat looks at `resumable`; a read of the job too) takes it over:
a compare-and-set makes it the owner (`_TAKE_OVER`: only if the old owner is
still silent and nobody took it first), and it is admitted again there under
its id (gateway/admission.py `GoingOn`), its events numbered on after the last
one Redis has. Its run goes on from its checkpoint where the replicas share the
result spool's disk (`checkpoints.lasting_folder`), and from its start where
they do not; the partial events it sends again are dropped (Redis counts them),
so a client reconnecting with its Last-Event-ID reads each event once. A
replica that would refuse the job ends it with that refusal, or, for a refusal
that may pass (busy, not ready, stopping), gives it back. A job is taken over
from a silent replica at most `MOST_TAKEOVERS` times (left by one that stopped:
any number); one no replica takes over within `TAKE_OVER_WAIT_S` (or half the
retention) is ended as lost, as above. An owner cut off from Redis past the
outage grace stops the runs of such jobs itself, before another replica can
take them over, and leaves them to another once Redis answers (unless taken
already); neither it nor anyone else removes a checkpoint that another replica
goes on from.

**Redis down, stalled or restarted** (up to the outage grace). Every call on
a request's path waits at most `ANSWER_S` (2 s): new runs, `GET /jobs/{id}`,
`DELETE` and `GET /jobs` of jobs owned elsewhere answer 503
`store_unavailable` with `Retry-After` — before anything is submitted when the
heartbeat already knows (it too gives Redis 2 s), otherwise the
just-submitted job is ended with that error and its key unbound; no request
hangs or answers 500. `/readyz` is 503 with the reason. Jobs already running
go on: their owner keeps streaming them to its own clients from memory (the
job's own log is the buffer), its mirror retries, and once Redis is back every
event is copied in order, none lost or doubled — the whole log again, with the
job's index entry and idempotency key, if Redis came back empty (it is not
meant to persist anything: a restart loses finished jobs, never a running
one's events). Followers on other replicas see only `: ping` meanwhile and
then every seq once; one whose Redis stays unreachable past the grace has its
response ended without a terminal event, so the client reconnects (EventSource
does) with its `Last-Event-ID` and catches up once Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

try:  # redis-py 7+: a Redis Enterprise feature, negotiated on every new connection unless turned off
    from redis.maint_notifications import MaintNotificationsConfig

    _NO_MAINT: dict[str, Any] = {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}
except ImportError:  # pragma: no cover
    _NO_MAINT = {}

from gateway import checkpoints
from gateway.admission import Admission, Applicant, GoingOn
from gateway.errors import ApiError
from gateway.jobs import Job, terminal_event
from gateway.protocol import RETRYABLE, Code, ErrorFrame, ErrorInfo, Event, EventType, JobSnapshot, Kept, TerminalEvent, encode, now
from gateway.plumbing.spool import PIECE, SPOOL_FROM, ResultSpool
from gateway.server.store import (
    DEFAULT_MEMORY_BUDGET,
    Binding,
    FinishedResults,
    JobHandle,
    JobStore,
    StoppedFollowing,
    StoreUnavailable,
)

log = logging.getLogger("streamgate.redis")

STOP_FLUSH_S = 2.0  # how long `stop` waits for the last events to reach Redis
LAG_TICK_S = 0.1
ANSWER_S = 2.0  # the longest a request, or a heartbeat, waits on Redis: a stalled one is a 503, never a hang
COMMAND_CONNECTIONS = 64  # per replica, for requests and copies
READ_CONNECTIONS = 1024  # per replica: jobs followed from here at once, each one blocking read
READ_COUNT = 1000  # most events one XREAD returns
MOST_TAKEOVERS = 2  # times a job goes on in another replica: one that kills every gateway it runs on ends
TAKE_OVER_COUNT = 8  # orphans one heartbeat looks at
TAKE_OVER_WAIT_S = 300.0  # the longest a job waits for a replica ready to take it over (at most half its retention)
SWEEP_S = 60.0  # how often the checkpoints of jobs ended everywhere are looked for
SWEEP_COUNT = 1000  # checkpoint folders one sweep looks at
# The fields of a job's hash a reader needs: never its request, which may be as big as a request body.
_FIELDS = (b"owner", b"key", b"last_seq", b"snapshot", b"tseq", b"tsize", b"ttype", b"resumable")

# Copy a batch of events and the snapshot. KEYS: hash, stream, attached, the
# owner's liveness key, the index, the result key, the set of jobs that can go
# on elsewhere, [idempotency key]. ARGV: job
# id, snapshot, retention ms, terminal seq ('' while running), terminal type,
# owner, idempotency key, the key's value, lease ms, liveness ms, now, the
# seq whose data is kept apart ('' for none), then (seq, type, data) triples. 1
# written; 0 the job was ended elsewhere; 2 Redis lost the job (restarted
# empty): send its log again from seq 1; 3 another replica took the job over.
#
# Writing is a sign of life (the liveness key), so a job Redis lost and gets
# back is never taken for an orphan between its copy and the next heartbeat; and
# a job copied afresh is listed and keeps its idempotency key again. Its keys are
# leased from then too: a stream begun just before its owner died expires with
# the rest. A big result is kept once, in the result key, which its stream entry
# and the hash (`tsize`) refer to; readers take it a piece at a time (`InRedis`).
_MIRROR = """
if redis.call('HEXISTS', KEYS[1], 'tseq') == 1 then return 0 end
local fresh = redis.call('EXISTS', KEYS[1]) == 0
if fresh and tonumber(ARGV[13]) > 1 then return 2 end
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= ARGV[6] then return 3 end
redis.call('SET', KEYS[4], '1', 'PX', ARGV[10])
local last = tonumber(redis.call('HGET', KEYS[1], 'last_seq') or '0')
local partials = 0
for i = 13, #ARGV, 3 do
  local seq = tonumber(ARGV[i])
  if seq > last then
    if ARGV[i] == ARGV[12] then
      redis.call('SET', KEYS[6], ARGV[i + 2])
      redis.call('XADD', KEYS[2], ARGV[i] .. '-0', 'type', ARGV[i + 1], 'size', #ARGV[i + 2])
      redis.call('HSET', KEYS[1], 'tsize', #ARGV[i + 2])
    else
      redis.call('XADD', KEYS[2], ARGV[i] .. '-0', 'type', ARGV[i + 1], 'data', ARGV[i + 2])
    end
    if ARGV[i + 1] == 'partial' then partials = partials + 1 end
    last = seq
  end
end
redis.call('HSET', KEYS[1], 'last_seq', last, 'snapshot', ARGV[2], 'owner', ARGV[6], 'key', ARGV[7])
if partials > 0 then redis.call('HINCRBY', KEYS[1], 'partials', partials) end
local own = {KEYS[1], KEYS[2], KEYS[3], KEYS[6], KEYS[8]}
redis.call('ZADD', KEYS[5], ARGV[11], ARGV[1])
if fresh and KEYS[8] then redis.call('SET', KEYS[8], ARGV[8], 'NX') end
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[1], 'tseq', ARGV[4], 'ttype', ARGV[5])
  redis.call('ZREM', KEYS[7], ARGV[1])
  for _, key in ipairs(own) do redis.call('PEXPIRE', key, ARGV[3]) end
else
  for _, key in ipairs(own) do redis.call('PEXPIRE', key, ARGV[9]) end
end
return 1
"""

# End a job whose owner is silent. KEYS: owner's liveness key, hash, stream,
# attached, result, [idempotency key]. ARGV: expected last seq, error data, snapshot,
# retention ms, the terminal's seq. 1 done, 0 not needed, -1 the log moved on.
_FINALIZE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
if redis.call('HEXISTS', KEYS[2], 'tseq') == 1 then return 0 end
if redis.call('HGET', KEYS[2], 'last_seq') ~= ARGV[1] then return -1 end
redis.call('XADD', KEYS[3], ARGV[5] .. '-0', 'type', 'error', 'data', ARGV[2])
redis.call('HSET', KEYS[2], 'last_seq', ARGV[5], 'tseq', ARGV[5], 'ttype', 'error', 'snapshot', ARGV[3])
for i = 2, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[4]) end
return 1
"""

# Re-lease a running job's keys (never a finished one's: that would stretch its
# retention) and read its cancel flag; -1 if Redis lost the job, -2 if another
# replica took it over. KEYS: hash, stream, attached, result, [idem]. ARGV:
# lease ms, this replica.
_LEASE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[2] then return -2 end
if redis.call('HEXISTS', KEYS[1], 'tseq') == 0 then
  for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
end
return redis.call('HGET', KEYS[1], 'cancel')
"""

# Take over a job whose owner is silent, to go on with it here from its
# checkpoint. KEYS: the owner's liveness key, hash, stream, attached, result,
# the set of jobs that can go on elsewhere, [idem]. ARGV: the owner read, this
# replica, lease ms, the most times a job is taken over, now, job id. 0 not
# (its owner lives, it ended, or another replica took it); -1 taken over too
# often already; else its last seq, partial events, idempotency key, request
# and whether a client ever followed it. Taken by this replica already (a call
# sent again after a lost answer): the same answer again.
_TAKE_OVER = """
if redis.call('EXISTS', KEYS[2]) == 0 or redis.call('HEXISTS', KEYS[2], 'tseq') == 1 then
  redis.call('ZREM', KEYS[6], ARGV[6])
  return 0
end
local owner = redis.call('HGET', KEYS[2], 'owner')
local request = redis.call('HGET', KEYS[2], 'request')
if not request then return 0 end
if owner ~= ARGV[2] then
  if redis.call('EXISTS', KEYS[1]) == 1 or owner ~= ARGV[1] then return 0 end
  if redis.call('HINCRBY', KEYS[2], 'taken', 1) > tonumber(ARGV[4]) then return -1 end
  redis.call('HSET', KEYS[2], 'owner', ARGV[2])
  redis.call('ZADD', KEYS[6], ARGV[5], ARGV[6])
  for i = 2, #KEYS do
    if i ~= 6 then redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
  end
end
local followed = redis.call('HEXISTS', KEYS[2], 'followed') == 1 or redis.call('ZCARD', KEYS[4]) > 0
return {redis.call('HGET', KEYS[2], 'last_seq'), redis.call('HGET', KEYS[2], 'partials') or '0',
  redis.call('HGET', KEYS[2], 'key') or '', request, followed and 1 or 0}
"""

# Give a job taken over back, for another replica to take (this one could not admit it now: a
# refusal that may pass). KEYS: hash. ARGV: this replica.
_GIVE_BACK = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] or redis.call('HEXISTS', KEYS[1], 'tseq') == 1 then return 0 end
redis.call('HSET', KEYS[1], 'owner', '')
redis.call('HINCRBY', KEYS[1], 'taken', -1)
return 1
"""

# Leave a running job for another replica to go on with (this one stops): no
# owner, first in the order jobs are taken over in, and not counted against
# the times it may be taken over. KEYS: hash, the set of jobs that can go on
# elsewhere. ARGV: this replica, job id, now. 1 it is not this replica's now
# (left, or another took it over); 0 it ended, or Redis lost it.
_LEAVE = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'tseq') == 1 then return 0 end
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'owner', '')
  redis.call('HINCRBY', KEYS[1], 'taken', -1)
  redis.call('ZADD', KEYS[2], -tonumber(ARGV[3]), ARGV[2])
end
return 1
"""

# A replica follows a job until ARGV[2] ms from now (server time). KEYS: attached. ARGV: replica, ttl, lease.
_ATTACH = """
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], ms + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# How many replicas follow the job now (lapsed members are dropped). KEYS: attached.
_LIVE = """
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
return redis.call('ZCARD', KEYS[1])
"""

# Unbind a key from a job. KEYS: the key. ARGV: the job id. The value is "<job id> <request
# digest>", or the job id alone where an older replica bound it.
_RELEASE = """
local bound = redis.call('GET', KEYS[1])
if bound and (bound == ARGV[1] or string.sub(bound, 1, #ARGV[1] + 1) == ARGV[1] .. ' ') then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# Set a flag (ARGV[1]: cancel, followed) on a job that still exists (never recreate an expired hash).
_FLAG = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], ARGV[1], '1') return 1 end
return 0
"""


def is_redis_url(value: str) -> bool:
    return value.startswith(("redis://", "rediss://", "unix://"))


@dataclass
class _Owned:
    """What the owner tracks about one of its jobs, for detach grace."""

    job: Job
    ever_attached: bool = False
    unattached_since: float | None = None  # loop time
    timer: asyncio.TimerHandle | None = None
    evaluating: bool = False
    cancel_seen: bool = False
    # Taken over from a replica that stopped: its events before are in Redis only (its clients here follow
    # it there, as they do every job that may go on elsewhere: `followed`).
    taken: bool = False


class _Request(msgspec.Struct, frozen=True):
    """What another replica needs to admit a job again (`_take_over`): its tool, its params as admitted
    (on a named model), who it runs for, its idempotency key's digest, and when it was admitted."""

    tool: str
    params: msgspec.Raw
    tenant: str
    weight: float = 1.0
    owner: str | None = None
    digest: str = ""
    created: float = 0.0


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
        client = redis.Redis.from_url(self.store.url, socket_timeout=ANSWER_S, socket_connect_timeout=2, **_NO_MAINT)
        try:
            return self._checked(client.getrange(self.store._result(self.job_id), start, start + size - 1) if size else b"", size)
        finally:
            client.close()

    async def pieces(self, piece: int = PIECE, start: int = 0, stop: int | None = None) -> AsyncIterator[bytes]:
        key = self.store._result(self.job_id)
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


class _Tail:
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
                reply = await store._reads.xread({store._stream(view.id): f"{last}-0"}, count=READ_COUNT, block=store._ms(store._block))
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


class RedisStore(JobStore):
    def __init__(
        self,
        url: str,
        cancel: Callable[[Job], None],
        *,
        detach_grace: float = 30.0,
        retention: float = 600.0,
        heartbeat: float = 1.0,
        outage_grace: float = 30.0,
        prefix: str = "streamgate:",
        results: ResultSpool | None = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        checkpoints: str | None = None,
    ) -> None:
        if not is_redis_url(url):
            raise ValueError(f"not a Redis URL: {url!r} (redis://host:port/db, rediss://…, unix://…)")
        self.url = url
        self._cancel = cancel
        self.detach_grace = detach_grace
        self.retention = retention
        self.heartbeat = heartbeat
        self.outage_grace = outage_grace
        self.prefix = prefix
        # The jobs this replica runs keep their events here too, to serve its own clients: bounded
        # as the memory store's are (a big result in this replica's spool, once copied to Redis).
        self.results = results
        self.finished = FinishedResults(results, memory_budget)
        # Where jobs keep their checkpoints (gateway/checkpoints.py `lasting_folder`): swept here of those
        # whose job has ended everywhere.
        self.checkpoints = checkpoints
        self._admission: Admission | None = None  # with which a job whose replica stopped goes on here
        self._ready: Callable[[], bool] = lambda: False
        self._taking: set[str] = set()  # jobs being taken over here now
        self._followed: dict[str, bool] = {}  # whether a client ever followed them (for detach grace)
        self._missing: set[str] = set()  # checkpoints whose job the last sweep found no record of
        self._looking = False  # for jobs to take over, now
        self._swept = 0.0  # loop time of the last sweep
        self.replica_id = uuid.uuid4().hex
        self.ttl = 3 * heartbeat  # of an attachment
        # A replica silent for this long is taken for dead and its jobs ended: no sooner than an
        # outage it must be able to ride out, or a stall would end jobs that are running fine.
        self.liveness = outage_grace + self.ttl
        self._block = max(0.05, min(5.0, self.ttl))  # one XREAD BLOCK, at most
        # Three pools, so that no kind of use starves another: requests and copies share a
        # bounded one (a burst of thousands of requests queues for its connections, for up
        # to ANSWER_S, rather than opening thousands); followers' blocking reads, one per
        # job followed here, have their own; the heartbeat and the owner's channel theirs.
        self._redis = self._client(aioredis.BlockingConnectionPool, max_connections=COMMAND_CONNECTIONS, timeout=ANSWER_S)
        self._reads = self._client(aioredis.BlockingConnectionPool, max_connections=READ_CONNECTIONS, timeout=None)
        self._pulse = self._client(aioredis.ConnectionPool, max_connections=4)
        self._mirror_script = self._redis.register_script(_MIRROR)
        self._finalize_script = self._redis.register_script(_FINALIZE)
        self._lease_script = self._redis.register_script(_LEASE)
        self._attach_script = self._redis.register_script(_ATTACH)
        self._live_script = self._redis.register_script(_LIVE)
        self._release_script = self._redis.register_script(_RELEASE)
        self._flag_script = self._redis.register_script(_FLAG)
        self._take_over_script = self._redis.register_script(_TAKE_OVER)
        self._leave_script = self._redis.register_script(_LEAVE)
        self._give_back_script = self._redis.register_script(_GIVE_BACK)
        self._owned: dict[str, _Owned] = {}
        self._mirrors: dict[str, asyncio.Task[None]] = {}
        self._attached: dict[str, int] = {}  # clients on this replica, per job (owned or not)
        self._views: dict[str, str] = {}  # remote jobs followed from here -> their owner
        self._tails: dict[str, _Tail] = {}  # remote jobs read from here, one reader each
        self._following = True  # until shutdown
        self._pending: dict[str, asyncio.Future[Any]] = {}  # reads in flight that others may share
        self._alive_until: dict[str, float] = {}  # replicas seen alive, until when (loop time)
        self._ops: asyncio.Queue[tuple[str, str, str] | None] = asyncio.Queue()
        # Background loops end on this flag rather than on cancellation alone: redis-py can
        # swallow a cancel that lands while it opens a connection (redis/redis-py#2028).
        self._closing = False
        self._tasks: list[asyncio.Task[Any]] = []
        self._spawned: set[asyncio.Task[Any]] = set()
        self.problem: str | None = f"not connected to Redis at {self._where()} yet"
        self._failed_beats = 0
        self._beat_ok = 0.0  # loop time of the last heartbeat Redis answered
        self._late_until = 0.0  # loop time until which the event loop counts as running late

    def _client(self, pool: type[aioredis.ConnectionPool], **sizing: Any) -> aioredis.Redis:
        return aioredis.Redis(
            connection_pool=pool.from_url(
                self.url,
                socket_connect_timeout=2,
                socket_timeout=self._block + 5,
                retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 2),
                **_NO_MAINT,  # one round trip less per connection, and a window less in which a cancel is lost
                **sizing,
            )
        )

    # -- names -------------------------------------------------------------------

    def _where(self) -> str:
        return self.url.split("@")[-1]  # no password in messages

    def _hash(self, job_id: str) -> str:
        return f"{self.prefix}job:{job_id}"

    def _stream(self, job_id: str) -> str:
        return f"{self.prefix}events:{job_id}"

    def _attached_key(self, job_id: str) -> str:
        return f"{self.prefix}attached:{job_id}"

    @property
    def _index(self) -> str:
        return f"{self.prefix}jobs"

    @property
    def _resumable(self) -> str:
        """The running jobs that can go on in another replica, scored by when their owner last re-leased them."""
        return f"{self.prefix}resumable"

    def _idem(self, key: str) -> str:
        return f"{self.prefix}key:{key}"

    def _replica(self, replica_id: str) -> str:
        """The replica's liveness key, and the name of the channel it listens on."""
        return f"{self.prefix}replica:{replica_id}"

    def _result(self, job_id: str) -> str:
        return f"{self.prefix}result:{job_id}"

    def _job_keys(self, job_id: str, key: str | None) -> list[str]:
        keys = [self._hash(job_id), self._stream(job_id), self._attached_key(job_id), self._result(job_id)]
        return keys + [self._idem(key)] if key else keys

    def _mirror_keys(self, job: Job) -> list[str]:
        keys = [
            self._hash(job.id),
            self._stream(job.id),
            self._attached_key(job.id),
            self._replica(self.replica_id),
            self._index,
            self._result(job.id),
            self._resumable,
        ]
        return keys + [self._idem(job.idempotency_key)] if job.idempotency_key else keys

    def _ms(self, seconds: float) -> int:
        return max(1, int(seconds * 1000))

    @property
    def _lease_ms(self) -> int:
        # A running job's keys outlive its owner's last sign of life by the owner's liveness and
        # then the retention: a job whose owner died reads as lost (`_finalize_if_orphan`) for as
        # long as a finished one reads as finished, never as unknown before its owner counts as gone.
        return self._ms(self.liveness + self.retention)

    def _unavailable(self, exc: BaseException) -> ApiError:
        if isinstance(exc, TimeoutError) and self._busy():
            # No answer in time because this process could not listen for it, not because Redis
            # is away: the client is told so, and to come back a little later.
            return ApiError(
                Code.OVERLOADED,
                "this gateway is too busy to answer in time; try again shortly",
                retry_after=random.randint(1, 5),
            )
        why = str(exc) or f"no answer in {ANSWER_S:g} s"
        return ApiError(Code.STORE_UNAVAILABLE, f"the job store (Redis at {self._where()}) is unreachable: {why}", retry_after=5)

    def _busy(self) -> bool:
        """Whether this process's event loop ran late in the last few seconds (see `_watch_lag`)."""
        return asyncio.get_running_loop().time() < self._late_until

    async def _watch_lag(self) -> None:
        """Note when the event loop runs late: a timer due in LAG_TICK_S that fires a quarter of
        ANSWER_S after it means a loop too busy to hear Redis, whatever Redis does."""
        loop = asyncio.get_running_loop()
        while not self._closing:
            due = loop.time() + LAG_TICK_S
            await asyncio.sleep(LAG_TICK_S)
            if loop.time() - due > ANSWER_S / 4:
                self._late_until = loop.time() + 2 * ANSWER_S

    @contextlib.asynccontextmanager
    async def _answering(self) -> Any:
        """Redis on a request's path: unreachable, or stalled past ANSWER_S, is a 503 store_unavailable."""
        try:
            async with asyncio.timeout(ANSWER_S):
                yield
        except (RedisError, TimeoutError) as exc:
            raise self._unavailable(exc) from exc

    async def _quietly(self, coro: Any) -> None:
        """A background chore that tries again at the next heartbeat if Redis or the disk fails it."""
        try:
            await coro
        except (RedisError, OSError, TimeoutError) as exc:
            log.debug("a background chore failed, tried again later: %s", exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        await self._beat()
        self._tasks = [
            asyncio.create_task(self._heartbeat(), name="redis store heartbeat"),
            asyncio.create_task(self._listen(), name="redis store listener"),
            asyncio.create_task(self._run_ops(), name="redis store attachments"),
            asyncio.create_task(self._watch_lag(), name="redis store loop lag"),
        ]

    async def stop(self) -> None:
        await self.hand_off()
        for owned in self._owned.values():
            if not owned.job.done:
                self._cancel(owned.job)
                owned.job.fail(Code.SHUTTING_DOWN, "the server is shutting down")
            if owned.timer is not None:
                owned.timer.cancel()
        mirrors = [task for task in self._mirrors.values() if not task.done()]
        if mirrors:
            await asyncio.wait(mirrors, timeout=STOP_FLUSH_S)
        self._closing = True
        self._ops.put_nowait(None)
        tasks = [task for task in [*self._tasks, *self._mirrors.values(), *self._spawned] if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2)  # bounded: see `_closing`
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(2):
                pipe = self._redis.pipeline(transaction=False)
                for job_id in self._views:
                    pipe.zrem(self._attached_key(job_id), self.replica_id)
                pipe.delete(self._replica(self.replica_id))
                await pipe.execute()
        for client in (self._redis, self._reads, self._pulse):
            with contextlib.suppress(Exception):
                await client.aclose()
        self.finished.stop()

    def results_kept(self) -> dict[str, int]:
        return self.finished.facts()

    # -- idempotency keys ----------------------------------------------------------

    async def reserve(self, key: str, job_id: str, request: str) -> Binding | None:
        try:
            async with self._answering():
                while True:
                    if await self._redis.set(self._idem(key), f"{job_id} {request}", nx=True, px=self._lease_ms):
                        return None
                    bound = await self._redis.get(self._idem(key))
                    if bound is not None:  # else it expired in between: try again
                        bound_id, _, bound_request = bound.decode().partition(" ")
                        return Binding(bound_id, bound_request)
        except ApiError:
            # A SET that timed out may still land: unbind it once Redis answers, so that the
            # client's retry with the same key starts its job rather than finding none.
            self._spawn(self._release_until_done(key, job_id))
            raise

    async def release(self, key: str, job_id: str) -> None:
        try:
            async with asyncio.timeout(ANSWER_S):
                await self._release_script(keys=[self._idem(key)], args=[job_id])
        except (RedisError, TimeoutError):
            self._spawn(self._release_until_done(key, job_id))

    async def _release_until_done(self, key: str, job_id: str) -> None:
        """Unbind `key` from `job_id` once Redis answers (until the key's own lease would end it)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._lease_ms / 1000
        delay = 0.05
        while not self._closing and loop.time() < give_up:
            try:
                async with asyncio.timeout(ANSWER_S):
                    await self._release_script(keys=[self._idem(key)], args=[job_id])
                return
            except (RedisError, TimeoutError):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    # -- jobs ----------------------------------------------------------------------

    async def add(self, job: Job) -> None:
        if job.taken_over:  # (`_take_over`): its hash is there, and names this replica its owner
            self._owned[job.id] = _Owned(job, ever_attached=self._followed.pop(job.id, False), taken=True)
            self._restart_mirror(job)
            return
        key = job.idempotency_key
        try:
            pipe = self._redis.pipeline(transaction=True)
            fields: dict[str, Any] = {"owner": self.replica_id, "snapshot": encode(job.snapshot()), "last_seq": 0, "key": key or ""}
            if job.resumable:  # another replica can go on with it if this one stops
                fields["request"] = encode(
                    _Request(job.tool, msgspec.Raw(encode(job.params)), job.tenant, job.weight, job.owner, job.request_digest, job.created)
                )
                fields["resumable"] = 1
                pipe.zadd(self._resumable, {job.id: time.time()})
            pipe.hset(self._hash(job.id), mapping=fields)
            pipe.pexpire(self._hash(job.id), self._lease_ms)
            # The index of every job, for listing; members whose job has expired are dropped
            # as it is read, and any older than a lease past retention here.
            # Touched at each copy and heartbeat (`_beat`); one untouched for two leases has expired.
            pipe.zadd(self._index, {job.id: time.time()})
            pipe.zremrangebyscore(self._index, "-inf", time.time() - (self._lease_ms / 1000) * 2)
            if key:
                pipe.pexpire(self._idem(key), self._lease_ms)
            async with self._answering():
                await pipe.execute()
        except ApiError:
            # Nobody may find the job again: stop it, free its key, and refuse the run. A write
            # that timed out may still land, so the job's end is copied too once Redis answers:
            # its record never shows a job running that is not.
            job.fail(Code.STORE_UNAVAILABLE, "the job store could not record the job")
            self._cancel(job)
            if key:
                await self.release(key, job.id)
            self._owned[job.id] = _Owned(job)
            self._restart_mirror(job)
            raise
        self._owned[job.id] = _Owned(job)
        self._restart_mirror(job)

    async def get(self, job_id: str, *, to_follow: bool = False) -> JobHandle | None:
        owned = self._owned.get(job_id)
        if owned is not None and not owned.taken and not owned.job.resumable:
            job = owned.job
            if job.finished is None or time.time() - job.finished <= self.retention:
                return job
            # Forgotten here; Redis's copy expires on Redis's clock, a moment later: read it as any
            # replica would, so that this one never says 404 while it is still found there.
            self._forget(job_id)
        tail = self._tails.get(job_id)
        if to_follow and tail is not None and tail.failure is None:
            # Followed from here already: the job's owner, tool and events are at hand, so a
            # reconnect storm's clients cost Redis nothing more (their snapshot may be stale).
            return tail.view_for_another()
        async with self._answering():
            fields = await self._fields(job_id)
            if not fields or b"snapshot" not in fields:
                return None
            view = RedisJobView(self, job_id, fields)
            if not view.done and view.owner != self.replica_id and await self._finalize_if_orphan(view):
                fields = await self._hash_fields(job_id)
                if not fields:
                    return None
                view._update(fields)
            if owned is not None:
                view.files = owned.job.files
            return view

    async def followed(self, job: Job) -> JobHandle:
        # A job that may go on in another replica is followed from Redis here too: a client never
        # reads an event that Redis lacks, which the replica going on with it would send again
        # under the same seq, and so reconnects after its last event wherever it goes on.
        if job.resumable:
            try:
                view = await self.get(job.id, to_follow=True)
            except ApiError:
                self._cancel(job)  # (nobody could follow it: it ends, and the client may run it again)
                raise
            if view is not None:
                return view
        return job

    async def _shared(self, key: str, call: Callable[[], Awaitable[Any]]) -> Any:
        """`call()`'s answer; calls for one `key` made while one is in flight share its round trip.
        A reconnect storm of a job's followers so costs Redis one read of the job, not one per client."""
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = asyncio.ensure_future(call())
            pending.add_done_callback(lambda done: self._settled(key, done))
        return await asyncio.shield(pending)

    def _settled(self, key: str, done: asyncio.Future[Any]) -> None:
        self._pending.pop(key, None)
        if not done.cancelled():
            done.exception()  # retrieved: a failure every waiter gave up on is not logged as lost

    async def _fields(self, job_id: str) -> dict[bytes, bytes]:
        return await self._shared(f"job {job_id}", lambda: self._hash_fields(job_id))

    async def _hash_fields(self, job_id: str) -> dict[bytes, bytes]:
        """The job's hash as readers need it (`_FIELDS`); {} if it is gone."""
        values = await self._redis.hmget(self._hash(job_id), _FIELDS)
        return {name: value for name, value in zip(_FIELDS, values) if value is not None}

    async def _owner_alive(self, owner: str) -> bool:
        """Whether `owner`'s liveness key exists; a yes is kept for one heartbeat (the key lasts
        far longer), so that reads of its jobs do not ask again and again."""
        loop = asyncio.get_running_loop()
        if self._alive_until.get(owner, 0.0) > loop.time():
            return True
        alive = bool(await self._shared(f"alive {owner}", lambda: self._redis.exists(self._replica(owner))))
        if alive:
            self._alive_until[owner] = loop.time() + self.heartbeat
        else:
            self._alive_until.pop(owner, None)
        return alive

    async def snapshots(self, kept: list[Kept] | None = None) -> list[JobSnapshot]:
        # A big result is in Redis apart (`InRedis`): a marker with `kept`, read whole without.
        names = ("snapshot", "owner", "tseq", "ttype", "tsize")
        async with self._answering():
            ids = [member.decode() for member in await self._redis.zrange(self._index, 0, -1)]
            pipe = self._redis.pipeline(transaction=False)
            for job_id in ids:
                pipe.hmget(self._hash(job_id), *names)
            found = {job_id: dict(zip(names, values)) for job_id, values in zip(ids, await pipe.execute() if ids else [])}
            gone = [job_id for job_id, fields in found.items() if fields["snapshot"] is None]
            if gone:  # expired jobs leave the index as it is read
                await self._redis.zrem(self._index, *gone)
            kept_here = {job_id: fields for job_id, fields in found.items() if fields["snapshot"] is not None}
            # A job whose owner went silent is listed as lost, as `get` reads it, not as running.
            elsewhere = {
                job_id: fields["owner"].decode()
                for job_id, fields in kept_here.items()
                if fields["tseq"] is None and fields["owner"] and fields["owner"].decode() != self.replica_id
            }
            silent = {owner for owner in set(elsewhere.values()) if not await self._owner_alive(owner)}
            lost = {job_id for job_id, owner in elsewhere.items() if owner in silent}
            views = {
                view.id: view for view in await asyncio.gather(*(self.get(job_id) for job_id in lost)) if isinstance(view, RedisJobView)
            }
        snapshots = []
        for job_id, fields in kept_here.items():
            if job_id in views:
                snapshots.append(views[job_id].snapshot(kept))
                continue
            snapshot = msgspec.json.decode(fields["snapshot"], type=JobSnapshot)
            if fields["tsize"] is not None and fields["tseq"] is not None:
                result = Event(job_id, int(fields["tseq"]), EventType(fields["ttype"].decode()), b"", InRedis(self, job_id, int(fields["tsize"])))
                snapshot = msgspec.structs.replace(snapshot, terminal=terminal_event(result, kept))
            snapshots.append(snapshot)
        return snapshots

    async def cancel(self, job: JobHandle) -> None:
        if isinstance(job, Job):
            if not job.done:
                self._cancel(job)
            return
        assert isinstance(job, RedisJobView)
        if job.done:
            return
        async with self._answering():
            if not await self._flag_script(keys=[self._hash(job.id)], args=["cancel"]):
                return  # expired meanwhile
            message = encode({"op": "cancel", "job_id": job.id})
            heard = await self._redis.publish(self._replica(job.owner), message)
            if not heard:
                await self._finalize_if_orphan(job)

    def _forget(self, job_id: str) -> None:
        owned = self._owned.pop(job_id, None)
        if owned is not None:
            self.finished.forget(owned.job)
        if owned is not None and owned.timer is not None:
            owned.timer.cancel()
        self._mirrors.pop(job_id, None)
        self._attached.pop(job_id, None)

    # -- the owner's copy of its jobs' events ----------------------------------------

    def _restart_mirror(self, job: Job) -> None:
        old = self._mirrors.get(job.id)
        if old is not None:
            old.cancel()
        self._mirrors[job.id] = asyncio.create_task(self._mirror(job), name=f"mirror {job.id}")

    async def _mirror(self, job: Job) -> None:
        written = job.base  # a job taken over: its events before are there already
        delay = 0.05
        failing = False
        while not self._closing:
            if job.last_seq <= written and job.terminal is None:
                await job.wait_events(written)
            events = job.events[written - job.base :]
            if not events:
                return
            try:
                if job.handed_off and events[-1].terminal:
                    # Its run here stopped for another replica to go on with it: its end here is not the
                    # job's, and it is left (unless another took it over). What it sent and Redis lacks
                    # nobody read (its clients follow it there); the replica going on sends its own.
                    await self._left(job)
                    return
                ok = await self._copy(job, events)
            except RedisError as exc:
                if not failing:
                    log.warning("job %s: cannot copy events to Redis, retrying: %s", job.id, exc)
                failing = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if failing:
                log.info("job %s: events reach Redis again", job.id)
            failing, delay = False, 0.05
            if ok == 3:
                self._handed_off(job)
                return
            if ok == 2:
                if job.base:  # taken over here: the events before it are gone with Redis's copy
                    log.warning("job %s: Redis lost it (restarted empty?), with the events it had before it came here: stopping it", job.id)
                    self._cancel(job)
                    job.fail(Code.BACKEND_UNAVAILABLE, "the job store lost the job's events")
                    return
                log.warning("job %s: Redis lost it (restarted empty?); copying its events again", job.id)
                written = 0
                continue
            written = events[-1].seq
            if not ok:
                if not job.done:
                    log.warning("job %s was ended by another replica (this one was thought lost): stopping it", job.id)
                    self._cancel(job)
                    job.fail(Code.BACKEND_UNAVAILABLE, "the job was ended while this gateway could not reach Redis")
                return
            if events[-1].terminal:
                if self._owned.get(job.id) is not None:
                    # Copied out: its own copy here now counts against this replica's memory, or goes to the spool.
                    self.finished.ended(job)
                return

    async def _copy(self, job: Job, events: list[Event]) -> int:
        """Copy `events` (the next of `job`'s log) and its snapshot: `_MIRROR`'s answer."""
        snapshot = job.snapshot(kept=[])  # taken with `events`, so the two agree
        terminal = events[-1] if events[-1].terminal else None
        # A result already in this replica's spool (a copy sent again) is read on a thread, not on the loop.
        datas = [event.raw if event.kept is None else await asyncio.to_thread(event.kept.read) for event in events]
        apart = terminal is not None and terminal.type is EventType.DATA and terminal.size >= SPOOL_FROM
        if terminal is not None:
            # A big result is kept once, in the result key, and readers fill it in from there.
            whole = TerminalEvent(terminal.type.value, msgspec.Raw(datas[-1]))
            snapshot = msgspec.structs.replace(snapshot, terminal=None if apart else whole)
        args: list[Any] = [
            job.id,
            encode(snapshot),
            self._ms(self.retention),
            terminal.seq if terminal else "",
            terminal.type.value if terminal else "",
            self.replica_id,
            job.idempotency_key or "",
            f"{job.id} {job.request_digest}",
            self._lease_ms,
            self._ms(self.liveness),
            time.time(),
            terminal.seq if apart and terminal is not None else "",
        ]
        for event, data in zip(events, datas):
            args += [event.seq, event.type.value, data]
        return int(await self._mirror_script(keys=self._mirror_keys(job), args=args))

    def _handed_off(self, job: Job) -> None:
        """Another replica took `job` over while this one could not reach Redis (it counted as gone):
        the work here stops, and leaves the job's checkpoint to the replica that goes on with it."""
        if job.done or job.handed_off:
            return
        log.warning("job %s was taken over by another replica (this one was thought gone): stopping it here", job.id)
        self._leave(job)

    def _leave(self, job: Job) -> None:
        """`job` goes on in another replica: its run here stops (what it appends from now on reaches
        no client: they follow it in Redis), and its checkpoint is left to that replica."""
        job.handed_off = True
        self._cancel(job)
        job.fail(Code.BACKEND_UNAVAILABLE, "the job goes on in another gateway replica")

    def _stand_down(self) -> None:
        """Cut off from Redis past the outage grace, this replica may count as gone, and its jobs that can
        go on elsewhere be taken over: their runs here stop (and leave the checkpoints alone) before
        another replica's can start. Once Redis answers, each is left (`_mirror`) unless taken."""
        for owned in list(self._owned.values()):
            job = owned.job
            if job.resumable and not job.done and not job.handed_off:
                log.warning("job %s: Redis unreachable past the outage grace; its run here stops, for another replica to go on with it", job.id)
                self._leave(job)

    async def hand_off(self) -> None:
        """This replica stops: its jobs that can go on elsewhere are left, for another replica (or this
        one's successor) to take over at once. Their events not copied yet stay behind: nobody has
        read them (clients follow such jobs in Redis), and the replica that goes on sends its own. A
        job not left in `STOP_FLUSH_S` (Redis unreachable) is taken over once this one counts as gone."""
        leaving = [o.job for o in self._owned.values() if o.job.resumable and not o.job.done and not o.job.handed_off]
        if not leaving:
            return
        try:
            async with asyncio.timeout(STOP_FLUSH_S):
                for job in leaving:
                    if await self._left(job):
                        log.info("job %s: left for another replica to go on with", job.id)
                        self._leave(job)
        except (RedisError, TimeoutError) as exc:
            log.warning("could not leave every job to another replica: %s", exc or "no answer in time")

    # -- a job whose replica stopped goes on in another ------------------------------------

    def takes_over(self, admission: Admission, ready: Callable[[], bool]) -> None:
        self._admission, self._ready = admission, ready

    async def _left(self, job: Job) -> int:
        """`_LEAVE` `job` in Redis: 1 if it is not this replica's any more."""
        return int(await self._leave_script(keys=[self._hash(job.id), self._resumable], args=[self.replica_id, job.id, time.time()]))

    async def _may_go_on(self, job_id: str) -> bool:
        """Whether a job whose owner is silent may still go on elsewhere: its owner re-leased it less than
        a liveness and `TAKE_OVER_WAIT_S` (or half the retention) ago. After that, no replica having
        been ready to take it over, it is ended as lost, and reads so for its retention."""
        score = await self._redis.zscore(self._resumable, job_id)
        return score is not None and time.time() - abs(float(score)) < self.liveness + min(TAKE_OVER_WAIT_S, self.retention / 2)

    def _take_over_soon(self, job_id: str, owner: str) -> None:
        if self._admission is not None and self._ready() and job_id not in self._taking and not self._closing:
            self._taking.add(job_id)
            self._spawn(self._take_over(job_id, owner))

    async def _take_over_orphans(self) -> None:
        """Take over the jobs that can go on whose owners have not re-leased them within a liveness, and
        those left by a replica that stopped (`hand_off`: scored by minus when, so they come first)."""
        try:
            await self._look_for_orphans()
        finally:
            self._looking = False

    async def _look_for_orphans(self) -> None:
        until = time.time() - self.liveness
        ids = await self._redis.zrangebyscore(self._resumable, "-inf", until, start=0, num=TAKE_OVER_COUNT)
        if not ids:
            return
        pipe = self._redis.pipeline(transaction=False)
        for member in ids:
            pipe.hget(self._hash(member.decode()), "owner")
        owners = await pipe.execute()
        for member, owner in zip(ids, owners):
            job_id = member.decode()
            if owner is None:  # expired: nothing to go on with
                await self._redis.zrem(self._resumable, job_id)
            elif owner.decode() != self.replica_id and not await self._owner_alive(owner.decode()):
                if await self._may_go_on(job_id):
                    self._take_over_soon(job_id, owner.decode())
                elif fields := await self._hash_fields(job_id):  # waited too long: lost
                    await self._finalize_if_orphan(RedisJobView(self, job_id, fields))

    async def _take_over(self, job_id: str, owner: str) -> None:
        """Make this replica the owner of `job_id` (if `owner` is still silent and nobody took it first)
        and admit the job again here, under its id, to go on from its checkpoint after its last event."""
        try:
            if job_id in self._owned:
                return
            keys = [self._replica(owner), self._hash(job_id), self._stream(job_id), self._attached_key(job_id), self._result(job_id), self._resumable]
            key = (await self._redis.hget(self._hash(job_id), "key") or b"").decode()
            if key:
                keys.append(self._idem(key))
            args = [owner, self.replica_id, self._lease_ms, MOST_TAKEOVERS, time.time(), job_id]
            taken = await self._take_over_script(keys=keys, args=args)
            if taken == -1:
                view = RedisJobView(self, job_id, await self._hash_fields(job_id))
                await self._finalize_if_orphan(view, f"the gateway replicas running this job stopped {MOST_TAKEOVERS + 1} times while it ran")
                return
            if not taken:
                return
            last, partials, key_bytes, request, followed = taken
            self._followed[job_id] = bool(followed)
            await self._go_on(job_id, int(last), int(partials), key_bytes.decode() or None, msgspec.json.decode(request, type=_Request))
        except (RedisError, TimeoutError, msgspec.DecodeError) as exc:
            log.warning("job %s: could not be taken over from replica %s: %s", job_id, owner, exc)
        finally:
            self._taking.discard(job_id)
            self._followed.pop(job_id, None)

    async def _go_on(self, job_id: str, last: int, partials: int, key: str | None, request: _Request) -> None:
        """Admit a job taken over here again; a refusal (its tool gone, over a budget) is its end."""
        assert self._admission is not None
        log.warning("job %s: its replica stopped; it goes on here after event %d", job_id, last)
        going_on = GoingOn(last, partials, key, request.digest, request.created)
        try:
            tool = self._admission.backend.tool(request.tool)
            params = await self._admission.decode(tool, bytes(request.params), "the job's request")
            applicant = Applicant(request.tenant, request.weight, request.owner)
            await self._admission.admit(tool, params, applicant, job_id=job_id, going_on=going_on)
        except Exception as exc:  # refused here: the job ends, once, with why
            if isinstance(exc, ApiError) and exc.code in RETRYABLE:  # (busy, not ready, stopping): another may take it
                log.warning("job %s: not admitted here now (%s); given back", job_id, exc.message)
                await self._give_back_script(keys=[self._hash(job_id)], args=[self.replica_id])
                return
            if isinstance(exc, ApiError):
                code, message = exc.code, exc.message
            else:
                log.exception("job %s: admitting it again failed", job_id)
                code, message = Code.INTERNAL, "the job could not go on in the replica that took it over"
            job = Job(request.tool, None, job_id=job_id, owner=request.owner, tenant=request.tenant, after=last)
            job.idempotency_key, job.request_digest = key, request.digest
            job.fail(code, message)
            await self.add(job)
            if self.checkpoints is not None:  # nothing will go on from it
                await asyncio.to_thread(shutil.rmtree, os.path.join(self.checkpoints, job_id), True)

    async def _sweep(self) -> None:
        """Remove the checkpoints of jobs that have ended everywhere (or are gone): a job goes on from
        its checkpoint only while it runs, or waits for a replica to take it over."""
        assert self.checkpoints is not None
        ids = await asyncio.to_thread(lambda: list(checkpoints.folders(self.checkpoints, SWEEP_S, SWEEP_COUNT)))
        ids = [job_id for job_id in ids if job_id not in self._owned]
        if not ids:
            return
        pipe = self._redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(self._hash(job_id), "owner", "tseq")
        states = await pipe.execute()
        # No record at all on two sweeps in a row (Redis restarted empty: a running job's owner copies
        # it back within a heartbeat), or its end recorded.
        missing = {job_id for job_id, (owner, _) in zip(ids, states) if owner is None}
        ended = [job_id for job_id, (owner, tseq) in zip(ids, states) if tseq is not None or job_id in missing & self._missing]
        self._missing = missing
        if ended:
            root = self.checkpoints
            await asyncio.to_thread(lambda: [shutil.rmtree(os.path.join(root, job_id), ignore_errors=True) for job_id in ended])

    # -- following a job that runs elsewhere -------------------------------------------

    async def _read(self, view: RedisJobView, after: int, timeout: float | None) -> list[Event]:
        if not self._following:
            raise StoppedFollowing("this gateway is shutting down")
        tail = self._tails.get(view.id)
        if tail is None or tail.failure is not None:
            tail = self._tails[view.id] = _Tail(self, view, view.fields)
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

    async def _finalize_if_orphan(self, view: RedisJobView, message: str | None = None) -> bool | None:
        """End `view`'s job with backend_unavailable if its owner is silent (unless it can go on in
        another replica: `_take_over`); True if it has ended, None if Redis no longer has it.
        `message`: why, if not the owner's silence."""
        for _ in range(5):
            if await self._owner_alive(view.owner):
                return False
            fields = await self._hash_fields(view.id)
            if not fields or b"snapshot" not in fields:
                return None
            silent = view.owner
            view._update(fields)
            if view.done:
                return True
            if view.owner != silent:
                continue  # taken over meanwhile: is the new owner alive?
            if message is None and b"resumable" in fields and await self._may_go_on(view.id):
                self._take_over_soon(view.id, view.owner)
                return False
            seq = view.last_seq + 1
            info = ErrorInfo(
                code=Code.BACKEND_UNAVAILABLE, message=message or "the gateway replica running this job stopped answering", retryable=True
            )
            data = encode(ErrorFrame(view.id, seq, info))
            old = view.snapshot()
            snapshot = msgspec.structs.replace(
                old,
                status="FAILED",
                finished=now(),
                position=None,
                last_event_id=f"{view.id}:{seq}",
                terminal=TerminalEvent("error", msgspec.Raw(data)),
            )
            keys = [self._replica(view.owner), *self._job_keys(view.id, view.idempotency_key or None)]
            args = [str(view.last_seq), data, encode(snapshot), self._ms(self.retention), seq]
            done = await self._finalize_script(keys=keys, args=args)
            if done == 1:
                log.warning("job %s: its replica %s is gone; ended with backend_unavailable", view.id, view.owner)
                return True
            if done == 0:
                return False
        return False

    def stop_following(self) -> None:
        self._following = False
        for tail in list(self._tails.values()):
            tail.stop()

    # -- attach, detach, and detach grace ------------------------------------------------

    def attach(self, job: JobHandle) -> None:
        count = self._attached.get(job.id, 0) + 1
        self._attached[job.id] = count
        owned = self._owned.get(job.id)
        if owned is not None:
            if not owned.ever_attached and owned.job.resumable:  # for the replica that may take it over
                self._ops.put_nowait(("followed", job.id, ""))
            owned.ever_attached = True
            owned.unattached_since = None
            if owned.timer is not None:
                owned.timer.cancel()
                owned.timer = None
        elif isinstance(job, RedisJobView) and count == 1 and not job.done:
            self._views[job.id] = job.owner
            self._ops.put_nowait(("attach", job.id, job.owner))

    def detach(self, job: JobHandle) -> None:
        count = self._attached.get(job.id, 1) - 1
        if count > 0:
            self._attached[job.id] = count
            return
        self._attached.pop(job.id, None)
        owned = self._owned.get(job.id)
        if owned is not None:
            if not owned.job.done:
                self._evaluate_soon(owned)
        elif job.id in self._views:
            owner = self._views.pop(job.id)
            self._ops.put_nowait(("detach", job.id, owner))

    async def _run_ops(self) -> None:
        """Attachments of remote jobs, in order (an attach never lands after its detach)."""
        while not self._closing:
            item = await self._ops.get()
            if item is None:
                return
            op, job_id, owner = item
            try:
                if op == "followed":
                    await self._flag_script(keys=[self._hash(job_id)], args=["followed"])
                elif op == "attach":
                    if job_id in self._views:
                        await self._attach_script(
                            keys=[self._attached_key(job_id)],
                            args=[self.replica_id, self._ms(self.ttl), self._lease_ms],
                        )
                elif job_id not in self._views:  # detach, unless a client came back meanwhile
                    await self._redis.zrem(self._attached_key(job_id), self.replica_id)
                    await self._redis.publish(self._replica(owner), encode({"op": "detached", "job_id": job_id}))
            except RedisError as exc:
                log.debug("attachment %s of job %s not recorded: %s", op, job_id, exc)

    def _evaluate_soon(self, owned: _Owned) -> None:
        if not owned.evaluating:
            owned.evaluating = True
            self._spawn(self._evaluate(owned))

    async def _evaluate(self, owned: _Owned) -> None:
        """Cancel the job if no client anywhere has followed it for detach_grace; else check again later."""
        job = owned.job
        try:
            if job.done or self._attached.get(job.id, 0) > 0:
                owned.unattached_since = None
                return
            try:
                remote = await self._live_script(keys=[self._attached_key(job.id)])
            except RedisError as exc:
                log.debug("job %s: cannot count its followers, cancelling nothing: %s", job.id, exc)
                return
            if job.done or self._attached.get(job.id, 0) > 0 or job.id not in self._owned:
                return
            if remote:
                owned.ever_attached = True
                owned.unattached_since = None
                return
            if not owned.ever_attached:
                return
            loop = asyncio.get_running_loop()
            if owned.unattached_since is None:
                owned.unattached_since = loop.time()
            left = self.detach_grace - (loop.time() - owned.unattached_since)
            if left <= 0:
                log.info("job %s: no client for %g s, cancelling", job.id, self.detach_grace)
                self._cancel(job)
            elif owned.timer is None:
                owned.timer = loop.call_later(left, self._grace_over, owned)
        finally:
            owned.evaluating = False

    def _grace_over(self, owned: _Owned) -> None:
        owned.timer = None
        self._evaluate_soon(owned)

    # -- heartbeat and the owner's channel ------------------------------------------------

    async def _heartbeat(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.heartbeat)
            if not self._closing:
                await self._beat()

    async def _beat(self) -> None:
        """Stay alive, re-lease running jobs, pick up cancel flags, keep attachments, forget old jobs."""
        running = [owned for owned in self._owned.values() if not owned.job.done]
        try:
            pipe = self._pulse.pipeline(transaction=False)
            pipe.set(self._replica(self.replica_id), b"1", px=self._ms(self.liveness))
            for owned in running:
                await self._lease_script(
                    keys=self._job_keys(owned.job.id, owned.job.idempotency_key),
                    args=[self._lease_ms, self.replica_id],
                    client=pipe,
                )
            if running:  # still listed, however long they run
                pipe.zadd(self._index, {owned.job.id: time.time() for owned in running}, xx=True)
            if resumable := {owned.job.id: time.time() for owned in running if owned.job.resumable}:
                pipe.zadd(self._resumable, resumable, xx=True)  # alive: nobody takes them over
            async with asyncio.timeout(ANSWER_S):  # a stalled Redis is found out as soon as a dead one
                replies = await pipe.execute()
        except (RedisError, TimeoutError) as exc:
            why = str(exc) or f"no answer in {ANSWER_S:g} s"
            if isinstance(exc, TimeoutError) and self._busy():
                return  # this process was too busy to hear the answer: no sign of an outage
            self._failed_beats += 1
            # Twice in a row (or before the first success): once may be this process too busy to hear the answer
            # in time (a storm of reconnects while the model loads), which is no outage of Redis.
            if self.problem is not None or self._failed_beats >= 2:
                if self.problem is None:
                    log.warning("Redis at %s is unreachable: %s", self._where(), why)
                self.problem = f"the job store (Redis at {self._where()}) is unreachable: {why}"
            if asyncio.get_running_loop().time() - self._beat_ok > self.outage_grace:
                self._stand_down()
            return
        if self.problem is not None:
            log.info("Redis at %s is reachable", self._where())
        self.problem = None
        self._failed_beats = 0
        self._beat_ok = asyncio.get_running_loop().time()
        for owned, flag in zip(running, replies[1 : 1 + len(running)]):
            if flag == -2:
                self._handed_off(owned.job)
            elif flag == -1 and not owned.job.done:  # Redis lost the job: copy it again
                self._restart_mirror(owned.job)
            elif flag and not owned.cancel_seen and not owned.job.done:
                owned.cancel_seen = True
                self._cancel(owned.job)
            elif owned.ever_attached and owned.timer is None and not self._attached.get(owned.job.id):
                self._evaluate_soon(owned)
        for job_id, owner in self._views.items():
            self._ops.put_nowait(("attach", job_id, owner))
        if self._admission is not None and not self._looking:
            self._looking = True
            self._spawn(self._quietly(self._take_over_orphans()))
        loop = asyncio.get_running_loop()
        if self.checkpoints is not None and loop.time() - self._swept > SWEEP_S:
            self._swept = loop.time()
            self._spawn(self._quietly(self._sweep()))
        moment = time.time()
        for job_id, owned in list(self._owned.items()):
            if owned.job.finished is not None and moment - owned.job.finished > self.retention:
                self._forget(job_id)

    async def _listen(self) -> None:
        channel = self._replica(self.replica_id)
        while not self._closing:
            pubsub = self._pulse.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                while not self._closing:
                    message = await pubsub.get_message(timeout=0.5)
                    if message is not None and message.get("type") == "message":
                        self._on_message(message["data"])
            except RedisError as exc:
                log.debug("subscription to %s lost: %s", channel, exc)
                await asyncio.sleep(min(1.0, self.heartbeat))
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def _on_message(self, data: bytes) -> None:
        try:
            message = msgspec.json.decode(data)
            op, job_id = message["op"], message["job_id"]
        except (msgspec.DecodeError, KeyError, TypeError):
            log.warning("ignoring a malformed message on the replica channel: %r", data[:200])
            return
        owned = self._owned.get(job_id)
        if owned is None or owned.job.done:
            return
        if op == "cancel":
            owned.cancel_seen = True
            self._cancel(owned.job)
        elif op == "detached":
            self._evaluate_soon(owned)
