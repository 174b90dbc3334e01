"""Classes of users (`[classes.<name>]` in the tokens file): what a token or a signed-in user's groups
put them in, what the class allows and limits, and `GET /me` saying it. Real gateways on loopback,
a real OIDC issuer (tests/test_signin.py's) for the groups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server.auth import AuthConfigError, load_access
from tests.conftest import run_stream, wait_until
from tests.support.user_tools import echo
from tests.support.oidc_issuer import AUDIENCE, LocalIssuer

STAFF = "staff-token-0123456789abcdef"
STUDENT = "student-token-0123456789abcd"
GUEST = "guest-token-0123456789abcdef"
TIGHT = "tight-token-0123456789abcdef"
HASTY = "hasty-token-0123456789abcdef"
CROWD_A = "crowd-a-token-0123456789abcd"
CROWD_B = "crowd-b-token-0123456789abcd"
PREDICT = {"prompt": "x", "top_k": 2}

TOKENS = f"""
[classes.staff]
priority = 10
weight = 2
max_concurrent = 8
jobs_per_minute = 120
groups = ["lab-staff"]

[classes.students]
tools = ["predict", "echo"]
max_concurrent = 1
default = true

[classes.nowhere]
models = ["a-model-not-served"]

[classes.frugal]
max_job_memory = "1KiB"

[classes.hasty]
job_timeout = 0.5

[classes.crowd]
max_queued = 2

[tokens.crowd-a]
token = "{CROWD_A}"
class = "crowd"

[tokens.crowd-b]
token = "{CROWD_B}"
class = "crowd"

[tokens.ci]
token = "{STAFF}"
class = "staff"

[tokens.stu]
token = "{STUDENT}"

[tokens.tight]
token = "{TIGHT}"
class = "frugal"

[tokens.hasty]
token = "{HASTY}"
class = "hasty"

[tokens.guest]
token = "{GUEST}"
class = "nowhere"
tools = ["echo"]
weight = 3
"""


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS)
    return path


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def me(url: str, token: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}/me", headers=bearer(token))
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_token_takes_its_class_and_its_own_keys_win(serve: Any, tokens_file: Path) -> None:
    gateway = serve(tools=[echo], tokens_file=str(tokens_file), jobs_per_minute_per_token=30)
    staff = me(gateway.url, STAFF)
    assert (staff["name"], staff["class"], staff["priority"], staff["weight"]) == ("ci", "staff", 10, 2.0)
    assert staff["tools"] is None and staff["models"] is None
    assert staff["usage"] == {"max_concurrent": 8, "jobs_per_minute": 120, "running": 0, "started_last_minute": 0, "max_job_memory": None, "job_timeout": None}
    assert me(gateway.url, TIGHT)["usage"]["max_job_memory"] == 1024
    assert me(gateway.url, HASTY)["usage"]["job_timeout"] == 0.5
    # No class named: the default class; what it leaves unset, the gateway's defaults.
    student = me(gateway.url, STUDENT)
    assert (student["class"], student["priority"], student["weight"], student["tools"]) == ("students", 0, 1.0, ["echo", "predict"])
    assert student["usage"]["max_concurrent"] == 1 and student["usage"]["jobs_per_minute"] == 30
    guest = me(gateway.url, GUEST)
    assert (guest["class"], guest["weight"], guest["tools"], guest["models"]) == ("nowhere", 3.0, ["echo"], ["a-model-not-served"])
    # What is in use shows up.
    assert run_stream(gateway.url, "predict", PREDICT, headers=bearer(STUDENT)).terminal["event"] == "data"
    assert me(gateway.url, STUDENT)["usage"]["started_last_minute"] == 1
    assert httpx.get(f"{gateway.url}/me").status_code == 401


def test_what_a_class_does_not_allow_is_refused_with_403_naming_it(serve: Any, tokens_file: Path) -> None:
    gateway = serve(tools=[echo], tokens_file=str(tokens_file))
    refused = run_stream(gateway.url, "embed", {"texts": ["x"]}, headers=bearer(STUDENT))
    assert refused.status == 403 and "its class 'students'" in refused.body["error"]["message"]
    on_model = run_stream(gateway.url, "echo", {"text": "hi"}, headers=bearer(GUEST))
    assert on_model.status == 403 and "may not run jobs on the model" in on_model.body["error"]["message"]
    assert run_stream(gateway.url, "embed", {"texts": ["x"]}, headers=bearer(STAFF)).terminal["event"] == "data"


def test_a_job_priced_over_its_class_memory_is_refused_with_413(serve: Any, tokens_file: Path) -> None:
    gateway = serve(tools=[echo], tokens_file=str(tokens_file))
    refused = run_stream(gateway.url, "embed", {"texts": ["x"]}, headers=bearer(TIGHT))
    assert refused.status == 413, refused.body
    error = refused.body["error"]
    assert error["code"] == "too_large" and "max_job_memory of this token's class" in error["message"] and error["field"] == "texts"
    assert run_stream(gateway.url, "embed", {"texts": ["x"]}, headers=bearer(STAFF)).terminal["event"] == "data"


def test_a_job_past_its_class_time_limit_ends_with_timeout(serve: Any, tokens_file: Path) -> None:
    from tests.test_fairness import GATES, hold, new_gate

    gateway = serve(tools=[echo, hold], tokens_file=str(tokens_file))
    gate = new_gate()
    try:
        ended = run_stream(gateway.url, "hold", {"gate": gate}, headers=bearer(HASTY)).terminal
        assert ended["event"] == "error" and ended["data"]["error"]["code"] == "timeout"
        assert "its limit of 0.5 s" in ended["data"]["error"]["message"]
    finally:
        GATES[gate].set()
    # Another class's job has the gateway's own limit (600 s): it ends when its gate opens.
    other = new_gate()
    GATES[other].set()
    assert run_stream(gateway.url, "hold", {"gate": other}, headers=bearer(STAFF)).terminal["event"] == "data"


def test_an_engine_prices_the_job_and_the_gateway_holds_it_to_its_class(tiny_model_path: Path, tokens_file: Path, tmp_path: Path) -> None:
    """The default set-up: the engine prices a relayed job, and the gateway refuses it once it knows
    the price (the job is cancelled in the engine): the same 413 as on a model in process."""
    from tests.test_engines import start_gateway

    gateway = start_gateway(tmp_path, str(tiny_model_path), extra=("--tokens-file", str(tokens_file)))
    try:
        refused = run_stream(gateway.url, "embed", {"texts": ["x"]}, headers=bearer(TIGHT))
        assert refused.status == 413 and "max_job_memory of this token's class" in refused.body["error"]["message"]
        assert run_stream(gateway.url, "embed", {"texts": ["x"]}, headers=bearer(STAFF)).terminal["event"] == "data"
        # Its class's time limit goes with the job to the engine, whose worker stops it.
        ended = run_stream(gateway.url, "nap", {"seconds": 30}, headers=bearer(HASTY)).terminal
        assert ended["event"] == "error" and ended["data"]["error"]["code"] == "timeout", ended
    finally:
        gateway.stop()


def test_a_signed_in_users_groups_put_them_in_a_class(serve: Any, tokens_file: Path) -> None:
    issuer = LocalIssuer()
    issuer.add_key("k1")
    try:
        gateway = serve(tools=[echo], tokens_file=str(tokens_file), oidc_issuer=issuer.url, oidc_audience=AUDIENCE)
        lead = me(gateway.url, issuer.token("k1", sub="lead", groups=["lab-staff", "other"]))
        assert (lead["name"], lead["class"], lead["priority"], lead["groups"]) == ("oidc:lead", "staff", 10, ["lab-staff", "other"])
        # A ticket carries no groups: the class it checks as is the one the user's JWT proved.
        lead_token = issuer.token("k1", sub="lead", groups=["lab-staff"])
        ticket = httpx.post(f"{gateway.url}/auth/ticket", headers=bearer(lead_token)).json()["ticket"]
        assert httpx.get(f"{gateway.url}/me", params={"ticket": ticket}).json()["class"] == "staff"
        newcomer = me(gateway.url, issuer.token("k1", sub="new"))
        assert (newcomer["class"], newcomer["tools"]) == ("students", ["echo", "predict"])
    finally:
        issuer.stop()


def test_without_auth_me_names_only_the_tenant(serve: Any) -> None:
    answer = httpx.get(f"{serve(tools=[echo]).url}/me").json()
    assert answer["name"] is None and answer["class"] is None and answer["tenant"]


def test_a_class_that_floods_the_queue_fills_its_own_part_of_it(serve: Any, tokens_file: Path) -> None:
    """`max_queued` counts the class's jobs waiting to start, every member's together: past it, any
    member is refused 429 `queue_full` naming the class, while another class's jobs still queue. A
    job of the class that starts gives its place back."""
    from tests.test_fairness import GATES, hold, new_gate, start_job

    gateway = serve(tools=[echo, hold], tokens_file=str(tokens_file), queue_size=20, detach_grace=30)
    gate = new_gate()
    try:
        start_job(gateway.url, "hold", {"gate": gate}, bearer(STAFF))  # holds the worker: the rest wait
        start_job(gateway.url, "hold", {"gate": gate}, bearer(CROWD_A))
        start_job(gateway.url, "hold", {"gate": gate}, bearer(CROWD_B))
        refused = httpx.post(f"{gateway.url}/hold/run", json={"gate": gate}, headers=bearer(CROWD_A), timeout=30)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "queue_full" and "the class 'crowd' has 2 jobs waiting" in error["message"]
        assert "max_queued" in error["message"] and refused.headers["retry-after"] == "1"
        start_job(gateway.url, "hold", {"gate": gate}, bearer(STAFF))  # another class still queues
        assert len(gateway.backend.queue) == 3
        GATES[gate].set()  # every job runs, one after another, and ends
        again = lambda: run_stream(gateway.url, "echo", {"text": "hi"}, headers=bearer(CROWD_A))  # noqa: E731
        wait_until(lambda: again().status == 200, 30, "the class's jobs to start, and a member to be admitted again")
    finally:
        GATES[gate].set()


def test_class_config_errors_are_one_line_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    for text, message in [
        ("[classes.a]\npriority = 'high'\n", "[classes.a]: priority must be an integer"),
        ("[classes.a]\nlimit = 3\n", "[classes.a]: unknown keys ['limit']"),
        ("[classes.a]\ndefault = true\n[classes.b]\ndefault = true\n", "one class may be the default"),
        (f"[tokens.x]\ntoken = '{STAFF}'\nclass = 'gold'\n", "[tokens.x]: class 'gold' is not one of"),
        ("[classes.a]\ngroups = 'staff'\n", "[classes.a]: groups must be a list"),
        ("[tokenz.x]\n", "unknown tables ['tokenz']"),
        ("[classes.a]\nmax_job_memory = 'lots'\n", "[classes.a]: max_job_memory must be a size"),
        ("[classes.a]\njob_timeout = 0\n", "[classes.a]: job_timeout must be a number of seconds > 0"),
        ("[classes.a]\nmax_queued = -1\n", "[classes.a]: max_queued must be"),
    ]:
        bad.write_text(text)
        with pytest.raises(AuthConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_access(str(bad))


def test_the_cli_says_who_a_token_is(serve: Any, tokens_file: Path) -> None:
    from click.testing import CliRunner

    from gateway.cli import commands as cli

    gateway = serve(tools=[echo], tokens_file=str(tokens_file))
    shown = CliRunner().invoke(cli.main, ["me", "--url", gateway.url, "--token", STUDENT])
    assert shown.exit_code == 0, shown.output
    assert "stu: class students (priority 0), weight 1" in shown.output
    assert "tools: echo, predict" in shown.output and "running: 0 of 1 (max concurrent)" in shown.output
    refused = CliRunner().invoke(cli.main, ["me", "--url", gateway.url, "--token", "not-a-token-of-this-gateway"])
    assert refused.exit_code == 2 and "unknown token" in refused.output
