"""Completion webhooks (gateway/server/webhooks.py): a run's `Callback-URL` gets its terminal event,
signed the Standard Webhooks way and checked here with the package's own verifier, by a real
receiver on loopback; retried with backoff, kept in Redis across a restart, shown on `GET /jobs/{id}`,
and refused where it would reach what it must not (a private address, another host, a redirect)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from tests.conftest import make_server, wait_until
from tests.support import loopback_http
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401

SECRET = "whsec_" + base64.b64encode(b"a webhook secret of 32 bytes....").decode()


class Receiver:
    """An HTTP server on loopback that keeps what it is sent and answers the statuses it is given in turn."""

    def __init__(self) -> None:
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.answers: list[int] = []
        self.redirect_to: str | None = None
        outer = self

        class Handler(loopback_http.Handler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.body()
                outer.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
                status = outer.answers.pop(0) if outer.answers else 204
                self.answer(status=status, headers={"Location": outer.redirect_to} if 300 <= status < 400 and outer.redirect_to else None)

        self.server, base = loopback_http.serve(Handler)
        self.url = f"{base}/hooks/streamgate?from=test"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


def run(url: str, params: dict[str, Any], callback: str, headers: dict[str, str] | None = None, tool: str = "generate") -> httpx.Response:
    response = httpx.post(f"{url}/{tool}/run", json=params, headers={"Callback-URL": callback, **(headers or {})}, timeout=60)
    return response


def job_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.headers["x-job-id"]


def callback(url: str, job_id: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    answer = httpx.get(f"{url}/jobs/{job_id}", headers=headers)
    assert answer.status_code == 200, answer.text
    return answer.json().get("callback", {})


def test_the_terminal_event_reaches_the_receiver_signed_and_verified(serve: Any, receiver: Receiver) -> None:
    server = serve(webhook_secret=SECRET, callback_hosts=["127.0.0.1"], detach_grace=30)
    response = run(server.url, {"prompts": ["hello"], "max_tokens": 4}, receiver.url)
    job_id = job_of(response)
    result = json.loads(response.text.rsplit("event: data\n", 1)[1].split("data: ", 1)[1].split("\n", 1)[0])
    wait_until(lambda: callback(server.url, job_id).get("state") == "delivered", 30, "the webhook's delivery")
    ((headers, body),) = receiver.received
    message = Webhook(SECRET).verify(body, headers)  # the package's own check: id, timestamp, signature
    assert message["type"] == "job.succeeded" and message["data"]["job_id"] == job_id
    assert message["data"]["status"] == "succeeded" and message["data"]["result"] == result
    assert headers["webhook-id"] == f"msg_{job_id}" and headers["host"] == receiver.url.split("/")[2]
    with pytest.raises(WebhookVerificationError):
        Webhook("whsec_" + base64.b64encode(b"another secret of thirty-two....").decode()).verify(body, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(body.replace(b"succeeded", b"SUCCEEDED"), headers)
    shown = callback(server.url, job_id)
    assert (shown["url"], shown["attempts"], shown["last_status"]) == (receiver.url, 1, 204)
    # A job that ends otherwise is told too: job.failed, with its error.
    with httpx.stream("POST", f"{server.url}/generate/run", json={"prompts": ["x"], "max_tokens": 200},
                      headers={"Callback-URL": receiver.url}, timeout=60) as stream:
        cancelled = stream.headers["x-job-id"]
        assert httpx.delete(f"{server.url}/jobs/{cancelled}").status_code == 200
        stream.read()
    wait_until(lambda: callback(server.url, cancelled).get("state") == "delivered", 30, "the cancelled job's webhook")
    message = Webhook(SECRET).verify(receiver.received[-1][1], receiver.received[-1][0])
    assert message["type"] == "job.failed" and message["data"]["status"] == "cancelled"
    assert message["data"]["error"]["code"] == "cancelled" and "result" not in message["data"]


def test_a_receiver_that_fails_is_tried_again_with_backoff_and_one_that_refuses_is_not(serve: Any, receiver: Receiver) -> None:
    server = serve(webhook_secret=SECRET, callback_hosts=["127.0.0.1"], detach_grace=30)
    receiver.answers = [503, 500]
    job_id = job_of(run(server.url, {"prompts": ["hello"], "max_tokens": 2}, receiver.url))
    wait_until(lambda: callback(server.url, job_id).get("state") == "delivered", 30, "the third try")
    assert callback(server.url, job_id)["attempts"] == 3 and len(receiver.received) == 3
    stamps = [int(headers["webhook-timestamp"]) for headers, _ in receiver.received]
    assert stamps == sorted(stamps) and {headers["webhook-id"] for headers, _ in receiver.received} == {f"msg_{job_id}"}
    receiver.answers = [400]
    refused = job_of(run(server.url, {"prompts": ["hello"], "max_tokens": 2}, receiver.url))
    wait_until(lambda: callback(server.url, refused).get("state") == "failed", 30, "the refusal")
    assert callback(server.url, refused)["attempts"] == 1 and callback(server.url, refused)["last_status"] == 400


def test_a_redirect_is_not_followed(serve: Any, receiver: Receiver) -> None:
    elsewhere = Receiver()
    try:
        server = serve(webhook_secret=SECRET, callback_hosts=["127.0.0.1"], detach_grace=30)
        receiver.answers, receiver.redirect_to = [307], elsewhere.url
        job_id = job_of(run(server.url, {"prompts": ["hello"], "max_tokens": 2}, receiver.url))
        wait_until(lambda: callback(server.url, job_id).get("state") == "failed", 30, "the redirect's refusal")
        assert callback(server.url, job_id)["last_status"] == 307 and elsewhere.received == []
    finally:
        elsewhere.stop()


def test_callbacks_that_would_reach_what_they_must_not_are_refused(serve: Any, receiver: Receiver, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        '[classes.guests]\ncallbacks = false\n[classes.staff]\n'
        '[tokens.guest]\ntoken = "guest-token-0123456789abcdef"\nclass = "guests"\n'
        '[tokens.staff]\ntoken = "staff-token-0123456789abcdef"\nclass = "staff"\n'
    )
    staff = {"Authorization": "Bearer staff-token-0123456789abcdef"}
    open_server = serve(webhook_secret=SECRET, tokens_file=str(tokens), detach_grace=30)  # any public host
    params = {"prompts": ["hello"], "max_tokens": 2}
    for url, status in [
        (receiver.url, 403),  # loopback, not listed
        ("http://10.1.2.3/hook", 403), ("http://169.254.169.254/latest/meta-data", 403), ("http://[::1]:9/x", 403),
        ("http://[::ffff:127.0.0.1]/x", 403), ("file:///etc/passwd", 400), ("http://user:pw@example.org/x", 400),
        ("gopher://example.org/", 400), ("http://example.org:99999/", 400), ("not a url", 400),
    ]:
        answer = run(open_server.url, params, url, staff)
        assert answer.status_code == status, (url, answer.text)
    assert run(open_server.url, params, "https://hooks.example.org/x", {"Authorization": "Bearer guest-token-0123456789abcdef"}).status_code == 403
    # A name that resolves to loopback passes the URL's check and is refused as its try connects.
    job_id = job_of(run(open_server.url, params, receiver.url.replace("127.0.0.1", "localhost"), staff))
    wait_until(lambda: callback(open_server.url, job_id, staff).get("state") == "failed", 30, "the refused try")
    assert "not public" in callback(open_server.url, job_id, staff)["last_error"] and receiver.received == []
    # Listed hosts only, when a list is given; and none at all without a secret.
    listed = serve(webhook_secret=SECRET, callback_hosts=["*.lab.example", "127.0.0.1"])
    assert run(listed.url, params, "https://hooks.example.org/x").status_code == 403
    assert run(listed.url, params, "https://a.lab.example/x").status_code == 200
    plain = serve()
    assert run(plain.url, params, receiver.url).status_code == 400


def test_a_delivery_pending_when_its_gateway_stops_is_made_by_the_next(
    tiny_model_path: Path, redis_server: RedisServer, receiver: Receiver,  # noqa: F811
) -> None:
    settings = {"webhook_secret": SECRET, "callback_hosts": ["127.0.0.1"], "store": redis_server.url, "detach_grace": 30}
    receiver.answers = [503] * 3
    first = make_server(tiny_model_path, **settings)
    try:
        job_id = job_of(run(first.url, {"prompts": ["hello"], "max_tokens": 2}, receiver.url))
        wait_until(lambda: callback(first.url, job_id).get("attempts", 0) >= 1, 30, "the first try, kept")
    finally:
        first.stop()
    tried = len(receiver.received)
    receiver.answers = []
    again = make_server(tiny_model_path, **settings)
    try:
        wait_until(lambda: callback(again.url, job_id).get("state") == "delivered", 60, "the delivery by the next gateway")
        assert callback(again.url, job_id)["attempts"] == tried + 1
        headers, body = receiver.received[-1]
        assert Webhook(SECRET).verify(body, headers)["data"]["job_id"] == job_id
    finally:
        again.stop()


def test_the_python_client_and_the_cli_name_a_callback(serve: Any, receiver: Receiver) -> None:
    from click.testing import CliRunner

    from gateway.cli.commands import main
    from gateway.client import Client

    server = serve(webhook_secret=SECRET, callback_hosts=["127.0.0.1"], detach_grace=30)
    with Client(server.url) as client:
        result = client.run("generate", {"prompts": ["hello"], "max_tokens": 2}, callback_url=receiver.url)
        job_id = client.job_id
    assert job_id is not None
    wait_until(lambda: callback(server.url, job_id).get("state") == "delivered", 30, "the client's job's webhook")
    assert Webhook(SECRET).verify(receiver.received[-1][1], receiver.received[-1][0])["data"]["result"] == result
    ran = CliRunner().invoke(main, ["run", "generate", "prompts=hi", "max_tokens=2", "--url", server.url, "--quiet", "--callback-url", receiver.url])
    assert ran.exit_code == 0, ran.output
    wait_until(lambda: len(receiver.received) == 2, 30, "the CLI's job's webhook")


def test_a_job_whose_replica_died_has_its_webhook_delivered_by_another(
    tiny_model_path: Path, redis_server: RedisServer, receiver: Receiver, tmp_path: Path,  # noqa: F811
) -> None:
    """Two gateways (engine processes) on one Redis; the one running a job is killed. The other, looking
    at the deliveries that wait for their jobs' ends, ends the job as lost, and delivers the webhook the
    dead one would have, though no client reads the job there."""
    import signal

    from tests.test_engines import start_gateway

    extra = (
        "--store", redis_server.url, "--store-outage-grace", "1", "--callback-hosts", "127.0.0.1", "--detach-grace", "30",
        "--webhook-secret", SECRET,
    )
    first, second = (start_gateway(tmp_path, str(tiny_model_path), extra=extra) for _ in range(2))
    try:
        with httpx.stream("POST", f"{first.url}/nap/run", json={"seconds": 60}, headers={"Callback-URL": receiver.url}, timeout=60) as stream:
            job_id = stream.headers["x-job-id"]
            for line in stream.iter_lines():
                if "RUNNING" in line:
                    break
        assert callback(second.url, job_id)["state"] == "waiting"
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=30)
        # Nobody reads the job on the other replica: it finds the delivery waiting, and the job lost.
        wait_until(lambda: len(receiver.received) == 1, 60, "its webhook, from the other replica")
        message = Webhook(SECRET).verify(receiver.received[-1][1], receiver.received[-1][0])
        assert message["data"]["job_id"] == job_id and message["data"]["error"]["code"] == "backend_unavailable"
        wait_until(lambda: callback(second.url, job_id).get("state") == "delivered", 30, "its delivery, kept")
    finally:
        first.stop()
        second.stop()


# -- bounded: what a tenant's callbacks hold, and what the outbox holds -----------------------------


def test_a_tenant_with_its_webhooks_all_open_is_refused_until_they_end(serve: Any, receiver: Receiver) -> None:
    """A receiver that fails every try: a tenant's open deliveries reach --webhooks-per-tenant, and
    its next run naming a callback is refused (429, Retry-After) before it is queued; a run without
    one still runs, and once the deliveries end (failed for good) callbacks are taken again."""
    server = serve(webhook_secret=SECRET, callback_hosts=["127.0.0.1"], detach_grace=30, webhooks_per_tenant=2, webhook_attempts=2)
    receiver.answers = [503] * 4
    params = {"prompts": ["hello"], "max_tokens": 2}
    first, second = (job_of(run(server.url, params, receiver.url)) for _ in range(2))
    refused = run(server.url, params, receiver.url)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "30", refused.text
    error = refused.json()["error"]
    assert error["code"] == "rate_limited" and "--webhooks-per-tenant" in error["message"]
    assert httpx.post(f"{server.url}/generate/run", json=params, timeout=60).status_code == 200
    for job_id in (first, second):
        wait_until(lambda job_id=job_id: callback(server.url, job_id).get("state") == "failed", 30, "the deliveries, failed")
    assert len(receiver.received) == 4
    job_of(run(server.url, params, receiver.url))


def test_the_memory_outbox_keeps_its_tries_in_order_of_when_they_are_due() -> None:
    import asyncio

    from gateway.server.webhooks import Delivery, MemoryOutbox

    async def check() -> None:
        outbox = MemoryOutbox(retention=600)
        for i, due in enumerate([5.0, 1.0, 3.0, 2.0, 4.0]):
            await outbox.put(Delivery(f"j{i}", "http://x", "pending", "t", "{}", due=due))
        assert await outbox.next_due() == 1.0
        claimed = await outbox.claim(now=3.0, lease=60.0, most=2)
        assert [d.job_id for d in claimed] == ["j1", "j3"]  # due at 1 and 2; at most 2
        assert [d.job_id for d in await outbox.claim(now=3.0, lease=60.0, most=10)] == ["j2"]
        assert await outbox.next_due() == 4.0  # the claimed ones are leased until 63
        # A delivery tried and put back is due when its new time says, its old entry skipped.
        tried = claimed[0]
        tried.due = 4.5
        await outbox.put(tried)
        assert [d.job_id for d in await outbox.claim(now=4.6, lease=60.0, most=10)] == ["j4", "j1"]
        for job_id in ("j0", "j1", "j2", "j3", "j4"):
            await outbox.put(Delivery(job_id, "http://x", "delivered", "t"))
        assert await outbox.next_due() is None and await outbox.claim(now=1e12, lease=1.0, most=10) == []
        assert await outbox.held("t") == (0, 0, 0)
        # Deliveries tried again and again leave stale entries behind: they do not pile up past the open ones.
        for attempt in range(100):
            await outbox.put(Delivery("again", "http://x", "pending", "t", "{}", due=1e9 + attempt))
        assert await outbox.claim(now=0.0, lease=1.0, most=10) == [] and len(outbox._heap) == 1

    asyncio.run(check())


def test_the_results_pending_deliveries_carry_inline_are_bounded_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worst case: a failing receiver, and every job ending with a result as big as a webhook
    carries inline. Past INLINE_HELD the messages carry the result's size (fetched from the job),
    so the outbox holds at most INLINE_HELD bytes of results; as deliveries end, their room comes back."""
    import asyncio

    import gateway.server.webhooks as webhooks
    from gateway.server.webhooks import JobEnd, Webhooks

    monkeypatch.setattr(webhooks, "INLINE_HELD", 1 << 20)
    result = b'"' + b"x" * (webhooks.INLINE_RESULT - 2) + b'"'

    async def check() -> None:
        hooks = Webhooks(SECRET, ["127.0.0.1"])
        outbox = hooks.outbox
        for i in range(12):
            await outbox.put(webhooks.Delivery(f"j{i}", "http://127.0.0.1/", tenant=f"t{i % 3}"))
            await hooks._ended("http://127.0.0.1/", f"t{i % 3}", JobEnd(f"j{i}", "generate", "m", True, result, None))
        held = await outbox.held("t0")
        assert held.tenant == 4 and held.total == 12 and held.inline <= webhooks.INLINE_HELD
        carried = [json.loads(outbox.deliveries[f"j{i}"].payload)["data"] for i in range(12)]
        assert sum("result" in c for c in carried) == 4 and all(c.get("result_size") == len(result) for c in carried[4:])
        # An ended delivery keeps no message, and its room goes to the next.
        ended = await outbox.get("j0")
        assert ended is not None
        ended.state, ended.payload, ended.inline = "delivered", "", 0
        await outbox.put(ended)
        assert (await outbox.held("t0")).inline == 3 * len(result)
        await hooks._ended("http://127.0.0.1/", "t0", JobEnd("j12", "generate", "m", True, result, None))
        assert "result" in json.loads(outbox.deliveries["j12"].payload)["data"]
        await hooks.stop()

    asyncio.run(check())


def test_the_redis_outbox_counts_a_delivery_once_however_often_it_is_put(redis_server: RedisServer) -> None:  # noqa: F811
    import asyncio

    from gateway.server.redis_store.outbox import RedisOutbox
    from gateway.server.webhooks import Delivery

    async def check() -> None:
        outbox = RedisOutbox(redis_server.url, retention=60, prefix="outbox-count:")
        try:
            await outbox.put(Delivery("a", "http://x", tenant="t"))
            await outbox.put(Delivery("a", "http://x", tenant="t"))
            await outbox.put(Delivery("b", "http://x", tenant="u"))
            assert await outbox.held("t") == (1, 2, 0)
            pending = Delivery("a", "http://x", "pending", "t", "{...}", inline=500, due=1.0)
            await outbox.put(pending)
            await outbox.put(pending)  # a try's outcome put twice (two replicas, a lease run out)
            assert await outbox.held("t") == (1, 2, 500)
            assert [d.job_id for d in await outbox.claim(now=2.0, lease=60, most=5)] == ["a"]
            for _ in range(2):
                await outbox.put(Delivery("a", "http://x", "delivered", "t"))
            assert await outbox.held("t") == (0, 1, 0) and await outbox.held("u") == (1, 1, 0)
        finally:
            await outbox.close()

    asyncio.run(check())


def test_replicas_opening_deliveries_at_once_never_pass_the_caps_together(redis_server: RedisServer) -> None:  # noqa: F811
    """Two replicas admit runs with callbacks at the same moment: the check and the put are one step
    in Redis (and in memory), so a tenant ends with exactly its cap open, and the outbox with its own."""
    import asyncio

    from gateway.server.redis_store.outbox import RedisOutbox
    from gateway.server.webhooks import Delivery, MemoryOutbox

    async def check() -> None:
        replicas = [RedisOutbox(redis_server.url, retention=60, prefix="outbox-caps:") for _ in range(2)]
        try:
            opened = await asyncio.gather(*(
                replicas[i % 2].open(Delivery(f"j{i}", "http://x", tenant="t"), per_tenant=5, most=8) for i in range(30)
            ))
            assert sum(held is None for held in opened) == 5 and await replicas[0].held("t") == (5, 5, 0)
            refused = [held for held in opened if held is not None]
            assert all(held.tenant == 5 for held in refused)
            others = await asyncio.gather(*(
                replicas[i % 2].open(Delivery(f"k{i}", "http://x", tenant=f"u{i}"), per_tenant=5, most=8) for i in range(10)
            ))
            assert sum(held is None for held in others) == 3 and (await replicas[1].held("u0")).total == 8
            assert {held.total for held in others if held is not None} == {8}
        finally:
            for outbox in replicas:
                await outbox.close()
        memory = MemoryOutbox(retention=60)
        opened = await asyncio.gather(*(memory.open(Delivery(f"j{i}", "http://x", tenant="t"), 5, 8) for i in range(30)))
        assert sum(held is None for held in opened) == 5 and await memory.held("t") == (5, 5, 0)

    asyncio.run(check())


async def test_a_run_with_a_callback_while_the_outbox_redis_does_not_answer_is_a_503() -> None:
    from gateway.errors import ApiError
    from gateway.server.redis_store.outbox import RedisOutbox
    from gateway.server.webhooks import Delivery
    from tests.support.processes import free_port

    outbox = RedisOutbox(f"redis://127.0.0.1:{free_port()}/0", retention=60)
    try:
        with pytest.raises(ApiError) as refused:
            await outbox.open(Delivery("j", "http://x", tenant="t"), per_tenant=5, most=8)
        assert refused.value.status == 503 and refused.value.retry_after == 5 and "webhook outbox" in refused.value.message
    finally:
        await outbox.close()


async def test_an_mcp_task_is_told_to_the_callback_its_request_names(serve: Any, receiver: Receiver, tmp_path: Path) -> None:
    """A `tools/call` sent with a `Callback-URL` header: the task (its job) is delivered there as it
    ends, as a run's is; a callback this gateway may not deliver to makes the call an error result."""
    import httpx2
    import mcp_types as types
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    from tests.test_mcp import TasksExtension, held, start_task

    server = serve(tools=[held], webhook_secret=SECRET, callback_hosts=["127.0.0.1"], detach_grace=30)
    gate = tmp_path / "gate"

    async def connected(callback: str) -> Any:
        http = httpx2.AsyncClient(headers={"Callback-URL": callback}, timeout=httpx2.Timeout(30, read=120))
        return http, Client(streamable_http_client(server.url + "/mcp", http_client=http), extensions=[TasksExtension()])

    http, client = await connected(receiver.url)
    async with http, client:
        created = await start_task(client, "held", {"gate": str(gate)})
        assert callback(server.url, created.task_id)["state"] == "waiting"
        gate.touch()
        for _ in range(600):
            if callback(server.url, created.task_id).get("state") == "delivered":
                break
            await asyncio.sleep(0.05)
    ((headers, body),) = receiver.received
    message = Webhook(SECRET).verify(body, headers)
    assert message["data"]["job_id"] == created.task_id and message["data"]["result"] == {"gate": str(gate)}
    http, client = await connected("http://10.0.0.1/hook")
    async with http, client:
        refused = await client.call_tool("held", {"gate": str(gate)})
        assert isinstance(refused, types.CallToolResult) and refused.is_error
        assert refused.content[0].text.startswith("forbidden:")


async def test_a_run_refused_after_its_delivery_was_kept_leaves_none_behind(tiny_model_path: Path) -> None:
    """The delivery is kept (and counted against the tenant's cap) before the job is queued; a run the
    queue then refuses (429 queue_full) takes it out again, so refusals never use up the tenant's
    webhooks. A job going on in another replica counts the delivery it kept from its first admission
    once, whatever the caps."""
    from backends.local import LocalBackend
    from gateway.admission import Admission, Applicant
    from gateway.config import Settings
    from gateway.errors import ApiError
    from gateway.server.webhooks import Delivery, Webhooks
    from gateway.tools import collect, load_module
    from tests.support import script_tools

    tools = collect(load_module(script_tools.__name__))
    settings = Settings(model=[str(tiny_model_path)], device="cpu", queue_size=1)
    backend = LocalBackend(tools, settings)
    hooks = Webhooks(SECRET, ["127.0.0.1"], per_tenant=3)
    admission = Admission(backend, settings.limits(), webhooks=hooks)
    waits = script_tools.ScriptParams(script=[script_tools.AwaitDisconnectStep()])
    url, applicant = "http://127.0.0.1:9/hook", Applicant("lab")
    await backend.start()
    try:
        await backend.wait_ready()
        running = await admission.admit(tools["script"], waits, applicant, callback=url)
        for _ in range(3000):  # its worker takes it: the queue's one place is free again
            if running.started is not None:
                break
            await asyncio.sleep(0.01)
        queued = await admission.admit(tools["script"], waits, applicant, callback=url)
        for _ in range(3):
            with pytest.raises(ApiError) as refused:
                await admission.admit(tools["script"], waits, applicant, callback=url)
            assert refused.value.code.value == "queue_full", refused.value.message  # never the webhooks' cap
        assert await hooks.outbox.held("lab") == (2, 2, 0)
        # The running job's delivery, kept again as it goes on elsewhere: counted once, not refused.
        assert await hooks.outbox.open(Delivery(running.id, url, tenant="lab"), 2, 10) is None
        assert await hooks.outbox.held("lab") == (2, 2, 0)
        for job in (running, queued):
            backend.cancel(job)
    finally:
        await backend.stop()


def test_a_redis_outbox_takes_out_a_refused_runs_delivery_and_counts_a_job_going_on_once(redis_server: RedisServer) -> None:  # noqa: F811
    from gateway.server.redis_store.outbox import RedisOutbox
    from gateway.server.webhooks import Delivery

    async def check() -> None:
        outbox = RedisOutbox(redis_server.url, retention=60, prefix="outbox-drop:")
        try:
            for job_id in ("a", "b"):
                assert await outbox.open(Delivery(job_id, "http://x", tenant="t"), per_tenant=2, most=10) is None
            assert await outbox.open(Delivery("c", "http://x", tenant="t"), per_tenant=2, most=10) == (2, 2, 0)
            assert await outbox.open(Delivery("a", "http://x", tenant="t"), per_tenant=2, most=10) is None  # its own
            await outbox.drop(Delivery("b", "http://x", tenant="t"))
            assert await outbox.held("t") == (1, 1, 0) and await outbox.get("b") is None
            assert await outbox.waiting(10) == ["a"]
            assert await outbox.open(Delivery("c", "http://x", tenant="t"), per_tenant=2, most=10) is None
        finally:
            await outbox.close()

    asyncio.run(check())


def test_a_delivery_whose_outbox_answer_is_lost_is_taken_out_again(redis_server: RedisServer) -> None:  # noqa: F811
    """Redis may keep a delivery and its answer be lost (stalled past the timeout, a reset): the run is
    a 503, and the delivery it kept must not count against the tenant's cap for the week it is kept."""
    from gateway.errors import ApiError
    from gateway.jobs import Job
    from gateway.server.redis_store.outbox import RedisOutbox
    from gateway.server.webhooks import Webhooks

    async def check() -> None:
        outbox = RedisOutbox(redis_server.url, retention=60, prefix="outbox-lost:")
        kept = outbox.open_script

        async def kept_then_lost(**kwargs: Any) -> Any:
            await kept(**kwargs)
            raise TimeoutError("its answer never came")

        outbox.open_script = kept_then_lost
        hooks = Webhooks(SECRET, ["127.0.0.1"], per_tenant=2, outbox=outbox)
        try:
            for i in range(3):
                with pytest.raises(ApiError) as refused:
                    await hooks.waiting(Job("t", None, job_id=f"j{i}", tenant="lab"), "http://127.0.0.1:9/hook")
                assert refused.value.status == 503
            assert await outbox.held("lab") == (0, 0, 0) and await outbox.get("j0") is None
        finally:
            await outbox.close()

    asyncio.run(check())
