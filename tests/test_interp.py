"""The interpretability tools on every model family, checked against plain transformers.

For each family in `FAMILIES` (Llama, GPT-2, GPT-NeoX, Qwen2, Gemma, Gemma 2 with an
active final logit soft-cap) a gateway serves a tiny random model, and every
number a tool returns is recomputed here the obvious way, in float32, with
nothing from `gateway.tools`:

- the residual stream after block i is `output_hidden_states=True`'s entry i + 1;
  the lens of a layer is the family's final norm and unembedding (named per family
  in `PARTS`, not found by the code under test), with Gemma 2's soft-cap, applied to
  it. The last entry of `hidden_states` is already normed, so the last layer's lens
  is compared with the model's own logits;
- activation patching is two forward passes: the source run with a hook that keeps
  block outputs, and the target run with a hook that returns the block output with
  one position replaced;
- embeddings are each text's `hidden_states[layer]` alone, unpadded;
- predict is the softmax of the last logits, and greedy generate is `model.generate`.

Tolerance: 1e-5 absolute and relative, in float32.

Then, on the tiny Llama: progress per layer, cancellation between layers, a
responsive event loop while a lens runs, the 422s and 413s naming their field,
and GET /tools.

The logit lens, activation patching and embedding checks also run through the
remote backend (a gateway driving a real executor process) on the Llama alone:
the same checks against the same reference, with results that crossed as msgpack
raw buffers and must come out as the same JSON floats.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import (
    TINY_CONTEXT,
    TINY_SOFTCAP,
    build_tiny_model,
    make_server,
    open_stream,
    parse_sse,
    run_stream,
    start_any,
    track_jobs,
    wait_until,
)

TOL = {"atol": 1e-5, "rtol": 1e-5}

# Where each family keeps its decoder blocks, final norm and unembedding: written
# out here so that the reference does not share the anatomy code it checks.
PARTS = {
    "llama": ("model.layers", "model.norm", "lm_head"),
    "gpt2": ("transformer.h", "transformer.ln_f", "lm_head"),
    "gpt_neox": ("gpt_neox.layers", "gpt_neox.final_layer_norm", "lm_head|embed_out"),  # embed_out before v5
    "qwen2": ("model.layers", "model.norm", "lm_head"),
    "gemma": ("model.layers", "model.norm", "lm_head"),
    "gemma2": ("model.layers", "model.norm", "lm_head"),
}
SOFTCAPPED = {"gemma2"}  # tanh(logits / cap) * cap after the unembedding

PROMPT = "The quick brown fox"
INTERP_TOOLS = ("logit_lens", "lens_line", "lens_grid", "activation_patching", "embed")


# -- the reference: plain transformers -------------------------------------------------------


def _block_output(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


class Reference:
    def __init__(self, path: Path) -> None:
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.family = self.model.config.model_type
        blocks, norm, unembed = PARTS[self.family]
        self.blocks = self.model.get_submodule(blocks)
        self.norm = self.model.get_submodule(norm)
        self.unembed = next(getattr(self.model, name) for name in unembed.split("|") if hasattr(self.model, name))
        self.n_layers = len(self.blocks)
        assert self.n_layers == self.model.config.num_hidden_layers
        self.softcap = self.model.config.final_logit_softcapping if self.family in SOFTCAPPED else None
        if self.family in SOFTCAPPED:
            assert self.softcap == TINY_SOFTCAP

    def encode(self, text: str) -> list[int]:
        return self.tok(text)["input_ids"]

    def token_id(self, text: str) -> int:
        (token,) = self.tok(text, add_special_tokens=False)["input_ids"]
        return token

    def text(self, token: int) -> str:
        return self.tok.decode([token], clean_up_tokenization_spaces=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    @torch.no_grad()
    def forward(self, ids: list[int]) -> Any:
        return self.model(input_ids=torch.tensor([ids]), output_hidden_states=True)

    @torch.no_grad()
    def unembed_logits(self, hidden: torch.Tensor, softcap: bool = True) -> torch.Tensor:
        logits = self.unembed(self.norm(hidden)).float()
        if softcap and self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.no_grad()
    def lens(self, ids: list[int], softcap: bool = True) -> torch.Tensor:
        """Probabilities, layer × position × vocabulary."""
        out = self.forward(ids)
        hs = out.hidden_states
        assert len(hs) == self.n_layers + 1
        per_layer = [self.unembed_logits(hs[i + 1][0], softcap) for i in range(self.n_layers - 1)]
        per_layer.append(out.logits[0].float())  # hs[-1] is already normed: the model's logits
        return torch.stack(per_layer).softmax(-1)

    @torch.no_grad()
    def block_outputs(self, ids: list[int]) -> list[torch.Tensor]:
        """Each block's output (positions × hidden) in one run, kept by forward hooks."""
        kept: dict[int, torch.Tensor] = {}
        handles = [
            block.register_forward_hook(lambda m, a, out, i=i: kept.__setitem__(i, _block_output(out)[0].clone()))
            for i, block in enumerate(self.blocks)
        ]
        try:
            self.model(input_ids=torch.tensor([ids]))
        finally:
            for handle in handles:
                handle.remove()
        return [kept[i] for i in range(self.n_layers)]

    @torch.no_grad()
    def last_probs(self, ids: list[int], patch: tuple[int, int, torch.Tensor] | None = None) -> torch.Tensor:
        """Next-token probabilities after `ids`; `patch` = (layer, position, vector) replaces a block output."""
        handle = None
        if patch is not None:
            layer, position, vector = patch

            def replace(module: Any, args: Any, output: Any) -> Any:
                hidden = _block_output(output).clone()
                hidden[0, position] = vector
                return hidden if isinstance(output, torch.Tensor) else (hidden, *output[1:])

            handle = self.blocks[layer].register_forward_hook(replace)
        try:
            return self.model(input_ids=torch.tensor([ids])).logits[0, -1].float().softmax(-1)
        finally:
            if handle is not None:
                handle.remove()

    @torch.no_grad()
    def states(self, text: str, layer: int) -> torch.Tensor:
        return self.forward(self.encode(text)).hidden_states[layer][0].float()

    @torch.no_grad()
    def greedy(self, prompt: str, n: int) -> list[int]:
        inputs = self.tok(prompt, return_tensors="pt")
        out = self.model.generate(**inputs, do_sample=False, max_new_tokens=n, pad_token_id=self.tok.pad_token_id)
        return out[0, inputs["input_ids"].shape[1] :].tolist()


@dataclass
class Arch:
    url: str
    ref: Reference

    @property
    def n(self) -> int:
        return self.ref.n_layers


@pytest.fixture(scope="module")
def arch(arch_model_path: Path) -> Iterator[Arch]:
    """A gateway and a reference model for each family, started once per family."""
    server = make_server(arch_model_path)
    try:
        yield Arch(server.url, Reference(arch_model_path))
    finally:
        server.stop()


# -- helpers ------------------------------------------------------------------------------------


def result(url: str, tool: str, params: dict[str, Any]) -> Any:
    s = run_stream(url, tool, params, timeout=120)
    assert s.status == 200, s.raw
    assert s.terminal["event"] == "data", s.terminal
    return s.terminal["data"]


def close(actual: Any, expected: Any) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected).double(), **TOL
    )


def check_topk(ref: Reference, entries: list[dict[str, Any]], probs: torch.Tensor, k: int) -> None:
    """Top-k entries against a reference distribution, robust to exact ties in the ordering."""
    top = probs.topk(k)
    assert len(entries) == k
    close([e["prob"] for e in entries], top.values)  # the k largest probabilities, in order
    close([e["prob"] for e in entries], probs[[e["id"] for e in entries]])  # of those very tokens
    assert len({e["id"] for e in entries}) == k
    assert [e["text"] for e in entries] == [ref.text(e["id"]) for e in entries]
    values = top.values.tolist()
    for j, (e, want) in enumerate(zip(entries, top.indices.tolist())):
        gap = min(abs(values[j] - v) for i, v in enumerate(values) if i != j) if k > 1 else 1.0
        if gap > 1e-5:  # not a near-tie: the very same token
            assert e["id"] == want


TIE = 1e-6  # probabilities closer than this may come out in either order


def rank_bounds(probs: torch.Tensor, tokens: list[int]) -> tuple[int, int]:
    """The best 1-based rank (strictly likelier tokens + 1) of any of `tokens` in the 1-D `probs`,
    as the (lowest, highest) it can be given near-ties: one number when none is within TIE."""
    lows = [int((probs > probs[t] + TIE).sum()) + 1 for t in tokens]
    highs = [int((probs >= probs[t] - TIE).sum()) for t in tokens]
    return min(lows), min(highs)


def assert_ranks(got: list[Any], probs: torch.Tensor, tokens: list[list[int]] | list[int]) -> None:
    """Ranks row by row (`probs` rows × vocab): exact, up to the order of near-tied tokens."""
    assert len(got) == len(probs)
    for value, row, token in zip(got, probs, tokens):
        lo, hi = rank_bounds(row, token if isinstance(token, list) else [token])
        assert lo <= value <= hi and value == int(value), (value, lo, hi)


def top_texts(row: torch.Tensor, ref: Any) -> set[str]:
    """The texts of the most likely token and of any within TIE of it."""
    return {ref.text(i) for i in torch.nonzero(row >= row.max() - TIE).flatten().tolist()}


def entropy(probs: torch.Tensor) -> torch.Tensor:
    logp = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))
    return -(probs * logp).sum(-1)


# -- logit_lens --------------------------------------------------------------------------------


def test_logit_lens_every_layer_and_position_equals_norm_and_unembed_by_hand(arch: Arch) -> None:
    ref = arch.ref
    track = ["e", " ", "q", "</s>"]
    out = result(arch.url, "logit_lens", {"prompt": PROMPT, "top_k": 7, "track": track})
    ids = ref.encode(PROMPT)
    probs = ref.lens(ids)
    n, T = arch.n, len(ids)
    assert out["tokens"] == [ref.text(i) for i in ids]
    assert out["layers"] == list(range(n))
    assert out["positions"] == list(range(T))
    assert len(out["topk"]) == n and all(len(row) == T for row in out["topk"])
    for layer in range(n):
        for pos in range(T):
            check_topk(ref, out["topk"][layer][pos], probs[layer, pos], 7)
    close(out["entropy"], entropy(probs))
    assert list(out["tracked"]) == track
    for text in track:
        close(out["tracked"][text], probs[:, :, ref.token_id(text)])
    # EOS's zeroed head row: its logit is exactly 0 at the last layer, whatever the family.
    assert min(out["tracked"]["</s>"][-1]) > 0
    if ref.softcap:
        # The soft-cap matters here: without it the numbers would be far off.
        uncapped = ref.lens(ids, softcap=False)
        assert (uncapped[:-1] - probs[:-1]).abs().max() > 1e-3
    # The last layer's lens is the model's own prediction.
    last = ref.forward(ids).logits[0].softmax(-1)
    close([row[0]["prob"] for row in out["topk"][-1]], last.max(-1).values)


def test_logit_lens_subsets_with_negative_indices(arch: Arch) -> None:
    ref = arch.ref
    n = arch.n
    ids = ref.encode(PROMPT)
    T = len(ids)
    params = {
        "prompt": PROMPT, "top_k": 3, "layers": [-1, 0], "positions": [-1, 2, 0, -T],
        "include_entropy": False, "track": ["o"],
    }
    out = result(arch.url, "logit_lens", params)
    layers, positions = [n - 1, 0], [T - 1, 2, 0, 0]
    assert out["layers"] == layers and out["positions"] == positions
    assert "entropy" not in out
    assert out["tokens"] == [ref.text(i) for i in ids]  # every token, whatever the positions
    probs = ref.lens(ids)[layers][:, positions]
    for li in range(len(layers)):
        for pi in range(len(positions)):
            check_topk(ref, out["topk"][li][pi], probs[li, pi], 3)
    close(out["tracked"]["o"], probs[:, :, ref.token_id("o")])

    # Without track, no tracked key; a single middle layer of a deeper family too.
    out = result(arch.url, "logit_lens", {"prompt": "ab", "layers": [-2], "positions": [1], "top_k": 1})
    assert "tracked" not in out and out["layers"] == [n - 2] and out["positions"] == [1]
    probs = ref.lens(ref.encode("ab"))[n - 2, 1]
    check_topk(ref, out["topk"][0][0], probs, 1)
    close(out["entropy"], [[entropy(probs)]])


# -- lens_line ---------------------------------------------------------------------------------


def test_lens_line_probability_rank_and_entropy(arch: Arch) -> None:
    ref = arch.ref
    n = arch.n
    ids = ref.encode(PROMPT)
    probs = ref.lens(ids)
    final = probs[-1]

    # A given token at a given position, every layer.
    out = result(arch.url, "lens_line", {"prompt": PROMPT, "token": "e", "position": 3})
    assert (out["stat"], out["token"], out["position"], out["layers"]) == ("probability", "e", 3, list(range(n)))
    close(out["values"], probs[:, 3, ref.token_id("e")])

    # Default token (the model's own prediction) and position (the last), as a rank.
    out = result(arch.url, "lens_line", {"prompt": PROMPT, "stat": "rank"})
    assert out["position"] == len(ids) - 1 and out["token"] in top_texts(final[-1], ref)
    assert_ranks(out["values"], probs[:, -1], [int(final[-1].argmax())] * n)
    assert out["values"][-1] == 1.0  # the prediction is the last layer's top token

    # A rank of a given token, at a negative position, on chosen layers.
    out = result(arch.url, "lens_line", {"prompt": PROMPT, "stat": "rank", "token": "x", "position": -2, "layers": [0, -1]})
    assert out["position"] == len(ids) - 2 and out["layers"] == [0, n - 1]
    assert_ranks(out["values"], probs[[0, n - 1], -2], [ref.token_id("x")] * 2)

    out = result(arch.url, "lens_line", {"prompt": PROMPT, "stat": "entropy", "position": 0, "layers": [-1]})
    assert out["layers"] == [n - 1] and out["token"] in top_texts(final[0], ref)
    close(out["values"], entropy(probs[[-1], 0]))


# -- lens_grid ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stat", ["probability", "rank", "entropy"])
def test_lens_grid_values_targets_and_top_tokens(arch: Arch, stat: str) -> None:
    ref = arch.ref
    n = arch.n
    ids = ref.encode(PROMPT)
    T = len(ids)
    probs = ref.lens(ids)
    for params, layers, positions in [
        ({}, list(range(n)), list(range(T))),
        ({"layers": [-1, 0], "positions": [-1, 1, 4]}, [n - 1, 0], [T - 1, 1, 4]),
    ]:
        out = result(arch.url, "lens_grid", {"prompt": PROMPT, "stat": stat, **params})
        assert out["stat"] == stat and out["layers"] == layers and out["positions"] == positions
        assert out["tokens"] == [ref.text(ids[p]) for p in positions]
        grid = probs[layers][:, positions]  # layer × position × vocab
        targets = probs[-1, positions].argmax(-1)  # the model's final prediction per column
        assert all(got in top_texts(row, ref) for got, row in zip(out["targets"], probs[-1, positions]))
        for layer_tops, layer_probs in zip(out["top_tokens"], grid):
            assert all(got in top_texts(row, ref) for got, row in zip(layer_tops, layer_probs))
        if stat == "entropy":
            close(out["values"], entropy(grid))
        else:
            at_target = torch.stack([grid[:, j, t] for j, t in enumerate(targets.tolist())], dim=1)
            if stat == "probability":
                close(out["values"], at_target)
            else:
                for got_row, layer_probs in zip(out["values"], grid):
                    assert_ranks(got_row, layer_probs, targets.tolist())
                if layers[0] == n - 1:
                    assert out["values"][0] == [1.0] * len(positions)


# -- activation_patching ----------------------------------------------------------------------


def patching_by_hand(
    ref: Reference, src: str, tgt: str, layers: list[int], src_pos: list[int], tgt_pos: list[int],
    targets: list[int] | None,
) -> dict[str, Any]:
    src_ids, tgt_ids = ref.encode(src), ref.encode(tgt)
    kept = ref.block_outputs(src_ids)
    source = ref.last_probs(src_ids)
    if targets is None:
        targets = [int(source.argmax())]
    clean = ref.last_probs(tgt_ids)
    diff, patched = [], []
    for layer in layers:
        row_diff, row_probs = [], []
        for s, t in zip(src_pos, tgt_pos):
            probs = ref.last_probs(tgt_ids, (layer, t, kept[layer][s]))
            row_diff.append(float(probs[targets].sum() - clean[targets].sum()))
            row_probs.append(probs)
        diff.append(row_diff)
        patched.append(torch.stack(row_probs))
    return {
        "targets": targets, "clean": float(clean[targets].sum()), "source": float(source[targets].sum()),
        "prob_diff": diff, "patched": patched,
        "labels": [f"{ref.text(src_ids[s])}→{ref.text(tgt_ids[t])}" for s, t in zip(src_pos, tgt_pos)],
    }


def check_patching(ref: Reference, out: dict[str, Any], want: dict[str, Any]) -> None:
    assert out["target_tokens"] == [ref.text(t) for t in want["targets"]]
    assert out["labels"] == want["labels"]
    close(out["clean_prob"], want["clean"])
    close(out["source_prob"], want["source"])
    close(out["prob_diff"], want["prob_diff"])
    assert len(out["rank"]) == len(want["patched"])
    for got_row, probs in zip(out["rank"], want["patched"]):
        assert all(isinstance(r, int) for r in got_row)
        assert_ranks(got_row, probs, [want["targets"]] * len(probs))


def test_patching_equal_lengths_defaults_to_every_position_and_the_source_prediction(arch: Arch) -> None:
    ref, n = arch.ref, arch.n
    src, tgt = "The cat sat on", "The dog ran in"
    T = len(ref.encode(src))
    assert len(ref.encode(tgt)) == T
    out = result(arch.url, "activation_patching", {"src_prompt": src, "tgt_prompt": tgt})
    everything = list(range(T))
    assert out["layers"] == list(range(n))
    assert out["positions"] == out["src_positions"] == everything
    want = patching_by_hand(ref, src, tgt, list(range(n)), everything, everything, None)
    check_patching(ref, out, want)
    # Patching the last block's output at the last position hands over the source's prediction.
    assert out["rank"][-1][-1] == 1
    close(out["prob_diff"][-1][-1], out["source_prob"] - out["clean_prob"])


def test_patching_different_lengths_with_positions_and_target_tokens(arch: Arch) -> None:
    ref, n = arch.ref, arch.n
    src, tgt = "Paris is in France", "Rome is in"
    params = {
        "src_prompt": src, "tgt_prompt": tgt, "src_positions": [1, 5, -1, 0], "tgt_positions": [1, -2, -1, 0],
        "layers": [-1, 0], "target_tokens": [" ", "e", "I"],
    }
    out = result(arch.url, "activation_patching", params)
    S, T = len(ref.encode(src)), len(ref.encode(tgt))
    src_pos, tgt_pos, layers = [1, 5, S - 1, 0], [1, T - 2, T - 1, 0], [n - 1, 0]
    assert (out["layers"], out["src_positions"], out["positions"]) == (layers, src_pos, tgt_pos)
    targets = [ref.token_id(t) for t in (" ", "e", "I")]
    check_patching(ref, out, patching_by_hand(ref, src, tgt, layers, src_pos, tgt_pos, targets))

    # One list of positions serves both prompts; the default target is the source's top token.
    out = result(arch.url, "activation_patching", {"src_prompt": src, "tgt_prompt": tgt, "tgt_positions": [2, 0]})
    assert out["src_positions"] == out["positions"] == [2, 0]
    check_patching(ref, out, patching_by_hand(ref, src, tgt, list(range(n)), [2, 0], [2, 0], None))


# -- embed --------------------------------------------------------------------------------------

TEXTS = ["Hello there", "a", "The quick brown fox jumps over", "caf\u00e9 \u2603"]


def test_embed_pooling_layers_and_normalize_with_padding(arch: Arch) -> None:
    ref, n = arch.ref, arch.n
    specials = set(ref.tok.all_special_ids)
    for layer in (0, 1, -1):
        # Pooling reads each text's own tokens: the tokenizer's BOS (<s>) is left out.
        owns = [[i for i, t in enumerate(ref.encode(text)) if t not in specials] for text in TEXTS]
        assert all(own[0] == 1 for own in owns)
        states = [ref.states(t, layer)[own] for t, own in zip(TEXTS, owns)]
        for pooling in ("mean", "last", "none", "per_token"):
            for normalize in (False, True):
                out = result(
                    arch.url, "embed", {"texts": TEXTS, "layer": layer, "pooling": pooling, "normalize": normalize}
                )
                assert out["dim"] == 32 and out["pooling"] == pooling and out["layer"] == layer % (n + 1)
                for i, (text, hidden) in enumerate(zip(TEXTS, states)):
                    want = {"mean": hidden.mean(0), "last": hidden[-1], "none": hidden, "per_token": hidden}[pooling]
                    if normalize:
                        want = torch.nn.functional.normalize(want, dim=-1)
                        assert torch.allclose(torch.tensor(out["embeddings"][i]).norm(dim=-1), torch.tensor(1.0), atol=1e-5)
                    close(out["embeddings"][i], want)
                if pooling in ("none", "per_token"):
                    assert out["tokens"] == [[ref.text(t) for t in ref.encode(text)[1:]] for text in TEXTS]
                else:
                    assert "tokens" not in out


def test_embed_floats_are_float32_exactly_or_rounded_to_the_precision(arch: Arch) -> None:
    ref = arch.ref
    params = {"texts": TEXTS, "layer": 1, "pooling": "none"}
    raw = run_stream(arch.url, "embed", params)
    full = raw.terminal["data"]["embeddings"]
    values = [v for text in full for vector in text for v in vector]
    # Each number is a float32's shortest form: it reads back as that float32 and prints the same.
    assert all(float(str(np.float32(v))) == v for v in values)
    for i, text in enumerate(TEXTS):
        close(full[i], ref.states(text, 1)[1:])  # per token: the text's own, <s> left out
    # The text itself holds no float64 tails (0.12345679, not 0.12345679104328156): a float32's
    # shortest form never needs more than 9 significant digits.
    data_line = next(line for line in raw.raw.decode().split("\n") if line.startswith("data:") and "embeddings" in line)
    literals = re.findall(r"-?[0-9.]+(?:e[-+]?[0-9]+)?", data_line.split('"embeddings":')[1], flags=re.IGNORECASE)
    assert len(literals) == len(values)
    assert max(len(m.split("e")[0].split("E")[0].lstrip("-").replace(".", "").lstrip("0")) for m in literals) <= 9

    # With a precision, the float32 value itself is rounded (1.658745 stands for the float32
    # 1.65874505…, which is 1.65875 to 5 decimals, though round(1.658745, 5) == 1.65874).
    for precision in (0, 2, 5):
        out = result(arch.url, "embed", {**params, "precision": precision})
        rounded = [v for text in out["embeddings"] for vector in text for v in vector]
        assert rounded == [round(float(np.float32(v)), precision) for v in values], precision
    # Pooled vectors too.
    pooled = result(arch.url, "embed", {"texts": TEXTS, "precision": 3})["embeddings"]
    exact = result(arch.url, "embed", {"texts": TEXTS})["embeddings"]
    assert pooled == [[round(float(np.float32(v)), 3) for v in vector] for vector in exact]


# -- predict and generate on every family ------------------------------------------------------


def test_predict(arch: Arch) -> None:
    ref = arch.ref
    for prompt in (PROMPT, "a", ""):
        out = result(arch.url, "predict", {"prompt": prompt, "top_k": 10})
        probs = ref.forward(ref.encode(prompt)).logits[0, -1].float().softmax(-1)
        check_topk(ref, out["predictions"], probs, 10)


def test_greedy_generate_equals_hf_generate(arch: Arch) -> None:
    ref = arch.ref
    prompts = [PROMPT, "a", "Hello there, how are", ""]
    n = 12
    s = run_stream(arch.url, "generate", {"prompts": prompts, "max_tokens": n})
    assert s.terminal["event"] == "data", s.terminal
    out = s.terminal["data"]
    for i, prompt in enumerate(prompts):
        want = ref.greedy(prompt, n)
        got = [t for e in s.of("partial") if e["data"]["index"] == i for t in e["data"]["token_ids"]]
        assert got == want, (ref.family, prompt)
        assert out["completions"][i] == ref.decode(want)
    assert out["finish_reasons"] == ["length"] * len(prompts)


# -- the same checks through the remote backend (Llama) ---------------------------------------


@pytest.fixture(scope="module")
def remote_llama(tmp_path_factory: pytest.TempPathFactory, executors: Any) -> Iterator[Arch]:
    """A remote gateway and its executor on the tiny Llama of `arch_model_path` (the same build)."""
    path = build_tiny_model(tmp_path_factory.mktemp("tiny-llama-remote"), family="llama", layers=2, init=0.2)
    server = start_any("remote", executors, path)
    try:
        yield Arch(server.url, Reference(path))
    finally:
        server.stop()


THROUGH_REMOTE = [
    test_logit_lens_every_layer_and_position_equals_norm_and_unembed_by_hand,
    test_logit_lens_subsets_with_negative_indices,
    test_patching_equal_lengths_defaults_to_every_position_and_the_source_prediction,
    test_patching_different_lengths_with_positions_and_target_tokens,
    test_embed_pooling_layers_and_normalize_with_padding,
    test_embed_floats_are_float32_exactly_or_rounded_to_the_precision,
]


@pytest.mark.parametrize("check", THROUGH_REMOTE, ids=lambda f: f.__name__.removeprefix("test_"))
def test_through_the_remote_backend_on_llama(remote_llama: Arch, check: Any) -> None:
    check(remote_llama)


# -- progress, cancellation, the event loop (tiny Llama, deeper) -------------------------------

DEEP_LAYERS = 8


@pytest.fixture(scope="module")
def deep_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-deep"), layers=DEEP_LAYERS, init=0.2)


def progress_frames(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        e["data"]["progress"] for e in events
        if e["event"] == "status" and e["data"]["status"] == "RUNNING" and "progress" in e["data"]
    ]


def test_progress_per_layer_and_a_free_event_loop(serve: Any, deep_model_path: Path) -> None:
    server = serve(model_path=deep_model_path)
    module = server.backend.model.module
    # The final norm runs once in the forward pass and then once per layer of the lens:
    # slowed, each layer's progress frame gets a coalescing slot of its own.
    handle = module.model.norm.register_forward_pre_hook(lambda m, a: time.sleep(0.15))
    try:
        started = time.monotonic()
        latencies: list[float] = []
        with open_stream(server.url, "logit_lens", {"prompt": "Hello there"}) as response:
            raw = b""
            for chunk in response.iter_raw():
                raw += chunk
                if b"RUNNING" in raw and len(latencies) < 3:
                    t0 = time.monotonic()
                    assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200
                    latencies.append(time.monotonic() - t0)
        elapsed = time.monotonic() - started
    finally:
        handle.remove()
    events = parse_sse(raw)
    assert events[-1]["event"] == "data"
    frames = progress_frames(events)
    assert all(f["unit"] == "layers" and f["total"] == DEEP_LAYERS and 1 <= f["done"] <= DEEP_LAYERS for f in frames)
    done = [f["done"] for f in frames]
    assert done == sorted(done) and done[-1] == DEEP_LAYERS
    assert len(frames) >= 4, frames  # the layers came one by one, not all at the end
    assert elapsed > 0.15 * DEEP_LAYERS
    # The worker's torch work never held up the event loop.
    assert latencies and max(latencies) < 0.5, latencies


PROGRESS = [
    ("logit_lens", {"prompt": "Hi", "layers": [0, 2, -1]}, 3, "layers"),
    ("lens_line", {"prompt": "Hi"}, DEEP_LAYERS, "layers"),
    ("lens_grid", {"prompt": "Hi", "layers": [1]}, 1, "layers"),
    ("activation_patching", {"src_prompt": "ab", "tgt_prompt": "cd", "layers": [0, 1, 2, 3]}, 4, "layers"),
    ("embed", {"texts": ["a", "bc", "def"]}, 3, "texts"),
]


def test_each_tool_ends_with_full_progress(serve: Any, deep_model_path: Path) -> None:
    server = serve(model_path=deep_model_path)
    for tool, params, total, unit in PROGRESS:
        s = run_stream(server.url, tool, params)
        assert s.terminal["event"] == "data", s.terminal
        frames = progress_frames(s.events)
        assert frames and frames[-1] == {"done": total, "total": total, "unit": unit}, (tool, frames)
        assert all(f["unit"] == unit and 0 < f["done"] <= f["total"] == total for f in frames), (tool, frames)


@pytest.mark.parametrize("phase", ["forward", "unembedding"])
def test_disconnect_mid_lens_cancels_between_layers(serve: Any, deep_model_path: Path, phase: str) -> None:
    server = serve(model_path=deep_model_path)
    jobs = track_jobs(server)
    module = server.backend.model.module
    calls = [0]

    def slow(m: Any, args: Any) -> None:
        calls[0] += 1
        time.sleep(0.1)

    # Slow the blocks (cancelled inside the forward pass), or the per-layer unembedding loop.
    targets = list(module.model.layers) if phase == "forward" else [module.model.norm]
    handles = [t.register_forward_pre_hook(slow) for t in targets]
    try:
        with open_stream(server.url, "logit_lens", {"prompt": "Hello there"}) as response:
            job_id = response.headers["x-job-id"]
            raw = b""
            for chunk in response.iter_raw():
                raw += chunk
                seen = parse_sse(raw[: raw.rfind(b"\n\n") + 2])
                if phase == "forward" and any(e["event"] == "status" and e["data"]["status"] == "RUNNING" for e in seen):
                    break
                if phase == "unembedding" and progress_frames(seen):
                    break
        job = jobs[job_id]
        wait_until(lambda: job.done, 30, "the abandoned job to end")
        used = calls[0]
    finally:
        for h in handles:
            h.remove()
    terminal = json.loads(job.terminal.data)
    assert job.terminal.type.value == "error" and terminal["error"]["code"] == "cancelled", terminal
    # It stopped between layers, well before the end (8 blocks, or 1 + 8 norm calls).
    assert used < (DEEP_LAYERS if phase == "forward" else DEEP_LAYERS + 1) - 2, used
    frames = [json.loads(e.data).get("progress") for e in job.events if e.type.value == "status"]
    assert all(f is None or f["done"] < DEEP_LAYERS for f in frames)
    wait_until(lambda: not server.backend.workers[0].busy, 10, "the worker to be free")
    # The worker goes on with the next job.
    again = run_stream(server.url, "lens_line", {"prompt": "Hi", "layers": [0]})
    assert again.terminal["event"] == "data"


# -- errors before the stream: 422 naming the field, 413 too_long ----------------------------------


def error_of(url: str, tool: str, params: Any) -> tuple[int, dict[str, Any]]:
    r = httpx.post(f"{url}/{tool}/run", json=params, timeout=30)
    assert r.headers["content-type"].startswith("application/json"), r.text
    return r.status_code, r.json()["error"]


HELLO = "Hello"  # <s> + 5 bytes: 6 tokens, positions 0..5 (or -6..-1); the tiny Llama has 2 layers

INVALID = [
    ("logit_lens", {"prompt": HELLO, "layers": [0, 2]}, "layers[1]"),
    ("logit_lens", {"prompt": HELLO, "layers": [-3]}, "layers[0]"),
    ("logit_lens", {"prompt": HELLO, "positions": [6]}, "positions[0]"),
    ("logit_lens", {"prompt": HELLO, "positions": [0, -7]}, "positions[1]"),
    ("logit_lens", {"prompt": ""}, "prompt"),
    ("logit_lens", {"prompt": HELLO, "track": ["ab"]}, "track[0]"),
    ("logit_lens", {"prompt": HELLO, "track": ["e", ""]}, "track[1]"),
    ("logit_lens", {"prompt": HELLO, "track": ["\u00e9"]}, "track[0]"),  # two byte tokens
    ("logit_lens", {"prompt": HELLO, "layers": []}, "layers"),
    ("logit_lens", {"prompt": HELLO, "top_k": 0}, "top_k"),
    ("lens_line", {"prompt": HELLO, "token": "ab"}, "token"),
    ("lens_line", {"prompt": HELLO, "token": ""}, "token"),
    ("lens_line", {"prompt": HELLO, "position": 6}, "position"),
    ("lens_line", {"prompt": HELLO, "position": -7}, "position"),
    ("lens_line", {"prompt": HELLO, "layers": [5]}, "layers[0]"),
    ("lens_line", {"prompt": HELLO, "stat": "median"}, "stat"),
    ("lens_line", {"prompt": ""}, "prompt"),
    ("lens_grid", {"prompt": HELLO, "positions": [0, 99]}, "positions[1]"),
    ("lens_grid", {"prompt": HELLO, "layers": [2]}, "layers[0]"),
    ("lens_grid", {"prompt": ""}, "prompt"),
    ("activation_patching", {"src_prompt": HELLO, "tgt_prompt": "World", "src_positions": [0, 1], "tgt_positions": [0]}, "src_positions"),
    ("activation_patching", {"src_prompt": HELLO, "tgt_prompt": "Hi"}, "tgt_positions"),
    ("activation_patching", {"src_prompt": HELLO, "tgt_prompt": "World", "target_tokens": ["ab"]}, "target_tokens[0]"),
    ("activation_patching", {"src_prompt": HELLO, "tgt_prompt": "World", "target_tokens": ["a", "bc"]}, "target_tokens[1]"),
    ("activation_patching", {"src_prompt": HELLO, "tgt_prompt": "World", "layers": [2]}, "layers[0]"),
    ("activation_patching", {"src_prompt": HELLO, "tgt_prompt": "Hi", "src_positions": [0, 6], "tgt_positions": [0, 1]}, "src_positions[1]"),
    ("activation_patching", {"src_prompt": HELLO, "tgt_prompt": "Hi", "src_positions": [0, 1], "tgt_positions": [0, 3]}, "tgt_positions[1]"),
    ("activation_patching", {"src_prompt": "", "tgt_prompt": "World"}, "src_prompt"),
    ("activation_patching", {"src_prompt": HELLO, "tgt_prompt": ""}, "tgt_prompt"),
    ("embed", {"texts": [HELLO], "layer": 3}, "layer"),
    ("embed", {"texts": [HELLO], "layer": -4}, "layer"),
    ("embed", {"texts": [HELLO, ""]}, "texts[1]"),
    ("embed", {"texts": []}, "texts"),
    ("embed", {"texts": [HELLO], "pooling": "max"}, "pooling"),
    ("embed", {"texts": [HELLO], "precision": 11}, "precision"),
]


@pytest.mark.parametrize(("tool", "params", "field"), INVALID, ids=[f"{t}-{f}" for t, _, f in INVALID])
def test_invalid_params_are_422_naming_the_field(server: Any, tool: str, params: Any, field: str) -> None:
    status, error = error_of(server.url, tool, params)
    assert (status, error["code"], error.get("field")) == (422, "invalid_params", field), error
    assert error["message"].startswith(f"{field}: ") and error["retryable"] is False, error


def test_edge_indices_are_accepted(server: Any) -> None:
    # The extremes just inside the ranges the 422s above step outside of.
    for tool, params in [
        ("logit_lens", {"prompt": HELLO, "layers": [-2, 1], "positions": [-6, 5]}),
        ("lens_line", {"prompt": HELLO, "position": -6, "layers": [1, -2]}),
        ("lens_grid", {"prompt": HELLO, "positions": [5]}),
        ("activation_patching", {"src_prompt": HELLO, "tgt_prompt": "Hi", "src_positions": [5], "tgt_positions": [-3]}),
        ("embed", {"texts": [HELLO], "layer": -3}),
        ("embed", {"texts": [HELLO], "layer": 2}),
    ]:
        assert run_stream(server.url, tool, params).terminal["event"] == "data", (tool, params)


def test_a_layer_named_twice_gives_the_same_row_twice(server: Any) -> None:
    # [1, -1, 0, 1] on 2 layers: layer 1 three times; each row as when asked once.
    twice = [1, -1, 0, 1]
    for tool, params, rows in [
        ("logit_lens", {"prompt": HELLO, "track": ["e"]}, lambda out: (out["topk"], out["entropy"], out["tracked"]["e"])),
        ("lens_line", {"prompt": HELLO, "stat": "rank"}, lambda out: (out["values"],)),
        ("lens_grid", {"prompt": HELLO}, lambda out: (out["values"], out["top_tokens"])),
        ("activation_patching", {"src_prompt": HELLO, "tgt_prompt": "World"}, lambda out: (out["prob_diff"], out["rank"])),
    ]:
        once = result(server.url, tool, {**params, "layers": [0, 1]})
        out = result(server.url, tool, {**params, "layers": twice})
        assert out["layers"] == [1, 1, 0, 1], tool
        for got, want in zip(rows(out), rows(once)):
            assert got == [want[1], want[1], want[0], want[1]], tool


LONG = "x" * TINY_CONTEXT  # <s> + 256 bytes: one token past the context
FITS = "x" * (TINY_CONTEXT - 1)

TOO_LONG = [
    ("logit_lens", {"prompt": LONG}, "prompt"),
    ("lens_line", {"prompt": LONG}, "prompt"),
    ("lens_grid", {"prompt": LONG}, "prompt"),
    ("activation_patching", {"src_prompt": LONG, "tgt_prompt": "Hi", "tgt_positions": [0]}, "src_prompt"),
    ("activation_patching", {"src_prompt": "Hi", "tgt_prompt": LONG, "tgt_positions": [0]}, "tgt_prompt"),
    ("embed", {"texts": ["a", LONG]}, "texts[1]"),
    ("predict", {"prompt": LONG}, "prompt"),
    ("generate", {"prompts": [LONG]}, "prompts[0]"),
]


@pytest.mark.parametrize(("tool", "params", "field"), TOO_LONG, ids=[f"{t}-{f}" for t, _, f in TOO_LONG])
def test_input_longer_than_the_context_is_413_too_long(server: Any, tool: str, params: Any, field: str) -> None:
    status, error = error_of(server.url, tool, params)
    assert (status, error["code"], error.get("field")) == (413, "too_long", field), error
    assert error["message"].startswith(f"{field}: "), error


def test_a_prompt_that_just_fits_the_context_runs(server: Any) -> None:
    out = result(server.url, "lens_grid", {"prompt": FITS, "positions": [-1], "layers": [-1]})
    assert out["positions"] == [TINY_CONTEXT - 1]
    out = result(server.url, "embed", {"texts": [FITS], "pooling": "last"})
    assert len(out["embeddings"][0]) == 32


# -- discovery -------------------------------------------------------------------------------------


def test_get_tools_lists_every_new_tool_with_its_schemas(server: Any) -> None:
    listed = {t["name"]: t for t in httpx.get(server.url + "/tools").json()}
    expected = {
        "logit_lens": ({"prompt", "top_k", "include_entropy", "layers", "positions", "track"}, {"tokens", "positions", "layers", "topk", "entropy", "tracked"}),
        "lens_line": ({"prompt", "stat", "token", "position", "layers"}, {"stat", "token", "position", "layers", "values"}),
        "lens_grid": ({"prompt", "stat", "layers", "positions"}, {"stat", "layers", "positions", "tokens", "targets", "values", "top_tokens"}),
        "activation_patching": (
            {"src_prompt", "tgt_prompt", "src_positions", "tgt_positions", "target_tokens", "layers"},
            {"layers", "positions", "src_positions", "labels", "target_tokens", "clean_prob", "source_prob", "prob_diff", "rank"},
        ),
        "embed": (
            {"texts", "layer", "pooling", "normalize", "precision", "window", "overlap", "stitch", "file", "partials", "part"},
            {"dim", "layer", "pooling", "embeddings", "tokens", "plans", "context", "files", "span", "sums"},
        ),
    }
    for name, (params, results) in expected.items():
        entry = listed[name]
        assert entry["description"] and entry["streams_partial"] is (name == "embed")
        assert (entry["partial_schema"] is None) is (name != "embed")
        p, r = entry["params_schema"], entry["result_schema"]
        assert p["type"] == "object" and set(p["properties"]) == params | {"model", "tag"}, (name, p)  # every tool of sequences takes `model` and `tag`
        assert r["type"] == "object" and set(r["properties"]) == results, (name, r)
        assert json.dumps(p) and json.dumps(r)  # self-contained JSON
    # embed's window rows, with partials.
    assert set(listed["embed"]["partial_schema"]["properties"]) == {"text", "start", "end", "embeddings", "tokens"}
    assert set(listed["logit_lens"]["params_schema"]["required"]) == {"prompt"}
    assert set(listed["activation_patching"]["params_schema"]["required"]) == {"src_prompt", "tgt_prompt"}
    assert listed["embed"]["params_schema"]["properties"]["texts"].get("maxItems") is not None  # capped by --max-prompts
    assert {"generate", "predict", "loglikelihood"} <= set(listed)
