"""Results on the wire: JSON for clients, msgpack with raw tensor buffers between services.

Tools may put numpy arrays or torch tensors in their results (an embedding
matrix, say). Clients get them as JSON numbers in float32's shortest exact
form; between an executor and a gateway they travel as msgpack extension
values holding the raw little-endian buffer, four bytes a float32 instead of
about eleven characters, and become the same JSON at the gateway.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import msgspec
import numpy as np
import torch

from gateway.tools.numbers import as_json, shortest

TENSOR_EXT = 1  # msgpack extension code: a header (dtype, shape) then the raw buffer

# A result between services: this little is hashed, and turned into JSON at a remote gateway, on
# the loop (tens of microseconds); the SHA-256 of more on a thread of its own, not the loop's
# default pool, which grows to a thread per core.
HASH_INLINE = 1 << 16
HASHING = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="streamgate-hash")


def _as_array(obj: Any) -> np.ndarray | None:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, (np.ndarray, np.generic)):
        return np.asarray(obj)
    return None


def _json_hook(obj: Any) -> Any:
    array = _as_array(obj)
    if array is None:
        raise TypeError(f"cannot encode a {type(obj).__name__} as JSON")
    array = array.astype(array.dtype.newbyteorder("="), copy=False)  # a big-endian float32 is a float32 too
    written = as_json(array)  # straight to JSON text: no Python float per number
    if written is not None:
        return msgspec.Raw(written)
    return shortest(array) if array.dtype == np.float32 else array.tolist()


def _msgpack_hook(obj: Any) -> Any:
    array = _as_array(obj)
    if array is None:
        raise TypeError(f"cannot encode a {type(obj).__name__} as msgpack")
    array = array.astype(array.dtype.newbyteorder("<"), copy=False)
    header = msgspec.msgpack.encode([array.dtype.str, list(array.shape)])
    return msgspec.msgpack.Ext(TENSOR_EXT, len(header).to_bytes(4, "little") + header + array.tobytes())


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != TENSOR_EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    size = int.from_bytes(data[:4], "little")
    dtype, shape = msgspec.msgpack.decode(data[4 : 4 + size])
    return np.frombuffer(data[4 + size :], dtype=np.dtype(dtype)).reshape(shape).copy()


_json = msgspec.json.Encoder(enc_hook=_json_hook)
_msgpack = msgspec.msgpack.Encoder(enc_hook=_msgpack_hook)
_from_msgpack = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def to_json(obj: Any) -> bytes:
    return _json.encode(obj)


def to_msgpack(obj: Any) -> bytes:
    return _msgpack.encode(obj)


def from_msgpack(data: bytes) -> Any:
    """Decode msgpack from `to_msgpack`; raises `msgspec.DecodeError` or `ValueError` if it is not that."""
    return _from_msgpack.decode(data)
