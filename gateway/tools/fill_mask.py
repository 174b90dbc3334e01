"""`fill_mask`: a masked LM's top-k tokens at each mask in a text (ESM-2: the likeliest residues at a site).

Write the model's mask token (`<mask>` for ESM and RoBERTa, `[MASK]` for
BERT; `GET /readyz` and a refusal name it) where the model should fill in;
each mask is scored in the one pass over the whole text, as the model's own
masked-LM head scores it. Positions count the text's own tokens from 0 (the
special tokens the tokenizer adds left out), so for a protein they are
residue indices.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from gateway.cost import JSON_ENTRY, JSON_TOKEN, PY_ENTRY, Cost, Shape
from gateway.errors import ParamError
from gateway.models.anatomy import logits_at
from gateway.tools.base import Capability, Context, Model, right_padded, tool
from gateway.tools.batching import one_pass
from gateway.tools.numbers import floats
from gateway.tools.predict import TokenProb


class FillMaskParams(msgspec.Struct, forbid_unknown_fields=True):
    texts: Annotated[
        list[str],
        msgspec.Meta(min_length=1, description="Texts (or sequences), each with one or more of the model's mask token."),
    ]
    top_k: Annotated[int, msgspec.Meta(ge=1, le=100)] = 5


class MaskFill(msgspec.Struct):
    position: int
    """The mask's index among the text's own tokens (a residue index for a protein)."""
    predictions: list[TokenProb]


class FillMaskResult(msgspec.Struct):
    mask_token: str
    fills: list[list[MaskFill]]
    """Per text, per mask in order: the top-k tokens and their probabilities."""


def _mask(model: Model) -> str:
    return model.token_text(model.mask_token_id) if model.mask_token_id is not None else ""


def check(model: Model, params: FillMaskParams) -> None:
    if params.top_k > model.vocab_size:
        raise ParamError("top_k", f"must be <= the vocabulary size {model.vocab_size}")
    for i, text in enumerate(params.texts):
        ids = model.encode(text, f"texts[{i}]")
        model.fit(len(ids), f"texts[{i}]")
        if model.mask_token_id not in ids:
            raise ParamError(f"texts[{i}]", f"has no mask token; write {_mask(model)} where the model should fill in")


def cost(model: Model, params: FillMaskParams) -> Cost:
    """The texts' pass, the logits at their masks, and the top-k at each."""
    shape = Shape.of(model)
    rows = [model.encode(text) for text in params.texts]
    masks = sum(ids.count(model.mask_token_id) for ids in rows)
    result = masks * params.top_k * (JSON_ENTRY + JSON_TOKEN)
    width = max(len(ids) for ids in rows)
    memory = (
        shape.block_bytes(len(rows), width) + shape.states_bytes(len(rows), width, 1) + shape.logits_bytes(masks)
        + masks * params.top_k * PY_ENTRY + result
    )
    return Cost(memory=memory, result=result, memory_field="texts", result_field="top_k", tokens=width)


def _fill_many(model: Model, jobs: list[FillMaskParams], ctxs: list[Context]) -> list[FillMaskResult]:
    # Every text of every job in one right-padded pass: each position sees only its own row's real tokens.
    encoded = [[model.encode(text) for text in params.texts] for params in jobs]
    rows = [ids for texts in encoded for ids in texts]
    input_ids, mask = right_padded(model, rows)
    masks = [[at for at, t in enumerate(ids) if t == model.mask_token_id] for ids in rows]
    where = [(row, at) for row, ats in enumerate(masks) for at in ats]
    # Only the masked positions go through the head: rows × tokens × vocabulary would be large.
    logits = logits_at(model, input_ids, mask, [row for row, _ in where], [at for _, at in where])
    top = logits.softmax(dim=-1).topk(max(params.top_k for params in jobs), dim=-1)
    top_ids, top_p = top.indices.tolist(), floats(top.values)
    texts = model.token_texts(i for ids in top_ids for i in ids)
    results, cell, row = [], 0, 0
    for params, job_rows, ctx in zip(jobs, encoded, ctxs):
        k, fills = params.top_k, []
        for ids in job_rows:
            own = {at: n for n, at in enumerate(model.own(ids))}
            fill = []
            for at in masks[row]:
                predictions = [TokenProb(i, texts[i], p) for i, p in zip(top_ids[cell][:k], top_p[cell][:k])]
                fill.append(MaskFill(position=own[at], predictions=predictions))
                cell += 1
            fills.append(fill)
            row += 1
        ctx.progress(len(job_rows), len(job_rows), "texts")
        results.append(FillMaskResult(mask_token=_mask(model), fills=fills))
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
