"""`fill_mask`: a masked LM's top-k tokens at each mask in a text (ESM-2: the likeliest residues at a site).

Write the model's mask token (`<mask>` for ESM and RoBERTa, `[MASK]` for
BERT; `GET /readyz` and a refusal name it) where the model should fill in;
each mask is scored in the one pass over the whole text, as the model's own
masked-LM head scores it. Positions count the text's own tokens from 0 (the
special tokens the tokenizer adds left out), so for a protein they are
residue indices.

With `window` (gateway/tools/windows.py) a text longer than the context is
read in windows: each mask from the window where it is farthest from an edge
(`center`), or with its probabilities averaged over every window holding it
(`mean`); only the windows holding a mask run, in passes of at most
`PASS_TOKENS` tokens and `windows.PASS_ROWS` windows, a pass a step (another
job may run between two; a cancel stops the job at the next), each kept in the
job's checkpoint (gateway/checkpoints.py).
"""

from __future__ import annotations

import bisect
from typing import Annotated, Any

import msgspec
import torch

from gateway.cost import JOURNAL_PIECE, JSON_ENTRY, JSON_TOKEN, PY_ENTRY, Cost, Shape
from gateway.errors import ParamError
from gateway.models.anatomy import logits_at
from gateway.tools.base import Capability, Context, Model, tool
from gateway.tools.batching import Chunk, Chunked, WindowItem
from gateway.tools import windows
from gateway.tools.numbers import floats
from gateway.tools.predict import TokenProb
from gateway.tools.windows import WindowIds, WindowParams, WindowPlan

PASS_TOKENS = 16384  # padded tokens in one pass over windows


class FillMaskParams(WindowParams, forbid_unknown_fields=True):
    texts: Annotated[
        list[str],
        msgspec.Meta(min_length=1, description="Texts (or sequences), each with one or more of the model's mask token."),
    ]
    top_k: Annotated[int, msgspec.Meta(ge=1, le=100)] = 5


class MaskFill(msgspec.Struct):
    position: int
    """The mask's index among the text's own tokens (a residue index for a protein)."""
    predictions: list[TokenProb]


class FillMaskResult(msgspec.Struct, omit_defaults=True):
    mask_token: str
    fills: list[list[MaskFill]]
    """Per text, per mask in order: the top-k tokens and their probabilities."""
    plans: list[WindowPlan] | None = None
    """With window: how each text was cut; only windows holding a mask ran."""


def _mask(model: Model) -> str:
    return model.token_text(model.mask_token_id) if model.mask_token_id is not None else ""


def check(model: Model, params: FillMaskParams) -> None:
    if params.top_k > model.vocab_size:
        raise ParamError("top_k", f"must be <= the vocabulary size {model.vocab_size}")
    windows.resolve(params, model.context_length)  # window-only params without a window
    for i, text in enumerate(params.texts):
        if params.window is not None:
            ids = _Windowed(model, params, i).ids
        else:
            with windows.naming_window():
                ids = model.encode(text, f"texts[{i}]")
                model.fit(len(ids), f"texts[{i}]")
        if model.mask_token_id not in ids:
            raise ParamError(f"texts[{i}]", f"has no mask token; write {_mask(model)} where the model should fill in")


class _Windowed:
    """A text read in windows: the windows holding a mask (`rows`), and per mask, in order, the
    (row, column, weight) of each window its probabilities come from."""

    def __init__(self, model: Model, params: FillMaskParams, i: int) -> None:
        framed, sizes, cut = windows.cut(model, params, params.texts[i], f"texts[{i}]")
        self.ids = [*framed.head, *framed.own, *framed.tail]
        self.plan = WindowPlan(windows=cut, stitch=sizes.stitch, window=sizes.window, overlap=sizes.overlap)
        shares = windows.shares(cut, sizes.stitch)
        self.rows: list[WindowIds] = []
        self.windows: list[int] = []  # each row's window in the plan
        self.reads: list[list[tuple[int, int, float]]] = []
        self.positions: list[int] = []  # each mask's among the text's own tokens
        row_of: dict[int, int] = {}
        starts = [share.start for share in shares]
        for q, token in enumerate(framed.own):
            if token != model.mask_token_id:
                continue
            self.positions.append(q)
            reads = []
            w = bisect.bisect_right(starts, q) - 1  # the last share starting at or before q
            while w >= 0 and shares[w].end > q:  # it, and those before it that still hold q
                share = shares[w]
                if w not in row_of:
                    row_of[w] = len(self.rows)
                    self.rows.append(WindowIds(framed, *cut[w]))
                    self.windows.append(w)
                weight = 1.0 if share.weights is None else float(share.weights[q - share.start])
                reads.append((row_of[w], len(framed.head) + q - cut[w][0], weight))
                w -= 1
            self.reads.append(reads)


def cost(model: Model, params: FillMaskParams) -> Cost:
    """The texts' pass (with windows, a pass of windows), the logits at their masks, and the top-k at each."""
    shape = Shape.of(model)
    if params.window is None:
        rows = [model.encode(text) for text in params.texts]
        masks = reads = sum(ids.count(model.mask_token_id) for ids in rows)
    else:
        cut = [_Windowed(model, params, i) for i in range(len(params.texts))]
        rows = [row for text in cut for row in text.rows]
        masks, reads = sum(len(text.reads) for text in cut), sum(len(r) for text in cut for r in text.reads)
    result = masks * params.top_k * (JSON_ENTRY + JSON_TOKEN)
    width = max(len(ids) for ids in rows)
    in_pass = max(1, min(len(rows), PASS_TOKENS // width, windows.PASS_ROWS)) if params.window is not None else len(rows)
    memory = (
        shape.block_bytes(in_pass, width) + shape.states_bytes(in_pass, width, 1) + shape.logits_bytes(reads)
        + masks * params.top_k * PY_ENTRY + result
    )
    return Cost(
        memory=memory, result=result, memory_field="window" if params.window is not None else "texts", result_field="top_k", tokens=width,
        counted=sum(len(ids) for ids in rows),
        # Its checkpoint keeps each row's reads: their weighted probabilities over the vocabulary.
        journal=len(rows) * JOURNAL_PIECE + reads * shape.vocab * 4,
    )


def _plan(model: Model, jobs: list[FillMaskParams], ctxs: Any = None) -> list[Chunk]:
    # Every whole text of every job in the first right-padded pass; the windows holding a mask in
    # passes of at most PASS_TOKENS padded tokens, in order. Each read: a mask's column in its row,
    # its weight (1 without windows, or with `center`), and which of the text's masks it is.
    passes = windows.ReadPasses(PASS_TOKENS)
    for job, params in enumerate(jobs):
        for i, text in enumerate(params.texts):
            if params.window is None:
                ids = model.encode(text)
                ats = [at for at, t in enumerate(ids) if t == model.mask_token_id]
                passes.whole((job, i), ids, ats, [1.0] * len(ats), range(len(ats)))
                continue
            cut = _Windowed(model, params, i)
            per_row: list[list[tuple[int, float, int]]] = [[] for _ in cut.rows]
            for m, mask_reads in enumerate(cut.reads):
                for row, col, weight in mask_reads:
                    per_row[row].append((col, weight, m))
            for w, row, reads in sorted(zip(cut.windows, cut.rows, per_row), key=lambda entry: entry[0]):
                cols, weights, masks = zip(*reads)
                passes.window((job, WindowItem(i, w)), row, cols, weights, masks)
    return passes.chunks()


def _run(model: Model, jobs: list[FillMaskParams], chunk: Chunk) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per item, which of its text's masks each read is, and the read's probabilities by its weight (on the CPU)."""
    input_ids, mask, rows, cols, weights, counts = windows.read_pass(model, chunk)
    # Only the masked positions go through the head: rows × tokens × vocabulary would be large.
    p = logits_at(model, input_ids, mask, rows, cols).softmax(dim=-1)
    weighted = (p * weights[:, None].to(p.dtype)).float().cpu()
    return [(chunk.extra[windows.READS][key][2], part.clone()) for key, part in zip(chunk.items, weighted.split(counts))]


def _assemble(model: Model, jobs: list[FillMaskParams], outputs: dict[Any, Any], ctxs: Any = None) -> list[FillMaskResult]:
    # Each mask's probabilities: the sum of its reads' (a window's each), in the plan's order.
    results = []
    for job, params in enumerate(jobs):
        fills, plans = [], []
        for i, text in enumerate(params.texts):
            if params.window is None:
                ids = model.encode(text)
                own = {at: n for n, at in enumerate(model.own(ids))}
                positions, plan = [own[at] for at, t in enumerate(ids) if t == model.mask_token_id], None
                pieces = [outputs[job, i]]
            else:
                cut = _Windowed(model, params, i)
                positions, plan = cut.positions, cut.plan
                pieces = [outputs[job, WindowItem(i, w)] for w in sorted(cut.windows)]
            probs = torch.zeros(len(positions), pieces[0][1].shape[-1])
            for masks, weighted in pieces:
                probs.index_add_(0, masks, weighted)
            top = probs.topk(params.top_k, dim=-1)
            top_ids, top_p = top.indices.tolist(), floats(top.values)
            texts = model.token_texts(t for ids_ in top_ids for t in ids_)
            fills.append([
                MaskFill(position=position, predictions=[TokenProb(t, texts[t], p) for t, p in zip(top_ids[m], top_p[m])])
                for m, position in enumerate(positions)
            ])
            plans.append(plan)
        results.append(FillMaskResult(mask_token=_mask(model), fills=fills, plans=plans if params.window is not None else None))
    return results


# A pass a step: the whole texts, or a pass of windows holding a mask; each kept in the job's
# checkpoint, so that a job whose engine died goes on from its last pass. A job of several texts is
# cut over a model's idle engines by its texts.
work = Chunked(
    plan=_plan, run=_run, assemble=_assemble, unit="texts", items="texts", per_item=("fills", "plans"), resumable=lambda params: True,
)


@tool(
    check=check,
    cost=cost,
    caps={"texts": "max_prompts"},
    sequences=("texts",),
    batch=work.batch,
    spread=work,
    needs={Capability.MASKED_LM},
)
def fill_mask(model: Model, params: FillMaskParams, ctx: Context) -> FillMaskResult:
    """The top-k tokens a masked LM puts at each mask token of each text."""
    return work.many(model, [params], [ctx])[0]
