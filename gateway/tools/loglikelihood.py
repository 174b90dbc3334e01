"""`loglikelihood`: how likely the model finds each continuation after its prompt.

The prompt and the continuation are tokenised separately and joined, so the
continuation's tokens are exactly its own (no merge across the boundary), and
the result is the sum of their log-probabilities given everything before them.

With `window` (gateway/tools/windows.py) a prompt and continuation longer
than the context are scored with a stride, as `logprobs` scores a text: each
continuation token in the first window that holds it, with at least `overlap`
tokens before it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import torch

from gateway.errors import ParamError
from gateway.cost import JSON_FLOAT, Cost, Shape
from gateway.models.anatomy import readout_chunks, readout_rows
from gateway.tools.base import Capability, Context, Model, right_padded, tool
from gateway.tools.batching import one_pass
from gateway.tools import windows
from gateway.tools.numbers import floats
from gateway.tools.windows import Strided, WindowParams, WindowPlan

PASS_TOKENS = 16384  # padded tokens in one pass over windows


class LoglikelihoodParams(WindowParams, forbid_unknown_fields=True):
    prompts: Annotated[list[str], msgspec.Meta(min_length=1)]
    continuations: Annotated[
        list[str], msgspec.Meta(min_length=1, description="One per prompt, scored after it.")
    ]


class LoglikelihoodResult(msgspec.Struct, omit_defaults=True):
    ll: list[float]
    is_greedy: list[bool]
    plans: list[WindowPlan] | None = None
    """With window: each pair's windows over the prompt's and continuation's own tokens."""


def _pairs(model: Model, params: LoglikelihoodParams) -> list[tuple[list[int], list[int]]]:
    bounded = params.window is None
    return [
        (model.encode(prompt, f"prompts[{i}]", bounded), model.encode_continuation(cont, f"continuations[{i}]", bounded))
        for i, (prompt, cont) in enumerate(zip(params.prompts, params.continuations))
    ]


def _strided(model: Model, params: LoglikelihoodParams, context: list[int], continuation: list[int], i: int) -> Strided:
    ids = context + continuation
    own = model.own(context)
    return Strided(model, params, ids, [*own, *range(len(context), len(ids))], f"prompts[{i}]")


def check(model: Model, params: LoglikelihoodParams) -> None:
    if len(params.continuations) != len(params.prompts):
        raise ParamError(
            "continuations",
            f"must have one entry per prompt ({len(params.prompts)}), got {len(params.continuations)}",
        )
    windows.resolve(params, model.context_length)  # window-only params without a window
    with windows.naming_window():
        pairs = _pairs(model, params)
    for i, (context, continuation) in enumerate(pairs):
        if not continuation:
            raise ParamError(f"continuations[{i}]", "must not be empty")
        if params.window is not None:
            _strided(model, params, context, continuation, i)
            continue
        with windows.naming_window():
            model.fit(len(context) + len(continuation), f"prompts[{i}]", "prompt + continuation")


def cost(model: Model, params: LoglikelihoodParams) -> Cost:
    """The pass with the last block's states kept, and one readout chunk's logits; two numbers a pair."""
    shape = Shape.of(model)
    pairs = _pairs(model, params)
    lengths = [len(context) + len(continuation) for context, continuation in pairs]
    positions = sum(len(continuation) for _, continuation in pairs)
    rows, width = len(pairs), max(lengths)
    if params.window is not None:
        cut = [_strided(model, params, c, k, i) for i, (c, k) in enumerate(pairs)]
        width = max(len(row) for text in cut for row in text.rows)
        rows = max(1, min(PASS_TOKENS // width, sum(len(text.rows) for text in cut)))
        lengths = [width]
    read = min(positions, readout_rows(model)) if model.has(Capability.LAYERS) else rows * width
    memory = shape.block_bytes(rows, width) + shape.states_bytes(rows, width, 1)
    return Cost(
        memory=memory + shape.logits_bytes(read) + positions * 16,
        result=len(pairs) * (JSON_FLOAT + 8),
        memory_field="window" if params.window is not None else "continuations",
        result_field="prompts",
        tokens=width,
    )


def _loglikelihood_many(
    model: Model, jobs: list[LoglikelihoodParams], ctxs: list[Context]
) -> list[LoglikelihoodResult]:
    # Every pair of every job in one right-padded forward pass (windows in passes of their own);
    # only the positions that predict a continuation token go through the head.
    pairs = [_pairs(model, params) for params in jobs]
    passes = windows.Passes(PASS_TOKENS)
    reads: list[tuple[int, int, int, int]] = []  # (pass, row, column, token scored), pair after pair
    plans: list[Any] = []
    for job, params in zip(pairs, jobs):
        for i, (context, continuation) in enumerate(job):
            if params.window is None:
                placed = passes.whole(context + continuation)
                # Logits at position t predict token t + 1.
                reads += [(*placed, len(context) - 1 + k, token) for k, token in enumerate(continuation)]
                plans.append(None)
                continue
            cut = _strided(model, params, context, continuation, i)
            in_passes = [passes.window(window) for window in cut.rows]
            for k, token in enumerate(continuation):
                w, col = cut.reads[len(context) - 1 + k]
                reads.append((*in_passes[w], col, token))
            plans.append(cut.plan)
    by_pass: list[list[int]] = [[] for _ in passes.rows]
    for r, read in enumerate(reads):
        by_pass[read[0]].append(r)
    own = torch.empty(len(reads))
    top = torch.empty(len(reads), dtype=torch.bool)
    for pass_rows, mine in zip(passes.rows, by_pass):
        if not mine:
            continue
        input_ids, mask = right_padded(model, pass_rows)
        device = input_ids.device
        rows = torch.tensor([reads[r][1] for r in mine], device=device)
        cols = torch.tensor([reads[r][2] for r in mine], device=device)
        target = torch.tensor([reads[r][3] for r in mine], device=device)
        index = torch.tensor(mine)
        # A chunk of positions at a time: each continuation token's log-probability, and whether it was the top one.
        for part, logits in readout_chunks(model, input_ids, mask, rows, cols):
            logprobs = logits.log_softmax(dim=-1)
            own[index[part]] = logprobs.gather(1, target[part, None])[:, 0].cpu()
            top[index[part]] = (logprobs.argmax(dim=-1) == target[part]).cpu()
    sizes = [len(cont) for job in pairs for _, cont in job]
    ll = floats(torch.stack([span.sum() for span in own.split(sizes)]))
    greedy = torch.stack([span.all() for span in top.split(sizes)]).tolist()
    results, row = [], 0
    for job, params, ctx in zip(pairs, jobs, ctxs):
        results.append(LoglikelihoodResult(
            ll=ll[row : row + len(job)], is_greedy=greedy[row : row + len(job)],
            plans=plans[row : row + len(job)] if params.window is not None else None,
        ))
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
