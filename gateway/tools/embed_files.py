"""`embed`'s per-token vectors written to result files as they are computed (`file`): safetensors or
npy, each window's share at its place, so that a job holds one window's rows whatever the length.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from gateway.protocol import ResultFile
from gateway.tools import windows
from gateway.tools.base import Context
from gateway.tools.embed_params import EmbedParams, FileFormat
from gateway.tools.files import NPY, Array, ArrayFile
from gateway.tools.windows import WindowPlan


def file_arrays(i: int, n: int, width: int, windowed: bool) -> list[Array]:
    """Text `i`'s arrays in a result file: its `n` vectors of `width`, their token ids, and their context."""
    arrays = [Array(f"embeddings.{i}", np.dtype("<f4"), (n, width)), Array(f"token_ids.{i}", np.dtype("<i4"), (n,))]
    if windowed:
        arrays.append(Array(f"context.{i}", np.dtype("<i4"), (n, 2)))
    return arrays


class EmbedFiles:
    """A job's per-token vectors written to its result files as they are computed (`file`): each
    window's share at its place, so that the job holds one window's rows, whatever the length.

    The files are opened at the first rows, whose width is the vectors'. Shares that overlap
    (`mean`) are added where they fall, normalized (`normalize`) once all are in; the others are
    final as they come."""

    def __init__(self, ctx: Context, params: EmbedParams, lengths: list[int]) -> None:
        self.ctx, self.params, self.lengths = ctx, params, lengths
        self.windowed = params.window is not None
        self.files: dict[str, ArrayFile] = {}  # by array name
        self.width = 0
        self.summed = False  # some rows were added, not written: normalized at the end
        self._lock = threading.Lock()

    def _open(self, width: int) -> None:
        with self._lock:
            if self.files:
                return
            self.width = width
            arrays = [a for i, n in enumerate(self.lengths) for a in file_arrays(i, n, width, self.windowed)]
            meta = {"layer": str(self.params.layer), "pooling": "per_token", "dim": str(width)}
            if FileFormat(self.params.file) is FileFormat.NPY:
                for a in arrays:
                    name = f"{a.name.rsplit('.', 1)[0]}.npy"
                    self.files[a.name] = ArrayFile(self.ctx.file(name), name, NPY, [a])
            else:
                shared = ArrayFile(self.ctx.file("embeddings.safetensors"), "embeddings.safetensors", "safetensors", arrays, meta)
                self.files = dict.fromkeys((a.name for a in arrays), shared)

    def put(self, i: int, start: int, rows: np.ndarray, ids: list[int], summed: bool, normalized: bool = False) -> None:
        """Text `i`'s rows from position `start`; `summed`: one weighted share of positions others share too."""
        self._open(rows.shape[-1])
        if summed:
            self.summed = True
            self.files[f"embeddings.{i}"].add(f"embeddings.{i}", start, rows)
        else:
            if self.params.normalize and not normalized:
                rows = _normalized(rows)
            self.files[f"embeddings.{i}"].write(f"embeddings.{i}", start, rows)
        self.files[f"token_ids.{i}"].write(f"token_ids.{i}", start, np.asarray(ids, dtype=np.int32))

    def close(self, plans: list[WindowPlan] | None) -> list[ResultFile]:
        """The context arrays written, summed rows normalized, the files closed: what the result names."""
        if plans is not None:
            for i, plan in enumerate(plans):
                for start in range(0, self.lengths[i], CONTEXT_ROWS):
                    stop = min(self.lengths[i], start + CONTEXT_ROWS)
                    self.files[f"context.{i}"].write(f"context.{i}", start, windows.context(plan.windows, plan.stitch, start, stop))
        if self.summed and self.params.normalize:
            for i, n in enumerate(self.lengths):
                for start in range(0, n, NORMALIZE_ROWS):
                    stop = min(n, start + NORMALIZE_ROWS)
                    self.files[f"embeddings.{i}"].write(f"embeddings.{i}", start, _normalized(self.files[f"embeddings.{i}"].read(f"embeddings.{i}", start, stop)))
        closed: dict[int, ResultFile] = {}
        for file in self.files.values():
            if id(file) not in closed:
                closed[id(file)] = file.close()
        return list(closed.values())


NORMALIZE_ROWS = 4096  # rows read back at once to normalize a file's summed vectors
CONTEXT_ROWS = 1 << 16  # positions' context computed and written at once (1 MB)


def _normalized(rows: np.ndarray) -> np.ndarray:
    return torch.nn.functional.normalize(torch.from_numpy(np.ascontiguousarray(rows)), dim=-1).numpy()
