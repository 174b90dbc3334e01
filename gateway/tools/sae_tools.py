"""The SAE tools: list a served SAE's features, annotate a prompt with them, steer generation.

They exist only when `--sae` gives at least one SAE (gateway/sae.py); each
finds it on `model.saes`, by the `sae` param's name, or the only one when
the param is left out. Feature ids are checked in `check`, before the job is
queued: an id past the SAE's features is a 422 naming the field, never a
wrong or negative index at run time.

`sae_steer` is `generate` with clamps: at the SAE's layer it encodes each
row's residual stream, sets the clamped features to their strengths, and adds
the decoded difference, `(strength - f) @ W_dec[id]`, to the stream. The hook
doing that is installed for one forward pass and removed after it, and each
row gets its own job's clamps, so steering never reaches another job, in the
same batch or the next.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal

import msgspec
import torch

from gateway.errors import ParamError
from gateway.sae import SAE
from gateway.tools.anatomy import anatomy
from gateway.tools.base import Capability, Context, Model, Tool, tool
from gateway.tools.batching import run_alone
from gateway.tools.numbers import floats
from gateway.tools.generate import (
    GenerateParams,
    GeneratePartial,
    GenerateResult,
    Generation,
    ModelState,
    Recompute,
    _Member,
)
from gateway.tools.generate import check as generate_check

# Beyond this a clamp only blows the residual stream up; real activations are far smaller.
MAX_STRENGTH = 1e4

SaeName = Annotated[str, msgspec.Meta(description="Which SAE (its name); may be left out when one is served.")]
FeatureId = Annotated[int, msgspec.Meta(ge=0)]


def resolve_sae(model: Model, name: str | None, field: str = "sae") -> SAE:
    """The SAE called `name`, or the only one served; 422 on `field` otherwise."""
    names = ", ".join(model.saes) or "none"
    if name is None:
        if len(model.saes) != 1:
            raise ParamError(field, f"required: several SAEs are served ({names})")
        return next(iter(model.saes.values()))
    if name not in model.saes:
        raise ParamError(field, f"unknown SAE {name!r}; served: {names}")
    return model.saes[name]


def check_feature_ids(sae: SAE, ids: list[int], field: str, suffix: str = "") -> None:
    """422 naming `field[i]` for an id out of range or given twice."""
    seen: set[int] = set()
    for i, fid in enumerate(ids):
        where = f"{field}[{i}]{suffix}"
        if not 0 <= fid < sae.n_features:
            raise ParamError(where, f"feature {fid} is out of range: {sae.name} has {sae.n_features} features (0..{sae.n_features - 1})")
        if fid in seen:
            raise ParamError(where, f"feature {fid} is given twice")
        seen.add(fid)


# -- sae_features ---------------------------------------------------------------------


class FeaturesParams(msgspec.Struct, forbid_unknown_fields=True):
    sae: SaeName | None = None
    query: Annotated[str, msgspec.Meta(description="Keep features whose label contains this (any case).")] | None = None
    offset: Annotated[int, msgspec.Meta(ge=0)] = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 50


class FeatureInfo(msgspec.Struct):
    id: int
    label: str | None
    decoder_norm: float
    encoder_bias: float


class FeaturesResult(msgspec.Struct):
    sae: str
    layer: int
    n_features: int
    total: int  # features matching `query`
    offset: int
    features: list[FeatureInfo]


def _check_features(model: Model, params: FeaturesParams) -> None:
    resolve_sae(model, params.sae)


@tool(check=_check_features)
def sae_features(model: Model, params: FeaturesParams, ctx: Context) -> FeaturesResult:
    """List an SAE's features with their labels and decoder norms, filtered by label and paginated."""
    sae = resolve_sae(model, params.sae)
    labels = sae.spec.labels
    if params.query is None:
        matching: Any = range(sae.n_features)
    else:
        needle = params.query.lower()
        matching = [i for i in sorted(labels) if needle in labels[i].lower()]
    page = matching[params.offset : params.offset + params.limit]
    norms, biases = floats(sae.decoder_norms), floats(sae.b_enc)
    return FeaturesResult(
        sae=sae.name,
        layer=sae.spec.layer,
        n_features=sae.n_features,
        total=len(matching),
        offset=params.offset,
        features=[FeatureInfo(i, labels.get(i), norms[i], biases[i]) for i in page],
    )


# -- sae_annotate ---------------------------------------------------------------------


class AnnotateParams(msgspec.Struct, forbid_unknown_fields=True):
    prompt: str
    sae: SaeName | None = None
    mode: Annotated[
        Literal["top", "pick"],
        msgspec.Meta(description="top: each token's k most active features; pick: the activations of feature_ids."),
    ] = "top"
    k: Annotated[int, msgspec.Meta(ge=1, le=100)] = 5
    feature_ids: Annotated[list[FeatureId], msgspec.Meta(min_length=1, max_length=256)] | None = None


class Activation(msgspec.Struct):
    id: int
    label: str | None
    value: float


class TokenAnnotation(msgspec.Struct):
    token: str
    token_id: int
    features: list[Activation]
    error: float  # |x - decode(encode(x))|
    relative_error: float  # error / |x|


class AnnotateResult(msgspec.Struct):
    sae: str
    layer: int
    tokens: list[TokenAnnotation]


def _check_annotate(model: Model, params: AnnotateParams) -> None:
    sae = resolve_sae(model, params.sae)
    if params.mode == "pick":
        if params.feature_ids is None:
            raise ParamError("feature_ids", "required when mode is pick")
        check_feature_ids(sae, params.feature_ids, "feature_ids")
    elif params.feature_ids is not None:
        raise ParamError("feature_ids", "only with mode pick")
    model.fit(len(model.encode(params.prompt)), "prompt")


@tool(check=_check_annotate, needs={Capability.LAYERS})
def sae_annotate(model: Model, params: AnnotateParams, ctx: Context) -> AnnotateResult:
    """Per token of a prompt: its most active SAE features (or the chosen ones) and the reconstruction error."""
    _check_annotate(model, params)  # also when called directly, without the gateway's check
    sae = resolve_sae(model, params.sae)
    ids = model.encode(params.prompt)
    layer = sae.spec.layer
    with anatomy(model).capture([layer]) as captured:
        input_ids = torch.tensor([ids], device=model.device)
        model.logits(input_ids, torch.ones_like(input_ids))
    x = captured[layer][0].float()
    f = sae.encode(x)
    error = (x - sae.decode(f)).norm(dim=-1)
    relative = error / x.norm(dim=-1).clamp(min=1e-12)
    if params.mode == "pick":
        assert params.feature_ids is not None
        chosen = torch.tensor(params.feature_ids, device=f.device)
        picked = [params.feature_ids] * len(ids)
        values = floats(f[:, chosen])
    else:
        top = torch.topk(f, min(params.k, sae.n_features), dim=-1)
        picked, values = top.indices.tolist(), floats(top.values)
    labels = sae.spec.labels
    errors, relatives = floats(error), floats(relative)
    tokens = []
    for pos, token_id in enumerate(ids):
        acts = [
            Activation(fid, labels.get(fid), value)
            for fid, value in zip(picked[pos], values[pos])
            if params.mode == "pick" or value > 0  # `top` lists active features only
        ]
        tokens.append(
            TokenAnnotation(model.token_text(token_id), token_id, acts, errors[pos], relatives[pos])
        )
    return AnnotateResult(sae=sae.name, layer=layer, tokens=tokens)


# -- sae_steer ------------------------------------------------------------------------


class Clamp(msgspec.Struct, forbid_unknown_fields=True):
    feature_id: FeatureId
    strength: Annotated[
        float,
        msgspec.Meta(ge=-MAX_STRENGTH, le=MAX_STRENGTH, description="The value the feature is clamped to at every position."),
    ]


class SteerParams(GenerateParams, forbid_unknown_fields=True, kw_only=True):
    clamps: Annotated[list[Clamp], msgspec.Meta(min_length=1, max_length=64)]
    sae: SaeName | None = None


def _check_steer(model: Model, params: SteerParams) -> None:
    sae = resolve_sae(model, params.sae)
    check_feature_ids(sae, [c.feature_id for c in params.clamps], "clamps", ".feature_id")
    generate_check(model, params)


@contextlib.contextmanager
def steering(model: Model, sae: SAE, rows: list[tuple[int, int, list[Clamp]]]) -> Iterator[None]:
    """Steer the forward passes inside: rows start..end get their clamps; other rows nothing."""
    if not rows:
        yield
        return
    blocks = [
        (
            start,
            end,
            torch.tensor([c.feature_id for c in clamps], device=sae.W_dec.device),
            torch.tensor([c.strength for c in clamps], dtype=torch.float32, device=sae.W_dec.device),
        )
        for start, end, clamps in rows
    ]

    def write(hidden: torch.Tensor) -> None:
        for start, end, ids, strengths in blocks:
            f = sae.encode(hidden[start:end])[..., ids]
            hidden[start:end] += ((strengths - f) @ sae.W_dec[ids]).to(hidden.dtype)

    with anatomy(model).overwrite(sae.spec.layer, write):
        yield


class Steering(Generation):
    """`generate`'s continuous batch, each row steered by its own job's clamps (one SAE per batch)."""

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

    def _forward(self, members: list[_Member], run: Callable[[], torch.Tensor]) -> torch.Tensor:
        assert self.sae is not None
        rows, start = [], 0
        for member in members:
            end = start + len(member.rows)
            rows.append((start, end, member.params.clamps))  # type: ignore[attr-defined]
            start = end
        with steering(self.model, self.sae, rows):
            return super()._forward(members, run)


@tool(
    partial=GeneratePartial,
    check=_check_steer,
    caps={"prompts": "max_prompts", "max_tokens": "max_tokens"},
    batch=Steering,
    batch_key=lambda params: params.sae,
    needs={Capability.NEXT_TOKEN, Capability.LAYERS},
)
def sae_steer(model: Model, params: SteerParams, ctx: Context) -> GenerateResult:
    """Generate like `generate`, with SAE features clamped to given strengths at the SAE's layer."""
    return run_alone(Steering(model), params, ctx)


def sae_tools() -> list[Tool]:
    """The tools served when at least one SAE is loaded."""
    return [sae_features, sae_annotate, sae_steer]
