"""Result files: a per-position result too big for one event, written in parts as the field's tools open it.

A tool whose result grows with the length of its input (per-token embeddings
of a 100,000-residue protein: 100,000 × 1,280 floats) would be refused past
`--max-result-bytes` as JSON. It can instead write the result into files the
job keeps beside its (then small) JSON result: the run opens each through its
`Context.file`, the result names them (`ResultFile`), and clients fetch them
from `GET /jobs/{id}/files/{name}`, resumable with `Range`.

`ArrayFile` writes named arrays of known shapes as `.safetensors` (several
arrays: what PyTorch, JAX and numpy users load with the `safetensors` package)
or `.npy` (one array: `numpy.load`, with `mmap_mode` for a big one). The file is
laid out whole when it is opened (the header, then every array's bytes at its
offset), so each window's rows go to their own place as they are computed, in
any order, with `pwrite`: the process holds one window, never the whole array.
Neither the `safetensors` package nor numpy writes a file in parts (both take
whole arrays), which is why the header is written here; both read what is
written here, and tests/test_result_files.py opens every file with them.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from typing import IO

import numpy as np
from numpy.lib import format as npy

from gateway.protocol import ResultFile

SAFETENSORS = "safetensors"
NPY = "npy"
_DTYPES = {np.dtype("<f4"): "F32", np.dtype("<i4"): "I32", np.dtype("<i8"): "I64"}
# Header bytes a safetensors file of this many arrays takes at most (names, dtypes, shapes, offsets).
HEADER_PER_ARRAY = 128


@dataclass(frozen=True)
class Array:
    """One array of a file: its name, dtype and shape (rows first)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes


def file_bytes(arrays: list[Array]) -> int:
    """What a file of `arrays` takes at most: their bytes and a header (for a tool's price)."""
    return sum(a.nbytes for a in arrays) + HEADER_PER_ARRAY * (len(arrays) + 1)


class ArrayFile:
    """Arrays of known shapes laid out in one file (`format`: safetensors, or npy for one array),
    written a stretch of rows at a time; safe to write from several threads (one job's chunks
    on several devices)."""

    def __init__(self, file: IO[bytes], name: str, format: str, arrays: list[Array], metadata: dict[str, str] | None = None) -> None:
        if format == NPY and len(arrays) != 1:
            raise ValueError("an .npy file holds one array")
        self.file, self.name, self.format = file, name, format
        self.fd = file.fileno()
        self.arrays = {a.name: a for a in arrays}
        self.offsets: dict[str, int] = {}
        self._lock = threading.Lock()
        header = _npy_header(arrays[0]) if format == NPY else self._safetensors_header(arrays, metadata or {})
        _pwrite(self.fd, header, 0)
        self.size = len(header) + sum(a.nbytes for a in arrays)
        os.ftruncate(self.fd, self.size)  # laid out whole: unwritten rows read as zeros

    def _safetensors_header(self, arrays: list[Array], metadata: dict[str, str]) -> bytes:
        entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        at = 0
        for a in arrays:
            entries[a.name] = {"dtype": _DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
            self.offsets[a.name] = at
            at += a.nbytes
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the package's own files do
        start = 8 + len(text)
        self.offsets = {name: start + offset for name, offset in self.offsets.items()}
        return struct.pack("<Q", len(text)) + text

    def write(self, array: str, start: int, rows: np.ndarray) -> None:
        """Rows `start`.. of `array`, as they are final."""
        a = self.arrays[array]
        data = np.ascontiguousarray(rows, dtype=a.dtype)
        _pwrite(self.fd, data.tobytes(), self._offset(a, start, len(data)))

    def add(self, array: str, start: int, rows: np.ndarray) -> None:
        """Add `rows` to those at `start`.. (positions several windows share, each with its weight)."""
        a = self.arrays[array]
        with self._lock:  # a read, then a write: two windows of one stretch must not interleave
            at = self._offset(a, start, len(rows))
            now = np.frombuffer(os.pread(self.fd, len(rows) * a.row_bytes, at), dtype=a.dtype).reshape(len(rows), *a.shape[1:])
            _pwrite(self.fd, (now + rows.astype(a.dtype)).tobytes(), at)

    def read(self, array: str, start: int, stop: int) -> np.ndarray:
        a = self.arrays[array]
        data = os.pread(self.fd, (stop - start) * a.row_bytes, self._offset(a, start, stop - start))
        return np.frombuffer(data, dtype=a.dtype).reshape(stop - start, *a.shape[1:]).copy()

    def _offset(self, a: Array, start: int, rows: int) -> int:
        if start < 0 or start + rows > a.shape[0]:
            raise ValueError(f"rows {start}..{start + rows} of {a.name}'s {a.shape[0]}")
        base = self.offsets[a.name] if self.format == SAFETENSORS else self.size - a.nbytes
        return base + start * a.row_bytes

    def close(self, description: str = "") -> ResultFile:
        """Flushed and closed: what the result says of it."""
        self.file.close()
        return ResultFile(self.name, self.format, self.size, description)


def _npy_header(a: Array) -> bytes:
    import io

    out = io.BytesIO()
    npy.write_array_header_1_0(out, {"descr": npy.dtype_to_descr(a.dtype), "fortran_order": False, "shape": a.shape})
    return out.getvalue()


def _pwrite(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written
