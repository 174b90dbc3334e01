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
owner died leaves once its keys have expired), `listing` and `listing-by:{token
name}` (sorted sets of every job's id, and of each token's, scored by when the job was made:
`GET /jobs` reads a page's jobs from them, newest first, and drops those expired as it meets
them; see listing.py), `key:{idempotency key}` (the job id and a digest of its request), `replica:{replica id}` (the
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
a compare-and-set makes it the owner (`scripts.TAKE_OVER`: only if the old owner is
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

The package's rooms: keys.py (names), scripts.py (the Lua scripts), store.py (the store itself),
writer.py (the owner's copy of its jobs' events), reading.py (jobs followed from another replica),
replicas.py (replicas that stop, jobs that go on in another), leases.py (heartbeat, channel,
attachments).
"""

from gateway.server.redis_store.keys import is_redis_url
from gateway.server.redis_store.reading import InRedis, RedisJobView
from gateway.server.redis_store.store import RedisStore

__all__ = ["InRedis", "RedisJobView", "RedisStore", "is_redis_url"]
