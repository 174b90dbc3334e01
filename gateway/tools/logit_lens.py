"""The logit lens: what the model would predict if it stopped after each layer.

Each layer's output (the residual stream) goes through the model's own final
norm and unembedding (see `anatomy.py`), so the last layer's lens is exactly
the model's prediction. Three tools share the one computation:

- `logit_lens`: top-k tokens, entropy and tracked tokens' probabilities, layer × position;
- `lens_line`: one token's probability, rank or the entropy across layers at one position;
- `lens_grid`: a statistic at every layer × position, as a chart-ready heatmap.

One forward pass records the chosen layers, and stops after the deepest of
them; each is put through the final norm as its block finishes (progress is
reported per layer then). The rows (layer, position) then go through the
head together, as one matmul per chunk of at most `READOUT_FLOATS` logits, so
memory stays bounded whatever the vocabulary, and each chunk is reduced (top
k, entropy, a statistic) before the next; the results are turned into numbers
and token texts once, at the end. Cancellation is checked after every block of
the forward pass and between chunks.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterator, Sequence
from typing import Annotated

import msgspec
import torch

from gateway.cost import JSON_ENTRY, JSON_FLOAT, JSON_FRAME, JSON_TOKEN, PY_ENTRY, PY_FLOAT, Cost, Shape
from gateway.errors import ParamError
from gateway.models.anatomy import anatomy, readout_rows, resolve_layers, resolve_positions, single_token
from gateway.tools.base import Capability, Context, Model, tool
from gateway.tools.numbers import floats
from gateway.tools.predict import TokenProb

Prompt = Annotated[str, msgspec.Meta(min_length=1, description="The text to look through.")]
# Caps on the lists themselves; what they multiply into (layers × positions × top_k) is priced
# against --max-result-bytes before the job is queued (gateway/cost.py). A layer named twice is
# computed once and its rows repeated.
MAX_LAYERS = 512
MAX_POSITIONS = 8192
Layers = Annotated[
    list[int],
    msgspec.Meta(
        min_length=1,
        max_length=MAX_LAYERS,
        description="Decoder layers by index (0 = first block's output; negatives count from the end). Default: all.",
    ),
]
Positions = Annotated[
    list[int],
    msgspec.Meta(
        min_length=1,
        max_length=MAX_POSITIONS,
        description="Token positions (negatives count from the end). Default: all.",
    ),
]


class Stat(str, enum.Enum):
    PROBABILITY = "probability"
    RANK = "rank"
    ENTROPY = "entropy"


class LogitLensParams(msgspec.Struct, forbid_unknown_fields=True):
    prompt: Prompt
    top_k: Annotated[int, msgspec.Meta(ge=1, le=100)] = 5
    include_entropy: bool = True
    layers: Layers | None = None
    positions: Positions | None = None
    track: Annotated[
        list[str], msgspec.Meta(max_length=32, description="Single tokens whose probability to follow.")
    ] | None = None


class LogitLensResult(msgspec.Struct, omit_defaults=True):
    tokens: list[str]
    """The prompt's tokens, every one."""
    positions: list[int]
    layers: list[int]
    topk: list[list[list[TokenProb]]]
    """Layer × position × k."""
    entropy: list[list[float]] | None = None
    """Layer × position, in nats."""
    tracked: dict[str, list[list[float]]] | None = None
    """Each tracked token's probability, layer × position."""


class LensLineParams(msgspec.Struct, forbid_unknown_fields=True):
    prompt: Prompt
    stat: Stat = Stat.PROBABILITY
    token: Annotated[
        str,
        msgspec.Meta(description="The single token to follow. Default: the model's own prediction at the position."),
    ] | None = None
    position: Annotated[int, msgspec.Meta(description="Default: the last token.")] = -1
    layers: Layers | None = None


class LensLineResult(msgspec.Struct):
    stat: Stat
    token: str
    position: int
    layers: list[int]
    """The x axis."""
    values: list[float]
    """The y axis: the statistic at each layer (rank 1 = most likely)."""


class LensGridParams(msgspec.Struct, forbid_unknown_fields=True):
    prompt: Prompt
    stat: Stat = Stat.PROBABILITY
    layers: Layers | None = None
    positions: Positions | None = None


class LensGridResult(msgspec.Struct):
    stat: Stat
    layers: list[int]
    """Rows."""
    positions: list[int]
    """Columns."""
    tokens: list[str]
    """The prompt's token at each column."""
    targets: list[str]
    """Each column's top token: the model's final prediction there, whose probability or rank the cells show."""
    values: list[list[float]]
    """Layer × position: the target's probability or rank, or the entropy, at that layer."""
    top_tokens: list[list[str]]
    """Layer × position: that layer's own most likely token, for labels and hover."""


def residuals(
    model: Model, ids: list[int], layers: Sequence[int], positions: Sequence[int], ctx: Context, counted: Sequence[int]
) -> torch.Tensor:
    """Each layer's residual stream at `positions`, through the readout's final norm: rows (layer,
    position), layer-major. One forward pass, stopped after the deepest layer; each layer is
    normed as its block finishes, and progress counts the layers of `counted` read so far."""
    body = anatomy(model)
    index = torch.tensor(positions, device=model.device)
    ordered = sorted(counted)

    def keep(layer: int, hidden: torch.Tensor) -> torch.Tensor:
        prepared = body.prepared(hidden[0].index_select(0, index))
        ctx.progress(bisect.bisect_right(ordered, layer), len(counted), "layers")
        return prepared

    input_ids = torch.tensor([ids], device=model.device)
    with body.capture(layers, check=ctx.raise_if_cancelled, keep=keep, stop=True) as captured:
        model.logits(input_ids, torch.ones_like(input_ids))
    return torch.cat([captured[layer] for layer in layers])


def lens(
    model: Model, ids: list[int], layers: Sequence[int], positions: Sequence[int], ctx: Context,
    counted: Sequence[int],
) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, float32 probabilities) of the rows (layer, position), layer-major, a chunk at a time.

    `layers` are distinct; progress counts the layers asked for, `counted` (repeats included). The rows go through the head as one matmul per chunk of at most
    READOUT_FLOATS logits, so memory stays bounded whatever the vocabulary and prompt.
    """
    body = anatomy(model)
    hidden = residuals(model, ids, layers, positions, ctx, counted)
    step = readout_rows(model)
    for start in range(0, hidden.shape[0], step):
        ctx.raise_if_cancelled()
        yield start, body.unembed(hidden[start : start + step]).softmax(dim=-1)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    return torch.special.entr(probs).sum(dim=-1)


def rank(probs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """1-based rank of `token_ids[i]` in row i of `probs` (ties share the better rank)."""
    target = probs.gather(-1, token_ids[:, None])
    return (probs > target).sum(dim=-1) + 1


def _rows(layers: list[int], distinct: list[int], n_positions: int) -> torch.Tensor:
    """Where each of `layers` (repeats allowed) has its rows among those of `distinct`: layer × position."""
    at = {layer: i for i, layer in enumerate(distinct)}
    return torch.tensor([[at[layer] * n_positions + j for j in range(n_positions)] for layer in layers])


def _prepare(model: Model, prompt: str, layers: list[int] | None, positions: list[int] | None):
    ids = model.encode(prompt, "prompt")
    model.fit(len(ids), "prompt")
    return ids, resolve_layers(model, layers), resolve_positions(len(ids), positions)


def _lens_cost(
    model: Model, prompt: str, layers: list[int] | None, positions: list[int] | None, cell: int, kept: int,
    field: str | None = None, tokens: bool = False,
) -> Cost:
    """A lens pass: the block's working set over the prompt, the residuals kept at every layer × position
    read, one readout chunk's probabilities, and `kept` bytes (and `cell` bytes of JSON) per cell.
    The field to shrink is `field`, else the longer of layers and positions."""
    shape = Shape.of(model)
    ids, layers_read, positions_read = _prepare(model, prompt, layers, positions)
    cells = len(layers_read) * len(positions_read)
    field = field or ("layers" if len(layers_read) > len(positions_read) else "positions")
    result = JSON_FRAME + cells * cell + (len(layers_read) + len(positions_read)) * 8 + (len(ids) * JSON_TOKEN if tokens else 0)
    memory = (
        shape.block_bytes(1, len(ids))
        + cells * shape.hidden * 4
        + shape.logits_bytes(min(cells, readout_rows(model)))
        + cells * kept
        + result
    )
    return Cost(memory=memory, result=result, memory_field="prompt", result_field=field, tokens=len(ids))


def cost_lens(model: Model, params: LogitLensParams) -> Cost:
    tracked = len(params.track or [])
    cell = min(params.top_k, model.vocab_size) * (JSON_ENTRY + JSON_TOKEN) + (JSON_FLOAT if params.include_entropy else 0) + tracked * JSON_FLOAT
    kept = params.top_k * (12 + PY_ENTRY) + (1 + tracked) * (4 + PY_FLOAT)
    return _lens_cost(model, params.prompt, params.layers, params.positions, cell, kept, "top_k" if params.top_k > 10 else None, tokens=True)


def cost_line(model: Model, params: LensLineParams) -> Cost:
    return _lens_cost(model, params.prompt, params.layers, [params.position], JSON_FLOAT, 12 + PY_FLOAT, "layers")


def cost_grid(model: Model, params: LensGridParams) -> Cost:
    return _lens_cost(model, params.prompt, params.layers, params.positions, JSON_FLOAT + JSON_TOKEN, 12 + 2 * PY_FLOAT)


def check_lens(model: Model, params: LogitLensParams) -> None:
    _prepare(model, params.prompt, params.layers, params.positions)
    for i, text in enumerate(params.track or []):
        single_token(model, text, f"track[{i}]")


@tool(check=check_lens, cost=cost_lens, needs={Capability.LAYERS}, sequences=("prompt",))
def logit_lens(model: Model, params: LogitLensParams, ctx: Context) -> LogitLensResult:
    """Each layer's residual stream through the final norm and unembedding: top tokens, entropy, tracked tokens."""
    ids, layers, positions = _prepare(model, params.prompt, params.layers, params.positions)
    tracked_ids = [single_token(model, t, f"track[{i}]") for i, t in enumerate(params.track or [])]
    top_k = min(params.top_k, model.vocab_size)
    distinct = list(dict.fromkeys(layers))
    values, indices, entropies, tracked = [], [], [], []
    for _, probs in lens(model, ids, distinct, positions, ctx, counted=layers):
        top = probs.topk(top_k, dim=-1)
        values.append(top.values)
        indices.append(top.indices)
        if params.include_entropy:
            entropies.append(entropy(probs))
        if tracked_ids:
            tracked.append(probs[:, tracked_ids])
    rows = _rows(layers, distinct, len(positions)).to(model.device)  # layer × position
    top_ids = torch.cat(indices)[rows].tolist()
    top_p = floats(torch.cat(values)[rows])
    texts = model.token_texts([*ids, *(i for layer in top_ids for cell in layer for i in cell)])
    return LogitLensResult(
        tokens=[texts[i] for i in ids],
        positions=positions,
        layers=layers,
        topk=[
            [[TokenProb(i, texts[i], p) for i, p in zip(cell_ids, cell_p)] for cell_ids, cell_p in zip(layer_ids, layer_p)]
            for layer_ids, layer_p in zip(top_ids, top_p)
        ],
        entropy=floats(torch.cat(entropies)[rows]) if params.include_entropy else None,
        # Each tracked token's probability, token × layer × position.
        tracked=dict(zip(params.track, floats(torch.cat(tracked)[rows].permute(2, 0, 1)))) if params.track else None,
    )


def _position(n_tokens: int, position: int) -> int:
    """lens_line's one position, negatives from the end; a 422 naming `position` (a scalar, not a list)."""
    if not -n_tokens <= position < n_tokens:
        raise ParamError("position", f"position {position} is past the prompt, which has {n_tokens} tokens")
    return position % n_tokens


def check_line(model: Model, params: LensLineParams) -> None:
    ids, _, _ = _prepare(model, params.prompt, params.layers, None)
    _position(len(ids), params.position)
    if params.token is not None:
        single_token(model, params.token, "token")


@tool(check=check_line, cost=cost_line, needs={Capability.LAYERS}, sequences=("prompt",))
def lens_line(model: Model, params: LensLineParams, ctx: Context) -> LensLineResult:
    """One token's probability or rank, or the entropy, across layers at one position: a line chart."""
    ids, layers, _ = _prepare(model, params.prompt, params.layers, None)
    position = _position(len(ids), params.position)
    given = None if params.token is None else torch.tensor([single_token(model, params.token, "token")], device=model.device)
    values, _, targets = _lens_stats(model, ids, layers, [position], params.stat, given, ctx)
    token = int(targets[0])
    return LensLineResult(params.stat, model.token_text(token), position, layers, [row[0] for row in floats(values)])


def check_grid(model: Model, params: LensGridParams) -> None:
    _prepare(model, params.prompt, params.layers, params.positions)


@tool(check=check_grid, cost=cost_grid, needs={Capability.LAYERS}, sequences=("prompt",))
def lens_grid(model: Model, params: LensGridParams, ctx: Context) -> LensGridResult:
    """A statistic at every layer × position, with each layer's top token: a heatmap."""
    ids, layers, positions = _prepare(model, params.prompt, params.layers, params.positions)
    values, tops, targets = _lens_stats(model, ids, layers, positions, params.stat, None, ctx)
    top_ids, target_ids = tops.tolist(), targets.tolist()
    texts = model.token_texts([*(ids[p] for p in positions), *target_ids, *(i for row in top_ids for i in row)])
    return LensGridResult(
        stat=params.stat,
        layers=layers,
        positions=positions,
        tokens=[texts[ids[p]] for p in positions],
        targets=[texts[i] for i in target_ids],
        values=floats(values),
        top_tokens=[[texts[i] for i in row] for row in top_ids],
    )


def _lens_stats(
    model: Model, ids: list[int], layers: list[int], positions: list[int], stat: Stat,
    token_ids: torch.Tensor | None, ctx: Context,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The statistic and the top token at each layer × position, and the token each column follows:
    `token_ids` (one per position), or where None the model's own prediction there, the last layer's
    top token, read in the same pass (the last layer's rows go first, so every row has its target)."""
    last = anatomy(model).n_layers - 1
    distinct = list(dict.fromkeys(layers))
    if token_ids is None:
        distinct = [last, *(layer for layer in distinct if layer != last)]
        targets = torch.empty(len(positions), dtype=torch.long, device=model.device)
    else:
        targets = token_ids
    n = len(positions)
    values = torch.empty(len(distinct) * n, device=model.device)
    tops = torch.empty(len(distinct) * n, dtype=torch.long, device=model.device)
    for start, probs in lens(model, ids, distinct, positions, ctx, counted=layers):
        end = start + probs.shape[0]
        top = probs.argmax(dim=-1)
        if token_ids is None and start < n:
            targets[start : min(end, n)] = top[: n - start]
        columns = torch.arange(start, end, device=model.device) % n
        values[start:end] = _stat(stat, probs, targets[columns])
        tops[start:end] = top
    rows = _rows(layers, distinct, n).to(model.device)
    return values[rows], tops[rows], targets


def _stat(stat: Stat, probs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    if stat is Stat.ENTROPY:
        return entropy(probs)
    if stat is Stat.RANK:
        return rank(probs, token_ids).float()
    return probs.gather(-1, token_ids[:, None])[:, 0]
