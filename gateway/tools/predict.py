"""`predict`: the model's distribution over the next token, its top k."""

from __future__ import annotations

from typing import Annotated

import msgspec
import torch

from gateway.errors import ParamError
from gateway.tools.base import Context, Model, tool
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
    if params.top_k > model.module.config.vocab_size:
        raise ParamError("top_k", f"must be <= the vocabulary size {model.module.config.vocab_size}")


@tool(check=check)
def predict(model: Model, params: PredictParams, ctx: Context) -> PredictResult:
    """The top-k next tokens after the prompt, with their probabilities."""
    ids = torch.tensor([model.encode(params.prompt)], device=model.device)
    logits = model.module(input_ids=ids).logits[0, -1].float()
    top = logits.softmax(dim=-1).topk(params.top_k)
    return PredictResult(
        [
            TokenProb(id=i, text=model.token_text(i), prob=p)
            for p, i in zip(floats(top.values), top.indices.tolist())
        ]
    )
