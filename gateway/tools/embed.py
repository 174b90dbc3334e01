"""`embed`: hidden-state embeddings of texts, pooled per text or per token.

Embeddings are returned as numpy arrays: clients get JSON numbers in
float32's shortest form, executors send the raw buffers (see `encoding.py`).

`layer` indexes the model's hidden states the way transformers numbers them
(`output_hidden_states=True`): 0 is the token embeddings, i ≥ 1 the output of
the i-th block (the lens tools' layer i − 1), and -1 the last, after the
model's final norm. Texts are right-padded
into batches; pooling reads only real tokens.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec
import numpy as np
import torch

from gateway.errors import ParamError
from gateway.tools.anatomy import anatomy
from gateway.tools.base import Context, Model, tool

EMBED_BATCH = 16  # texts per forward pass


class Pooling(str, enum.Enum):
    MEAN = "mean"
    LAST = "last"
    NONE = "none"


class EmbedParams(msgspec.Struct, forbid_unknown_fields=True):
    texts: Annotated[list[str], msgspec.Meta(min_length=1)]
    layer: Annotated[
        int,
        msgspec.Meta(description="Hidden state index: 0 = token embeddings, i = after the i-th block, -1 = the last (after the final norm)."),
    ] = -1
    pooling: Annotated[
        Pooling, msgspec.Meta(description="mean or last token per text, or none: one vector per token.")
    ] = Pooling.MEAN
    normalize: Annotated[bool, msgspec.Meta(description="Scale each vector to unit length.")] = False
    precision: Annotated[
        int, msgspec.Meta(ge=0, le=10, description="Round to this many decimals. Default: float32's shortest exact form.")
    ] | None = None


Vector = list[float]


class EmbedResult(msgspec.Struct, omit_defaults=True):
    dim: int
    layer: int
    pooling: Pooling
    embeddings: Annotated[
        list[Any],
        msgspec.Meta(
            description="Per text: a vector (mean, last) or a list of per-token vectors (none).",
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
    """With pooling none: each text's tokens, one per vector."""


def _array(t: torch.Tensor, precision: int | None) -> np.ndarray:
    """float32 as computed; float64 rounded to `precision` decimals when asked."""
    array = t.detach().to("cpu", torch.float32).numpy()
    return array if precision is None else np.round(array.astype(np.float64), precision)


def _n_states(model: Model) -> int:
    return anatomy(model).n_layers + 1


def check(model: Model, params: EmbedParams) -> None:
    n = _n_states(model)
    if not -n <= params.layer < n:
        raise ParamError("layer", f"layer {params.layer} is out of range; the model has {n} hidden states (0..{n - 1}, or -{n}..-1)")
    for i, text in enumerate(params.texts):
        if not text:
            raise ParamError(f"texts[{i}]", "must not be empty")
        model.fit(len(model.encode(text)), f"texts[{i}]")


@tool(check=check, caps={"texts": "max_prompts"})
def embed(model: Model, params: EmbedParams, ctx: Context) -> EmbedResult:
    """Hidden-state embeddings of each text at one layer, mean- or last-pooled, or per token."""
    layer = params.layer % _n_states(model)
    encoded = [model.encode(text) for text in params.texts]
    body = anatomy(model)
    pad = model.tokenizer.pad_token_id
    out: list[Any] = []
    for start in range(0, len(encoded), EMBED_BATCH):
        chunk = encoded[start : start + EMBED_BATCH]
        width = max(len(ids) for ids in chunk)
        input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(chunk):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
        with body.capture([], check=ctx.raise_if_cancelled):
            states = model.module(
                input_ids=input_ids.to(model.device),
                attention_mask=mask.to(model.device),
                output_hidden_states=True,
            ).hidden_states[layer].float()
        mask = mask.to(states.device)
        if params.pooling is Pooling.MEAN:
            pooled = (states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        elif params.pooling is Pooling.LAST:
            pooled = states[torch.arange(len(chunk)), mask.sum(1) - 1]
        if params.pooling is Pooling.NONE:
            for row, ids in enumerate(chunk):
                vectors = states[row, : len(ids)]
                if params.normalize:
                    vectors = torch.nn.functional.normalize(vectors, dim=-1)
                out.append(_array(vectors, params.precision))
        else:
            if params.normalize:
                pooled = torch.nn.functional.normalize(pooled, dim=-1)
            out.extend(_array(pooled, params.precision))
        ctx.progress(min(start + EMBED_BATCH, len(encoded)), len(encoded), "texts")
    return EmbedResult(
        dim=model.module.config.hidden_size if hasattr(model.module.config, "hidden_size") else len(out[0][0]),
        layer=layer,
        pooling=params.pooling,
        embeddings=out,
        tokens=[[model.token_text(i) for i in ids] for ids in encoded] if params.pooling is Pooling.NONE else None,
    )
