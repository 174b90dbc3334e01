"""Dynamic batching: jobs run together give what each gives alone, and keep their own
frames, results, errors and cancellation; `generate` batches continuously.

The first half drives the tools' batches directly on tiny models of every family
(padding side, attention masks, merged KV caches); the second goes through a real
gateway with concurrent clients.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest

from backends import loading as models
from gateway.tools import Cancelled, Context, Model, tool
from gateway.tools.batching import one_pass, run_alone
from gateway.tools.embed import EmbedParams, embed
from gateway.tools.generate import GenerateParams, Generation, generate
from gateway.tools.loglikelihood import LoglikelihoodParams, loglikelihood
from gateway.tools.predict import PredictParams, predict
from tests.conftest import Stream, open_stream, parse_sse, run_stream, wait_until

TOL = 1e-4


class Recorder:
    """A job's context that keeps what the tool told it."""

    def __init__(self, name: str = "job") -> None:
        self.job_id = name
        self.partials: list[Any] = []
        self.progressed: list[tuple[int, int | None]] = []
        self.cancel_now = False
        self.tokens_in = self.tokens_out = 0

    def progress(self, done: int, total: int | None = None, unit: str | None = None) -> None:
        self.progressed.append((done, total))

    def log(self, message: str, level: str = "info") -> None:
        pass

    def partial(self, obj: Any) -> None:
        self.partials.append(msgspec.to_builtins(obj))

    def count(self, tokens_in: int = 0, tokens_out: int = 0) -> None:
        self.tokens_in += tokens_in
        self.tokens_out += tokens_out

    @property
    def cancelled(self) -> bool:
        return self.cancel_now

    def raise_if_cancelled(self) -> None:
        if self.cancel_now:
            raise Cancelled()


def as_plain(result: Any) -> Any:
    return msgspec.to_builtins(result, enc_hook=lambda a: a.tolist() if isinstance(a, np.ndarray) else a)


def assert_close(a: Any, b: Any, where: str = "") -> None:
    """Equal structure; floats to TOL."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert abs(a - b) <= TOL * max(1.0, abs(a)), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def run_together(model: Model, batch: Any, jobs: list[tuple[Any, Recorder]]) -> dict[str, Any]:
    """Add every job, step to the end; outcomes by job name."""
    for params, ctx in jobs:
        batch.add(params, ctx)
    outcomes: dict[str, Any] = {}
    while len(batch):
        for ctx, outcome in batch.step():
            outcomes[ctx.job_id] = outcome
    return outcomes


@pytest.fixture(scope="module")
def llama(tiny_model_path: Path) -> Model:
    return models.load(models.resolve(str(tiny_model_path)), "cpu")


@pytest.fixture(scope="module")
def family_model(arch_model_path: Path) -> Model:
    return models.load(models.resolve(str(arch_model_path)), "cpu")


PROMPTS = ["a", "The capital of France is", "xyz xyz xyz xyz xyz xyz xyz xyz", "Hi!", "0123456789" * 4]


# -- one forward pass over every member ------------------------------------------


def test_one_pass_tools_give_what_each_gives_alone(family_model: Model) -> None:
    cases = [
        (predict, [PredictParams(prompt=p, top_k=5 + i) for i, p in enumerate(PROMPTS)]),
        (
            loglikelihood,
            [
                LoglikelihoodParams(prompts=[p, p[:3] or "q"], continuations=[" next", " x" * (i + 1)])
                for i, p in enumerate(PROMPTS)
            ],
        ),
        (
            embed,
            [
                EmbedParams(texts=PROMPTS[: i + 1], layer=layer, pooling=pooling, normalize=i % 2 == 0)
                for i, (layer, pooling) in enumerate(
                    [(-1, "mean"), (0, "last"), (1, "none"), (-1, "last"), (2, "mean")]
                )
            ],
        ),
    ]
    for t, jobs in cases:
        alone = [as_plain(t.run(family_model, params, Recorder())) for params in jobs]
        together = run_together(family_model, t.batch(family_model), [(p, Recorder(str(i))) for i, p in enumerate(jobs)])
        assert sorted(together) == [str(i) for i in range(len(jobs))]
        for i, expected in enumerate(alone):
            assert_close(as_plain(together[str(i)]), expected, f"{t.name} job {i}")


def test_embed_batches_across_jobs_beyond_one_chunk(llama: Model) -> None:
    # 20 + 7 texts: chunks of 16 mix the two jobs' texts.
    jobs = [EmbedParams(texts=[f"text {i} " * (i % 5 + 1) for i in range(20)]), EmbedParams(texts=PROMPTS + ["b", "c"], pooling="none")]
    alone = [as_plain(embed.run(llama, p, Recorder())) for p in jobs]
    ctxs = [Recorder("0"), Recorder("1")]
    together = run_together(llama, embed.batch(llama), list(zip(jobs, ctxs)))
    for i in range(2):
        assert_close(as_plain(together[str(i)]), alone[i], f"job {i}")
    # Each job hears its own progress, ending at its own total.
    assert ctxs[0].progressed[-1] == (20, 20)
    assert ctxs[1].progressed[-1] == (7, 7)


def test_a_cancelled_member_leaves_and_the_others_are_unchanged(llama: Model) -> None:
    jobs = [(PredictParams(prompt=p), Recorder(str(i))) for i, p in enumerate(PROMPTS)]
    jobs[2][1].cancel_now = True
    together = run_together(llama, predict.batch(llama), jobs)
    assert isinstance(together["2"], Cancelled)
    for i, (params, _) in enumerate(jobs):
        if i != 2:
            assert_close(as_plain(together[str(i)]), as_plain(predict.run(llama, params, Recorder())))


class Number(msgspec.Struct):
    x: float


class Doubled(msgspec.Struct):
    y: float


def _double_many(model: Model, jobs: list[Number], ctxs: list[Context]) -> list[Doubled]:
    if any(j.x < 0 for j in jobs):
        raise ValueError("negative input")
    return [Doubled(2 * j.x) for j in jobs]


@tool(batch=one_pass(_double_many))
def double(model: Model, params: Number, ctx: Context) -> Doubled:
    """Twice x; fails on a negative x (a user tool that batches)."""
    return _double_many(model, [params], [ctx])[0]


def test_one_bad_input_fails_only_its_own_job(llama: Model) -> None:
    jobs = [(Number(x), Recorder(str(i))) for i, x in enumerate([1.0, -1.0, 3.0])]
    together = run_together(llama, double.batch(llama), jobs)
    assert together["0"] == Doubled(2.0)
    assert together["2"] == Doubled(6.0)
    assert isinstance(together["1"], ValueError)


# -- generation: continuous batching ------------------------------------------------


def _rows_text(model: Model, ids: list[int], stops: list[str]) -> tuple[str, str | None, str]:
    """A `generate` row fed `ids`: its text, its finish, and what its partials sent (its end at the
    last of `ids` if nothing ended it before)."""
    from gateway.tools.generate import _Completion

    row, sent = _Completion(stops, model), ""
    for token in ids:
        sent += row.add(token, model)
        if row.finish:
            break
    else:
        sent += row.end("length", model.decode(row.tokens))
    return row.text, row.finish, sent


@pytest.mark.parametrize("decoder", ["rust", "python"])
def test_generated_text_grows_as_decoding_every_token_gives_it_and_stops_where_it_shows_a_stop(
    llama: Model, decoder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row's text a token at a time (the tokenizer's incremental decoder, or, for a tokenizer without
    one, the same in Python): at each step, what decoding all its tokens gives; it stops at
    the first step where that text holds a stop string, cut where the first one begins, and its partials
    add up to the completion.
    Byte tokens that split characters, or are no UTF-8 at all, included."""
    from gateway.models.base import RUST_DECODER

    if decoder == "python":
        monkeypatch.setitem(llama.memo, RUST_DECODER, None)
    rng = random.Random(7)
    texts = ["héllo wörld ✓ 日本語 🙂 ok", "ab\n\ncd END x", "aaab ababac abab"]
    eos = set(llama.eos_token_ids)
    for trial in range(400):
        if trial % 2:
            ids = llama.encode(rng.choice(texts))[1:]
            ids = ids[: rng.randint(1, len(ids))]
        else:
            ids = [i for i in (rng.randrange(3, 259) for _ in range(rng.randint(1, 30))) if i not in eos]
        # (Stop strings that overlap themselves: a partial match falls back to a shorter one.)
        stops = rng.choice([[], ["\n\n"], ["END", "ö"], ["日"], ["o w"], ["abac", "aab"], ["baba", "ab a"]])
        text, finish, sent = _rows_text(llama, ids, stops)
        expected = (llama.decode(ids), "length")
        for k in range(1, len(ids) + 1):  # decoding every token at every step
            whole = llama.decode(ids[:k])
            cuts = [at for at in (whole.find(s) for s in stops) if at >= 0]
            if cuts:
                expected = (whole[: min(cuts)], "stop")
                break
        assert (text, finish) == expected and sent == text, (ids, stops)


@pytest.mark.parametrize("decoder", ["rust", "python"])
def test_a_token_that_changes_the_text_before_it_ends_nothing_but_what_is_sent(
    llama: Model, decoder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ByteFallback tokenizer (Llama 2's, Mistral's): bytes that turn out to be no UTF-8 each decode
    as U+FFFD, so `€` already sent becomes `���` and a fourth (tokenizers' DecodeStream refuses such a
    token). The row goes on, decoding every token from there: its completion is the decode of all its
    tokens, and its partials what began the text when they were sent (all of it that did not change)."""
    from gateway.models.base import RUST_DECODER
    from tests.support.tiny_models import byte_fallback_tokenizer

    model = dataclasses.replace(llama, tokenizer=byte_fallback_tokenizer(), memo={}, eos_token_ids=frozenset({1}))
    if decoder == "python":
        model.memo[RUST_DECODER] = None
    ids = model.tokenizer.convert_tokens_to_ids(["▁a", "<0xE2>", "<0x82>", "<0xAC>", "<0x87>", "▁b", "ab"])
    assert model.decode(ids[:4]) == "a€" and model.decode(ids) == "a���� bab"
    assert _rows_text(model, ids, []) == ("a���� bab", "length", "a€")
    rng = random.Random(5)
    for _ in range(300):
        ids = [rng.choice([*range(2, 258), 258, 259, 260, 261, 262, 263, 264]) for _ in range(rng.randint(1, 12))]
        text, finish, sent = _rows_text(model, ids, [])
        assert (text, finish) == (model.decode(ids), "length"), ids
        # What was sent began the text when it was sent; it begins the completion unless a later byte changed it.
        changed = any(not model.decode(ids[: k + 1]).startswith(model.decode(ids[:k]).rstrip("\ufffd")) for k in range(len(ids)))
        assert text.startswith(sent) or (changed and any(model.decode(ids[:k]).startswith(sent) for k in range(len(ids)))), ids


def test_a_stop_string_its_last_token_leaves_before_an_incomplete_character_still_ends_the_row(llama: Model) -> None:
    """A byte-level BPE token of a space and the first byte of `é`: the text it completes with `User: `
    waits for the next byte to be read. The row ends there all the same: at its length's end (or
    EOS), cut where the stop string begins."""
    from tokenizers import Tokenizer, decoders, models as tokenizer_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["ĠÃ"] = len(vocab)  # " " and 0xC3
    vocab["</s>"] = len(vocab)
    bpe = Tokenizer(tokenizer_models.BPE(vocab=vocab, merges=[("Ġ", "Ã")]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>")
    model = dataclasses.replace(llama, tokenizer=tokenizer, memo={}, eos_token_ids=frozenset({vocab["</s>"]}))
    ids = tokenizer.encode("Hi User: é", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids[-2:]) == ["ĠÃ", "©"] and model.decode(ids[:-1]) == "Hi User: \ufffd"
    assert _rows_text(model, ids[:-1], ["User: "]) == ("Hi ", "stop", "Hi ")  # its length's end
    assert _rows_text(model, [*ids[:-1], vocab["</s>"]], ["User: "]) == ("Hi ", "stop", "Hi ")  # EOS
    assert _rows_text(model, ids, ["User: "]) == ("Hi ", "stop", "Hi ")


def test_a_row_that_fails_ends_its_own_job_and_not_the_others_in_its_batch(llama: Model) -> None:
    """A row whose text cannot be taken (here its third token raises) ends its job with that error
    between two steps; the other jobs of the continuous batch go on to what each gives alone."""
    good = GenerateParams(prompts=["Hello", "a b"], max_tokens=8)
    bad = GenerateParams(prompts=["Hi"], max_tokens=8)
    batch = Generation(llama)
    batch.add(good, Recorder("good"))
    batch.add(bad, Recorder("bad"))
    row = batch.joining[-1].rows[0]
    taken = row.add

    def add(token: int, model: Model) -> str:
        if len(row.tokens) == 2:
            raise ValueError("this row cannot be read")
        return taken(token, model)

    row.add = add  # type: ignore[method-assign]
    outcomes = run_together(llama, batch, [])
    assert isinstance(outcomes["bad"], ValueError) and str(outcomes["bad"]) == "this row cannot be read"
    assert as_plain(outcomes["good"]) == as_plain(_alone(llama, good)[0])


def _generate_jobs() -> list[GenerateParams]:
    return [
        GenerateParams(prompts=["Hello"], max_tokens=12),
        GenerateParams(prompts=["a", "The capital of France is"], max_tokens=7, temperature=0.9, seed=3),
        GenerateParams(prompts=["xyz xyz xyz xyz xyz"], max_tokens=20, temperature=1.2, top_k=5, seed=11),
        GenerateParams(prompts=["Hi!"], max_tokens=3, top_p=0.8, temperature=0.7, seed=5, stop=["q"]),
        GenerateParams(prompts=["0123456789" * 3, "z"], max_tokens=9),
    ]


def _alone(model: Model, params: GenerateParams) -> tuple[Any, list[Any]]:
    ctx = Recorder()
    result = as_plain(generate.run(model, params, ctx))
    return result, ctx.partials


def test_generation_together_and_joining_midway_equals_alone(family_model: Model) -> None:
    jobs = _generate_jobs()
    alone = [_alone(family_model, p) for p in jobs]
    batch = Generation(family_model)
    ctxs = [Recorder(str(i)) for i in range(len(jobs))]
    outcomes: dict[str, Any] = {}
    # Two start together; the others join one per step while those decode.
    waiting = list(zip(jobs, ctxs))
    for params, ctx in waiting[:2]:
        batch.add(params, ctx)
    waiting = waiting[2:]
    steps = 0
    while len(batch) or waiting:
        if waiting and batch.continuous:
            batch.add(*waiting.pop(0))
        for ctx, outcome in batch.step():
            outcomes[ctx.job_id] = outcome
        steps += 1
        assert steps < 100
    for i, (expected, partials) in enumerate(alone):
        assert as_plain(outcomes[str(i)]) == expected, f"job {i}"
        assert ctxs[i].partials == partials, f"job {i}: its partial events"


def test_a_prompt_sent_by_several_rows_is_run_once_and_each_row_gets_what_it_gets_alone(family_model: Model) -> None:
    """`n` completions of a prompt and other jobs on the same prompt, joining together and midway:
    the prefill runs each distinct prompt once, and every job is what it is alone (the sampled
    ones included, whose rows must not share a sampler because they share a prompt)."""
    same = "The capital of France is"
    jobs = [
        GenerateParams(prompts=[same], max_tokens=6),
        GenerateParams(prompts=[same, "Hi!", same], max_tokens=5, temperature=0.9, seed=7),
        GenerateParams(prompts=[same], n=3, max_tokens=4, temperature=1.1, seed=2),
        GenerateParams(prompts=["Hi!"], max_tokens=6),
        GenerateParams(prompts=[same], max_tokens=3),  # joins midway, onto a padded cache
    ]
    alone = [_alone(family_model, p) for p in jobs]
    greedy_once = _alone(family_model, GenerateParams(prompts=[same], max_tokens=4))[0]
    prefilled: list[int] = []

    def record(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:  # a prefill: every decoding step feeds one column
            prefilled.append(ids.shape[0])

    batch = Generation(family_model)
    ctxs = [Recorder(str(i)) for i in range(len(jobs))]
    for params, ctx in zip(jobs[:4], ctxs):
        batch.add(params, ctx)
    handle = family_model.module.register_forward_pre_hook(record, with_kwargs=True)
    outcomes: dict[str, Any] = {}
    try:
        steps = 0
        while len(batch) or steps < 2:
            if steps == 2:
                batch.add(jobs[4], ctxs[4])
            for ctx, outcome in batch.step():
                outcomes[ctx.job_id] = outcome
            steps += 1
    finally:
        handle.remove()
    # Eight rows at first (`same` six times, "Hi!" twice): two distinct prompts; then the one joining.
    assert prefilled[:2] == [2, 1]
    for i, (expected, partials) in enumerate(alone):
        assert as_plain(outcomes[str(i)]) == expected, f"job {i}"
        assert ctxs[i].partials == partials, f"job {i}: its partial events"
    # Greedy, a prompt's copies are its one completion.
    greedy = _alone(family_model, GenerateParams(prompts=[same], n=3, max_tokens=4))[0]
    assert greedy["completions"] == greedy_once["completions"] * 3


def test_a_short_job_ends_while_a_long_one_goes_on(llama: Model) -> None:
    batch = Generation(llama)
    told: list[tuple[str, int]] = []  # (job, tokens so far), in the order the batch told them

    class Told(Recorder):
        def progress(self, done: int, total: int | None = None, unit: str | None = None) -> None:
            super().progress(done, total, unit)
            told.append((self.job_id, done))

    long, short, one = Told("long"), Told("short"), Told("one")
    batch.add(GenerateParams(prompts=["Once upon a time"], max_tokens=30), long)
    batch.step()
    batch.step()
    joined = {"short": GenerateParams(prompts=["Hi"], max_tokens=2), "one": GenerateParams(prompts=["Hey"], max_tokens=1)}
    batch.add(joined["short"], short)
    batch.add(joined["one"], one)
    ended_at: dict[str, int] = {}
    outcomes: dict[str, Any] = {}
    step = 2
    while len(batch):
        step += 1
        for ctx, outcome in batch.step():
            ended_at[ctx.job_id] = step
            outcomes[ctx.job_id] = outcome
    # Joined at step 3: the newcomers' first tokens before the long job's third, then the short
    # job's second with it; the one-token job leaves before that step's decoding.
    assert told[2:6] == [("short", 1), ("one", 1), ("long", 3), ("short", 2)]
    assert ended_at == {"short": 3, "one": 3, "long": 30}
    assert long.progressed[-1] == (30, 30)
    for name, params in joined.items():
        assert as_plain(outcomes[name]) == _alone(llama, params)[0], name


def test_cancelling_one_generation_leaves_the_others_unchanged(llama: Model) -> None:
    jobs = _generate_jobs()[:3]
    alone = [_alone(llama, p)[0] for p in jobs]
    batch = Generation(llama)
    ctxs = [Recorder(str(i)) for i in range(3)]
    for params, ctx in zip(jobs, ctxs):
        batch.add(params, ctx)
    outcomes: dict[str, Any] = {}
    for ctx, outcome in batch.step() + batch.step():
        outcomes[ctx.job_id] = outcome
    ctxs[1].cancel_now = True
    while len(batch):
        for ctx, outcome in batch.step():
            outcomes[ctx.job_id] = outcome
    assert isinstance(outcomes["1"], Cancelled)
    assert len(ctxs[1].progressed) == 2  # it stopped at the step after its cancel
    assert as_plain(outcomes["0"]) == alone[0]
    assert as_plain(outcomes["2"]) == alone[2]


def test_the_batch_of_one_is_the_tool(llama: Model) -> None:
    params = GenerateParams(prompts=["Hello", "abc"], max_tokens=5, temperature=1.0, seed=1)
    assert as_plain(run_alone(Generation(llama), params, Recorder())) == _alone(llama, params)[0]


# -- through the gateway ---------------------------------------------------------------


def _concurrently(calls: list[Any]) -> list[Any]:
    barrier = threading.Barrier(len(calls))

    def go(call: Any) -> Any:
        barrier.wait()
        return call()

    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(go, calls))


def _data(stream: Stream) -> Any:
    assert stream.terminal["event"] == "data", stream.terminal
    return stream.terminal["data"]


@pytest.mark.parametrize("max_batch_size", [32, 1])
def test_concurrent_clients_batch_and_get_their_own_results(serve: Any, max_batch_size: int) -> None:
    server = serve(tools=[double], max_batch_size=max_batch_size, batch_wait_ms=50)
    worker = server.backend.workers[0]
    prompts = [f"prompt number {i} " * (i % 4 + 1) for i in range(12)]
    alone = [_data(run_stream(server.url, "predict", {"prompt": p, "top_k": 3})) for p in prompts]
    worker.batch_sizes.clear()
    together = _concurrently(
        [lambda p=p: _data(run_stream(server.url, "predict", {"prompt": p, "top_k": 3})) for p in prompts]
    )
    for expected, got in zip(alone, together):
        assert_close(got, expected)
    if max_batch_size == 1:
        assert set(worker.batch_sizes) == {1}
    else:
        assert max(worker.batch_sizes) > 1, worker.batch_sizes

    # A bad input among good ones: its own tool_error, the others their results.
    outcomes = _concurrently(
        [lambda x=x: run_stream(server.url, "double", {"x": x}).terminal for x in [1.0, -1.0, 2.0, 3.0]]
    )
    assert [o["event"] for o in outcomes] == ["data", "error", "data", "data"]
    assert outcomes[1]["data"]["error"]["code"] == "tool_error"
    assert "negative input" in outcomes[1]["data"]["error"]["message"]
    assert [o["data"]["y"] for i, o in enumerate(outcomes) if i != 1] == [2.0, 4.0, 6.0]


_held = threading.Event()


@tool
def hold(model: Model, params: Number, ctx: Context) -> Doubled:
    """x, once the test lets go (a tool that does not batch, to keep the worker busy)."""
    _held.wait(30)
    return Doubled(params.x)


def test_a_lone_job_waits_for_company_unless_one_client_sends_one_job_after_another(serve: Any) -> None:
    wait_s = 1.5
    server = serve(tools=[double, hold], batch_wait_ms=wait_s * 1000)
    worker = server.backend.workers[0]

    def timed(x: float) -> float:
        started = time.monotonic()
        assert _data(run_stream(server.url, "double", {"x": x})) == {"y": 2 * x}
        return time.monotonic() - started

    # Nothing known of the tool yet: its first job waits for company.
    assert timed(1.0) >= wait_s
    # The next comes to an idle worker after a lone job: one client's next job, run at once.
    assert timed(2.0) < wait_s / 2
    assert timed(3.0) < wait_s / 2
    # Jobs that queue behind other work are gathered, and batched.
    _held.clear()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        held = pool.submit(run_stream, server.url, "hold", {"x": 0.0})
        wait_until(lambda: len(worker.running) == 1, 10, "the hold job to run")
        doubles = [pool.submit(run_stream, server.url, "double", {"x": x}) for x in (4.0, 5.0)]
        wait_until(lambda: len(worker.queue) == 2, 10, "both jobs to queue")
        worker.batch_sizes.clear()
        _held.set()
        assert _data(held.result(30)) == {"y": 0.0}
        assert [_data(f.result(30)) for f in doubles] == [{"y": 8.0}, {"y": 10.0}]
    assert worker.batch_sizes == {2: 1}
    # After a batch of several, a lone job waits for company again.
    assert timed(6.0) >= wait_s


def test_a_generation_joins_a_running_batch_and_one_is_cancelled(serve: Any) -> None:
    server = serve()
    worker = server.backend.workers[0]
    long_params = {"prompts": ["Once upon a time"], "max_tokens": 150}
    expected_short = _data(run_stream(server.url, "generate", {"prompts": ["Hi"], "max_tokens": 4}))
    results: dict[str, Any] = {}
    job_ids: dict[str, str] = {}

    def follow(name: str, params: dict[str, Any]) -> None:
        with open_stream(server.url, "generate", params) as response:
            job_ids[name] = response.headers["x-job-id"]
            results[name] = parse_sse(response.read())[-1]

    # Each decoding step held 20 ms: the long jobs decode for 3 s or more, however fast the machine, and
    # the second one joins the first while it runs.
    hook = worker.model.module.register_forward_pre_hook(lambda *_: time.sleep(0.02))
    threads = [threading.Thread(target=follow, args=("long", long_params)), threading.Thread(target=follow, args=("doomed", long_params))]
    for t in threads:
        t.start()
    wait_until(lambda: len(worker.running) == 2, 20, "both long jobs to run")
    # A short job arrives while they decode: it joins their batch and ends long before them.
    started = time.monotonic()
    assert _data(run_stream(server.url, "generate", {"prompts": ["Hi"], "max_tokens": 4})) == expected_short
    assert len(worker.running) == 2, "the long jobs still run"
    assert time.monotonic() - started < 10
    httpx.delete(f"{server.url}/jobs/{job_ids['doomed']}")
    for t in threads:
        t.join(60)
    hook.remove()
    assert results["doomed"]["event"] == "error" and results["doomed"]["data"]["error"]["code"] == "cancelled"
    assert results["long"]["event"] == "data"
    assert results["long"]["data"]["usage"]["completion_tokens"] == 150
    assert max(worker.batch_sizes) >= 3


def test_one_worker_per_device(serve: Any) -> None:
    server = serve(tools=[], devices=["cpu", "cpu"], max_batch_size=1)
    workers = server.backend.workers
    assert len(workers) == 2 and workers[0].model is not workers[1].model
    params = {"prompts": ["Once upon a time"], "max_tokens": 100}
    threads = [threading.Thread(target=run_stream, args=(server.url, "generate", params)) for _ in range(2)]
    for t in threads:
        t.start()
    # Unbatched, two jobs still run at once: one on each device's worker.
    wait_until(lambda: all(w.busy for w in workers), 20, "both workers to run a job")
    for t in threads:
        t.join(60)


@pytest.mark.parametrize(
    "params",
    [
        GenerateParams(prompts=["Once upon a time", "Hi"], max_tokens=20),
        GenerateParams(prompts=["Once upon a time"], n=3, max_tokens=20, temperature=1.0, top_p=0.9, seed=11, stop=["e"]),
    ],
    ids=["greedy", "sampled"],
)
def test_a_member_preempted_and_taken_up_again_completes_as_alone(llama: Model, params: GenerateParams) -> None:
    """Generation is Preemptible: a member taken out between steps keeps its tokens and sampler, and
    back (in the same batch beside others, or a fresh one) completes as it would have, its partials
    adding up to its tokens, each once."""
    import torch

    with torch.inference_mode():
        alone_ctx = Recorder("alone")
        alone = run_alone(Generation(llama), params, alone_ctx)
        for fresh in (False, True):
            batch, ctx = Generation(llama), Recorder("member")
            batch.add(params, ctx)
            batch.add(GenerateParams(prompts=["another job"], max_tokens=30), Recorder("other"))
            for _ in range(5):
                assert all(c is not ctx for c, _ in batch.step())
            ((out, kept),) = batch.preempt({ctx})
            assert out is ctx and batch.preempt({ctx}) == []
            if fresh:
                batch = Generation(llama)
            batch.step()  # a step without it
            back = Recorder("back")
            batch.resume(kept, back)
            results: dict[str, Any] = {}
            while len(batch):
                for c, outcome in batch.step():
                    results[c.job_id] = outcome
            assert results["back"] == alone, fresh
            assert ctx.tokens_in + back.tokens_in == alone_ctx.tokens_in and ctx.tokens_out + back.tokens_out == alone_ctx.tokens_out
            streamed = [tok for p in ctx.partials + back.partials for tok in p["token_ids"]]
            assert len(streamed) == alone.usage.completion_tokens
