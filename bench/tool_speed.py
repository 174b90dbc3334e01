"""Tool speed: each built-in tool through the gateway against the same result in plain torch, side by side.

One gateway per kind of model is started (`streamgate serve`): a causal LM
(the default SmolLM2-135M-Instruct, converted once and cached, or `--model
PATH`, a Llama-like causal LM; --quick: a tiny random Llama) served with a
random sparse autoencoder (`--sae`, ReLU, at a middle layer) for the SAE
tools, and a masked LM (a random ESM-2 of ESM-2 8M's shape, built for the run
as bench/embeddings.py builds it, or `--masked-model PATH`) for `embed`,
`fill_mask` and `pseudo_loglikelihood`. In this process the same checkpoints
are loaded with plain transformers, and each tool's output is computed again
by torch code written here, the way a careful torch programmer would: one
forward pass (ended at the SAE's layer for what needs no more), the lens's
readout as one matmul over every layer and position, only the positions
needed through the head, distinct token ids decoded once. Its time covers
tokenizing, the model, the reductions, moving the numbers to Python and
decoding token texts; the gateway's covers a job from sending the request to
its `data` event (HTTP, validation, the queue, the tool, JSON, SSE). A job of
the no-op tool (bench.tools.noop) is timed in each round too: the gateway's
own floor. `generate` is not measured here.

Rounds are interleaved: in each, every case runs once through the gateway and
once in plain torch, one after the other; each figure is the best of
`--rounds` (default 5; --quick: 2), after one warm-up of each. Both sides use
the same torch threads: `--torch-threads N` (default: the gateway's own
default, one less than the cores, at least 1) is passed to the gateways (as
`--torch-threads` where `streamgate serve` has it, and OMP_NUM_THREADS) and
set here with torch.set_num_threads, one inter-op thread on both sides.
`--device cuda` (or `cuda:N`) runs both sides on that GPU in bfloat16
(`--dtype` for another), the gateways given the same `--device` and `--dtype`.

The outputs are checked as well as timed: the gateway's last result against
the plain one, every number (max abs difference printed; within 1e-4 plus
1e-4 relative in float32, 5e-2 in half precision) and every id, token and
text. Top-k entries whose ids trade places between values within that
tolerance are counted as ties, not errors, and so, in half precision (whose
rounding differs with the batch's shape), is any other id, rank, text or list
length that differs. Any other difference is reported and the script exits 1.

Target, per tool: gateway best <= 1.3x the plain best.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

TITLE = "tool_speed: each built-in tool through the gateway vs the same output in plain torch"
TARGET_RATIO = 1.3
AMINO_ACIDS = "LAGVSERTIDPKQNFYMHWC"
SAE_FEATURES, SAE_FEATURES_QUICK = 2048, 64


def options(parser) -> None:
    parser.add_argument("--device", default="cpu", help="Where both sides run: cpu (the default) or cuda, cuda:N.")
    parser.add_argument("--dtype", default=None, help="Both sides' dtype (default: bfloat16 on CUDA, else float32).")
    parser.add_argument("--rounds", type=int, default=None, help="Timed rounds; each figure is the best (default 5; --quick: 2).")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch's intra-op threads on both sides (default: one less than the cores, at least 1).")
    parser.add_argument("--masked-model", default=None,
                        help="A masked LM folder for embed, fill_mask and pseudo_loglikelihood (default: a random ESM-2 8M-shaped model).")
    parser.add_argument("--only", default=None, help="Comma-separated case names to run (default: all).")


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) - 1)


# -- the plain side --------------------------------------------------------------------


class Plain:
    """One checkpoint loaded with plain transformers, and the helpers every plain computation shares."""

    def __init__(self, path: str, masked: bool, device: str, dtype: Any, sae: dict[str, Any] | None = None) -> None:
        import torch
        import transformers as tf

        self.torch = torch
        auto = tf.AutoModelForMaskedLM if masked else tf.AutoModelForCausalLM
        with contextlib.redirect_stderr(io.StringIO()):  # transformers' progress bar while loading
            self.model = auto.from_pretrained(path, dtype=dtype).to(device).eval()
        self.tok = tf.AutoTokenizer.from_pretrained(path)
        self.device = torch.device(device)
        self.base = self.model.base_model
        self.head = self.model.get_output_embeddings()
        self.eos = {self.tok.eos_token_id} | set(_listed(getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)))
        self.eos.discard(None)
        self.sae = {k: v.float().to(device) for k, v in sae["tensors"].items()} if sae else None
        self.sae_layer = sae["layer"] if sae else None
        self.sae_labels = sae["labels"] if sae else {}

    def ids(self, text: str, special: bool = True) -> list[int]:
        return list(self.tok(text, add_special_tokens=special)["input_ids"])

    def texts(self, ids: Any) -> dict[int, str]:
        """Each distinct id's text, decoded once."""
        distinct = sorted(set(ids))
        return dict(zip(distinct, self.tok.batch_decode([[i] for i in distinct], clean_up_tokenization_spaces=False)))

    def own(self, ids: list[int]) -> list[int]:
        """Indices of a text's own tokens: those the tokenizer did not add around it."""
        added = self.tok.get_special_tokens_mask(ids, already_has_special_tokens=True)
        return [i for i, a in enumerate(added) if not a or ids[i] in (self.tok.mask_token_id, self.tok.unk_token_id)]

    def tensor(self, rows: list[list[int]]) -> tuple[Any, Any]:
        """Right-padded (input_ids, attention_mask) on the device."""
        torch = self.torch
        width = max(len(r) for r in rows)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        return ids.to(self.device), mask.to(self.device)

    def blocks(self) -> Any:
        """The decoder blocks, where a Llama-like model keeps them."""
        return self.base.layers


def _listed(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def _block_output(output: Any) -> Any:
    return output if not isinstance(output, tuple) else output[0]


@contextlib.contextmanager
def hooked(module: Any, fn: Callable[[Any], None]) -> Any:
    handle = module.register_forward_hook(lambda m, args, output: fn(_block_output(output)))
    try:
        yield
    finally:
        handle.remove()


def token_probs(ids: list[list[int]], values: list[list[float]], texts: dict[int, str], key: str = "prob") -> list[list[dict]]:
    return [[{"id": i, "text": texts[i], key: v} for i, v in zip(row_i, row_v)] for row_i, row_v in zip(ids, values)]


def plain_predict(p: Plain, params: dict) -> dict:
    x = p.torch.tensor([p.ids(params["prompt"])], device=p.device)
    probs = p.model(input_ids=x, logits_to_keep=1).logits[0, -1].float().softmax(-1)
    top = probs.topk(params["top_k"])
    ids = top.indices.tolist()
    return {"predictions": token_probs([ids], [top.values.tolist()], p.texts(ids))[0]}


def plain_loglikelihood(p: Plain, params: dict) -> dict:
    torch = p.torch
    pairs = [(p.ids(c), p.ids(t, special=False)) for c, t in zip(params["prompts"], params["continuations"])]
    x, mask = p.tensor([c + t for c, t in pairs])
    hidden = p.base(input_ids=x, attention_mask=mask).last_hidden_state
    # Only the positions that predict a continuation token go through the head.
    rows = torch.tensor([r for r, (c, t) in enumerate(pairs) for _ in t], device=p.device)
    cols = torch.tensor([len(c) - 1 + k for c, t in pairs for k in range(len(t))], device=p.device)
    targets = torch.tensor([tok for _, t in pairs for tok in t], device=p.device)
    logprobs = p.head(hidden[rows, cols]).float().log_softmax(-1)
    own = logprobs.gather(1, targets[:, None])[:, 0]
    greedy = logprobs.argmax(-1) == targets
    sizes = [len(t) for _, t in pairs]
    return {
        "ll": [float(s.sum()) for s in own.split(sizes)],
        "is_greedy": [bool(g.all()) for g in greedy.split(sizes)],
    }


def plain_logprobs(p: Plain, params: dict) -> dict:
    rows = [p.ids(t) for t in params["prompts"]]
    x, mask = p.tensor(rows)
    logprobs = p.model(input_ids=x, attention_mask=mask).logits.float().log_softmax(-1)
    k = params.get("top", 0)
    tops = logprobs.topk(k, dim=-1) if k else None
    last = p.torch.tensor([len(r) - 1 for r in rows], device=p.device)
    best = logprobs[p.torch.arange(len(rows), device=p.device), last].argmax(-1).tolist()
    ids_all = [t for r in rows for t in r] + best + (tops.indices.flatten().tolist() if tops is not None else [])
    texts = p.texts(ids_all)
    out = []
    for i, r in enumerate(rows):
        n = len(r)
        own = logprobs[i, : n - 1].gather(1, p.torch.tensor(r[1:], device=p.device)[:, None])[:, 0].tolist()
        entry: dict[str, Any] = {"token_ids": r, "tokens": [texts[t] for t in r], "logprobs": [None, *own]}
        if k:
            entry["top"] = token_probs(tops.indices[i, : n - 1].tolist(), tops.values[i, : n - 1].tolist(), texts, "logprob")
        if params.get("next_token"):
            entry["next_token"] = {"id": best[i], "text": texts[best[i]], "logprob": float(logprobs[i, n - 1, best[i]])}
            if k:
                entry["next_top"] = token_probs([tops.indices[i, n - 1].tolist()], [tops.values[i, n - 1].tolist()], texts, "logprob")[0]
        out.append(entry)
    return {"sequences": out}


def lens_probs(p: Plain, prompt: str, positions: slice = slice(None)) -> tuple[list[int], Any]:
    """The prompt's ids and the lens's probabilities, layers × positions × vocabulary, from one forward."""
    torch = p.torch
    ids = p.ids(prompt)
    states = p.base(input_ids=torch.tensor([ids], device=p.device), output_hidden_states=True).hidden_states
    # transformers' last hidden state is after the final norm already: only the head is left for it.
    inner = p.base.norm(torch.cat(states[1:-1])[:, positions])
    logits = p.head(torch.cat([inner, states[-1][:, positions]])).float()
    return ids, logits.softmax(-1)


def plain_logit_lens(p: Plain, params: dict) -> dict:
    ids, probs = lens_probs(p, params["prompt"])
    top = probs.topk(params["top_k"], dim=-1)
    entropy = p.torch.special.entr(probs).sum(-1)
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    texts = p.texts(ids + top.indices.flatten().tolist())
    layers = list(range(probs.shape[0]))
    return {
        "tokens": [texts[i] for i in ids],
        "positions": list(range(len(ids))),
        "layers": layers,
        "topk": [token_probs(top_ids[l], top_values[l], texts) for l in layers],
        "entropy": entropy.tolist(),
    }


def plain_lens_grid(p: Plain, params: dict) -> dict:
    ids, probs = lens_probs(p, params["prompt"])
    targets = probs[-1].argmax(-1)  # the last layer's lens is the model's own prediction
    values = probs.gather(-1, targets[None, :, None].expand(probs.shape[0], -1, 1))[..., 0]
    tops = probs.argmax(-1)
    texts = p.texts(ids + targets.tolist() + tops.flatten().tolist())
    return {
        "stat": "probability",
        "layers": list(range(probs.shape[0])),
        "positions": list(range(len(ids))),
        "tokens": [texts[i] for i in ids],
        "targets": [texts[i] for i in targets.tolist()],
        "values": values.tolist(),
        "top_tokens": [[texts[i] for i in row] for row in tops.tolist()],
    }


def plain_lens_line(p: Plain, params: dict) -> dict:
    ids, probs = lens_probs(p, params["prompt"], slice(-1, None))
    at = probs[:, 0]  # layers × vocabulary at the last position
    token = int(at[-1].argmax())
    ranks = (at > at[:, token : token + 1]).sum(-1) + 1
    return {"stat": "rank", "token": p.texts([token])[token], "position": len(ids) - 1,
            "layers": list(range(probs.shape[0])), "values": [float(r) for r in ranks.tolist()]}


PATCH_TOKENS, READOUT_FLOATS = 8192, 1 << 24  # per forward pass: patched tokens, logits


def plain_activation_patching(p: Plain, params: dict) -> dict:
    torch = p.torch
    src, tgt = p.ids(params["src_prompt"]), p.ids(params["tgt_prompt"])
    blocks = p.blocks()
    n_layers, n = len(blocks), len(tgt)
    source: dict[int, Any] = {}
    with contextlib.ExitStack() as stack:
        for i, block in enumerate(blocks):
            stack.enter_context(hooked(block, lambda h, i=i: source.__setitem__(i, h[0].clone())))
        src_probs = p.model(input_ids=torch.tensor([src], device=p.device), logits_to_keep=1).logits[0, -1].float().softmax(-1)
    targets = [int(src_probs.argmax())]
    clean_probs = p.model(input_ids=torch.tensor([tgt], device=p.device), logits_to_keep=1).logits[0, -1].float().softmax(-1)
    clean = clean_probs[targets].sum()
    # Every (layer, position) patch is a row; each block overwrites the rows that patch it.
    pairs = [(layer, pos) for layer in range(n_layers) for pos in range(n)]
    diffs, ranks = [], []
    per_pass = min(PATCH_TOKENS // n, READOUT_FLOATS // p.head.out_features)
    for start in range(0, len(pairs), per_pass):
        chunk = pairs[start : start + per_pass]
        with contextlib.ExitStack() as stack:
            for layer in sorted({layer for layer, _ in chunk}):
                rows = [r for r, (l, _) in enumerate(chunk) if l == layer]
                pos = [chunk[r][1] for r in rows]
                patch = source[layer][pos]

                def write(h, rows=torch.tensor(rows, device=p.device), pos=torch.tensor(pos, device=p.device), patch=patch):
                    h[rows, pos] = patch.to(h.dtype)

                stack.enter_context(hooked(blocks[layer], write))
            x = torch.tensor([tgt], device=p.device).expand(len(chunk), -1)
            probs = p.model(input_ids=x, logits_to_keep=1).logits[:, -1].float().softmax(-1)
        diffs.append(probs[:, targets].sum(-1) - clean)
        ranks.append(torch.stack([(probs > probs[:, t : t + 1]).sum(-1) + 1 for t in targets]).min(0).values)
    texts = p.texts(src + tgt + targets)
    return {
        "layers": list(range(n_layers)),
        "positions": list(range(n)),
        "src_positions": list(range(n)),
        "labels": [f"{texts[s]}→{texts[t]}" for s, t in zip(src, tgt)],
        "target_tokens": [texts[t] for t in targets],
        "clean_prob": float(clean),
        "source_prob": float(src_probs[targets].sum()),
        "prob_diff": torch.cat(diffs).view(n_layers, n).tolist(),
        "rank": torch.cat(ranks).view(n_layers, n).tolist(),
    }


EMBED_ROWS = 16


def plain_embed(p: Plain, params: dict) -> dict:
    """Mean over each text's own tokens of the last hidden state, texts sorted by length into padded chunks."""
    torch = p.torch
    rows = [p.ids(t) for t in params["texts"]]
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    out: list[Any] = [None] * len(rows)
    for start in range(0, len(order), EMBED_ROWS):
        chunk = order[start : start + EMBED_ROWS]
        x, mask = p.tensor([rows[i] for i in chunk])
        states = p.base(input_ids=x, attention_mask=mask, output_hidden_states=True).hidden_states[-1].float()
        own = torch.zeros(x.shape, device=p.device)
        for r, i in enumerate(chunk):
            own[r, p.own(rows[i])] = 1
        pooled = (states * own[..., None]).sum(1) / own.sum(1, keepdim=True)
        for r, vector in zip(chunk, pooled.cpu().numpy()):
            out[r] = vector.tolist()
    return {"dim": len(out[0]), "layer": p.model.config.num_hidden_layers, "pooling": "mean", "embeddings": out}


def plain_fill_mask(p: Plain, params: dict) -> dict:
    rows = [p.ids(t) for t in params["texts"]]
    x, mask = p.tensor(rows)
    where = (x == p.tok.mask_token_id).nonzero().tolist()
    logits = p.model(input_ids=x, attention_mask=mask).logits
    top = logits[[r for r, _ in where], [c for _, c in where]].float().softmax(-1).topk(params["top_k"], dim=-1)
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    texts = p.texts(top.indices.flatten().tolist() + [p.tok.mask_token_id])
    fills: list[list[dict]] = [[] for _ in rows]
    owns = [{at: n for n, at in enumerate(p.own(r))} for r in rows]
    for k, (r, c) in enumerate(where):
        fills[r].append({"position": owns[r][c], "predictions": token_probs([top_ids[k]], [top_values[k]], texts)[0]})
    return {"mask_token": texts[p.tok.mask_token_id], "fills": fills}


PLL_ROWS, PLL_TOKENS = 64, 16384


def plain_pseudo_loglikelihood(p: Plain, params: dict) -> dict:
    """Every own position of every sequence masked in turn: copies sorted by length into padded chunks."""
    torch = p.torch
    copies = []  # (sequence, position, true token, ids)
    for s, text in enumerate(params["sequences"]):
        ids = p.ids(text)
        copies += [(s, at, ids[at], ids) for at in p.own(ids)]
    copies.sort(key=lambda c: -len(c[3]))
    scores: list[list[tuple[int, float]]] = [[] for _ in params["sequences"]]
    start = 0
    while start < len(copies):
        width = len(copies[start][3])
        end = min(start + PLL_ROWS, len(copies), start + max(1, PLL_TOKENS // width))
        chunk = copies[start:end]
        x, mask = p.tensor([c[3] for c in chunk])
        rows = torch.arange(len(chunk), device=p.device)
        at = torch.tensor([c[1] for c in chunk], device=p.device)
        x[rows, at] = p.tok.mask_token_id
        logits = p.model(input_ids=x, attention_mask=mask).logits[rows, at].float().log_softmax(-1)
        values = logits[rows, torch.tensor([c[2] for c in chunk], device=p.device)].tolist()
        for c, v in zip(chunk, values):
            scores[c[0]].append((c[1], v))
        start = end
    return {
        "pll": [math.fsum(v for _, v in sorted(per)) for per in scores],
        "tokens_scored": [len(per) for per in scores],
    }


def sae_encode(p: Plain, x: Any) -> Any:
    sae = p.sae
    return p.torch.relu(x.float() @ sae["W_enc"] + sae["b_enc"])


class Deep(Exception):
    """The forward pass has reached the block it was run for."""


def sae_residual(p: Plain, ids_rows: list[list[int]]) -> list[Any]:
    """Each row's output of the SAE's block (float32), read with a hook that ends the forward pass there."""
    x, mask = p.tensor(ids_rows)
    got: dict[str, Any] = {}

    def read(h: Any) -> None:
        got["h"] = h
        raise Deep()

    with hooked(p.blocks()[p.sae_layer], read), contextlib.suppress(Deep):
        p.base(input_ids=x, attention_mask=mask)
    return [got["h"][i, : len(r)].float() for i, r in enumerate(ids_rows)]


def plain_sae_annotate(p: Plain, params: dict) -> dict:
    if params.get("sequences") is not None:
        return plain_sae_sequences(p, params)
    ids = p.ids(params["prompt"])
    (x,) = sae_residual(p, [ids])
    f = sae_encode(p, x)
    error = (x - (f @ p.sae["W_dec"] + p.sae["b_dec"])).norm(dim=-1)
    relative = error / x.norm(dim=-1).clamp(min=1e-12)
    top = f.topk(params["k"], dim=-1)
    texts = p.texts(ids)
    labels = p.sae_labels
    tokens = []
    for pos, (fids, values, e, r) in enumerate(zip(top.indices.tolist(), top.values.tolist(), error.tolist(), relative.tolist())):
        feats = [{"id": i, "label": labels.get(i), "value": v} for i, v in zip(fids, values) if v > 0]
        tokens.append({"token": texts[ids[pos]], "token_id": ids[pos], "features": feats, "error": e, "relative_error": r})
    return {"sae": "bench", "layer": p.sae_layer, "tokens": tokens}


def plain_sae_sequences(p: Plain, params: dict) -> dict:
    torch = p.torch
    rows = [p.ids(t) for t in params["sequences"]]
    threshold = params.get("threshold", 0.0)
    out = []
    texts = p.texts([t for r in rows for t in r])
    for ids, x in zip(rows, sae_residual(p, rows)):
        own = p.own(ids)
        x = x[own]
        f = sae_encode(p, x)
        relative = (x - (f @ p.sae["W_dec"] + p.sae["b_dec"])).norm(dim=-1) / x.norm(dim=-1).clamp(min=1e-12)
        top = f.max(0).values.topk(params["k"])
        chosen = [i for i, v in zip(top.indices.tolist(), top.values.tolist()) if v > 0]
        tracks = f[:, chosen].T
        peaks, means = tracks.max(1), tracks.mean(1)
        above = tracks > threshold
        features = [
            {"id": i, "label": p.sae_labels.get(i), "max": m, "mean": a, "argmax": g,
             "above": torch.nonzero(row).flatten().tolist()}
            for i, m, a, g, row in zip(chosen, peaks.values.tolist(), means.tolist(), peaks.indices.tolist(), above)
        ]
        out.append({"tokens": [texts[ids[i]] for i in own], "features": features, "tracks": tracks.tolist(),
                    "relative_error": relative.tolist()})
    return {"sae": "bench", "layer": p.sae_layer, "sequences": out}


def plain_sae_steer(p: Plain, params: dict) -> dict:
    """Greedy decoding on the KV cache, each block output at the SAE's layer steered by the clamps."""
    torch = p.torch
    ids = p.ids(params["prompts"][0])
    clamps = params["clamps"]
    fids = torch.tensor([c["feature_id"] for c in clamps], device=p.device)
    strengths = torch.tensor([c["strength"] for c in clamps], device=p.device)
    w_enc, b_enc, w_dec = p.sae["W_enc"][:, fids], p.sae["b_enc"][fids], p.sae["W_dec"][fids]

    def steer(h: Any) -> None:
        f = torch.relu(h.float() @ w_enc + b_enc)
        h += ((strengths - f) @ w_dec).to(h.dtype)

    tokens: list[int] = []
    finish = "length"
    with hooked(p.blocks()[p.sae_layer], steer):
        out = p.model(input_ids=torch.tensor([ids], device=p.device), use_cache=True, logits_to_keep=1)
        for _ in range(params["max_tokens"]):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            if token in p.eos:
                finish = "stop"
                break
            if len(tokens) == params["max_tokens"]:
                break
            out = p.model(input_ids=torch.tensor([[token]], device=p.device), cache=out.cache, use_cache=True)
    text = p.tok.decode(tokens[:-1] if finish == "stop" else tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    n = len(ids)
    return {"completions": [text], "usage": {"prompt_tokens": n, "completion_tokens": len(tokens), "total_tokens": n + len(tokens)},
            "finish_reasons": [finish]}


# -- the cases -------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    tool: str
    masked: bool  # runs on the masked-LM gateway
    params: dict[str, Any]
    plain: Callable[[Plain, dict], dict]
    what: str
    gateway_s: list[float] = field(default_factory=list)
    plain_s: list[float] = field(default_factory=list)
    got: Any = None
    want: Any = None


def protein(rng: Any, low: int, high: int) -> str:
    return "".join(rng.choices(AMINO_ACIDS, k=rng.randint(low, high)))


def cases(quick: bool, n_features: int) -> list[Case]:
    import random

    rng = random.Random(0)
    lens = "The capital of France is Paris, and the"  # 9 tokens on SmolLM2
    masked_texts = [protein(rng, 40, 60) for _ in range(4)]
    for i, text in enumerate(masked_texts):  # two masks in each, apart
        at = (len(text) // 3, 2 * len(text) // 3 + i)
        masked_texts[i] = "".join("<mask>" if k in at else c for k, c in enumerate(text))
    embed_n, embed_len = (8, (20, 40)) if quick else (32, (50, 200))
    pll_len = (10, 15) if quick else (35, 45)
    feature_ids = list(range(min(4, n_features)))
    return [
        Case("predict", "predict", False, {"prompt": "The capital of France is", "top_k": 10}, plain_predict,
             "top 10 after a 5-token prompt"),
        Case("loglikelihood", "loglikelihood", False,
             {"prompts": ["The capital of France is", "Water boils at a temperature of",
                          "The largest planet in the solar system is", "The chemical symbol for gold is"],
              "continuations": [" Paris", " 100 degrees", " Jupiter", " Au"]},
             plain_loglikelihood, "4 prompt/continuation pairs"),
        Case("logprobs", "logprobs", False,
             {"prompts": ["The capital of France is Paris, and the capital of Spain is Madrid.",
                          "Water boils at a temperature of 100 degrees"], "top": 5, "next_token": True},
             plain_logprobs, "2 texts, top 5, next token"),
        Case("logit_lens", "logit_lens", False, {"prompt": lens, "top_k": 5, "include_entropy": True},
             plain_logit_lens, "every layer and position, top 5 + entropy"),
        Case("lens_grid", "lens_grid", False, {"prompt": lens, "stat": "probability"}, plain_lens_grid,
             "every layer and position, probability"),
        Case("lens_line", "lens_line", False, {"prompt": lens, "stat": "rank"}, plain_lens_line,
             "every layer, last position, rank"),
        Case("activation_patching", "activation_patching", False,
             {"src_prompt": "The capital of Italy is", "tgt_prompt": "The capital of Spain is"},
             plain_activation_patching, "every layer and position of 5-token prompts"),
        Case("sae_annotate", "sae_annotate", False, {"prompt": lens, "k": 5}, plain_sae_annotate,
             "a 9-token prompt, top 5 features per token"),
        Case("sae_annotate sequences", "sae_annotate", False,
             {"sequences": [lens, "The capital of Spain is Madrid.", "Water boils at a temperature of 100 degrees"],
              "k": 5, "threshold": 0.5}, plain_sae_annotate, "3 texts, top 5 features' tracks"),
        Case("sae_steer", "sae_steer", False,
             {"prompts": ["The capital of France is"], "max_tokens": 8,
              "clamps": [{"feature_id": f, "strength": 8.0} for f in feature_ids]},
             plain_sae_steer, f"8 greedy tokens, {len(feature_ids)} features clamped"),
        Case("embed", "embed", True, {"texts": [protein(rng, *embed_len) for _ in range(embed_n)]}, plain_embed,
             f"{embed_n} proteins of {embed_len[0]}..{embed_len[1]}, mean of the last layer"),
        Case("fill_mask", "fill_mask", True, {"texts": masked_texts, "top_k": 5}, plain_fill_mask,
             "4 proteins of 40..60, 2 masks each, top 5"),
        Case("pseudo_loglikelihood", "pseudo_loglikelihood", True,
             {"sequences": [protein(rng, *pll_len) for _ in range(2)]}, plain_pseudo_loglikelihood,
             f"2 proteins of {pll_len[0]}..{pll_len[1]}, every residue masked"),
    ]


# -- checking --------------------------------------------------------------------------


@dataclass
class Agreement:
    max_diff: float = 0.0
    ties: int = 0
    errors: list[str] = field(default_factory=list)


def compare(got: Any, want: Any, atol: float, rtol: float, exact: bool = True) -> Agreement:
    """Every number within tolerance, and every id, token and text equal, except ties: a top-k entry
    whose id trades places with another of a value within tolerance, or, where not `exact` (half
    precision, whose rounding differs with the batch's shape), any id, rank, text or list length."""
    out = Agreement()

    def close(a: float, b: float) -> bool:
        return abs(a - b) <= atol + rtol * abs(b)

    def differ(where: str, what: str) -> None:
        if exact:
            out.errors.append(f"{where}: {what}")
        else:
            out.ties += 1

    def walk(a: Any, b: Any, where: str) -> None:
        if isinstance(b, float) or (isinstance(a, float) and isinstance(b, int) and not isinstance(b, bool)):
            if not isinstance(a, (int, float)) or isinstance(a, bool):
                out.errors.append(f"{where}: {a!r} against {b!r}")
                return
            diff = abs(a - b)
            out.max_diff = max(out.max_diff, diff)
            if not close(a, b):
                out.errors.append(f"{where}: {a!r} against {b!r} (diff {diff:.2e})")
        elif isinstance(b, dict):
            if not isinstance(a, dict) or set(a) != set(b):
                out.errors.append(f"{where}: keys {sorted(a) if isinstance(a, dict) else a!r} against {sorted(b)}")
                return
            if "id" in b and a["id"] != b["id"]:
                values = [k for k, v in b.items() if isinstance(v, float)]
                if values and all(isinstance(a[k], float) and close(a[k], b[k]) for k in values):
                    out.ties += 1  # another token of (nearly) the same value in this place
                else:
                    differ(where, f"id {a['id']} against {b['id']}")
                return
            for k in b:
                walk(a[k], b[k], f"{where}.{k}")
        elif isinstance(b, list):
            if not isinstance(a, list) or len(a) != len(b):
                differ(where, f"{len(a) if isinstance(a, list) else a!r} items against {len(b)}")
                return
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{where}[{i}]")
        elif a != b:
            differ(where, f"{a!r} against {b!r}")

    walk(got, want, "")
    return out


# -- the run ---------------------------------------------------------------------------


def build_masked(path: Path, quick: bool) -> Path:
    """A random ESM-2 masked LM with ESM's vocabulary: ESM-2 8M's shape, or a tiny one (--quick)."""
    import torch
    import transformers as tf

    from bench import embeddings
    from tests.support.tiny_models import ESM_VOCAB

    if not quick:
        return embeddings.build_model(path, seed=0)
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(ESM_VOCAB) + "\n")
    config = tf.EsmConfig(
        vocab_size=len(ESM_VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=1026, position_embedding_type="rotary", pad_token_id=ESM_VOCAB.index("<pad>"),
        mask_token_id=ESM_VOCAB.index("<mask>"), token_dropout=True, emb_layer_norm_before=False,
    )
    torch.manual_seed(0)
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' progress bar while saving
        tf.EsmForMaskedLM(config).save_pretrained(path)
        tf.EsmTokenizer(str(path / "vocab.txt")).save_pretrained(path)
    return path


def make_sae(folder: Path, d_model: int, n_features: int, layer: int, seed: int = 0) -> tuple[Path, dict[str, Any]]:
    """A random ReLU SAE on `layer`'s residual stream, saved with its sidecar."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    w_dec = torch.randn(n_features, d_model, generator=g)
    w_dec = w_dec / w_dec.norm(dim=-1, keepdim=True)
    tensors = {"W_enc": w_dec.T.contiguous(), "b_enc": -0.5 * torch.rand(n_features, generator=g),
               "W_dec": w_dec, "b_dec": torch.zeros(d_model)}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bench.safetensors"
    save_file(tensors, str(path))
    labels = {i: f"feature {i}" for i in range(0, n_features, 7)}
    (folder / "bench.json").write_text(json.dumps(
        {"layer": layer, "activation": "relu", "name": "bench", "labels": {str(k): v for k, v in labels.items()}}))
    return path, {"tensors": tensors, "layer": layer, "labels": labels}


def has_threads_flag() -> bool:
    """Whether this `streamgate serve` takes `--torch-threads`."""
    from tests.support.processes import STREAMGATE

    shown = subprocess.run([str(STREAMGATE), "serve", "--help"], capture_output=True, text=True, timeout=60).stdout
    return "--torch-threads" in shown


def causal_path(bench: common.Bench) -> str:
    """The causal checkpoint's folder: `--model`, the tiny model (--quick), or the default model's converted cache
    (converted here first if it is not there yet, as `streamgate serve` would)."""
    chosen = bench.model(default_tiny=False)
    if chosen is not None:
        return chosen
    from backends import loading as models

    spec = models.resolve(None)
    cached = models.converted_path(spec, models.cache_root())
    if not (cached / "config.json").exists():
        common.step("converting the default model once (what streamgate serve does on its first start)")
        models.convert_gguf(spec.gguf, cached)
    return str(cached)


def sync(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


async def run(bench: common.Bench, report: common.Report) -> list[str]:
    """Measure, check and fill the report; the cases whose outputs disagree."""
    import torch

    args, quick = bench.args, bench.quick
    rounds = args.rounds or (2 if quick else 5)
    threads = args.torch_threads or default_threads()
    device = args.device
    dtype_name = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    dtype = getattr(torch, dtype_name)
    # float32 agrees to rounding; half precision, computed in other batch shapes, less closely.
    atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (5e-2, 5e-2)
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    from transformers import AutoConfig

    common.step("building the models")
    causal = bench.model(default_tiny=False)  # None: the default model
    path = causal_path(bench)
    masked = args.masked_model or str(build_masked(bench.dir / "esm2-random", quick))
    config = AutoConfig.from_pretrained(path)
    flags = ["--device", device, "--dtype", dtype_name, *(["--torch-threads", str(threads)] if has_threads_flag() else [])]
    env = {"OMP_NUM_THREADS": str(threads)}
    n_features = SAE_FEATURES_QUICK if quick else SAE_FEATURES
    layer = config.num_hidden_layers // 3
    sae_path, sae = make_sae(bench.dir / "sae", config.hidden_size, n_features, layer)
    gateways = {
        False: bench.streamgate("serve", *flags, "--sae", str(sae_path), model=causal, name="causal", env=env),
        True: bench.streamgate("serve", *flags, model=masked, name="masked", env=env),
    }
    common.step("loading the models in two gateways and in this process")
    plains = {False: Plain(path, False, device, dtype, sae), True: Plain(masked, True, device, dtype)}
    bench.ready(*gateways.values())
    ready = common.readyz(gateways[False])
    report.fact("machine", common.machine(ready.get("device", device)))
    shapes = {name: AutoConfig.from_pretrained(folder) for name, folder in (("causal", path), ("masked", masked))}
    report.fact("models", ", ".join(f"{name}: {Path(folder).name} ({shapes[name].num_hidden_layers} layers, hidden "
                                    f"{shapes[name].hidden_size})" for name, folder in (("causal", path), ("masked", masked)))
                + f"; {dtype_name} on {device} on both sides")
    report.fact("sae", f"random ReLU SAE, {n_features} features, on layer {layer}")
    report.fact("torch threads", f"{threads} on both sides ({' '.join(flags[-2:]) if '--torch-threads' in flags else 'OMP_NUM_THREADS'} "
                f"for the gateways, torch.set_num_threads({threads}) here), one inter-op thread")
    report.fact("rounds", f"{rounds}, interleaved: each case through the gateway then in plain torch; figures are the best, after a warm-up")

    chosen = cases(quick, n_features)
    if args.only:
        wanted = set(args.only.split(","))
        chosen = [c for c in chosen if c.name in wanted]
    ports = {k: common.port_of(g) for k, g in gateways.items()}

    async def through_gateway(case: Case) -> float:
        job = await common.run_job(ports[case.masked], f"/{case.tool}/run", case.params)
        if not job.ok:
            raise RuntimeError(f"{case.name} failed through the gateway: {job.status} {job.events[-1:] or ''}")
        case.got = msgspec.json.decode(job.terminal.data)
        return job.latency

    def in_plain_torch(case: Case) -> float:
        plain = plains[case.masked]
        sync(torch, device)
        start = time.perf_counter()
        with torch.inference_mode():
            case.want = case.plain(plain, case.params)
        sync(torch, device)
        return time.perf_counter() - start

    for case in chosen:
        common.step(f"warm-up: {case.name}")
        await through_gateway(case)
        in_plain_torch(case)
    floor: list[float] = []  # a job that does nothing: what the gateway costs around any tool
    for r in range(rounds):
        common.step(f"round {r + 1}/{rounds}")
        noop = await common.run_job(ports[False], "/noop/run", {"partials": 0})
        if not noop.ok:
            raise RuntimeError(f"a no-op job failed: {noop.status} {noop.events[-1:] or ''}")
        floor.append(noop.latency)
        for case in chosen:
            case.gateway_s.append(await through_gateway(case))
            case.plain_s.append(in_plain_torch(case))
    report.fact("gateway floor", f"a job that does nothing (bench.tools.noop, no partials) takes {1000 * min(floor):.1f} ms "
                "(best); a lone job of a tool that batches waits up to --batch-wait-ms (default 5) for company, "
                "unless it follows a lone job of its tool on an idle worker (as here after the warm-up)")

    rows, failed = [], []
    for case in chosen:
        agreement = compare(case.got, case.want, atol, rtol, exact=dtype == torch.float32)
        gateway_ms, plain_ms = 1000 * min(case.gateway_s), 1000 * min(case.plain_s)
        ratio = gateway_ms / plain_ms
        agree = "yes" if not agreement.errors else "NO"
        rows.append([case.name, case.what, common.fmt(gateway_ms), common.fmt(plain_ms), f"{ratio:.2f}x",
                     f"{agreement.max_diff:.1e}", str(agreement.ties), agree])
        if agreement.errors:
            failed.append(case.name)
            print(f"error: {case.name}: the gateway and plain torch disagree ({len(agreement.errors)} places): "
                  + "; ".join(agreement.errors[:5]), file=sys.stderr)
        report.target(f"{case.name} through the gateway <= {TARGET_RATIO}x plain torch", f"{ratio:.2f}x", ratio <= TARGET_RATIO)
    report.table(["case", "work", "gateway ms", "plain ms", "ratio", "max abs diff", "ties", "agree"], rows,
                 title="Best of each: one job through the gateway (request to data event) and the same output in plain torch")
    report.note("ratio: gateway best over plain best; max abs diff: over every number of the result; ties: top-k "
                f"entries whose ids trade places between values within the tolerance ({atol:g} + {rtol:g} relative)"
                + ("" if dtype == torch.float32 else ", and any id, rank, text or list length that differs, as "
                   f"{dtype_name}'s rounding differs with the batch's shape"))
    return failed


if __name__ == "__main__":
    common.main(run, TITLE, __doc__, options, disagreed="the gateway's results differ from plain torch's")
