"""The SAE tools: list a served SAE's features (`sae_features`, here), annotate a prompt or a
sequence with them (gateway/tools/sae_annotate.py), steer generation (gateway/tools/sae_steer.py).

They exist only when `--sae` gives at least one SAE (gateway/models/sae.py); each
finds it on `model.saes`, by the `sae` param's name, or the only one when
the param is left out. Feature ids are checked in `check`, before the job is
queued: an id past the SAE's features is a 422 naming the field, never a
wrong or negative index at run time.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from gateway.errors import ParamError
from gateway.models.sae import SAE
from gateway.tools.base import Capability, Context, Model, Tool, tool
from gateway.tools.numbers import floats

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


@tool(check=_check_features, needs={Capability.SAE})
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


def sae_tools() -> list[Tool]:
    """The tools served when at least one SAE is loaded."""
    from gateway.tools.sae_annotate import sae_annotate
    from gateway.tools.sae_steer import sae_steer

    return [sae_features, sae_annotate, sae_steer]
