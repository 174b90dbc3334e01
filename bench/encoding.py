"""Results as JSON: how fast the arrays of a large result become the numbers a client reads.

A tool's arrays (an embedding matrix, a lens grid) are written as JSON numbers,
float32 in its shortest exact form (`gateway/encoding.py`, with orjson), and a
remote gateway writes them again from the executor's msgpack. Side by side in
one process, on the same arrays: this code (`to_json`, and `to_json` of
`from_msgpack`, the remote gateway's step), against the way it went before,
through a Python float per number (float32: numpy's shortest text of each
value read back as float64; float64: `tolist`), each encoded by msgspec. Each
figure is the best of a few runs; the values each way are compared number
for number, and the run fails if any differs.

The arrays: 2 M float32 (the size of an `embed` with `pooling: none` of 256
texts; --quick: 205 k), the same rounded to 6 decimals as float64 (what
`precision` gives), and a 30 × 9 × 64 float32 grid (a lens result's size).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

TITLE = "encoding: arrays of a result as JSON, this code vs a Python float per number"


def python_floats(array: np.ndarray) -> bytes:
    """The way before: a Python float per number (float32 by its numpy text), then msgspec."""
    values = array.astype(str).astype(np.float64) if array.dtype == np.float32 else array
    return msgspec.json.encode({"x": values.tolist()})


def best_of(rounds: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(rounds):
        started = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - started)
    return best, out


async def run(bench: common.Bench, report: common.Report) -> list[str]:
    from gateway.encoding import from_msgpack, to_json, to_msgpack

    rounds = 2 if bench.quick else 3
    n = 256 * (800 if bench.quick else 7_800)
    rng = np.random.default_rng(0)
    embedding = rng.standard_normal(n).astype(np.float32).reshape(256, -1)
    cases = {
        "float32, an embed's size": embedding,
        "float64, precision 6": np.round(embedding.astype(np.float64), 6),
        "float32, a lens grid": rng.standard_normal((30, 9, 64)).astype(np.float32),
    }
    report.fact("machine", common.machine("cpu"))
    report.fact("arrays", ", ".join(f"{name} {array.shape} ({array.size:,} numbers)" for name, array in cases.items()))
    rows, disagreed = [], []
    for name, array in cases.items():
        common.step(name)
        packed = to_msgpack({"x": array})
        ours_s, ours = best_of(rounds, lambda: to_json({"x": array}))
        hop_s, hop = best_of(rounds, lambda: to_json(from_msgpack(packed)))
        before_s, before = best_of(rounds, lambda: python_floats(array))
        same = [np.array_equal(np.asarray(msgspec.json.decode(out)["x"], np.float64),
                               np.asarray(msgspec.json.decode(before)["x"], np.float64)) for out in (ours, hop)]
        if not all(same):
            disagreed.append(name)
        mb = len(ours) / 1e6
        rows.append([name, mb, 1000 * ours_s, mb / ours_s, 1000 * hop_s, mb / hop_s, 1000 * before_s, mb / before_s,
                     f"{before_s / ours_s:.1f}x", "yes" if all(same) else "no"])
    report.table(["array", "JSON MB", "to_json ms", "to_json MB/s", "msgpack to JSON ms", "msgpack to JSON MB/s",
                  "a float each ms", "a float each MB/s", "to_json speed-up", "same numbers"], rows)
    report.note("to_json: gateway.encoding.to_json of {'x': array}, as a local backend writes a result; msgpack to "
                "JSON: the same from the executor's msgpack, as a remote gateway writes it; a float each: the way "
                "before, numpy's text of each float32 (or float64's tolist) through msgspec; best of "
                f"{rounds}, one thread")
    report.target("every array's numbers the same each way", "the same" if not disagreed else
                  f"differ for {', '.join(disagreed)}", not disagreed)
    return disagreed


if __name__ == "__main__":
    common.main(run, TITLE, __doc__, disagreed="the JSON numbers differ")
