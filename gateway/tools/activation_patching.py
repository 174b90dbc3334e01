"""`activation_patching`: which layer and position carry the source prompt's answer.

For each chosen layer and each pair of positions, the target prompt is run
again with that layer's output at the target position replaced by the source
run's output at the source position. The result is how much that moves the
target tokens' probability at the target's last position (summed over the
target tokens), and their best rank, compared with the clean target run.

Every (layer, position) patch is a row of the target prompt, and the rows of
every layer go through the model together, in passes of at most
`PATCH_TOKENS` tokens (and `READOUT_FLOATS` logits): in each pass every
patched block overwrites its own rows, the pass stops after the last block,
and only the last position goes through the final norm and head. The source
and clean runs share one pass where the prompts are of one length. Progress is
reported per layer as its rows finish; cancellation is checked after every
block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Annotated

import msgspec
import torch

from gateway.cost import JSON_FLOAT, JSON_TOKEN, Cost, Shape
from gateway.errors import ParamError
from gateway.models.anatomy import anatomy, readout_rows, resolve_layers, resolve_positions, single_token
from gateway.tools.base import Capability, Context, Model, tool
from gateway.tools.logit_lens import MAX_POSITIONS, Layers, rank
from gateway.tools.numbers import floats

PATCH_TOKENS = 8192  # patched rows × the target's tokens per forward pass, at most

class PatchingParams(msgspec.Struct, forbid_unknown_fields=True):
    src_prompt: Annotated[str, msgspec.Meta(min_length=1, description="The run activations are taken from.")]
    tgt_prompt: Annotated[str, msgspec.Meta(min_length=1, description="The run they are patched into.")]
    src_positions: Annotated[
        list[int],
        msgspec.Meta(min_length=1, max_length=MAX_POSITIONS, description="Source positions, paired with tgt_positions. Default: the same as tgt_positions, or all when the prompts have equal length."),
    ] | None = None
    tgt_positions: Annotated[
        list[int],
        msgspec.Meta(
            min_length=1,
            max_length=MAX_POSITIONS,
            description="Target positions to patch. Default: as src_positions, or all.",
        ),
    ] | None = None
    target_tokens: Annotated[
        list[str],
        msgspec.Meta(min_length=1, max_length=16, description="Single tokens whose probability is measured. Default: the source run's top prediction."),
    ] | None = None
    layers: Layers | None = None


class PatchingResult(msgspec.Struct):
    layers: list[int]
    positions: list[int]
    """The target positions patched (columns)."""
    src_positions: list[int]
    labels: list[str]
    """A label per column: the source token → the target token it replaced."""
    target_tokens: list[str]
    clean_prob: float
    """The target tokens' probability in the unpatched target run."""
    source_prob: float
    """Their probability in the source run."""
    prob_diff: list[list[float]]
    """Layer × position: patched minus clean probability."""
    rank: list[list[int]]
    """Layer × position: the best rank (1 = top) of a target token after patching."""


def _plan(model: Model, p: PatchingParams):
    src_ids, tgt_ids = model.encode(p.src_prompt, "src_prompt"), model.encode(p.tgt_prompt, "tgt_prompt")
    model.fit(len(src_ids), "src_prompt")
    model.fit(len(tgt_ids), "tgt_prompt")
    layers = resolve_layers(model, p.layers)
    src_given = p.src_positions if p.src_positions is not None else p.tgt_positions
    tgt_given = p.tgt_positions if p.tgt_positions is not None else p.src_positions
    if src_given is None and len(src_ids) != len(tgt_ids):
        raise ParamError(
            "tgt_positions",
            f"the prompts have different lengths ({len(src_ids)} and {len(tgt_ids)} tokens); "
            "say which positions to pair with src_positions and tgt_positions",
        )
    src_pos = resolve_positions(len(src_ids), src_given, "src_positions")
    tgt_pos = resolve_positions(len(tgt_ids), tgt_given, "tgt_positions")
    if len(src_pos) != len(tgt_pos):
        raise ParamError(
            "src_positions", f"pairs with tgt_positions: {len(src_pos)} positions against {len(tgt_pos)}"
        )
    targets = [single_token(model, t, f"target_tokens[{i}]") for i, t in enumerate(p.target_tokens or [])]
    return src_ids, tgt_ids, layers, src_pos, tgt_pos, targets


def _last_logits(
    model: Model, rows: list[list[int]], layers: Sequence[int], check: Callable[[], None]
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Float32 logits at the last position of each row (rows of one length), and the output of
    each block of `layers` (row × position × width), from one pass stopped after the last block."""
    body = anatomy(model)
    last = body.n_layers - 1
    input_ids = torch.tensor(rows, device=model.device)
    with body.capture([*layers, last], check=check, stop=True) as captured:
        model.logits(input_ids, torch.ones_like(input_ids))
    return body.logits(captured[last][:, -1]), captured


def check(model: Model, params: PatchingParams) -> None:
    _plan(model, params)


def cost(model: Model, params: PatchingParams) -> Cost:
    """The source run with each patched layer's output kept, then the largest patched pass with its
    last-position logits; two numbers a cell."""
    shape = Shape.of(model)
    src_ids, tgt_ids, layers, _, tgt_pos, _ = _plan(model, params)
    cells = len(layers) * len(tgt_pos)
    per_pass = max(1, min(PATCH_TOKENS // len(tgt_ids), readout_rows(model), cells))
    source = shape.pass_bytes(2, max(len(src_ids), len(tgt_ids)), states=len(layers) + 1, logits=2)
    patched = shape.pass_bytes(per_pass, len(tgt_ids), states=1, logits=per_pass)
    result = cells * (JSON_FLOAT + 8) + len(tgt_pos) * (2 * JSON_TOKEN + 16)
    return Cost(
        memory=source + patched + cells * 12 + result,
        result=result,
        memory_field="layers",
        result_field="tgt_positions",
        tokens=max(len(src_ids), len(tgt_ids)),
    )


@tool(check=check, cost=cost, needs={Capability.NEXT_TOKEN, Capability.LAYERS}, sequences=("src_prompt", "tgt_prompt"))
def activation_patching(model: Model, params: PatchingParams, ctx: Context) -> PatchingResult:
    """Patch the source run's residual stream into the target run, layer by layer and position by position."""
    src_ids, tgt_ids, layers, src_pos, tgt_pos, targets = _plan(model, params)
    body = anatomy(model)
    device = model.device
    check = ctx.raise_if_cancelled

    if len(src_ids) == len(tgt_ids):
        logits, source = _last_logits(model, [src_ids, tgt_ids], layers, check)
        src_logits, clean_logits = logits
    else:
        (src_logits,), source = _last_logits(model, [src_ids], layers, check)
        (clean_logits,), _ = _last_logits(model, [tgt_ids], (), check)
    src_hidden = {layer: source[layer][0] for layer in layers}
    del source
    src_probs = src_logits.softmax(-1)
    if not targets:
        targets = [int(src_probs.argmax())]
    target_index = torch.tensor(targets, device=device)
    clean = clean_logits.softmax(-1)[target_index].sum()

    # Row r patches layer layers[r // n] at the pair of positions r % n.
    n = len(tgt_pos)
    cells = len(layers) * n
    per_pass = max(1, min(PATCH_TOKENS // len(tgt_ids), readout_rows(model)))
    t_all = torch.tensor(tgt_pos, device=device)
    s_all = torch.tensor(src_pos, device=device)
    prob_diff, ranks = [], []
    for start in range(0, cells, per_pass):
        end = min(start + per_pass, cells)
        with contextlib.ExitStack() as patches:
            for li in range(start // n, (end - 1) // n + 1):
                first, stop = max(start, li * n), min(end, (li + 1) * n)
                cols = slice(first - li * n, stop - li * n)
                rows = torch.arange(first - start, stop - start, device=device)
                patch = src_hidden[layers[li]][s_all[cols]]

                def write(hidden: torch.Tensor, rows=rows, t_pos=t_all[cols], patch=patch) -> None:
                    hidden[rows, t_pos] = patch.to(hidden.dtype)

                patches.enter_context(body.overwrite(layers[li], write))
            logits, _ = _last_logits(model, [tgt_ids] * (end - start), (), check)
        probs = logits.softmax(-1)
        prob_diff.append(probs[:, target_index].sum(-1) - clean)
        best = torch.stack([rank(probs, target_index[k].expand(end - start)) for k in range(len(targets))])
        ranks.append(best.min(dim=0).values)
        if end // n > start // n:  # a layer's last row was in this pass
            ctx.progress(end // n, len(layers), "layers")

    grid = (len(layers), n)
    texts = model.token_texts([*(src_ids[s] for s in src_pos), *(tgt_ids[t] for t in tgt_pos), *targets])
    return PatchingResult(
        layers=layers,
        positions=tgt_pos,
        src_positions=src_pos,
        labels=[f"{texts[src_ids[s]]}→{texts[tgt_ids[t]]}" for s, t in zip(src_pos, tgt_pos)],
        target_tokens=[texts[t] for t in targets],
        clean_prob=floats(clean),
        source_prob=floats(src_probs[target_index].sum()),
        prob_diff=floats(torch.cat(prob_diff).view(grid)),
        rank=torch.cat(ranks).view(grid).tolist(),
    )
