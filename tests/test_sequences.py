"""Sequences on a protein model: cleaned one documented way (upper-case, whitespace and line
breaks out, the mask token kept), letters outside its alphabet refused with their position, and
texts on a model of text passed on exactly as written."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from gateway.errors import ParamError
from gateway.models import alphabet
from tests.conftest import make_server, run_stream
from tests.test_tools import result

ESM_LETTERS = "LAGVSERTIDPKQNFYMHWCXBUZO.-"


@pytest.fixture(scope="module")
def paths(tiny: Callable[..., Path], tiny_model_path: Path) -> dict[str, Path]:
    return {
        "esm": tiny("esm_mlm"),
        "bert": tiny("bert_mlm"),
        "text": tiny_model_path,
    }


@pytest.fixture(scope="module")
def server(paths: dict[str, Path]):
    s = make_server([f"{name}={path}" for name, path in paths.items()])
    yield s
    s.stop()


def test_an_alphabet_comes_from_a_tokenizer_of_letters_only(paths: dict[str, Path]) -> None:
    assert alphabet.from_tokenizer(AutoTokenizer.from_pretrained(paths["esm"])) == ESM_LETTERS
    assert alphabet.from_tokenizer(AutoTokenizer.from_pretrained(paths["bert"])) is None  # word pieces: text
    assert alphabet.from_tokenizer(AutoTokenizer.from_pretrained(paths["text"])) is None  # 256 bytes: text


def test_models_say_their_alphabet(server) -> None:
    listed = {m["name"]: m for m in httpx.get(server.url + "/models").json()["models"]}
    assert (listed["esm"]["alphabet"], listed["bert"]["alphabet"], listed["text"]["alphabet"]) == (ESM_LETTERS, None, None)


def test_cleaning_is_upper_case_and_no_whitespace_and_nothing_else() -> None:
    assert alphabet.clean("mk ta\nyi\r\n\tak ", ESM_LETTERS, "x") == "MKTAYIAK"
    assert alphabet.clean("mk<mask>a y<mask>", ESM_LETTERS, "x", keep="<mask>") == "MK<mask>AY<mask>"
    with pytest.raises(ParamError) as err:
        alphabet.clean("mk\nt<mask>a#y", ESM_LETTERS, "seqs[2]", keep="<mask>")
    # Positions count the cleaned letters from 1, the mask one of them.
    assert err.value.field == "seqs[2]" and "letter '#' at position 6" in err.value.message and ESM_LETTERS in err.value.message


def test_a_wrapped_lower_case_sequence_is_the_same_sequence(server) -> None:
    wrapped = "mktayiakqr\nqisfvksh\r\nfsrq"
    for tool, params in (
        ("embed", {"texts": [wrapped, wrapped.upper().replace("\n", "").replace("\r", "")]}),
        ("pseudo_loglikelihood", {"sequences": [wrapped, "MKTAYIAKQRQISFVKSHFSRQ"]}),
    ):
        out = result(server.url, tool, {**params, "model": "esm"})
        first, second = out["embeddings"] if tool == "embed" else out["pll"]
        assert first == second, tool
    filled = result(server.url, "fill_mask", {"texts": ["mk<mask>y\nia"], "model": "esm"})
    same = result(server.url, "fill_mask", {"texts": ["MK<mask>YIA"], "model": "esm"})
    assert filled == same


@pytest.mark.parametrize(
    ("tool", "params", "field", "letter", "position"),
    [
        ("embed", {"texts": ["MKTAY", "MKT#AY"]}, "texts[1]", "#", 4),
        ("pseudo_loglikelihood", {"sequences": ["mk\nj"]}, "sequences[0]", "J", 3),
        ("fill_mask", {"texts": ["M<mask>1"]}, "texts[0]", "1", 3),
    ],
)
def test_a_letter_outside_the_alphabet_is_refused_naming_it(server, tool, params, field, letter, position) -> None:
    response = httpx.post(f"{server.url}/{tool}/run", json={**params, "model": "esm"})
    assert response.status_code == 422
    error = response.json()["error"]
    assert (error["code"], error["field"]) == ("invalid_params", field)
    assert f"letter {letter!r} at position {position}" in error["message"]


def test_text_models_get_their_text_as_written(server) -> None:
    lower = result(server.url, "embed", {"texts": ["mk ta"], "model": "text"})["embeddings"][0]
    upper = result(server.url, "embed", {"texts": ["MKTA"], "model": "text"})["embeddings"][0]
    assert lower != upper
    s = run_stream(server.url, "embed", {"texts": ["what #1?"], "model": "bert"})
    assert s.terminal["event"] == "data"


# -- a DNA model with tags ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dna():
    s = make_server(None, model_loader="dna=tests.support.custom_model:load_dna")
    yield s
    s.stop()


def test_a_dna_model_says_its_alphabet_and_tags(dna) -> None:
    (model,) = httpx.get(dna.url + "/models").json()["models"]
    assert (model["name"], model["alphabet"], model["tags"]) == ("dna", "ACGTN", ["bacteria", "human"])


def test_a_tag_goes_before_the_sequence_and_positions_are_the_callers_letters(dna) -> None:
    import torch

    from tests.support.custom_model import BOS, DNA_TAGS, greedy

    module = dna.backend.model.module
    out = result(dna.url, "embed", {"texts": ["acg\ntn"], "pooling": "per_token", "tag": "bacteria"})
    assert out["tokens"] == [["A", "C", "G", "T", "N"]]  # the tag's tokens are no positions of the sequence
    ids = [BOS, *DNA_TAGS["bacteria"].encode(), *b"ACGTN"]
    with torch.inference_mode():
        states = module.hidden_states(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[-1][0]
    assert torch.allclose(torch.tensor(out["embeddings"][0]), states[-5:], atol=1e-5)
    untagged = result(dna.url, "embed", {"texts": ["ACGTN"], "pooling": "per_token"})
    assert untagged["tokens"] == out["tokens"] and untagged["embeddings"] != out["embeddings"]
    # generate with a tag completes the tagged sequence: greedy decoding of the tag and the bases, by hand.
    tagged = result(dna.url, "generate", {"prompts": ["acgt"], "tag": "human", "max_tokens": 4})
    assert tagged["completions"] == [module.detokenize(greedy(module, DNA_TAGS["human"] + "ACGT", 4))]


def test_an_unknown_tag_is_refused_with_the_known_ones(dna, server) -> None:
    unknown = httpx.post(dna.url + "/embed/run", json={"texts": ["ACGT"], "tag": "archaea"})
    assert unknown.status_code == 422
    error = unknown.json()["error"]
    assert error["field"] == "tag" and "archaea" in error["message"] and "bacteria, human" in error["message"]
    none = httpx.post(server.url + "/embed/run", json={"texts": ["MKT"], "tag": "bacteria", "model": "esm"})
    assert none.status_code == 422 and none.json()["error"]["field"] == "tag" and "declares no tags" in none.json()["error"]["message"]
    base = httpx.post(dna.url + "/embed/run", json={"texts": ["ACGU"], "tag": "human"})
    assert base.status_code == 422 and "letter 'U' at position 4" in base.json()["error"]["message"]
