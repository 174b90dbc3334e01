"""Results on the wire (gateway/encoding.py, gateway/tools/numbers.py): arrays as JSON numbers.

Each float32 must reach a client as its shortest round-tripping form, the
number numpy's own repr gives, whichever way it is written: straight from the
array, through Python floats (`shortest`), or after the msgpack hop between an
executor and a gateway, which must give the same bytes as a local backend.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch

from gateway.encoding import from_msgpack, to_json, to_msgpack
from gateway.tools.numbers import shortest
from tests.conftest import floats_not_float32_shortest


def _float32s(n: int, seed: int = 0) -> np.ndarray:
    """n values of every scale, in a random order: normal, tiny, huge, subnormal, random bit patterns (finite ones)."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    parts = [rng.standard_normal(n), rng.standard_normal(n) * 1e-30, rng.standard_normal(n) * 1e30,
             rng.uniform(-1, 1, n) * 1e-40, bits[np.isfinite(bits)], [0.0, -0.0, 1.0, 0.1, 3.4028235e38, 1e-45]]
    every = np.concatenate([np.asarray(p, dtype=np.float32) for p in parts])
    return np.concatenate([every[-6:], rng.permutation(every[:-6])])[:n]


def _expected(array: np.ndarray) -> list[float]:
    """Each float32 as numpy prints it (its shortest form) read as a Python float: the reference, one value at a time."""
    return [float(str(x)) if math.isfinite(x) else None for x in array.astype(np.float32).ravel()]


def _json_values(obj: object) -> list[float | None]:
    return list(np.asarray(msgspec.json.decode(to_json({"x": obj}))["x"], dtype=object).ravel())


@pytest.mark.parametrize(
    "array",
    [
        _float32s(2000),
        _float32s(600, seed=1).reshape(3, 20, -1),
        _float32s(600, seed=2).reshape(30, -1).T,  # not contiguous
        _float32s(100, seed=3).astype(">f4"),  # big-endian
        np.zeros((2, 0, 3), np.float32),
    ],
    ids=["flat", "3-d", "transposed", "big-endian", "empty"],
)
def test_float32_arrays_are_written_in_their_shortest_form(array: np.ndarray) -> None:
    written = msgspec.json.decode(to_json({"x": array}))["x"]
    assert written == np.array(_expected(array), dtype=object).reshape(array.shape).tolist()
    assert floats_not_float32_shortest(written) == []
    assert shortest(array) == written


def test_nan_and_infinities_are_null_in_json_and_kept_in_python() -> None:
    array = np.array([0.1, np.nan, np.inf, -np.inf, 2.5], np.float32)
    assert _json_values(array) == [0.1, None, None, None, 2.5]
    kept = shortest(array)
    assert kept[0] == 0.1 and math.isnan(kept[1]) and kept[2:] == [math.inf, -math.inf, 2.5]


@pytest.mark.parametrize(
    "obj",
    [
        np.random.default_rng(4).standard_normal(500),  # float64
        np.round(np.random.default_rng(5).standard_normal(500), 6),
        np.arange(-50, 50, dtype=np.int64),
        np.arange(200, dtype=np.uint8),
        np.array([True, False, True]),
        np.float16([0.5, 0.1, 65504]),
    ],
    ids=["float64", "rounded", "int64", "uint8", "bool", "float16"],
)
def test_other_arrays_are_written_as_their_python_values(obj: np.ndarray) -> None:
    assert _json_values(obj) == obj.tolist()


def test_scalars_and_tensors() -> None:
    assert _json_values(np.float32(0.1)) == [0.1]
    assert msgspec.json.decode(to_json({"x": np.float32(0.1)}))["x"] == 0.1
    tensor = torch.tensor([[0.1, 1 / 3], [2.0, -7.25]])
    assert _json_values(tensor) == _expected(tensor.numpy())


def test_the_msgpack_hop_gives_a_local_backends_bytes() -> None:
    result = {
        "embeddings": _float32s(300, seed=6).reshape(3, -1),
        "rounded": np.round(np.random.default_rng(7).standard_normal((4, 5)), 6),
        "ids": np.arange(10),
        "tensor": torch.randn(2, 3),
        "text": "ok",
        "plain": [0.1, 2],
    }
    assert to_json(from_msgpack(to_msgpack(result))) == to_json(result)
