"""Who may run what: bearer tokens, per-token limits, and short-lived tickets.

Auth is off until tokens are configured, from a TOML file (`--tokens-file`) or
the environment (`--tokens` / `STREAMGATE_TOKENS`). With tokens, every run and
every job route needs `Authorization: Bearer <token>`: 401 `unauthorized`
without a valid one, 403 `forbidden` for a tool the token may not use, 429
`rate_limited` (with `Retry-After`) past the token's concurrent jobs or jobs
per minute. Health, readiness, the tool list and the dashboard's files stay
open: probes and a login page need them, and they hold no one's data.

Tokens are compared in constant time, as SHA-256 digests so that even their
lengths leak nothing.

A browser's `EventSource` cannot send headers, and a long-lived token put in a
URL ends up in logs, histories and `Referer` headers. So GET streams take a
ticket instead: `POST /auth/ticket` (with the token) answers
`<name>.<expiry ms>.<signature>`, an HMAC-SHA256 of the name and expiry keyed by
the token itself. Keyed that way, a ticket is bound to its token (remove the
token and its tickets die with it), and any replica that knows the token can
check it without another shared secret. Tickets live at most 60 seconds and
are accepted only in the `ticket` query key of GET requests; a `token` in a
query is refused outright rather than ignored.

Limits are counted by each gateway process; behind several replicas a token
gets its limits at each one.

A token's `weight` (default 1) is its share of the queue's turns when tokens'
jobs wait together: a token of weight 2 has two jobs served for each one of a
token of weight 1 (backends/queue.py).

A job belongs to the token that started it (`JobSnapshot.owner`): every job
route answers another token 404, exactly as for an id that does not exist, so
that a job's existence leaks nothing. A token with `admin = true` in the
tokens file sees and cancels every job, for operators.

With an OpenID Connect issuer (`--oidc-issuer`, gateway/server/signin.py), a bearer token that is
none of the static ones is verified as the issuer's JWT: its user is a principal named
`oidc:<tenant claim>`, with the per-token defaults (`--max-concurrent-per-token`,
`--jobs-per-minute-per-token`), every tool, and the groups its token lists. Its tickets are
signed with a key of this process (a signed-in user has no token of its own to key them by): they
are checked only by the replica that issued them, and none outlives the JWT it was issued for.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import hashlib
import hmac
import math
import secrets
import time
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from gateway.errors import ApiError
from gateway.protocol import Code
from gateway.server.classes import (
    NO_QUOTAS, SHARED_KEYS, ClassConfigError, Quotas, UserClass, check_weight, class_of_groups, default_class, parse_classes, shared_keys,
)
from gateway.server.signin import NAME_PREFIX, Issuer, SignInError

if TYPE_CHECKING:
    from gateway.jobs import Job

TICKET_TTL_MAX = 60.0
SIGNED_IN_KEPT = 10_000  # signed-in users whose tickets can be checked (a ticket lives a minute at most)
# Query keys where a credential would be a mistake: refused, so it is noticed.
LONG_LIVED_IN_QUERY = ("token", "access_token", "api_key")


class AuthConfigError(ValueError):
    """The tokens file or list cannot be used; the message says where and why."""


@dataclass(frozen=True)
class Principal:
    """A configured token: its name (in logs, tickets, metrics), what it may run and its limits."""

    name: str
    token: str = field(repr=False)
    tools: frozenset[str] | None = None  # None: every tool
    max_concurrent: int | None = None
    jobs_per_minute: int | None = None
    admin: bool = False  # sees and cancels every token's jobs (operators)
    weight: float = 1.0  # its share of the queue's turns against other tokens' (backends/queue.py)
    groups: frozenset[str] = frozenset()  # a signed-in user's, from the issuer's groups claim
    models: frozenset[str] | None = None  # None: every model
    user_class: str | None = None  # its class (gateway/server/classes.py), if any
    priority: int = 0  # its class's
    max_job_memory: int | None = None  # bytes a job of it may be priced at (its class's), within --max-job-memory
    job_timeout: float | None = None  # seconds a job of it may run (its class's), within --job-timeout
    expires: float | None = None  # a signed-in user's: when the JWT that proved it expires
    quotas: Quotas = NO_QUOTAS  # its class's, on each member's use (gateway/server/metering.py)
    callbacks: bool = True  # its class's: whether its runs may name a Callback-URL
    class_max_queued: int | None = None  # its class's: the class's jobs that may wait to start together

    @property
    def digest(self) -> bytes:
        return hashlib.sha256(self.token.encode()).digest()


TOKEN_KEYS = frozenset({"token", "class", "admin", "weight", *SHARED_KEYS})


@dataclass(frozen=True)
class Access:
    """Who may come in: the tokens, and the classes of users (gateway/server/classes.py)."""

    principals: list[Principal]
    classes: dict[str, UserClass] = field(default_factory=dict)


def load_principals(
    tokens_file: str | None,
    tokens: Iterable[str] = (),
    *,
    max_concurrent: int | None = None,
    jobs_per_minute: int | None = None,
) -> list[Principal]:
    """Tokens from a TOML file (a `[tokens.<name>]` table each) and `name=token` (or bare token) entries."""
    return load_access(tokens_file, tokens, max_concurrent=max_concurrent, jobs_per_minute=jobs_per_minute).principals


def load_access(
    tokens_file: str | None,
    tokens: Iterable[str] = (),
    *,
    max_concurrent: int | None = None,
    jobs_per_minute: int | None = None,
) -> Access:
    """`load_principals`, with the file's `[classes.<name>]` tables: each token of a class (or, there
    being a default class, of none named) takes the class's values for the keys it does not set."""
    found: list[Principal] = []
    classes: dict[str, UserClass] = {}
    defaults = {"max_concurrent": max_concurrent, "jobs_per_minute": jobs_per_minute}
    if tokens_file:
        try:
            data = tomllib.loads(Path(tokens_file).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise AuthConfigError(f"--tokens-file {tokens_file}: {exc}") from None
        where = f"--tokens-file {tokens_file}"
        if unknown := set(data) - {"tokens", "classes"}:
            raise AuthConfigError(f"{where}: unknown tables {sorted(unknown)} (tokens, classes)")
        try:
            classes = parse_classes(data.get("classes"), where)
            found = [_token(name, entry, f"{where}: [tokens.{name}]", classes, defaults) for name, entry in (data.get("tokens") or {}).items()]
        except ClassConfigError as exc:
            raise AuthConfigError(str(exc)) from None
    fallback = default_class(classes)
    for i, item in enumerate(t.strip() for t in tokens):
        if not item:
            continue
        name, _, token = item.rpartition("=") if "=" in item else (f"token-{i + 1}", "", item)
        found.append(member(Principal(name=name, token=token, weight=0.0), fallback, defaults))
    for p in found:
        if len(p.token) < 16:
            raise AuthConfigError(f"token {p.name!r}: use at least 16 characters (e.g. `openssl rand -hex 32`)")
    if reserved := [p.name for p in found if p.name.startswith(NAME_PREFIX)]:
        raise AuthConfigError(f"token names starting {NAME_PREFIX!r} are signed-in users': rename {sorted(reserved)}")
    names = [p.name for p in found]
    if len(set(names)) != len(names):
        raise AuthConfigError(f"token names must be unique: {sorted(n for n in set(names) if names.count(n) > 1)}")
    return Access(found, classes)


def _token(name: str, entry: Any, where: str, classes: dict[str, UserClass], defaults: dict[str, int | None]) -> Principal:
    if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
        raise AuthConfigError(f"{where}: needs token = \"…\"")
    if unknown := set(entry) - TOKEN_KEYS:
        raise AuthConfigError(f"{where}: unknown keys {sorted(unknown)}")
    if not isinstance(entry.get("admin", False), bool):
        raise AuthConfigError(f"{where}: admin must be true or false")
    named = entry.get("class")
    if named is not None and named not in classes:
        raise AuthConfigError(f"{where}: class {named!r} is not one of the [classes.<name>] tables {sorted(classes)}")
    own = Principal(
        name=name,
        token=entry["token"],
        **shared_keys(entry, where),
        admin=entry.get("admin", False),
        weight=check_weight(entry.get("weight"), where) or 0.0,
    )
    return member(own, classes[named] if named is not None else default_class(classes), defaults)


def member(own: Principal, of: UserClass | None, defaults: dict[str, int | None]) -> Principal:
    """`own` (its unset keys None, its weight 0) in the class `of`: the class's values where it sets
    none, then the gateway's defaults."""

    def pick(key: str) -> Any:
        mine = getattr(own, key)
        if mine is not None:
            return mine
        theirs = getattr(of, key) if of is not None else None
        return theirs if theirs is not None else defaults.get(key)

    weight = own.weight or (of.weight if of is not None and of.weight is not None else 1.0)
    return dataclasses.replace(
        own, **{key: pick(key) for key in SHARED_KEYS}, weight=weight,
        user_class=of.name if of is not None else None, priority=of.priority if of is not None else 0,
        quotas=of.quotas if of is not None else NO_QUOTAS, callbacks=of.callbacks if of is not None else True,
        class_max_queued=of.max_queued if of is not None else None,
    )


class Auth:
    """Checks requests against the configured tokens; a no-op without any."""

    def __init__(
        self, principals: list[Principal], *, ticket_ttl: float = TICKET_TTL_MAX, issuer: Issuer | None = None,
        max_concurrent: int | None = None, jobs_per_minute: int | None = None, classes: dict[str, UserClass] | None = None,
    ) -> None:
        self.principals = {p.name: p for p in principals}
        self.classes = classes or {}
        self.ticket_ttl = min(ticket_ttl, TICKET_TTL_MAX)
        self.limits = Limits()
        self.issuer = issuer
        self._signed_in_limits = {"max_concurrent": max_concurrent, "jobs_per_minute": jobs_per_minute}
        self._ticket_key = secrets.token_bytes(32)  # signed-in users' tickets
        # The users whose tickets this process issued, as their JWT proved them (their class comes from
        # its groups, which a ticket does not carry); the most recent `SIGNED_IN_KEPT`.
        self._ticketed: collections.OrderedDict[str, Principal] = collections.OrderedDict()

    @property
    def enabled(self) -> bool:
        return bool(self.principals) or self.issuer is not None

    async def start(self) -> None:
        if self.issuer is not None:
            await self.issuer.start()

    async def stop(self) -> None:
        if self.issuer is not None:
            await self.issuer.stop()

    async def authenticate(self, request: Request) -> Principal | None:
        """The request's principal (None with auth off); 401 without a valid credential."""
        if not self.enabled:
            return None
        for key in LONG_LIVED_IN_QUERY:
            if key in request.query_params:
                raise _unauthorized(
                    f"a credential in the URL ({key}=) is refused: send `Authorization: Bearer …`, "
                    "or for a GET stream a ticket from POST /auth/ticket"
                )
        header = request.headers.get("authorization")
        if header is not None:
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise _unauthorized("expected `Authorization: Bearer <token>`")
            principal = self._by_token(token.strip())
            if principal is None:
                principal = await self._signed_in(token.strip())
            return principal
        ticket = request.query_params.get("ticket")
        if ticket is not None:
            if request.method != "GET":
                raise _unauthorized("a ticket is only for GET streams; send `Authorization: Bearer …`")
            return self._check_ticket(ticket)
        raise _unauthorized("this gateway needs `Authorization: Bearer <token>` (or, for a GET stream, ?ticket=)")

    async def _signed_in(self, token: str) -> Principal:
        """The user a JWT of the issuer proves (401 with the reason it does not)."""
        if self.issuer is None:
            raise _unauthorized("unknown token")
        try:
            identity = await self.issuer.verify(token)
        except SignInError as exc:
            raise _unauthorized(str(exc)) from None
        return self._user(identity.name, identity.groups, identity.expires)

    def _user(self, name: str, groups: frozenset[str] = frozenset(), expires: float | None = None) -> Principal:
        own = Principal(name=name, token="", groups=groups, expires=expires, weight=0.0)
        return member(own, class_of_groups(self.classes, groups), self._signed_in_limits)

    def sees(self, principal: Principal | None, owner: str | None) -> bool:
        """Whether `principal` may see (read, follow, cancel) a job started by the token named `owner`."""
        return self.whose(principal) in (None, owner)

    def whose(self, principal: Principal | None) -> str | None:
        """The owner of every job `principal` may see, or None where it may see them all."""
        return None if principal is None or principal.admin else principal.name

    def authorize(self, principal: Principal | None, tool: str) -> None:
        """403 if `principal` may not use `tool`."""
        if principal is not None and principal.tools is not None and tool not in principal.tools:
            raise ApiError(Code.FORBIDDEN, f"this token may not use the tool {tool!r}" + _in_class(principal))

    def issue_ticket(self, principal: Principal, now: float | None = None) -> tuple[str, float]:
        """A ticket for `principal`'s GET streams, and its lifetime in seconds."""
        # In milliseconds: whole seconds would cut up to one off the ticket's life.
        now = now if now is not None else time.time()
        if not principal.token:  # a signed-in user: kept as its JWT proved it, for its tickets' checks
            self._ticketed.pop(principal.name, None)
            self._ticketed[principal.name] = principal
            while len(self._ticketed) > SIGNED_IN_KEPT:
                self._ticketed.popitem(last=False)
        ttl = self.ticket_ttl if principal.expires is None else max(0.0, min(self.ticket_ttl, principal.expires - now))
        expiry = int((now + ttl) * 1000)
        payload = f"{principal.name}.{expiry}"
        return f"{_b64(principal.name.encode())}.{expiry}.{self._sign(principal, payload)}", ttl

    def _check_ticket(self, ticket: str, now: float | None = None) -> Principal:
        parts = ticket.split(".")
        # Only ASCII reaches int() and hmac.compare_digest, which raise on anything else.
        if len(parts) != 3 or not ticket.isascii() or not parts[1].isdigit():
            raise _unauthorized("malformed ticket")
        try:
            name = _unb64(parts[0]).decode()
        except (ValueError, UnicodeDecodeError):
            raise _unauthorized("malformed ticket") from None
        principal = self.principals.get(name)
        if principal is None and name.startswith(NAME_PREFIX):
            principal = self._ticketed.get(name)
        # Sign even for an unknown name, so that timing does not tell which names exist.
        expected = self._sign(principal or Principal(name, "\0" * 16), f"{name}.{parts[1]}")
        if not hmac.compare_digest(expected, parts[2]) or principal is None:
            raise _unauthorized("invalid ticket")
        if int(parts[1]) / 1000 < (now if now is not None else time.time()):
            raise _unauthorized("the ticket expired: get a new one from POST /auth/ticket")
        return principal

    def _sign(self, principal: Principal, payload: str) -> str:
        key = principal.token.encode() if principal.token else self._ticket_key
        return _b64(hmac.new(key, payload.encode(), hashlib.sha256).digest())

    def _by_token(self, token: str) -> Principal | None:
        digest = hashlib.sha256(token.encode()).digest()
        match = None
        for principal in self.principals.values():  # every one compared, whatever matches
            if hmac.compare_digest(digest, principal.digest):
                match = principal
        return match


class Limits:
    """Per-token concurrent jobs and jobs per minute, and each class's jobs waiting to start, counted
    in this process."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # Only names that run a job, and those that started one in the last minute, are kept: signed-in
        # users come and go by the thousand. `started` is in the order each name last started one.
        self.running: collections.Counter[str] = collections.Counter()
        self.started: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()
        self.waiting: collections.Counter[str] = collections.Counter()  # by class: admitted, not yet started

    def _forget_idle(self, now: float) -> None:
        """Forget the names whose last start is a minute old: the oldest first, as many as there are."""
        while self.started:
            oldest = next(iter(self.started.values()))
            if oldest and oldest[-1] > now - 60:
                return
            self.started.popitem(last=False)

    def usage(self, name: str) -> tuple[int, int]:
        """The jobs `name` runs now, and those it started in the last minute."""
        now = self.clock()
        return self.running.get(name, 0), sum(1 for t in self.started.get(name, ()) if t > now - 60)

    def admit(self, principal: Principal | None, job: Job | None = None) -> Callable[[], None]:
        """Count a job for `principal` (429 if over a limit); call the returned function when it ends."""
        if principal is None:
            return lambda: None
        user_class, most = principal.user_class, principal.class_max_queued
        if user_class is not None and most is not None and self.waiting[user_class] >= most:
            raise ApiError(
                Code.QUEUE_FULL,
                f"the class {user_class!r} has {self.waiting[user_class]} jobs waiting to start, as many as it may (max_queued); try again shortly",
                retry_after=1,
            )
        name, now = principal.name, self.clock()
        self._forget_idle(now)
        window = self.started.get(name) or collections.deque()
        while window and window[0] <= now - 60:
            window.popleft()
        if principal.jobs_per_minute is not None and len(window) >= principal.jobs_per_minute:
            wait = math.ceil(window[0] + 60 - now)
            raise ApiError(
                Code.RATE_LIMITED,
                f"this token may start {principal.jobs_per_minute} jobs a minute; try again in {wait} s",
                retry_after=max(wait, 1),
            )
        if principal.max_concurrent is not None and self.running[name] >= principal.max_concurrent:
            raise ApiError(
                Code.RATE_LIMITED,
                f"this token may run {principal.max_concurrent} jobs at once; wait for one to end",
                retry_after=1,
            )
        window.append(now)
        self.started[name] = window
        self.started.move_to_end(name)
        self.running[name] += 1
        released = False
        waits = user_class is not None and job is not None
        if waits:
            self.waiting[user_class] += 1

        def started(_: Any = None) -> None:
            nonlocal waits
            if waits:
                waits = False
                self.waiting[user_class] -= 1
                if not self.waiting[user_class]:
                    del self.waiting[user_class]

        def release() -> None:
            nonlocal released
            started()
            if not released:
                released = True
                self.running[name] -= 1
                if not self.running[name]:
                    del self.running[name]

        if job is not None:
            job.on_start.append(started)
        return release


def _in_class(principal: Principal) -> str:
    return f" (its class {principal.user_class!r})" if principal.user_class is not None else ""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _unauthorized(message: str) -> ApiError:
    return ApiError(Code.UNAUTHORIZED, message, headers={"WWW-Authenticate": 'Bearer realm="streamgate"'})
