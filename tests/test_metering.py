"""Metered usage and quotas (gateway/server/metering.py): what each job used, counted where it ran,
settled by tenant, class and model as it ends, in memory or in Redis across restarts; a class's
quotas refuse a tenant that used them up (429, the quota named, Retry-After the window's turn)."""

from __future__ import annotations

import asyncio
import uuid

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.server.classes import Quotas
from gateway.server.metering import MemoryLedger, Meter, row_key, summed
from gateway.usage import JobUsage
from tests.conftest import CLASSES, LAB, STUDENT, make_server
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401
from tests.test_fairness import bearer

METERED = "metered-token-0123456789abcd"
QUOTAED = CLASSES + (
    '[classes.metered]\ntokens_per_hour = 40\ndevice_seconds_per_day = 3600\n'
    f'[tokens.metered]\ntoken = "{METERED}"\nclass = "metered"\n'
)


def run(url: str, token: str, params: dict[str, Any], tool: str = "generate") -> dict[str, Any]:
    """A job's result, through `POST /{tool}/run` (raises with the status if refused); "" for no token."""
    with httpx.stream("POST", f"{url}/{tool}/run", json=params, headers=bearer(token) if token else {}, timeout=60) as response:
        if response.status_code != 200:
            response.read()
            raise AssertionError((response.status_code, response.headers.get("retry-after"), response.json()))
        body = response.read().decode()
    data = body.rsplit("event: data\n", 1)[1].split("data: ", 1)[1].split("\n", 1)[0]
    return json.loads(data)


def rows(url: str, token: str, **query: Any) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/usage", params=query, headers=bearer(token) if token else {}, timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()["rows"]


async def test_the_ledger_keeps_its_rows_and_windows_bounded_and_the_windows_turn() -> None:
    ledger = MemoryLedger(max_rows=3)
    hour = 3600.0
    for tenant in ("a", "b", "c", "d", "e"):
        ledger.add(row_key(tenant, "students", "m"), tenant, JobUsage(jobs=1, tokens_in=5, device_s=1.0), now=10 * hour)
    assert sorted(row.tenant for row in await ledger.rows()) == ["(others)", "a", "b", "c"]
    assert next(r for r in await ledger.rows() if r.tenant == "(others)").usage.jobs == 2
    assert len(ledger.windows) <= 3
    ledger.add(row_key("e", "students", "m"), "e", JobUsage(tokens_in=7), now=10 * hour + 60)
    assert (await ledger.spent("e", 10 * hour + 60))["hour"].tokens == 12
    assert (await ledger.spent("e", 11 * hour))["hour"].tokens == 0  # the hour turned
    assert (await ledger.spent("e", 11 * hour))["day"].tokens == 12


async def test_the_counters_name_the_first_tenants_and_sum_the_rest_and_a_tenant_reads_its_own_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prometheus counters by tenant: thousands of signed-in users would make a scrape of megabytes,
    written on the event loop. Past METRIC_TENANTS, a tenant is counted as (others), its use kept."""
    import gateway.server.metering as metering

    monkeypatch.setattr(metering, "METRIC_TENANTS", 3)
    meter = Meter()
    for tenant in ("a", "b", "c", "d", "e", "a", "d"):
        job = Job("generate", None, tenant=tenant)
        job.usage.tokens_in = 10
        meter.settle(job, "students")
    counted = {labels[0]: usage for labels, usage in meter.counted()}
    assert sorted(counted) == ["(others)", "a", "b", "c"]
    assert (counted["a"].jobs, counted["(others)"].jobs, counted["(others)"].tokens_in) == (2, 3, 30)
    # The ledger keeps every tenant's row all the same; a tenant's own are read apart from the rest.
    assert [(row.tenant, row.usage.jobs) for row in await meter.rows("d")] == [("d", 2)]
    assert len(await meter.rows()) == 5 and await meter.rows("nobody") == []


async def test_a_tenant_over_its_quota_is_refused_with_the_quota_named_until_its_window_turns() -> None:
    now = [100 * 3600.0 + 600]
    meter = Meter(clock=lambda: now[0])
    quotas = Quotas(tokens_per_hour=10)
    await meter.check("t", quotas, "students")  # nothing used yet
    job = Job("generate", None, tenant="t")
    job.usage.tokens_in, job.usage.tokens_out = 4, 6
    meter.settle(job, "students")
    with pytest.raises(ApiError) as refused:
        await meter.check("t", quotas, "students")
    assert refused.value.status == 429 and "tokens_per_hour" in refused.value.message and "'students'" in refused.value.message
    assert refused.value.retry_after == pytest.approx(3000.0)
    await meter.check("other", quotas, "students")  # per tenant
    now[0] += 3000
    await meter.check("t", quotas, "students")
    assert summed(await meter.rows(), ["class"])[0].usage.tokens == 10


async def test_running_jobs_hold_the_tokens_they_may_count_until_their_use_is_settled() -> None:
    """Admissions at once never pass a token quota together: each holds its job's most tokens until
    the job's use is settled, when what it used counts instead; the hold is given back once."""
    now = 100 * 3600.0
    meter = Meter(clock=lambda: now)
    quotas = Quotas(tokens_per_hour=100, device_seconds_per_hour=5)
    jobs = [Job("generate", None, tenant="t") for _ in range(5)]
    held = await asyncio.gather(*(meter.hold("t", quotas, "c", 30, job.id) for job in jobs), return_exceptions=True)
    kept = [(job, h) for job, h in zip(jobs, held) if not isinstance(h, BaseException)]
    refused = [h for h in held if isinstance(h, ApiError)]
    assert len(kept) == 3 and len(refused) == 2 and await meter.ledger.held("t", now) == 90
    assert all(r.status == 429 and "90 held by your running jobs" in r.message for r in refused)
    assert {q.name: q.held for q in await meter.left("t", quotas)} == {"tokens_per_hour": 90, "device_seconds_per_hour": 0}  # GET /me's
    await meter.hold("u", quotas, "c", 100, "u1")  # per tenant
    with pytest.raises(ApiError) as alone:
        await meter.hold("v", quotas, "c", 101, "v1")
    assert alone.value.status == 413
    job, give_back = kept[0]
    job.usage.tokens_in, job.usage.tokens_out = 5, 20  # it used less than it held
    meter.settle(job, "c")
    give_back()
    give_back()  # once only
    assert await meter.ledger.held("t", now) == 60
    last = await meter.hold("t", quotas, "c", 15, "t9")  # 25 used + 60 held + 15 = 100
    with pytest.raises(ApiError):
        await meter.hold("t", quotas, "c", 1, "t10")
    for give_back in [h for _, h in kept[1:]] + [last]:
        give_back()
    assert await meter.ledger.held("t", now) == 0 and set(meter.holding) == {"u1"}
    await meter.hold("t", Quotas(device_seconds_per_hour=5), "c", 10**9, "t11")  # no token quota: nothing held
    assert await meter.ledger.held("t", now) == 0


async def test_replicas_hold_a_quota_together_and_a_stopped_ones_holds_go_after_a_lease(redis_server: RedisServer) -> None:  # noqa: F811
    """With the ledger in Redis, holds are checked and made in one step there: two replicas admitting
    at once never pass the quota together; a hold is given back once the job's use is written; and
    the holds of a replica that stopped (renewing nothing) go after their lease, while those renewed
    stay. The replicas' clock is the test's: a lease ends when the test says."""
    from gateway.server.redis_store.ledger import RedisLedger

    prefix = f"holds-{uuid.uuid4().hex[:6]}:"
    now = [100 * 3600.0 + 10]
    a, b = (Meter(RedisLedger(redis_server.url, prefix=prefix, hold_lease=60), clock=lambda: now[0]) for _ in range(2))
    quotas = Quotas(tokens_per_hour=100)
    try:
        jobs = [Job("generate", None, tenant="t") for _ in range(8)]
        held = await asyncio.gather(*((a, b)[i % 2].hold("t", quotas, "c", 30, job.id) for i, job in enumerate(jobs)), return_exceptions=True)
        kept = [(i, job, h) for i, (job, h) in enumerate(zip(jobs, held)) if not isinstance(h, BaseException)]
        assert len(kept) == 3 and sum(isinstance(h, ApiError) and h.status == 429 for h in held) == 5
        assert await b.ledger.held("t", now[0]) == 90
        i, job, give_back = kept[0]
        job.usage.tokens_out = 10
        (a, b)[i % 2].settle(job, "c")
        give_back()
        await asyncio.gather(*a._writes, *b._writes)
        assert await a.ledger.held("t", now[0]) == 60 and (await a.ledger.spent("t", now[0]))["hour"].tokens == 10
        for _, _, give_back in kept[1:]:
            give_back()
        await asyncio.gather(*a._writes, *b._writes)
        assert await a.ledger.held("t", now[0]) == 0
        # One hold on each; 40 s on, a renews its own and b, stopped, does not: 30 s later (past b's
        # lease, within a's renewed one) only a's is held.
        await a.hold("t", quotas, "c", 20, "on-a")
        await b.hold("t", quotas, "c", 25, "on-b")
        now[0] += 40
        await a.ledger.renew([("t", job_id) for job_id in a.holding], now[0])
        now[0] += 30
        assert await a.ledger.held("t", now[0]) == 20 and await b.ledger.held("t", now[0]) == 20
    finally:
        await a.close()
        await b.close()


def test_a_jobs_use_is_counted_settled_listed_and_its_quota_refuses(serve: Any, tiny_model_path: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(QUOTAED + '[tokens.ops]\ntoken = "ops-token-0123456789abcdef0"\nadmin = true\n')
    server = serve(tokens_file=str(tokens))
    result = run(server.url, METERED, {"prompts": ["hello there"], "max_tokens": 8})
    used = result["usage"]
    (row,) = rows(server.url, METERED)
    assert (row["tenant"], row["class"]) == ("metered", "metered")
    counted = row["usage"]
    # The tokens its generation read and wrote, as its own result says; its time on the device.
    assert (counted["jobs"], counted["tokens_in"], counted["tokens_out"]) == (1, used["prompt_tokens"], used["completion_tokens"])
    assert counted["device_s"] > 0 and counted["result_bytes"] > 0
    me = httpx.get(f"{server.url}/me", headers=bearer(METERED)).json()
    assert {q["name"]: q["used"] for q in me["quotas"]} == {"tokens_per_hour": used["total_tokens"], "device_seconds_per_day": pytest.approx(counted["device_s"], abs=1e-3)}
    # A run whose tokens (prompt and max_tokens) could take it past 40 this hour is refused before it
    # is queued, one whose tokens alone pass the quota too (413); one that fits runs, to the token.
    with pytest.raises(AssertionError) as refused:
        run(server.url, METERED, {"prompts": ["hello there, again"], "max_tokens": 16})
    status, retry_after, body = refused.value.args[0]
    assert status == 429 and "tokens_per_hour" in body["error"]["message"] and "would be passed" in body["error"]["message"]
    with pytest.raises(AssertionError) as alone:
        run(server.url, METERED, {"prompts": ["x"], "max_tokens": 64})
    assert alone.value.args[0][0] == 413 and "tokens_per_hour" in alone.value.args[0][2]["error"]["message"]
    fits = 40 - used["total_tokens"] - used["prompt_tokens"]
    second = run(server.url, METERED, {"prompts": ["hello there"], "max_tokens": fits})["usage"]
    assert used["total_tokens"] + second["total_tokens"] == 40
    # Used up: the next, however small, is refused until the hour turns.
    with pytest.raises(AssertionError) as refused:
        run(server.url, METERED, {"prompts": ["x"], "max_tokens": 1})
    status, retry_after, body = refused.value.args[0]
    assert status == 429 and body["error"]["code"] == "rate_limited" and "tokens_per_hour" in body["error"]["message"]
    assert 1 <= int(retry_after) <= 3600
    # Other tools count too: predict read the tokens it was priced for. Another class has no quota.
    run(server.url, STUDENT, {"prompt": "hello", "top_k": 2}, tool="predict")
    mine = rows(server.url, STUDENT)
    read = len(AutoTokenizer.from_pretrained(tiny_model_path)("hello")["input_ids"])  # the prompt as the model reads it
    assert [(r["class"], r["usage"]["jobs"]) for r in mine] == [("students", 1)] and mine[0]["usage"]["tokens_in"] == read
    # An admin sees everyone's, summed as asked; others see their own only.
    everyone = rows(server.url, "ops-token-0123456789abcdef0", by="class")
    assert {r["class"]: r["usage"]["jobs"] for r in everyone} == {"metered": 2, "students": 1}
    assert {r["tenant"] for r in rows(server.url, STUDENT, tenant="metered")} == {"student"}
    assert httpx.get(f"{server.url}/usage?by=colour", headers=bearer(LAB)).status_code == 400
    metrics = httpx.get(f"{server.url}/metrics").text.splitlines()
    (line,) = [m for m in metrics if m.startswith("streamgate_usage_tokens_out_total{") and 'tenant="metered"' in m]
    assert 'class="metered"' in line and float(line.rsplit(" ", 1)[1]) == counted["tokens_out"] + second["completion_tokens"]


def test_usage_is_kept_in_redis_across_a_restart(tiny_model_path: Path, redis_server: RedisServer, tmp_path: Path) -> None:  # noqa: F811
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(QUOTAED)
    first = make_server(tiny_model_path, tokens_file=str(tokens), store=redis_server.url)
    try:
        run(first.url, METERED, {"prompts": ["hello"], "max_tokens": 30})
    finally:
        first.stop()
    again = make_server(tiny_model_path, tokens_file=str(tokens), store=redis_server.url)
    try:
        (row,) = rows(again.url, METERED)
        assert row["usage"]["jobs"] == 1
        # The quota counts what the replica before used: 5 + 30 tokens this hour, and 5 + 5 more would pass 40.
        answer = httpx.post(f"{again.url}/generate/run", json={"prompts": ["hello"], "max_tokens": 5}, headers=bearer(METERED))
        assert answer.status_code == 429 and "tokens_per_hour" in answer.json()["error"]["message"]
    finally:
        again.stop()


def test_an_engine_process_counts_and_sends_its_jobs_use_back(classed_engine: Any) -> None:
    """The default set-up: the engine counts the job's use and sends it with its terminal event."""
    url = classed_engine.url
    before = {r["tenant"]: r["usage"] for r in rows(url, LAB)}.get("lab", {})
    result = run(url, LAB, {"prompts": ["count me"], "max_tokens": 12})
    after = rows(url, LAB)[0]["usage"]
    assert after["jobs"] - before.get("jobs", 0) == 1
    assert after["tokens_in"] - before.get("tokens_in", 0) == result["usage"]["prompt_tokens"]
    assert after["tokens_out"] - before.get("tokens_out", 0) == result["usage"]["completion_tokens"]
    assert after["device_s"] > before.get("device_s", 0)


async def test_the_redis_ledger_reads_one_tenants_rows_however_its_name_is_spelled(redis_server: RedisServer) -> None:  # noqa: F811
    """A tenant's rows are matched in Redis by its name, glob characters and all, as a name."""
    from gateway.server.redis_store.ledger import RedisLedger

    ledger = RedisLedger(redis_server.url, prefix="ledger-rows:")
    try:
        for tenant in ("a*", "ab", "a", "x[1]", "x1"):
            await ledger.settle(row_key(tenant, "students", "m"), tenant, JobUsage(jobs=1, tokens_in=len(tenant)), now=3600.0)
        for tenant in ("a*", "a", "x[1]"):
            assert [(row.tenant, row.usage.tokens_in) for row in await ledger.rows(tenant)] == [(tenant, len(tenant))]
        assert len(await ledger.rows()) == 5
        # An admin's rows are read a piece at a time (HSCAN): every row once, with each measure, however many.
        await asyncio.gather(*(
            ledger.settle(row_key(f"t{i}", "c", "m"), f"t{i}", JobUsage(jobs=1, tokens_in=i, device_s=i / 4), now=3600.0) for i in range(4000)
        ))
        rows = {row.tenant: row.usage for row in await ledger.rows() if row.tenant.startswith("t")}
        assert len(rows) == 4000 and all(rows[f"t{i}"] == JobUsage(jobs=1, tokens_in=i, device_s=i / 4) for i in range(4000))
    finally:
        await ledger.close()


# Each tool on the tiny model, with windows where it takes them: what its use counts must never pass
# what its price says it may count, or a token quota would hold too little while it runs.
COUNTED_CASES = [
    ("generate", {"prompts": ["hello there", "hi"], "max_tokens": 12, "n": 2, "temperature": 1.0, "seed": 3}),
    ("predict", {"prompt": "hello there", "top_k": 3}),
    ("logprobs", {"prompts": ["hello there, how are you", "hi"], "top": 2}),
    ("logprobs", {"prompts": ["a long text to score in windows " * 3], "window": 24, "overlap": 8}),
    ("loglikelihood", {"prompts": ["hello", "the sky is"], "continuations": [" there", " blue"]}),
    ("loglikelihood", {"prompts": ["a long context read in windows " * 3], "continuations": [" end"], "window": 24, "overlap": 8}),
    ("embed", {"texts": ["hello there", "hi"]}),
    ("embed", {"texts": ["a long text embedded in windows " * 3], "window": 24, "overlap": 8}),
    ("logit_lens", {"prompt": "hello there", "top_k": 2}),
    ("activation_patching", {"src_prompt": "hello there", "tgt_prompt": "hello where"}),
]


PROTEIN = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQHDFSAGEGLY"
MASKED_CASES = [
    ("fill_mask", {"texts": [PROTEIN[:20] + "<mask>" + PROTEIN[21:40]], "top_k": 2}),
    ("fill_mask", {"texts": [PROTEIN[:60] + "<mask>" + PROTEIN[61:]], "top_k": 2, "window": 24, "overlap": 8}),
    ("pseudo_loglikelihood", {"sequences": [PROTEIN[:20], PROTEIN[:9]]}),
    ("pseudo_loglikelihood", {"sequences": [PROTEIN], "window": 24, "overlap": 8}),
]


# The SAE's tools on the tiny Llama with an SAE at its layer 0: a prompt, DNA-like sequences, and
# sequences in windows (mode top reads each window twice).
SAE_CASES = [
    ("sae_annotate", {"prompt": "hot dogs and cats", "k": 3}),
    ("sae_annotate", {"sequences": ["ACGT" * 10, "TTGA" * 4], "mode": "pick", "feature_ids": [0, 1]}),
    ("sae_annotate", {"sequences": ["ACGT" * 150], "mode": "pick", "feature_ids": [0], "window": 0, "overlap": 64}),
    ("sae_annotate", {"sequences": ["ACGT" * 150, "TTGA" * 20], "k": 2, "window": 0, "overlap": 64}),
]


@pytest.mark.parametrize("kind", ["causal", "masked", "sae"])
def test_no_tool_counts_more_tokens_than_its_price_says_it_may(
    serve: Any, tiny: Any, tiny_model_path: Path, tmp_path: Path, kind: str
) -> None:
    import msgspec

    from backends import loading as models
    from gateway.models import sae as sae_files
    from gateway.tools import builtin_tools
    from gateway.tools.sae_annotate import sae_annotate
    from tests.test_sae import write_sae

    tools = {t.name: t for t in [*builtin_tools(), sae_annotate]}
    path = tiny("esm_mlm") if kind == "masked" else tiny_model_path
    sae = [str(write_sae(tmp_path / "sae"))] if kind == "sae" else []
    server = serve(model_path=path, sae=sae)
    model = models.load(models.resolve(str(path)), "cpu")
    sae_files.attach(model, sae_files.read_specs(sae))
    cases = {"causal": COUNTED_CASES, "masked": MASKED_CASES, "sae": SAE_CASES}[kind]

    def counted() -> int:
        return sum(r["usage"].get("tokens_in", 0) + r["usage"].get("tokens_out", 0) for r in rows(server.url, ""))

    for name, raw in cases:
        before = counted()
        run(server.url, "", raw, tool=name)
        used = counted() - before
        price = tools[name].cost(model, msgspec.convert(raw, tools[name].params))
        # Within it, and not far under it: a hold of many times the use would refuse tenants for nothing.
        assert 0 < used <= price.most_counted, (name, raw, used, price.most_counted)
        assert used >= price.most_counted / 2, (name, raw, used, price.most_counted)


async def test_a_ledger_redis_does_not_answer_is_a_503_not_an_internal_error() -> None:
    """Quotas checked, held or shown while the Redis ledger is unreachable: 503 `store_unavailable`
    with Retry-After, as the job store answers then."""
    from gateway.server.redis_store.ledger import RedisLedger
    from tests.support.processes import free_port

    meter = Meter(RedisLedger(f"redis://127.0.0.1:{free_port()}/0"))
    try:
        for call in (
            meter.check("t", Quotas(tokens_per_hour=10), "c"),
            meter.hold("t", Quotas(tokens_per_hour=10), "c", 5, "j1"),
            meter.left("t", Quotas(tokens_per_hour=10)),
            meter.rows(),
        ):
            with pytest.raises(ApiError) as refused:
                await call
            assert refused.value.status == 503 and refused.value.code == "store_unavailable" and refused.value.retry_after == 5
    finally:
        await meter.close()
