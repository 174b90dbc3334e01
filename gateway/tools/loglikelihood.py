"""`loglikelihood`: how likely the model finds each continuation after its prompt.

The prompt and the continuation are tokenised separately and joined, so the
continuation's tokens are exactly its own (no merge across the boundary), and
the result is the sum of their log-probabilities given everything before them.

With `window` (gateway/tools/windows.py) a prompt and continuation longer
than the context are scored with a stride, as `logprobs` scores a text: each
continuation token in the first window that holds it, with at least `overlap`
tokens before it. Only the windows that score a continuation token run: a
prompt of 100,000 tokens before a continuation of five is a window or two.
Passes are steps, counted and kept in the job's checkpoint, as `logprobs`'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

import msgspec
import torch

from gateway.errors import ParamError
from gateway.cost import JOURNAL_PIECE, JSON_FLOAT, Cost, Shape
from gateway.models.anatomy import readout_chunks, readout_rows
from gateway.tools.base import Capability, Context, Model, tool
from gateway.tools.batching import Chunk, Chunked, WindowItem
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
    counted = sum(lengths)
    if params.window is not None:
        cut = [_strided(model, params, c, k, i) for i, (c, k) in enumerate(pairs)]
        width = max(len(row) for text in cut for row in text.rows)
        rows = max(1, min(PASS_TOKENS // width, windows.PASS_ROWS, sum(len(text.rows) for text in cut)))
        lengths = [width]
        # Only the windows that score a continuation token run (`_plan`).
        counted = sum(len(text.rows[w]) for text, (c, k) in zip(cut, pairs) for w, _, _ in _scoring(text, len(c), len(k)))
    read = min(positions, readout_rows(model)) if model.has(Capability.LAYERS) else rows * width
    memory = shape.block_bytes(rows, width) + shape.states_bytes(rows, width, 1)
    return Cost(
        memory=memory + shape.logits_bytes(read) + positions * 16,
        result=len(pairs) * (JSON_FLOAT + 8),
        memory_field="window" if params.window is not None else "continuations",
        result_field="prompts",
        tokens=width,
        counted=counted,
        # Its checkpoint keeps each pair's scores, or each window's that scores continuation tokens: a
        # float and a flag a token.
        journal=(
            sum(len(list(_scoring(text, len(c), len(k)))) for text, (c, k) in zip(cut, pairs)) if params.window is not None else len(pairs)
        ) * JOURNAL_PIECE + positions * 8,
    )


def _plan(model: Model, jobs: list[LoglikelihoodParams], ctxs: Any = None) -> list[Chunk]:
    # Every whole pair of every job in the first right-padded pass; windows in passes of at most
    # PASS_TOKENS padded tokens, in order: those that score a continuation token only (a long
    # prompt's windows before its continuation score nothing).
    passes = windows.ReadPasses(PASS_TOKENS)
    for job, params in enumerate(jobs):
        for i, (context, continuation) in enumerate(_pairs(model, params)):
            ids = context + continuation
            if params.window is None:
                passes.whole((job, i), ids, range(len(context) - 1, len(ids) - 1), continuation)
                continue
            cut = _strided(model, params, context, continuation, i)
            rows = cut.rows
            for w, start, end in _scoring(cut, len(context), len(continuation)):
                at = cut.cut[w][0]
                passes.window((job, WindowItem(i, w)), rows[w], range(start - at, end - at), ids[start + 1 : end + 1])
    return passes.chunks()


def _scoring(cut: windows.Strided, context: int, continuation: int) -> Iterator[tuple[int, int, int]]:
    """The windows of a pair's plan that score a continuation token: each one's index and the positions
    [start, end) it reads for them (logits at position t score token t + 1)."""
    first, last = context - 1, context + continuation - 1
    for w, (start, end) in enumerate(cut.spans()):
        start, end = max(start, first), min(end, last)
        if start < end:
            yield w, start, end


def _run(model: Model, jobs: list[LoglikelihoodParams], chunk: Chunk) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per item, its continuation tokens' log-probabilities and whether each was the greedy one (on the CPU)."""
    input_ids, mask, rows, cols, target, counts = windows.read_pass(model, chunk)
    own = torch.empty(len(target))
    top = torch.empty(len(target), dtype=torch.bool)
    # A chunk of positions at a time: each continuation token's log-probability, and whether it was the top one.
    for part, logits in readout_chunks(model, input_ids, mask, rows, cols):
        logprobs = logits.log_softmax(dim=-1)
        own[part] = logprobs.gather(1, target[part, None])[:, 0].cpu()
        top[part] = (logprobs.argmax(dim=-1) == target[part]).cpu()
    return [(o.clone(), t.clone()) for o, t in zip(own.split(counts), top.split(counts))]


def _assemble(
    model: Model, jobs: list[LoglikelihoodParams], outputs: dict[Any, tuple[torch.Tensor, torch.Tensor]], ctxs: Any = None
) -> list[LoglikelihoodResult]:
    results = []
    for job, params in enumerate(jobs):
        pairs = _pairs(model, params)
        if params.window is None:
            scored, plans = [outputs[job, i] for i in range(len(pairs))], None
        else:
            cuts = [_strided(model, params, c, k, i) for i, (c, k) in enumerate(pairs)]
            plans = [cut.plan for cut in cuts]
            scored = []
            for i, cut in enumerate(cuts):  # its windows that scored a continuation token, in order
                pieces = [outputs[job, WindowItem(i, w)] for w in range(len(cut.cut)) if (job, WindowItem(i, w)) in outputs]
                scored.append((torch.cat([own for own, _ in pieces]), torch.cat([top for _, top in pieces])))
        results.append(LoglikelihoodResult(
            ll=floats(torch.stack([own.sum() for own, _ in scored])), is_greedy=[bool(top.all()) for _, top in scored], plans=plans,
        ))
    return results


# A pass a step: the whole pairs, or a pass of windows; each kept in the job's checkpoint, so that
# a job whose engine died goes on from its last pass.
work = Chunked(plan=_plan, run=_run, assemble=_assemble, unit="pairs", resumable=lambda params: True)


@tool(
    check=check,
    cost=cost,
    caps={"prompts": "max_prompts", "continuations": "max_prompts"},
    sequences=("prompts", "continuations"),
    tagged=("prompts",),  # the continuation follows its prompt: the tag is the prompt's
    batch=work.batch,
    spread=work,
    needs={Capability.NEXT_TOKEN},
)
def loglikelihood(model: Model, params: LoglikelihoodParams, ctx: Context) -> LoglikelihoodResult:
    """Sum of the continuation tokens' log-probabilities given the prompt, and whether greedy decoding would produce them."""
    return work.many(model, [params], [ctx])[0]
