"""`predict`: the model's distribution over the next token, its top k."""

from __future__ import annotations

from typing import Annotated

import msgspec
import torch

from gateway.cost import JSON_ENTRY, JSON_TOKEN, PY_ENTRY, Cost, Shape
from gateway.errors import ParamError
from gateway.models.anatomy import logits_at
from gateway.tools.base import Capability, Context, Model, right_padded, tool
from gateway.tools.batching import one_pass
from gateway.tools.numbers import floats


class PredictParams(msgspec.Struct, forbid_unknown_fields=True):
    prompt: str
    top_k: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 10


class TokenProb(msgspec.Struct):
    id: int
    text: str
    prob: float


class PredictResult(msgspec.Struct):
    predictions: list[TokenProb]


def check(model: Model, params: PredictParams) -> None:
    model.fit(len(model.encode(params.prompt, "prompt")), "prompt")
    if params.top_k > model.vocab_size:
        raise ParamError("top_k", f"must be <= the vocabulary size {model.vocab_size}")


def cost(model: Model, params: PredictParams) -> Cost:
    """The prompt's pass, the logits at its last position, and the top-k."""
    shape = Shape.of(model)
    n = len(model.encode(params.prompt))
    result = params.top_k * (JSON_ENTRY + JSON_TOKEN)
    memory = shape.block_bytes(1, n) + shape.states_bytes(1, n, 1) + shape.logits_bytes(1) + params.top_k * PY_ENTRY + result
    return Cost(memory=memory, result=result, memory_field="prompt", result_field="top_k", tokens=n)


def _predict_many(model: Model, jobs: list[PredictParams], ctxs: list[Context]) -> list[PredictResult]:
    # Right padding: causal attention keeps each prompt's real tokens from seeing the pads after them.
    encoded = [model.encode(params.prompt) for params in jobs]
    input_ids, mask = right_padded(model, encoded)
    rows = torch.arange(len(encoded), device=input_ids.device)
    last = torch.tensor([len(ids) - 1 for ids in encoded], device=input_ids.device)
    probs = logits_at(model, input_ids, mask, rows, last).softmax(dim=-1)
    # One top-k for every row, as deep as the deepest job asks; each job reads its own first top_k.
    top = probs.topk(max(params.top_k for params in jobs), dim=-1)
    ids, values = top.indices.tolist(), floats(top.values)
    texts = model.token_texts(i for row, params in zip(ids, jobs) for i in row[: params.top_k])
    return [
        PredictResult([TokenProb(id=i, text=texts[i], prob=p) for i, p in zip(row_ids[: params.top_k], row_p)])
        for row_ids, row_p, params in zip(ids, values, jobs)
    ]


@tool(check=check, cost=cost, batch=one_pass(_predict_many), needs={Capability.NEXT_TOKEN}, sequences=("prompt",))
def predict(model: Model, params: PredictParams, ctx: Context) -> PredictResult:
    """The top-k next tokens after the prompt, with their probabilities."""
    return _predict_many(model, [params], [ctx])[0]
