"""`loglikelihood`: how likely the model finds each continuation after its prompt.

The prompt and the continuation are tokenised separately and joined, so the
continuation's tokens are exactly its own (no merge across the boundary), and
the result is the sum of their log-probabilities given everything before them.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import torch

from gateway.errors import ParamError
from gateway.tools.base import Context, Model, tool


class LoglikelihoodParams(msgspec.Struct, forbid_unknown_fields=True):
    prompts: Annotated[list[str], msgspec.Meta(min_length=1)]
    continuations: Annotated[
        list[str], msgspec.Meta(min_length=1, description="One per prompt, scored after it.")
    ]


class LoglikelihoodResult(msgspec.Struct):
    ll: list[float]
    is_greedy: list[bool]


def _pairs(model: Model, params: LoglikelihoodParams) -> list[tuple[list[int], list[int]]]:
    return [
        (model.encode(prompt), model.encode_continuation(cont))
        for prompt, cont in zip(params.prompts, params.continuations)
    ]


def check(model: Model, params: LoglikelihoodParams) -> None:
    if len(params.continuations) != len(params.prompts):
        raise ParamError(
            "continuations",
            f"must have one entry per prompt ({len(params.prompts)}), got {len(params.continuations)}",
        )
    for i, (context, continuation) in enumerate(_pairs(model, params)):
        if not continuation:
            raise ParamError(f"continuations[{i}]", "must not be empty")
        model.fit(len(context) + len(continuation), f"prompts[{i}]", "prompt + continuation")


@tool(check=check, caps={"prompts": "max_prompts", "continuations": "max_prompts"})
def loglikelihood(model: Model, params: LoglikelihoodParams, ctx: Context) -> LoglikelihoodResult:
    """Sum of the continuation tokens' log-probabilities given the prompt, and whether greedy decoding would produce them."""
    pairs = _pairs(model, params)
    rows = [context + continuation for context, continuation in pairs]
    width = max(len(r) for r in rows)
    pad = model.tokenizer.pad_token_id
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    ctx.raise_if_cancelled()
    logits = model.module(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device)).logits
    logprobs = logits.float().log_softmax(dim=-1)
    ll, greedy = [], []
    for i, (context, continuation) in enumerate(pairs):
        # Logits at position t predict token t + 1.
        span = logprobs[i, len(context) - 1 : len(context) + len(continuation) - 1]
        target = torch.tensor(continuation, device=span.device)
        ll.append(span.gather(1, target[:, None]).sum().item())
        greedy.append(bool((span.argmax(dim=-1) == target).all()))
    ctx.progress(len(pairs), len(pairs), "pairs")
    return LoglikelihoodResult(ll=ll, is_greedy=greedy)
