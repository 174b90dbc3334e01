"""Completion webhooks: a run names a URL in its `Callback-URL` header, and the job's terminal event is
POSTed there, signed the Standard Webhooks way, once the job ends.

- **Who may.** Only a gateway with a signing secret (`--webhook-secret`, `whsec_…`) sends them; a
  class may forbid its members (`callbacks = false`, gateway/server/classes.py).
- **Where to** (checked as the job is admitted, and again as each try connects): `http` or `https`,
  no credentials in the URL, a host `--callback-hosts` lists (exactly, or under a `*.domain`) when it
  lists any. Every address the host resolves to must be a public one, unless the host is listed
  exactly: a private, loopback or link-local receiver must be named by the operator. The try
  connects to the address checked (its name still sent as `Host` and for TLS), so a name that
  resolves elsewhere between the check and the connection reaches nothing new; redirects are
  not followed.
- **What.** `{"type": "job.succeeded"|"job.failed", "timestamp", "data": {"job_id", "tool",
  "model", "status", "result"?, "result_size"?, "error"?}}`: the result itself when it is at most
  256 KiB, else its size, to be fetched from `GET /jobs/{id}/result`. The headers
  `webhook-id` (the same on every try of one job's), `webhook-timestamp` and `webhook-signature`
  are the standard's, made by the `standardwebhooks` package, whose `Webhook.verify` (or a port
  of it) checks them.
- **Until it is taken.** A 2xx ends it; a 3xx, or a 4xx other than 408, 409, 425 and 429, ends it
  failed (the receiver refused it for good); anything else (a 5xx, no answer within
  `--webhook-timeout`) is tried again after 1 s, doubling up to 10 minutes, `--webhook-attempts`
  tries in all. With the Redis store the deliveries are kept in Redis (`redis_store/outbox.py`):
  one that a gateway was delivering when it stopped is taken up by another, or by itself once it
  is back, so a terminal event is delivered at least once. `GET /jobs/{id}` shows the delivery
  (`callback`: its state, tries, the receiver's last status and error).
- **Bounded.** A tenant has at most `--webhooks-per-tenant` deliveries open (its jobs' that run, and
  those whose tries go on), a gateway at most `MAX_OPEN`; a run past either is refused with 429, and
  a run refused for any other reason leaves no delivery behind. The
  results carried inline by the pending deliveries are at most `INLINE_HELD` bytes together: past
  that, a message carries the result's size instead (the receiver fetches it). An ended delivery
  keeps no message, and at most `MAX_ENDED` are kept in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import heapq
import ipaddress
import logging
import math
import random
import socket
import time
import urllib.parse
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

import anyio
import httpx
import msgspec
from standardwebhooks import Webhook

from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.protocol import Callback, Code, EventType, JobSnapshot, encode

log = logging.getLogger("streamgate.webhooks")

HEADER = "callback-url"
MAX_URL = 2048
INLINE_RESULT = 256 * 1024  # the most bytes of result a webhook carries; a bigger one is fetched
INLINE_HELD = 32 << 20  # the most bytes of results the pending deliveries carry inline together
MAX_OPEN = 10_000  # deliveries open (waiting for their job, or being tried) in one outbox
MAX_ENDED = 10_000  # ended deliveries kept in memory for `GET /jobs/{id}`, the oldest forgotten first
FULL_RETRY_S = 30  # Retry-After for a run refused as its tenant's (or the gateway's) deliveries are full
BACKOFF_S, BACKOFF_CAP_S = 1.0, 600.0
AT_ONCE = 16  # tries in flight at once
LEASE_S = 60.0  # a try claimed in a shared outbox is another replica's to take after this long
POLL_S = 1.0  # a shared outbox is looked at this often for tries other replicas put in it
LOOK_S = 5.0  # how often a shared outbox's waiting deliveries have their jobs looked at (`look`)
LOOKED_AT = 8  # waiting deliveries whose jobs one look reads
FOR_GOOD = frozenset(range(300, 500)) - {408, 409, 425, 429}  # answers not worth another try


class Delivery(msgspec.Struct, omit_defaults=True):
    """One job's webhook: where to, what (`payload`, set as the job ends), and how its tries went."""

    job_id: str
    url: str
    state: str = "waiting"  # then "pending", "delivered" or "failed"
    tenant: str = ""
    payload: str = ""  # its message while it is pending; an ended one keeps none
    inline: int = 0  # the bytes of result `payload` carries, counted against INLINE_HELD
    attempts: int = 0
    due: float = 0.0  # when its next try is, in seconds since the epoch
    last_status: int | None = None
    last_error: str | None = None

    def shown(self, now: float) -> Callback:
        wait = max(0.0, round(self.due - now, 1)) if self.state == "pending" else None
        return Callback(self.url, self.state, self.attempts, self.last_status, self.last_error, wait)

    @property
    def open(self) -> bool:
        return self.state in ("waiting", "pending")


class OutboxHeld(NamedTuple):
    """What an outbox holds: one tenant's open deliveries, every tenant's, and the pending ones'
    inline results' bytes."""

    tenant: int
    total: int
    inline: int


class Outbox(Protocol):
    """Where deliveries are kept: this process's memory, or Redis shared by every replica."""

    async def put(self, delivery: Delivery) -> None: ...

    async def open(self, delivery: Delivery, per_tenant: int, most: int) -> OutboxHeld | None:
        """Put `delivery` (one waiting for its job) if its tenant has fewer than `per_tenant` open and
        the outbox fewer than `most`, checked and put as one step: None once put, else what is held."""

    async def held(self, tenant: str) -> OutboxHeld: ...

    async def drop(self, delivery: Delivery) -> None:
        """Take out `delivery`, which waited for a job that was refused: it counts no more."""

    async def claim(self, now: float, lease: float, most: int) -> list[Delivery]: ...

    async def get(self, job_id: str) -> Delivery | None: ...

    async def next_due(self) -> float | None:
        """When the next try is due, if the outbox knows (None: not before one is put)."""

    async def close(self) -> None: ...


class MemoryOutbox:
    """Deliveries in this process: the open ones and, for `retention` seconds (at most MAX_ENDED),
    the ended ones. The pending ones' tries are a heap by when they are due."""

    shared = False

    def __init__(self, retention: float) -> None:
        self.retention = retention
        self.deliveries: dict[str, Delivery] = {}
        self._ended: dict[str, float] = {}  # when each ended one ended, oldest first
        self._open: dict[str, set[str]] = {}  # each tenant's open deliveries
        self._opened = 0
        self._inline = 0
        # (due, job id): an entry whose delivery has since been tried, put again or ended is stale,
        # skipped when it comes up (and the heap built again when the stale ones outnumber the rest).
        self._heap: list[tuple[float, str]] = []

    async def put(self, delivery: Delivery) -> None:
        old = self.deliveries.get(delivery.job_id)
        if old is not None:
            self._count(old, -1)
        delivery = msgspec.structs.replace(delivery)  # its own: counted as it was put, whatever a caller does to theirs
        self.deliveries[delivery.job_id] = delivery
        self._count(delivery, 1)
        now = time.time()
        if delivery.state == "pending":
            heapq.heappush(self._heap, (delivery.due, delivery.job_id))
        elif not delivery.open:
            self._ended.pop(delivery.job_id, None)
            self._ended[delivery.job_id] = now
        while self._ended and (first := next(iter(self._ended))) and (self._ended[first] < now - self.retention or len(self._ended) > MAX_ENDED):
            del self._ended[first]
            self.deliveries.pop(first, None)

    def _count(self, delivery: Delivery, sign: int) -> None:
        if not delivery.open:
            return
        ids = self._open.setdefault(delivery.tenant, set())
        (ids.add if sign > 0 else ids.discard)(delivery.job_id)
        if not ids:
            del self._open[delivery.tenant]
        self._opened += sign
        if delivery.state == "pending":
            self._inline += sign * delivery.inline

    async def open(self, delivery: Delivery, per_tenant: int, most: int) -> OutboxHeld | None:
        mine = self._open.get(delivery.tenant, ())
        held = OutboxHeld(len(mine), self._opened, self._inline)
        if delivery.job_id not in mine and (held.tenant >= per_tenant or held.total >= most):
            return held
        await self.put(delivery)  # no wait in between: nothing else is put meanwhile
        return None

    async def held(self, tenant: str) -> OutboxHeld:
        return OutboxHeld(len(self._open.get(tenant, ())), self._opened, self._inline)

    async def drop(self, delivery: Delivery) -> None:
        kept = self.deliveries.pop(delivery.job_id, None)
        if kept is not None:
            self._count(kept, -1)

    async def claim(self, now: float, lease: float, most: int) -> list[Delivery]:
        claimed: list[Delivery] = []
        while self._heap and len(claimed) < most and self._heap[0][0] <= now:
            due, job_id = heapq.heappop(self._heap)
            delivery = self.deliveries.get(job_id)
            if delivery is None or delivery.state != "pending" or delivery.due != due:
                continue
            delivery.due = now + lease
            heapq.heappush(self._heap, (delivery.due, job_id))
            claimed.append(msgspec.structs.replace(delivery))
        if len(self._heap) > 2 * self._opened + 64:
            self._heap = [(d.due, d.job_id) for d in self.deliveries.values() if d.state == "pending"]
            heapq.heapify(self._heap)
        return claimed

    async def get(self, job_id: str) -> Delivery | None:
        delivery = self.deliveries.get(job_id)
        return msgspec.structs.replace(delivery) if delivery is not None else None

    async def next_due(self) -> float | None:
        while self._heap:
            due, job_id = self._heap[0]
            delivery = self.deliveries.get(job_id)
            if delivery is not None and delivery.state == "pending" and delivery.due == due:
                return due
            heapq.heappop(self._heap)
        return None

    async def close(self) -> None:
        pass


def _host_listed(host: str, listed: Iterable[str]) -> tuple[bool, bool]:
    """Whether `host` is allowed by the list (any entry), and whether it is listed exactly."""
    exact = any(host == entry.lower() for entry in listed)
    under = any(entry.startswith("*.") and host.endswith(entry[1:].lower()) for entry in listed)
    return exact or under, exact


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global


class Webhooks:
    """Checks callback URLs as jobs are admitted, and delivers their terminal events as they end."""

    def __init__(
        self, secret: str | None, hosts: list[str], *, attempts: int = 10, timeout: float = 10.0, outbox: Outbox | None = None,
        retention: float = 600.0, per_tenant: int = 64,
    ) -> None:
        self.signer = Webhook(secret) if secret else None
        self.hosts = [host.strip().lower() for host in hosts if host.strip()]
        self.attempts, self.timeout, self.per_tenant = attempts, timeout, per_tenant
        self.outbox: Outbox = outbox if outbox is not None else MemoryOutbox(retention)
        self.shared = getattr(self.outbox, "shared", False)
        self._due = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._tries: set[asyncio.Task[None]] = set()
        self._ends: set[asyncio.Task[None]] = set()
        self.http = httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=timeout)
        # Reads a job from the shared store (`RedisStore.get`), which ends one whose replica is gone (and
        # so has its webhook delivered from here, `ended_elsewhere`): set by the gateway with the Redis store.
        self.look: Any = None
        self._looked = 0.0

    # -- as a job is admitted ---------------------------------------------------------------------

    def check(self, url: str, principal: Any) -> str:
        """The callback URL, if this caller may name it: 400 for one that is not a URL to deliver to,
        403 for a host or a class that may not have them."""
        if self.signer is None:
            raise ApiError(Code.BAD_REQUEST, "this gateway sends no webhooks (it has no --webhook-secret): leave out Callback-URL")
        if principal is not None and not getattr(principal, "callbacks", True):
            raise ApiError(Code.FORBIDDEN, f"the class {principal.user_class!r} may not have completion webhooks")
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").lower()
        if len(url) > MAX_URL or parts.scheme not in ("http", "https") or not host or parts.username or parts.password:
            raise ApiError(Code.BAD_REQUEST, f"Callback-URL must be an http or https URL of at most {MAX_URL} characters, without credentials")
        try:
            parts.port  # noqa: B018 - raises for a port out of range
        except ValueError:
            raise ApiError(Code.BAD_REQUEST, "Callback-URL names a port that is not one") from None
        allowed, exact = _host_listed(host, self.hosts) if self.hosts else (True, False)
        if not allowed:
            raise ApiError(Code.FORBIDDEN, f"Callback-URL's host {host!r} is not one this gateway delivers to (--callback-hosts)")
        try:
            literal = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            literal = None
        if literal is not None and not exact and not _public(str(literal)):
            raise ApiError(Code.FORBIDDEN, f"Callback-URL's address {host} is not public; an operator may list it in --callback-hosts")
        return url

    async def waiting(self, job: Job, url: str) -> None:
        """`job` has a callback: kept (shown on `GET /jobs/{id}`), and delivered once the job ends;
        429 while its tenant, or the gateway, has as many deliveries open as it may."""
        # Checked and put in one step: replicas admitting at once never overshoot the caps together.
        try:
            held = await self.outbox.open(Delivery(job.id, url, tenant=job.tenant), self.per_tenant, MAX_OPEN)
        except BaseException:  # the step may have landed and its answer been lost (a stalled Redis, a reset)
            with anyio.CancelScope(shield=True):
                await self.withdraw(job, url)
            raise
        if held is not None and held.tenant >= self.per_tenant:
            raise ApiError(
                Code.RATE_LIMITED, f"{held.tenant} completion webhooks of yours are not yet delivered (--webhooks-per-tenant): "
                "wait for them, or run without Callback-URL", retry_after=FULL_RETRY_S,
            )
        if held is not None:
            raise ApiError(Code.RATE_LIMITED, f"this gateway has {held.total} completion webhooks not yet delivered: try again later", retry_after=FULL_RETRY_S)

    async def withdraw(self, job: Job, url: str) -> None:
        """The run `waiting` kept the delivery of was refused after all: it is no delivery to count."""
        try:
            await self.outbox.drop(Delivery(job.id, url, tenant=job.tenant))
        except Exception as exc:  # the outbox is unreachable: counted until its key expires
            log.error("job %s: its refused run's webhook could not be taken out: %s", job.id, exc, extra={"job_id": job.id})

    def armed(self, job: Job, url: str) -> None:
        """`job`, admitted, has its end delivered: the message is made as the terminal event is
        appended (or now, if it has been), while its result is still in memory."""
        job.when_ended(lambda ended: self._on_end(ended, url))

    def _on_end(self, job: Job, url: str) -> None:
        if job.handed_off:  # it goes on in another replica, which delivers its end
            return
        terminal = job.terminal
        assert terminal is not None
        ended = JobEnd(job.id, job.tool, job.model, terminal.type is EventType.DATA, terminal.data, job.finished)
        self._spawn(self._ended(url, job.tenant, ended))

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._ends.add(task)
        task.add_done_callback(self._ends.discard)

    async def _ended(self, url: str, tenant: str, ended: JobEnd) -> None:
        """The job's delivery is due: its message made, the result inline while the pending ones'
        inline results leave room for it."""
        try:
            room = INLINE_HELD - (await self.outbox.held(tenant)).inline
            payload, inline = ended.message(room)
            await self.outbox.put(Delivery(ended.job_id, url, "pending", tenant, payload, inline, due=time.time()))
        except Exception as exc:  # the outbox is unreachable: logged, as nothing else can be done
            log.error("job %s: its webhook could not be kept for delivery: %s", ended.job_id, exc, extra={"job_id": ended.job_id})
            return
        self._due.set()

    async def waiting_url(self, job_id: str) -> str | None:
        """The callback of a job that has not ended, if it has one: a replica that takes the job over
        from one that stopped delivers it as the job ends there."""
        delivery = await self.outbox.get(job_id)
        return delivery.url if delivery is not None and delivery.state == "waiting" else None

    async def ended_elsewhere(self, snapshot: JobSnapshot) -> None:
        """A job another replica ran was ended here (its replica stopped answering, or refused to go on
        here): its terminal event is delivered as its own replica would have."""
        delivery = await self.outbox.get(snapshot.job_id)
        terminal = snapshot.terminal
        if delivery is None or delivery.state != "waiting" or terminal is None:
            return
        ended = JobEnd(snapshot.job_id, snapshot.tool, snapshot.model, terminal.event == "data", bytes(terminal.data), snapshot.finished)
        await self._ended(delivery.url, delivery.tenant, ended)

    async def state(self, job_id: str) -> Callback | None:
        delivery = await self.outbox.get(job_id)
        return delivery.shown(time.time()) if delivery is not None else None

    # -- delivery ---------------------------------------------------------------------------------

    def start(self) -> None:
        if self.signer is not None:
            self._task = asyncio.create_task(self._deliver(), name="webhooks")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._tries:  # tries under way end (each within --webhook-timeout), their outcome kept
            await asyncio.wait(list(self._tries), timeout=self.timeout + 1)
        for task in list(self._tries):
            task.cancel()
        await asyncio.gather(*self._ends, *self._tries, return_exceptions=True)
        await self.http.aclose()
        await self.outbox.close()

    async def _deliver(self) -> None:
        while True:
            self._due.clear()
            room = AT_ONCE - len(self._tries)
            try:
                claimed = await self.outbox.claim(time.time(), LEASE_S, room) if room > 0 else []
            except Exception as exc:  # a shared outbox that is down: its deliveries wait for it
                log.warning("webhooks: the outbox could not be read: %s", exc)
                claimed = []
            for delivery in claimed:
                task = asyncio.create_task(self._try(delivery))
                self._tries.add(task)
                task.add_done_callback(self._tries.discard)
                task.add_done_callback(lambda _: self._due.set())
            if self.look is not None and time.monotonic() - self._looked >= LOOK_S:
                await self._look_at_waiting()
            if len(claimed) >= room:  # as many tries under way as may be: the next waits for one to end
                wait = None
            elif self.shared:
                wait = POLL_S
            else:
                due = await self.outbox.next_due()
                wait = max(0.0, due - time.time()) if due is not None else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._due.wait()

    async def _look_at_waiting(self) -> None:
        """Read a few jobs whose delivery waits for their end: one whose replica died unread by any
        client is ended as lost by the read, and its webhook delivered from here."""
        self._looked = time.monotonic()
        try:
            for job_id in await self.outbox.waiting(LOOKED_AT):  # type: ignore[attr-defined]
                await self.look(job_id)
        except Exception as exc:  # the store is down: looked at again later
            log.warning("webhooks: waiting deliveries could not be looked at: %s", exc)

    async def _try(self, delivery: Delivery) -> None:
        delivery.attempts += 1
        status: int | None = None
        try:
            status = await self._post(delivery)
            problem = None if 200 <= status < 300 else f"the receiver answered {status}"
            for_good = status in FOR_GOOD
        except Refused as exc:
            problem, for_good = str(exc), True
        except Exception as exc:  # no answer: refused, reset, timed out
            problem, for_good = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, False
        delivery.last_status, delivery.last_error = status, problem
        if problem is None:
            delivery.state, delivery.payload, delivery.inline = "delivered", "", 0
        elif for_good or delivery.attempts >= self.attempts:
            delivery.state, delivery.payload, delivery.inline = "failed", "", 0
            log.warning("job %s: its webhook to %s failed after %d tries: %s", delivery.job_id, delivery.url, delivery.attempts, problem)
        else:
            backoff = min(BACKOFF_CAP_S, BACKOFF_S * 2 ** (delivery.attempts - 1))
            delivery.due = time.time() + backoff * random.uniform(0.8, 1.0)
        try:
            await self.outbox.put(delivery)
        except Exception as exc:  # tried again once its lease runs out
            log.warning("job %s: its webhook's state could not be kept: %s", delivery.job_id, exc)

    async def _post(self, delivery: Delivery) -> int:
        parts = urllib.parse.urlsplit(delivery.url)
        host = (parts.hostname or "").lower()
        address = await self._address(host, parts.port or (443 if parts.scheme == "https" else 80))
        netloc = f"[{address}]" if ":" in address else address
        if parts.port:
            netloc += f":{parts.port}"
        pinned = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
        assert self.signer is not None
        now = datetime.datetime.now(tz=datetime.timezone.utc)
        msg_id = f"msg_{delivery.job_id}"
        headers = {
            "host": parts.netloc.rsplit("@", 1)[-1],
            "content-type": "application/json",
            "user-agent": "streamgate-webhooks",
            "webhook-id": msg_id,
            "webhook-timestamp": str(math.floor(now.timestamp())),
            "webhook-signature": self.signer.sign(msg_id, now, delivery.payload),
        }
        extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
        async with self.http.stream("POST", pinned, content=delivery.payload.encode(), headers=headers, extensions=extensions) as answer:
            return answer.status_code  # its body is never read

    async def _address(self, host: str, port: int) -> str:
        """The address a try connects to: the host's first, each checked public unless listed exactly."""
        allowed, exact = _host_listed(host, self.hosts) if self.hosts else (True, False)
        if not allowed:
            raise Refused(f"the host {host!r} is no longer one this gateway delivers to")
        found = await asyncio.get_running_loop().getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
        addresses = [info[4][0] for info in found]
        if not addresses:
            raise Refused(f"{host!r} resolves to no address")
        if not exact and (private := [a for a in addresses if not _public(a)]):
            raise Refused(f"{host!r} resolves to an address that is not public ({private[0]}); an operator may list it in --callback-hosts")
        return addresses[0]


class Refused(Exception):
    """A try not made: the receiver's host is not (or no longer) one to deliver to."""


class JobEnd(NamedTuple):
    """A job's end, as its webhook tells it: `data` is its terminal event's (the result, or the error frame)."""

    job_id: str
    tool: str
    model: str | None
    succeeded: bool
    data: bytes
    finished: float | None

    def message(self, room: int) -> tuple[str, int]:
        """The webhook's body, and the bytes of result it carries inline: the result itself when it
        is at most INLINE_RESULT and `room` bytes, else its size."""
        body: dict[str, Any] = {"job_id": self.job_id, "tool": self.tool, "model": self.model}
        inline = 0
        if self.succeeded:
            body["status"] = "succeeded"
            if len(self.data) <= min(INLINE_RESULT, room):
                body["result"], inline = msgspec.Raw(self.data), len(self.data)
            else:
                body["result_size"] = len(self.data)
        else:
            error = msgspec.json.decode(self.data)["error"]
            body["status"] = "cancelled" if error.get("code") == "cancelled" else "failed"
            body["error"] = error
        kind = "job.succeeded" if self.succeeded else "job.failed"
        stamp = datetime.datetime.fromtimestamp(self.finished or time.time(), tz=datetime.timezone.utc).isoformat()
        return encode({"type": kind, "timestamp": stamp, "data": body}).decode(), inline
