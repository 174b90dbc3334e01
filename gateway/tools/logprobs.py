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

from gateway.errors import ParamError
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
    return [model.encode(text) for text in params.prompts or []]


def check(model: Model, params: LogprobsParams) -> None:
    if (params.prompts is None) == (params.token_ids is None):
        raise ParamError("prompts", "give prompts (text) or token_ids, one of the two")
    field = "prompts" if params.prompts is not None else "token_ids"
    for i, ids in enumerate(rows(model, params)):
        if params.token_ids is not None and (bad := next((t for t in ids if t >= model.vocab_size), None)) is not None:
            raise ParamError(f"token_ids[{i}]", f"token id {bad} is not below the vocabulary size {model.vocab_size}")
        model.fit(len(ids), f"{field}[{i}]")


def _logprobs_many(model: Model, jobs: list[LogprobsParams], ctxs: list[Context]) -> list[LogprobsResult]:
    # Every text of every job in one right-padded forward pass.
    per_job = [rows(model, params) for params in jobs]
    flat = [ids for job in per_job for ids in job]
    input_ids, mask = right_padded(model, flat)
    device = input_ids.device
    logprobs = model.logits(input_ids, mask).float().log_softmax(dim=-1)
    # Logits at position t score token t + 1: each token's log-probability, row × position (padding too).
    own = logprobs[:, :-1].gather(2, input_ids[:, 1:, None])[..., 0].cpu()
    at_last = logprobs[torch.arange(len(flat), device=device), torch.tensor([len(ids) - 1 for ids in flat], device=device)]
    best = at_last.argmax(dim=-1)
    best_ids, best_logprobs = best.tolist(), floats(at_last.gather(1, best[:, None])[:, 0])
    k = max(params.top for params in jobs)
    top_ids: list[Any] = []
    top_values: Any = None
    if k:  # one top-k for every row and position, as deep as the deepest job asks
        top = logprobs.topk(k, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.cpu()
    texts = model.token_texts(
        [*(t for ids in flat for t in ids), *best_ids, *(i for row in top_ids for position in row for i in position)]
    )

    def alternatives(row: int, start: int, end: int, top: int) -> list[list[TokenLogprob]]:
        values = floats(top_values[row, start:end, :top])
        return [
            [TokenLogprob(i, texts[i], v) for i, v in zip(ids, vs)]
            for ids, vs in zip((position[:top] for position in top_ids[row][start:end]), values)
        ]

    results, row = [], 0
    for job, params, ctx in zip(per_job, jobs, ctxs):
        scored = []
        for ids in job:
            n = len(ids)
            entry = Scored(token_ids=list(ids), tokens=[texts[t] for t in ids], logprobs=[None, *floats(own[row, : n - 1])])
            if params.top:
                entry.top = alternatives(row, 0, n - 1, params.top)
            if params.next_token:
                entry.next_token = TokenLogprob(best_ids[row], texts[best_ids[row]], best_logprobs[row])
                if params.top:
                    entry.next_top = alternatives(row, n - 1, n, params.top)[0]
            scored.append(entry)
            row += 1
        ctx.progress(len(job), len(job), "sequences")
        results.append(LogprobsResult(scored))
    return results


@tool(
    check=check,
    caps={"prompts": "max_prompts", "token_ids": "max_prompts"},
    sequences=("prompts",),
    batch=one_pass(_logprobs_many),
    needs={Capability.NEXT_TOKEN},
)
def logprobs(model: Model, params: LogprobsParams, ctx: Context) -> LogprobsResult:
    """Each token's log-probability given the tokens before it, with the top alternatives and the next greedy token if asked."""
    return _logprobs_many(model, [params], [ctx])[0]
