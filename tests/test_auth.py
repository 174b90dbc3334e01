"""Client access: bearer tokens, tickets for GET streams, per-token limits, CORS, and the
warning for a gateway open to the network without tokens. Real servers on loopback."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from gateway.cli import commands as cli
from gateway.server.auth import Auth, AuthConfigError, Principal, load_principals
from tests.conftest import run_stream, wait_until
from tests.support.user_tools import echo

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef00"
PREDICT = {"prompt": "x", "top_k": 2}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def error_of(response: httpx.Response | Any) -> dict[str, Any]:
    return response.json()["error"] if isinstance(response, httpx.Response) else response.body["error"]


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(
        f"""
[tokens.alice]
token = "{ALICE}"

[tokens.bob]
token = "{BOB}"
tools = ["predict", "echo"]
max_concurrent = 1
jobs_per_minute = 3
"""
    )
    return path


@pytest.fixture
def gateway(serve: Any, tokens_file: Path) -> Any:
    return serve(tools=[echo], tokens_file=str(tokens_file))


def test_without_tokens_there_is_no_auth(serve: Any) -> None:
    server = serve()
    assert run_stream(server.url, "predict", PREDICT).terminal["event"] == "data"
    assert httpx.post(f"{server.url}/auth/ticket").status_code == 404


def test_runs_need_a_valid_bearer_token(gateway: Any) -> None:
    for headers, why in [
        ({}, "needs `Authorization: Bearer"),
        (bearer("not-a-token-of-this-gateway"), "unknown token"),
        ({"Authorization": f"Basic {ALICE}"}, "expected `Authorization: Bearer"),
        ({"Authorization": "Bearer"}, "expected `Authorization: Bearer"),
    ]:
        refused = run_stream(gateway.url, "predict", PREDICT, headers=headers)
        assert refused.status == 401, headers
        assert refused.headers["www-authenticate"] == 'Bearer realm="streamgate"'
        assert error_of(refused)["code"] == "unauthorized"
        assert why in error_of(refused)["message"]
    ok = run_stream(gateway.url, "predict", PREDICT, headers=bearer(ALICE))
    assert ok.status == 200 and ok.terminal["event"] == "data"
    # The job routes too; probes, the tool list and the dashboard stay open.
    job = ok.headers["x-job-id"]
    for method, path in [("GET", f"/jobs/{job}"), ("GET", f"/jobs/{job}/events"), ("DELETE", f"/jobs/{job}")]:
        assert httpx.request(method, gateway.url + path).status_code == 401, path
        assert httpx.request(method, gateway.url + path, headers=bearer(ALICE)).status_code in (200, 204), path
    for path in ["/healthz", "/readyz", "/tools", "/"]:
        assert httpx.get(gateway.url + path).status_code == 200, path


def test_a_token_limited_to_some_tools_gets_403_for_the_others(gateway: Any) -> None:
    refused = run_stream(gateway.url, "generate", {"prompts": ["x"]}, headers=bearer(BOB))
    assert refused.status == 403
    assert error_of(refused)["code"] == "forbidden"
    assert "'generate'" in error_of(refused)["message"]
    assert run_stream(gateway.url, "predict", PREDICT, headers=bearer(BOB)).status == 200
    assert run_stream(gateway.url, "generate", {"prompts": ["x"], "max_tokens": 2}, headers=bearer(ALICE)).status == 200


def test_a_long_lived_token_in_the_url_is_refused(gateway: Any) -> None:
    for key in ("token", "access_token", "api_key"):
        refused = httpx.get(f"{gateway.url}/predict/run", params={"prompt": "x", key: ALICE}, headers=bearer(ALICE))
        assert refused.status_code == 401
        assert f"({key}=)" in error_of(refused)["message"]


def test_get_streams_take_a_short_lived_ticket(gateway: Any) -> None:
    assert httpx.post(f"{gateway.url}/auth/ticket").status_code == 401
    answer = httpx.post(f"{gateway.url}/auth/ticket", headers=bearer(ALICE))
    assert answer.status_code == 200
    assert answer.headers["cache-control"] == "no-store"
    ticket, ttl = answer.json()["ticket"], answer.json()["expires_in"]
    assert 0 < ttl <= 60
    assert ALICE not in ticket
    stream = run_stream(gateway.url, "predict", method="GET", query={"prompt": "x", "top_k": 2, "ticket": ticket})
    assert stream.status == 200 and stream.terminal["event"] == "data"
    job = stream.headers["x-job-id"]
    replay = httpx.get(f"{gateway.url}/jobs/{job}/events", params={"ticket": ticket})
    assert replay.status_code == 200 and "event: data" in replay.text
    assert httpx.get(f"{gateway.url}/jobs/{job}", params={"ticket": ticket}).status_code == 200
    # Only for GET: a POST must carry the token itself.
    refused = httpx.post(f"{gateway.url}/predict/run", params={"ticket": ticket}, json=PREDICT)
    assert refused.status_code == 401
    assert "only for GET" in error_of(refused)["message"]
    # Tampered, expired, or of a token the gateway no longer has: refused.
    auth: Auth = gateway.app.state.auth
    name, expiry, signature = ticket.split(".")
    expired, _ = auth.issue_ticket(auth.principals["alice"], now=time.time() - 61)
    forged = Auth([Principal("alice", "another-token-0123456789")]).issue_ticket(Principal("alice", "another-token-0123456789"))[0]
    for bad, why in [
        (f"{name}.{int(expiry) + 3600}.{signature}", "invalid ticket"),
        (f"{name}.{expiry}.{signature[:-2]}AA", "invalid ticket"),
        (expired, "expired"),
        (forged, "invalid ticket"),
        ("garbage", "malformed"),
    ]:
        refused = httpx.get(f"{gateway.url}/predict/run", params={"prompt": "x", "ticket": bad})
        assert refused.status_code == 401, bad
        assert why in error_of(refused)["message"], (bad, error_of(refused))


def test_a_ticket_dies_with_its_token(serve: Any, tmp_path: Path) -> None:
    first = serve(tokens=[f"carol={ALICE}"])
    ticket = httpx.post(f"{first.url}/auth/ticket", headers=bearer(ALICE)).json()["ticket"]
    # A replica (or a restart) whose carol has a new token refuses carol's old tickets.
    second = serve(tokens=[f"carol={BOB}"])
    assert httpx.get(f"{first.url}/predict/run", params={"prompt": "x", "ticket": ticket}).status_code == 200
    refused = httpx.get(f"{second.url}/predict/run", params={"prompt": "x", "ticket": ticket})
    assert refused.status_code == 401


def test_per_token_concurrency_limit(gateway: Any) -> None:
    slow = {"text": "a", "repeat": 40, "delay": 0.05}
    outcome: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: outcome.update(first=run_stream(gateway.url, "echo", slow, headers=bearer(BOB))))
    thread.start()
    wait_until(lambda: gateway.backend.describe()["running"] == 1, 20, "bob's first job to run")
    refused = run_stream(gateway.url, "predict", PREDICT, headers=bearer(BOB))
    assert refused.status == 429
    assert error_of(refused)["code"] == "rate_limited"
    assert refused.headers["retry-after"] == "1"
    assert "1 jobs at once" in error_of(refused)["message"]
    # Another token is not held back by bob's.
    assert run_stream(gateway.url, "predict", PREDICT, headers=bearer(ALICE)).status == 200
    thread.join(30)
    assert outcome["first"].terminal["event"] == "data"
    assert run_stream(gateway.url, "predict", PREDICT, headers=bearer(BOB)).status == 200


def test_per_token_jobs_per_minute(gateway: Any) -> None:
    for _ in range(3):
        assert run_stream(gateway.url, "predict", PREDICT, headers=bearer(BOB)).status == 200
    refused = run_stream(gateway.url, "predict", PREDICT, headers=bearer(BOB))
    assert refused.status == 429
    assert error_of(refused)["code"] == "rate_limited"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert error_of(refused)["retryable"] is True
    # A refused request does not count, and alice has no such limit.
    for _ in range(5):
        assert run_stream(gateway.url, "predict", PREDICT, headers=bearer(ALICE)).status == 200


def test_idempotency_keys_are_per_token(gateway: Any) -> None:
    key = {"Idempotency-Key": "same-key"}
    first = run_stream(gateway.url, "predict", PREDICT, headers={**bearer(ALICE), **key})
    again = run_stream(gateway.url, "predict", PREDICT, headers={**bearer(ALICE), **key})
    other = run_stream(gateway.url, "predict", PREDICT, headers={**bearer(BOB), **key})
    assert again.headers["x-job-id"] == first.headers["x-job-id"]
    assert other.headers["x-job-id"] != first.headers["x-job-id"]


def test_cors_only_for_listed_origins(serve: Any) -> None:
    preflight = {"Origin": "https://ok.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    closed = serve()
    answer = httpx.options(f"{closed.url}/predict/run", headers=preflight)
    assert "access-control-allow-origin" not in answer.headers
    opened = serve(cors_origins=["https://ok.example"])
    answer = httpx.options(f"{opened.url}/predict/run", headers=preflight)
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == "https://ok.example"
    assert "authorization" in answer.headers["access-control-allow-headers"].lower()
    refused = httpx.options(f"{opened.url}/predict/run", headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in refused.headers
    # A browser's MCP client: its preflight names the MCP headers it sends.
    mcp = {**preflight, "Access-Control-Request-Headers": "content-type,mcp-protocol-version,mcp-session-id,mcp-method,mcp-name"}
    answer = httpx.options(f"{opened.url}/mcp", headers=mcp)
    assert answer.status_code == 200, answer.text
    assert {"mcp-protocol-version", "mcp-session-id", "mcp-method", "mcp-name"} <= {
        h.strip().lower() for h in answer.headers["access-control-allow-headers"].split(",")
    }
    stream = run_stream(opened.url, "predict", PREDICT, headers={"Origin": "https://ok.example"})
    assert stream.headers["access-control-allow-origin"] == "https://ok.example"
    assert "x-job-id" in stream.headers["access-control-expose-headers"].lower()


def test_tokens_config_errors_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    for text, message in [
        ("[tokens.a]\ntools = ['x']\n", "needs token"),
        ("[tokens.a]\ntoken = 'short'\n", "at least 16 characters"),
        (f"[tokens.a]\ntoken = '{ALICE}'\nlimit = 3\n", "unknown keys ['limit']"),
        (f"[tokens.a]\ntoken = '{ALICE}'\nmax_concurrent = 0\n", "max_concurrent must be an integer >= 1"),
        ("[tokens.a\n", "--tokens-file"),
    ]:
        bad.write_text(text)
        with pytest.raises(AuthConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_principals(str(bad))
    with pytest.raises(AuthConfigError, match="unique"):
        load_principals(None, [f"a={ALICE}", f"a={BOB}"])
    assert [p.name for p in load_principals(None, [ALICE, f"ci={BOB}"])] == ["token-1", "ci"]


def test_serve_warns_loudly_without_auth_beyond_loopback(monkeypatch: pytest.MonkeyPatch, tiny_model_path: Path,
                                                         caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    runner = CliRunner()
    for host, tokens, warned in [("0.0.0.0", [], True), ("127.0.0.1", [], False), ("::1", [], False),
                                 ("0.0.0.0", ["--tokens", f"ops={ALICE}"], False)]:
        caplog.clear()
        result = runner.invoke(cli.main, ["serve", "--host", host, "--model", str(tiny_model_path), "--device", "cpu", *tokens])
        assert result.exit_code == 0, result.output
        assert any("WITHOUT AUTH" in r.getMessage() for r in caplog.records) == warned, (host, tokens)
    bad = tmp_path / "t.toml"
    bad.write_text("[tokens.a]\ntoken = 'short'\n")
    result = runner.invoke(cli.main, ["serve", "--model", str(tiny_model_path), "--tokens-file", str(bad)])
    assert result.exit_code == 1
    assert "at least 16 characters" in result.output


def test_the_limits_keep_only_the_names_that_run_or_started_a_job_within_a_minute() -> None:
    """Signed-in users come and go by the thousand: each one's counters go once it runs nothing and
    its last start is a minute old, while the limits still hold for those that are counted."""
    from gateway.errors import ApiError
    from gateway.server.auth import Limits, Principal

    now = [0.0]
    limits = Limits(clock=lambda: now[0])
    for i in range(1000):
        limits.admit(Principal(f"user-{i}", "x" * 16, jobs_per_minute=5, max_concurrent=2))()
        now[0] += 0.5
    assert len(limits.started) == 120 and not limits.running  # the last minute's 120 names, nothing running
    busy = Principal("busy", "y" * 16, jobs_per_minute=2, max_concurrent=5)
    releases = [limits.admit(busy), limits.admit(busy)]
    with pytest.raises(ApiError) as refused:
        limits.admit(busy)
    assert "2 jobs a minute" in refused.value.message
    now[0] += 61
    limits.admit(Principal("another", "z" * 16))()
    assert list(limits.started) == ["another"] and limits.running == {"busy": 2}
    for release in releases:
        release()
    assert not limits.running
