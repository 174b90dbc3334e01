"""`sae_steer`: `generate` with SAE features clamped.

At the SAE's layer it encodes each row's residual stream, sets the clamped
features to their strengths, and adds the decoded difference,
`(strength - f) @ W_dec[id]`, to the stream. The hook doing that is installed
for one forward pass and removed after it, and each row gets its own job's
clamps, so steering never reaches another job, in the same batch or the next.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from collections.abc import Callable, Iterator
from typing import Annotated, Literal

import msgspec
import torch

from gateway.cost import Cost
from gateway.errors import ParamError
from gateway.models.anatomy import anatomy
from gateway.models.decoders import ModelState, Recompute
from gateway.models.sae import SAE
from gateway.tools.base import Capability, Context, Model, tool
from gateway.tools.batching import run_alone
from gateway.tools.generate import (
    GenerateParams,
    GeneratePartial,
    GenerateResult,
    Generation,
    _Member,
)
from gateway.tools.generate import CAPS as generate_caps
from gateway.tools.generate import check as generate_check
from gateway.tools.generate import cost as generate_cost
from gateway.tools.sae_tools import MAX_STRENGTH, FeatureId, SaeName, check_feature_ids, resolve_sae


class Clamp(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    feature_id: FeatureId
    strength: Annotated[
        float,
        msgspec.Meta(ge=-MAX_STRENGTH, le=MAX_STRENGTH, description="The value the feature is clamped to at the positions steered."),
    ]
    start: Annotated[
        int, msgspec.Meta(ge=0, description="The first position clamped, counting the prompt's tokens from 0.")
    ] = 0
    end: Annotated[
        int, msgspec.Meta(ge=1, description="The position after the last one clamped; left out, every position from start on.")
    ] | None = None


class SteerParams(GenerateParams, forbid_unknown_fields=True, kw_only=True):
    clamps: Annotated[list[Clamp], msgspec.Meta(min_length=1, max_length=64)]
    sae: SaeName | None = None
    # The default is "all": feature clamping as the SAE literature does it (Templeton et al. 2024's
    # "Scaling Monosemanticity" clamps a feature at every position, prompt included), which also
    # leaves the prompt's reading shaped by the feature, as a prompt about the topic would.
    steer: Annotated[
        Literal["all", "generated"],
        msgspec.Meta(
            description="all: clamp at every position, the prompt's included; generated: only at the tokens "
            "generated, so the prompt is read as it would be without steering."
        ),
    ] = "all"


def _check_steer(model: Model, params: SteerParams) -> None:
    sae = resolve_sae(model, params.sae)
    check_feature_ids(sae, [c.feature_id for c in params.clamps], "clamps", ".feature_id")
    for i, clamp in enumerate(params.clamps):
        if clamp.end is not None and clamp.end <= clamp.start:
            raise ParamError(f"clamps[{i}].end", f"must be after start ({clamp.start})")
    generate_check(model, params)


def _cost_steer(model: Model, params: SteerParams) -> Cost:
    """`generate`'s, with every step's residuals at the SAE's layer encoded into every feature."""
    plain = generate_cost(model, params)
    sae = resolve_sae(model, params.sae)
    return dataclasses.replace(plain, memory=plain.memory + plain.tokens * sae.n_features * 4 * 2)


@dataclass(frozen=True)
class SteeredRows:
    """One job's rows of a forward pass: rows start..end of the batch, their clamps, and where
    each row's columns are in its sequence: column c is position c + offsets[r], and positions
    from firsts[r] on may be steered (0 for steer "all", the prompt's length for "generated")."""

    start: int
    end: int
    clamps: list[Clamp]
    offsets: list[int]
    firsts: list[int]


@contextlib.contextmanager
def steering(model: Model, sae: SAE, rows: list[SteeredRows]) -> Iterator[None]:
    """Steer the forward passes inside: each block of rows gets its clamps, at its positions; other rows nothing."""
    if not rows:
        yield
        return
    device = sae.W_dec.device
    blocks = [
        (
            block,
            torch.tensor([c.feature_id for c in block.clamps], device=device),
            torch.tensor([c.strength for c in block.clamps], dtype=torch.float32, device=device),
            torch.tensor([[c.start, c.end if c.end is not None else 2**62] for c in block.clamps], device=device),
            torch.tensor(block.offsets, device=device),
            torch.tensor(block.firsts, device=device),
        )
        for block in rows
    ]

    # A prefill may run its columns in pieces (gateway/models/decoders.py), each a pass of its own
    # through the layer: the columns of each piece follow those of the pieces before it.
    seen = [0]

    def write(hidden: torch.Tensor) -> None:
        width = hidden.shape[1]
        columns = torch.arange(seen[0], seen[0] + width, device=device)
        seen[0] += width
        for block, ids, strengths, spans, offsets, firsts in blocks:
            positions = columns[None, :] + offsets[:, None]  # rows × width
            where = (positions[..., None] >= spans[:, 0]) & (positions[..., None] < spans[:, 1])  # rows × width × clamps
            where &= (positions >= firsts[:, None])[..., None]
            f = sae.encode(hidden[block.start : block.end])[..., ids]
            delta = ((strengths - f) * where) @ sae.W_dec[ids]
            hidden[block.start : block.end] += delta.to(hidden.dtype)

    with anatomy(model).overwrite(sae.spec.layer, write):
        yield


class Steering(Generation):
    """`generate`'s continuous batch, each row steered by its own job's clamps (one SAE per batch)."""

    shares_prompts = False  # one prompt's rows may be steered apart

    def __init__(self, model: Model) -> None:
        super().__init__(model)
        self.sae: SAE | None = None
        if isinstance(self.decoder, ModelState):
            # A custom model's `start` may read rows one at a time, so a block's output would not
            # hold every row of the batch for `steering` to tell apart: run whole batches instead.
            self.decoder = Recompute(model)

    def add(self, params: SteerParams, ctx: Context) -> None:
        _check_steer(self.model, params)  # a job at fault fails alone, even if `check` was skipped
        self.sae = resolve_sae(self.model, params.sae)
        super().add(params, ctx)

    def resume(self, kept: _Member, ctx: Context) -> None:
        self.sae = resolve_sae(self.model, kept.params.sae)  # type: ignore[attr-defined]  # a batch it starts afresh
        super().resume(kept, ctx)

    def _forward(self, members: list[_Member], run: Callable[[], torch.Tensor], prefill: bool) -> torch.Tensor:
        assert self.sae is not None
        # Where each row's columns are in its sequence: the KV cache decodes one column, the pending
        # token, and prefills prompts left-padded to the longest; Recompute runs every row whole from 0.
        # (A preempted member's prefill runs its prompt and the tokens it took: `context`.)
        width = max(len(ids) for m in members for ids in m.context)
        rows, start = [], 0
        for member in members:
            end = start + len(member.rows)
            lengths = [len(ids) for ids in member.encoded]
            if isinstance(self.decoder, Recompute):
                offsets = [0] * len(lengths)
            elif prefill:
                offsets = [len(ids) - width for ids in member.context]
            else:
                offsets = [n + member.steps - 1 for n in lengths]
            params: SteerParams = member.params  # type: ignore[assignment]
            firsts = lengths if params.steer == "generated" else [0] * len(lengths)
            rows.append(SteeredRows(start, end, params.clamps, offsets, firsts))
            start = end
        with steering(self.model, self.sae, rows):
            return super()._forward(members, run, prefill)


@tool(
    partial=GeneratePartial,
    check=_check_steer,
    cost=_cost_steer,
    caps=generate_caps,
    sequences=("prompts",),
    batch=Steering,
    batch_key=lambda params: params.sae,
    needs={Capability.NEXT_TOKEN, Capability.LAYERS, Capability.SAE},
)
def sae_steer(model: Model, params: SteerParams, ctx: Context) -> GenerateResult:
    """Generate like `generate`, with SAE features clamped to given strengths at the SAE's layer."""
    return run_alone(Steering(model), params, ctx)
