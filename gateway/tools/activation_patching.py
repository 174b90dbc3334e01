"""`activation_patching`: which layer and position carry the source prompt's answer.

For each chosen layer and each pair of positions, the target prompt is run
again with that layer's output at the target position replaced by the source
run's output at the source position. The result is how much that moves the
target tokens' probability at the target's last position (summed over the
target tokens), and their best rank, compared with the clean target run.

All positions of one layer are patched in one batched forward pass (one row
per position); progress is reported and cancellation checked per layer.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import torch

from gateway.errors import ParamError
from gateway.tools.anatomy import anatomy, resolve_layers, resolve_positions, single_token
from gateway.tools.base import Capability, Context, Model, tool
from gateway.tools.logit_lens import Layers, rank
from gateway.tools.numbers import floats

PATCH_BATCH = 32  # patched runs per forward pass

class PatchingParams(msgspec.Struct, forbid_unknown_fields=True):
    src_prompt: Annotated[str, msgspec.Meta(min_length=1, description="The run activations are taken from.")]
    tgt_prompt: Annotated[str, msgspec.Meta(min_length=1, description="The run they are patched into.")]
    src_positions: Annotated[
        list[int],
        msgspec.Meta(min_length=1, description="Source positions, paired with tgt_positions. Default: the same as tgt_positions, or all when the prompts have equal length."),
    ] | None = None
    tgt_positions: Annotated[
        list[int], msgspec.Meta(min_length=1, description="Target positions to patch. Default: as src_positions, or all.")
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
    src_ids, tgt_ids = model.encode(p.src_prompt), model.encode(p.tgt_prompt)
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


def _last_logits(model: Model, rows: list[list[int]]) -> torch.Tensor:
    """Float32 logits at the last position of each row (rows of one length)."""
    input_ids = torch.tensor(rows, device=model.device)
    return model.logits(input_ids, torch.ones_like(input_ids))[:, -1].float()


def check(model: Model, params: PatchingParams) -> None:
    _plan(model, params)


@tool(check=check, needs={Capability.NEXT_TOKEN, Capability.LAYERS}, sequences=("src_prompt", "tgt_prompt"))
def activation_patching(model: Model, params: PatchingParams, ctx: Context) -> PatchingResult:
    """Patch the source run's residual stream into the target run, layer by layer and position by position."""
    src_ids, tgt_ids, layers, src_pos, tgt_pos, targets = _plan(model, params)
    body = anatomy(model)
    device = model.device

    with body.capture(layers, check=ctx.raise_if_cancelled) as source:
        src_logits = _last_logits(model, [src_ids])[0]
    src_probs = src_logits.softmax(-1)
    if not targets:
        targets = [int(src_probs.argmax())]
    target_index = torch.tensor(targets, device=device)
    clean_probs = _last_logits(model, [tgt_ids])[0].softmax(-1)
    clean = clean_probs[target_index].sum()

    prob_diff, ranks = [], []
    for done, layer in enumerate(layers, 1):
        ctx.raise_if_cancelled()
        src_hidden = source[layer][0]
        if layer not in layers[done:]:  # a layer may be asked for twice (`[1, -1]`)
            del source[layer]
        row_diff, row_rank = [], []
        for start in range(0, len(tgt_pos), PATCH_BATCH):
            t_pos = tgt_pos[start : start + PATCH_BATCH]
            s_pos = src_pos[start : start + PATCH_BATCH]
            rows = torch.arange(len(t_pos), device=device)
            patch = src_hidden[s_pos]

            def write(hidden: torch.Tensor, rows=rows, t_pos=t_pos, patch=patch) -> None:
                hidden[rows, t_pos] = patch.to(hidden.dtype)

            batch = [tgt_ids] * len(t_pos)
            with body.overwrite(layer, write):
                probs = _last_logits(model, batch).softmax(-1)
            row_diff.append(probs[:, target_index].sum(-1) - clean)
            best = torch.stack([rank(probs, target_index[k].expand(len(t_pos))) for k in range(len(targets))])
            row_rank.append(best.min(dim=0).values)
        prob_diff.append(floats(torch.cat(row_diff)))
        ranks.append(torch.cat(row_rank).tolist())
        ctx.progress(done, len(layers), "layers")

    return PatchingResult(
        layers=layers,
        positions=tgt_pos,
        src_positions=src_pos,
        labels=[f"{model.token_text(src_ids[s])}→{model.token_text(tgt_ids[t])}" for s, t in zip(src_pos, tgt_pos)],
        target_tokens=[model.token_text(t) for t in targets],
        clean_prob=floats(clean),
        source_prob=floats(src_probs[target_index].sum()),
        prob_diff=prob_diff,
        rank=ranks,
    )
