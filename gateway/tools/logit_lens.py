"""The logit lens: what the model would predict if it stopped after each layer.

Each layer's output (the residual stream) goes through the model's own final
norm and unembedding (see `anatomy.py`), so the last layer's lens is exactly
the model's prediction. Three tools share the one computation:

- `logit_lens`: top-k tokens, entropy and tracked tokens' probabilities, layer × position;
- `lens_line`: one token's probability, rank or the entropy across layers at one position;
- `lens_grid`: a statistic at every layer × position, as a chart-ready heatmap.

One forward pass records the chosen layers; then each layer is unembedded and
reduced before the next, so memory stays at one layer's distributions
(positions × vocabulary). Cancellation is checked after every block of the
forward pass and between layers; progress is reported per layer.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from typing import Annotated

import msgspec
import torch

from gateway.errors import ParamError
from gateway.tools.anatomy import anatomy, resolve_layers, resolve_positions, single_token
from gateway.tools.base import Capability, Context, Model, tool
from gateway.tools.numbers import floats
from gateway.tools.predict import TokenProb

Prompt = Annotated[str, msgspec.Meta(min_length=1, description="The text to look through.")]
Layers = Annotated[
    list[int],
    msgspec.Meta(
        min_length=1,
        description="Decoder layers by index (0 = first block's output; negatives count from the end). Default: all.",
    ),
]
Positions = Annotated[
    list[int],
    msgspec.Meta(min_length=1, description="Token positions (negatives count from the end). Default: all."),
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


def lens(
    model: Model, ids: list[int], layers: Sequence[int], positions: Sequence[int], ctx: Context
) -> Iterator[tuple[int, torch.Tensor]]:
    """(layer, probabilities [positions × vocab] in float32) for each layer, in order."""
    body = anatomy(model)
    input_ids = torch.tensor([ids], device=model.device)
    with body.capture(layers, check=ctx.raise_if_cancelled) as captured:
        model.logits(input_ids, torch.ones_like(input_ids))
    index = torch.tensor(positions, device=model.device)
    for done, layer in enumerate(layers, 1):
        ctx.raise_if_cancelled()
        hidden = captured[layer][0].index_select(0, index)
        if layer not in layers[done:]:  # a layer may be asked for twice (`[1, -1]`)
            del captured[layer]
        yield layer, body.logits(hidden).softmax(dim=-1)
        ctx.progress(done, len(layers), "layers")


def entropy(probs: torch.Tensor) -> torch.Tensor:
    return -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)


def rank(probs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """1-based rank of `token_ids[i]` in row i of `probs` (ties share the better rank)."""
    target = probs.gather(-1, token_ids[:, None])
    return (probs > target).sum(dim=-1) + 1


def _prepare(model: Model, prompt: str, layers: list[int] | None, positions: list[int] | None):
    ids = model.encode(prompt)
    model.fit(len(ids), "prompt")
    return ids, resolve_layers(model, layers), resolve_positions(len(ids), positions)


def check_lens(model: Model, params: LogitLensParams) -> None:
    _prepare(model, params.prompt, params.layers, params.positions)
    for i, text in enumerate(params.track or []):
        single_token(model, text, f"track[{i}]")


@tool(check=check_lens, needs={Capability.LAYERS}, sequences=("prompt",))
def logit_lens(model: Model, params: LogitLensParams, ctx: Context) -> LogitLensResult:
    """Each layer's residual stream through the final norm and unembedding: top tokens, entropy, tracked tokens."""
    ids, layers, positions = _prepare(model, params.prompt, params.layers, params.positions)
    tracked_ids = [single_token(model, t, f"track[{i}]") for i, t in enumerate(params.track or [])]
    top_k = min(params.top_k, model.vocab_size)
    topk, entropies, tracked = [], [], []
    for _, probs in lens(model, ids, layers, positions, ctx):
        top = probs.topk(top_k, dim=-1)
        topk.append(
            [
                [TokenProb(i, model.token_text(i), p) for i, p in zip(row_ids, row_p)]
                for row_ids, row_p in zip(top.indices.tolist(), floats(top.values))
            ]
        )
        if params.include_entropy:
            entropies.append(floats(entropy(probs)))
        if tracked_ids:
            tracked.append(floats(probs[:, tracked_ids].T))  # token × position
    return LogitLensResult(
        tokens=[model.token_text(i) for i in ids],
        positions=positions,
        layers=layers,
        topk=topk,
        entropy=entropies if params.include_entropy else None,
        tracked={
            text: [per_layer[k] for per_layer in tracked] for k, text in enumerate(params.track or [])
        }
        if params.track
        else None,
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


@tool(check=check_line, needs={Capability.LAYERS}, sequences=("prompt",))
def lens_line(model: Model, params: LensLineParams, ctx: Context) -> LensLineResult:
    """One token's probability or rank, or the entropy, across layers at one position: a line chart."""
    ids, layers, _ = _prepare(model, params.prompt, params.layers, None)
    position = _position(len(ids), params.position)
    if params.token is not None:
        token = single_token(model, params.token, "token")
    else:
        token = int(_final_prediction(model, ids, [position])[0])
    values = []
    for _, probs in lens(model, ids, layers, [position], ctx):
        values.append(_stat(params.stat, probs, torch.tensor([token], device=probs.device))[0])
    return LensLineResult(params.stat, model.token_text(token), position, layers, values)


def check_grid(model: Model, params: LensGridParams) -> None:
    _prepare(model, params.prompt, params.layers, params.positions)


@tool(check=check_grid, needs={Capability.LAYERS}, sequences=("prompt",))
def lens_grid(model: Model, params: LensGridParams, ctx: Context) -> LensGridResult:
    """A statistic at every layer × position, with each layer's top token: a heatmap."""
    ids, layers, positions = _prepare(model, params.prompt, params.layers, params.positions)
    targets = _final_prediction(model, ids, positions)
    values, top_tokens = [], []
    for _, probs in lens(model, ids, layers, positions, ctx):
        values.append(_stat(params.stat, probs, targets))
        top_tokens.append([model.token_text(i) for i in probs.argmax(dim=-1).tolist()])
    return LensGridResult(
        stat=params.stat,
        layers=layers,
        positions=positions,
        tokens=[model.token_text(ids[p]) for p in positions],
        targets=[model.token_text(i) for i in targets.tolist()],
        values=values,
        top_tokens=top_tokens,
    )


def _final_prediction(model: Model, ids: list[int], positions: Sequence[int]) -> torch.Tensor:
    """The model's own most likely token at each position (the next one, for a causal model)."""
    input_ids = torch.tensor([ids], device=model.device)
    logits = model.logits(input_ids, torch.ones_like(input_ids))[0]
    return logits[list(positions)].float().argmax(dim=-1)


def _stat(stat: Stat, probs: torch.Tensor, token_ids: torch.Tensor) -> list[float]:
    if stat is Stat.ENTROPY:
        return floats(entropy(probs))
    if stat is Stat.RANK:
        return [float(r) for r in rank(probs, token_ids).tolist()]
    return floats(probs.gather(-1, token_ids[:, None])[:, 0])
