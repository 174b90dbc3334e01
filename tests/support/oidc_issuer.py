"""An OpenID Connect issuer on loopback for the sign-in tests and benchmarks: its discovery document
and JWKS served by a thread, keys made here (and rotated by the test), tokens signed with PyJWT."""

from __future__ import annotations

import json
import time
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from tests.support import loopback_http

AUDIENCE = "streamgate-lab"


class LocalIssuer:
    """An OpenID Connect issuer on loopback: its discovery document, its JWKS (keys added and
    removed as a rotation does), how often the JWKS was fetched, and tokens signed with its keys."""

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}  # kid -> private key, the published set
        self.jwks_fetches = 0
        issuer = self

        class Handler(loopback_http.Handler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path == "/.well-known/openid-configuration":
                    body = {"issuer": issuer.url, "jwks_uri": f"{issuer.url}/jwks.json"}
                elif self.path == "/jwks.json":
                    issuer.jwks_fetches += 1
                    body = {"keys": [issuer.public_jwk(kid) for kid in list(issuer.keys)]}
                else:
                    self.send_error(404)
                    return
                self.answer(json.dumps(body).encode(), "application/json")

        self.server, self.url = loopback_http.serve(Handler)

    def add_key(self, kid: str, kind: str = "rsa") -> None:
        self.keys[kid] = rsa.generate_private_key(public_exponent=65537, key_size=2048) if kind == "rsa" else ec.generate_private_key(ec.SECP256R1())

    def public_jwk(self, kid: str) -> dict[str, Any]:
        key = self.keys[kid]
        algorithm = jwt.algorithms.RSAAlgorithm if isinstance(key, rsa.RSAPrivateKey) else jwt.algorithms.ECAlgorithm
        jwk = json.loads(algorithm.to_jwk(key.public_key()))
        return {**jwk, "kid": kid, "use": "sig", "alg": "RS256" if isinstance(key, rsa.RSAPrivateKey) else "ES256"}

    def token(self, kid: str, *, alg: str | None = None, key: Any = None, **claims: Any) -> str:
        now = int(time.time())
        body = {"iss": self.url, "aud": AUDIENCE, "sub": "alice", "iat": now, "exp": now + 300, **claims}
        body = {k: v for k, v in body.items() if v is not None}
        private = self.keys.get(kid)
        alg = alg or ("RS256" if isinstance(private, rsa.RSAPrivateKey) else "ES256")
        return jwt.encode(body, key if key is not None else private, algorithm=alg, headers={"kid": kid})

    def stop(self) -> None:
        self.server.shutdown()
