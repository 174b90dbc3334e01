"""Sign-in with an OpenID Connect issuer: a real issuer served by the test on loopback (its discovery
document and JWKS, keys made here and rotated mid-test), tokens signed with PyJWT, a real gateway
verifying them. Hostile tokens (forged, expired, foreign, of the wrong audience) are refused with
401 and their reason; static tokens keep working beside them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from gateway.cli import commands as cli
from gateway.server.signin import REFETCH_S
from tests.conftest import run_stream
from tests.support.oidc_issuer import AUDIENCE, LocalIssuer
from tests.support.user_tools import echo

STATIC = "static-token-0123456789abcdef"
PREDICT = {"prompt": "x", "top_k": 2}


@pytest.fixture
def issuer() -> Any:
    local = LocalIssuer()
    local.add_key("k1")
    yield local
    local.stop()


@pytest.fixture
def gateway(serve: Any, issuer: LocalIssuer) -> Any:
    return serve(tools=[echo], tokens=[f"ops={STATIC}"], oidc_issuer=issuer.url, oidc_audience=AUDIENCE)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def refusal(gateway: Any, token: str) -> str:
    refused = run_stream(gateway.url, "predict", PREDICT, headers=bearer(token))
    assert refused.status == 401, refused.body
    assert refused.headers["www-authenticate"] == 'Bearer realm="streamgate"'
    assert refused.body["error"]["code"] == "unauthorized"
    return refused.body["error"]["message"]


def test_a_user_signed_in_by_the_issuer_runs_jobs_that_are_theirs_alone(gateway: Any, issuer: LocalIssuer) -> None:
    alice, bob = issuer.token("k1", sub="alice"), issuer.token("k1", sub="bob")
    ran = run_stream(gateway.url, "predict", PREDICT, headers=bearer(alice))
    assert ran.status == 200 and ran.terminal["event"] == "data"
    job = ran.headers["x-job-id"]
    snapshot = httpx.get(f"{gateway.url}/jobs/{job}", headers=bearer(alice)).json()
    assert snapshot["owner"] == "oidc:alice"
    # Another user, and a static token of the same name, are other principals: the job is not theirs.
    assert httpx.get(f"{gateway.url}/jobs/{job}", headers=bearer(bob)).status_code == 404
    assert httpx.get(f"{gateway.url}/jobs/{job}", headers=bearer(STATIC)).status_code == 404
    # The static token works beside the issuer's users.
    assert run_stream(gateway.url, "predict", PREDICT, headers=bearer(STATIC)).terminal["event"] == "data"


def test_forged_expired_foreign_and_misaddressed_tokens_are_refused_with_their_reason(gateway: Any, issuer: LocalIssuer) -> None:
    public_pem = issuer.keys["k1"].public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    unsigned = jwt.encode({"iss": issuer.url, "aud": AUDIENCE, "sub": "mallory", "exp": int(time.time()) + 300}, None, algorithm="none")
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cases = [
        (unsigned, "'none' is not accepted"),
        # The classic forgery: HMAC keyed with the issuer's public key, which anyone can read.
        (_hmac_token(issuer, public_pem), "'HS256' is not accepted"),
        (issuer.token("k1", exp=int(time.time()) - 600), "expired"),
        (issuer.token("k1", iss="https://issuer.elsewhere.example"), "from another issuer"),
        (issuer.token("k1", aud="another-service"), "not for this gateway"),
        (issuer.token("k1", nbf=int(time.time()) + 600), "not valid yet"),
        (issuer.token("k1", key=stranger), "signature does not verify"),
        (issuer.token("k1", exp=None), "no exp claim"),
        (issuer.token("k1", sub=None), "no sub claim"),
        (issuer.token("nobody-knows-me", key=stranger, alg="RS256"), "a key the issuer does not publish"),
        ("not-a-jwt-nor-a-token", "nor a JWT"),
    ]
    for token, why in cases:
        assert why in refusal(gateway, token), why


def _hmac_token(issuer: LocalIssuer, secret: bytes) -> str:
    # PyJWT refuses to HMAC with a PEM key, as a verifier must; the forger writes the token by hand.
    import base64
    import hashlib
    import hmac

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    header = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "k1"}).encode())
    body = b64(json.dumps({"iss": issuer.url, "aud": AUDIENCE, "sub": "mallory", "exp": int(time.time()) + 300}).encode())
    signature = b64(hmac.new(secret, f"{header}.{body}".encode(), hashlib.sha256).digest())
    return f"{header}.{body}.{signature}"


def test_keys_rotated_by_the_issuer_are_fetched_again_and_made_up_key_ids_cannot_flood_it(gateway: Any, issuer: LocalIssuer) -> None:
    assert run_stream(gateway.url, "predict", PREDICT, headers=bearer(issuer.token("k1"))).status == 200
    fetched = issuer.jwks_fetches
    # The issuer rotates: a new key (an EC one) is published and the old one withdrawn.
    issuer.add_key("k2", "ec")
    new_token = issuer.token("k2", sub="carol")
    del issuer.keys["k1"]
    ran = run_stream(gateway.url, "predict", PREDICT, headers=bearer(new_token))
    assert ran.status == 200 and ran.terminal["event"] == "data"
    assert issuer.jwks_fetches == fetched + 1
    # Tokens naming key ids nobody published: refused, and the issuer asked at most once more in REFETCH_S.
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    started = time.monotonic()
    for i in range(20):
        assert "does not publish" in refusal(gateway, issuer.token(f"made-up-{i}", key=stranger, alg="RS256"))
    assert time.monotonic() - started < REFETCH_S, "the run must stay within one refetch interval for this bound"
    assert issuer.jwks_fetches <= fetched + 2


def test_a_signed_in_user_gets_tickets_for_get_streams(gateway: Any, issuer: LocalIssuer) -> None:
    alice = issuer.token("k1", sub="alice", groups=["lab-a", "students"])
    answer = httpx.post(f"{gateway.url}/auth/ticket", headers=bearer(alice))
    assert answer.status_code == 200
    ticket = answer.json()["ticket"]
    stream = run_stream(gateway.url, "echo", method="GET", query={"text": "hi", "ticket": ticket})
    assert stream.status == 200 and stream.terminal["event"] == "data"
    assert httpx.get(f"{gateway.url}/jobs/{stream.headers['x-job-id']}", headers=bearer(alice)).json()["owner"] == "oidc:alice"
    # A ticket names its user: a forged name is refused.
    name, expiry, signature = ticket.split(".")
    forged = f"{jwt.utils.base64url_encode(b'oidc:bob').decode()}.{expiry}.{signature}"
    refused = run_stream(gateway.url, "echo", method="GET", query={"text": "hi", "ticket": forged})
    assert refused.status == 401


def test_the_tenant_is_the_configured_claim(serve: Any, issuer: LocalIssuer) -> None:
    gateway = serve(tools=[echo], oidc_issuer=issuer.url, oidc_audience=AUDIENCE, oidc_tenant_claim="email")
    token = issuer.token("k1", sub="a1b2c3", email="dana@lab.example")
    ran = run_stream(gateway.url, "predict", PREDICT, headers=bearer(token))
    assert ran.status == 200
    assert httpx.get(f"{gateway.url}/jobs/{ran.headers['x-job-id']}", headers=bearer(token)).json()["owner"] == "oidc:dana@lab.example"
    assert "no email claim" in refusal(gateway, issuer.token("k1", sub="a1b2c3"))


def test_oidc_settings_errors_are_one_line_naming_the_setting(tmp_path: Path, tiny_model_path: Path) -> None:
    runner = CliRunner()
    for flags, why in [
        (["--oidc-issuer", "https://issuer.example"], "--oidc-issuer needs --oidc-audience"),
        (["--oidc-issuer", "https://issuer.example", "--oidc-audience", "x", "--oidc-algorithms", "RS256,HS256"], "only asymmetric"),
        (["--oidc-audience", "x"], "need --oidc-issuer"),
    ]:
        result = runner.invoke(cli.main, ["serve", "--model", str(tiny_model_path), "--dry-run", *flags])
        assert result.exit_code != 0, flags
        assert why in result.output, result.output


async def test_a_verified_token_is_checked_again_once_a_minute_and_never_past_its_exp(issuer: LocalIssuer, monkeypatch: Any) -> None:
    from gateway.server import signin

    verifier = signin.Issuer(issuer.url, AUDIENCE)
    await verifier.start()
    checks: list[str] = []
    real = signin.jwt.decode
    monkeypatch.setattr(signin.jwt, "decode", lambda token, *a, **k: checks.append(token) or real(token, *a, **k))
    token, soon = issuer.token("k1", sub="dana"), issuer.token("k1", sub="erin", exp=int(time.time()) + 5)
    assert [(await verifier.verify(t)).name for t in (token, token, soon, soon)] == ["oidc:dana"] * 2 + ["oidc:erin"] * 2
    assert checks == [token, soon]  # each checked once
    now = time.time()
    # The kept entries' clock (PyJWT's own checks read the real one): past the second's exp, within the minute.
    monkeypatch.setattr(signin.time, "time", lambda: now + 10)
    await verifier.verify(token)
    await verifier.verify(soon)
    assert checks == [token, soon, soon]  # the second checked again: its entry lapsed with its exp
    monkeypatch.setattr(signin.time, "time", lambda: now + signin.VERIFIED_S + 1)
    await verifier.verify(token)
    assert checks == [token, soon, soon, token]  # a minute on: checked again
    await verifier.stop()
