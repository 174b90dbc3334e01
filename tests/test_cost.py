"""A job's price against what it takes: each tool's estimate of its peak memory and result size
(gateway/cost.py) checked on a model wide and long enough for the work to show in the process's
peak RSS, and the 413 `too_large` a job over a bound gets before it is queued."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import torch

from backends import loading as models
from gateway.cost import Budget, Cost
from gateway.errors import ApiError
from gateway.tools import Model, builtin_tools
from bench.cost import cases, measure
from tests.conftest import Executors, Server, make_remote_server, make_server, run_stream
from tests.test_batching import Recorder

MIB = 1 << 20
TOOLS = {t.name: t for t in builtin_tools()}


@pytest.fixture(scope="module")
def wide(wide_model_path: Path) -> Model:
    return models.load(models.resolve(str(wide_model_path)), "cpu")


def priced_and_measured(model: Model, tool_name: str, raw: dict[str, Any]) -> tuple[Cost, int, int]:
    """The tool's price for `raw` params, the peak its run took (the process's peak RSS, reset before
    it; bench/cost.py measures the same on a GPU), and its result's bytes."""
    return measure(model, tool_name, raw)


@pytest.fixture(scope="module")
def wide_esm(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """A masked LM of ESM-2's kind, as wide and long as `wide`."""
    from tests.support.tiny_models import _esm

    path = _esm(tmp_path_factory.mktemp("wide-esm"), head=True, seed=0, hidden=256, context=4096)
    return models.load(models.resolve(str(path)), "cpu")


PROTEIN = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQHDFSAGEGLYTHMKALRPDEDRLSPLHSVYVDQWDWERVMGDGERQFSTLKSTVEAIWAGIKATEAAVSEEFGLAPFLPDQIHFVHSQELLSRYPDLDAKGRERAIAKDLGAVFLVGIGGKLSDGHRHDVRAPDYDDWUAAAALRKVEKPY"
ESM_CASES = [
    ("embed", {"texts": [PROTEIN * 10]}),
    ("embed", {"texts": [PROTEIN * 4] * 4, "pooling": "per_token"}),
    ("fill_mask", {"texts": [PROTEIN[:100] + "<mask>" + PROTEIN * 8] * 2, "top_k": 20}),
    ("pseudo_loglikelihood", {"sequences": [PROTEIN, PROTEIN[:120]], "per_position": True}),
]


@pytest.mark.parametrize(("tool_name", "raw"), ESM_CASES, ids=[f"{name}-{i}" for i, (name, _) in enumerate(ESM_CASES)])
def test_a_masked_lms_price_is_never_under_its_measured_peak_by_more_than_a_quarter(
    wide_esm: Model, tool_name: str, raw: dict[str, Any]
) -> None:
    cost, peak, size = priced_and_measured(wide_esm, tool_name, raw)
    assert cost.memory >= 0.75 * peak, (cost.memory / MIB, peak / MIB)
    assert cost.result >= 0.75 * size, (cost.result, size)
    assert cost.memory <= 4 * peak + 64 * MIB, (cost.memory / MIB, peak / MIB)


CASES = cases(scale=1)


@pytest.mark.parametrize(("tool_name", "raw"), CASES, ids=[f"{name}-{i}" for i, (name, _) in enumerate(CASES)])
def test_the_price_is_never_under_the_measured_peak_by_more_than_a_quarter(wide: Model, tool_name: str, raw: dict[str, Any]) -> None:
    cost, peak, size = priced_and_measured(wide, tool_name, raw)
    assert cost.memory >= 0.75 * peak, (cost.memory / MIB, peak / MIB)
    assert cost.result >= 0.75 * size, (cost.result, size)
    # And not so far over that it refuses what fits: within 4x (plus what a small job's noise is).
    assert cost.memory <= 4 * peak + 64 * MIB, (cost.memory / MIB, peak / MIB)
    assert cost.result <= 4 * size + 64 * 1024, (cost.result, size)


@pytest.mark.parametrize("tool_name", ["logprobs", "loglikelihood"])
def test_logits_read_a_few_positions_at_a_time_give_what_one_readout_gives(
    wide: Model, tool_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Full-vocabulary logits at every position are never held at once: read 3 positions at a time
    (not the thousands one readout chunk takes here), every number is what one readout gives."""
    import gateway.models.anatomy as anatomy_mod

    raw = {
        "logprobs": {"prompts": ["The cat sat", "a" * 40, "xy"], "top": 4, "next_token": True},
        "loglikelihood": {"prompts": ["The cat", "a" * 30], "continuations": [" sat on the mat", "bbbb"]},
    }[tool_name]
    t = TOOLS[tool_name]
    params = msgspec.convert(raw, t.params)
    with torch.inference_mode():
        whole = msgspec.to_builtins(t.run(wide, params, Recorder()))
        seen: list[int] = []
        real = anatomy_mod.readout_chunks

        def few(*args: Any, **kwargs: Any) -> Any:
            for part, logits in real(*args, 3):
                seen.append(logits.shape[0])
                yield part, logits

        monkeypatch.setattr(f"gateway.tools.{tool_name}.readout_chunks", few)
        chunked = msgspec.to_builtins(t.run(wide, params, Recorder()))
    assert max(seen) == 3 and len(seen) > 3
    assert _close(chunked, whole)


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return abs(a - b) <= 1e-5
    return a == b


def test_a_budget_refuses_the_bound_it_passes_naming_the_field() -> None:
    budget = Budget(memory=100 * MIB, result=10 * MIB)
    budget.admit(Cost(memory=100 * MIB, result=10 * MIB, memory_field="texts", result_field="top_k"))
    with pytest.raises(ApiError) as memory:
        budget.admit(Cost(memory=101 * MIB, result=1, memory_field="texts", result_field="top_k"))
    assert memory.value.status == 413 and memory.value.field == "texts"
    assert "101.0 MiB" in memory.value.message and "100.0 MiB" in memory.value.message and "--max-job-memory" in memory.value.message
    with pytest.raises(ApiError) as result:
        budget.admit(Cost(memory=1, result=11 * MIB, memory_field="texts", result_field="top_k"))
    assert result.value.field == "top_k" and "--max-result-bytes" in result.value.message


def test_a_result_over_the_bound_that_can_be_files_is_admitted_as_files_within_their_bound() -> None:
    written = Cost(memory=MIB, result=1024, memory_field="texts", result_field="texts", files=50 * MIB)
    inline = Cost(memory=MIB, result=11 * MIB, memory_field="texts", result_field="pooling", as_files=written, file_format="safetensors")
    assert Budget(memory=100 * MIB, result=10 * MIB, files=50 * MIB).admit(inline) is written
    small = Cost(memory=MIB, result=MIB, memory_field="texts", result_field="pooling", as_files=written, file_format="safetensors")
    assert Budget(memory=100 * MIB, result=10 * MIB, files=50 * MIB).admit(small) is small  # inline where it fits
    with pytest.raises(ApiError) as files:
        Budget(memory=100 * MIB, result=10 * MIB, files=49 * MIB).admit(inline)
    assert files.value.status == 413 and "--max-result-file-bytes" in files.value.message
    with pytest.raises(ApiError) as none:  # a backend that keeps no files: the inline bound stands
        Budget(memory=100 * MIB, result=10 * MIB).admit(inline)
    assert "--max-result-bytes" in none.value.message


# -- refused before queueing, through the server ---------------------------------------------


@pytest.fixture(scope="module")
def priced(wide_model_path: Path) -> Iterator[Server]:
    s = make_server(wide_model_path, max_job_memory=1024 * MIB, max_result_bytes=4 * MIB, max_sequences=64)
    yield s
    s.stop()


BOMBS = [
    # 400 layer × position cells × top_k 100: a result of hundreds of MB from a 1.6 KB request.
    ("logit_lens", {"prompt": "a" * 300, "top_k": 100, "layers": [0] * 400, "positions": [0] * 400}, "top_k", "--max-result-bytes"),
    ("lens_grid", {"prompt": "a" * 300, "layers": [0, 1] * 200, "positions": list(range(300))}, "layers", "--max-result-bytes"),
    # (Without precision, it would be written as a file: tests/test_result_files.py.)
    ("embed", {"texts": ["ab" * 1000] * 8, "pooling": "per_token", "precision": 6}, "pooling", "--max-result-bytes"),
    ("logprobs", {"prompts": ["a" * 7000] * 8}, "prompts", "--max-job-memory"),
    # (Its scores over --max-result-bytes are written as a file, and through /v1 refused: below, and
    # tests/test_result_files.py.)
]


@pytest.mark.parametrize(("tool_name", "raw", "field", "bound"), BOMBS, ids=[b[0] for b in BOMBS])
def test_a_job_over_a_bound_is_refused_with_413_before_it_is_queued(
    priced: Server, tool_name: str, raw: dict[str, Any], field: str, bound: str
) -> None:
    r = httpx.post(f"{priced.url}/{tool_name}/run", json=raw, timeout=60)
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "too_large" and error["field"] == field and bound in error["message"]
    assert "X-Job-Id" not in r.headers  # no job was made
    assert httpx.get(f"{priced.url}/jobs", timeout=10).json()["jobs"] == []


def test_a_job_within_both_bounds_runs(priced: Server) -> None:
    s = run_stream(priced.url, "logit_lens", {"prompt": "a" * 300, "top_k": 5, "layers": [0, 1], "positions": [0, 1, 2]})
    assert s.status == 200 and s.terminal["event"] == "data"


def test_openai_routes_are_priced_too(priced: Server) -> None:
    model = priced.backend.model_names()[0]
    # Scoring the prompts with their 5 top alternatives at every token: a result of about 10 MB.
    body = {"model": model, "prompt": ["a" * 3000] * 8, "max_tokens": 0, "echo": True, "logprobs": 5}
    r = httpx.post(f"{priced.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "too_large" and "--max-result-bytes" in r.json()["error"]["message"]


def test_a_long_prefill_in_pieces_gives_what_one_pass_gives(wide: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts of 700 and 400 tokens (left-padded together) and one alone, prefilled 64 columns at a
    time: the next-token logits, and those after one decoding step, as one pass gives them."""
    import gateway.models.decoders as decoders

    prompts = [[5 + i % 200 for i in range(700)], [7 + i % 150 for i in range(400)]]
    for rows in ([prompts[0]], prompts):
        with torch.inference_mode():
            whole = decoders.KVCache(wide)
            first = whole.prefill(rows)
            after = whole.decode(first.argmax(-1))
            monkeypatch.setattr(decoders, "PREFILL_TOKENS", 64 * len(rows))
            assert decoders.prefill_columns(len(rows), 700) == 64
            pieces = decoders.KVCache(wide)
            first_pieces = pieces.prefill(rows)
            after_pieces = pieces.decode(first_pieces.argmax(-1))
            monkeypatch.undo()
        torch.testing.assert_close(first_pieces, first, atol=1e-5, rtol=0)
        torch.testing.assert_close(after_pieces, after, atol=1e-5, rtol=0)


def test_an_executor_prices_the_jobs_a_gateway_relays_and_those_sent_to_it(executors: Executors, wide_model_path: Path) -> None:
    """The executor admits as a gateway does: a bomb relayed by a remote gateway, or posted to the
    executor itself, is refused with the same 413 and leaves no job on either."""
    tool_name, raw, field, bound = BOMBS[0]
    executor = executors.get(wide_model_path, (), ("--max-result-bytes", str(4 * MIB)))
    gateway = make_remote_server([executor.url])
    try:
        relayed = httpx.post(f"{gateway.url}/{tool_name}/run", json=raw, timeout=60)
        assert httpx.get(f"{gateway.url}/jobs", timeout=10).json()["jobs"] == []
    finally:
        gateway.stop()
    body = {"tool": tool_name, "params": raw, "job_id": "a-bomb"}
    direct = httpx.post(f"{executor.url}/jobs", json=body, headers={"X-Session-Id": "s"}, timeout=60)
    for r in (relayed, direct):
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert error["code"] == "too_large" and error["field"] == field and bound in error["message"]
    assert httpx.get(f"{executor.url}/jobs/a-bomb/result", timeout=10).status_code == 404
