"""Tenants: whom a job, a queue place and an event stream count against.

A request's tenant is its token's name, or, on a gateway without tokens, its
client's address (`addr:<host>`, as uvicorn reports it: from `X-Forwarded-For`
when the connection comes from `FORWARDED_ALLOW_IPS`, so that behind a proxy
it is the client's, not the proxy's). Tenants are what the queue serves in
turn (backends/queue.py), with each token's `weight`, and what the per-owner
limits count (`--max-queued-per-owner`, `--max-streams-per-owner`). A tenant
is only a name: nothing here authenticates, and a client that can change its
address can become another tenant, as it could open another connection.

Past a per-owner limit the answer is 429 `rate_limited` with `Retry-After`,
the shape of the per-token limits (gateway/server/auth.py).
"""

from __future__ import annotations

from typing import Protocol

from starlette.requests import HTTPConnection

from gateway.errors import ApiError
from gateway.protocol import Code

ADDRESS = "addr:"
# An executor's tenant for a gateway that names none (an older one): its session, the whole gateway.
SESSION = "session:"


class Named(Protocol):
    """A principal as tenancy sees it (gateway/server/auth.py's `Principal`): only its name."""

    @property
    def name(self) -> str: ...


def tenant(principal: Named | None, request: HTTPConnection) -> str:
    """The tenant of a request made as `principal` (None: a gateway without tokens)."""
    if principal is not None:
        return principal.name
    return ADDRESS + (request.client.host if request.client is not None else "unknown")


def label(name: str) -> str:
    """A tenant as a message names it to its own client."""
    if name.startswith(ADDRESS):
        return f"the client {name.removeprefix(ADDRESS)}"
    if name.startswith(SESSION):
        return f"the gateway session {name.removeprefix(SESSION)}"
    return f"the token {name!r}" if name else "this gateway"


def over_share(name: str, holds: str, flag: str, retry_after: float) -> ApiError:
    """429 `rate_limited` for a tenant that `holds` (e.g. "has 32 jobs waiting") the most one owner may (`flag`)."""
    return ApiError(
        Code.RATE_LIMITED,
        f"{label(name)} {holds}, the most one owner may ({flag}); try again shortly",
        retry_after=retry_after,
    )
