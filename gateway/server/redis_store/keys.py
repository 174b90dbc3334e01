"""Where a job lives in Redis (gateway/server/redis_store/__init__.py has the whole of it): the names
of its keys, the fields of its hash a reader takes, and how long a call on Redis may wait."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

from gateway.errors import ApiError
from gateway.protocol import Code

T = TypeVar("T")

try:  # redis-py 7+: a Redis Enterprise feature, negotiated on every new connection unless turned off
    from redis.maint_notifications import MaintNotificationsConfig

    NO_MAINT: dict[str, Any] = {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}
except ImportError:  # pragma: no cover
    NO_MAINT = {}

ANSWER_S = 2.0  # the longest a request, or a heartbeat, waits on Redis: a stalled one is a 503, never a hang
# The fields of a job's hash a reader needs: never its request, which may be as big as a request body.
READ_FIELDS = (b"owner", b"key", b"last_seq", b"snapshot", b"tseq", b"tsize", b"ttype", b"resumable")


def small_client(url: str, connections: int = 8) -> aioredis.Redis:
    """A client of a few connections for a part beside the store (the meter's ledger, the webhooks'
    outbox): every call bounded by ANSWER_S, retried twice quickly."""
    return aioredis.Redis(
        connection_pool=aioredis.BlockingConnectionPool.from_url(
            url, max_connections=connections, timeout=ANSWER_S, socket_connect_timeout=2, socket_timeout=ANSWER_S,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 2), **NO_MAINT,
        )
    )


def answering(what: str) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
    """For the methods of a part beside the store (`what`: "the usage ledger") that a request waits
    on: Redis unreachable, or no answer in time, is a 503 `store_unavailable` (as the store's own),
    never an internal error."""

    def wrap(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(method)
        async def answered(*args: Any, **kwargs: Any) -> T:
            try:
                return await method(*args, **kwargs)
            except (RedisError, OSError, TimeoutError) as exc:
                why = str(exc) or type(exc).__name__
                raise ApiError(Code.STORE_UNAVAILABLE, f"{what} (Redis) is unreachable: {why}", retry_after=5) from exc

        return answered

    return wrap


def is_redis_url(value: str) -> bool:
    return value.startswith(("redis://", "rediss://", "unix://"))


class Keys:
    """The keys of one store (`prefix`), as seen from one replica (`replica_id`)."""

    def __init__(self, prefix: str, replica_id: str) -> None:
        self.prefix, self.replica_id = prefix, replica_id
        self.index = f"{prefix}jobs"  # every job's id, scored by when its owner last wrote or re-leased it
        # The running jobs that can go on in another replica, scored by when their owner last re-leased them.
        self.resumable = f"{prefix}resumable"
        self.listing = f"{prefix}listing"  # every job's id, scored by when it was made: `GET /jobs` by pages

    def listing_by(self, owner: str) -> str:
        """The ids of the jobs the token named `owner` started, scored by when each was made."""
        return f"{self.prefix}listing-by:{owner}"

    def job(self, job_id: str) -> str:
        """The job's hash."""
        return f"{self.prefix}job:{job_id}"

    def events(self, job_id: str) -> str:
        """The job's stream of events."""
        return f"{self.prefix}events:{job_id}"

    def attached(self, job_id: str) -> str:
        """The replicas that follow the job, scored by deadline."""
        return f"{self.prefix}attached:{job_id}"

    def idem(self, key: str) -> str:
        return f"{self.prefix}key:{key}"

    def replica(self, replica_id: str) -> str:
        """The replica's liveness key, and the name of the channel it listens on."""
        return f"{self.prefix}replica:{replica_id}"

    def result(self, job_id: str) -> str:
        """A big result, kept once apart from the job's events."""
        return f"{self.prefix}result:{job_id}"

    def job_keys(self, job_id: str, key: str | None) -> list[str]:
        keys = [self.job(job_id), self.events(job_id), self.attached(job_id), self.result(job_id)]
        return keys + [self.idem(key)] if key else keys

    def mirrored(self, job_id: str, key: str | None) -> list[str]:
        """The keys a copy of the job's events writes (`scripts.MIRROR`'s KEYS)."""
        keys = [
            self.job(job_id), self.events(job_id), self.attached(job_id), self.replica(self.replica_id), self.index,
            self.result(job_id), self.resumable,
        ]
        return keys + [self.idem(key)] if key else keys
