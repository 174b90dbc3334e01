"""The bundled default model, SmolLM2-135M-Instruct, converted once from its GGUF file and cached."""

from __future__ import annotations

import json

import httpx
import pytest

from backends import loading as models
from tests.conftest import make_server, run_stream

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def smol():
    server = make_server(None, ready=False)
    server.wait_ready(timeout=300)
    yield server
    server.stop()


def test_the_documented_curl_session(smol):
    s = run_stream(smol.url, "generate", {"prompts": ["The capital of France is"], "max_tokens": 8})
    statuses = [e["data"]["status"] for e in s.of("status")]
    assert statuses[:3] == ["RECEIVED", "QUEUED", "RUNNING"]
    result = s.terminal["data"]
    assert s.terminal["event"] == "data"
    assert "Paris" in result["completions"][0]
    assert "".join(p["data"]["text"] for p in s.of("partial")) == result["completions"][0]
    assert result["usage"]["completion_tokens"] == 8


def test_predict_and_loglikelihood_know_paris(smol):
    top = run_stream(smol.url, "predict", {"prompt": "The capital of France is", "top_k": 3}).terminal["data"]
    assert top["predictions"][0]["text"] == " Paris"
    ll = run_stream(
        smol.url,
        "loglikelihood",
        {"prompts": ["The capital of France is"] * 2, "continuations": [" Paris", " Berlin"]},
    ).terminal["data"]
    assert ll["ll"][0] > ll["ll"][1]
    assert ll["is_greedy"] == [True, False]


def test_the_conversion_is_cached_as_plain_safetensors(smol, monkeypatch):
    spec = models.resolve(None)
    cached = models.converted_path(spec, models.cache_root())
    assert (cached / "model.safetensors").is_file()
    config = json.loads((cached / "config.json").read_text())
    assert "quantization_config" not in config

    def no_conversion(*args, **kwargs):
        raise AssertionError("a cached model was converted again")

    monkeypatch.setattr(models, "convert_gguf", no_conversion)
    loaded = models.load(spec, device="cpu")
    assert loaded.context_length == 8192
    assert loaded.name == "SmolLM2-135M-Instruct"


def test_the_lens_finds_paris_in_the_last_layers(smol):
    lens = run_stream(
        smol.url, "logit_lens",
        {"prompt": "The Eiffel Tower is in the city of", "top_k": 1, "positions": [-1], "track": [" Paris"]},
    ).terminal["data"]
    assert len(lens["layers"]) == 30
    tops = [layer[0][0]["text"] for layer in lens["topk"]]
    assert tops[-1] == " Paris"  # the last layer's lens is the model's own prediction
    assert " Paris" not in tops[:10]  # early layers have not got there yet
    paris = [row[0] for row in lens["tracked"][" Paris"]]
    assert paris[-1] > 0.5 and max(paris[:20]) < 0.01


def test_the_documented_chat_is_the_reply_transformers_generates(smol):
    """README's chat example: the reply equals greedy decoding of the template's rendering in plain transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    messages = [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    out = run_stream(smol.url, "generate", {"messages": messages, "max_tokens": 32}).terminal["data"]
    assert "chat" in httpx.get(f"{smol.url}/readyz").json()["capabilities"]
    path = models.converted_path(models.resolve(None), models.cache_root())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        generated = model.generate(**ids, do_sample=False, max_new_tokens=32)
    reply = tok.decode(generated[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert out["completions"] == [reply] and "Paris" in reply
    assert out["usage"]["prompt_tokens"] == ids["input_ids"].shape[1]
