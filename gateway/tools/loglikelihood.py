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
from gateway.cost import JSON_FLOAT, Cost, Shape
from gateway.models.anatomy import readout_chunks, readout_rows
from gateway.tools.base import Capability, Context, Model, right_padded, tool
from gateway.tools.batching import one_pass
from gateway.tools.numbers import floats


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
        (model.encode(prompt, f"prompts[{i}]"), model.encode_continuation(cont, f"continuations[{i}]"))
        for i, (prompt, cont) in enumerate(zip(params.prompts, params.continuations))
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


def cost(model: Model, params: LoglikelihoodParams) -> Cost:
    """The pass with the last block's states kept, and one readout chunk's logits; two numbers a pair."""
    shape = Shape.of(model)
    pairs = _pairs(model, params)
    lengths = [len(context) + len(continuation) for context, continuation in pairs]
    positions = sum(len(continuation) for _, continuation in pairs)
    read = min(positions, readout_rows(model)) if model.has(Capability.LAYERS) else sum(lengths)
    memory = shape.block_bytes(len(pairs), max(lengths)) + shape.states_bytes(len(pairs), max(lengths), 1)
    return Cost(
        memory=memory + shape.logits_bytes(read) + positions * 16,
        result=len(pairs) * (JSON_FLOAT + 8),
        memory_field="continuations",
        result_field="prompts",
        tokens=max(lengths),
    )


def _loglikelihood_many(
    model: Model, jobs: list[LoglikelihoodParams], ctxs: list[Context]
) -> list[LoglikelihoodResult]:
    # Every pair of every job in one right-padded forward pass; only the positions that
    # predict a continuation token go through the head.
    pairs = [_pairs(model, params) for params in jobs]
    flat = [pair for job in pairs for pair in job]
    input_ids, mask = right_padded(model, [context + continuation for context, continuation in flat])
    device = input_ids.device
    # Logits at position t predict token t + 1.
    rows = torch.tensor([row for row, (_, cont) in enumerate(flat) for _ in cont], device=device)
    cols = torch.tensor([len(ctx) - 1 + k for ctx, cont in flat for k in range(len(cont))], device=device)
    target = torch.tensor([token for _, cont in flat for token in cont], device=device)
    # A chunk of positions at a time: each continuation token's log-probability, and whether it was the top one.
    own_parts, top_parts = [], []
    for part, logits in readout_chunks(model, input_ids, mask, rows, cols):
        logprobs = logits.log_softmax(dim=-1)
        own_parts.append(logprobs.gather(1, target[part, None])[:, 0])
        top_parts.append(logprobs.argmax(dim=-1) == target[part])
    sizes = [len(cont) for _, cont in flat]
    ll = floats(torch.stack([span.sum() for span in torch.cat(own_parts).split(sizes)]))
    greedy = torch.stack([span.all() for span in torch.cat(top_parts).split(sizes)]).tolist()
    results, row = [], 0
    for job, ctx in zip(pairs, ctxs):
        results.append(LoglikelihoodResult(ll=ll[row : row + len(job)], is_greedy=greedy[row : row + len(job)]))
        row += len(job)
        ctx.progress(len(job), len(job), "pairs")
    return results


@tool(
    check=check,
    cost=cost,
    caps={"prompts": "max_prompts", "continuations": "max_prompts"},
    sequences=("prompts", "continuations"),
    tagged=("prompts",),  # the continuation follows its prompt: the tag is the prompt's
    batch=one_pass(_loglikelihood_many),
    needs={Capability.NEXT_TOKEN},
)
def loglikelihood(model: Model, params: LoglikelihoodParams, ctx: Context) -> LoglikelihoodResult:
    """Sum of the continuation tokens' log-probabilities given the prompt, and whether greedy decoding would produce them."""
    return _loglikelihood_many(model, [params], [ctx])[0]
