"""A job that goes on from its last finished window (gateway/checkpoints.py): a chunked run keeps
each chunk's outputs in the job's checkpoint, and a run after its engine died skips them. Tested
on a real engine process killed mid-job, its numbers against windows computed here in plain
transformers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import redis
from safetensors.numpy import load as load_safetensors

from gateway.checkpoints import Checkpoint
from gateway.encoding import to_json
from gateway.errors import ParamError
from gateway.tools import embed, fill_mask, loglikelihood, logprobs, pseudo_loglikelihood, windows
from gateway.tools.base import Cancelled
from gateway.tools.batching import WindowItem
from gateway.tools.windows import Sizes, Stitch
from tests.conftest import parse_sse, run_stream, wait_until
from tests.test_engines import copies, start_gateway
from tests.support.processes import ServeProcess
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401
from tests.test_windows import protein, strided_logprobs, windowed_states


@pytest.fixture(scope="module")
def esm_path(tiny: Callable[..., Path]) -> Path:
    return tiny("esm_mlm")


@pytest.fixture(scope="module")
def model(esm_path: Path) -> Any:
    """The tiny ESM-2 as a backend serves it, for runs of a tool's work in this process."""
    from backends import loading

    return loading.load(loading.resolve(str(esm_path)), "cpu", "float32")


class Ctx:
    """A run's context with a checkpoint: what an engine's job gives its run."""

    job_id = "job"
    cancelled = False

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self.frames: list[tuple[int, int | None, str | None]] = []
        self.partials: list[Any] = []

    def partial(self, obj: Any) -> None:
        self.partials.append(obj)

    def count(self, tokens_in: int = 0, tokens_out: int = 0) -> None:
        pass

    def progress(self, done: int, total: int | None = None, unit: str | None = None) -> None:
        self.frames.append((done, total, unit))

    def raise_if_cancelled(self) -> None:
        pass


def same(a: embed.EmbedResult, b: embed.EmbedResult) -> bool:
    """Equal results, but for the last bits that how many rows shared a pass may move."""
    assert a.plans == b.plans and a.embeddings is not None and b.embeddings is not None
    return all(np.abs(np.asarray(x) - np.asarray(y)).max() <= 1e-6 for x, y in zip(a.embeddings, b.embeddings, strict=True))


def journal(checkpoint: Checkpoint) -> list[bytes]:
    """A checkpoint's journal, record by record (each its length and its pickle)."""
    data = Path(checkpoint.path).read_bytes()
    records, at = [], 0
    while at < len(data):
        n = int.from_bytes(data[at : at + 8], "little")
        records.append(data[at : at + 8 + n])
        at += 8 + n
    return records


def counted(work: Any, ran: list[Any]) -> Any:
    """`work` whose runs append their chunk's items to `ran`."""
    return dataclasses.replace(work, run=lambda m, jobs, chunk: ran.append(list(chunk.items)) or work.run(m, jobs, chunk))


def test_a_run_given_what_a_run_before_it_finished_computes_only_the_rest_and_gives_the_same(model: Any, tmp_path: Path) -> None:
    params = embed.EmbedParams(texts=[protein(2000, seed=1), protein(300, seed=2)], window=100, overlap=30, pooling="mean")
    whole = embed.work.many(model, [params], [Ctx(Checkpoint(str(tmp_path / "none")))])[0]

    first = Checkpoint(str(tmp_path / "cp"))
    os.mkdir(first.folder)
    ran: list[int] = []
    counting = dataclasses.replace(embed.work, run=lambda m, jobs, chunk: ran.append(len(chunk.items)) or embed.work.run(m, jobs, chunk))
    ctx = Ctx(first)
    assert same(counting.many(model, [params], [ctx])[0], whole)
    windows_total = ctx.frames[-1][1]
    assert ctx.frames[-1] == (windows_total, windows_total, "windows") and sum(ran) == windows_total

    # A run killed mid-way leaves its first records, and a torn one: the next run keeps the whole
    # ones, drops the torn one, and computes the rest only.
    records = journal(first)
    assert len(records) >= 3
    Path(first.path).write_bytes(b"".join(records[:2]) + records[2][:20])
    kept = sum(len(pickle.loads(r[8:])) for r in records[:2])

    ran.clear()
    again = Ctx(Checkpoint(first.folder, resumed=True))
    assert same(counting.many(model, [params], [again])[0], whole)
    assert sum(ran) == windows_total - kept  # the finished windows were not run again
    assert again.frames[0] == (kept, windows_total, "windows")  # counted once: the first frame is where it was
    assert [d for d, _, _ in again.frames] == sorted(d for d, _, _ in again.frames)


@pytest.fixture(scope="module")
def causal(tiny_model_path: Path) -> Any:
    """The tiny Llama (a byte tokenizer, a context of 256) as a backend serves it."""
    from backends import loading

    return loading.load(loading.resolve(str(tiny_model_path)), "cpu", "float32")


# 3,150 tokens (a byte each, after the BOS): in windows of 100 overlapping by 30, 45 windows, in three
# passes of at most 16 (windows.PASS_ROWS).
LONG_TEXT = "the quick brown fox jumps over the lazy dog. " * 70
STRIDE = {"window": 100, "overlap": 30}


def masked(n: int, every: int, seed: int) -> str:
    """A protein of `n` residues with a mask every `every`."""
    residues = list(protein(n, seed=seed))
    for q in range(every // 2, n, every):
        residues[q] = "<mask>"
    return "".join(residues)


@pytest.mark.parametrize("tool", ["logprobs", "fill_mask"])
def test_a_scorer_over_windows_goes_on_from_its_last_finished_pass_and_gives_the_same(
    request: pytest.FixtureRequest, tool: str, tmp_path: Path
) -> None:
    """`logprobs` over 45 windows, `fill_mask` over the 43 windows of a protein that hold its masks:
    three passes of at most 16 windows."""
    if tool == "logprobs":
        model, work = request.getfixturevalue("causal"), logprobs.work
        params: Any = logprobs.LogprobsParams(prompts=[LONG_TEXT], top=2, next_token=True, **STRIDE)
        passes = [16, 16, 13]
    else:
        model, work = request.getfixturevalue("model"), fill_mask.work
        params = fill_mask.FillMaskParams(texts=[masked(3000, 60, seed=12)], top_k=3, stitch="mean", **STRIDE)
        passes = [16, 16, 11]
    whole = msgspec.json.encode(work.many(model, [params], [Ctx(Checkpoint(str(tmp_path / "none")))])[0])
    first = Checkpoint(str(tmp_path / "cp"))
    os.mkdir(first.folder)
    ran: list[Any] = []
    ctx = Ctx(first)
    assert msgspec.json.encode(counted(work, ran).many(model, [params], [ctx])[0]) == whole
    total = sum(passes)
    assert [len(items) for items in ran] == passes and ctx.frames[-1] == (total, total, "windows")

    # Killed in its third pass, after a torn record of its second: the next run keeps the first pass's
    # outputs, runs the other two, and gives the same result, bit for bit.
    records = journal(first)
    assert len(records) == 3
    Path(first.path).write_bytes(records[0] + records[1][:20])
    ran.clear()
    again = Ctx(Checkpoint(first.folder, resumed=True))
    assert msgspec.json.encode(counted(work, ran).many(model, [params], [again])[0]) == whole
    assert [len(items) for items in ran] == passes[1:]
    assert again.frames[0] == (16, total, "windows") and [d for d, _, _ in again.frames] == [16, 32, total]


def test_logprobs_partials_are_each_windows_scores_in_order_and_a_run_that_goes_on_sends_them_again_first(
    causal: Any, tmp_path: Path
) -> None:
    texts = [LONG_TEXT, LONG_TEXT[:700]]
    params = logprobs.LogprobsParams(prompts=texts, top=2, partials=True, **STRIDE)
    checkpoint = Checkpoint(str(tmp_path / "cp"))
    os.mkdir(checkpoint.folder)
    ctx = Ctx(checkpoint)
    result = logprobs.work.many(causal, [params], [ctx])[0]
    for i, scored in enumerate(result.sequences):
        parts = [p for p in ctx.partials if p.sequence == i]
        assert parts and [p.start for p in parts] == [1, *(p.end for p in parts[:-1])] and parts[-1].end == len(scored.token_ids)
        assert [v for p in parts for v in p.logprobs] == scored.logprobs[1:]
        assert [t for p in parts for t in p.token_ids] == scored.token_ids[1:]
        assert [t for p in parts for t in p.tokens] == scored.tokens[1:]
        assert [t for p in parts for t in p.top] == scored.top
    assert [p.sequence for p in ctx.partials] == sorted(p.sequence for p in ctx.partials)

    records = journal(checkpoint)
    Path(checkpoint.path).write_bytes(records[0])
    again = Ctx(Checkpoint(checkpoint.folder, resumed=True))
    assert msgspec.json.encode(logprobs.work.many(causal, [params], [again])[0]) == msgspec.json.encode(result)
    assert msgspec.json.encode(again.partials) == msgspec.json.encode(ctx.partials)


def test_pseudo_loglikelihood_partials_are_its_positions_scores_in_order_and_sent_again_first_when_it_goes_on(
    model: Any, tmp_path: Path
) -> None:
    sequences = [protein(700, seed=13), protein(300, seed=14)]
    params = pseudo_loglikelihood.PseudoLoglikelihoodParams(sequences=sequences, per_position=True, partials=True, **STRIDE)
    checkpoint = Checkpoint(str(tmp_path / "cp"))
    os.mkdir(checkpoint.folder)
    ctx = Ctx(checkpoint)
    result = pseudo_loglikelihood.work.many(model, [params], [ctx])[0]
    assert result.per_position is not None and result.tokens is not None
    for s, sequence in enumerate(sequences):
        parts = [p for p in ctx.partials if p.sequence == s]
        assert [p.start for p in parts] == [0, *(p.end for p in parts[:-1])] and parts[-1].end == len(sequence)
        assert [v for p in parts for v in p.scores] == result.per_position[s]
        assert "".join(t for p in parts for t in p.tokens) == sequence
    # A window's share an event: the same events whichever chunks its copies fell into, beside another
    # job's (of other lengths) or alone, or going on from its checkpoint.
    shares = [windows.shares(windows.plan(len(q), Sizes(100, 30, Stitch.CENTER)), Stitch.CENTER) for q in sequences]
    assert [(p.sequence, p.start, p.end) for p in ctx.partials] == [(i, w.start, w.end) for i, share in enumerate(shares) for w in share]
    other = pseudo_loglikelihood.PseudoLoglikelihoodParams(sequences=[protein(200, seed=15)])  # rows longer: planned first
    beside = Ctx(Checkpoint(str(tmp_path / "none")))
    stepped(pseudo_loglikelihood.work, model, [(other, Ctx(Checkpoint(str(tmp_path / "none2")))), (params, beside)])
    assert [(p.sequence, p.start, p.end, p.tokens) for p in beside.partials] == [(p.sequence, p.start, p.end, p.tokens) for p in ctx.partials]
    assert max(abs(a - b) for p, q in zip(beside.partials, ctx.partials) for a, b in zip(p.scores, q.scores)) <= 1e-4  # padding apart

    Path(checkpoint.path).write_bytes(b"".join(journal(checkpoint)[:4]))
    again = Ctx(Checkpoint(checkpoint.folder, resumed=True))
    assert to_json(pseudo_loglikelihood.work.many(model, [params], [again])[0]) == to_json(result)
    assert msgspec.json.encode(again.partials) == msgspec.json.encode(ctx.partials)

    for bad, field, why in [
        ({"window": None, "overlap": None}, "partials", "only with window"),
        ({"stitch": "mean"}, "partials", "use center or left"),
        ({"sequences": sequences[:1], "part": [0, 2]}, "part", "not with partials"),
    ]:
        with pytest.raises(ParamError) as refused:
            pseudo_loglikelihood.check(model, msgspec.structs.replace(params, **bad))
        assert refused.value.field == field and why in refused.value.message


def test_logprobs_partials_are_refused_without_window_and_with_file(causal: Any) -> None:
    for params, why in [
        (logprobs.LogprobsParams(prompts=["hello"], partials=True), "only with window"),
        (logprobs.LogprobsParams(prompts=["hello"], partials=True, file="tsv", **STRIDE), "not with file"),
    ]:
        with pytest.raises(ParamError) as refused:
            logprobs.check(causal, params)
        assert refused.value.field == "partials" and why in refused.value.message


def test_logprobs_over_windows_run_a_pass_a_step_and_a_cancel_stops_them_at_the_next(causal: Any) -> None:
    """A pass a step (`InSteps`): a worker runs another job between two, and a job cancelled stops
    before its next pass."""
    params = logprobs.LogprobsParams(prompts=[LONG_TEXT], **STRIDE)
    ran: list[Any] = []
    work = counted(logprobs.work, ran)
    batch = work.batch(causal)
    batch.add(params, ctx := Ctx(None))  # type: ignore[arg-type]
    steps = [batch.step() for _ in range(3)]
    assert steps[:2] == [[], []] and len(ran) == 3
    assert steps[2][0][0] is ctx and isinstance(steps[2][0][1], logprobs.LogprobsResult)

    batch.add(params, ctx := Ctx(None))  # type: ignore[arg-type]
    ran.clear()
    assert batch.step() == []
    ctx.cancelled = True
    ((ended, outcome),) = batch.step()
    assert ended is ctx and isinstance(outcome, Cancelled) and len(ran) == 1


def test_loglikelihood_over_windows_runs_only_the_windows_that_score_its_continuation(
    causal: Any, tiny_model_path: Path, tmp_path: Path
) -> None:
    """A prompt of 3,150 tokens before a continuation of 24: of 45 windows, only those where a
    continuation token is first held run; its score is theirs, as computed here in plain
    transformers; and a run that goes on after its engine died keeps them."""
    continuation = " and the cat sat on a mat"
    params = loglikelihood.LoglikelihoodParams(prompts=[LONG_TEXT], continuations=[continuation], **STRIDE)
    ids, cut, want = strided_logprobs(tiny_model_path, LONG_TEXT + continuation, **STRIDE)
    n, prompt = len(continuation), len(ids) - 1 - len(continuation)  # own tokens: a byte each
    holding = sorted({next(w for w, (_, end) in enumerate(cut) if end > q) for q in range(prompt, prompt + n)})
    ran: list[Any] = []
    first = Checkpoint(str(tmp_path / "cp"))
    os.mkdir(first.folder)
    out = counted(loglikelihood.work, ran).many(causal, [params], [Ctx(first)])[0]
    assert len(cut) == 45 and 1 <= len(holding) <= 2
    assert ran == [[(0, WindowItem(0, w)) for w in holding]]
    assert out.ll[0] == pytest.approx(sum(want[-n:]), abs=1e-4)  # type: ignore[arg-type]
    assert out.plans is not None and out.plans[0].windows == cut

    ran.clear()
    again = counted(loglikelihood.work, ran).many(causal, [params], [Ctx(Checkpoint(first.folder, resumed=True))])[0]
    assert again == out and ran == []  # every window it ran was kept


@pytest.fixture(scope="module")
def engine(esm_path: Path, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, Path]]:
    """A gateway with the models (`esm`, the default, and the tiny Llama, `text`) in engine processes,
    its result files in `spool`."""
    tmp = tmp_path_factory.mktemp("engine")
    spool = tmp / "spool"
    spool.mkdir()
    gateway = start_gateway(tmp, f"esm={esm_path}", f"text={tiny_model_path}", extra=("--result-spool", str(spool)))
    yield gateway, spool
    gateway.stop()


@pytest.mark.parametrize("file", [None, "safetensors"])
def test_a_job_whose_engine_is_killed_mid_way_goes_on_from_its_last_finished_window_in_the_next(
    engine: tuple[ServeProcess, Path], esm_path: Path, tmp_path: Path, file: str | None
) -> None:
    """`embed_dying` (tests/support/engine_tools.py) is `embed` whose engine is SIGKILLed once, at
    window 40 of 42: the job is queued again, runs on the new engine from its checkpoint, and
    ends once with what the windows computed here give; its progress never goes back."""
    gateway, spool = engine
    url = gateway.url
    before = copies(gateway)[0]
    sequence = protein(3000, seed=3)
    params: dict[str, Any] = {"texts": [sequence], "window": 100, "overlap": 30, "pooling": "per_token"}
    if file:
        params["file"] = file
    else:
        params["partials"] = True
    marker = tmp_path / "died"
    s = run_stream(url, "embed_dying", params | {"die_at": 40, "marker": str(marker)})
    assert marker.exists() and s.terminal is not None and s.terminal["event"] == "data", s.events[-3:]
    assert [e["event"] for e in s.events].count("data") + [e["event"] for e in s.events].count("error") == 1
    after = copies(gateway)[0]
    assert after["restarts"] == before["restarts"] + 1 and after["pid"] != before["pid"]

    statuses = [e["data"] for e in s.of("status")]
    told = next(i for i, f in enumerate(statuses) if "goes on from its last finished piece" in f.get("message", ""))
    assert statuses[told]["status"] == "QUEUED" and "SIGKILL" in statuses[told]["message"]
    frames = [f["progress"] for f in statuses if "progress" in f]
    cut = windows.plan(3000, Sizes(100, 30, Stitch.CENTER))
    assert frames[-1] == {"done": len(cut), "total": len(cut), "unit": "windows"}
    assert [f["done"] for f in frames] == sorted(f["done"] for f in frames)
    # On the new engine it went on from its checkpoint: 32 windows (two chunks of 16) were kept.
    resumed = [f["progress"]["done"] for f in statuses[told:] if "progress" in f]
    assert resumed[0] >= 32, resumed

    want = windowed_states(esm_path, sequence, 100, 30, "center")
    out = s.terminal["data"]
    if file:
        job_id = s.events[0]["data"]["job_id"]
        arrays = load_safetensors(httpx.get(f"{url}/jobs/{job_id}/files/embeddings.safetensors").content)
        got = arrays["embeddings.0"]
        assert (arrays["context.0"] == windows.context(cut, Stitch.CENTER)).all()
    else:
        got = np.array(out["embeddings"][0], dtype=np.float32)
        # Each window's rows streamed once, in order, across the engine's death: those the dead
        # engine had sent are not sent again.
        parts = [e["data"] for e in s.of("partial")]
        shares = windows.shares(cut, Stitch.CENTER)
        assert [(p["text"], p["start"], p["end"]) for p in parts] == [(0, share.start, share.end) for share in shares]
        assert [row for p in parts for row in p["embeddings"]] == out["embeddings"][0]
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5
    assert out["plans"][0]["windows"] == [list(w) for w in cut]

    # The checkpoint went with the job: nothing is left of it in the gateway's folder.
    pattern = str(spool / f"streamgate-files-{gateway.proc.pid}-*" / "checkpoints" / "*")
    wait_until(lambda: glob.glob(pattern) == [], timeout=10, what="the checkpoint to be removed")


def test_logprobs_whose_engine_is_killed_mid_way_go_on_from_their_last_finished_pass_in_the_next(
    engine: tuple[ServeProcess, Path], tiny_model_path: Path, tmp_path: Path
) -> None:
    """`logprobs_dying` (tests/support/engine_tools.py) is `logprobs` whose engine is SIGKILLed once,
    before its pass holding window 20 (the second of three): the job goes on in the new engine
    from its first pass, and ends once with each token's score as computed here."""
    gateway, _ = engine
    before = copies(gateway, "text")[0]
    marker = tmp_path / "died"
    params = {"model": "text", "prompts": [LONG_TEXT], "next_token": True, "partials": True, **STRIDE}
    s = run_stream(gateway.url, "logprobs_dying", params | {"die_at": 20, "marker": str(marker)})
    assert marker.exists() and s.terminal is not None and s.terminal["event"] == "data", s.events[-3:]
    assert [e["event"] for e in s.events].count("data") + [e["event"] for e in s.events].count("error") == 1
    after = copies(gateway, "text")[0]
    assert after["restarts"] == before["restarts"] + 1 and after["pid"] != before["pid"]

    statuses = [e["data"] for e in s.of("status")]
    told = next(i for i, f in enumerate(statuses) if "goes on from its last finished piece" in f.get("message", ""))
    frames = [f["progress"] for f in statuses if "progress" in f]
    assert frames[-1] == {"done": 45, "total": 45, "unit": "windows"}
    assert [f["done"] for f in frames] == sorted(f["done"] for f in frames)
    resumed = [f["progress"]["done"] for f in statuses[told:] if "progress" in f]
    assert resumed[0] == 16, resumed  # its first pass, kept

    ids, cut, want = strided_logprobs(tiny_model_path, LONG_TEXT, **STRIDE)
    (scored,) = s.terminal["data"]["sequences"]
    assert scored["token_ids"] == ids and scored["plan"]["windows"] == [list(w) for w in cut]
    assert scored["logprobs"][0] is None and max(abs(a - b) for a, b in zip(scored["logprobs"][1:], want[1:])) <= 1e-5
    assert scored["next_token"]["id"] >= 0
    # Each window's scores streamed once, in order, across the engine's death.
    parts = [e["data"] for e in s.of("partial")]
    assert len(parts) == 45 and [p["start"] for p in parts] == [1, *(p["end"] for p in parts[:-1])] and parts[-1]["end"] == len(ids)
    assert [v for p in parts for v in p["logprobs"]] == scored["logprobs"][1:]
    assert [t for p in parts for t in p["token_ids"]] == ids[1:]


def test_partials_are_each_windows_final_rows_in_order_and_a_run_that_goes_on_sends_its_finished_ones_first(
    model: Any, tmp_path: Path
) -> None:
    texts = [protein(1000, seed=4), protein(500, seed=5)]
    params = embed.EmbedParams(texts=texts, window=100, overlap=30, pooling="per_token", normalize=True, partials=True)
    checkpoint = Checkpoint(str(tmp_path / "cp"))
    os.mkdir(checkpoint.folder)
    ctx = Ctx(checkpoint)
    result = embed.work.many(model, [params], [ctx])[0]
    for i, text in enumerate(texts):
        parts = [p for p in ctx.partials if p.text == i]
        # In order, each position once, and each row as the result has it.
        assert [(p.start, p.end) for p in parts] == list(zip([0, *(p.end for p in parts[:-1])], [p.end for p in parts]))
        assert parts[-1].end == len(text)
        rows = np.concatenate([np.asarray(p.embeddings) for p in parts])
        assert rows.tolist() == np.asarray(result.embeddings[i]).tolist()
        assert [t for p in parts for t in p.tokens] == result.tokens[i]

    again = Ctx(Checkpoint(checkpoint.folder, resumed=True))
    assert same(embed.work.many(model, [params], [again])[0], result)
    assert [(p.text, p.start, p.end) for p in again.partials] == [(p.text, p.start, p.end) for p in ctx.partials]


class FileCtx(Ctx):
    """A context whose job writes result files, where an engine's job writes them: its checkpoint's folder."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        from gateway.jobs import ResultFiles

        super().__init__(checkpoint)
        self.files = ResultFiles(self.job_id)
        self.files.folder, self.files.resumed = checkpoint.folder, checkpoint.resumed

    def file(self, name: str) -> Any:
        return self.files.open(name)


def failing_when_batched(after: int) -> Any:
    """embed's work, whose chunk number `after` fails while several jobs share the batch (each then runs again alone)."""
    calls: list[int] = []

    def run(model: Any, jobs: list[Any], chunk: Any) -> list[Any]:
        calls.append(len(jobs))
        if len(jobs) > 1 and len(calls) == after:
            raise RuntimeError("the batch's chunk failed")
        return embed.work.run(model, jobs, chunk)

    return dataclasses.replace(embed.work, run=run)


def stepped(work: Any, model: Any, members: list[tuple[Any, Any]]) -> list[Any]:
    """Run jobs as one batch of `work`, a chunk a step, as a worker does: each member's outcome."""
    batch = work.batch(model)
    for params, ctx in members:
        batch.add(params, ctx)
    ended: dict[int, Any] = {}
    while len(ended) < len(members):
        for ctx, outcome in batch.step():
            ended[next(i for i, (_, c) in enumerate(members) if c is ctx)] = outcome
    return [ended[i] for i in range(len(members))]


def test_a_job_run_again_alone_after_its_batch_failed_sends_each_windows_partial_once(model: Any, tmp_path: Path) -> None:
    mine = embed.EmbedParams(texts=[protein(1500, seed=6)], window=100, overlap=30, pooling="per_token", partials=True)
    other = embed.EmbedParams(texts=[protein(1200, seed=7)], window=100, overlap=30)
    ctx = Ctx(Checkpoint(str(tmp_path / "none")))
    result, _ = stepped(failing_when_batched(after=2), model, [(mine, ctx), (other, Ctx(Checkpoint(str(tmp_path / "none2"))))])
    shares = windows.shares(windows.plan(1500, Sizes(100, 30, Stitch.CENTER)), Stitch.CENTER)
    assert ctx.partials and ctx.partials[0].start == 0
    assert [(p.start, p.end) for p in ctx.partials] == [(s.start, s.end) for s in shares]
    assert [row for p in ctx.partials for row in np.asarray(p.embeddings).tolist()] == np.asarray(result.embeddings[0]).tolist()


def test_a_resumed_job_whose_batch_fails_keeps_the_rows_its_files_hold(model: Any, tmp_path: Path) -> None:
    """Going on from its checkpoint, a job writing a file reopens it as it is, even when it runs again
    alone after its batch failed: the rows finished before the crash stay; and its progress, which
    had reached the end, does not go back."""
    from safetensors.numpy import load_file

    params = embed.EmbedParams(texts=[protein(2000, seed=8)], window=100, overlap=30, pooling="per_token", file="safetensors")
    first = Checkpoint(str(tmp_path / "cp"))
    os.mkdir(first.folder)
    done = embed.work.many(model, [params], [FileCtx(first)])[0]
    path = os.path.join(first.folder, "job.embeddings.safetensors")
    whole = load_file(path)
    assert done.files and whole["embeddings.0"].shape == (2000, 32)

    # Every chunk was journaled (the engine died ending the job): the run going on counts them done at once.
    resumed = FileCtx(Checkpoint(first.folder, resumed=True))
    other = embed.EmbedParams(texts=[protein(900, seed=9)], window=100, overlap=30)
    stepped(failing_when_batched(after=1), model, [(params, resumed), (other, Ctx(Checkpoint(str(tmp_path / "none"))))])
    total = resumed.frames[-1][1]
    assert [d for d, _, _ in resumed.frames] == [total] * len(resumed.frames)
    again = load_file(path)
    assert again.keys() == whole.keys() and all((again[k] == whole[k]).all() for k in whole)

    # Half the chunks journaled: the rest computed, the first half's rows kept from the file.
    data = Path(first.path).read_bytes()
    cut = at = 0
    for _ in range(2):
        at += 8 + int.from_bytes(data[at : at + 8], "little")
        cut = at
    Path(first.path).write_bytes(data[:cut])
    half = FileCtx(Checkpoint(first.folder, resumed=True))
    stepped(failing_when_batched(after=2), model, [(params, half), (other, Ctx(Checkpoint(str(tmp_path / "none3"))))])
    again = load_file(path)
    assert all(np.abs(again[k] - whole[k]).max() <= 1e-6 for k in whole)
    assert [d for d, _, _ in half.frames] == sorted(d for d, _, _ in half.frames)


@pytest.fixture
def shared(esm_path: Path, tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[tuple[Callable[..., ServeProcess], Path]]:
    """`start(*args)`: a gateway with the model in an engine process and the test Redis as its store,
    every one with the same result spool, and a second of outage grace (a replica silent for
    1 + 3 heartbeats counts as gone); all stopped after the test, so that no other test's can take
    its jobs over."""
    tmp = tmp_path_factory.mktemp("shared")
    spool = tmp / "spool"
    spool.mkdir()
    started: list[ServeProcess] = []

    def start(*more: str) -> ServeProcess:
        extra = ("--result-spool", str(spool), "--store", redis_server.url, "--store-outage-grace", "1", "--drain-timeout", "0", *more)
        started.append(start_gateway(tmp, f"esm={esm_path}", extra=extra))
        return started[-1]

    yield start, spool
    for gateway in started:
        gateway.stop()


def follow(url: str, job_id: str, last_event_id: str) -> list[dict[str, Any]]:
    """The job's events after `last_event_id`, to its end, as a client reconnecting with it reads them."""
    with httpx.Client(timeout=120) as client:
        response = client.get(f"{url}/jobs/{job_id}/events", headers={"Last-Event-ID": last_event_id})
    assert response.status_code == 200, response.text
    return [e for e in parse_sse(response.content) if "id" in e]


def read_until_cut(url: str, path: str, body: dict[str, Any], key: str | None = None) -> list[dict[str, Any]]:
    """A run's events, read until its stream ends (with its terminal event, or cut); `key`: its Idempotency-Key."""
    raw = b""
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", url + path, json=body, headers={"Idempotency-Key": key} if key else {}) as response:
            assert response.status_code == 200, response.read()
            with contextlib.suppress(httpx.HTTPError):
                for chunk in response.iter_raw():
                    raw += chunk
    return [e for e in parse_sse(raw[: raw.rfind(b"\n\n") + 2]) if "id" in e]


@pytest.mark.parametrize(("sig", "file"), [("SIGKILL", None), ("SIGTERM", None), ("SIGTERM", "safetensors")])
def test_a_job_whose_gateway_stops_mid_way_goes_on_in_another_replica_from_its_last_finished_window(
    shared: tuple[Callable[..., ServeProcess], Path], esm_path: Path, tmp_path: Path, sig: str, file: str | None
) -> None:
    """Two gateways share a Redis store and a spool. `embed_dying` with `kill: gateway` sends the
    gateway running it `sig` at window 40 of 43: SIGKILL kills it and its engine; SIGTERM drains it
    (no time for jobs to finish: --drain-timeout 0) and it leaves the job for another replica, while
    the chunk that holds window 40 waits in its engine.
    The other replica takes the job over (once the first counts as gone, or at once when it was
    left), admits it again under its id, and its run goes on from the checkpoint the first left:
    the client, reading on (where the first stopped, from Redis; else reconnecting to the other
    with its Last-Event-ID), reads each event once (seqs contiguous), each window's partial once,
    one terminal event, and the numbers the windows computed here give (inline, or in the
    safetensors file the first began and the other finished)."""
    start, spool = shared
    first, second = start(), start()
    sequence = protein(3000, seed=4)
    marker = tmp_path / "died"
    params: dict[str, Any] = {
        "texts": [sequence], "window": 100, "overlap": 30, "pooling": "per_token",
        "die_at": 40, "marker": str(marker), "kill": "gateway", "signal": sig,
    }
    params |= {"file": file} if file else {"partials": True}
    key = os.urandom(8).hex()
    before = read_until_cut(first.url, "/embed_dying/run", params, key)
    assert marker.exists() and first.proc.wait(timeout=30) == (-signal.SIGKILL if sig == "SIGKILL" else 0)
    if not before:
        # A killed process's connection is reset, and a reset drops what the client had received but
        # not yet read (a busy machine's client reads late): it sends its request again, with its key.
        assert sig == "SIGKILL"
        before = read_until_cut(second.url, "/embed_dying/run", params, key)[:1]
    job_id = before[0]["data"]["job_id"]
    # Cut when its gateway died; or, drained, read on from Redis while it stopped, maybe to the end.
    ended = any(e["event"] in ("data", "error") for e in before)
    assert sig == "SIGTERM" or not ended
    after = [] if ended else follow(second.url, job_id, before[-1]["id"])
    events = before + after
    assert [int(e["id"].split(":")[1]) for e in events] == list(range(1, len(events) + 1))
    kinds = [e["event"] for e in events]
    assert kinds.count("data") + kinds.count("error") == 1 and kinds[-1] == "data", events[-3:]

    statuses = [e["data"] for e in events if e["event"] == "status"]
    told = next((i for i, f in enumerate(statuses) if "the gateway replica that ran the job stopped" in f.get("message", "")), None)
    assert told is not None, statuses
    assert statuses[told]["status"] == "QUEUED"
    cut = windows.plan(3000, Sizes(100, 30, Stitch.CENTER))
    frames = [f["progress"] for f in statuses if "progress" in f]
    assert frames[-1] == {"done": len(cut), "total": len(cut), "unit": "windows"}
    assert [f["done"] for f in frames] == sorted(f["done"] for f in frames)
    resumed = [f["progress"]["done"] for f in statuses[told:] if "progress" in f]
    assert resumed[0] == 32, resumed  # from its checkpoint: the two chunks of 16 windows the first had finished

    out = events[-1]["data"]
    want = windowed_states(esm_path, sequence, 100, 30, "center")
    if file:
        arrays = load_safetensors(httpx.get(f"{second.url}/jobs/{job_id}/files/embeddings.safetensors", timeout=30).content)
        got = arrays["embeddings.0"]
        assert (arrays["context.0"] == windows.context(cut, Stitch.CENTER)).all()
    else:
        parts = [e["data"] for e in events if e["event"] == "partial"]
        shares = windows.shares(cut, Stitch.CENTER)
        assert [(p["text"], p["start"], p["end"]) for p in parts] == [(0, share.start, share.end) for share in shares]
        assert [row for p in parts for row in p["embeddings"]] == out["embeddings"][0]
        got = np.array(out["embeddings"][0], dtype=np.float32)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5

    # Its snapshot on the replica that finished it, and its checkpoint removed there.
    assert httpx.get(f"{second.url}/jobs/{job_id}", timeout=10).json()["status"] == "SUCCEEDED"
    folder = spool / f"streamgate-checkpoints-*/{job_id}"
    wait_until(lambda: glob.glob(str(folder)) == [], timeout=10, what="the checkpoint to be removed")


def test_a_job_the_replica_that_takes_it_over_refuses_ends_once_with_its_refusal(
    shared: tuple[Callable[..., ServeProcess], Path], tmp_path: Path
) -> None:
    """A replica admits a job it takes over as any other: one with a smaller --max-job-memory
    refuses it, and the job ends there, once, with that 413, its events numbered on."""
    start, spool = shared
    first, strict = start(), start("--max-job-memory", "100000")
    marker = tmp_path / "died"
    params = {
        "texts": [protein(3000, seed=5)], "window": 100, "overlap": 30, "pooling": "per_token",
        "die_at": 16, "marker": str(marker), "kill": "gateway", "signal": "SIGTERM",
    }
    before = read_until_cut(first.url, "/embed_dying/run", params)
    assert first.proc.wait(timeout=30) == 0
    job_id = before[0]["data"]["job_id"]
    ended = any(e["event"] in ("data", "error") for e in before)
    events = before + ([] if ended else follow(strict.url, job_id, before[-1]["id"]))
    assert [int(e["id"].split(":")[1]) for e in events] == list(range(1, len(events) + 1))
    terminals = [e for e in events if e["event"] in ("data", "error")]
    assert len(terminals) == 1 and terminals[0]["event"] == "error", terminals
    assert terminals[0]["data"]["error"]["code"] == "too_large", terminals[0]
    assert httpx.get(f"{strict.url}/jobs/{job_id}", timeout=10).json()["status"] == "FAILED"
    wait_until(lambda: glob.glob(str(spool / f"streamgate-checkpoints-*/{job_id}")) == [], timeout=10, what="the checkpoint to be removed")


def test_a_job_taken_over_has_its_completion_webhook_delivered_by_the_replica_that_finishes_it(
    shared: tuple[Callable[..., ServeProcess], Path], tmp_path: Path
) -> None:
    """A run's Callback-URL goes on with its job: the replica that takes it over (its first drained,
    leaving it) delivers the terminal event it finished, signed, once."""
    from standardwebhooks import Webhook

    from tests.test_webhooks import SECRET, Receiver

    receiver = Receiver()
    start, _ = shared
    flags = ("--webhook-secret", SECRET, "--callback-hosts", "127.0.0.1")
    first, second = start(*flags), start(*flags)
    params = {
        "texts": [protein(2000, seed=6)], "window": 100, "overlap": 30, "pooling": "mean",
        "die_at": 16, "marker": str(tmp_path / "died"), "kill": "gateway", "signal": "SIGTERM",
    }
    try:
        with httpx.stream("POST", f"{first.url}/embed_dying/run", json=params, headers={"Callback-URL": receiver.url}, timeout=120) as stream:
            job_id = stream.headers["x-job-id"]
            with contextlib.suppress(httpx.HTTPError):
                for _ in stream.iter_raw():
                    pass
        assert first.proc.wait(timeout=30) == 0
        wait_until(lambda: httpx.get(f"{second.url}/jobs/{job_id}", timeout=10).json()["status"] == "SUCCEEDED", 120, "the job to finish on the other")
        wait_until(lambda: len(receiver.received) == 1, 30, "its webhook")
        headers, body = receiver.received[0]
        message = Webhook(SECRET).verify(body, headers)
        assert message["type"] == "job.succeeded" and message["data"]["job_id"] == job_id
        assert httpx.get(f"{second.url}/jobs/{job_id}", timeout=10).json()["callback"]["state"] == "delivered"
    finally:
        receiver.stop()


async def test_the_sweep_removes_the_checkpoints_of_jobs_ended_everywhere_and_keeps_the_rest(redis_server: RedisServer, tmp_path: Path) -> None:
    """Checkpoint folders whose job has ended in the store go, and those of jobs it has no record of
    on two sweeps; a running job's stay, and so does a folder just made (its job may not be
    recorded yet)."""
    from gateway.server import redis_store
    from gateway.server.redis_store import replicas

    prefix = f"sweep-{os.getpid()}:"
    root = tmp_path / "checkpoints"
    for name in ("running", "ended", "gone", "new"):
        (root / name).mkdir(parents=True)
    old = time.time() - 2 * replicas.SWEEP_S
    for name in ("running", "ended", "gone"):
        os.utime(root / name, (old, old))
    client = redis.Redis.from_url(redis_server.url)
    client.hset(f"{prefix}job:running", mapping={"owner": "someone"})
    client.hset(f"{prefix}job:ended", mapping={"owner": "someone", "tseq": 9})
    store = redis_store.RedisStore(redis_server.url, lambda job: None, prefix=prefix, checkpoints=str(root))
    try:
        await store._sweep()
        # A job with no record at all may be one whose Redis restarted empty, its owner about to
        # copy it back: its checkpoint goes only if the next sweep finds none either.
        assert sorted(os.listdir(root)) == ["gone", "new", "running"]
        await store._sweep()
    finally:
        await store.stop()
        client.delete(f"{prefix}job:running", f"{prefix}job:ended")
    assert sorted(os.listdir(root)) == ["new", "running"]


@pytest.mark.parametrize("devices", ["cpu", "cpu,cpu"])
def test_with_threads_a_job_of_a_stopped_gateway_goes_on_from_its_checkpoint_in_another(
    shared: tuple[Callable[..., ServeProcess], Path], esm_path: Path, tmp_path: Path, devices: str
) -> None:
    """`--engine thread` (the model in the gateway's own process): a gateway stopped (SIGTERM) while
    a chunk of its job waits leaves the job to the other, which goes on from the checkpoint the
    first kept in the shared spool, its first progress where the first stopped; each event
    reaches the client once, and the numbers are the windows computed here. On two devices the
    job's chunks are shared by both (`Tool.spread`), and kept as they end, in any order."""
    start, spool = shared
    first, second = (start("--engine", "thread", "--devices", devices) for _ in range(2))
    marker, release = tmp_path / "paused", tmp_path / "release"
    sequence = protein(3000, seed=6)
    params = {
        "texts": [sequence], "window": 100, "overlap": 30, "pooling": "per_token",
        "die_at": 16, "marker": str(marker), "kill": "none", "release": str(release),
    }
    try:
        done: list[list[dict[str, Any]]] = []
        reader = threading.Thread(target=lambda: done.append(read_until_cut(first.url, "/embed_dying/run", params)), daemon=True)
        reader.start()
        wait_until(marker.exists, timeout=60, what="the job to reach window 16")
        # Its first chunk is kept (on two devices, once the other device has run it).
        journals = str(spool / "streamgate-checkpoints-*" / "*" / "journal")
        wait_until(lambda: any(os.path.getsize(path) > 0 for path in glob.glob(journals)), timeout=60, what="a chunk kept")
        first.proc.send_signal(signal.SIGTERM)
        threading.Timer(3.0, release.touch).start()  # the waiting chunk ends once the job has gone on elsewhere
        assert first.proc.wait(timeout=60) == 0
        reader.join(timeout=60)
        before = done[0]
        job_id = before[0]["data"]["job_id"]
        ended = any(e["event"] in ("data", "error") for e in before)
        events = before + ([] if ended else follow(second.url, job_id, before[-1]["id"]))
    finally:
        release.touch()
    assert [int(e["id"].split(":")[1]) for e in events] == list(range(1, len(events) + 1))
    kinds = [e["event"] for e in events]
    assert kinds.count("data") + kinds.count("error") == 1 and kinds[-1] == "data", events[-2:]
    statuses = [e["data"] for e in events if e["event"] == "status"]
    told = next(i for i, f in enumerate(statuses) if "the gateway replica that ran the job stopped" in f.get("message", ""))
    going_on = [f["progress"]["done"] for f in statuses[told:] if "progress" in f]
    # Not from the start: the first chunk of 16 windows was kept (on two devices, the last one too, maybe).
    assert going_on[0] == 16 if devices == "cpu" else going_on[0] in (16, 16 + 11), going_on
    want = windowed_states(esm_path, sequence, 100, 30, "center")
    got = np.array(events[-1]["data"]["embeddings"][0], dtype=np.float32)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5
    wait_until(lambda: glob.glob(str(spool / f"streamgate-checkpoints-*/{job_id}")) == [], timeout=10, what="the checkpoint to be removed")


async def test_taking_a_job_over_and_leaving_it_give_the_same_answer_when_sent_twice(redis_server: RedisServer) -> None:
    """redis-py sends a script again after a lost answer: a takeover sent twice answers the same and
    counts once, a leave sent twice leaves once, and a left job is taken over without counting."""
    from gateway.server import redis_store
    from gateway.server.redis_store import replicas

    prefix = f"twice-{os.getpid()}:"
    client = redis.Redis.from_url(redis_server.url)
    store = redis_store.RedisStore(redis_server.url, lambda job: None, prefix=prefix)
    job = f"{prefix}job:j"
    client.hset(job, mapping={"owner": "dead", "request": "{}", "last_seq": 7, "partials": 2, "snapshot": "{}", "key": ""})

    def take(owner: str) -> Any:
        keys = [f"{prefix}replica:{owner}", job, f"{prefix}events:j", f"{prefix}attached:j", f"{prefix}result:j", f"{prefix}resumable"]
        return store.scripts.take_over(keys=keys, args=[owner, store.replica_id, 60_000, replicas.MOST_TAKEOVERS, time.time(), "j"])

    try:
        first = await take("dead")
        assert first == await take("dead") and first[:2] == [b"7", b"2"] and first[4] == 0
        assert client.hget(job, "owner").decode() == store.replica_id and client.hget(job, "taken") == b"1"
        leave = [job, f"{prefix}resumable"], [store.replica_id, "j", time.time()]
        assert await store.scripts.leave(keys=leave[0], args=leave[1]) == 1
        assert await store.scripts.leave(keys=leave[0], args=leave[1]) == 1
        assert client.hget(job, "owner") == b"" and client.hget(job, "taken") == b"0"
        assert (await take(""))[:2] == [b"7", b"2"] and client.hget(job, "taken") == b"1"
    finally:
        await store.stop()
        client.delete(job, f"{prefix}resumable")


def test_a_run_from_the_start_never_takes_another_runs_journal_for_its_own(tmp_path: Path) -> None:
    """A part of a job cut again (its gateway stopped) may reuse an old part's folder: a run that does
    not go on from it drops what is there, so that a later run that does finds only its own pieces."""
    folder = tmp_path / "job.0"
    folder.mkdir()
    Checkpoint(str(folder)).record([((0, 3), "an old part's third text")])
    fresh = Checkpoint(str(folder))
    assert fresh.finished() == {}
    fresh.record([((0, 1), "this run's")])
    assert Checkpoint(str(folder), resumed=True).finished() == {(0, 1): "this run's"}


JOURNALED = {
    "embed per_token": ("model", "embed", lambda: embed.EmbedParams(texts=[protein(1500, seed=21), protein(300, seed=22)], pooling="per_token", stitch="mean", **STRIDE)),
    "embed mean": ("model", "embed", lambda: embed.EmbedParams(texts=[protein(2000, seed=1)], pooling="mean", **STRIDE)),
    "logprobs": ("causal", "logprobs", lambda: logprobs.LogprobsParams(prompts=[LONG_TEXT], top=2, next_token=True, **STRIDE)),
    "loglikelihood": ("causal", "loglikelihood", lambda: loglikelihood.LoglikelihoodParams(prompts=[LONG_TEXT[:1000]] * 2, continuations=[" a cat", " the dog"], **STRIDE)),
    "fill_mask": ("model", "fill_mask", lambda: fill_mask.FillMaskParams(texts=[masked(3000, 60, seed=12)], top_k=3, stitch="mean", **STRIDE)),
    "pseudo_loglikelihood": ("model", "pseudo_loglikelihood", lambda: pseudo_loglikelihood.PseudoLoglikelihoodParams(sequences=[protein(500, seed=13)], per_position=True, **STRIDE)),
}


@pytest.mark.parametrize("case", list(JOURNALED))
def test_a_jobs_journal_is_priced_before_it_is_queued_at_no_less_than_it_takes(request: pytest.FixtureRequest, case: str, tmp_path: Path) -> None:
    """A job's checkpoint lies on disk while it runs: its price (`Cost.journal`) bounds what its run
    writes there, within a factor of ten."""
    from backends.local import prepare
    from gateway.tools import builtin_tools, collect

    which, name, make = JOURNALED[case]
    model, params = request.getfixturevalue(which), make()
    tool = collect(builtin_tools())[name]
    priced = prepare(tool, model, params)
    assert priced is not None
    checkpoint = Checkpoint(str(tmp_path / "cp"))
    os.mkdir(checkpoint.folder)
    tool.spread.many(model, [params], [Ctx(checkpoint)])
    taken = os.path.getsize(checkpoint.path)
    assert 0 < taken <= priced.journal <= 10 * taken, (taken, priced.journal)


def test_a_journal_stops_at_its_bound_and_one_priced_over_it_is_not_kept(model: Any, tmp_path: Path) -> None:
    """--max-checkpoint-bytes: a journal that would grow past it keeps what it holds and no more (the
    answer the same); a job priced over it keeps none, and no other replica may go on with it."""
    from backends.local import prepare
    from gateway.cost import Budget
    from gateway.tools import builtin_tools, collect

    params = embed.EmbedParams(texts=[protein(2000, seed=1), protein(300, seed=2)], window=100, overlap=30, pooling="mean")
    whole = embed.work.many(model, [params], [Ctx(Checkpoint(str(tmp_path / "none")))])[0]
    unbounded = Checkpoint(str(tmp_path / "unbounded"))
    os.mkdir(unbounded.folder)
    embed.work.many(model, [params], [Ctx(unbounded)])
    records = journal(unbounded)
    assert len(records) >= 3

    bounded = Checkpoint(str(tmp_path / "bounded"), most=len(records[0]) + len(records[1]) + 8)
    os.mkdir(bounded.folder)
    assert same(embed.work.many(model, [params], [Ctx(bounded)])[0], whole)
    assert journal(bounded) == records[:2]  # the third would pass the bound: none after it either
    again = Ctx(Checkpoint(bounded.folder, resumed=True))
    assert same(embed.work.many(model, [params], [again])[0], whole)  # what it kept is as good to go on from
    assert again.frames[0][0] == sum(len(pickle.loads(r[8:])) for r in records[:2])

    none = Checkpoint(str(tmp_path / "none kept"), most=0)
    os.mkdir(none.folder)
    assert same(embed.work.many(model, [params], [Ctx(none)])[0], whole)
    assert not os.path.exists(none.path)

    tool = collect(builtin_tools())["embed"]
    priced = prepare(tool, model, params)
    assert priced is not None and priced.journal > 0
    assert Budget(memory=1 << 30, result=1 << 26, journal=priced.journal).admit(priced).journal == priced.journal
    assert Budget(memory=1 << 30, result=1 << 26, journal=priced.journal - 1).admit(priced).journal == 0
    # Rows a `mean` window adds into a file cannot be kept (`_resumable`): such a job has no journal to price.
    into_file = embed.EmbedParams(texts=[protein(2000, seed=1)], window=100, overlap=30, stitch="mean", pooling="per_token", file="safetensors")
    assert prepare(tool, model, into_file, Budget(memory=1 << 30, result=1 << 26, files=1 << 30)).journal == 0  # type: ignore[union-attr]


async def test_a_gateway_keeps_no_checkpoint_for_a_job_whose_journal_is_priced_over_its_bound(esm_path: Path, tmp_path: Path) -> None:
    """Admission: the bound chosen at start decides, before the job is queued, whether it keeps a
    checkpoint (and may go on in another replica); a job that keeps one has it bounded."""
    from backends.local import LocalBackend
    from gateway.admission import Admission, Applicant
    from gateway.config import Settings
    from gateway.tools import builtin_tools, collect

    tools = collect(builtin_tools())
    params = embed.EmbedParams(texts=[protein(2000, seed=1)], window=100, overlap=30, pooling="mean")
    for bound, keeps in [(1 << 30, True), (1000, False)]:
        backend = LocalBackend(
            tools, Settings(model=[str(esm_path)], device="cpu", max_checkpoint_bytes=bound), checkpoint_folder=str(tmp_path / str(bound))
        )
        await backend.start()
        try:
            await backend.wait_ready()
            job = await Admission(backend, Settings().limits()).admit(tools["embed"], msgspec.structs.replace(params), Applicant("tenant"))
            assert job.cost is not None and (job.cost.journal > 0) == keeps and job.resumable == keeps
            if keeps:
                assert job.checkpoint is not None and job.checkpoint.most == bound
            else:
                assert job.checkpoint is None
            for _ in range(600):
                if job.done:
                    break
                await asyncio.sleep(0.05)
            assert job.terminal is not None and job.terminal.type == "data"
        finally:
            await backend.stop()
