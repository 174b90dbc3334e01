"""Every kind of model users bring: each tool equals a plain transformers/torch computation, or is refused.

Tiny random models of each kind (tests/support/tiny_models.py, tests/support/custom_model.py)
are served by real gateways on loopback. For each, a tool either returns what
an independent computation written here returns (to 1e-5), or answers 422
`unsupported_by_model` before anything is queued, naming the tool, the
model's kind and what is missing. No model makes any tool answer 5xx.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import transformers as tf
from click.testing import CliRunner

from gateway.cli import commands as cli
from gateway.tools import builtin_tools
from tests.support import custom_model
from tests.conftest import Server, build_tiny_model, floats_not_float32_shortest, make_server, run_stream
from tests.support.tiny_models import BERT_VOCAB, ESM_VOCAB, PROTEINS, build

ATOL = 1e-5


def result(url: str, tool: str, params: dict[str, Any]) -> Any:
    s = run_stream(url, tool, params)
    assert s.status == 200, s.raw[:500]
    assert s.terminal["event"] == "data", s.terminal
    return s.terminal["data"]


def refused(url: str, tool: str, params: dict[str, Any], kind: str, missing: str) -> dict[str, Any]:
    r = httpx.post(f"{url}/{tool}/run", json=params, timeout=30)
    assert r.status_code == 422, (tool, r.status_code, r.text)
    error = r.json()["error"]
    assert error["code"] == "unsupported_by_model", error
    assert tool in error["message"] and f"({kind})" in error["message"] and missing in error["message"], error
    return error


def close(got: Any, want: torch.Tensor, atol: float = ATOL) -> None:
    got_t = torch.tensor(got, dtype=torch.float32)
    assert got_t.shape == want.shape, (got_t.shape, want.shape)
    assert torch.allclose(got_t, want.float(), atol=atol, rtol=1e-4), (got_t - want).abs().max()


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kinds")
    built = {kind: build(kind, root / kind) for kind in ("esm_mlm", "esm_encoder", "bert_mlm", "opt350", "hrm", "t5")}
    built["llama"] = build_tiny_model(root / "llama", init=0.2)
    return built


@pytest.fixture(scope="module")
def servers(paths: dict[str, Path]) -> Iterator[dict[str, Server]]:
    """One gateway per servable model, started once for the module."""
    started: dict[str, Server] = {}
    try:
        for kind in ("esm_mlm", "esm_encoder", "bert_mlm", "opt350", "hrm", "llama"):
            started[kind] = make_server(paths[kind])
        started["custom"] = make_server(None, model_loader="tests.support.custom_model:load")
        started["custom_plain"] = make_server(None, model_loader="tests.support.custom_model:load_plain")
        yield started
    finally:
        for server in started.values():
            server.stop()


# -- kinds are detected, never guessed ---------------------------------------------------------


@pytest.mark.parametrize(
    "kind, expected",
    [("esm_mlm", "masked_lm"), ("esm_encoder", "encoder"), ("bert_mlm", "masked_lm"), ("opt350", "causal_lm"),
     ("hrm", "causal_lm"), ("llama", "causal_lm"), ("custom", "custom")],
)
def test_each_checkpoint_loads_as_the_kind_its_config_says(servers: dict[str, Server], kind: str, expected: str) -> None:
    ready = httpx.get(servers[kind].url + "/readyz").json()
    assert ready["kind"] == expected, ready
    assert ready.get("mask_token") == {"esm_mlm": "<mask>", "bert_mlm": "[MASK]"}.get(kind), ready


def test_an_encoder_decoder_fails_dry_run_and_start_with_one_sentence(paths: dict[str, Path]) -> None:
    for command in ("serve", "executor"):
        run = CliRunner().invoke(cli.main, [command, "--model", str(paths["t5"]), "--device", "cpu", "--dry-run"])
        assert run.exit_code == 1, run.output
        message = run.output.strip()
        assert message.count("\n") == 0, message  # one line, no transformers traceback
        assert "T5Config is an encoder-decoder model" in message and "--model-loader" in message, message


def test_a_bert_config_never_loads_as_a_causal_lm(tmp_path: Path) -> None:
    # A checkpoint saved from BertLMHeadModel whose config says is_decoder false is an encoder.
    from backends.loading import detect_kind

    path = build("bert_mlm", tmp_path / "bert")
    config = tf.AutoConfig.from_pretrained(path)
    config.architectures = ["BertLMHeadModel"]
    config.save_pretrained(path)
    assert detect_kind(str(path)).value == "masked_lm"
    config.is_decoder = True
    config.save_pretrained(path)
    assert detect_kind(str(path)).value == "causal_lm"


# -- ESM-2 -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def esm(paths: dict[str, Path]) -> tuple[Any, Any]:
    tok = tf.AutoTokenizer.from_pretrained(paths["esm_mlm"])
    model = tf.EsmForMaskedLM.from_pretrained(paths["esm_mlm"]).eval()
    return tok, model


@torch.no_grad()
def esm_states(tok: Any, base: Any, sequence: str, layer: int) -> torch.Tensor:
    ids = tok(sequence, return_tensors="pt")
    return base(**ids, output_hidden_states=True).hidden_states[layer][0]


@pytest.mark.parametrize("model_kind", ["esm_mlm", "esm_encoder"])
def test_esm_embed_pools_residues_only_cls_and_per_token(
    servers: dict[str, Server], paths: dict[str, Path], model_kind: str
) -> None:
    tok = tf.AutoTokenizer.from_pretrained(paths[model_kind])
    loaded = tf.AutoModel.from_pretrained(paths[model_kind]) if model_kind == "esm_encoder" else None
    base = loaded if loaded is not None else tf.EsmForMaskedLM.from_pretrained(paths[model_kind]).esm
    base.eval()
    url = servers[model_kind].url
    for layer in (0, 1, -1):
        states = [esm_states(tok, base, p, layer) for p in PROTEINS]
        mean = result(url, "embed", {"texts": PROTEINS, "layer": layer})  # mean is the default
        cls = result(url, "embed", {"texts": PROTEINS, "layer": layer, "pooling": "cls"})
        per_token = result(url, "embed", {"texts": PROTEINS, "layer": layer, "pooling": "per_token"})
        assert mean["dim"] == cls["dim"] == per_token["dim"] == 32
        for i, (protein, s) in enumerate(zip(PROTEINS, states)):
            # <cls> first, <eos> last: the residues are everything between.
            assert s.shape[0] == len(protein) + 2
            close(mean["embeddings"][i], s[1:-1].mean(0))
            close(cls["embeddings"][i], s[0])
            close(per_token["embeddings"][i], s[1:-1])
            assert per_token["tokens"][i] == list(protein)
    # The mean over residues differs from one over <cls> and <eos> too: the old, wrong default.
    s = esm_states(tok, base, PROTEINS[0], -1)
    assert (s.mean(0) - s[1:-1].mean(0)).abs().max() > 1e-3


def test_esm_fill_mask_equals_the_heads_softmax(servers: dict[str, Server], esm: tuple[Any, Any]) -> None:
    tok, model = esm
    texts = ["MKT<mask>YIAK<mask>R", "<mask>GG"]
    out = result(servers["esm_mlm"].url, "fill_mask", {"texts": texts, "top_k": 4})
    assert out["mask_token"] == "<mask>"
    for text, fills in zip(texts, out["fills"]):
        ids = tok(text, return_tensors="pt")
        with torch.no_grad():
            probs = model(**ids).logits[0].softmax(-1)
        masks = (ids["input_ids"][0] == tok.mask_token_id).nonzero().flatten().tolist()
        assert [f["position"] for f in fills] == [m - 1 for m in masks]  # residue indices: <cls> left out
        for at, fill in zip(masks, fills):
            top = probs[at].topk(4)
            assert [p["id"] for p in fill["predictions"]] == top.indices.tolist()
            assert [p["text"] for p in fill["predictions"]] == [ESM_VOCAB[i] for i in top.indices.tolist()]
            close([p["prob"] for p in fill["predictions"]], top.values)
    assert floats_not_float32_shortest(out) == []


def test_esm_pseudo_loglikelihood_masks_each_residue_in_turn(servers: dict[str, Server], esm: tuple[Any, Any]) -> None:
    tok, model = esm
    out = result(servers["esm_mlm"].url, "pseudo_loglikelihood", {"sequences": PROTEINS, "per_position": True})
    for i, protein in enumerate(PROTEINS):
        ids = tok(protein, return_tensors="pt")["input_ids"][0]
        scores = []
        for at in range(1, len(ids) - 1):  # every residue, never <cls> or <eos>
            masked = ids.clone()
            masked[at] = tok.mask_token_id
            with torch.no_grad():
                logprobs = model(input_ids=masked[None]).logits[0, at].log_softmax(-1)
            scores.append(float(logprobs[ids[at]]))
        assert out["tokens_scored"][i] == len(protein)
        assert out["tokens"][i] == list(protein)
        close(out["per_position"][i], torch.tensor(scores))
        assert math.isclose(out["pll"][i], sum(scores), abs_tol=1e-4)
    assert floats_not_float32_shortest(out) == []


@pytest.mark.parametrize("model_kind", ["esm_mlm", "bert_mlm"])
def test_the_lens_last_layer_is_the_models_own_prediction_through_its_whole_head(
    servers: dict[str, Server], paths: dict[str, Path], model_kind: str
) -> None:
    tok = tf.AutoTokenizer.from_pretrained(paths[model_kind])
    model = tf.AutoModelForMaskedLM.from_pretrained(paths[model_kind]).eval()
    text = PROTEINS[0] if model_kind == "esm_mlm" else "the cat sat"
    url = servers[model_kind].url
    out = result(url, "logit_lens", {"prompt": text, "layers": [-1], "top_k": 3})
    with torch.no_grad():
        probs = model(**tok(text, return_tensors="pt")).logits[0].softmax(-1)
    top = probs.topk(3)
    assert [[p["id"] for p in cell] for cell in out["topk"][0]] == top.indices.tolist()
    close([[p["prob"] for p in cell] for cell in out["topk"][0]], top.values)
    grid = result(url, "lens_grid", {"prompt": text, "layers": [-1]})
    close(grid["values"][0], top.values[:, 0])


def test_masked_lms_refuse_next_token_tools_before_queueing(servers: dict[str, Server]) -> None:
    for model_kind in ("esm_mlm", "bert_mlm"):
        url = servers[model_kind].url
        for tool, params in [
            ("generate", {"prompts": ["MKT"]}),
            ("predict", {"prompt": "MKT"}),
            ("loglikelihood", {"prompts": ["MK"], "continuations": ["T"]}),
            ("activation_patching", {"src_prompt": "MKT", "tgt_prompt": "MKA"}),
        ]:
            refused(url, tool, params, "masked_lm", "causal next-token logits")
        tools = {t["name"]: t for t in httpx.get(url + "/tools").json()}
        assert tools["generate"]["unsupported"] and tools["fill_mask"]["unsupported"] is None
        paths = httpx.get(url + "/openapi.json").json()["paths"]
        assert "/fill_mask/run" in paths and "/generate/run" not in paths


def test_a_headless_encoder_serves_embed_and_refuses_the_rest(servers: dict[str, Server]) -> None:
    url = servers["esm_encoder"].url
    for tool, params in [
        ("fill_mask", {"texts": ["MK<mask>"]}),
        ("pseudo_loglikelihood", {"sequences": ["MKT"]}),
        ("logit_lens", {"prompt": "MKT"}),
        ("generate", {"prompts": ["MKT"]}),
    ]:
        error = refused(url, tool, params, "encoder", "without a head")
        assert "EsmModel" in error["message"]


def test_bert_fill_mask_equals_the_heads_softmax(servers: dict[str, Server], paths: dict[str, Path]) -> None:
    tok = tf.AutoTokenizer.from_pretrained(paths["bert_mlm"])
    model = tf.BertForMaskedLM.from_pretrained(paths["bert_mlm"]).eval()
    text = "the [MASK] sat"
    out = result(servers["bert_mlm"].url, "fill_mask", {"texts": [text], "top_k": 5})
    assert out["mask_token"] == "[MASK]"
    ids = tok(text, return_tensors="pt")
    with torch.no_grad():
        probs = model(**ids).logits[0].softmax(-1)
    at = int((ids["input_ids"][0] == tok.mask_token_id).nonzero())
    top = probs[at].topk(5)
    ((fill,),) = out["fills"]
    assert fill["position"] == at - 1
    assert [p["id"] for p in fill["predictions"]] == top.indices.tolist()
    assert [p["text"] for p in fill["predictions"]] == [BERT_VOCAB[i] for i in top.indices.tolist()]
    close([p["prob"] for p in fill["predictions"]], top.values)


def test_fill_mask_without_a_mask_names_the_text_and_the_token(servers: dict[str, Server]) -> None:
    r = httpx.post(servers["esm_mlm"].url + "/fill_mask/run", json={"texts": ["MK<mask>", "MKT"]})
    assert r.status_code == 422
    error = r.json()["error"]
    assert error["field"] == "texts[1]" and "<mask>" in error["message"]


# -- OPT-350m: post-LN, project_out ---------------------------------------------------------------


def test_opt_lens_runs_through_project_out_and_embed_reports_its_vectors_length(
    servers: dict[str, Server], paths: dict[str, Path]
) -> None:
    tok = tf.AutoTokenizer.from_pretrained(paths["opt350"])
    model = tf.OPTForCausalLM.from_pretrained(paths["opt350"]).eval()
    url = servers["opt350"].url
    text = "Hello there"
    with torch.no_grad():
        out = model(**tok(text, return_tensors="pt"), output_hidden_states=True)
    probs = out.logits[0].softmax(-1)
    lens = result(url, "logit_lens", {"prompt": text, "top_k": 2})
    assert lens["layers"] == [0, 1]
    top = probs.topk(2)
    assert [[p["id"] for p in cell] for cell in lens["topk"][-1]] == top.indices.tolist()
    close([[p["prob"] for p in cell] for cell in lens["topk"][-1]], top.values)
    line = result(url, "lens_line", {"prompt": text})
    assert len(line["values"]) == 2
    for layer, width in ((0, 32), (-1, 16)):
        emb = result(url, "embed", {"texts": [text], "layer": layer})
        assert emb["dim"] == len(emb["embeddings"][0]) == width
        close(emb["embeddings"][0], out.hidden_states[layer][0][1:].mean(0))
    patched = result(url, "activation_patching", {"src_prompt": "ab", "tgt_prompt": "cd"})
    assert len(patched["prob_diff"]) == 2


# -- layers that are not one list ---------------------------------------------------------------


def test_a_model_whose_blocks_are_not_one_list_refuses_the_lens_and_serves_the_rest(
    servers: dict[str, Server], paths: dict[str, Path]
) -> None:
    url = servers["hrm"].url
    for tool, params in [
        ("logit_lens", {"prompt": "ab"}),
        ("lens_line", {"prompt": "ab"}),
        ("lens_grid", {"prompt": "ab"}),
        ("activation_patching", {"src_prompt": "ab", "tgt_prompt": "cd"}),
    ]:
        refused(url, tool, params, "causal_lm", "not one list")
    tok = tf.AutoTokenizer.from_pretrained(paths["hrm"])
    model = tf.AutoModelForCausalLM.from_pretrained(paths["hrm"]).eval()
    with torch.no_grad():
        probs = model(**tok("ab", return_tensors="pt")).logits[0, -1].softmax(-1)
    out = result(url, "predict", {"prompt": "ab", "top_k": 3})
    assert [p["id"] for p in out["predictions"]] == probs.topk(3).indices.tolist()
    close([p["prob"] for p in out["predictions"]], probs.topk(3).values)


# -- a custom model through --model-loader --------------------------------------------------------


@pytest.mark.parametrize("which", ["custom", "custom_plain"])
def test_a_custom_recurrent_model_generates_what_full_context_greedy_decoding_gives(
    servers: dict[str, Server], which: str
) -> None:
    reference = custom_model.ByteGRU().eval()
    prompts = ["Hello", "a", "The quick brown fox"]
    out = result(servers[which].url, "generate", {"prompts": prompts, "max_tokens": 12})
    for prompt, completion in zip(prompts, out["completions"]):
        assert completion == reference.detokenize(custom_model.greedy(reference, prompt, 12))
    ready = httpx.get(servers[which].url + "/readyz").json()
    assert ("incremental" in ready["capabilities"]) == (which == "custom")


def test_a_custom_model_scores_and_reads_out_like_its_own_forward(servers: dict[str, Server]) -> None:
    reference = custom_model.ByteGRU().eval()
    url = servers["custom"].url
    ids = [custom_model.BOS, *reference.tokenize("Hello")]
    with torch.no_grad():
        logits = reference.logits(torch.tensor([ids]), torch.ones(1, len(ids)))[0]
        states = reference.hidden_states(torch.tensor([ids]), torch.ones(1, len(ids)))
    probs = logits.softmax(-1)
    out = result(url, "predict", {"prompt": "Hello", "top_k": 3})
    assert [p["id"] for p in out["predictions"]] == probs[-1].topk(3).indices.tolist()
    close([p["prob"] for p in out["predictions"]], probs[-1].topk(3).values)
    ll = result(url, "loglikelihood", {"prompts": ["Hell"], "continuations": ["o"]})
    assert math.isclose(ll["ll"][0], float(logits[-2].log_softmax(-1)[ids[-1]]), abs_tol=1e-5)
    lens = result(url, "logit_lens", {"prompt": "Hello", "layers": [-1], "top_k": 1})
    assert [cell[0]["id"] for cell in lens["topk"][0]] == probs.argmax(-1).tolist()
    emb = result(url, "embed", {"texts": ["Hello"], "layer": 2})
    close(emb["embeddings"][0], states[2][0][1:].mean(0))
    for tool, params in [("logit_lens", {"prompt": "a"}), ("embed", {"texts": ["a"]})]:
        refused(servers["custom_plain"].url, tool, params, "custom", "it has no")


# -- no model shape ever makes a 5xx --------------------------------------------------------------


def params_for(tool: str, model: str) -> dict[str, Any]:
    mask = {"esm_mlm": "<mask>", "esm_encoder": "<mask>", "bert_mlm": "[MASK]"}.get(model, "<mask>")
    text = "MKTAYIAK" if model.startswith("esm") else "the cat sat"
    return {
        "generate": {"prompts": [text], "max_tokens": 3},
        "loglikelihood": {"prompts": [text], "continuations": [" a"]},
        "logprobs": {"prompts": [text], "top": 2, "next_token": True},
        "predict": {"prompt": text},
        "logit_lens": {"prompt": text},
        "lens_line": {"prompt": text},
        "lens_grid": {"prompt": text},
        "activation_patching": {"src_prompt": text, "tgt_prompt": text},
        "embed": {"texts": [text]},
        "fill_mask": {"texts": [text + mask]},
        "pseudo_loglikelihood": {"sequences": [text]},
    }[tool]


def test_no_model_makes_any_tool_answer_5xx(servers: dict[str, Server]) -> None:
    outcomes: dict[tuple[str, str], str] = {}
    for model, server in servers.items():
        for tool in builtin_tools():
            s = run_stream(server.url, tool.name, params_for(tool.name, model))
            assert s.status < 500, (model, tool.name, s.raw[:300])
            if s.status == 200:
                assert s.terminal["event"] == "data", (model, tool.name, s.terminal)
                outcomes[model, tool.name] = "data"
            else:
                assert s.status == 422 and s.body["error"]["code"] == "unsupported_by_model", (model, tool.name, s.body)
                outcomes[model, tool.name] = "refused"
    # Each kind serves what it can: the sweep is not passing by refusing everything.
    assert outcomes["esm_mlm", "fill_mask"] == outcomes["esm_mlm", "embed"] == "data"
    assert outcomes["llama", "generate"] == outcomes["opt350", "logit_lens"] == outcomes["hrm", "logprobs"] == "data"
    assert outcomes["custom", "activation_patching"] == outcomes["custom_plain", "generate"] == "data"


# -- the remote backend refuses the same way ------------------------------------------------------


def test_a_remote_gateway_refuses_what_its_executors_model_cannot_run(executors: Any, paths: dict[str, Path]) -> None:
    from tests.conftest import make_remote_server

    executor = executors.get(paths["esm_mlm"])
    server = make_remote_server([executor.url])
    try:
        tools = {t["name"]: t for t in httpx.get(server.url + "/tools").json()}
        assert "masked_lm" in tools["generate"]["unsupported"] and tools["embed"]["unsupported"] is None
        error = refused(server.url, "generate", {"prompts": ["MKT"]}, "masked_lm", "causal next-token logits")
        assert error["retryable"] is False
        out = result(server.url, "pseudo_loglikelihood", {"sequences": ["MKTAY"]})
        assert out["tokens_scored"] == [5]
    finally:
        server.stop()


# -- one big job over every device ------------------------------------------------------------------


def test_one_big_job_spreads_over_every_device_with_the_one_device_result(paths: dict[str, Path]) -> None:
    import random
    import threading

    rng = random.Random(0)
    sequences = ["".join(rng.choice("LAGVSERTIDPKQNFYMHWC") for _ in range(rng.randint(3, 60))) for _ in range(70)]
    one = make_server(paths["esm_mlm"])
    two = make_server(paths["esm_mlm"], devices=["cpu", "cpu"])
    try:
        threads: set[int] = set()
        hooks = [
            w.model.module.register_forward_pre_hook(lambda *_: threads.add(threading.get_ident()))
            for w in two.backend.workers
        ]
        for tool, params, unit, total in [
            ("embed", {"texts": sequences, "pooling": "per_token"}, "texts", len(sequences)),
            ("pseudo_loglikelihood", {"sequences": sequences[:12], "per_position": True}, "positions",
             sum(len(s) for s in sequences[:12])),
        ]:
            threads.clear()
            alone = result(one.url, tool, params)
            spread = run_stream(two.url, tool, params)
            assert spread.terminal["event"] == "data"
            # Both devices' workers ran chunks of the one job.
            assert len(threads) == 2, threads
            # In the caller's order, and equal: each chunk is the same padded pass wherever it ran.
            assert spread.terminal["data"] == alone, tool
            frames = [e["data"]["progress"] for e in spread.of("status") if "progress" in e["data"]]
            assert frames[-1] == {"done": total, "total": total, "unit": unit}
            assert len(frames) >= 2 and [f["done"] for f in frames] == sorted(f["done"] for f in frames)
        assert [len(v) for v in alone["per_position"]] == [len(s) for s in sequences[:12]]
        for hook in hooks:
            hook.remove()
    finally:
        one.stop()
        two.stop()


def test_the_models_pages_loader_example_loads_and_passes_its_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import re
    import sys

    from backends import loading as models

    page = (Path(__file__).parent.parent / "docs" / "models.md").read_text()
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "# mypkg/models.py" in block]
    package = tmp_path / "readme_loader"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        model = models.load(models.ModelSpec("byte-lm", ""), "cpu", loader="readme_loader.models:load")
    finally:
        sys.modules.pop("readme_loader.models", None)
        sys.modules.pop("readme_loader", None)
    assert model.kind.value == "custom"
    assert {c.value for c in model.capabilities} == {"next_token", "incremental"}, model.missing


def test_embed_refuses_cls_on_a_causal_model_and_a_text_of_special_tokens_only(servers: dict[str, Server]) -> None:
    r = httpx.post(servers["llama"].url + "/embed/run", json={"texts": ["ab"], "pooling": "cls"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "pooling", r.text
    assert "causal" in r.json()["error"]["message"]
    r = httpx.post(servers["esm_mlm"].url + "/embed/run", json={"texts": ["MKT", "<eos>"]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "texts[1]", r.text
    r = httpx.post(servers["esm_mlm"].url + "/pseudo_loglikelihood/run", json={"sequences": ["MK<mask>"]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "sequences[0]", r.text


def test_a_task_head_checkpoint_serves_its_encoder_and_a_causal_base_model_no_cls(tmp_path: Path) -> None:
    from backends import loading as models

    path = build("bert_mlm", tmp_path / "bert-cls")
    tok = tf.AutoTokenizer.from_pretrained(path)
    config = tf.AutoConfig.from_pretrained(path)
    tf.BertForSequenceClassification(config).save_pretrained(path)  # its LM head is not saved
    loaded = models.load(models.resolve(str(path)), "cpu")
    assert loaded.kind.value == "encoder" and loaded.bidirectional, loaded
    assert tok is not None
    llama = build_tiny_model(tmp_path / "llama")
    base = tf.AutoModel.from_pretrained(llama)
    base.save_pretrained(tmp_path / "llama-base")
    tf.AutoTokenizer.from_pretrained(llama).save_pretrained(tmp_path / "llama-base")
    loaded = models.load(models.resolve(str(tmp_path / "llama-base")), "cpu")
    # A causal family's base model: hidden states, and its first token sees nothing after it.
    assert loaded.kind.value == "encoder" and not loaded.bidirectional


# A tool whose chunks run on every device and fail on some inputs, or whose result cannot be written.
from gateway.tools import Context, Model, tool  # noqa: E402
from gateway.tools.batching import Chunk, Chunked, one_pass, sorted_chunks  # noqa: E402
import msgspec  # noqa: E402


class SpreadParams(msgspec.Struct):
    texts: list[str]


def _spread_plan(model: Model, jobs: list[SpreadParams], ctxs: Any = None) -> list[Chunk]:
    return sorted_chunks([((j, i), model.encode(t)) for j, p in enumerate(jobs) for i, t in enumerate(p.texts)], 2)


def _spread_run(model: Model, jobs: list[SpreadParams], chunk: Chunk) -> list[Any]:
    texts = [jobs[j].texts[i] for j, i in chunk.items]
    if "boom" in texts:
        raise ValueError("boom")
    return [object() if t == "unwritable" else len(t) for t in texts]


_spread_work = Chunked(
    plan=_spread_plan, run=_spread_run, assemble=lambda m, jobs, out, ctxs: [[out[j, i] for i in range(len(p.texts))] for j, p in enumerate(jobs)], unit="texts"
)


@tool(batch=one_pass(_spread_work.many), spread=_spread_work)
def spread_probe(model: Model, params: SpreadParams, ctx: Context) -> list[Any]:
    """Lengths of texts, chunk by chunk on every device."""
    return _spread_work.many(model, [params], [ctx])[0]


def test_a_spread_job_that_fails_ends_once_and_the_workers_go_on(paths: dict[str, Path]) -> None:
    server = make_server(paths["llama"], devices=["cpu", "cpu"], tools=[spread_probe])
    try:
        texts = [f"t{i}" * (i + 1) for i in range(9)]
        ok = result(server.url, "spread_probe", {"texts": texts})
        assert ok == [len(t) for t in texts]
        for bad in ("boom", "unwritable"):
            s = run_stream(server.url, "spread_probe", {"texts": [*texts, bad]})
            assert [e["event"] for e in s.events].count("error") == 1 and s.terminal["event"] == "error", s.events[-3:]
            assert s.of("data") == []
        # Both workers are still alive and serving.
        assert all(w._task is not None and not w._task.done() for w in server.backend.workers)
        assert result(server.url, "spread_probe", {"texts": texts}) == ok
    finally:
        server.stop()


def test_recomputing_the_context_gives_the_tokens_of_the_kv_cache(paths: dict[str, Path]) -> None:
    from gateway.models.base import Capability

    server = make_server(paths["opt350"])
    try:
        params = {"prompts": ["Hello there", "a", "The quick brown"], "max_tokens": 10}
        cached = result(server.url, "generate", params)
        for worker in server.backend.workers:  # as for a model whose cache failed its probe
            worker.model.capabilities = worker.model.capabilities - {Capability.INCREMENTAL}
        assert result(server.url, "generate", params) == cached
    finally:
        server.stop()


@pytest.mark.parametrize("kind", ["llama", "esm_mlm", "bert_mlm", "opt350"])
def test_decoding_is_the_tokenizers_own_for_every_id(paths: dict[str, Path], kind: str) -> None:
    """`Model.decode` may skip transformers' wrapper (gateway/models/base.py `_decoder`): the text must
    be what the wrapper gives, special tokens and cut multi-byte characters included."""
    from transformers import AutoTokenizer

    from backends import loading as models

    model = models.load(models.resolve(str(paths[kind])), "cpu")
    tokenizer = AutoTokenizer.from_pretrained(paths[kind])
    generator = torch.Generator().manual_seed(0)
    size = len(tokenizer)
    rows = [list(range(size))] + [torch.randint(0, size, (n,), generator=generator).tolist() for n in (1, 2, 3, 7, 40) for _ in range(20)]
    for ids in rows:
        assert model.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
