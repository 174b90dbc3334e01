"""Sequences longer than the context, as windows: the plan (gateway/tools/windows.py), and `embed`
over it through the gateway against the same windows computed here in plain transformers and
stitched here by each rule."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

from gateway.tools import windows
from gateway.tools.windows import Sizes, Stitch
from tests.conftest import make_server, run_stream
from tests.test_tools import result

AMINO = "LAGVSERTIDPKQNFYMHWC"


# -- the plan -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "window", "overlap"), [(1, 10, 2), (10, 10, 2), (11, 10, 2), (1000, 100, 30), (997, 64, 63), (500, 7, 0)])
def test_a_plan_covers_every_position_with_full_windows_and_shares_that_sum_to_one(n: int, window: int, overlap: int) -> None:
    for stitch in Stitch:
        sizes = Sizes(window, overlap, stitch)
        cut = windows.plan(n, sizes)
        assert cut[0][0] == 0 and cut[-1][1] == n
        assert all(end - start == min(window, n) for start, end in cut)
        assert all(b[0] - a[0] <= window - overlap for a, b in zip(cut, cut[1:]))  # no gap, at least the overlap shared
        total = np.zeros(n)
        for share, (start, end) in zip(windows.shares(cut, stitch), cut):
            assert start <= share.start <= share.end <= end and share.offset == share.start - start
            total[share.start : share.end] += 1 if share.weights is None else share.weights
        assert np.allclose(total, 1)


def test_center_takes_each_position_from_the_window_it_is_farthest_inside() -> None:
    cut = windows.plan(1000, Sizes(100, 30, Stitch.CENTER))
    context = windows.context(cut, Stitch.CENTER)
    for p in range(1000):
        best = max(min(p - s, e - 1 - p) for s, e in cut if s <= p < e)
        assert min(context[p]) == best, p
    # Inside the sequence every position keeps at least half the overlap on each side.
    assert context[100:900].min() >= 14


def test_left_takes_each_position_from_the_first_window_holding_it() -> None:
    cut = windows.plan(1000, Sizes(100, 30, Stitch.LEFT))
    context = windows.context(cut, Stitch.LEFT)
    for p in range(1000):
        first = next(s for s, e in cut if s <= p < e)
        assert context[p][0] == p - first, p
    # Every position keeps the whole overlap before it, where a causal model's state looks; center keeps half.
    assert context[100:, 0].min() >= 30
    assert windows.context(cut, Stitch.CENTER)[100:, 0].min() == 15


@pytest.mark.parametrize("stitch", list(Stitch))
def test_the_context_of_a_stretch_is_that_stretch_of_the_whole(stitch: Stitch) -> None:
    cut = windows.plan(1000, Sizes(100, 30, stitch))
    whole = windows.context(cut, stitch)
    for start, stop in [(0, 1000), (0, 1), (37, 38), (150, 480), (999, 1000), (970, 1000)]:
        assert (windows.context(cut, stitch, start, stop) == whole[start:stop]).all(), (start, stop)


def test_mean_reports_each_sides_least_context_over_the_windows_averaged() -> None:
    cut = [(0, 10), (6, 16)]
    context = windows.context(cut, Stitch.MEAN)
    assert context[7].tolist() == [1, 2]  # in (0, 10): 7 left, 2 right; in (6, 16): 1 left, 8 right


# -- embed through the gateway ------------------------------------------------------------------


@pytest.fixture(scope="module")
def esm_path(tiny: Callable[..., Path]) -> Path:
    return tiny("esm_mlm")


@pytest.fixture(scope="module")
def server(esm_path: Path, tiny_model_path: Path):
    s = make_server([f"esm={esm_path}", f"text={tiny_model_path}"])
    yield s
    s.stop()


def protein(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(AMINO) for _ in range(n))


def windowed_states(path: Path, sequence: str, window: int, overlap: int, stitch: str, layer: int = -1) -> np.ndarray:
    """Per residue, the stitched hidden state, computed here: each window tokenized as a protein of
    its own, run through transformers, and its residues' states stitched by `stitch`."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForMaskedLM.from_pretrained(path).eval()
    n = len(sequence)
    starts = list(range(0, max(n - window, 0), window - overlap)) + [max(n - window, 0)]
    states: list[tuple[int, int, np.ndarray]] = []
    with torch.no_grad():
        for start in dict.fromkeys(starts):
            end = min(start + window, n)
            ids = tokenizer(sequence[start:end], return_tensors="pt")
            hidden = model(**ids, output_hidden_states=True).hidden_states[layer][0, 1:-1]
            states.append((start, end, hidden.numpy()))
    out = np.zeros((n, states[0][2].shape[-1]), dtype=np.float64)
    for p in range(n):
        seen = [(min(p - s, e - 1 - p), h[p - s]) for s, e, h in states if s <= p < e]
        if stitch == "center":
            out[p] = max(seen, key=lambda x: x[0])[1]  # the first of equals: the earlier window
        else:
            out[p] = np.mean([h for _, h in seen], axis=0)
    return out


@pytest.mark.parametrize("stitch", ["center", "mean"])
def test_embed_over_windows_is_the_windows_computed_here_and_stitched(server, esm_path: Path, stitch: str) -> None:
    """A 1,000-residue protein on a model of 256 tokens: per_token, mean and last embeddings from
    windows of 100 residues overlapping by 30, each equal (1e-5) to the same windows run here in
    transformers and stitched here; the plan and each residue's context are in the answer."""
    sequence = protein(1000)
    want = windowed_states(esm_path, sequence, 100, 30, stitch)
    params = {"model": "esm", "texts": [sequence], "window": 100, "overlap": 30, "stitch": stitch}
    per_token = result(server.url, "embed", {**params, "pooling": "per_token"})
    got = np.array(per_token["embeddings"][0])
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5
    assert "".join(per_token["tokens"][0]) == sequence
    (plan,) = per_token["plans"]
    assert plan == {"windows": [list(w) for w in windows.plan(1000, Sizes(100, 30, Stitch(stitch)))], "stitch": stitch, "window": 100, "overlap": 30}
    context = np.array(per_token["context"][0])
    assert context.shape == (1000, 2) and context[0].tolist() == [0, 99] and context[-1].tolist() == [99, 0]
    mean = result(server.url, "embed", {**params, "pooling": "mean"})["embeddings"][0]
    assert np.abs(np.array(mean) - want.mean(0)).max() <= 1e-5
    last = result(server.url, "embed", {**params, "pooling": "last", "normalize": True})["embeddings"][0]
    assert np.abs(np.array(last) - want[-1] / np.linalg.norm(want[-1])).max() <= 1e-5


def test_a_windowed_jobs_progress_counts_its_windows(server) -> None:
    s = run_stream(server.url, "embed", {"model": "esm", "texts": [protein(1000), "MKV"], "window": 100, "overlap": 30})
    assert s.terminal["event"] == "data"
    running = [e["data"]["progress"] for e in s.events if e["event"] == "status" and e["data"].get("progress")]
    n = len(windows.plan(1000, Sizes(100, 30, Stitch.CENTER))) + 1  # the short text is one window
    assert running and running[-1] == {"done": n, "total": n, "unit": "windows"}, running


def test_one_window_as_long_as_the_sequence_is_the_whole_pass_exactly(server) -> None:
    sequence = protein(200, seed=1)
    for pooling in ("per_token", "mean", "last"):
        whole = result(server.url, "embed", {"model": "esm", "texts": [sequence], "pooling": pooling})
        one = result(server.url, "embed", {"model": "esm", "texts": [sequence], "pooling": pooling, "window": 0})
        assert one["embeddings"] == whole["embeddings"], pooling
        assert one["plans"] == [{"windows": [[0, 200]], "stitch": "center", "window": 256, "overlap": 64}]  # 258 positions less <cls> and <eos>


def test_a_causal_models_windows_keep_its_bos_in_each(server, tiny_model_path: Path) -> None:
    """A text model's windows are its own tokens with its special tokens around each (the tiny
    Llama's BOS), stitched by default as a causal model's are (`left`: each position from the first
    window holding it): equal (1e-5) to the windows run here in transformers, their tokens in order."""
    text = "the quick brown fox jumps over the lazy dog. " * 40  # 1,800 bytes on a 256-token model
    out = result(server.url, "embed", {"model": "text", "texts": [text], "window": 100, "overlap": 30, "pooling": "per_token"})
    assert "".join(out["tokens"][0]) == text
    assert len(out["embeddings"][0]) == len(text) and out["plans"][0]["stitch"] == "left"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    ids = tokenizer(text)["input_ids"]
    bos, own = ids[:1], ids[1:]
    want = np.zeros((len(own), model.config.hidden_size))
    done = 0
    with torch.no_grad():
        for start, end in out["plans"][0]["windows"]:
            hidden = model(input_ids=torch.tensor([bos + own[start:end]]), output_hidden_states=True).hidden_states[-1][0, 1:]
            want[done:end] = hidden[done - start :].numpy()  # from where the window before ended
            done = end
    assert np.abs(np.array(out["embeddings"][0]) - want).max() <= 1e-5


def test_over_the_context_without_a_window_the_413_names_the_window_param(server) -> None:
    s = run_stream(server.url, "embed", {"model": "esm", "texts": ["MK", protein(1000)]})
    assert s.status == 413
    error = s.body["error"]
    assert error["code"] == "too_long" and error["field"] == "texts[1]" and "give window" in error["message"]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"window": 100, "pooling": "cls"}, "pooling"),
        ({"window": 100, "overlap": 100}, "overlap"),
        ({"window": 300}, "window"),
        ({"overlap": 10}, "overlap"),
        ({"window": 1, "overlap": 0, "texts": [protein(30_000)]}, "window"),  # 30,000 windows of one residue
        ({"part": [0, 2]}, "part"),  # a part of a plan: only with window
        ({"window": 100, "part": [0, 2], "texts": [protein(500), protein(300)]}, "part"),
        ({"window": 100, "part": [2, 2]}, "part"),
        ({"window": 100, "part": [0, 2], "pooling": "per_token", "stitch": "mean"}, "part"),
        ({"window": 100, "part": [0, 2], "pooling": "per_token", "file": "safetensors"}, "part"),
        ({"window": 100, "part": [0, 2], "pooling": "per_token", "partials": True}, "part"),
    ],
)
def test_a_window_that_cannot_run_is_refused_naming_the_param(server, params: dict[str, Any], field: str) -> None:
    response = httpx.post(f"{server.url}/embed/run", json={"model": "esm", "texts": [protein(500)], **params})
    assert response.status_code in (400, 413, 422) and response.json()["error"]["field"] == field, response.text


def close(got: Any, want: Any, numbers: tuple[str, ...]) -> None:
    """Equal results, but for the last bits of their numbers, which which rows share a pass may move."""
    assert got.keys() == want.keys()
    for key in got:
        if key in numbers:
            assert np.abs(np.array(got[key], dtype=np.float64) - np.array(want[key], dtype=np.float64)).max() <= 1e-5, key
        else:
            assert got[key] == want[key], key


@pytest.mark.parametrize(
    ("tool", "params"),
    [
        ("embed", {"texts": [protein(500, seed=3)], "pooling": "per_token", "normalize": True}),
        ("embed", {"texts": [protein(500, seed=3)], "pooling": "per_token", "stitch": "left", "precision": 4}),
        ("embed", {"texts": [protein(500, seed=3)], "pooling": "mean", "stitch": "mean"}),
        ("embed", {"texts": [protein(500, seed=3)], "pooling": "last"}),
        ("pseudo_loglikelihood", {"sequences": [protein(500, seed=3)], "per_position": True}),
        ("pseudo_loglikelihood", {"sequences": [protein(500, seed=3)]}),
    ],
)
def test_the_parts_of_a_plan_hold_its_runs_of_windows_and_put_together_are_the_whole(server, tool: str, params: dict[str, Any]) -> None:
    """`part` [i, n] computes the i-th of n runs of consecutive windows of the plan (7 windows here):
    the parts' positions follow one another, and the tool's `join`, which puts the parts that engines
    computed together, gives the whole job's answer, with 2, 3 and 9 parts (two of them empty)."""
    from gateway.tools import embed, pseudo_loglikelihood

    work = {"embed": embed.work, "pseudo_loglikelihood": pseudo_loglikelihood.work}[tool]
    params = {"model": "esm", "window": 100, "overlap": 30, **params}
    whole = result(server.url, tool, params)
    assert len(whole["plans"][0]["windows"]) == 7
    kind = {"embed": embed.EmbedParams, "pseudo_loglikelihood": pseudo_loglikelihood.PseudoLoglikelihoodParams}[tool]
    typed = msgspec.convert({k: v for k, v in params.items() if k != "model"}, kind)
    for count in (2, 3, 9):
        parts = [result(server.url, tool, {**params, "part": [i, count]}) for i in range(count)]
        spans = [part.get("span", [[0, 0]])[0] for part in parts]
        if "span" in parts[0]:
            assert spans[0][0] == 0 and spans[-1][1] == 500 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
            assert sum(b - a == 0 for a, b in spans) == (2 if count == 9 else 0)
        assert all(part["plans"] == whole["plans"] for part in parts)
        joined = msgspec.json.decode(work.join(typed, [msgspec.json.encode(part) for part in parts]))
        close(joined, whole, ("embeddings", "per_position", "pll"))
    # Where a position's value is summed over windows two parts would hold, no part.
    summed = {**params, "stitch": "mean", "part": [0, 2]}
    if tool == "embed" and params["pooling"] != "per_token":
        assert "sums" in result(server.url, tool, summed)
    else:
        refused = httpx.post(f"{server.url}/{tool}/run", json=summed, timeout=30)
        assert refused.status_code == 422 and refused.json()["error"]["field"] == "part", refused.text


def test_a_remote_executor_answers_the_same_windows(server, serve_any, esm_path: Path) -> None:
    """Through an executor process (results as msgpack with raw buffers), the same numbers, plan and
    context as in-process."""
    remote = serve_any("remote", model_path=esm_path)
    params = {"texts": [protein(600, seed=2)], "window": 120, "overlap": 40, "stitch": "mean", "pooling": "per_token"}
    there = result(remote.url, "embed", params)
    here = result(server.url, "embed", {**params, "model": "esm"})
    assert there == here


def windowed_pll(path: Path, sequence: str, window: int, overlap: int, stitch: str) -> tuple[float, list[float]]:
    """Per residue, its log-probability masked in its window (center) or averaged over every window
    holding it (mean), computed here in transformers; and their sum."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForMaskedLM.from_pretrained(path).eval()
    n = len(sequence)
    starts = list(dict.fromkeys(list(range(0, max(n - window, 0), window - overlap)) + [max(n - window, 0)]))
    cut = [(s, min(s + window, n)) for s in starts]
    scores: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    with torch.no_grad():
        for start, end in cut:
            ids = tokenizer(sequence[start:end], return_tensors="pt").input_ids[0]
            for p in range(start, end):
                masked = ids.clone()
                masked[1 + p - start] = tokenizer.mask_token_id
                logits = model(input_ids=masked[None]).logits[0, 1 + p - start]
                scores[p].append((min(p - start, end - 1 - p), float(logits.log_softmax(-1)[ids[1 + p - start]])))
    per = [max(s, key=lambda x: x[0])[1] if stitch == "center" else float(np.mean([v for _, v in s])) for s in scores]
    return sum(per), per


@pytest.mark.parametrize("stitch", ["center", "mean"])
def test_pseudo_loglikelihood_over_windows_is_the_windows_scored_here(server, esm_path: Path, stitch: str) -> None:
    sequence = protein(300, seed=3)
    total, per = windowed_pll(esm_path, sequence, 80, 20, stitch)
    out = result(server.url, "pseudo_loglikelihood", {
        "model": "esm", "sequences": [sequence], "window": 80, "overlap": 20, "stitch": stitch, "per_position": True,
    })
    assert out["tokens_scored"] == [300] and "".join(out["tokens"][0]) == sequence
    assert np.abs(np.array(out["per_position"][0]) - per).max() <= 1e-4 and abs(out["pll"][0] - total) <= 1e-3
    assert out["plans"][0]["windows"] == [list(w) for w in windows.plan(300, Sizes(80, 20, Stitch(stitch)))]
    assert np.array(out["context"][0]).shape == (300, 2)
    short = protein(60, seed=4)
    whole = result(server.url, "pseudo_loglikelihood", {"model": "esm", "sequences": [short], "per_position": True})
    one = result(server.url, "pseudo_loglikelihood", {"model": "esm", "sequences": [short], "per_position": True, "window": 0})
    assert one["per_position"] == whole["per_position"] and one["pll"] == whole["pll"]


def strided_logprobs(path: Path, text: str, window: int, overlap: int) -> tuple[list[int], list[tuple[int, int]], list[float | None]]:
    """Plain transformers, as the sliding-window perplexity does: the text's tokens, its windows, and
    each token's log-probability in the first window holding it, with the BOS before the window
    (none for the first token); every token has at least `overlap` tokens of its text before it."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tokenizer(text).input_ids
    bos, own = ids[:1], ids[1:]
    cut = windows.plan(len(own), Sizes(window, overlap, Stitch.CENTER))
    want: list[float | None] = [None] * len(ids)
    done = 0
    with torch.no_grad():
        for start, end in cut:
            logprobs = model(input_ids=torch.tensor([bos + own[start:end]])).logits[0].log_softmax(-1)
            for q in range(max(done, start), end):
                assert q == 0 or q - start >= overlap or start == 0
                want[1 + q] = float(logprobs[q - start, own[q]])  # the logits at the token before it (the BOS for q = start = 0)
            done = end
    return ids, cut, want


def test_logprobs_over_windows_score_each_token_in_the_first_window_that_holds_it(server, tiny_model_path: Path) -> None:
    """A text of 1,800 tokens on a 256-token model, windows of 100 tokens overlapping by 30: each
    token's log-probability equal (1e-5) to the one computed here (`strided_logprobs`)."""
    text = "the quick brown fox jumps over the lazy dog. " * 40
    ids, cut, want = strided_logprobs(tiny_model_path, text, 100, 30)
    out = result(server.url, "logprobs", {"model": "text", "prompts": [text], "window": 100, "overlap": 30, "next_token": True})
    (scored,) = out["sequences"]
    assert scored["token_ids"] == ids and scored["plan"]["windows"] == [list(w) for w in cut]
    assert scored["logprobs"][0] is None
    assert max(abs(a - b) for a, b in zip(scored["logprobs"][1:], want[1:])) <= 1e-5
    short = {"model": "text", "prompts": ["hello there, a short text"], "top": 3, "next_token": True}
    whole, one = result(server.url, "logprobs", short), result(server.url, "logprobs", {**short, "window": 0})
    assert one["sequences"][0].pop("plan")["windows"] == [[0, 25]] and one == whole


@pytest.mark.parametrize("stitch", ["center", "mean"])
def test_fill_mask_over_windows_is_the_windows_read_here(server, esm_path: Path, stitch: str) -> None:
    """Masks along a 700-residue protein, windows of 100 overlapping by 40: each mask's top tokens
    and probabilities from its window (center) or averaged over its windows (mean), as computed here."""
    tokenizer = AutoTokenizer.from_pretrained(esm_path)
    model = AutoModelForMaskedLM.from_pretrained(esm_path).eval()
    residues = list(protein(700, seed=5))
    masked = [3, 95, 130, 350, 351, 699]
    for q in masked:
        residues[q] = "<mask>"
    text = "".join(residues)
    cut = windows.plan(700, Sizes(100, 40, Stitch(stitch)))
    want = {}
    with torch.no_grad():
        for q in masked:
            seen = []
            for a, b in cut:
                if a <= q < b:
                    ids = tokenizer("".join(residues[a:b]), return_tensors="pt").input_ids
                    seen.append((min(q - a, b - 1 - q), model(input_ids=ids).logits[0, 1 + q - a].softmax(-1)))
            want[q] = max(seen, key=lambda x: x[0])[1] if stitch == "center" else torch.stack([p for _, p in seen]).mean(0)
    out = result(server.url, "fill_mask", {"model": "esm", "texts": [text], "window": 100, "overlap": 40, "stitch": stitch, "top_k": 3})
    (fills,) = out["fills"]
    assert [f["position"] for f in fills] == masked
    for fill in fills:
        top = want[fill["position"]].topk(3)
        assert [p["id"] for p in fill["predictions"]] == top.indices.tolist()
        assert np.allclose([p["prob"] for p in fill["predictions"]], top.values.numpy(), atol=1e-5)
    assert out["plans"][0]["windows"] == [list(w) for w in cut]


def test_loglikelihood_over_windows_sums_the_strided_scores_of_the_continuation(server) -> None:
    """A prompt and continuation of 1,500 tokens on a 256-token model: the continuation's log-likelihood
    with windows is the sum of its tokens' scores from logprobs over the same windows."""
    prompt, continuation = "the quick brown fox " * 50, "jumps over the lazy dog. " * 20
    params = {"model": "text", "window": 120, "overlap": 40}
    out = result(server.url, "loglikelihood", {**params, "prompts": [prompt], "continuations": [continuation]})
    scored = result(server.url, "logprobs", {**params, "prompts": [prompt + continuation]})["sequences"][0]
    n = len(continuation)  # the byte tokenizer: a token a character, the same either way
    assert out["ll"][0] == pytest.approx(sum(scored["logprobs"][-n:]), abs=1e-3)
    assert out["plans"][0] == scored["plan"]
    with pytest.raises(AssertionError):  # the same pair without a window: over the context
        result(server.url, "loglikelihood", {"model": "text", "prompts": [prompt], "continuations": [continuation]})


def test_a_long_sequence_tokenized_a_piece_at_a_time_is_the_whole_tokenized(esm_path: Path) -> None:
    from backends import loading

    model = loading.load(loading.resolve(str(esm_path)), "cpu", "float32")
    assert model.alphabet is not None
    sequence = protein(200_000, seed=11)  # over three pieces of 65,536 letters
    sequence = sequence[:65_533] + "<mask>" + sequence[65_533:]  # a token typed across the first cut
    want = AutoTokenizer.from_pretrained(esm_path)(sequence)["input_ids"]
    assert model.encode(sequence, bounded=False) == want
    assert model.memo["by_letter"] is True
