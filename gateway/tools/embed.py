"""`embed`: hidden-state embeddings of texts (or protein and DNA sequences), pooled per text or per token.

Embeddings are returned as numpy arrays: clients get JSON numbers in
float32's shortest form, executors send the raw buffers (see `encoding.py`).

`layer` indexes the model's hidden states the way transformers numbers them
(`output_hidden_states=True`): 0 is the token embeddings, i ≥ 1 the output of
the i-th block (the lens tools' layer i − 1), and -1 the last, after the
model's final norm (and, where a model projects its output, OPT-350m, after
that: `dim` is always the length of the vectors returned).

Pooling reads a text's own tokens only: the special tokens the tokenizer adds
around it (`<cls>` and `<eos>` for ESM and BERT, a BOS for Llama) are left out
of `mean`, `last` and `per_token`, so a protein's mean embedding is the mean
over its residues. `cls` reads the first token, `<cls>`, where an encoder
gathers the whole sequence.

Texts are sorted by length into chunks of at most `EMBED_BATCH` texts and
`EMBED_TOKENS` padded tokens (padding stays small, and so does one pass's
memory) and run chunk by chunk, or on every device at once (`--devices`) for
one big job; each chunk needs about its rows × its longest text's tokens ×
hidden size × (layers + 1) × 4 bytes for the hidden states it returns, plus
the attention of one layer (`cost` prices the largest before the job is queued).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np
import torch

from gateway.cost import JSON_FLOAT, JSON_TOKEN, Cost, Shape
from gateway.errors import ParamError
from gateway.tools.base import Capability, Context, Model, right_padded, tool
from gateway.tools import windows
from gateway.tools.batching import Chunk, Chunked, WindowItem, chunk_peak, sorted_chunks
from gateway.tools.windows import Framed, Share, Sizes, Stitch, WindowParams, WindowPlan

EMBED_BATCH = 16  # texts per forward pass at most
EMBED_TOKENS = 16384  # padded tokens per forward pass at most (a longer text runs alone)


class Pooling(str, enum.Enum):
    MEAN = "mean"
    CLS = "cls"
    LAST = "last"
    PER_TOKEN = "per_token"
    NONE = "none"  # the older name of per_token


class EmbedParams(WindowParams, forbid_unknown_fields=True):
    texts: Annotated[list[str], msgspec.Meta(min_length=1, description="Texts, or protein or DNA sequences.")]
    layer: Annotated[
        int,
        msgspec.Meta(description="Hidden state index: 0 = token embeddings, i = after the i-th block, -1 = the last (after the final norm)."),
    ] = -1
    pooling: Annotated[
        Pooling,
        msgspec.Meta(
            description=(
                "mean (the default): the average over the text's own tokens, the special tokens the tokenizer adds "
                "(<cls>, <eos>, BOS) left out: for a protein, the mean over its residues. "
                "cls: the first token's vector (<cls>; encoders only). last: the text's last own token "
                "(for a causal model, the one that has seen the whole text). "
                "per_token: one vector per own token (a residue), with the tokens. none: the older name of per_token."
            )
        ),
    ] = Pooling.MEAN
    normalize: Annotated[bool, msgspec.Meta(description="Scale each vector to unit length.")] = False
    precision: Annotated[
        int, msgspec.Meta(ge=0, le=10, description="Round to this many decimals. Default: float32's shortest exact form.")
    ] | None = None


class EmbedResult(msgspec.Struct, omit_defaults=True):
    dim: int
    """The length of every vector returned."""
    layer: int
    pooling: Pooling
    embeddings: Annotated[
        list[Any],
        msgspec.Meta(
            description="Per text: a vector (mean, cls, last) or a list of per-token vectors (per_token).",
            extra_json_schema={
                "items": {
                    "anyOf": [
                        {"type": "array", "items": {"type": "number"}},
                        {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                    ]
                }
            },
        ),
    ]
    tokens: list[list[str]] | None = None
    """With pooling per_token: each text's own tokens, one per vector."""
    plans: list[WindowPlan] | None = None
    """With window: how each text was cut and stitched (gateway/tools/windows.py)."""
    context: list[Any] | None = None
    """With window and pooling per_token: per text, per own token, the fewest tokens of context it had
    on its left and on its right, [left, right]."""


def _array(t: torch.Tensor, precision: int | None) -> np.ndarray:
    """float32 as computed; float64 rounded to `precision` decimals when asked."""
    array = t.detach().to("cpu", torch.float32).numpy()
    return array if precision is None else np.round(array.astype(np.float64), precision)


def _n_states(model: Model) -> int:
    return model.memo["n_states"]


def _per_token(pooling: Pooling) -> bool:
    return pooling in (Pooling.PER_TOKEN, Pooling.NONE)


def _framed(model: Model, text: str, field: str) -> Framed:
    ids = model.encode(text, field, bounded=False)
    return Framed.of(ids, model.own(ids), field)


def _sizes(model: Model, params: EmbedParams, framed: Framed) -> Sizes | None:
    return windows.resolve(params, model.context_length - framed.around, causal=not model.bidirectional)


def check(model: Model, params: EmbedParams) -> None:
    if params.window is not None:
        _check_windows(model, params)
        return
    windows.resolve(params, model.context_length)  # window-only params without a window
    with windows.naming_window():
        _check(model, params)


def _check_windows(model: Model, params: EmbedParams) -> None:
    _check_layer(model, params)
    if params.pooling is Pooling.CLS:
        raise ParamError("pooling", "cls reads one window's first token; with windows use mean, last or per_token")
    for i, text in enumerate(params.texts):
        if not text:
            raise ParamError(f"texts[{i}]", "must not be empty")
        framed = _framed(model, text, f"texts[{i}]")
        sizes = _sizes(model, params, framed)
        assert sizes is not None
        windows.plan(len(framed.own), sizes)  # a plan of too many windows is refused here


def _check_layer(model: Model, params: EmbedParams) -> None:
    n = _n_states(model)
    if not -n <= params.layer < n:
        raise ParamError("layer", f"layer {params.layer} is out of range; the model has {n} hidden states (0..{n - 1}, or -{n}..-1)")
    if params.pooling is Pooling.CLS and not model.bidirectional:
        raise ParamError(
            "pooling",
            "cls reads the first token, which in a causal model sees nothing after it; use mean or last",
        )


def _check(model: Model, params: EmbedParams) -> None:
    _check_layer(model, params)
    for i, text in enumerate(params.texts):
        if not text:
            raise ParamError(f"texts[{i}]", "must not be empty")
        ids = model.encode(text, f"texts[{i}]")
        model.fit(len(ids), f"texts[{i}]")
        if params.pooling is not Pooling.CLS and not model.own(ids):
            raise ParamError(f"texts[{i}]", "has no tokens of its own, only the tokenizer's special tokens")


def cost(model: Model, params: EmbedParams) -> Cost:
    """The largest chunk's pass with every hidden state it returns, then the vectors kept and their JSON.
    With windows the passes are the windows', and a per-token result is held twice at the end (the
    windows' rows and the stitched array) with each position's context beside it in the JSON."""
    shape = Shape.of(model)
    per_token = _per_token(params.pooling)
    if params.window is None:
        lengths = [len(model.encode(text)) for text in params.texts]
        passes, positions, held = lengths, sum(lengths) if per_token else len(lengths), 1
    else:
        passes, n_own = [], []
        for i, text in enumerate(params.texts):
            framed = _framed(model, text, f"texts[{i}]")
            sizes = _sizes(model, params, framed)
            assert sizes is not None
            passes += [end - start + framed.around for start, end in windows.plan(len(framed.own), sizes)]
            n_own.append(len(framed.own))
        positions, held = sum(n_own) if per_token else len(n_own), 2 if per_token else 1
    n_states = _n_states(model)
    peak = chunk_peak(passes, EMBED_BATCH, EMBED_TOKENS, lambda rows, width: shape.pass_bytes(rows, width, states=n_states))
    per_vector = shape.hidden * JSON_FLOAT + (JSON_TOKEN if per_token else 0)
    if params.window is not None and per_token:
        per_vector += 2 * JSON_FLOAT  # its [left, right] context
    result = positions * per_vector
    return Cost(
        memory=peak + held * positions * shape.hidden * 4 + result,
        result=result,
        memory_field="window" if params.window is not None else "texts",
        result_field="pooling" if per_token else "texts",
        tokens=max(passes),
    )


@dataclass(frozen=True)
class _InWindow:
    """A window's row of a chunk: where the text's own tokens begin in it, its share of the stitched
    text, and the text's length in own tokens."""

    head: int
    share: Share
    n: int


def _plan(model: Model, jobs: list[EmbedParams], by_length: bool = True) -> list[Chunk]:
    items: list[tuple[Any, list[int]]] = []
    placed: dict[Any, _InWindow] = {}
    for job, params in enumerate(jobs):
        for i, text in enumerate(params.texts):
            if params.window is None:
                items.append(((job, i), model.encode(text)))
                continue
            framed = _framed(model, text, f"texts[{i}]")
            sizes = _sizes(model, params, framed)
            assert sizes is not None
            cut = windows.plan(len(framed.own), sizes)
            for w, ((start, end), share) in enumerate(zip(cut, windows.shares(cut, sizes.stitch))):
                key = (job, WindowItem(i, w))
                items.append((key, framed.window(start, end)))
                placed[key] = _InWindow(len(framed.head), share, len(framed.own))
    chunks = sorted_chunks(items, EMBED_BATCH, max_tokens=EMBED_TOKENS, by_length=by_length)
    for chunk in chunks:
        chunk.extra["windows"] = {key: placed[key] for key in chunk.items if key in placed}
    return chunks


def _run(model: Model, jobs: list[EmbedParams], chunk: Chunk) -> list[Any]:
    """Each text's vector(s); with per_token pooling, (vectors, its own token ids) for the tokens' texts.

    The rows of the chunk that ask for the same (layer, pooling, normalize, precision), one job's
    usually, are pooled together: their own tokens gathered in one index, and their vectors moved
    off the device in one copy.
    """
    n_states = _n_states(model)
    input_ids, mask = right_padded(model, chunk.data)
    states = model.hidden_states(input_ids, mask)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for row, (job, _) in enumerate(chunk.items):
        params = jobs[job]
        # Pooling(…): params built in Python (not decoded) may hold the plain string.
        pooling = Pooling(params.pooling)
        pooling = Pooling.PER_TOKEN if _per_token(pooling) else pooling
        groups.setdefault((params.layer % n_states, pooling, params.normalize, params.precision), []).append(row)
    out: list[Any] = [None] * len(chunk.items)
    owns: dict[int, list[int]] = {}  # each pooled row's own token positions (CLS reads none)
    in_windows = chunk.extra.get("windows", {})
    for row, key in enumerate(chunk.items):
        if key in in_windows:
            params = jobs[key[0]]
            out[row] = _window_share(states[params.layer % n_states][row], chunk.data[row], in_windows[key], Pooling(params.pooling))
    for (layer, pooling, normalize, precision), rows in groups.items():
        rows = [row for row in rows if chunk.items[row] not in in_windows]
        if not rows:
            continue
        device = states[layer].device
        if pooling is Pooling.CLS:
            vectors = states[layer][torch.tensor(rows, device=device), 0].float()
        else:
            owns.update((row, model.own(chunk.data[row])) for row in rows)
            counts = [len(owns[row]) for row in rows]
            index = (
                torch.tensor([row for row, n in zip(rows, counts) for _ in range(n)], device=device),
                torch.tensor([at for row in rows for at in owns[row]], device=device),
            )
            vectors = states[layer][index].float()  # every row's own tokens, row after row
            if pooling is Pooling.MEAN:
                vectors = torch.stack([own.mean(0) for own in vectors.split(counts)])
            elif pooling is Pooling.LAST:
                vectors = vectors[torch.tensor(counts, device=device).cumsum(0) - 1]
        if normalize:
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
        array = _array(vectors, precision)
        if pooling is Pooling.PER_TOKEN:
            for row, part in zip(rows, np.split(array, np.cumsum(counts)[:-1])):
                out[row] = (part, [chunk.data[row][at] for at in owns[row]])
        else:
            for row, vector in zip(rows, array):
                out[row] = vector
    return out


@dataclass(frozen=True)
class _Shared:
    """What one window gives its text: positions [start, end) of it; `rows` its (weighted) states
    there (per_token), their sum (mean), or the text's last position's (last; None if not its);
    `ids` the tokens at those positions."""

    start: int
    end: int
    rows: np.ndarray | None
    ids: list[int]


def _window_share(states: torch.Tensor, ids: list[int], at: _InWindow, pooling: Pooling) -> _Shared:
    """One window row's share of its text, off the device: only what the stitched result needs of it."""
    share = at.share
    begin = at.head + share.offset
    rows = states[begin : begin + share.end - share.start].float()
    if share.weights is not None:
        rows = rows * torch.from_numpy(share.weights).to(rows.device)[:, None]
    own = ids[begin : begin + share.end - share.start]
    if pooling is Pooling.MEAN:
        return _Shared(share.start, share.end, _array(rows.sum(0), None), [])
    if pooling is Pooling.LAST:
        return _Shared(share.start, share.end, _array(rows[-1], None) if share.end == at.n else None, [])
    return _Shared(share.start, share.end, _array(rows, None), own)


def _stitched(params: EmbedParams, shared: list[_Shared], precision: int | None) -> tuple[Any, list[int]]:
    """A windowed text's vector(s) from its windows' shares, and (per_token) its own token ids."""
    n = max(part.end for part in shared)
    pooling = Pooling(params.pooling)
    ids: list[int] = []
    if pooling is Pooling.MEAN:
        vector = torch.from_numpy(np.sum([part.rows for part in shared], axis=0) / n)
    elif pooling is Pooling.LAST:
        vector = torch.from_numpy(np.sum([part.rows for part in shared if part.rows is not None], axis=0))
    else:
        width = next(part.rows.shape[-1] for part in shared if part.rows is not None)
        vector = torch.zeros((n, width))
        ids = [0] * n
        for part in shared:
            assert part.rows is not None
            vector[part.start : part.end] += torch.from_numpy(part.rows)
            ids[part.start : part.end] = part.ids
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return _array(vector, precision), ids


def _assemble(model: Model, jobs: list[EmbedParams], outputs: dict[Any, Any]) -> list[EmbedResult]:
    shared: dict[tuple[int, int], list[_Shared]] = {}
    for (job, item), output in outputs.items():
        if isinstance(item, tuple):
            shared.setdefault((job, item[0]), []).append(output)
    for key, parts in shared.items():
        outputs[key] = _stitched(jobs[key[0]], sorted(parts, key=lambda part: part.start), jobs[key[0]].precision)
        if not _per_token(jobs[key[0]].pooling):
            outputs[key] = outputs[key][0]
    texts = model.token_texts(t for key, output in outputs.items() if not isinstance(key[1], tuple) and isinstance(output, tuple) for t in output[1])
    results = []
    for job, params in enumerate(jobs):
        vectors = [outputs[job, i] for i in range(len(params.texts))]
        tokens = None
        if _per_token(params.pooling):
            tokens = [[texts[t] for t in ids] for _, ids in vectors]
            vectors = [v for v, _ in vectors]
        plans = context = None
        if params.window is not None:
            plans, context = _plans(model, params)
        results.append(
            EmbedResult(
                dim=int(vectors[0].shape[-1]),
                layer=params.layer % _n_states(model),
                pooling=params.pooling,
                embeddings=vectors,
                tokens=tokens,
                plans=plans,
                context=context if _per_token(params.pooling) else None,
            )
        )
    return results


def _plans(model: Model, params: EmbedParams) -> tuple[list[WindowPlan], list[Any]]:
    """Each text's window plan, and each own token's least context on each side."""
    plans, context = [], []
    for i, text in enumerate(params.texts):
        framed = _framed(model, text, f"texts[{i}]")
        sizes = _sizes(model, params, framed)
        assert sizes is not None
        cut = windows.plan(len(framed.own), sizes)
        plans.append(WindowPlan(windows=cut, stitch=sizes.stitch, window=sizes.window, overlap=sizes.overlap))
        context.append(windows.context(cut, sizes.stitch))
    return plans, context


# Per text, a pass over its tokens: its length is its share of the work.
work = Chunked(
    plan=_plan, run=_run, assemble=_assemble, unit="texts", items="texts", per_item=("embeddings", "tokens", "plans", "context")
)


@tool(
    check=check,
    cost=cost,
    caps={"texts": "max_sequences"},
    sequences=("texts",),
    batch=work.batch,
    spread=work,
    needs={Capability.HIDDEN_STATES},
)
def embed(model: Model, params: EmbedParams, ctx: Context) -> EmbedResult:
    """Hidden-state embeddings of each text at one layer: mean over its own tokens, cls, last, or per token."""
    return work.many(model, [params], [ctx])[0]
