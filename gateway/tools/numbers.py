"""Tensors to JSON numbers, as short as they can be without losing what the tensor holds.

A float32 value widened to a Python float prints with up to 17 digits
(`0.12345679104328156`); its own shortest form (`0.12345679`) reads back as the
same float32 and takes about half the bytes. Rounding beyond that happens only
when the caller asks for a `precision`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def floats(tensor: torch.Tensor, precision: int | None = None) -> Any:
    """Nested lists of floats: the shortest float32 form, or rounded to `precision` decimals."""
    t = tensor.detach().to("cpu", torch.float32)
    if precision is not None:
        return torch.round(t.double(), decimals=precision).tolist()
    return shortest(t.numpy())


def shortest(array: np.ndarray) -> Any:
    """A float32 array as (nested) Python floats that print in float32's shortest form."""
    # numpy prints float32 in its shortest round-tripping form; parsing that text
    # as float64 gives a value msgspec prints in the same few digits.
    return array.astype(str).astype(np.float64).tolist()
