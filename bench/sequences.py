"""Sequences over the context: how far windowed numbers are from a full pass, and what length costs.

Two cases, each on its own `streamgate serve`:

1. parity: the default model (SmolLM2-135M-Instruct; --quick the tests' tiny Llama, whose numbers
   mean nothing but the code path), a real English text (docs/operations.md, cut to about
   `--tokens` tokens: 2,048; --quick 300) that the model takes whole. The full pass is `embed`
   (pooling per_token, the last layer) and `logprobs` without a window; then for each window
   (256 and 512; --quick 64), overlap (0, an eighth, a quarter, a half of the window; --quick 0
   and a quarter) and rule (center, left, mean)
   the same with `window`, `overlap` and `stitch`: per position the max abs
   difference of the states and their cosine (mean, least, and the share of positions at 0.99 or
   more), the cosine of the mean-pooled vectors (`pooling: mean`, computed over the stitched
   states), and the perplexity (exp of the mean negative log-probability of every token after the
   first) with a stride (each token scored in the first window that holds it with `overlap` tokens
   before it) against the full one. From the plan the answer states: the share of positions cut
   short (less left context than the full pass gave them: a causal model's state depends on its
   left context alone) and the least left context such a position had.
2. length: a tiny random ESM-2 (the tests', hidden 32, a 256-token context) and random protein
   sequences of 10^3 to 10^6 residues (--quick: to 10^5), each one `embed` job with `window: 0`
   (the model's context), pooling mean, then pooling per_token written as a safetensors file
   (10^6 residues: 136 MB of vectors, token ids and context): the job's time, per 1,000 residues,
   and the peak resident memory of the gateway and its engine over their idle memory (the peak
   counters reset before each job).
3. DNA: the tests' Evo2-style byte-level DNA model (tests/support/custom_model.py `load_dna`,
   width 32, a 512-token context) with a random ReLU SAE of 64 features on its layer 1, and random
   DNA of 10^3 to 10^6 bases (--quick: to 10^5), each one `sae_annotate` job with `window: 0`
   written as bigWig tracks and a BED (`file: bigwig`): mode pick (4 features, one run of the
   windows) and mode top (k 5, two runs: the first finds the features). Time per 1,000 bases and
   peak RSS over idle, as in 2.

Targets: none for parity, which is measured, not bounded (docs/sequences.md shows the table and
how to choose an overlap); for length and DNA (the issue's), peak RSS flat in the length (at 10^6 within
+64 MB of 10^3's) and time linear (per 1,000 residues or bases within 1.5x of 10^4's).
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

TITLE = "sequences: windowed against a full pass, and memory and time against length"
ROOT = Path(__file__).resolve().parents[1]
AMINO_ACIDS = "LAGVSERTIDPKQNFYMHWC"
FLAT_MB = 64  # peak RSS at 10^6 residues over 10^3's, at most
LINEAR = 1.5  # time per 1,000 residues over 10^4's, at most


def options(parser: Any) -> None:
    parser.add_argument("--tokens", type=int, default=None, help="Tokens of the parity text, about (default 2048; --quick 300).")
    parser.add_argument("--cases", default="1,2,3", help="Which cases to run, by number (default all).")


async def answer(port: int, tool: str, params: dict[str, Any]) -> Any:
    """The job's result, or its refusal as `(status, code)`."""
    run = await common.run_job(port, f"/{tool}/run", params)
    if run.ok:
        assert run.terminal is not None
        return msgspec.json.decode(run.terminal.data)
    body = run.terminal.data if run.terminal is not None else run.body
    try:
        code = msgspec.json.decode(body)["error"]["code"]
    except (msgspec.DecodeError, KeyError, TypeError):
        code = body[:200].decode(errors="replace")
    return run.status, code


def perplexity(scored: dict[str, Any]) -> float:
    logprobs = [lp for lp in scored["sequences"][0]["logprobs"] if lp is not None]
    return math.exp(-sum(logprobs) / len(logprobs))


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


async def parity(bench: common.Bench, report: common.Report) -> list[str]:
    model = bench.model(default_tiny=False)
    gateway = bench.streamgate("serve", model=model, name="parity")
    bench.ready(gateway)
    port, info = common.port_of(gateway), common.readyz(gateway)
    tokens = bench.args.tokens or (300 if bench.quick else 2048)
    source = (ROOT / "docs" / "operations.md").read_text()
    chars = tokens * 4  # about 4 characters a token in English; the count below is the model's
    while True:
        text = source[:chars]
        common.step(f"parity: the full pass over {len(text)} characters")
        full = await answer(port, "embed", {"texts": [text], "pooling": "per_token"})
        if full != (413, "too_long"):
            break
        chars = chars * 3 // 4  # more tokens than the model takes: a shorter text
    assert isinstance(full, dict), full
    states = np.asarray(full["embeddings"][0], dtype=np.float64)
    n = len(states)
    pooled = np.asarray((await answer(port, "embed", {"texts": [text], "pooling": "mean"}))["embeddings"][0])
    whole_ppl = perplexity(await answer(port, "logprobs", {"prompts": [text]}))
    sizes = (64,) if bench.quick else (256, 512)
    rows, failed = [], []
    for window in sizes:
        for overlap in (0, window // 4) if bench.quick else (0, window // 8, window // 4, window // 2):
            common.step(f"parity: window {window}, overlap {overlap}")
            scored = await answer(port, "logprobs", {"prompts": [text], "window": window, "overlap": overlap})
            ppl_text = f"{perplexity(scored):.3f}" if isinstance(scored, dict) else f"{scored[0]} {scored[1]}"
            ratio_text = f"{perplexity(scored) / whole_ppl:.4f}" if isinstance(scored, dict) else "-"
            for stitch in ("center", "left", "mean"):
                params = {"texts": [text], "window": window, "overlap": overlap, "stitch": stitch}
                got = await answer(port, "embed", {**params, "pooling": "per_token"})
                if not isinstance(got, dict):
                    failed.append(f"window {window} overlap {overlap} {stitch}: {got}")
                    continue
                windowed = np.asarray(got["embeddings"][0], dtype=np.float64)
                if windowed.shape != states.shape:
                    failed.append(f"window {window} overlap {overlap} {stitch}: shape {windowed.shape} against {states.shape}")
                    continue
                cos = cosines(windowed, states)
                # Left context is what a causal model's state depends on: the least any position had
                # where the full pass gave it more.
                left = np.asarray(got["context"][0])[:, 0]
                short = left < np.arange(n)
                least = int(left[short].min()) if short.any() else None
                mean = np.asarray((await answer(port, "embed", {**params, "pooling": "mean"}))["embeddings"][0])
                rows.append([
                    window, overlap, stitch, len(got["plans"][0]["windows"]),
                    f"{np.abs(windowed - states).max():.3g}", f"{cos.mean():.5f}", f"{cos.min():.4f}",
                    f"{np.mean(cos >= 0.99) * 100:.1f}", f"{np.mean(short) * 100:.1f}", least,
                    f"{cosines(mean[None], pooled[None])[0]:.6f}", ppl_text, ratio_text,
                ])
    report.table(
        ["window", "overlap", "stitch", "windows", "max abs diff", "cos mean", "cos least", "% cos>=0.99",
         "% cut short", "least left", "mean-pooled cos", "ppl (stride)", "ppl / full"],
        rows,
        title=f"1. windowed against the full pass: {n} tokens of docs/operations.md, full perplexity {whole_ppl:.3f}",
    )
    report.fact("parity model", f"{info['model']} ({info['device']}, {info['dtype']}), context {info['context_length']}")
    common.stop(gateway)
    return failed


def protein(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choices(AMINO_ACIDS, k=n))


def peak_mb(pids: list[int]) -> float:
    return sum(common.rss_kb(pid, "VmHWM") for pid in pids) / 1024


async def length(bench: common.Bench, report: common.Report) -> None:
    from tests.support.tiny_models import build

    path = build("esm_mlm", bench.dir / "esm")
    gateway = bench.streamgate("serve", "--max-body-bytes", str(4 << 20), model=str(path), name="length")
    cases = [
        (f"pooling {pooling}", {"pooling": pooling, **extra}, f"embed (window 0, {what}) on a tiny ESM-2")
        for pooling, extra, what in [
            ("mean", {}, "pooling mean"),
            ("per_token", {"file": "safetensors"}, "pooling per_token, written as a safetensors file"),
        ]
    ]
    await lengths(bench, report, gateway, "embed", "texts", protein, cases, "residues", "2")


async def dna(bench: common.Bench, report: common.Report) -> None:
    from bench.tool_speed import make_sae

    sae, _ = make_sae(bench.dir / "sae", d_model=32, n_features=64, layer=1)
    gateway = bench.streamgate(
        "serve", "--max-body-bytes", str(4 << 20), "--model-loader", "dna=tests.support.custom_model:load_dna", "--sae", str(sae),
        model=None, name="dna",
    )
    params = {"window": 0, "file": "bigwig", "threshold": 0.5}
    cases = [
        ("mode pick", {"mode": "pick", "feature_ids": [0, 7, 21, 42], **params}, "sae_annotate (window 0, mode pick, 4 features, bigWig)"),
        ("mode top", {"mode": "top", "k": 5, **params}, "sae_annotate (window 0, mode top, k 5, bigWig)"),
    ]
    await lengths(bench, report, gateway, "sae_annotate", "sequences", bases, cases, "bases", "3")


def bases(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choices("ACGT", k=n))


async def lengths(
    bench: common.Bench, report: common.Report, gateway: Any, tool: str, field: str, sequence: Any,
    cases: list[tuple[str, dict[str, Any], str]], unit: str, number: str,
) -> None:
    """One `tool` job of each length from 10^3 to 10^6 (--quick 10^5) for each case: its time and peak RSS."""
    bench.ready(gateway)
    port = common.port_of(gateway)
    engines = common.readyz(gateway).get("engines", [])
    pids = [gateway.proc.pid, *(e["pid"] for e in engines if e.get("pid"))]
    await answer(port, tool, {field: [sequence(1000, 1)], **cases[0][1]})  # warm
    idle = sum(common.rss_kb(pid) for pid in pids) / 1024
    for name, params, what in cases:
        rows, figures = [], {}
        for exponent in range(3, 6 if bench.quick else 7):
            n = 10**exponent
            common.step(f"{tool}: {n} {unit}, {name}")
            for pid in pids:
                common.reset_peak_rss(pid)
            started = time.perf_counter()
            got = await answer(port, tool, {field: [sequence(n)], **params})
            seconds = time.perf_counter() - started
            peak = peak_mb(pids) - idle
            common.step("  peak MB by process (gateway, engine): " + ", ".join(f"{common.rss_kb(pid, 'VmHWM') / 1024:.0f}" for pid in pids))
            done = isinstance(got, dict) and ("files" not in params or sum(f["size"] for f in got["files"]) >= n * 4)
            if isinstance(got, dict):
                plans = got["plans"] if "plans" in got else [s["plan"] for s in got["sequences"]]
                windows: Any = len(plans[0]["windows"])
            else:
                windows = f"{got[0]} {got[1]}"
            figures[n] = (seconds, peak, done)
            rows.append([n, windows, seconds, f"{seconds / n * 1e6:.1f}", peak])
        report.table([unit, "windows", "seconds", "ms per 1,000", "peak RSS over idle MB"], rows,
                     title=f"{number}. {what}: one job of each length (idle {idle:.0f} MB)")
        longest = max(figures)
        ok = all(done for _, _, done in figures.values())
        flat = figures[longest][1] - figures[1000][1]
        report.target(f"{tool} {name}: peak RSS at {longest} {unit} within +{FLAT_MB} MB of 1,000's", f"+{flat:.0f} MB", ok and flat <= FLAT_MB)
        base = figures[10_000][0] / 10_000
        worst = max(seconds / n / base for n, (seconds, _, _) in figures.items() if n >= 10_000)
        report.target(f"{tool} {name}: time per position within {LINEAR}x of 10,000's from 10,000 on", f"at most {worst:.2f}x", ok and worst <= LINEAR)
    common.stop(gateway)


async def run(bench: common.Bench, report: common.Report) -> list[str]:
    cases = {case.strip() for case in bench.args.cases.split(",")}
    failed: list[str] = []
    if "1" in cases:
        failed += await parity(bench, report)
    if "2" in cases:
        await length(bench, report)
    if "3" in cases:
        await dna(bench, report)
    report.fact("machine", common.machine("cpu"))
    return failed


if __name__ == "__main__":
    common.main(run, TITLE, __doc__, options, disagreed="windowed runs failed")
