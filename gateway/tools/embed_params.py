"""`embed`'s params, partial and result (gateway/tools/embed.py), and the two rules every part of
it shares: how pooling names per-token vectors, and how vectors leave the device.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec
import numpy as np
import torch

from gateway.protocol import ResultFile
from gateway.tools import windows
from gateway.tools.windows import WindowParams, WindowPlan


class Pooling(str, enum.Enum):
    MEAN = "mean"
    CLS = "cls"
    LAST = "last"
    PER_TOKEN = "per_token"
    NONE = "none"  # the older name of per_token


class FileFormat(str, enum.Enum):
    SAFETENSORS = "safetensors"
    NPY = "npy"


FILE_DOC = (
    "Write the per-token vectors as files (pooling per_token), fetched from GET /jobs/{id}/files/{name}: "
    "safetensors, one file of embeddings.<i> (tokens × dim, float32), token_ids.<i> and, with window, context.<i> "
    "(per token, the fewest tokens of context on its left and right) for each text i; npy (one text), "
    "embeddings.npy, token_ids.npy and context.npy. Default: none, or safetensors when the result as JSON "
    "would be over the gateway's --max-result-bytes."
)


PARTIALS_DOC = (
    "With window, pooling per_token and stitch center or left: send each window's share of a text's per-token "
    "vectors as a partial event as soon as it is computed ({text, start, end, embeddings, tokens}: positions "
    "start..end-1 of the text's own tokens, final), in order within each text; the result still holds them all."
)


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
    file: Annotated[FileFormat, msgspec.Meta(description=FILE_DOC)] | None = None
    partials: Annotated[bool, msgspec.Meta(description=PARTIALS_DOC)] = False
    part: Annotated[windows.Part, msgspec.Meta(description=windows.PART_DOC)] | None = None


class EmbedPartial(msgspec.Struct):
    """With partials: one window's share of a text's per-token vectors, as soon as it is computed."""

    text: int
    """The text's index in texts."""
    start: int
    """The first of its positions (the text's own tokens, from 0)."""
    end: int
    """Past the last of them: the vectors are those of positions start..end-1, final."""
    embeddings: list[Any]
    tokens: list[str]


class EmbedResult(msgspec.Struct, omit_defaults=True):
    dim: int
    """The length of every vector returned."""
    layer: int
    pooling: Pooling
    embeddings: Annotated[
        list[Any],
        msgspec.Meta(
            description="Per text: a vector (mean, cls, last) or a list of per-token vectors (per_token); none when they are in files.",
            extra_json_schema={
                "items": {
                    "anyOf": [
                        {"type": "array", "items": {"type": "number"}},
                        {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                    ]
                }
            },
        ),
    ] | None = None
    tokens: list[list[str]] | None = None
    """With pooling per_token: each text's own tokens, one per vector."""
    plans: list[WindowPlan] | None = None
    """With window: how each text was cut and stitched (gateway/tools/windows.py)."""
    context: list[Any] | None = None
    """With window and pooling per_token: per text, per own token, the fewest tokens of context it had
    on its left and on its right, [left, right]."""
    files: list[ResultFile] | None = None
    """With file: the files holding the vectors, their tokens' ids and context."""
    span: list[tuple[int, int]] | None = None
    """With part and pooling per_token: the positions [start, end) of the text that its embeddings, tokens
    and context hold, the part's."""
    sums: list[Any] | None = None
    """With part and a pooled vector (embeddings left out), per text (one): mean, the sum of the vectors
    of the positions the part's windows give, weighted as stitch says (the parts' sums added up over
    the text's length are the mean); last, the text's last vector where the part holds it, else null.
    Neither normalized nor rounded: that is done to the whole."""


def as_array(t: torch.Tensor, precision: int | None) -> np.ndarray:
    """float32 as computed; float64 rounded to `precision` decimals when asked."""
    array = t.detach().to("cpu", torch.float32).numpy()
    return array if precision is None else np.round(array.astype(np.float64), precision)


def is_per_token(pooling: Pooling) -> bool:
    return pooling in (Pooling.PER_TOKEN, Pooling.NONE)
