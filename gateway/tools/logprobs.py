"""`logprobs`: the log-probability of every token of a text given the tokens before it.

What evaluation harnesses call scoring a prompt (OpenAI's `echo` with `logprobs`):
one forward pass per text, each token's log-probability read from the logits at
the position before it. The first token has nothing before it and no number.
Texts are tokenised as prompts are (special tokens included), or given as token
ids, which are scored exactly as given. `top` adds the most likely tokens at each
position, and `next_token` the greedy token after the text (what `generate` at
temperature 0 would produce first), both from the same pass.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import torch

from gateway.cost import JSON_ENTRY, JSON_FLOAT, JSON_TOKEN, PY_ENTRY, PY_FLOAT, Cost, Shape
from gateway.errors import ParamError
from gateway.models.anatomy import readout_chunks, readout_rows
from gateway.tools.base import Capability, Context, Model, right_padded, tool
from gateway.tools.batching import one_pass
from gateway.tools.numbers import floats

MAX_TOP = 20


class LogprobsParams(msgspec.Struct, forbid_unknown_fields=True):
    prompts: Annotated[list[str], msgspec.Meta(min_length=1, description="Texts to score, tokenised as prompts are.")] | None = None
    token_ids: Annotated[
        list[Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=1)]],
        msgspec.Meta(min_length=1, description="Token id sequences to score as they are, instead of prompts."),
    ] | None = None
    top: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP, description="The most likely tokens to list at each position.")] = 0
    next_token: Annotated[bool, msgspec.Meta(description="Also the greedy token after each text, with its log-probability.")] = False


class TokenLogprob(msgspec.Struct):
    id: int
    text: str
    logprob: float


class Scored(msgspec.Struct, omit_defaults=True):
    """One text: its tokens, each token's log-probability given those before it (null for the
    first), the `top` alternatives at each position (from the second), and the next token."""

    token_ids: list[int]
    tokens: list[str]
    logprobs: list[float | None]
    top: list[list[TokenLogprob]] | None = None
    next_token: TokenLogprob | None = None
    next_top: list[TokenLogprob] | None = None  # the `top` alternatives at the next token's position


class LogprobsResult(msgspec.Struct):
    sequences: list[Scored]


def rows(model: Model, params: LogprobsParams) -> list[list[int]]:
    if params.token_ids is not None:
        return params.token_ids
    return [model.encode(text, f"prompts[{i}]") for i, text in enumerate(params.prompts or [])]


def check(model: Model, params: LogprobsParams) -> None:
    if (params.prompts is None) == (params.token_ids is None):
        raise ParamError("prompts", "give prompts (text) or token_ids, one of the two")
    field = "prompts" if params.prompts is not None else "token_ids"
    for i, ids in enumerate(rows(model, params)):
        if params.token_ids is not None and (bad := next((t for t in ids if t >= model.vocab_size), None)) is not None:
            raise ParamError(f"token_ids[{i}]", f"token id {bad} is not below the vocabulary size {model.vocab_size}")
        model.fit(len(ids), f"{field}[{i}]")


def cost(model: Model, params: LogprobsParams) -> Cost:
    """The pass with the last block's states kept, one readout chunk's logits, and the tokens scored."""
    shape = Shape.of(model)
    lengths = [len(ids) for ids in rows(model, params)]
    positions = sum(lengths)
    # A model without a layer stack gives its logits at every position at once.
    read = min(positions, readout_rows(model)) if model.has(Capability.LAYERS) else positions
    per_token = 8 + JSON_TOKEN + JSON_FLOAT + params.top * (JSON_ENTRY + JSON_TOKEN)
    result = positions * per_token
    memory = shape.block_bytes(len(lengths), max(lengths)) + shape.states_bytes(len(lengths), max(lengths), 1)
    return Cost(
        memory=memory + shape.logits_bytes(read) + positions * (8 + 4 + PY_FLOAT + params.top * (12 + PY_ENTRY)) + result,
        result=result,
        memory_field="prompts" if params.prompts is not None else "token_ids",
        result_field="top" if params.top else ("prompts" if params.prompts is not None else "token_ids"),
        tokens=max(lengths),
    )


def _logprobs_many(model: Model, jobs: list[LogprobsParams], ctxs: list[Context]) -> list[LogprobsResult]:
    # Every text of every job in one right-padded forward pass, read out a chunk of positions at a time.
    per_job = [rows(model, params) for params in jobs]
    flat = [ids for job in per_job for ids in job]
    input_ids, mask = right_padded(model, flat)
    device = input_ids.device
    # Every position of every text: at t < n - 1 its logits score token t + 1; at n - 1, the next token.
    at_rows = torch.tensor([row for row, ids in enumerate(flat) for _ in ids], device=device)
    at_cols = torch.tensor([t for ids in flat for t in range(len(ids))], device=device)
    scored = torch.tensor([ids[t + 1] if t + 1 < len(ids) else 0 for ids in flat for t in range(len(ids))], device=device)
    k = max(params.top for params in jobs)  # one top-k for every position, as deep as the deepest job asks
    own_parts, best_parts, best_lp_parts, top_id_parts, top_value_parts = [], [], [], [], []
    for part, logits in readout_chunks(model, input_ids, mask, at_rows, at_cols):
        logprobs = logits.log_softmax(dim=-1)
        own_parts.append(logprobs.gather(1, scored[part, None])[:, 0])
        best = logprobs.argmax(dim=-1)
        best_parts.append(best)
        best_lp_parts.append(logprobs.gather(1, best[:, None])[:, 0])
        if k:
            top = logprobs.topk(k, dim=-1)
            top_id_parts.append(top.indices)
            top_value_parts.append(top.values)
    own = floats(torch.cat(own_parts))
    best_ids = torch.cat(best_parts).tolist()
    best_logprobs = floats(torch.cat(best_lp_parts))
    top_ids: list[Any] = torch.cat(top_id_parts).tolist() if k else []
    top_values: Any = torch.cat(top_value_parts).cpu() if k else None
    texts = model.token_texts([*(t for ids in flat for t in ids), *best_ids, *(i for position in top_ids for i in position)])

    def alternatives(start: int, end: int, top: int) -> list[list[TokenLogprob]]:
        values = floats(top_values[start:end, :top])
        return [[TokenLogprob(i, texts[i], v) for i, v in zip(ids[:top], vs)] for ids, vs in zip(top_ids[start:end], values)]

    results, at = [], 0  # `at`: the first position of the text at hand, in the flat order
    for job, params, ctx in zip(per_job, jobs, ctxs):
        entries = []
        for ids in job:
            n = len(ids)
            last = at + n - 1
            entry = Scored(token_ids=list(ids), tokens=[texts[t] for t in ids], logprobs=[None, *own[at:last]])
            if params.top:
                entry.top = alternatives(at, last, params.top)
            if params.next_token:
                entry.next_token = TokenLogprob(best_ids[last], texts[best_ids[last]], best_logprobs[last])
                if params.top:
                    entry.next_top = alternatives(last, last + 1, params.top)[0]
            entries.append(entry)
            at += n
        ctx.progress(len(job), len(job), "sequences")
        results.append(LogprobsResult(entries))
    return results


@tool(
    check=check,
    cost=cost,
    caps={"prompts": "max_prompts", "token_ids": "max_prompts"},
    sequences=("prompts",),
    batch=one_pass(_logprobs_many),
    needs={Capability.NEXT_TOKEN},
)
def logprobs(model: Model, params: LogprobsParams, ctx: Context) -> LogprobsResult:
    """Each token's log-probability given the tokens before it, with the top alternatives and the next greedy token if asked."""
    return _logprobs_many(model, [params], [ctx])[0]
