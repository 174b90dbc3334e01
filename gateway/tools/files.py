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

import heapq
import io
import json
import os
import struct
import tempfile
import threading
from dataclasses import dataclass
from collections.abc import Callable, Iterator
from typing import IO, Any

import numpy as np
from numpy.lib import format as npy

from gateway.protocol import ResultFile

# The files one job may write: a bigWig for each feature of an annotation, and two more.
MAX_FILES = 256
SAFETENSORS = "safetensors"
NPY = "npy"
BIGWIG = "bigwig"
BED = "bed"
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


_FORMATS = {".safetensors": SAFETENSORS, ".npy": NPY, ".bw": "bigwig", ".bed": "bed", ".tsv": "tsv", ".jsonl": "jsonl"}


def format_of(name: str) -> str:
    """A result file's format, by its name's extension ("" if none of these)."""
    return next((fmt for ext, fmt in _FORMATS.items() if name.endswith(ext)), "")


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
        write_all(self.fd, header, 0)
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
        write_all(self.fd, data.tobytes(), self._offset(a, start, len(data)))

    def add(self, array: str, start: int, rows: np.ndarray) -> None:
        """Add `rows` to those at `start`.. (positions several windows share, each with its weight)."""
        a = self.arrays[array]
        with self._lock:  # a read, then a write: two windows of one stretch must not interleave
            at = self._offset(a, start, len(rows))
            now = np.frombuffer(read_all(self.fd, len(rows) * a.row_bytes, at), dtype=a.dtype).reshape(len(rows), *a.shape[1:])
            write_all(self.fd, (now + rows.astype(a.dtype)).tobytes(), at)

    def read(self, array: str, start: int, stop: int) -> np.ndarray:
        a = self.arrays[array]
        data = read_all(self.fd, (stop - start) * a.row_bytes, self._offset(a, start, stop - start))
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
    out = io.BytesIO()
    npy.write_array_header_1_0(out, {"descr": npy.dtype_to_descr(a.dtype), "fortran_order": False, "shape": a.shape})
    return out.getvalue()


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """All of `data` at `offset` (a `pwrite` may write less than asked)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def read_all(fd: int, n: int, offset: int) -> bytes:
    """`n` bytes at `offset` (a `pread` may read less than asked); OSError if the file ends first."""
    data = os.pread(fd, n, offset)
    if len(data) == n:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = os.pread(fd, n - got, offset + got)
        if not more:
            raise OSError(f"the file ended {n - got} bytes short")
        parts.append(more)
        got += len(more)
    return b"".join(parts)


class TrackFiles:
    """Per-position tracks of several sequences, a bigWig file each (every sequence a chromosome of
    it), and the stretches where a track is above `threshold` in one BED file, written a stretch of
    positions at a time, sequence after sequence, in order (as bigWig and BED are read: sorted).

    `open_file` is the job's `Context.file`. A bigWig is written by its C library (pyBigWig), which
    opens a path: it is given the job's open file's own (`/proc/self/fd/N`), so a job that ends
    meanwhile leaves nothing behind. A sequence's stretches above the threshold are kept on disk
    until it ends, a file a track, each in order (`_Spill`): a BED line's score needs its track's
    peak, known only then, and the tracks' lines are merged in order as they are written, so a
    sequence of any length holds a line a track."""

    def __init__(self, open_file: Callable[[str], IO[bytes]], chroms: list[tuple[str, int]], threshold: float) -> None:
        self.open_file = open_file
        self.chroms = chroms
        self.threshold = threshold
        self._bigwigs: dict[str, tuple[IO[bytes], Any]] = {}
        self._bed: IO[bytes] | None = None
        self._runs: dict[str, tuple[int, float]] = {}  # a track's stretch above the threshold not yet ended: start, most
        self._spills: dict[str, _Spill] = {}  # the sequence's stretches above the threshold, by track
        self._folder: str | None = None  # where the job's files are: the spills go there too

    def write(self, chrom: str, track: str, start: int, values: np.ndarray, fires: bool = False) -> None:
        """Positions `start`.. of `track` on `chrom`; with `fires`, its stretches above the threshold go
        to the BED too, scored once the chromosome ends (`end_chrom`: by then its peak is known)."""
        if not len(values):
            return
        bigwig = self._bigwig(track)
        bigwig.addEntries(chrom, start, values=np.ascontiguousarray(values, dtype=np.float64), span=1, step=1)
        if fires:
            self._fires(track, start, values)

    def _opened(self, name: str) -> IO[bytes]:
        """The job's file `name`, empty: a run that goes on from a checkpoint writes its tracks again
        from the start (gateway/tools/sae_annotate.py `_Kept`), over what the run before it left."""
        file = self.open_file(name)
        file.truncate(0)
        return file

    def _bigwig(self, track: str) -> Any:
        if track not in self._bigwigs:
            import pyBigWig

            file = self._opened(f"{track}.bw")
            if self._folder is None and isinstance(file.name, str):
                self._folder = os.path.dirname(file.name)
            bigwig = pyBigWig.open(_own_path(file), "w")
            bigwig.addHeader(self.chroms, maxZooms=10)
            self._bigwigs[track] = (file, bigwig)
        return self._bigwigs[track][1]

    def _fires(self, track: str, start: int, values: np.ndarray) -> None:
        above = np.concatenate(([False], values > self.threshold, [False]))
        edges = np.flatnonzero(above[1:] != above[:-1])  # where runs above it start and end, alternating
        going = self._runs.pop(track, None)  # a run the stretch before ended in
        if going is not None and not (len(edges) and edges[0] == 0):  # it ended where this stretch begins
            self._spill(track).add(going[0], start, going[1])  # first: a track's stretches go in order
            going = None
        for a, b in zip(edges[::2].tolist(), edges[1::2].tolist()):
            first, most = start + a, float(values[a:b].max())
            if a == 0 and going is not None:  # it goes on here
                first, most, going = going[0], max(going[1], most), None
            if b == len(values):
                self._runs[track] = (first, most)  # and maybe into the next stretch
            else:
                self._spill(track).add(first, start + b, most)

    def _spill(self, track: str) -> _Spill:
        if track not in self._spills:
            self._spills[track] = _Spill(self._folder)
        return self._spills[track]

    def end_chrom(self, chrom: str, length: int, peaks: dict[str, float]) -> None:
        """`chrom` is done: its stretches still above the threshold end at its end; its BED lines, sorted,
        each scored 0-1000 by its largest value against its track's peak on `chrom` (`peaks`)."""
        for track, run in self._runs.items():
            self._spill(track).add(run[0], length, run[1])
        self._runs = {}
        spills, self._spills = self._spills, {}
        if not spills:
            return
        if self._bed is None:
            self._bed = self._opened("features.bed")
        lines: list[str] = []
        for a, b, track, most in heapq.merge(*(spill.read(track) for track, spill in sorted(spills.items()))):
            lines.append(f"{chrom}\t{a}\t{b}\t{track}\t{_score(most, peaks.get(track, 0.0))}\n")
            if len(lines) >= _LINES:
                self._bed.write("".join(lines).encode())
                lines = []
        self._bed.write("".join(lines).encode())
        for spill in spills.values():
            spill.close()

    def abandon(self) -> None:
        """The job stopped unfinished: every file closed, none named."""
        for file, bigwig in self._bigwigs.values():
            bigwig.close()
            file.close()
        for closing in (self._bed, *self._spills.values()):
            if closing is not None:
                closing.close()
        self._bigwigs, self._bed, self._spills = {}, None, {}

    def close(self) -> list[ResultFile]:
        files = []
        for track, (file, bigwig) in self._bigwigs.items():
            bigwig.close()
            files.append(ResultFile(f"{track}.bw", BIGWIG, os.fstat(file.fileno()).st_size))
            file.close()
        if self._bed is not None:
            self._bed.flush()
            files.append(ResultFile("features.bed", BED, os.fstat(self._bed.fileno()).st_size))
            self._bed.close()
        return files


_INTERVAL = struct.Struct("<qqd")  # a stretch above the threshold on disk: start, end, its largest value
_LINES = 4096  # BED lines written at once


class _Spill:
    """One track's stretches above the threshold on one sequence, in order, in an unnamed file."""

    def __init__(self, folder: str | None) -> None:
        self.file = tempfile.TemporaryFile(dir=folder if folder and os.path.isdir(folder) else None)

    def add(self, start: int, end: int, most: float) -> None:
        self.file.write(_INTERVAL.pack(start, end, most))

    def read(self, track: str) -> Iterator[tuple[int, int, str, float]]:
        self.file.seek(0)
        while chunk := self.file.read(_INTERVAL.size * _LINES):
            for start, end, most in _INTERVAL.iter_unpack(chunk):
                yield start, end, track, most

    def close(self) -> None:
        self.file.close()


def _score(most: float, peak: float) -> int:
    return max(0, min(1000, int(round(1000 * most / peak)))) if peak > 0 else 0


def _own_path(file: IO[bytes]) -> str:
    """A path that opens `file`'s own inode, named or not (a library that opens paths writes into it)."""
    return f"/proc/self/fd/{file.fileno()}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{file.fileno()}"
