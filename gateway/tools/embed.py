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
from gateway.tools.base import Context, Model, right_padded, tool
from gateway.tools.batching import one_pass, raise_if_all_cancelled

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


def _pooled(states: torch.Tensor, params: EmbedParams) -> torch.Tensor:
    """One text's vector(s) from its real tokens' states, as `params` asks."""
    if params.pooling is Pooling.MEAN:
        states = states.mean(0)
    elif params.pooling is Pooling.LAST:
        states = states[-1]
    return torch.nn.functional.normalize(states, dim=-1) if params.normalize else states


def _embed_many(model: Model, jobs: list[EmbedParams], ctxs: list[Context]) -> list[EmbedResult]:
    # The texts of every job, in right-padded chunks; each job reads its own layer and pooling.
    n_states = _n_states(model)
    encoded = [[model.encode(text) for text in params.texts] for params in jobs]
    flat = [(job, i) for job, texts in enumerate(encoded) for i in range(len(texts))]
    out: list[list[Any]] = [[None] * len(texts) for texts in encoded]
    done = [0] * len(jobs)
    body = anatomy(model)
    for start in range(0, len(flat), EMBED_BATCH):
        chunk = flat[start : start + EMBED_BATCH]
        input_ids, mask = right_padded(model, [encoded[job][i] for job, i in chunk])
        with body.capture([], check=lambda: raise_if_all_cancelled(ctxs)):
            states = model.module(input_ids=input_ids, attention_mask=mask, output_hidden_states=True).hidden_states
        for row, (job, i) in enumerate(chunk):
            params = jobs[job]
            real = states[params.layer % n_states][row, : len(encoded[job][i])].float()
            out[job][i] = _array(_pooled(real, params), params.precision)
            done[job] += 1
        for job in sorted({job for job, _ in chunk}):
            ctxs[job].progress(done[job], len(encoded[job]), "texts")
    return [
        EmbedResult(
            dim=model.module.config.hidden_size if hasattr(model.module.config, "hidden_size") else len(vectors[0][0]),
            layer=params.layer % n_states,
            pooling=params.pooling,
            embeddings=vectors,
            tokens=[[model.token_text(t) for t in ids] for ids in texts] if params.pooling is Pooling.NONE else None,
        )
        for params, texts, vectors in zip(jobs, encoded, out)
    ]


@tool(check=check, caps={"texts": "max_prompts"}, batch=one_pass(_embed_many))
def embed(model: Model, params: EmbedParams, ctx: Context) -> EmbedResult:
    """Hidden-state embeddings of each text at one layer, mean- or last-pooled, or per token."""
    return _embed_many(model, [params], [ctx])[0]
