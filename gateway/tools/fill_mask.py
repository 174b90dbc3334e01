"""`fill_mask`: a masked LM's top-k tokens at each mask in a text (ESM-2: the likeliest residues at a site).

Write the model's mask token (`<mask>` for ESM and RoBERTa, `[MASK]` for
BERT; `GET /readyz` and a refusal name it) where the model should fill in;
each mask is scored in the one pass over the whole text, as the model's own
masked-LM head scores it. Positions count the text's own tokens from 0 (the
special tokens the tokenizer adds left out), so for a protein they are
residue indices.

With `window` (gateway/tools/windows.py) a text longer than the context is
read in windows: each mask from the window where it is farthest from an edge
(`center`), or with its probabilities averaged over every window holding it
(`mean`); only the windows holding a mask run, in passes of at most
`PASS_TOKENS` tokens.
"""

from __future__ import annotations

import bisect
from typing import Annotated, Any

import msgspec
import torch

from gateway.cost import JSON_ENTRY, JSON_TOKEN, PY_ENTRY, Cost, Shape
from gateway.errors import ParamError
from gateway.models.anatomy import logits_at
from gateway.tools.base import Capability, Context, Model, right_padded, tool
from gateway.tools.batching import one_pass
from gateway.tools import windows
from gateway.tools.numbers import floats
from gateway.tools.predict import TokenProb
from gateway.tools.windows import WindowParams, WindowPlan

PASS_TOKENS = 16384  # padded tokens in one pass over windows


class FillMaskParams(WindowParams, forbid_unknown_fields=True):
    texts: Annotated[
        list[str],
        msgspec.Meta(min_length=1, description="Texts (or sequences), each with one or more of the model's mask token."),
    ]
    top_k: Annotated[int, msgspec.Meta(ge=1, le=100)] = 5


class MaskFill(msgspec.Struct):
    position: int
    """The mask's index among the text's own tokens (a residue index for a protein)."""
    predictions: list[TokenProb]


class FillMaskResult(msgspec.Struct, omit_defaults=True):
    mask_token: str
    fills: list[list[MaskFill]]
    """Per text, per mask in order: the top-k tokens and their probabilities."""
    plans: list[WindowPlan] | None = None
    """With window: how each text was cut; only windows holding a mask ran."""


def _mask(model: Model) -> str:
    return model.token_text(model.mask_token_id) if model.mask_token_id is not None else ""


def check(model: Model, params: FillMaskParams) -> None:
    if params.top_k > model.vocab_size:
        raise ParamError("top_k", f"must be <= the vocabulary size {model.vocab_size}")
    windows.resolve(params, model.context_length)  # window-only params without a window
    for i, text in enumerate(params.texts):
        if params.window is not None:
            ids = _Windowed(model, params, i).ids
        else:
            with windows.naming_window():
                ids = model.encode(text, f"texts[{i}]")
                model.fit(len(ids), f"texts[{i}]")
        if model.mask_token_id not in ids:
            raise ParamError(f"texts[{i}]", f"has no mask token; write {_mask(model)} where the model should fill in")


class _Windowed:
    """A text read in windows: the windows holding a mask (`rows`), and per mask, in order, the
    (row, column, weight) of each window its probabilities come from."""

    def __init__(self, model: Model, params: FillMaskParams, i: int) -> None:
        framed, sizes, cut = windows.cut(model, params, params.texts[i], f"texts[{i}]")
        self.ids = [*framed.head, *framed.own, *framed.tail]
        self.plan = WindowPlan(windows=cut, stitch=sizes.stitch, window=sizes.window, overlap=sizes.overlap)
        shares = windows.shares(cut, sizes.stitch)
        self.rows: list[list[int]] = []
        self.reads: list[list[tuple[int, int, float]]] = []
        self.positions: list[int] = []  # each mask's among the text's own tokens
        row_of: dict[int, int] = {}
        starts = [share.start for share in shares]
        for q, token in enumerate(framed.own):
            if token != model.mask_token_id:
                continue
            self.positions.append(q)
            reads = []
            w = bisect.bisect_right(starts, q) - 1  # the last share starting at or before q
            while w >= 0 and shares[w].end > q:  # it, and those before it that still hold q
                share = shares[w]
                if w not in row_of:
                    row_of[w] = len(self.rows)
                    self.rows.append(framed.window(*cut[w]))
                weight = 1.0 if share.weights is None else float(share.weights[q - share.start])
                reads.append((row_of[w], len(framed.head) + q - cut[w][0], weight))
                w -= 1
            self.reads.append(reads)


def cost(model: Model, params: FillMaskParams) -> Cost:
    """The texts' pass (with windows, a pass of windows), the logits at their masks, and the top-k at each."""
    shape = Shape.of(model)
    if params.window is None:
        rows = [model.encode(text) for text in params.texts]
        masks = reads = sum(ids.count(model.mask_token_id) for ids in rows)
    else:
        cut = [_Windowed(model, params, i) for i in range(len(params.texts))]
        rows = [row for text in cut for row in text.rows]
        masks, reads = sum(len(text.reads) for text in cut), sum(len(r) for text in cut for r in text.reads)
    result = masks * params.top_k * (JSON_ENTRY + JSON_TOKEN)
    width = max(len(ids) for ids in rows)
    in_pass = max(1, min(len(rows), PASS_TOKENS // width)) if params.window is not None else len(rows)
    memory = (
        shape.block_bytes(in_pass, width) + shape.states_bytes(in_pass, width, 1) + shape.logits_bytes(reads)
        + masks * params.top_k * PY_ENTRY + result
    )
    return Cost(
        memory=memory, result=result, memory_field="window" if params.window is not None else "texts", result_field="top_k", tokens=width
    )


def _fill_many(model: Model, jobs: list[FillMaskParams], ctxs: list[Context]) -> list[FillMaskResult]:
    # Every text of every job in one right-padded pass (windows in passes of their own): each position
    # sees only its own row's real tokens. Each mask's probabilities are the weighted sum of its reads'
    # (one read of weight 1 without windows, or with `center`).
    passes = windows.Passes(PASS_TOKENS)
    reads: list[tuple[int, int, int, int, float]] = []  # (pass, row, column, mask, weight)
    per_text: list[tuple[list[int], Any]] = []  # each text's own positions of its masks, and its plan
    n_masks = 0
    for params in jobs:
        for i, text in enumerate(params.texts):
            if params.window is None:
                ids = model.encode(text)
                own = {at: n for n, at in enumerate(model.own(ids))}
                ats = [at for at, t in enumerate(ids) if t == model.mask_token_id]
                placed = passes.whole(ids)
                reads += [(*placed, at, n_masks + m, 1.0) for m, at in enumerate(ats)]
                per_text.append(([own[at] for at in ats], None))
                n_masks += len(ats)
                continue
            cut = _Windowed(model, params, i)
            in_passes = [passes.window(window) for window in cut.rows]
            for m, mask_reads in enumerate(cut.reads):
                reads += [(*in_passes[row], col, n_masks + m, weight) for row, col, weight in mask_reads]
            per_text.append((cut.positions, cut.plan))
            n_masks += len(cut.positions)
    by_pass: list[list[tuple[int, int, int, int, float]]] = [[] for _ in passes.rows]
    for read in reads:
        by_pass[read[0]].append(read)
    probs: torch.Tensor | None = None
    for pass_rows, mine in zip(passes.rows, by_pass):
        if not mine:
            continue
        input_ids, mask = right_padded(model, pass_rows)
        # Only the masked positions go through the head: rows × tokens × vocabulary would be large.
        p = logits_at(model, input_ids, mask, [r[1] for r in mine], [r[2] for r in mine]).softmax(dim=-1)
        weights = torch.tensor([r[4] for r in mine], device=p.device, dtype=p.dtype)
        index = torch.tensor([r[3] for r in mine], device=p.device)
        if probs is None:
            probs = p.new_zeros((n_masks, p.shape[-1]))
        probs.index_add_(0, index, p * weights[:, None])
    assert probs is not None
    top = probs.topk(max(params.top_k for params in jobs), dim=-1)
    top_ids, top_p = top.indices.tolist(), floats(top.values)
    texts = model.token_texts(i for ids in top_ids for i in ids)
    results, cell, text_at = [], 0, 0
    for params, ctx in zip(jobs, ctxs):
        k, fills, plans = params.top_k, [], []
        for _ in params.texts:
            positions, plan = per_text[text_at]
            text_at += 1
            fill = []
            for position in positions:
                predictions = [TokenProb(i, texts[i], p) for i, p in zip(top_ids[cell][:k], top_p[cell][:k])]
                fill.append(MaskFill(position=position, predictions=predictions))
                cell += 1
            fills.append(fill)
            plans.append(plan)
        ctx.progress(len(params.texts), len(params.texts), "texts")
        results.append(FillMaskResult(mask_token=_mask(model), fills=fills, plans=plans if params.window is not None else None))
    return results



@tool(
    check=check,
    cost=cost,
    caps={"texts": "max_prompts"},
    sequences=("texts",),
    batch=one_pass(_fill_many),
    needs={Capability.MASKED_LM},
)
def fill_mask(model: Model, params: FillMaskParams, ctx: Context) -> FillMaskResult:
    """The top-k tokens a masked LM puts at each mask token of each text."""
    return _fill_many(model, [params], [ctx])[0]
