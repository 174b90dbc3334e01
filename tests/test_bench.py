"""The benchmarks under bench/, each run as a user runs it (`python bench/<name>.py --quick`).

Each must finish in time and print its report: the machine, its tables with
the expected columns and numbers in every figure cell, and a `target:` line per
target with a verdict. Whether targets are met is not checked: these run on
shared, noisy machines; bench/RESULTS.md holds the figures of full runs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from tests.support.processes import ROOT, clean_env

TIMEOUT = 150  # each script takes well under a minute on a 2-core machine; this is for a loaded one


@dataclass
class Table:
    title: str | None
    columns: list[str]
    rows: list[dict[str, str]]

    def numbers(self, column: str) -> list[float | None]:
        return [number(row[column]) for row in self.rows]


@dataclass
class Printed:
    facts: dict[str, str] = field(default_factory=dict)
    tables: list[Table] = field(default_factory=list)
    targets: list[tuple[str, str]] = field(default_factory=list)  # (what and figure, verdict)


def number(cell: str) -> float | None:
    """A figure cell: a number (a ratio may end in x), or n/a and - where there is none."""
    if cell in ("n/a", "-"):
        return None
    assert re.fullmatch(r"-?\d+(\.\d+)?x?", cell), f"not a number: {cell!r}"
    return float(cell.rstrip("x"))


def parse(output: str) -> Printed:
    """The report: `name: value` facts at the top, tables (header, dashes, rows), `target:` lines."""
    printed = Printed()
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if re.fullmatch(r"-+(  -+)*", line):
            columns = re.split(r" {2,}", lines[i - 1].strip())
            title = lines[i - 2] if i >= 2 and lines[i - 2] else None
            rows = []
            for row_line in lines[i + 1 :]:
                if not row_line.strip():
                    break
                cells = re.split(r" {2,}", row_line.strip())
                assert len(cells) == len(columns), f"row {row_line!r} does not fit columns {columns}"
                rows.append(dict(zip(columns, cells)))
            printed.tables.append(Table(title, columns, rows))
        elif line.startswith("target: "):
            what, _, verdict = line.removeprefix("target: ").rpartition(": ")
            printed.targets.append((what, verdict))
        elif not printed.tables and ": " in line and not line.startswith(("#", "note:")):
            name, _, value = line.partition(": ")
            printed.facts[name] = value
    return printed


def run_bench(name: str, timeout: float = TIMEOUT) -> Printed:
    proc = subprocess.run(
        [sys.executable, f"bench/{name}.py", "--quick"],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, f"bench/{name}.py --quick exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    printed = parse(proc.stdout)
    assert printed.facts["mode"] == "quick"
    assert re.search(r"\d+ cores, torch \S+, device \S+", printed.facts["machine"]), printed.facts
    assert printed.tables, proc.stdout
    assert printed.targets or name == "polling", proc.stdout
    for what, verdict in printed.targets:
        assert verdict in ("met", "missed", "unavailable"), (what, verdict)
    return printed


def test_streaming():
    printed = run_bench("streaming")
    table, tracing = printed.tables
    assert [row["endpoint"] for row in table.rows] == ["gateway", "bare", "gateway/bare"]
    for column in ("jobs/s", "events/s", "server CPU ms/job", "first event p50 ms", "first event p99 ms", "job p50 ms", "long stream events/s"):
        assert all(value is not None and value > 0 for value in table.numbers(column)), (column, table.rows)
    assert [row["tracing"] for row in tracing.rows] == ["off", "on", "on/off"]
    for column in ("jobs/s", "server CPU ms/job", "engine CPU ms/job", "first event p50 ms", "job p50 ms", "long stream events/s"):
        assert all(value is not None and value > 0 for value in tracing.numbers(column)), (column, tracing.rows)
    # The traced gateway's spans (and its engine's) reached the sink: several a job.
    assert float(re.search(r"([\d.]+) a job$", printed.facts["tracing on"]).group(1)) >= 5, printed.facts["tracing on"]
    assert len(printed.targets) == 3


def test_idle_streams():
    printed = run_bench("idle_streams")
    (table,) = printed.tables
    assert [row["mode"] for row in table.rows] == ["queued", "followers"]
    assert table.numbers("streams") == [500, 500]
    for column in ("RSS before MB", "RSS after MB", "KB/stream", "gateway CPU %", "healthz ms"):
        assert all(value is not None for value in table.numbers(column)), (column, table.rows)
    # Heartbeats are a function, not a figure: every stream held for 3.5 s at a 1 s interval gets some.
    assert table.numbers("with pings") == table.numbers("streams")
    assert [verdict for _, verdict in printed.targets][0] == "unavailable"  # 500 streams cannot meet 10,000


def test_polling():
    printed = run_bench("polling")
    (table,) = printed.tables
    assert [(row["client"], row["period ms"]) for row in table.rows] == [
        ("SSE stream", "-"), ("poll", "50"), ("poll", "250"), ("poll", "1000")
    ]
    requests = table.numbers("requests/job")
    assert requests[0] == 1 and all(r is not None and r >= 2 for r in requests[1:]), requests
    for column in ("delay p50 ms", "delay mean ms", "delay max ms"):
        assert all(value is not None for value in table.numbers(column)), (column, table.rows)


def test_remote_hop():
    printed = run_bench("remote_hop")
    frames, download = printed.tables
    assert [row["gateway"] for row in frames.rows] == ["local", "remote", "added by the hop"]
    assert all(value is not None for value in frames.numbers("emit to client p50 ms"))
    assert download.columns == ["measure", "MB", "time p50 ms", "MB/s"]
    assert all(value is not None and value > 0 for value in download.numbers("MB"))
    assert number(download.rows[0]["MB/s"]) > 0
    assert len(printed.targets) == 2


def test_batching():
    printed = run_bench("batching")
    (table,) = printed.tables
    assert [(row["tool"], row["clients"]) for row in table.rows] == [
        (tool, clients) for tool in ("predict", "loglikelihood", "generate") for clients in ("1", "16")
    ]
    assert all(value is not None and value > 0 for value in table.numbers("batch-1 jobs/s"))
    assert all(value is not None for value in table.numbers("batch-1 p50 ms"))
    assert table.numbers("failed") == [0] * len(table.rows)
    # Without the batching flags the batched side is n/a and its targets unavailable; with them, numbers.
    batched = table.numbers("batched jobs/s")
    assert all(value is None for value in batched) or all(value is not None for value in batched), batched
    assert len(printed.targets) == 6


def test_batching_device_flags():
    """`--device` reaches every server (gateways and peer) as they take it: CUDA in bfloat16 unless told otherwise.

    No GPU runs here; `bench/batching.py --peer litserve` is not run either (making
    the peer's environment takes minutes: bench/peers/README.md).
    """
    from argparse import Namespace

    from bench.common import device_flags

    assert device_flags(Namespace(device=None, dtype=None)) == []
    assert device_flags(Namespace(device="cpu", dtype=None)) == ["--device", "cpu"]
    assert device_flags(Namespace(device="cuda", dtype=None)) == ["--device", "cuda", "--dtype", "bfloat16"]
    assert device_flags(Namespace(device="cuda:1", dtype="float16")) == ["--device", "cuda:1", "--dtype", "float16"]


def test_embeddings():
    printed = run_bench("embeddings")
    gateway, long, sorting, checks = printed.tables
    assert [row["configuration"] for row in gateway.rows] == [
        "one device", "two engines", "two workers on threads", "one device, 2x threads"
    ]
    assert [row["engine"] for row in gateway.rows] == ["process", "process", "thread", "process"]
    assert gateway.numbers("copies") == [1, 2, 2, 1]
    for column in ("best s", "sequences/s"):
        assert all(value is not None and value > 0 for value in gateway.numbers(column)), (column, gateway.rows)
    assert [row["chunk order"] for row in sorting.rows] == ["by length (embed's)", "as sent", "as sent / by length"]
    assert sorting.numbers("chunks")[:2] == [3, 3]  # --quick: 48 sequences, chunks of 16
    real, padded = sorting.numbers("real tokens"), sorting.numbers("padded tokens")
    assert real[0] == real[1] and real[0] is not None
    # Sorting by length never pads more than the order sent; both pad at least the real tokens.
    assert padded[1] is not None and padded[0] is not None and real[0] <= padded[0] <= padded[1]
    assert all(value is not None and value > 0 for value in sorting.numbers("best s"))
    # The embeddings agree every way (the script exits 1 otherwise); a benchmark of wrong results is no benchmark.
    assert [row["configuration"] for row in long.rows] == ["one device", "two engines", "two workers on threads"]
    assert long.numbers("residues") == [10_000] * 3 and all(value is not None and value > 0 for value in long.numbers("residues/s"))
    assert [row[checks.columns[-1]] for row in checks.rows] == ["yes"] * 7
    (agree, agreed), (scale, _), (long_scale, _) = printed.targets
    worst = max(checks.rows[:2], key=lambda row: float(row["max abs diff"]))["max abs diff"]
    assert (agree, agreed) == (f"two engines and two threads return the one-device embeddings (max abs diff <= 0.0001): {worst}", "met")
    # A quick run on a shared machine measures nothing worth a verdict; the full run in bench/RESULTS.md does.
    assert scale == f"two engines >= 1.8x one device's sequences/s: {gateway.rows[1]['vs one device']}"
    assert long_scale == f"one long sequence: two engines >= 1.8x one device's residues/s: {long.rows[1]['vs one device']}"


TOOL_SPEED_CASES = [
    "predict", "loglikelihood", "logprobs", "logit_lens", "lens_grid", "lens_line", "activation_patching",
    "sae_annotate", "sae_annotate sequences", "sae_steer", "embed", "fill_mask", "pseudo_loglikelihood",
]


def test_tool_speed():
    printed = run_bench("tool_speed")
    (table,) = printed.tables
    assert [row["case"] for row in table.rows] == TOOL_SPEED_CASES
    for column in ("gateway ms", "plain ms", "ratio"):
        assert all(value is not None and value > 0 for value in table.numbers(column)), (column, table.rows)
    # Every result agrees with plain torch's (the script exits 1 otherwise): a timing of wrong numbers is no timing.
    assert [row["agree"] for row in table.rows] == ["yes"] * len(TOOL_SPEED_CASES)
    assert all(float(row["max abs diff"]) <= 1e-4 for row in table.rows), table.rows
    assert [what.split(" through ")[0] for what, _ in printed.targets] == TOOL_SPEED_CASES
    assert float(printed.facts["gateway floor"].split(" takes ")[1].split(" ms")[0]) > 0


def test_generation():
    printed = run_bench("generation")
    lone, batched = printed.tables
    assert [row["measure"] for row in lone.rows] == ["partial span", "job time less prefill", "first token"]
    for column in ("gateway p50 ms", "gateway best ms", "plain p50 ms", "plain best ms", "p50 ratio", "best ratio"):
        # job time less prefill is a difference of two latencies: on a busy machine it may come out at or below 0.
        assert all(value is not None for value in lone.numbers(column)), (column, lone.rows)
    gateway, plain = lone.numbers("gateway p50 ms"), lone.numbers("plain p50 ms")
    # The partial span is 0 where a busy machine's client read every partial event in one burst.
    assert gateway[0] >= 0 and gateway[2] > 0 and plain[0] > 0 and plain[2] > 0, lone.rows
    assert batched.numbers("jobs") == [4]  # --quick: one batch size
    for column in ("gateway jobs/s", "generate() jobs/s", "gateway tokens/s", "generate() tokens/s", "CPU us per token event"):
        assert all(value is not None and value > 0 for value in batched.numbers(column)), (column, batched.rows)
    assert re.fullmatch(r"\d/4", batched.rows[0]["same tokens"]), batched.rows
    (speed, speed_verdict), (same, same_verdict) = printed.targets
    assert speed_verdict in ("met", "missed"), speed
    # Greedy through the gateway is plain greedy decoding, token for token.
    assert same_verdict == "met", same


def test_generation_device_and_threads():
    """`--device cuda`: the gateway in bfloat16, the plain side on the device and dtype the gateway reports;
    the threads by flag where `serve` has one (no GPU here)."""
    from argparse import Namespace

    import torch

    from bench.common import device_flags
    from bench.generation import plain_side, threads_flags

    assert device_flags(Namespace(device="cuda", dtype=None)) == ["--device", "cuda", "--dtype", "bfloat16"]
    assert plain_side({"device": "cuda:0", "dtype": "bfloat16"}) == ("cuda:0", torch.bfloat16)
    assert plain_side({"device": "cpu", "dtype": "float32"}) == ("cpu", torch.float32)
    assert threads_flags(3, True) == (["--torch-threads", "3"], None)
    assert threads_flags(2, False) == ([], {"OMP_NUM_THREADS": "2"})


def test_encoding():
    printed = run_bench("encoding")
    (table,) = printed.tables
    assert [row["array"] for row in table.rows] == ["float32, an embed's size", "float64, precision 6", "float32, a lens grid"]
    for column in ("JSON MB", "to_json ms", "msgpack to JSON ms", "a float each ms"):
        assert all(value is not None and value > 0 for value in table.numbers(column)), (column, table.rows)
    # The numbers agree each way (the script exits 1 otherwise).
    assert [row["same numbers"] for row in table.rows] == ["yes"] * 3
    assert printed.targets == [("every array's numbers the same each way: the same", "met")]


SAFETY_ATTACKS = [
    'body: 1 MiB of "\\', "header: 4 MiB", "lens: 400x400, top_k 100", "embed over the budget", "embed under the budget",
    "flood: 200 streams", "cancel a long embed", "10 never-reading followers",
]


def test_safety():
    printed = run_bench("safety")
    (table,) = printed.tables
    assert [row["attack"] for row in table.rows] == SAFETY_ATTACKS
    answers = [row["answer"] for row in table.rows]
    # What each attack is answered is a function, not a figure: each refusal its own 4xx, before any job is made.
    assert answers[:4] == ["400 bad_request", "431 headers_too_large", "413 too_large: top_k", "413 too_large: texts"]
    assert table.numbers("jobs made")[:4] == [0, 0, 0, 0]
    assert answers[4] == answers[7] == "200 data" and answers[6] == "200 error cancelled", answers
    assert re.fullmatch(r"\d+ ran; \d+ got 429 rate_limited", answers[5]), answers[5]
    for column in ("answer ms", "peak RSS over idle MB", "healthz p50 ms", "healthz p99 ms", "bystander max ms", "allowed ms"):
        assert all(value is not None for value in table.numbers(column)), (column, table.rows)
    assert len(printed.targets) == 6


def test_sequences():
    printed = run_bench("sequences")
    parity, length, in_files, picked, top = printed.tables
    assert [(row["window"], row["overlap"], row["stitch"]) for row in parity.rows] == [
        ("64", overlap, stitch) for overlap in ("0", "16") for stitch in ("center", "left", "mean")
    ]
    # Windows that overlap more are closer to the full pass, the stitched states and the strided scores alike.
    for column in ("cos mean", "mean-pooled cos"):
        assert all(value is not None and 0.9 < value <= 1.01 for value in parity.numbers(column)), (column, parity.rows)
    # The tiny Llama adds a BOS before a text: a stride with no overlap scores every token too.
    assert all(value is not None and 0.9 < value <= 1.1 for value in parity.numbers("ppl / full")), parity.rows
    centered = [row for row in parity.rows if row["stitch"] == "center"]
    assert float(centered[-1]["cos mean"]) > float(centered[0]["cos mean"]), centered
    # On a causal model, left keeps the whole overlap before each position, center half of it.
    left = [row for row in parity.rows if row["stitch"] == "left"]
    assert [int(row["least left"]) for row in left] == [0, 16] and [int(row["least left"]) for row in centered] == [0, 8]
    for table in (length, in_files):  # pooled, then per token into a file
        assert [row["residues"] for row in table.rows] == ["1000", "10000", "100000"]
        assert all(value is not None for value in table.numbers("peak RSS over idle MB"))
    assert "safetensors file" in (in_files.title or "")
    for table in (picked, top):  # a DNA model's SAE features, as bigWig tracks: mode pick, then top
        assert [row["bases"] for row in table.rows] == ["1000", "10000", "100000"]
        assert all(value is not None for value in table.numbers("peak RSS over idle MB"))
    assert "mode top" in (top.title or "")


def test_memory():
    printed = run_bench("memory", timeout=300)
    titles = [table.title or "" for table in printed.tables]
    assert [t.split(" ", 1)[0] for t in titles] == ["1.", "2-3.", "4.", "5.", "6.", "7.", "8.", "8."], titles
    sequential, readers, ways, turns, hostile, replicas, windowed, partial_readers = printed.tables
    assert all(value is not None for value in sequential.numbers("over idle MB"))
    assert [row["way"] for row in ways.rows] == ["/logit_lens/run", "/mcp"]
    assert all(row["answered"] == row["calls"] for row in ways.rows), ways.rows  # every call answered whole
    assert [row["tool"] for row in turns.rows] == ["embed", "logprobs", "logit_lens", "generate", "predict"]
    assert all(row["its end"] == "data" for row in turns.rows), turns.rows
    # What each hostile text gets is a function, not a figure: a 413 each time, before it is tokenized.
    assert all(row["answers"].startswith("413 too_long") for row in hostile.rows), hostile.rows
    assert all(value is not None for value in replicas.numbers("over before MB"))
    # Every windowed job read to its end (the script stops at the first that is not a `data`).
    assert windowed.numbers("jobs read")[-1] == 30 and all(value is not None for value in windowed.numbers("over idle MB"))
    assert all(value is not None for value in partial_readers.numbers("over before MB"))
    assert len(printed.targets) == 9


@pytest.mark.vllm
def test_engines():
    printed = run_bench("engines", timeout=900)  # vLLM's first start compiles for about 100 s
    (table,) = printed.tables
    assert [(row["clients"], row["way"]) for row in table.rows] == [
        (clients, way) for clients in ("1", "4") for way in ("bare vLLM", "streamgate over vLLM", "streamgate local")
    ]
    for column in ("tokens/s", "first token p50 ms", "p99 ms"):
        assert all(value is not None and value > 0 for value in table.numbers(column)), (column, table.rows)
    # Over vLLM, the gateway's completions are vLLM's own (the script exits 1 otherwise).
    assert [row["same text as bare"] for row in table.rows[1::3]] == ["1/1", "4/4"]
    assert [what.split(":")[0] for what, _ in printed.targets] == [
        f"streamgate over vLLM{target} at {clients} clients"
        for clients in (1, 4)
        for target in (" >= 0.95x bare vLLM's tokens/s", "'s first token p50 within +10 ms of bare vLLM's")
    ]


def test_priority():
    printed = run_bench("priority")
    wait, share, cost = printed.tables
    assert [row["measure"] for row in wait.rows][:2] == ["predict alone, p50", "predict alone, p99"]
    assert all(value is not None and value > 0 for value in wait.numbers("ms")), wait.rows
    assert [row["class"] for row in share.rows] == ["lab", "students"]
    assert sum(share.numbers("jobs finished")) > 0, share.rows  # type: ignore[arg-type]
    assert [row["gateway"] for row in cost.rows] == ["classes", "no classes"]
    assert all(value is not None and value > 0 for value in cost.numbers("jobs/s (median)")), cost.rows
    assert len(printed.targets) == 4


def test_institution():
    printed = run_bench("institution")
    memory, answers = printed.tables
    assert [int(n) for n in memory.numbers("users")] == list(range(60, 601, 60))
    assert all(value is not None for value in memory.numbers("over idle MB"))
    # Below the caps in --quick: every user's run is taken with its webhook, none refused.
    assert [(row["answer"], row["runs"]) for row in answers.rows] == [("200, its webhook open", "600")]
    assert len(printed.targets) == 2 and printed.targets[1][1] == "met"
