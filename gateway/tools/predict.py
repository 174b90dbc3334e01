"""`predict`: the model's distribution over the next token, its top k."""

from __future__ import annotations

from typing import Annotated

import msgspec
import torch

from gateway.errors import ParamError
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
    model.fit(len(model.encode(params.prompt)), "prompt")
    if params.top_k > model.vocab_size:
        raise ParamError("top_k", f"must be <= the vocabulary size {model.vocab_size}")


def _predict_many(model: Model, jobs: list[PredictParams], ctxs: list[Context]) -> list[PredictResult]:
    # Right padding: causal attention keeps each prompt's real tokens from seeing the pads after them.
    encoded = [model.encode(params.prompt) for params in jobs]
    input_ids, mask = right_padded(model, encoded)
    logits = model.logits(input_ids, mask)
    last = torch.tensor([len(ids) - 1 for ids in encoded], device=logits.device)
    probs = logits[torch.arange(len(encoded), device=logits.device), last].float().softmax(dim=-1)
    results = []
    for row, params in enumerate(jobs):
        top = probs[row].topk(params.top_k)
        results.append(
            PredictResult(
                [
                    TokenProb(id=i, text=model.token_text(i), prob=p)
                    for p, i in zip(floats(top.values), top.indices.tolist())
                ]
            )
        )
    return results


@tool(check=check, batch=one_pass(_predict_many), needs={Capability.NEXT_TOKEN}, sequences=("prompt",))
def predict(model: Model, params: PredictParams, ctx: Context) -> PredictResult:
    """The top-k next tokens after the prompt, with their probabilities."""
    return _predict_many(model, [params], [ctx])[0]
