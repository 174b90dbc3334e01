"""SAE features: loading and checking a user's SAE, `sae_features`, `sae_annotate`, `sae_steer`.

The SAE is tiny and made here (hidden 32, 16 ReLU features at layer 0 of the
tiny 2-layer model), so its activations are computed again by hand from the
model's own hidden states. Feature DEAD has a bias so negative that it never
fires: clamping it to 0 must change nothing at all.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from backends import loading as models
from backends.local import LocalBackend
from gateway.config import Settings
from gateway.models import sae as sae_files
from gateway.errors import ParamError
from gateway.tools import builtin_tools, collect, windows
from gateway.tools.generate import GenerateParams, generate
from gateway.tools.sae_annotate import AnnotateParams, sae_annotate
from gateway.tools.sae_steer import Clamp, SteerParams, Steering, sae_steer
from gateway.tools.sae_tools import FeaturesParams, sae_features
from tests.conftest import floats_not_float32_shortest, run_stream, wait_until
from tests.test_batching import Recorder

D, N, LAYER, DEAD = 32, 16, 0, 15


def sae_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w_dec = torch.randn(N, D, generator=g)
    w_dec = w_dec / w_dec.norm(dim=-1, keepdim=True)
    b_enc = torch.randn(N, generator=g) * 0.1
    b_enc[DEAD] = -1e4
    return {"W_enc": w_dec.T.clone() * 2, "b_enc": b_enc, "W_dec": w_dec, "b_dec": torch.randn(D, generator=g) * 0.01}


def write_sae(
    folder: Path, tensors: dict[str, torch.Tensor] | None = None, sidecar: Any = None, stem: str = "res0", ext: str = "json"
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}.safetensors"
    tensors = sae_tensors() if tensors is None else tensors
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    if sidecar is None:
        sidecar = {"layer": LAYER, "activation": "relu", "name": "res0", "labels": {"0": "dogs", "1": "Hot dogs", "2": "cats"}}
    if isinstance(sidecar, str):
        (folder / f"{stem}.{ext}").write_text(sidecar)
    elif sidecar is not False:
        (folder / f"{stem}.json").write_text(json.dumps(sidecar))
    return path


@pytest.fixture(scope="module")
def sae_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sae(tmp_path_factory.mktemp("sae"))


@pytest.fixture(scope="module")
def model(tiny_model_path: Path, sae_path: Path) -> Any:
    loaded = models.load(models.resolve(str(tiny_model_path)), "cpu", "float32")
    sae_files.attach(loaded, sae_files.read_specs([str(sae_path)]))
    return loaded


def by_hand(model: Any, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer LAYER's residual stream (from output_hidden_states, not hooks) and its ReLU features."""
    t = sae_tensors()
    ids = torch.tensor([model.encode(prompt)])
    with torch.no_grad():
        x = model.module(input_ids=ids, output_hidden_states=True).hidden_states[LAYER + 1][0].float()
    return x, torch.relu(x @ t["W_enc"] + t["b_enc"])


def steer(model: Any, clamps: list[tuple[int, float]], **kw: Any) -> Any:
    params = SteerParams(prompts=["The cat"], clamps=[Clamp(i, s) for i, s in clamps], **kw)
    with torch.inference_mode():
        return sae_steer.run(model, params, Recorder())


def plain(model: Any, **kw: Any) -> Any:
    with torch.inference_mode():
        return generate.run(model, GenerateParams(prompts=["The cat"], **kw), Recorder())


# -- the tools, driven directly --------------------------------------------------------


def test_annotate_matches_a_direct_encode(model: Any) -> None:
    x, f = by_hand(model, "hot dogs")
    ids = list(range(N))
    with torch.inference_mode():
        picked = sae_annotate.run(model, AnnotateParams("hot dogs", mode="pick", feature_ids=ids), Recorder())
        top = sae_annotate.run(model, AnnotateParams("hot dogs", k=3), Recorder())
    t = sae_tensors()
    error = (x - (f @ t["W_dec"] + t["b_dec"])).norm(dim=-1)
    assert len(picked.tokens) == x.shape[0]
    for pos, token in enumerate(picked.tokens):
        assert [a.id for a in token.features] == ids
        assert torch.allclose(torch.tensor([a.value for a in token.features]), f[pos], atol=1e-5)
        assert abs(token.error - float(error[pos])) < 1e-5
        assert abs(token.relative_error - float(error[pos] / x[pos].norm())) < 1e-5
        want = [(int(i), float(v)) for v, i in zip(*f[pos].topk(3)) if v > 0]
        got = [(a.id, a.value) for a in top.tokens[pos].features]
        assert [i for i, _ in got] == [i for i, _ in want]
        assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(got, want))
    assert picked.tokens[0].features[0].label == "dogs"
    assert floats_not_float32_shortest(msgspec.to_builtins([picked, top])) == []
    assert any(top.tokens[p].features for p in range(len(top.tokens))), "some feature should fire"


def test_features_filter_and_paginate(model: Any) -> None:
    result = sae_features.run(model, FeaturesParams(query="DOGS"), Recorder())
    assert (result.total, [f.id for f in result.features]) == (2, [0, 1])
    page = sae_features.run(model, FeaturesParams(offset=10, limit=4), Recorder())
    assert page.total == N and [f.id for f in page.features] == [10, 11, 12, 13]
    assert abs(page.features[0].decoder_norm - 1.0) < 1e-5  # rows were normalised
    assert page.features[0].label is None
    assert floats_not_float32_shortest(msgspec.to_builtins(page)) == []


def test_steering_a_silent_feature_to_zero_changes_nothing(model: Any) -> None:
    for kw in ({}, {"temperature": 1.0, "seed": 7}):
        assert steer(model, [(DEAD, 0.0)], max_tokens=12, **kw) == plain(model, max_tokens=12, **kw)


def test_a_large_clamp_changes_generation_and_is_gone_for_the_next_job(model: Any) -> None:
    before = plain(model, max_tokens=12)
    layer = model.memo["anatomy"].layers[LAYER] if "anatomy" in model.memo else None
    hooks = dict(layer._forward_hooks) if layer is not None else {}
    steered = steer(model, [(0, 200.0)], max_tokens=12)
    assert steered.completions != before.completions
    assert plain(model, max_tokens=12) == before
    assert dict(model.memo["anatomy"].layers[LAYER]._forward_hooks) == hooks  # transformers' own stay


def test_batched_jobs_each_get_their_own_clamps(model: Any) -> None:
    jobs = [
        SteerParams(prompts=["The cat"], clamps=[Clamp(0, 200.0)], max_tokens=8),
        SteerParams(prompts=["A dog", "The cat"], clamps=[Clamp(DEAD, 0.0)], max_tokens=8),
        SteerParams(prompts=["The cat"], clamps=[Clamp(1, -200.0), Clamp(2, 50.0)], max_tokens=5),
    ]
    with torch.inference_mode():
        alone = [sae_steer.run(model, p, Recorder()) for p in jobs]
        batch = Steering(model)
        ctxs = [Recorder(f"job{i}") for i in range(len(jobs))]
        batch.add(jobs[0], ctxs[0])
        batch.step()  # the others join a running batch
        batch.add(jobs[1], ctxs[1])
        batch.add(jobs[2], ctxs[2])
        results: dict[str, Any] = {}
        while len(batch):
            for ctx, outcome in batch.step():
                results[ctx.job_id] = outcome
    assert [results[f"job{i}"] for i in range(len(jobs))] == alone
    assert alone[1].completions[1] == plain(model, max_tokens=8).completions[0]


# -- sequences at scale ------------------------------------------------------------------------


SEQUENCES = ["hot dogs", "The cat sat on the mat", "a", "dogs and cats " * 8]


def test_annotate_sequences_gives_tracks_equal_to_a_direct_encode(model: Any) -> None:
    ids = [0, 1, 2, DEAD]
    with torch.inference_mode():
        out = sae_annotate.run(model, AnnotateParams(sequences=SEQUENCES, mode="pick", feature_ids=ids, threshold=0.1), Recorder())
    t = sae_tensors()
    assert out.tokens is None and len(out.sequences) == len(SEQUENCES)
    for text, seq in zip(SEQUENCES, out.sequences):
        x, f = by_hand(model, text)
        own = model.own(model.encode(text))  # BOS is no letter of the sequence
        x, f = x[own], f[own]
        assert seq.tokens == [model.token_text(model.encode(text)[i]) for i in own]
        assert seq.tracks.dtype == np.float32 and seq.tracks.shape == (len(ids), len(own))
        assert np.allclose(seq.tracks, f[:, ids].T.numpy(), atol=1e-5)
        relative = (x - (f @ t["W_dec"] + t["b_dec"])).norm(dim=-1) / x.norm(dim=-1)
        assert np.allclose(seq.relative_error, relative.numpy(), atol=1e-5)
        for row, summary in zip(f[:, ids].T, seq.features):
            assert summary.max == pytest.approx(float(row.max()), abs=1e-5) and summary.argmax == int(row.argmax())
            assert summary.mean == pytest.approx(float(row.mean()), abs=1e-5)
            assert summary.above == torch.nonzero(row > 0.1).flatten().tolist()
        assert seq.features[-1].above == [] and seq.features[-1].max == 0  # DEAD never fires
        assert [s.label for s in seq.features[:3]] == ["dogs", "Hot dogs", "cats"]
    with torch.inference_mode():
        top = sae_annotate.run(model, AnnotateParams(sequences=SEQUENCES[:1], k=3), Recorder()).sequences[0]
    _, f = by_hand(model, SEQUENCES[0])
    peaks = f[model.own(model.encode(SEQUENCES[0]))].max(dim=0).values
    assert [s.id for s in top.features] == [i for i in peaks.topk(3).indices.tolist() if peaks[i] > 0]


@pytest.mark.parametrize("stitch", ["center", "left", "mean"])
def test_annotate_a_sequence_longer_than_the_context_in_windows(model: Any, stitch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1,000-letter sequence on a 256-token model, windows of 100 overlapping by 30: its residual
    stream stitched from the windows (each run here with the BOS before it) and encoded here gives
    the same tracks, errors and summaries; the plan and each position's context are in the answer.
    The stream is encoded 37 positions at a time, as a long one is."""
    from gateway.tools import sae_stream, windows
    from gateway.tools.windows import Sizes, Stitch

    monkeypatch.setattr(sae_stream, "ENCODE_FLOATS", N * 37)

    sequence = "".join("ACGT"[(i * 7 + i // 3) % 4] for i in range(1000))
    ids = model.encode(sequence, bounded=False)
    bos, own = ids[:1], ids[1:]
    cut = windows.plan(len(own), Sizes(100, 30, Stitch(stitch)))
    x = torch.zeros((len(own), D))
    with torch.no_grad():
        states = [
            model.module(input_ids=torch.tensor([bos + own[a:b]]), output_hidden_states=True).hidden_states[LAYER + 1][0, 1:]
            for a, b in cut
        ]
    for p in range(len(own)):
        seen = [(min(p - a, b - 1 - p), h[p - a]) for (a, b), h in zip(cut, states) if a <= p < b]
        if stitch == "center":  # the window where it is farthest from an edge
            x[p] = max(seen, key=lambda v: v[0])[1]
        elif stitch == "left":  # the first window holding it
            x[p] = seen[0][1]
        else:
            x[p] = torch.stack([h for _, h in seen]).mean(0)
    t = sae_tensors()
    f = torch.relu(x @ t["W_enc"] + t["b_enc"])
    picked = [0, 1, 2, DEAD]
    params = AnnotateParams(sequences=[sequence], mode="pick", feature_ids=picked, window=100, overlap=30, stitch=Stitch(stitch))
    with torch.inference_mode():
        (seq,) = sae_annotate.run(model, params, Recorder()).sequences
    assert "".join(seq.tokens) == sequence and seq.tracks.shape == (4, 1000)
    assert np.allclose(seq.tracks, f[:, picked].T.numpy(), atol=1e-5)
    relative = (x - (f @ t["W_dec"] + t["b_dec"])).norm(dim=-1) / x.norm(dim=-1)
    assert np.allclose(seq.relative_error, relative.numpy(), atol=1e-5)
    assert [s.argmax for s in seq.features] == f[:, picked].argmax(dim=0).tolist()
    assert seq.plan.windows == cut and seq.context.shape == (1000, 2)
    with torch.inference_mode():  # the top features, found over every stretch of the sequence
        top = sae_annotate.run(model, AnnotateParams(sequences=[sequence], k=3, window=100, overlap=30, stitch=Stitch(stitch)), Recorder())
    peaks = f.max(dim=0).values
    assert [s.id for s in top.sequences[0].features] == [i for i in peaks.topk(3).indices.tolist() if peaks[i] > 0]


def test_annotate_sequences_in_one_job_equal_one_job_each(serve: Any, sae_path: Path) -> None:
    server = serve(sae=[str(sae_path)], max_batch_size=64)
    texts = [("ab" * (i % 13 + 1)) + " dogs"[: i % 5] for i in range(64)]
    params = {"mode": "pick", "feature_ids": [0, 1, 2, 3]}
    together = run_stream(server.url, "sae_annotate", {"sequences": texts, **params}, timeout=120)
    assert together.terminal["event"] == "data", together.raw[-500:]
    each = [run_stream(server.url, "sae_annotate", {"sequences": [t], **params}).terminal["data"]["sequences"][0] for t in texts]
    for got, want in zip(together.terminal["data"]["sequences"], each):
        assert got["tokens"] == want["tokens"]
        assert np.allclose(np.array(got["tracks"]), np.array(want["tracks"]), atol=1e-5)
        assert np.allclose(got["relative_error"], want["relative_error"], atol=1e-5)
        for a, b in zip(got["features"], want["features"]):
            assert (a["id"], a["argmax"]) == (b["id"], b["argmax"])
            assert (a["max"], a["mean"]) == pytest.approx((b["max"], b["mean"]), abs=1e-5)
    refused = httpx.post(server.url + "/sae_annotate/run", json={"sequences": ["a"], "prompt": "b"})
    assert error_of(refused) == (422, "prompt")


# -- steering what is generated, and where -----------------------------------------------------


def steered_greedy(model: Any, prompt: str, clamps: list[tuple[int, float, int, int | None]], n: int, first: int) -> str:
    """Greedy decoding with the whole context run again each token and the clamps written by a hook of
    the test's own on the layer's output: at positions from `first` on, within each clamp's [start, end)."""
    t = sae_tensors()
    ids = model.encode(prompt)
    layer = model.memo["anatomy"].layers[LAYER]

    def hook(module: Any, args: Any, output: Any) -> None:
        h = output[0] if isinstance(output, tuple) else output
        f = torch.relu(h[0] @ t["W_enc"] + t["b_enc"])  # every clamp reads the stream before any is written
        for fid, strength, start, end in clamps:
            for pos in range(max(start, first), min(end if end is not None else h.shape[1], h.shape[1])):
                h[0, pos] += (strength - f[pos, fid]) * t["W_dec"][fid]

    handle = layer.register_forward_hook(hook)
    try:
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model.module(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    finally:
        handle.remove()
    return model.decode(ids[len(model.encode(prompt)):])


def test_steering_only_generated_leaves_the_prompt_untouched(model: Any) -> None:
    prompt_ids = model.encode("The cat")
    clamps = [Clamp(0, 200.0), Clamp(2, -50.0)]
    # The prompt's logits under `steer: generated` are the unsteered model's, exactly.
    from gateway.tools.sae_steer import SteeredRows, steering

    with torch.inference_mode():
        input_ids = torch.tensor([prompt_ids])
        plain_logits = model.module(input_ids=input_ids).logits
        with steering(model, model.saes["res0"], [SteeredRows(0, 1, clamps, [0], [len(prompt_ids)])]):
            kept = model.module(input_ids=input_ids).logits
        with steering(model, model.saes["res0"], [SteeredRows(0, 1, clamps, [0], [0])]):
            changed = model.module(input_ids=input_ids).logits
    assert torch.equal(kept, plain_logits)
    assert not torch.allclose(changed, plain_logits)
    generated = steer(model, [(0, 200.0), (2, -50.0)], max_tokens=8, steer="generated")
    assert generated.completions[0] == steered_greedy(model, "The cat", [(0, 200.0, 0, None), (2, -50.0, 0, None)], 8, len(prompt_ids))
    assert generated.completions[0][:1] == plain(model, max_tokens=1).completions[0]  # the first token is read off the prompt
    everywhere = steer(model, [(0, 200.0), (2, -50.0)], max_tokens=8)
    assert everywhere.completions[0] == steered_greedy(model, "The cat", [(0, 200.0, 0, None), (2, -50.0, 0, None)], 8, 0)
    assert everywhere.completions != generated.completions


def test_a_clamp_steers_only_its_positions(model: Any) -> None:
    n = len(model.encode("The cat"))
    for start, end in ((0, 2), (n, n + 3), (1, None)):
        clamps = [Clamp(0, 200.0, start=start, end=end)]
        with torch.inference_mode():
            got = sae_steer.run(model, SteerParams(prompts=["The cat"], clamps=clamps, max_tokens=8), Recorder())
        assert got.completions[0] == steered_greedy(model, "The cat", [(0, 200.0, start, end)], 8, 0), (start, end)
    with pytest.raises(ParamError) as err:
        sae_steer.check(model, SteerParams(prompts=["x"], clamps=[Clamp(0, 1.0, start=3, end=3)]))
    assert err.value.field == "clamps[0].end"


def test_bad_feature_ids_and_sae_names_are_param_errors(model: Any) -> None:
    with pytest.raises(ParamError) as err:
        sae_annotate.check(model, AnnotateParams("x", mode="pick", feature_ids=[1, N]))
    assert err.value.field == "feature_ids[1]"
    with pytest.raises(ParamError) as err:
        sae_annotate.check(model, AnnotateParams("x", sae="nope"))
    assert err.value.field == "sae" and "res0" in str(err.value)
    with pytest.raises(ParamError) as err:
        sae_steer.check(model, SteerParams(prompts=["x"], clamps=[Clamp(3, 1.0), Clamp(3, 2.0)]))
    assert err.value.field == "clamps[1].feature_id"


# -- loading: bad files fail at start-up, naming the problem ------------------------------


def bad_cases(tmp: Path) -> list[tuple[Path, str]]:
    t = sae_tensors()
    nan = dict(t, W_dec=t["W_dec"].clone())
    nan["W_dec"][3, 4] = float("nan")
    return [
        (write_sae(tmp / "shape", dict(t, W_dec=t["W_dec"][:, :16].contiguous())), "W_dec has shape [16, 16]"),
        (write_sae(tmp / "missing", {k: v for k, v in t.items() if k != "b_enc"}), "missing tensors: b_enc"),
        (write_sae(tmp / "nan", nan), "W_dec has NaN or infinite values"),
        (write_sae(tmp / "no-sidecar", sidecar=False), "no sidecar"),
        (write_sae(tmp / "bad-sidecar", sidecar='{"layer": 0, "activation": "gelu"}'), "activation"),
        (write_sae(tmp / "toml", sidecar='layer = 0\nactivation = "topk"\n', ext="toml"), "gives no k"),
        (write_sae(tmp / "labels", sidecar={"layer": 0, "activation": "relu", "labels": {"99": "x"}}), "label key 99"),
        (write_sae(tmp / "layer", sidecar={"layer": 2, "activation": "relu"}), "layer 2 is out of range"),
        (write_sae(tmp / "width", dict(t, W_enc=t["W_enc"][:24], W_dec=t["W_dec"][:, :24], b_dec=t["b_dec"][:24])),
         "d_model is 24 (W_enc's first dimension) but the model's hidden size is 32"),
    ]


def start(model_path: Path, sae: list[str]) -> None:
    async def go() -> None:
        backend = LocalBackend(collect(builtin_tools()), Settings(model=[str(model_path)], device="cpu", sae=sae))
        await backend.start()
        try:
            await backend.wait_ready()
        finally:
            await backend.stop()

    asyncio.run(go())


def test_bad_sae_files_fail_start_up_with_the_problem(tiny_model_path: Path, tmp_path: Path) -> None:
    for path, problem in bad_cases(tmp_path):
        with pytest.raises((ValueError, models.ModelError)) as err:
            start(tiny_model_path, [str(path)])
        assert problem in str(err.value) and str(path) in str(err.value), (problem, str(err.value))


def test_a_toml_sidecar_and_two_saes_load(tmp_path: Path) -> None:
    toml = 'layer = 1\nactivation = "topk"\nk = 4\nlabels = ["a", "b"]\n'
    one = write_sae(tmp_path / "a", sidecar=toml, ext="toml")  # named after its stem: res0
    two = write_sae(tmp_path / "b")
    with pytest.raises(sae_files.SAEError, match="the name 'res0' is also used"):
        sae_files.read_specs([str(one), str(two)])
    three = write_sae(tmp_path / "c", sidecar=toml, ext="toml", stem="deep")
    specs = sae_files.read_specs([str(three), str(two)])
    assert [(s.name, s.layer, s.k, s.labels) for s in specs] == [
        ("deep", 1, 4, {0: "a", 1: "b"}),
        ("res0", 0, None, {0: "dogs", 1: "Hot dogs", 2: "cats"}),
    ]


# -- through a real server ----------------------------------------------------------------


def error_of(response: httpx.Response) -> tuple[int, str | None]:
    return response.status_code, response.json()["error"].get("field")


def test_the_server_serves_the_tools_and_refuses_bad_params(serve: Any, sae_path: Path) -> None:
    server = serve(sae=[str(sae_path)])
    names = {t["name"] for t in httpx.get(server.url + "/tools").json()}
    assert {"sae_features", "sae_annotate", "sae_steer"} <= names
    ok = run_stream(server.url, "sae_steer", {"prompts": ["The cat"], "clamps": [{"feature_id": 0, "strength": 200}]})
    assert ok.terminal["event"] == "data" and ok.of("partial"), ok.events[-1]
    annotated = run_stream(server.url, "sae_annotate", {"prompt": "hot dogs", "k": 2})
    assert annotated.terminal["event"] == "data"
    refused = [
        ("sae_annotate", {"prompt": "x", "sae": "nope"}, "sae"),
        ("sae_annotate", {"prompt": "x", "mode": "pick", "feature_ids": [0, 1, 2, N]}, "feature_ids[3]"),
        ("sae_annotate", {"prompt": "x", "mode": "pick", "feature_ids": [0, -1]}, "feature_ids[1]"),
        ("sae_annotate", {"prompt": "x", "mode": "pick"}, "feature_ids"),
        ("sae_features", {"sae": "nope"}, "sae"),
        ("sae_steer", {"prompts": ["x"], "clamps": [{"feature_id": N, "strength": 1}]}, "clamps[0].feature_id"),
        ("sae_steer", {"prompts": ["x"], "clamps": [{"feature_id": -2, "strength": 1}]}, "clamps[0].feature_id"),
        ("sae_steer", {"prompts": ["x"], "clamps": [{"feature_id": 0, "strength": 1e5}]}, "clamps[0].strength"),
        ("sae_steer", {"prompts": ["x"], "clamps": [{"feature_id": 0, "strength": 1}], "top_k": -1}, "top_k"),
        ("sae_steer", {"prompts": ["x"], "clamps": [{"feature_id": 0, "strength": 1}], "temperature": 5}, "temperature"),
        ("sae_steer", {"prompts": ["x"], "clamps": []}, "clamps"),
    ]
    for tool, params, field in refused:
        assert error_of(httpx.post(f"{server.url}/{tool}/run", json=params)) == (422, field), (tool, params)
    # JSON has no NaN or infinity: the decoder refuses them, and an overflowing number, as malformed.
    for bad in (b"NaN", b"Infinity", b"1e999"):
        body = b'{"prompts": ["x"], "clamps": [{"feature_id": 0, "strength": %s}]}' % bad
        assert httpx.post(f"{server.url}/sae_steer/run", content=body).status_code in (400, 422), bad


def test_without_an_sae_the_tools_are_not_served(serve: Any) -> None:
    server = serve()
    names = {t["name"] for t in httpx.get(server.url + "/tools").json()}
    assert not names & {"sae_features", "sae_annotate", "sae_steer"}


def test_non_finite_strengths_fail_validation() -> None:
    raw = {"prompts": ["x"], "clamps": [{"feature_id": 1, "strength": 2.5}], "sae": "res0"}
    assert msgspec.to_builtins(msgspec.convert(raw, SteerParams))["clamps"] == raw["clamps"]
    for bad in (float("nan"), float("inf"), -float("inf"), 1e4 + 1):
        with pytest.raises(msgspec.ValidationError, match="clamps\\[0\\].strength"):
            msgspec.convert(dict(raw, clamps=[{"feature_id": 1, "strength": bad}]), SteerParams)


def test_dry_run_reports_saes_and_refuses_a_bad_one(tiny_model_path: Path, sae_path: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from gateway.cli.commands import main

    serve = ["serve", "--model", str(tiny_model_path), "--device", "cpu", "--dry-run"]
    result = CliRunner().invoke(main, [*serve, "--sae", str(sae_path)])
    assert result.exit_code == 0, result.output
    assert "saes: res0 (layer 0, 16 features, relu)" in result.output and "sae_steer" in result.output
    bad = write_sae(tmp_path / "bad", sidecar={"layer": 5, "activation": "relu"})
    result = CliRunner().invoke(main, serve, env={"STREAMGATE_SAE": str(bad)})
    assert result.exit_code == 1 and f"--sae {bad}: layer 5 is out of range" in result.output


def test_annotate_windows_through_the_gateway(serve: Any, sae_path: Path) -> None:
    """The windowed answer on the wire: the plan and the context as JSON beside the tracks; a
    sequence over the context without a window is a 413 naming the window param."""
    server = serve(sae=[str(sae_path)])
    sequence = "ACGT" * 150
    params = {"sequences": [sequence], "mode": "pick", "feature_ids": [0, 1], "window": 0, "overlap": 64}
    out = run_stream(server.url, "sae_annotate", params, timeout=120)
    assert out.terminal["event"] == "data", out.raw[-300:]
    (seq,) = out.terminal["data"]["sequences"]
    # A causal model's default rule: each position from the first window holding it.
    assert seq["plan"] == {"windows": [[0, 255], [191, 446], [345, 600]], "stitch": "left", "window": 255, "overlap": 64}
    assert len(seq["context"]) == 600 and seq["context"][0] == [0, 254] and len(seq["tracks"][0]) == 600
    refused = httpx.post(server.url + "/sae_annotate/run", json={"sequences": [sequence]})
    assert refused.status_code == 413 and "give window" in refused.json()["error"]["message"]


def test_annotate_tracks_as_bigwig_and_bed_files_through_the_gateway(serve: Any, sae_path: Path, tmp_path: Path) -> None:
    """With file bigwig, the tracks the inline answer gives are in one bigWig per feature (each
    sequence a chromosome by its name) that pyBigWig reads back equal, with the relative error; the
    BED lists each stretch above the threshold; the JSON keeps the summaries and the plan."""
    import pyBigWig

    server = serve(sae=[str(sae_path)])
    sequences = ["ACGT" * 150, "".join("ACGT"[(i * 7 + i // 3) % 4] for i in range(300))]
    params = {"sequences": sequences, "k": 3, "window": 100, "overlap": 30, "threshold": 0.1}
    inline = run_stream(server.url, "sae_annotate", params, timeout=120).terminal["data"]
    out = run_stream(server.url, "sae_annotate", {**params, "file": "bigwig", "names": ["chr1", "chr2"]}, timeout=120)
    assert out.terminal["event"] == "data", out.raw[-300:]
    result, job_id = out.terminal["data"], out.events[0]["data"]["job_id"]
    chosen = {f["id"] for seq in inline["sequences"] for f in seq["features"]}
    assert sorted(f["name"] for f in result["files"]) == sorted([*(f"f{i}.bw" for i in chosen), "features.bed", "relative_error.bw"])

    def fetched(name: str) -> Path:
        path = tmp_path / name
        path.write_bytes(httpx.get(f"{server.url}/jobs/{job_id}/files/{name}").content)
        return path

    bed = [line.split("\t") for line in fetched("features.bed").read_text().splitlines()]
    for i, (chrom, want) in enumerate(zip(["chr1", "chr2"], inline["sequences"])):
        got = result["sequences"][i]
        assert got["name"] == chrom and got["length"] == len(sequences[i]) and got["plan"] == want["plan"]
        assert [f["id"] for f in got["features"]] == [f["id"] for f in want["features"]]
        for k, fid in enumerate(f["id"] for f in want["features"]):
            assert any(want["features"][k]["above"])  # each fires somewhere: the BED has lines of it
            track = np.array(want["tracks"][k], dtype=np.float32)
            with pyBigWig.open(str(fetched(f"f{fid}.bw"))) as bw:
                assert bw.chroms() == {"chr1": 600, "chr2": 300}
                assert np.allclose(np.array(bw.values(chrom, 0, len(track))), track, atol=1e-6)
            summary = got["features"][k]
            assert summary["max"] == pytest.approx(want["features"][k]["max"], abs=1e-6) and summary["argmax"] == want["features"][k]["argmax"]
            assert summary["mean"] == pytest.approx(want["features"][k]["mean"], abs=1e-5) and "above" not in summary
            # Its stretches above the threshold, as the inline answer's positions above it make them.
            above = want["features"][k]["above"]
            runs = [[p, p + 1] for p in above]
            merged: list[list[int]] = []
            for run in runs:
                if merged and merged[-1][1] == run[0]:
                    merged[-1][1] = run[1]
                else:
                    merged.append(run)
            assert [[int(a), int(b)] for c, a, b, name, _ in bed if c == chrom and name == f"f{fid}"] == merged
        with pyBigWig.open(str(fetched("relative_error.bw"))) as bw:
            assert np.allclose(np.array(bw.values(chrom, 0, len(sequences[i]))), want["relative_error"], atol=1e-6)
    starts = [(c, int(a)) for c, a, *_ in bed]
    assert starts == sorted(starts, key=lambda s: (["chr1", "chr2"].index(s[0]), s[1]))  # sorted, as browsers read it


def test_track_files_join_stretches_that_run_on_across_writes(tmp_path: Path) -> None:
    """Written 37 positions at a time, a track's stretches above the threshold come out whole, each
    scored by its largest value against the track's peak."""
    import pyBigWig

    from gateway.tools.files import TrackFiles

    rng = np.random.default_rng(0)
    values = np.where(rng.random(500) < 0.6, rng.random(500) + 0.5, 0.0).astype(np.float32)
    opened: dict[str, Any] = {}

    def open_file(name: str) -> Any:
        opened[name] = (tmp_path / name).open("w+b")
        return opened[name]

    files = TrackFiles(open_file, [("s", 500)], threshold=0.4)
    for a in range(0, 500, 37):
        files.write("s", "f3", a, values[a : a + 37], fires=True)
    files.end_chrom("s", 500, {"f3": float(values.max())})
    written = files.close()
    assert sorted(f.name for f in written) == ["f3.bw", "features.bed"]
    want, start = [], None
    for p in range(501):
        on = p < 500 and values[p] > 0.4
        if on and start is None:
            start = p
        elif not on and start is not None:
            want.append((start, p, round(1000 * float(values[start:p].max()) / float(values.max()))))
            start = None
    lines = [line.split("\t") for line in (tmp_path / "features.bed").read_text().splitlines()]
    assert [(int(a), int(b), int(score)) for _, a, b, _, score in lines] == want
    with pyBigWig.open(str(tmp_path / "f3.bw")) as bw:
        assert np.allclose(bw.values("s", 0, 500), values)


def test_tracks_over_the_result_bound_are_written_as_files_not_refused(serve: Any, sae_path: Path) -> None:
    server = serve(sae=[str(sae_path)], max_result_bytes=64 * 1024)
    sequence = "".join("ACGT"[(i * 7 + i // 3) % 4] for i in range(3000))
    out = run_stream(server.url, "sae_annotate", {"sequences": [sequence], "k": 3, "window": 0}, timeout=120)
    assert out.terminal["event"] == "data", out.raw[-300:]
    result = out.terminal["data"]
    assert {f["format"] for f in result["files"]} == {"bigwig", "bed"}
    assert result["sequences"][0]["name"] == "seq1" and result["sequences"][0]["length"] == 3000
    assert "tracks" not in result["sequences"][0]
    refused = httpx.post(server.url + "/sae_annotate/run", json={"prompt": "ab", "file": "bigwig"})
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "file"


def test_a_long_annotation_lets_a_waiting_job_run_between_its_passes(serve: Any, sae_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequence's windows are many passes, a step each: a `predict` that queues while they run waits
    for the pass under way, not for the whole annotation."""
    import gateway.tools.sae_annotate as annotating
    from tests.test_fairness import Follower, Turnstile

    monkeypatch.setattr(annotating, "PASS_TOKENS", 256)  # two windows of 100 a pass: 10 passes
    server = serve(sae=[str(sae_path)])
    turnstile = Turnstile()
    handle = server.backend.model.module.register_forward_pre_hook(turnstile)
    ended: list[str] = []
    try:
        sequence = "".join("ACGT"[(i * 7 + i // 3) % 4] for i in range(2000))
        params = {"sequences": [sequence], "window": 100, "overlap": 0, "mode": "pick", "feature_ids": [0, 1]}
        annotation = Follower(server.url, "sae_annotate", params, on_terminal=ended.append)
        turnstile.let(2)
        wait_until(lambda: turnstile.passed == 2, 20, "the annotation to be under way")
        predict = Follower(server.url, "predict", {"prompt": "hello", "top_k": 2}, on_terminal=ended.append)
        wait_until(lambda: len(server.backend.queue) == 1, 20, "the predict to queue")
        # And the running batch asked to pause after its step (the loop sees the arrival first): else the step
        # let through next may be the batch's own.
        wait_until(lambda: any(run.pause for run in server.backend.workers[0]._runs), 20, "the batch to pause for it")
        turnstile.let(2)  # the pass under way when it queued, then the predict's
        assert predict.done(timeout=20)[-1]["event"] == "data"
        assert ended == ["predict"] and turnstile.passed == 4
        turnstile.let(1000)
        events = annotation.done()
    finally:
        handle.remove()
        turnstile.let(1000)
    assert events[-1]["event"] == "data" and ended == ["predict", "sae_annotate"]
    assert events[-1]["data"]["sequences"][0]["plan"]["windows"][-1] == [1900, 2000]


def test_a_job_cancelled_in_a_shared_batch_has_no_rows_in_the_next_passes(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two jobs' windows in one batch, two windows a pass: once one job is cancelled, the passes after
    carry only the other's windows, and the other's answer is what it is alone."""
    import gateway.tools.sae_annotate as annotating

    monkeypatch.setattr(annotating, "PASS_TOKENS", 256)
    sequence = "".join("ACGT"[(i * 7 + i // 3) % 4] for i in range(1000))
    params = AnnotateParams(sequences=[sequence], window=100, overlap=0, mode="pick", feature_ids=[0, 1])
    rows: list[int] = []
    handle = model.module.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append((args[0] if args else kwargs["input_ids"]).shape[0]), with_kwargs=True
    )
    try:
        with torch.inference_mode():
            alone = annotating._annotate_many(model, [params], [Recorder()])[0]
            rows.clear()
            mine, theirs = Recorder("mine"), Recorder("theirs")
            steps = annotating._annotate_steps(model, [params, params], [mine, theirs])
            next(steps)  # the first pass: two windows, both the first job's
            theirs.cancel_now = True
            results = annotating.run_through(steps)
    finally:
        handle.remove()
    assert results[1] is None and sum(rows) == 10  # the first job's ten windows; none of the second's
    got, want = results[0].sequences[0], alone.sequences[0]
    assert np.array_equal(got.tracks, want.tracks) and got.features == want.features


@pytest.mark.parametrize(
    ("mode", "stitch", "file"), [("top", "mean", None), ("pick", "center", "bigwig"), ("top", "left", "bigwig")]
)
def test_an_annotation_over_windows_goes_on_from_its_last_kept_pass_with_the_same_tracks(
    model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, stitch: str, file: str | None
) -> None:
    """A job of two sequences in windows, two windows a pass, keeps each pass's encoded windows in its
    checkpoint; killed after half its passes (its last record torn), the next run replays what was
    kept and runs the rest: the same answer and the same files, byte for byte, and the windows kept
    never run again. Mode top runs its windows twice (the peaks, then the tracks): there the cut falls
    in the second run."""
    import os

    from gateway.checkpoints import Checkpoint
    from gateway.encoding import to_json
    import gateway.tools.sae_annotate as annotating
    from tests.test_checkpoints import FileCtx, journal

    monkeypatch.setattr(annotating, "PASS_TOKENS", 256)  # two windows of 100 a pass
    sequences = ["".join("ACGT"[(i * 7 + i // 3 + k) % 4] for i in range(n)) for k, n in enumerate([1000, 700])]
    params = AnnotateParams(
        sequences=sequences, window=100, overlap=30, stitch=stitch, mode=mode, k=3,
        feature_ids=[0, 1, 2] if mode == "pick" else None, file=file,
    )
    passes: list[int] = []
    handle = model.module.register_forward_pre_hook(lambda *_: passes.append(1))

    def run(folder: Path, resumed: bool = False) -> tuple[bytes, dict[str, bytes], FileCtx]:
        ctx = FileCtx(Checkpoint(str(folder), resumed=resumed))
        with torch.inference_mode():
            out = annotating._annotate_many(model, [params], [ctx])[0]
        files = {name: Path(path).read_bytes() for name, path in ctx.files.take().items()}
        return to_json(out), files, ctx

    try:
        os.mkdir(tmp_path / "whole")
        whole, whole_files, _ = run(tmp_path / "whole")
        assert bool(whole_files) == (file is not None)
        folder = tmp_path / "cp"
        os.mkdir(folder)
        first, first_files, ctx = run(folder)
        assert first == whole and first_files == whole_files
        total = ctx.frames[-1][1]
        records = journal(ctx.checkpoint)
        assert len(passes) == 2 * len(records)  # a record a pass
        taken = os.path.getsize(ctx.checkpoint.path)  # priced before it is queued: no less, within a factor of ten
        assert taken <= annotating._cost_annotate(model, params).journal <= 10 * taken
        assert len(records) == (total + 1) // 2 and total == (14 + 10) * (2 if mode == "top" else 1)

        half = len(records) // 2 + 2  # mode top: 4 windows into the second run; pick: 2 into the second sequence
        Path(ctx.checkpoint.path).write_bytes(b"".join(records[:half]) + records[half][:30])
        passes.clear()
        again, again_files, resumed = run(folder, resumed=True)
        assert again == whole and again_files == whole_files
        assert len(passes) == len(records) - half  # the kept passes' windows never ran again
        assert resumed.frames[0] == (2 * half, total, "windows")
        assert [d for d, _, _ in resumed.frames] == sorted(d for d, _, _ in resumed.frames)
    finally:
        handle.remove()


def test_an_annotation_whose_engine_is_killed_mid_way_goes_on_from_its_last_kept_pass_in_the_next(
    tiny_model_path: Path, sae_path: Path, tmp_path: Path
) -> None:
    """`sae_annotate_dying` (tests/support/engine_tools.py) is `sae_annotate` whose engine is SIGKILLed
    once, after 3 of its 10 passes (714 windows of 100 bases, 160 a pass, run twice): the job goes on
    in the new engine from its third pass, and ends once, with the tracks of an annotation never cut
    (both as bigWig files)."""
    import pyBigWig

    from tests.test_engines import copies, start_gateway

    gateway = start_gateway(tmp_path, f"text={tiny_model_path}", extra=("--sae", str(sae_path), "--result-spool", str(tmp_path)))
    try:
        n = 50_000
        sequence = "".join("ACGT"[(i * 7 + i // 3) % 4] for i in range(n))
        params = {"sequences": [sequence], "window": 100, "overlap": 30, "mode": "top", "k": 3, "file": "bigwig"}
        count = len(windows.plan(n, windows.Sizes(100, 30, windows.Stitch.LEFT)))
        before = copies(gateway, "text")[0]
        marker = tmp_path / "died"
        cut = run_stream(gateway.url, "sae_annotate_dying", params | {"die_at": 3, "marker": str(marker)}, timeout=120)
        assert marker.exists() and cut.terminal is not None and cut.terminal["event"] == "data", cut.events[-3:]
        assert [e["event"] for e in cut.events].count("data") + [e["event"] for e in cut.events].count("error") == 1
        assert copies(gateway, "text")[0]["restarts"] == before["restarts"] + 1
        statuses = [e["data"] for e in cut.of("status")]
        told = next(i for i, f in enumerate(statuses) if "goes on from its last finished piece" in f.get("message", ""))
        frames = [f["progress"] for f in statuses if "progress" in f]
        assert count == 714 and frames[-1] == {"done": 2 * count, "total": 2 * count, "unit": "windows"}
        assert [f["done"] for f in frames] == sorted(f["done"] for f in frames)
        resumed = [f["progress"]["done"] for f in statuses[told:] if "progress" in f]
        assert resumed[0] >= 3 * 160, resumed

        whole = run_stream(gateway.url, "sae_annotate", params, timeout=120)
        assert whole.terminal["event"] == "data"
        assert cut.terminal["data"]["sequences"] == whole.terminal["data"]["sequences"]

        def tracks(done: Any) -> dict[str, list[float]]:
            job_id = done.events[0]["data"]["job_id"]
            out = {}
            for f in done.terminal["data"]["files"]:
                if f["name"].endswith(".bw"):
                    path = tmp_path / f["name"]
                    path.write_bytes(httpx.get(f"{gateway.url}/jobs/{job_id}/files/{f['name']}").content)
                    with pyBigWig.open(str(path)) as bw:
                        out[f["name"]] = bw.values("seq1", 0, n)
            return out

        assert tracks(cut) == tracks(whole) and len(tracks(whole)) == 4
    finally:
        gateway.stop()


@pytest.mark.parametrize("mode", ["pick", "top"])
def test_annotation_partials_are_each_stretchs_final_values_in_order_and_sent_once_across_a_resumed_run(
    model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """With partials, the chosen features' values stream as each stretch is final: in order within each
    sequence, each position once, as the result has them; a run that goes on from the checkpoint sends
    the same events again, in the same order (the gateway drops those its stream has)."""
    import os

    from gateway.checkpoints import Checkpoint
    from gateway.encoding import to_json
    import gateway.tools.sae_annotate as annotating
    from tests.test_checkpoints import Ctx, journal

    monkeypatch.setattr(annotating, "PASS_TOKENS", 256)
    sequences = ["".join("ACGT"[(i * 5 + i // 4 + k) % 4] for i in range(n)) for k, n in enumerate([900, 400])]
    params = AnnotateParams(
        sequences=sequences, window=100, overlap=30, mode=mode, k=3, feature_ids=[2, 0] if mode == "pick" else None, partials=True,
    )
    os.mkdir(tmp_path / "cp")
    ctx = Ctx(Checkpoint(str(tmp_path / "cp")))
    with torch.inference_mode():
        result = annotating._annotate_many(model, [params], [ctx])[0]
    for s, annotation in enumerate(result.sequences):
        parts = [p for p in ctx.partials if p.sequence == s]
        assert parts and [p.start for p in parts] == [0, *(p.end for p in parts[:-1])] and parts[-1].end == len(sequences[s])
        assert all(p.features == [f.id for f in annotation.features] for p in parts)
        values = np.concatenate([np.asarray(p.values, dtype=np.float32) for p in parts], axis=1)
        assert values.tolist() == np.asarray(annotation.tracks).tolist()
    assert [p.sequence for p in ctx.partials] == sorted(p.sequence for p in ctx.partials)

    Path(ctx.checkpoint.path).write_bytes(b"".join(journal(ctx.checkpoint)[:5]))
    again = Ctx(Checkpoint(str(tmp_path / "cp"), resumed=True))
    with torch.inference_mode():
        assert to_json(annotating._annotate_many(model, [params], [again])[0]) == to_json(result)
    assert msgspec.json.encode(again.partials) == msgspec.json.encode(ctx.partials)

    for bad, why in [({"window": None, "overlap": None}, "only with sequences and window"), ({"file": "bigwig"}, "not with file")]:
        with pytest.raises(ParamError) as refused:
            annotating._check_annotate(model, msgspec.structs.replace(params, **bad))
        assert refused.value.field == "partials" and why in refused.value.message


@pytest.mark.parametrize("steer_where", ["all", "generated"])
def test_a_steered_job_preempted_and_taken_up_in_a_fresh_batch_completes_as_alone(model: Any, steer_where: str) -> None:
    params = SteerParams(prompts=["The cat", "A dog"], clamps=[Clamp(0, 200.0), Clamp(2, 50.0)], max_tokens=10, steer=steer_where)
    other = SteerParams(prompts=["hello"], clamps=[Clamp(1, -100.0)], max_tokens=10)
    with torch.inference_mode():
        alone = sae_steer.run(model, params, Recorder())
        first, ctx = Steering(model), Recorder("preempted")
        first.add(params, ctx)
        first.add(other, Recorder("other"))
        for _ in range(4):
            assert first.step() == []
        ((out, kept),) = first.preempt({ctx})
        assert out is ctx and len(first) == 1  # the other goes on
        again, back = Steering(model), Recorder("back")  # a batch with no SAE resolved yet
        again.resume(kept, back)
        ended: list[Any] = []
        while len(again):
            ended += again.step()
    assert ended == [(back, alone)]


@pytest.mark.parametrize("steer_where", ["all", "generated"])
def test_a_steered_prefill_in_pieces_is_the_steered_prefill_whole(model: Any, steer_where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt's prefill runs its columns in pieces (gateway/models/decoders.py): each piece's
    columns are steered at their own positions, not counted from 0 again."""
    from gateway.models import decoders

    params = SteerParams(
        prompts=["The cat sat on the mat and looked", "A dog"], clamps=[Clamp(0, 200.0), Clamp(2, 50.0, start=3, end=20)],
        max_tokens=6, steer=steer_where,
    )
    with torch.inference_mode():
        whole = sae_steer.run(model, params, Recorder())
        monkeypatch.setattr(decoders, "PREFILL_TOKENS", 16)  # two rows: pieces of 8 columns
        assert decoders.prefill_columns(2, 34) == 8
        pieces = sae_steer.run(model, params, Recorder())
    assert pieces == whole
