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

With `window` (gateway/tools/windows.py) a sequence longer than the context
is scored in windows: each position is masked in a copy of the window it takes
its value from (`center`), or in every window that holds it, its
log-probabilities averaged (`mean`). A sequence of n tokens then costs about
n rows of `window` tokens (`center`).
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
from gateway.tools import windows
from gateway.tools.numbers import floats
from gateway.tools.windows import Framed, Sizes, Stitch, WindowParams, WindowPlan

PLL_ROWS = 64  # masked copies per forward pass at most
PLL_TOKENS = 16384  # padded tokens per forward pass at most


class PseudoLoglikelihoodParams(WindowParams, forbid_unknown_fields=True):
    sequences: Annotated[list[str], msgspec.Meta(min_length=1, description="Sequences (or texts) to score.")]
    per_position: Annotated[
        bool, msgspec.Meta(description="Also return each own token's log-probability with it masked, and the tokens.")
    ] = False
    part: Annotated[windows.Part, msgspec.Meta(description=windows.PART_DOC + " A part's per_position is always there.")] | None = None
    partials: Annotated[
        bool,
        msgspec.Meta(
            description="With window and stitch center or left: send the positions' scores as partial events as soon as "
            "a window's are all computed ({sequence, start, end, scores, tokens}: positions start..end-1 of the "
            "sequence's own tokens, a window's share, each its log-probability with it masked), in order within each "
            "sequence."
        ),
    ] = False


class PseudoLoglikelihoodPartial(msgspec.Struct):
    """With partials: a window's share of a sequence's positions' scores, as soon as they are computed."""

    sequence: int
    start: int
    end: int
    scores: list[float]
    tokens: list[str]


class PseudoLoglikelihoodResult(msgspec.Struct, omit_defaults=True):
    pll: list[float]
    """Per sequence: the sum of its tokens' log-probabilities, each masked in turn (nats)."""
    tokens_scored: list[int]
    """Per sequence: how many tokens were masked and scored (its own tokens)."""
    per_position: list[list[float]] | None = None
    tokens: list[list[str]] | None = None
    plans: list[WindowPlan] | None = None
    """With window: how each sequence was cut and stitched."""
    context: list[Any] | None = None
    """With window and per_position: per own token, the fewest tokens of context it had on each side, [left, right]."""
    span: list[tuple[int, int]] | None = None
    """With part: the positions [start, end) of the sequence that its per_position (and tokens, context)
    hold, the part's; pll is their sum."""


def _framed(model: Model, params: PseudoLoglikelihoodParams, i: int) -> tuple[Framed, Sizes, list[tuple[int, int]]]:
    """A windowed sequence's tokens, its window sizes and its plan."""
    return windows.cut(model, params, params.sequences[i], f"sequences[{i}]")


def check(model: Model, params: PseudoLoglikelihoodParams) -> None:
    if params.partials:
        if params.window is None:
            raise ParamError("partials", "a partial event is a run of a sequence's windowed positions: only with window")
        if params.stitch is not None and Stitch(params.stitch) is Stitch.MEAN:
            raise ParamError("partials", "with stitch mean a position is final only once every window holding it is in: use center or left")
        if params.part is not None:
            raise ParamError("part", "not with partials: the job's partial events are the whole's")
    if params.part is not None:
        windows.check_part(params, params.sequences, "sequences", params.stitch is not None and Stitch(params.stitch) is Stitch.MEAN)
    windows.resolve(params, model.context_length)  # window-only params without a window
    for i, sequence in enumerate(params.sequences):
        if not sequence:
            raise ParamError(f"sequences[{i}]", "must not be empty")
        if params.window is not None:
            framed, _, _ = _framed(model, params, i)
            if model.mask_token_id in framed.own:
                raise ParamError(f"sequences[{i}]", "already holds the mask token; give the sequence itself")
            continue
        with windows.naming_window():
            ids = model.encode(sequence, f"sequences[{i}]")
            model.fit(len(ids), f"sequences[{i}]")
        if not model.own(ids):
            raise ParamError(f"sequences[{i}]", "has no tokens of its own, only the tokenizer's special tokens")
        if model.mask_token_id in ids:
            raise ParamError(f"sequences[{i}]", "already holds the mask token; give the sequence itself")


# A masked copy's piece of the checkpoint's journal: its key and its float, pickled in a list.
JOURNAL_COPY = 128


def cost(model: Model, params: PseudoLoglikelihoodParams) -> Cost:
    """The largest chunk of masked copies (each as long as its sequence) with its logits, and a number a copy."""
    shape = Shape.of(model)
    if params.window is None:
        lengths = [len(model.encode(sequence)) for sequence in params.sequences]
        copies = [n for n in lengths for _ in range(n)]  # a copy per position (own tokens: at most that)
    else:
        lengths, copies = [], []
        for i in range(len(params.sequences)):
            framed, sizes, cut = _framed(model, params, i)
            shares = windows.shares(cut, sizes.stitch)
            picked = windows.part_windows(params.part, len(cut))
            copies += [cut[w][1] - cut[w][0] + framed.around for w in picked for _ in range(shares[w].end - shares[w].start)]
            lengths.append(len(framed.own) if params.part is None else len(copies))  # a part's: its positions
    peak = chunk_peak(copies, PLL_ROWS, PLL_TOKENS, lambda rows, width: shape.pass_bytes(rows, width, states=1, logits=rows))
    scores = params.per_position or params.part is not None
    result = len(lengths) * 2 * JSON_FLOAT + (sum(lengths) * (JSON_FLOAT + JSON_TOKEN) if scores else 0)
    logged = sum(lengths) * (JSON_FLOAT + JSON_TOKEN) if params.partials else 0  # in the job's log until it ends
    return Cost(
        # Its checkpoint keeps each masked copy's log-probability, a float, under its key (a few ints).
        journal=len(copies) * JOURNAL_COPY,
        memory=peak + len(copies) * 64 + result + logged,
        result=result,
        memory_field="window" if params.window is not None else "sequences",
        result_field="per_position" if params.per_position else "sequences",
        tokens=max(copies, default=0),
        counted=sum(copies),
    )


def _plan(model: Model, jobs: list[PseudoLoglikelihoodParams], ctxs: Any = None, by_length: bool = True) -> list[Chunk]:
    # One item per masked copy: (job, (sequence, position, the true token)).
    items: list[tuple[tuple[int, Any], list[int]]] = []
    for job, params in enumerate(jobs):
        for s, sequence in enumerate(params.sequences):
            if params.window is not None:
                items += _window_copies(model, params, job, s)
                continue
            # The copies share the sequence's ids; each is masked only when its chunk runs.
            ids = model.encode(sequence)
            for at in model.own(ids):
                items.append(((job, (s, at, ids[at])), ids))
    return sorted_chunks(items, PLL_ROWS, max_tokens=PLL_TOKENS, by_length=by_length)  # type: ignore[arg-type]


def _window_copies(model: Model, params: PseudoLoglikelihoodParams, job: int, s: int) -> list[tuple[tuple[int, Any], list[int]]]:
    """A windowed sequence's masked copies: (job, (sequence, where in the window, the true token,
    the position in the sequence, its weight)), each copy its window's ids."""
    framed, sizes, cut = _framed(model, params, s)
    head = len(framed.head)
    items: list[tuple[tuple[int, Any], list[int]]] = []
    shares = windows.shares(cut, sizes.stitch)
    for w in windows.part_windows(params.part, len(cut)):
        share, (start, end) = shares[w], cut[w]
        ids = framed.window(start, end)
        for p in range(share.start, share.end):
            weight = 1.0 if share.weights is None else float(share.weights[p - share.start])
            at = head + p - start
            items.append(((job, (s, at, ids[at], p, weight, share.start, share.end)), ids))
    return items


def _run(model: Model, jobs: list[PseudoLoglikelihoodParams], chunk: Chunk) -> list[float]:
    input_ids, mask = right_padded(model, chunk.data)
    rows = torch.arange(len(chunk.items), device=input_ids.device)
    at = torch.tensor([key[1] for _, key in chunk.items], device=input_ids.device)
    true = torch.tensor([key[2] for _, key in chunk.items], device=input_ids.device)
    input_ids[rows, at] = model.mask_token_id
    logits = logits_at(model, input_ids, mask, rows, at)  # each copy's masked position only
    return floats(logits.log_softmax(dim=-1).gather(1, true[:, None])[:, 0])


def _assemble(
    model: Model, jobs: list[PseudoLoglikelihoodParams], outputs: dict[tuple[int, Any], float], ctxs: Any = None
) -> list[PseudoLoglikelihoodResult]:
    by_sequence: dict[tuple[int, int], list[tuple[int, int, float]]] = {}
    windowed: dict[tuple[int, int], dict[int, tuple[int, float]]] = {}
    for (job, key), value in outputs.items():
        if len(key) == 7:  # a windowed copy: summed into its position, by its weight
            s, _, token, p, weight, _, _ = key
            at_p = windowed.setdefault((job, s), {})
            at_p[p] = (token, at_p.get(p, (token, 0.0))[1] + weight * value)
        else:
            s, at, token = key
            by_sequence.setdefault((job, s), []).append((at, token, value))
    for key, at_p in windowed.items():
        by_sequence[key] = [(p, token, value) for p, (token, value) in at_p.items()]
    wanted = any(params.per_position for params in jobs)
    texts = model.token_texts(token for per in by_sequence.values() for _, token, _ in per) if wanted else {}
    results = []
    for job, params in enumerate(jobs):
        scored = [sorted(by_sequence.get((job, s), [])) for s in range(len(params.sequences))]
        plans = context = span = None
        if params.window is not None:
            cuts = [_framed(model, params, s) for s in range(len(params.sequences))]
            plans = [WindowPlan(windows=cut, stitch=sizes.stitch, window=sizes.window, overlap=sizes.overlap) for _, sizes, cut in cuts]
            stretches = [(0, len(framed.own)) for framed, _, _ in cuts]
            if params.part is not None:
                span = stretches = [
                    windows.span(windows.shares(cut, sizes.stitch), windows.part_windows(params.part, len(cut)), len(framed.own))
                    for framed, sizes, cut in cuts
                ]
            context = [windows.context(cut, sizes.stitch, *at) for (_, sizes, cut), at in zip(cuts, stretches)] if params.per_position else None
        results.append(
            PseudoLoglikelihoodResult(
                pll=_summed([[v for _, _, v in per] for per in scored]),
                tokens_scored=[len(per) for per in scored],
                per_position=[[v for _, _, v in per] for per in scored] if params.per_position or params.part is not None else None,
                tokens=[[texts[t] for _, t, _ in per] for per in scored] if params.per_position else None,
                plans=plans,
                context=context,
                span=span,
            )
        )
    return results


def _summed(scores: list[list[float]]) -> list[float]:
    """Each sequence's score: summed in float64 in position order, the same sum whichever device (or
    engine, for a job put together from parts) scored which copy."""
    return floats(torch.tensor([sum(per) for per in scores], dtype=torch.float64))


class _PllPart(msgspec.Struct):
    """A part's result as the gateway reads it to put the parts together: its values as the engine wrote them."""

    pll: list[float]
    tokens_scored: list[int]
    plans: list[msgspec.Raw]
    span: list[tuple[int, int]]
    per_position: list[list[float]]
    tokens: list[list[msgspec.Raw]] | None = None
    context: list[list[msgspec.Raw]] | None = None


def _joined(params: PseudoLoglikelihoodParams, results: list[bytes]) -> bytes:
    """The whole's result from its parts' (`part`: 0..count-1, in order): their positions' scores one
    after another, summed as one engine sums them. Raises ValueError where they do not make one whole."""
    parts = [msgspec.json.decode(result, type=_PllPart) for result in results]
    plan = parts[0].plans[0]
    if any(bytes(part.plans[0]) != bytes(plan) for part in parts):
        raise ValueError("the parts disagree on the plan")
    n = msgspec.json.decode(plan, type=WindowPlan).windows[-1][1]
    spans = [part.span[0] for part in parts]
    if spans[0][0] != 0 or spans[-1][1] != n or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        raise ValueError(f"the parts' positions {spans} do not cover the sequence's {n} one after another")
    scores = [v for part in parts for v in part.per_position[0]]
    if len(scores) != n:
        raise ValueError(f"the parts scored {len(scores)} positions of {n}")

    def joined(field: str) -> list[list[msgspec.Raw]] | None:
        return [[value for part in parts for value in (getattr(part, field) or [[]])[0]]] if params.per_position else None

    whole = PseudoLoglikelihoodResult(
        pll=_summed([scores]), tokens_scored=[n], per_position=[scores] if params.per_position else None,
        tokens=joined("tokens"), plans=[plan], context=joined("context"),  # type: ignore[arg-type, list-item]
    )
    return msgspec.json.encode(whole)


def _partials(
    model: Model, params: PseudoLoglikelihoodParams, done: list[tuple[Any, float]], carry: list[tuple[Any, float]]
) -> list[PseudoLoglikelihoodPartial]:
    """A window's share of a sequence's positions' scores (`partials`), once every copy of it is done:
    an event a share, whichever chunks (and other jobs' copies) its copies fell into."""
    if not params.partials:
        return []
    carry += done
    events = []
    while carry:
        s, start, end = carry[0][0][0], carry[0][0][5], carry[0][0][6]
        share = [(key, value) for key, value in carry[: end - start] if key[0] == s and key[5] == start]
        if len(share) < end - start:
            break  # its copies are planned in order: the rest of the share is still to come
        del carry[: end - start]
        texts = model.token_texts(key[2] for key, _ in share)
        events.append(PseudoLoglikelihoodPartial(s, start, end, [v for _, v in share], [texts[key[2]] for key, _ in share]))
    return events


def _by_windows(params: PseudoLoglikelihoodParams, context_length: int | None) -> int:
    """The most parts a one-sequence job may be cut into over engines by its window plan (`part`):
    none for one that is a part already, one whose scores stream as partial events, or with `mean`,
    where a position's score is summed over windows two parts would each hold."""
    if params.window is None or params.part is not None or len(params.sequences) != 1 or params.partials:
        return 0
    if params.stitch is not None and Stitch(params.stitch) is Stitch.MEAN:
        return 0
    return windows.most_windows(params, params.sequences[0], context_length)


def _weight(sequence: str) -> float:
    return len(sequence) ** 2  # a copy per position, each as long as the sequence


work = Chunked(
    plan=_plan, run=_run, assemble=_assemble, unit="positions",  # type: ignore[arg-type]
    items="sequences", per_item=("pll", "tokens_scored", "per_position", "tokens", "plans", "context"), weight=_weight,
    resumable=lambda params: True,  # each masked copy's log-probability, a float
    partial=_partials,
    whole=lambda params: params.partials,  # a part's partial events would number its sequences from 0
    by_windows=_by_windows,
    join=_joined,
)


@tool(
    check=check,
    cost=cost,
    caps={"sequences": "max_sequences"},
    sequences=("sequences",),
    batch=work.batch,
    spread=work,
    needs={Capability.MASKED_LM},
    partial=PseudoLoglikelihoodPartial,
)
def pseudo_loglikelihood(model: Model, params: PseudoLoglikelihoodParams, ctx: Context) -> PseudoLoglikelihoodResult:
    """Each sequence's pseudo-log-likelihood: every own token masked in turn, its log-probability summed."""
    return work.many(model, [params], [ctx])[0]
