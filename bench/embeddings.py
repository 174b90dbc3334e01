"""Embeddings: sequences/s of `embed` on a batch of protein sequences, one device vs two engines or two workers, sorted vs unsorted chunks.

The model is a random ESM-2 masked LM shaped like ESM-2 8M (hidden 320, 6
layers, 20 heads, intermediate 1280, rotary positions, ESM's 33-token
vocabulary written by hand as in tests/support/tiny_models.py), built for the run:
nothing is downloaded. The sequences are random amino-acid strings (the 20
standard residues) with lengths drawn uniformly from 50..500 (seeded), N of
them (`--sequences`, default 256; --quick: 48 of 50..120, three chunks).

Four gateways (`streamgate serve` on that model, `--max-sequences N`) are
started together and measured in turn, round by round: one device
(`--devices cpu`: one engine process), two engines (`--devices cpu,cpu`: a
model copy in each of two engine processes; the job is cut in two parts, one
per engine, backends/spreading.py), two workers on threads (`--engine thread
--devices cpu,cpu`: two copies on two threads of the gateway's process; one
job's chunks shared by both, `Tool.spread` in backends/workers.py), and one
device with twice the torch threads (the same cores as the two copies). Each
gateway gets `--torch-threads` threads per copy (OMP_NUM_THREADS, default 1,
so that two copies on a 2-core machine do not oversubscribe it). One `embed`
job holds all N sequences (pooling mean, the last layer), POSTed to
`/embed/run` and followed to its `data` event; its time is from sending the
request to that event, best of `--repeat` rounds.

Sorting: `embed` plans its chunks of 16 sequences sorted by length, so that a
chunk pads little. In this process, on one loaded copy of the same model, the
chunks are planned both ways (`embed._plan(..., by_length=True/False)`, the
latter in the order sent) and run (`embed._run` over every chunk, under
torch.inference_mode, `--torch-threads` threads): padded tokens computed (the
sum over chunks of rows x width) and the time, both orders in each round.

The results are checked as well as timed: the two engines' and the two
workers' embeddings against the one device's, and the others against it, max
abs difference printed; a difference above 1e-4 is reported and the script
exits 1.

One long sequence: each round, the first three gateways also embed one random
sequence of `--long` residues (default 100,000; --quick: 10,000) in windows of
1,000 residues overlapping by 200 (pooling mean): on two engines its plan's
windows are cut in two runs, one per engine (the `part` param,
backends/spreading.py), on two workers its chunks of windows are shared. Its
vector is checked against the one device's like the others.

Targets: two engines and two workers return the one-device embeddings (max
abs diff <= 1e-4); two engines embed >= 1.8x the sequences/s of one device,
and >= 1.8x its residues/s for one long sequence.
"""

from __future__ import annotations

import contextlib
import io
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

TITLE = "embeddings: sequences/s of one embed job, one device vs two engines or two workers, chunks sorted vs unsorted"
AMINO_ACIDS = "LAGVSERTIDPKQNFYMHWC"
# ESM-2 8M's shape (esm2_t6_8M_UR50D).
HIDDEN, LAYERS, HEADS, INTERMEDIATE, MAX_RESIDUES = 320, 6, 20, 1280, 1024
TOLERANCE = 1e-4  # float32 rounding: what docs/cli.md promises batched and spread results agree to
WARM_UP = 32  # sequences in each gateway's first, untimed job: two chunks, one for each worker


def options(parser) -> None:
    parser.add_argument("--sequences", type=int, default=None, help="Sequences in the job (default 256; --quick: 48).")
    parser.add_argument("--min-length", type=int, default=None, help="Shortest sequence, residues (default 50).")
    parser.add_argument("--max-length", type=int, default=None,
                        help=f"Longest sequence, residues (default 500; --quick: 120; at most {MAX_RESIDUES}).")
    parser.add_argument("--repeat", type=int, default=None, help="Rounds; each figure is the best (default 3; --quick: 1).")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="Torch threads per worker (OMP_NUM_THREADS in the gateways; this process's chunk timing). Default 1.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the sequences and the weights.")
    parser.add_argument("--long", type=int, default=None, help="Residues of the one long sequence (default 100,000; --quick: 10,000).")


def build_model(path: Path, seed: int) -> Path:
    """A random ESM-2 masked LM of ESM-2 8M's shape, with ESM's vocabulary, saved at `path`."""
    import torch
    import transformers as tf

    from tests.support.tiny_models import ESM_VOCAB

    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(ESM_VOCAB) + "\n")
    tokenizer = tf.EsmTokenizer(str(path / "vocab.txt"))
    config = tf.EsmConfig(
        vocab_size=len(ESM_VOCAB), hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE, max_position_embeddings=MAX_RESIDUES + 2, position_embedding_type="rotary",
        pad_token_id=ESM_VOCAB.index("<pad>"), mask_token_id=ESM_VOCAB.index("<mask>"), token_dropout=True,
        emb_layer_norm_before=False,
    )
    torch.manual_seed(seed)
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' progress bar while saving
        tf.EsmForMaskedLM(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def sequences(n: int, low: int, high: int, seed: int) -> list[str]:
    """`n` random amino-acid strings, lengths uniform in low..high."""
    rng = random.Random(seed)
    return ["".join(rng.choices(AMINO_ACIDS, k=rng.randint(low, high))) for _ in range(n)]


def vectors(result: dict[str, Any]) -> np.ndarray:
    return np.asarray(result["embeddings"], dtype=np.float64)


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)))


def _e(value: float) -> str:
    return "0" if value == 0 else f"{value:.1e}"


def _f(value: float) -> str:
    return common.fmt(value, 2)


def _x(value: float | None) -> str:
    return common.fmt(value, 2) + ("x" if value is not None else "")


class ChunkTimer:
    """One copy of the model in this process: `embed`'s chunks planned by length or as sent, and timed."""

    def __init__(self, path: Path, texts: list[str], threads: int, device: str = "cpu") -> None:
        import torch

        from backends import loading as models
        from gateway.tools import embed

        torch.set_num_threads(threads)
        self.torch, self.embed = torch, embed
        with contextlib.redirect_stderr(io.StringIO()):  # transformers' progress bar while loading
            self.model = models.load(models.resolve(str(path)), device)
        self.params = embed.EmbedParams(texts=texts)
        self.chunks = {by_length: embed._plan(self.model, [self.params], None, by_length=by_length) for by_length in (True, False)}
        self.outputs: dict[bool, np.ndarray] = {}
        with torch.inference_mode():  # warm-up: one short chunk
            embed._run(self.model, [self.params], self.chunks[True][-1])

    def padded(self, by_length: bool) -> int:
        return sum(len(chunk.items) * chunk.width for chunk in self.chunks[by_length])

    def real(self) -> int:
        return sum(len(ids) for chunk in self.chunks[True] for ids in chunk.data)

    def run(self, by_length: bool) -> float:
        """Seconds to run every chunk; the embeddings are kept, in the order sent."""
        outputs: dict[tuple[int, int], Any] = {}
        start = time.perf_counter()
        with self.torch.inference_mode():
            for chunk in self.chunks[by_length]:
                outputs.update(zip(chunk.items, self.embed._run(self.model, [self.params], chunk)))
        took = time.perf_counter() - start
        self.outputs[by_length] = np.stack([outputs[0, i] for i in range(len(self.params.texts))]).astype(np.float64)
        return took


CONFIGS = [  # (name, devices, threads per worker as a multiple of --torch-threads, --engine)
    ("one device", "cpu", 1, "process"),
    ("two engines", "cpu,cpu", 1, "process"),
    ("two workers on threads", "cpu,cpu", 1, "thread"),
    ("one device, 2x threads", "cpu", 2, "process"),
]
SPREAD_TARGET = 1.8  # two engines' sequences/s over one device's
LONG = ["one device", "two engines", "two workers on threads"]  # the gateways that embed the one long sequence
LONG_WINDOW, LONG_OVERLAP = 1000, 200


async def run(bench: common.Bench, report: common.Report) -> list[str]:
    """Measure and fill the report; the checks whose embeddings disagree beyond TOLERANCE."""
    args, quick = bench.args, bench.quick
    n = args.sequences or (48 if quick else 256)
    low = args.min_length or 50
    high = min(args.max_length or (120 if quick else 500), MAX_RESIDUES)
    rounds = args.repeat or (1 if quick else 3)
    threads = args.torch_threads
    texts = sequences(n, low, high, args.seed)
    body = msgspec.json.encode({"texts": texts})
    long_n = args.long or (10_000 if quick else 100_000)
    long = {"texts": sequences(1, long_n, long_n, args.seed + 1), "window": LONG_WINDOW, "overlap": LONG_OVERLAP}

    # `--device cuda`: the same set-ups on the GPU (two engines, two workers: two model copies on it).
    device = args.device or "cpu"
    dtype = common.device_flags(args)[2:] if args.device else []  # `--dtype` alone: the devices are named here
    common.step(f"building the model (hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads)")
    path = build_model(bench.dir / "esm2-8m-random", args.seed)
    flags = ["--max-sequences", str(max(n, WARM_UP)), "--max-body-bytes", str(max(1 << 20, 2 * len(body), 2 * long_n)),
             "--job-timeout", "0"]
    gateways = {
        name: bench.streamgate("serve", "--devices", devices.replace("cpu", device), "--engine", engine, *dtype, *flags,
                               model=str(path), name=name.replace(" ", "-").replace(",", ""),
                               env={"OMP_NUM_THREADS": str(threads * times)})
        for name, devices, times, engine in CONFIGS
    }
    common.step(f"loading the model in {len(CONFIGS)} gateways and in this process")
    timer = ChunkTimer(path, texts, threads, device)
    bench.ready(*gateways.values())
    ready = common.readyz(gateways["one device"])
    lengths = [len(t) for t in texts]
    report.fact("machine", common.machine(ready.get("device", "?")))
    params = sum(p.numel() for p in timer.model.module.parameters())
    report.fact("model", f"random ESM-2 masked LM of ESM-2 8M's shape: hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads, "
                f"intermediate {INTERMEDIATE}, rotary, 33-token vocabulary, {params / 1e6:.1f}M parameters "
                f"({ready.get('dtype', '?')})")
    report.fact("sequences", f"{n} random amino-acid strings, lengths uniform in {low}..{high} (seed {args.seed}): "
                f"min {min(lengths)}, median {statistics.median(lengths):g}, mean {statistics.mean(lengths):.0f}, "
                f"max {max(lengths)}; {timer.real()} tokens with <cls> and <eos>")
    report.fact("job", f"one embed job of all {n} (pooling mean, layer -1), chunks of {timer.embed.EMBED_BATCH} sequences")
    report.fact("torch threads", f"{threads} per model copy (OMP_NUM_THREADS={threads} in the one-device, two-engine and "
                f"two-worker gateways, {2 * threads} in the last; torch.set_num_threads({threads}) for the chunk timing here)")
    report.fact("long sequence", f"one random amino-acid string of {long_n} residues, windows of {LONG_WINDOW} "
                f"overlapping by {LONG_OVERLAP} (stitch center), pooling mean")
    report.fact("rounds", f"{rounds}, every configuration and order in turn in each; figures are the best round")

    ports = {name: common.port_of(process) for name, process in gateways.items()}
    warm_up = sorted(texts, key=len)[:WARM_UP]  # the shortest: a quick first pass for every worker
    for name, port in ports.items():
        warm = await common.run_job(port, "/embed/run", {"texts": warm_up})
        if not warm.ok:
            raise RuntimeError(f"the warm-up job on {name} failed: {warm.status} {warm.events[-1:] or ''}")

    seconds: dict[Any, list[float]] = {}
    results: dict[str, np.ndarray] = {}
    for r in range(rounds):
        for name, port in ports.items():
            common.step(f"round {r + 1}/{rounds}: {name}, {n} sequences")
            job = await common.run_job(port, "/embed/run", {"texts": texts})
            if not job.ok:
                raise RuntimeError(f"the embed job on {name} failed: {job.status} {job.events[-1:] or ''}")
            seconds.setdefault(name, []).append(job.latency)
            results[name] = vectors(msgspec.json.decode(job.terminal.data))
        for name in LONG:
            common.step(f"round {r + 1}/{rounds}: {name}, one sequence of {long_n} residues in windows")
            job = await common.run_job(ports[name], "/embed/run", long)
            if not job.ok:
                raise RuntimeError(f"the long embed job on {name} failed: {job.status} {job.events[-1:] or ''}")
            seconds.setdefault(("long", name), []).append(job.latency)
            results[f"long {name}"] = vectors(msgspec.json.decode(job.terminal.data))
        for by_length in (True, False):
            common.step(f"round {r + 1}/{rounds}: chunks {'by length' if by_length else 'as sent'}, in this process")
            seconds.setdefault(by_length, []).append(timer.run(by_length))

    best = {key: min(times) for key, times in seconds.items()}
    base = best["one device"]
    rows = []
    for name, devices, times, engine in CONFIGS:
        rows.append([name, engine, len(devices.split(",")), threads * times, n, _f(best[name]), _f(n / best[name]),
                     _x(common.ratio(base, best[name]))])
    report.table(["configuration", "engine", "copies", "threads each", "sequences", "best s", "sequences/s", "vs one device"],
                 rows, title="Through the gateway: one embed job of every sequence, request to data event")
    report.note("vs one device: its time over this row's (higher is faster); every gateway sorts its chunks by length; "
                "two engines: the job cut in two parts, one per engine process (backends/spreading.py); two workers on "
                "threads: its chunks shared by two threads of one process (Tool.spread)")

    long_base = best["long", "one device"]
    report.table(
        ["configuration", "engine", "copies", "residues", "best s", "residues/s", "vs one device"],
        [[name, engine, len(devices.split(",")), long_n, _f(best["long", name]), _f(long_n / best["long", name]),
          _x(common.ratio(long_base, best["long", name]))] for name, devices, _, engine in CONFIGS if name in LONG],
        title=f"One long sequence in windows: one embed job of {long_n} residues, request to data event",
    )
    report.note("two engines: the plan's windows cut in two runs of consecutive windows, one per engine (`part`), their "
                "sums put together as one engine's; two workers: the job's chunks of windows shared by two threads")

    sorted_s, unsorted_s = best[True], best[False]
    padded = {by_length: timer.padded(by_length) for by_length in (True, False)}
    real = timer.real()
    sort_rows = []
    for label, by_length in (("by length (embed's)", True), ("as sent", False)):
        sort_rows.append([label, len(timer.chunks[by_length]), real, padded[by_length],
                          100 * (padded[by_length] - real) / padded[by_length], _f(best[by_length]),
                          _f(n / best[by_length])])
    sort_rows.append(["as sent / by length", "-", "-", _x(padded[False] / padded[True]), "-",
                      _x(common.ratio(unsorted_s, sorted_s)), _x(common.ratio(sorted_s, unsorted_s))])
    report.table(["chunk order", "chunks", "real tokens", "padded tokens", "padding %", "best s", "sequences/s"],
                 sort_rows, title="Sorting: embed's chunk work on one model in this process")
    report.note("padded tokens: the sum over chunks of rows x width (the longest row); the work is embed._run over "
                "every chunk, without the request, tokenizing, assembly and JSON around it")

    one = results["one device"]
    checks = [
        ("two engines vs one device", max_diff(results["two engines"], one)),
        ("two workers on threads vs one device", max_diff(results["two workers on threads"], one)),
        ("one device, 2x threads vs one device", max_diff(results["one device, 2x threads"], one)),
        ("chunks by length, here vs one device", max_diff(timer.outputs[True], one)),
        ("chunks as sent vs by length, here", max_diff(timer.outputs[False], timer.outputs[True])),
        ("one long sequence, two engines vs one device", max_diff(results["long two engines"], results["long one device"])),
        ("one long sequence, two workers vs one device",
         max_diff(results["long two workers on threads"], results["long one device"])),
    ]
    sizes = [one.size] * (len(checks) - 2) + [results["long one device"].size] * 2
    report.table(["compared", "values", "max abs diff", f"within {TOLERANCE:g}"],
                 [[what, size, _e(diff), "yes" if diff <= TOLERANCE else "NO"] for (what, diff), size in zip(checks, sizes)],
                 title="Checks: the embeddings each way, against each other")
    spread = max(checks[0][1], checks[1][1])
    report.target(f"two engines and two threads return the one-device embeddings (max abs diff <= {TOLERANCE:g})",
                  _e(spread), spread <= TOLERANCE)
    scaled = common.ratio(base, best["two engines"])
    report.target(f"two engines >= {SPREAD_TARGET}x one device's sequences/s", _x(scaled),
                  scaled is not None and scaled >= SPREAD_TARGET)
    long_scaled = common.ratio(long_base, best["long", "two engines"])
    report.target(f"one long sequence: two engines >= {SPREAD_TARGET}x one device's residues/s", _x(long_scaled),
                  long_scaled is not None and long_scaled >= SPREAD_TARGET)
    return [what for what, diff in checks if diff > TOLERANCE]


if __name__ == "__main__":
    common.main(run, TITLE, __doc__, options, disagreed=f"embeddings disagree beyond {TOLERANCE:g}")
