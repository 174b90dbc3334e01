"""Sign-in with an OpenID Connect issuer: its bearer JWTs, verified against its published keys.

With `--oidc-issuer URL` and `--oidc-audience AUD`, a bearer token that is not one of the
configured static tokens is read as a JWT (gateway/server/auth.py asks `Issuer.verify`):

- **Keys.** The issuer's JWKS, from its discovery document's `jwks_uri`
  (`URL/.well-known/openid-configuration`, whose `issuer` must be `URL`) or `--oidc-jwks-url`,
  fetched at start and kept. A token naming a key id the set lacks has the set fetched again (the
  issuer rotated its keys), at most once every `REFETCH_S` seconds whoever asks, so that tokens
  with made-up key ids cannot turn the gateway into a client hammering the issuer; the set is
  also fetched again once it is `--oidc-jwks-refresh` seconds old. Fetches follow no redirect and
  read at most `MAX_JWKS_BYTES`.
- **Checks**, by PyJWT (no hand-written crypto): the signature with the key the token's `kid`
  names; the algorithm among `--oidc-algorithms`, which only take asymmetric ones: `none` and
  the HMAC family are refused before any key is looked at (an HMAC token "signed" with the
  issuer's public key is the classic forgery), and a key that states its own `alg` must be used
  with that one; `iss`, `aud` and `exp` required and checked, `nbf` and `iat` checked when
  present, with `LEEWAY_S` of clock skew. Each refusal is 401 `unauthorized` with its reason.
- **Who.** The tenant is the `--oidc-tenant-claim` claim (default `sub`; `email` and
  `preferred_username` are common), a non-empty string. The principal's name is `oidc:<tenant>`,
  so that a signed-in user never shares a name, and with it jobs, with a static token. Groups
  come from the `--oidc-groups-claim` claim (a list of strings, or one string).

Verification runs on the event loop: a signature check costs about 0.1 ms here (75 µs RS256,
120 µs ES256, measured on a 2-core Xeon), and a token is bounded by the request's header limit.
A token that verified is kept (by its SHA-256, `VERIFIED_KEPT` of them, the oldest going first)
for `VERIFIED_S` seconds at most and never past its `exp`: a client that sends the same JWT with
every request pays the check once a minute, and a key the issuer withdraws stops its tokens
within a minute.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx
import jwt

log = logging.getLogger("streamgate.signin")

NAME_PREFIX = "oidc:"
REFETCH_S = 10.0  # the least time between two fetches of the key set that a token asked for
LEEWAY_S = 30.0  # clock skew allowed on exp, nbf and iat
MAX_JWKS_BYTES = 1 << 20
FETCH_TIMEOUT_S = 5.0
# What a key set may sign with: asymmetric algorithms only (PyJWT's names).
ASYMMETRIC = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES256K", "ES384", "ES512", "EdDSA"})
DEFAULT_ALGORITHMS = ("RS256", "PS256", "ES256", "EdDSA")
VERIFIED_KEPT = 10_000  # tokens that verified, kept to skip their check when they come again
VERIFIED_S = 60.0  # how long one is kept at most (and never past its exp)


class SignInError(Exception):
    """Why a token is refused (the 401's message)."""


class IssuerConfigError(ValueError):
    """The OIDC settings cannot be used; the message names the setting."""


@dataclass(frozen=True)
class Identity:
    """Who a verified token says the caller is."""

    name: str  # `oidc:<tenant claim>`
    groups: frozenset[str]
    expires: float  # the token's `exp`


class Issuer:
    """One OpenID Connect issuer's keys and the checks of its tokens (see the module docstring)."""

    def __init__(
        self,
        issuer: str,
        audience: str | None,
        *,
        jwks_url: str | None = None,
        tenant_claim: str = "sub",
        groups_claim: str = "groups",
        algorithms: Iterable[str] = DEFAULT_ALGORITHMS,
        refresh_s: float = 300.0,
    ) -> None:
        if not audience:
            raise IssuerConfigError("--oidc-issuer needs --oidc-audience: the aud a token must name (this gateway's client id)")
        if not issuer.startswith(("https://", "http://")):
            raise IssuerConfigError(f"--oidc-issuer {issuer!r}: an http(s) URL")
        self.algorithms = frozenset(algorithms)
        if not self.algorithms or not self.algorithms <= ASYMMETRIC:
            raise IssuerConfigError(
                f"--oidc-algorithms: only asymmetric algorithms are accepted ({', '.join(sorted(ASYMMETRIC))}); "
                f"not {', '.join(sorted(self.algorithms - ASYMMETRIC)) or 'none'}"
            )
        self.issuer = issuer
        self.audience = audience
        self.jwks_url = jwks_url
        self.tenant_claim = tenant_claim
        self.groups_claim = groups_claim
        self.refresh_s = refresh_s
        self.keys: dict[str | None, _Key] = {}
        self.fetched_at = -float("inf")  # monotonic time of the last fetch that was tried
        self.asked_at = -float("inf")  # of the last one a token naming an unknown key asked for
        self.problem: str | None = "the issuer's keys were not fetched yet"
        self._lock = asyncio.Lock()
        self._http = httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=False)
        # SHA-256 of a token that verified -> (who it is, when the entry lapses: wall clock), oldest first.
        self._verified: dict[bytes, tuple[Identity, float]] = {}

    async def start(self) -> None:
        await self._fetch()

    async def stop(self) -> None:
        await self._http.aclose()

    async def verify(self, token: str) -> Identity:
        """The identity `token` proves; `SignInError` saying why not."""
        digest = hashlib.sha256(token.encode()).digest()
        kept = self._verified.get(digest)
        now = time.time()
        if kept is not None:
            if now < kept[1]:
                return kept[0]
            del self._verified[digest]
        identity = await self._verify(token)
        if len(self._verified) >= VERIFIED_KEPT:
            del self._verified[next(iter(self._verified))]
        self._verified[digest] = (identity, min(now + VERIFIED_S, identity.expires))
        return identity

    async def _verify(self, token: str) -> Identity:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:
            raise SignInError("not a token of this gateway, nor a JWT") from None
        alg = header.get("alg")
        if alg not in self.algorithms:
            raise SignInError(f"a JWT signed with {alg!r} is not accepted (accepted: {', '.join(sorted(self.algorithms))})")
        key = await self._key(header.get("kid"))
        if key.alg is not None and key.alg != alg:
            raise SignInError(f"the key {key.jwk.key_id!r} signs with {key.alg}, not {alg}")
        try:
            claims = jwt.decode(
                token, key.jwk.key, algorithms=[alg], audience=self.audience, issuer=self.issuer, leeway=LEEWAY_S,
                options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.ExpiredSignatureError:
            raise SignInError("the JWT expired") from None
        except jwt.ImmatureSignatureError:
            raise SignInError("the JWT is not valid yet (nbf or iat in the future)") from None
        except jwt.InvalidAudienceError:
            raise SignInError(f"the JWT is not for this gateway (aud must be {self.audience!r})") from None
        except jwt.InvalidIssuerError:
            raise SignInError(f"the JWT is from another issuer (iss must be {self.issuer!r})") from None
        except jwt.InvalidSignatureError:
            raise SignInError("the JWT's signature does not verify") from None
        except jwt.MissingRequiredClaimError as exc:
            raise SignInError(f"the JWT has no {exc.claim} claim") from None
        except jwt.PyJWTError as exc:  # a malformed token, or a key of another type than its alg's
            raise SignInError(f"invalid JWT: {exc}") from None
        tenant = claims.get(self.tenant_claim)
        if not isinstance(tenant, str) or not tenant:
            raise SignInError(f"the JWT has no {self.tenant_claim} claim naming its user")
        return Identity(NAME_PREFIX + tenant, _groups(claims.get(self.groups_claim)), float(claims["exp"]))

    async def _key(self, kid: Any) -> _Key:
        if not isinstance(kid, str | None):
            raise SignInError("the JWT's kid is not a string")
        if time.monotonic() - self.fetched_at > self.refresh_s:
            await self._fetch()
        if self._lookup(kid) is None:
            await self._fetch(asked=True)
        key = self._lookup(kid)
        if key is None:
            if self.problem is not None:
                raise SignInError(f"the issuer's keys are unavailable: {self.problem}")
            raise SignInError(f"the JWT names a key the issuer does not publish ({kid!r})")
        return key

    def _lookup(self, kid: str | None) -> _Key | None:
        if kid is not None:
            return self.keys.get(kid)
        # No kid: only a set of one key says which.
        return next(iter(self.keys.values())) if len(self.keys) == 1 else None

    async def _fetch(self, asked: bool = False) -> None:
        """Fetch the key set; `asked`: for a token naming a key it lacks, at most every `REFETCH_S`."""
        async with self._lock:  # one fetch for every request that asked at once
            now = time.monotonic()
            if asked:
                if now - self.asked_at < REFETCH_S:
                    return
                self.asked_at = now
            elif now - self.fetched_at < self.refresh_s and self.fetched_at > -float("inf") and self.problem is None:
                return  # fetched meanwhile by another request
            self.fetched_at = now
            try:
                url = self.jwks_url or (await self._get(self.issuer.rstrip("/") + "/.well-known/openid-configuration", discovery=True))
                keys = _keys(await self._get(url), self.algorithms)
            except (httpx.HTTPError, ValueError) as exc:
                self.problem = f"{type(exc).__name__}: {exc}"
                log.warning("OIDC issuer %s: its keys could not be fetched: %s", self.issuer, self.problem)
                return
            self.keys = keys
            self.problem = None

    async def _get(self, url: str, discovery: bool = False) -> Any:
        async with self._http.stream("GET", url, headers={"Accept": "application/json"}) as response:
            if response.status_code != 200:
                raise ValueError(f"GET {url} answered {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_JWKS_BYTES:
                    raise ValueError(f"GET {url}: over {MAX_JWKS_BYTES} bytes")
        data = json.loads(body)
        if not isinstance(data, dict):
            raise ValueError(f"GET {url}: not a JSON object")
        if not discovery:
            return data
        if data.get("issuer") != self.issuer:
            raise ValueError(f"the discovery document names the issuer {data.get('issuer')!r}, not {self.issuer!r}")
        if not isinstance(data.get("jwks_uri"), str):
            raise ValueError("the discovery document has no jwks_uri")
        return data["jwks_uri"]


@dataclass(frozen=True)
class _Key:
    jwk: jwt.PyJWK
    alg: str | None  # the algorithm the key states it is for, if it does


def _keys(jwks: dict[str, Any], algorithms: frozenset[str]) -> dict[str | None, _Key]:
    """A JWKS's signing keys usable with `algorithms`, by key id; a key of a type this cannot use
    (an encryption key, a symmetric one) is left out, not the whole set."""
    found: dict[str | None, _Key] = {}
    entries = jwks.get("keys")
    if not isinstance(entries, list):
        raise ValueError("the JWKS has no keys list")
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("use", "sig") != "sig" or entry.get("kty") == "oct":
            continue
        stated = entry.get("alg")
        if stated is not None and stated not in algorithms:
            continue
        try:
            found[entry.get("kid")] = _Key(jwt.PyJWK(entry), stated)
        except jwt.PyJWTError as exc:
            log.info("a key of the JWKS is left out: %s", exc)
    if not found:
        raise ValueError("the JWKS has no signing key for the accepted algorithms")
    return found


def _groups(value: Any) -> frozenset[str]:
    if isinstance(value, str):
        return frozenset([value])
    if isinstance(value, list):
        return frozenset(v for v in value if isinstance(v, str))
    return frozenset()
