"""`pseudo_loglikelihood`: a masked LM's score of a whole sequence, each position masked in turn.

For a sequence of n own tokens (residues), n copies are run, copy i with its
token i replaced by the mask; the pseudo-log-likelihood is the sum over i of
log p(token i | every other token) (Salazar et al. 2020; the standard score
of protein sequences and their variants with ESM). The special tokens the
tokenizer adds are never masked or scored.

The copies of every job's sequences are sorted by length into chunks of at
most `PLL_TOKENS` padded tokens and run chunk by chunk, or on every device at
once (`--devices`) for one big job. A sequence of n tokens costs n forward
rows of n tokens: a 500-residue protein is 500 rows.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import torch

from gateway.cost import JSON_FLOAT, JSON_TOKEN, Cost, Shape
from gateway.errors import ParamError
from gateway.models.anatomy import logits_at
from gateway.tools.base import Capability, Context, Model, right_padded, tool
from gateway.tools.batching import Chunk, Chunked, chunk_peak, sorted_chunks
from gateway.tools.numbers import floats

PLL_ROWS = 64  # masked copies per forward pass at most
PLL_TOKENS = 16384  # padded tokens per forward pass at most


class PseudoLoglikelihoodParams(msgspec.Struct, forbid_unknown_fields=True):
    sequences: Annotated[list[str], msgspec.Meta(min_length=1, description="Sequences (or texts) to score.")]
    per_position: Annotated[
        bool, msgspec.Meta(description="Also return each own token's log-probability with it masked, and the tokens.")
    ] = False


class PseudoLoglikelihoodResult(msgspec.Struct, omit_defaults=True):
    pll: list[float]
    """Per sequence: the sum of its tokens' log-probabilities, each masked in turn (nats)."""
    tokens_scored: list[int]
    """Per sequence: how many tokens were masked and scored (its own tokens)."""
    per_position: list[list[float]] | None = None
    tokens: list[list[str]] | None = None


def check(model: Model, params: PseudoLoglikelihoodParams) -> None:
    for i, sequence in enumerate(params.sequences):
        if not sequence:
            raise ParamError(f"sequences[{i}]", "must not be empty")
        ids = model.encode(sequence, f"sequences[{i}]")
        model.fit(len(ids), f"sequences[{i}]")
        if not model.own(ids):
            raise ParamError(f"sequences[{i}]", "has no tokens of its own, only the tokenizer's special tokens")
        if model.mask_token_id in ids:
            raise ParamError(f"sequences[{i}]", "already holds the mask token; give the sequence itself")


def cost(model: Model, params: PseudoLoglikelihoodParams) -> Cost:
    """The largest chunk of masked copies (each as long as its sequence) with its logits, and a number a copy."""
    shape = Shape.of(model)
    lengths = [len(model.encode(sequence)) for sequence in params.sequences]
    copies = [n for n in lengths for _ in range(n)]  # a copy per position (own tokens: at most that)
    peak = chunk_peak(copies, PLL_ROWS, PLL_TOKENS, lambda rows, width: shape.pass_bytes(rows, width, states=1, logits=rows))
    result = len(lengths) * 2 * JSON_FLOAT + (sum(lengths) * (JSON_FLOAT + JSON_TOKEN) if params.per_position else 0)
    return Cost(
        memory=peak + len(copies) * 64 + result,
        result=result,
        memory_field="sequences",
        result_field="per_position" if params.per_position else "sequences",
        tokens=max(lengths),
    )


def _plan(model: Model, jobs: list[PseudoLoglikelihoodParams], by_length: bool = True) -> list[Chunk]:
    # One item per masked copy: (job, (sequence, position, the true token)).
    items: list[tuple[tuple[int, Any], list[int]]] = []
    for job, params in enumerate(jobs):
        for s, sequence in enumerate(params.sequences):
            # The copies share the sequence's ids; each is masked only when its chunk runs.
            ids = model.encode(sequence)
            for at in model.own(ids):
                items.append(((job, (s, at, ids[at])), ids))
    return sorted_chunks(items, PLL_ROWS, max_tokens=PLL_TOKENS, by_length=by_length)  # type: ignore[arg-type]


def _run(model: Model, jobs: list[PseudoLoglikelihoodParams], chunk: Chunk) -> list[float]:
    input_ids, mask = right_padded(model, chunk.data)
    rows = torch.arange(len(chunk.items), device=input_ids.device)
    at = torch.tensor([key[1] for _, key in chunk.items], device=input_ids.device)
    true = torch.tensor([key[2] for _, key in chunk.items], device=input_ids.device)
    input_ids[rows, at] = model.mask_token_id
    logits = logits_at(model, input_ids, mask, rows, at)  # each copy's masked position only
    return floats(logits.log_softmax(dim=-1).gather(1, true[:, None])[:, 0])


def _assemble(
    model: Model, jobs: list[PseudoLoglikelihoodParams], outputs: dict[tuple[int, Any], float]
) -> list[PseudoLoglikelihoodResult]:
    by_sequence: dict[tuple[int, int], list[tuple[int, int, float]]] = {}
    for (job, (s, at, token)), value in outputs.items():
        by_sequence.setdefault((job, s), []).append((at, token, value))
    wanted = any(params.per_position for params in jobs)
    texts = model.token_texts(token for per in by_sequence.values() for _, token, _ in per) if wanted else {}
    results = []
    for job, params in enumerate(jobs):
        scored = [sorted(by_sequence[job, s]) for s in range(len(params.sequences))]
        results.append(
            PseudoLoglikelihoodResult(
                # Summed in float64 in position order: the same sum whichever device scored which copy.
                pll=floats(torch.tensor([sum(v for _, _, v in per) for per in scored], dtype=torch.float64)),
                tokens_scored=[len(per) for per in scored],
                per_position=[[v for _, _, v in per] for per in scored] if params.per_position else None,
                tokens=[[texts[t] for _, t, _ in per] for per in scored] if params.per_position else None,
            )
        )
    return results


def _weight(sequence: str) -> float:
    return len(sequence) ** 2  # a copy per position, each as long as the sequence


work = Chunked(
    plan=_plan, run=_run, assemble=_assemble, unit="positions",  # type: ignore[arg-type]
    items="sequences", per_item=("pll", "tokens_scored", "per_position", "tokens"), weight=_weight,
)


@tool(
    check=check,
    cost=cost,
    caps={"sequences": "max_sequences"},
    sequences=("sequences",),
    batch=work.batch,
    spread=work,
    needs={Capability.MASKED_LM},
)
def pseudo_loglikelihood(model: Model, params: PseudoLoglikelihoodParams, ctx: Context) -> PseudoLoglikelihoodResult:
    """Each sequence's pseudo-log-likelihood: every own token masked in turn, its log-probability summed."""
    return work.many(model, [params], [ctx])[0]
