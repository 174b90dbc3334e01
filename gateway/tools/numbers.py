"""Tensors to JSON numbers, as short as they can be without losing what the tensor holds.

A float32 value widened to a Python float prints with up to 17 digits
(`0.12345679104328156`); its own shortest form (`0.12345679`) reads back as the
same float32 and takes about half the bytes. Rounding beyond that happens only
when the caller asks for a `precision`.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import orjson
import torch

# The dtypes orjson writes itself: float32 in float32's shortest form, float64 in float64's
# (both by ryu), NaN and infinities as null, as msgspec writes a Python float.
_WRITTEN = frozenset(np.dtype(name) for name in (
    "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
))


def floats(tensor: torch.Tensor, precision: int | None = None) -> Any:
    """Nested lists of floats: the shortest float32 form, or rounded to `precision` decimals."""
    t = tensor.detach().to("cpu", torch.float32)
    if precision is not None:
        return torch.round(t.double(), decimals=precision).tolist()
    return shortest(t.numpy())


def shortest(array: np.ndarray) -> Any:
    """A float32 array as (nested) Python floats that print in float32's shortest form."""
    # Each float32 written in its shortest round-tripping form, then read as float64: a value
    # msgspec prints in the same few digits. orjson writes them about fifty times as fast as
    # numpy's own text; NaN and infinities, which JSON has no number for, go numpy's way.
    array = np.asarray(array, dtype=np.float32)
    written = as_json(array) if np.isfinite(array).all() else None
    if written is None:
        return array.astype(str).astype(np.float64).tolist()
    return msgspec.json.decode(written)


def as_json(array: np.ndarray) -> bytes | None:
    """The array as a JSON array of numbers, float32 in its shortest form and NaN as null; None
    for what is not written this way (a 0-d array, another dtype), which takes Python's values."""
    if array.ndim == 0 or array.dtype not in _WRITTEN:
        return None
    return orjson.dumps(np.ascontiguousarray(array), option=orjson.OPT_SERIALIZE_NUMPY)
