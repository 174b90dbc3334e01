"""Batch runs from files: `streamgate run TOOL --input FILE --output OUT`, and `run_many` in the Python clients.

The CLI runs as a subprocess (as a user runs it) against real gateways in this
process: the tiny ESM-2 masked LM for FASTA files of proteins, the tiny causal
LM with the test tools for JSONL files, resumes and the clients. Input files
are generated here, deterministically.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from gateway.client import asynchronous, synchronous
from gateway.client import AsyncClient, Client, HttpError, JobError, Outcome
from gateway.cli.records import Record, RecordError, detect_format, read_fasta, read_jsonl, read_records
from gateway.tools import load_module
from tests.conftest import Server, make_server, track_jobs, wait_until
from tests.test_observability import scrape, value
from tests.support.processes import ROOT, STREAMGATE, clean_env, free_port

CLI_TIMEOUT = 300
ESM_ALPHABET = "LAGVSERTIDPKQNFYMHWC"  # ESM-2's amino acids
ECHO_TOOLS = load_module("tests.support.user_tools")  # echo (with a delay per copy) and fail


def cli(*args: str, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(STREAMGATE), *args], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=timeout
    )


def proteins(count: int, seed: int = 0, longest: int = 240) -> list[tuple[str, str]]:
    """`count` (id, sequence) pairs of ESM-2 letters, lengths 1 to `longest` (all within the tiny model's context)."""
    rng = random.Random(seed)
    return [(f"P{i:05d}", "".join(rng.choice(ESM_ALPHABET) for _ in range(rng.randint(1, longest)))) for i in range(count)]


def write_fasta(path: Path, records: list[tuple[str, str]], width: int = 60, newline: str = "\n") -> Path:
    """A FASTA file with a description on each header and sequences wrapped at `width` columns."""
    lines = []
    for name, sequence in records:
        lines.append(f">{name} test protein {name.lower()}")
        lines += [sequence[i : i + width] for i in range(0, len(sequence), width)] or [""]
    path.write_bytes((newline.join(lines) + newline).encode())
    return path


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def outcomes_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def jobs_total(url: str) -> float:
    """Every job the gateway has ended, from /metrics' streamgate_jobs_total (refusals are no jobs)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("streamgate_jobs_total{"))


def assert_same_embedding(batched: dict[str, Any], alone: dict[str, Any]) -> None:
    """A result from a batch equals the one the record gets alone: every field, the vectors to float32 rounding.

    The gateway batches the jobs that wait together into one padded forward pass, which can round a
    float32 differently in the last bits (docs/cli.md: "to float32 rounding"); test_batch_results_are_exact
    checks the same path, unbatched, for exact equality.
    """
    assert {k: v for k, v in batched.items() if k != "embeddings"} == {k: v for k, v in alone.items() if k != "embeddings"}
    np.testing.assert_allclose(np.array(batched["embeddings"]), np.array(alone["embeddings"]), rtol=0, atol=2e-6)


def jobs_at_once(server: Server) -> tuple[dict[str, Any], list[int]]:
    """Record each job the gateway accepts from now on, and at each how many of them have not ended (itself included)."""
    jobs = track_jobs(server)
    counts: list[int] = []
    submit = server.backend.submit

    async def counting_submit(job: Any) -> None:
        await submit(job)
        counts.append(sum(1 for j in jobs.values() if not j.done))

    server.backend.submit = counting_submit
    return jobs, counts


@pytest.fixture(scope="module")
def esm_path(tiny: Callable[..., Path]) -> Path:
    return tiny("esm_mlm")


@pytest.fixture(scope="module")
def esm(esm_path: Path) -> Iterator[Server]:
    """A gateway on the tiny ESM-2 masked LM (context 256 residues), batching as by default."""
    server = make_server(esm_path)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def lm(tiny_model_path: Path) -> Iterator[Server]:
    """A gateway on the tiny causal LM with the test tools (echo, fail)."""
    server = make_server(tiny_model_path, tools=ECHO_TOOLS)
    yield server
    server.stop()


# -- reading input files ------------------------------------------------------------------------


def test_fasta_records_join_wrapped_lines_and_take_blank_lines_and_windows_line_ends(tmp_path):
    text = "\r\n".join([">a first one", "MKTA", "yiak", "", ">b", "", "GG ", ">c\tdescription after a tab", "A", ""])
    (tmp_path / "x.fa").write_bytes(("\ufeff" + text).encode())
    assert read_fasta(tmp_path / "x.fa") == [
        Record("a", 1, "MKTAyiak", "first one"),  # as written: the server upper-cases and checks
        Record("b", 5, "GG"),
        Record("c", 8, "A", "description after a tab"),
    ]
    records = proteins(50)
    with gzip.open(tmp_path / "p.faa.gz", "wt") as f:
        f.write(write_fasta(tmp_path / "p.faa", records, width=7).read_text())
    for name in ("p.faa", "p.faa.gz"):
        assert [(r.id, r.sequence) for r in read_records(tmp_path / name)] == records


@pytest.mark.parametrize(
    ("text", "line", "says"),
    [
        ("MKT\n>a\nAA\n", 1, "a sequence before any header"),
        ("\n\n>a\nAA\n>\nGG\n", 5, "a header with no id"),
        (">a\nAA\n>b\nCC\n>a x\nGG\n", 5, "the id 'a' again (first on line 1)"),
    ],
)
def test_a_fasta_file_that_is_not_records_names_the_line(tmp_path, text, line, says):
    (tmp_path / "bad.fasta").write_text(text)
    with pytest.raises(RecordError) as caught:
        read_fasta(tmp_path / "bad.fasta")
    assert caught.value.line == line and says in str(caught.value)
    assert str(caught.value).startswith(f"{tmp_path / 'bad.fasta'}:{line}: ")


def test_jsonl_records_take_their_id_key_or_their_line_number(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"id": "q1", "prompt": "a"}, "", {"prompt": "b"}, {"id": 7, "prompt": "c"}])
    assert [(r.id, r.line, r.params) for r in read_jsonl(path)] == [
        ("q1", 1, {"prompt": "a"}), ("3", 3, {"prompt": "b"}), ("7", 4, {"prompt": "c"}),
    ]
    # A tool with an `id` param of its own keeps it: records are named by their lines.
    assert [(r.id, r.params.get("id")) for r in read_jsonl(path, id_key=False)] == [("1", "q1"), ("3", None), ("4", 7)]
    for rows, says in [
        ([{"prompt": "a"}, "{nope"], "2: not valid JSON"),
        ([[1, 2]], "1: expected a JSON object"),
        ([{"id": "x"}, {"id": "x"}], "2: the id 'x' again (first on line 1)"),
        ([{"id": None}], "1: the id must be"),
    ]:
        with pytest.raises(RecordError, match=re.escape(says)):
            read_jsonl(write_jsonl(tmp_path / "bad.jsonl", rows))


def test_the_format_comes_from_the_extension():
    assert [detect_format(n) for n in ("a.fasta", "a.FA", "a.faa.gz", "a.fna", "a.fas", "a.jsonl", "a.ndjson.gz")] == [
        "fasta", "fasta", "fasta", "fasta", "fasta", "jsonl", "jsonl",
    ]
    assert detect_format("a.txt") is None and detect_format("a.gz") is None


# -- FASTA → embeddings, through the CLI ----------------------------------------------------------


def test_a_fasta_file_of_proteins_becomes_embeddings_in_input_order_and_a_second_run_skips_them(esm, tmp_path):
    records = proteins(998)
    records.insert(317, ("bad", "MKT#@!AY"))  # not amino acids
    records.insert(702, ("long", "".join(random.Random(1).choice(ESM_ALPHABET) for _ in range(400))))  # past 256
    fasta = write_fasta(tmp_path / "proteins.fasta", records)
    out = tmp_path / "embeddings.jsonl"
    jobs_before = jobs_total(esm.url)
    _, at_once = jobs_at_once(esm)

    started = time.monotonic()
    proc = cli("run", "embed", "--input", str(fasta), "--output", str(out), "--url", esm.url)
    first_run_s = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr  # two records failed
    assert proc.stdout == ""
    lines = outcomes_of(out)
    assert len(lines) == 1000
    assert [line["id"] for line in lines] == [name for name, _ in records]
    by_id = {line["id"]: line for line in lines}
    assert by_id["long"]["error"]["code"] == "too_long" and by_id["long"]["error"]["status"] == 413
    assert "result" not in by_id["long"]
    assert by_id["bad"]["error"]["code"] == "invalid_params", by_id["bad"]  # the server's alphabet check
    assert by_id["bad"]["error"]["status"] == 422 and "'#'" in by_id["bad"]["error"]["message"]
    good = [line for line in lines if line["id"] not in ("bad", "long")]
    assert all(set(line) == {"id", "result"} and line["result"]["dim"] == 32 for line in good)
    assert "998 succeeded, 2 failed" in proc.stderr
    assert "failed: bad: 422 invalid_params" in proc.stderr and "failed: long: 413 too_long" in proc.stderr
    # One job per good record; the refused ones never became jobs.
    assert jobs_total(esm.url) - jobs_before == 998
    # At most the gateway's batch size at once (32, from GET /readyz), the default --concurrency.
    assert 8 < max(at_once) <= 32

    # Each result is the one the record gets run alone.
    sequences = dict(records)
    with Client(esm.url) as client:
        for name, _ in random.Random(2).sample([r for r in records if r[0] not in ("bad", "long")], 10):
            assert_same_embedding(by_id[name]["result"], client.run("embed", {"texts": [sequences[name]]}))

    # Again: the records with a result are skipped, the failed two run (and fail) again.
    jobs_before = jobs_total(esm.url)
    started = time.monotonic()
    again = cli("run", "embed", "--input", str(fasta), "--output", str(out), "--url", esm.url)
    second_run_s = time.monotonic() - started
    assert again.returncode == 1, again.stderr
    assert "0 succeeded, 2 failed, 998 done before" in again.stderr
    assert jobs_total(esm.url) == jobs_before  # nothing submitted that became a job
    assert outcomes_of(out) == lines
    print(f"\n1,000 records: first run {first_run_s:.1f} s, second {second_run_s:.1f} s")


def test_batch_results_are_exact(esm_path, tmp_path):
    """Without batching on the gateway, a record's line holds exactly what a single run of it gives."""
    server = make_server(esm_path, max_batch_size=1)
    try:
        records = proteins(24, seed=5)
        out = tmp_path / "out.jsonl"
        proc = cli("run", "embed", "--input", str(write_fasta(tmp_path / "p.fa", records)), "--output", str(out),
                   "--url", server.url, "--concurrency", "6")
        assert proc.returncode == 0, proc.stderr
        with Client(server.url) as client:
            assert outcomes_of(out) == [
                {"id": name, "result": client.run("embed", {"texts": [sequence]})} for name, sequence in records
            ]
    finally:
        server.stop()


def test_a_list_param_or_a_string_param_takes_the_sequence_with_extra_params(esm, tmp_path):
    records = proteins(6, seed=3, longest=30)
    fasta = write_fasta(tmp_path / "p.fasta", records)
    # embed's texts (a list: [sequence]) with pooling and normalize from the command line.
    out = tmp_path / "cls.jsonl"
    proc = cli("run", "embed", "pooling=cls", "normalize=true", "--input", str(fasta), "--output", str(out),
               "--url", esm.url, "--quiet")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = outcomes_of(out)
    assert all(line["result"]["pooling"] == "cls" for line in lines)
    assert all(abs(np.linalg.norm(line["result"]["embeddings"][0]) - 1) < 1e-5 for line in lines)
    # logit_lens's prompt is a string: the sequence itself; --json gives the rest, --model names the model.
    out = tmp_path / "lens.jsonl"
    model = httpx.get(esm.url + "/readyz", timeout=30).json()["model"]
    proc = cli("run", "logit_lens", "--json", '{"top_k": 2}', "--model", model, "--input", str(fasta),
               "--output", str(out), "--url", esm.url)
    assert proc.returncode == 0, proc.stderr
    for (name, sequence), line in zip(records, outcomes_of(out), strict=True):
        assert line["id"] == name and len(line["result"]["topk"][0][0]) == 2
        assert "".join(line["result"]["tokens"][1:-1]) == sequence  # <cls> … <eos>


# -- resuming ---------------------------------------------------------------------------------


def test_a_killed_run_resumes_where_it_stopped(lm, tmp_path):
    rows = [{"id": f"r{i}", "text": f"t{i}", "delay": 0.05} for i in range(40)]
    source = write_jsonl(tmp_path / "echo.jsonl", rows)
    out = tmp_path / "out.jsonl"
    jobs, at_once = jobs_at_once(lm)
    args = ["run", "echo", "--input", str(source), "--output", str(out), "--url", lm.url, "--concurrency", "2"]
    proc = subprocess.Popen([str(STREAMGATE), *args], cwd=ROOT, env=clean_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: out.exists() and len(out.read_text().splitlines()) >= 10, 60, "ten records done")
    finally:
        proc.kill()
        proc.wait(timeout=30)
    done_before = {json.loads(line)["id"] for line in out.read_text().splitlines() if line.endswith("}")}
    assert 10 <= len(done_before) < 40
    # The jobs in flight at the kill end (their client is gone) before the count.
    wait_until(lambda: httpx.get(lm.url + "/jobs?state=active", timeout=30).json()["jobs"] == [], 30, "no job left")
    submitted = len(jobs)

    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert f"{len(done_before)} done before" in again.stderr
    lines = outcomes_of(out)
    assert [line["id"] for line in lines] == [row["id"] for row in rows]  # each once, in input order
    assert [line["result"]["text"] for line in lines] == [row["text"] for row in rows]
    # Nothing done ran again: the second run ran the rest; only the (at most two) jobs in flight at the kill ran twice.
    assert len(jobs) - submitted == 40 - len(done_before)
    assert len(jobs) <= 40 + 2
    assert max(at_once) == 2  # never more jobs at once than --concurrency


def test_a_resume_reads_a_cut_last_line_drops_strangers_and_runs_failures_again(esm, tmp_path):
    records = proteins(30, seed=7, longest=50)
    fasta = write_fasta(tmp_path / "p.fasta", records)
    out = tmp_path / "out.jsonl"
    assert cli("run", "embed", "--input", str(fasta), "--output", str(out), "--url", esm.url).returncode == 0
    complete = out.read_text().splitlines()

    # As a crash would leave it: lines in the order records ended, the last one cut short;
    # plus a record from another input, and a failure that may have been transient.
    partial = [complete[3], complete[0], '{"id":"elsewhere","result":{}}', complete[5],
               '{"id":"P00008","error":{"code":"queue_full","message":"the queue is full","status":429}}']
    out.write_text("\n".join(partial) + "\n" + complete[9][:40])
    jobs_before = jobs_total(esm.url)
    proc = cli("run", "embed", "--input", str(fasta), "--output", str(out), "--url", esm.url)
    assert proc.returncode == 0, proc.stderr
    assert "3 done before" in proc.stderr
    assert "holds 1 record(s) whose ids are not in" in proc.stderr and "elsewhere" in proc.stderr
    assert jobs_total(esm.url) - jobs_before == 27
    lines = outcomes_of(out)
    assert [line["id"] for line in lines] == [name for name, _ in records]
    for line, before in zip(lines, complete, strict=True):
        assert_same_embedding(line["result"], json.loads(before)["result"])
    assert [out.read_text().splitlines()[i] for i in (0, 3, 5)] == [complete[i] for i in (0, 3, 5)]  # kept as they were


def test_an_output_that_is_not_a_runs_output_is_left_alone(esm, tmp_path):
    fasta = write_fasta(tmp_path / "p.fasta", proteins(3))
    out = tmp_path / "notes.jsonl"
    out.write_text('{"note": "mine"}\n{"note": "keep me"}\n')
    proc = cli("run", "embed", "--input", str(fasta), "--output", str(out), "--url", esm.url)
    assert proc.returncode == 2 and "notes.jsonl:1: not an outcome" in proc.stderr, proc.stderr
    assert out.read_text() == '{"note": "mine"}\n{"note": "keep me"}\n'


# -- JSONL params ---------------------------------------------------------------------------------


def test_jsonl_lines_are_params_with_the_command_lines_under_them(lm, tmp_path):
    rows = [
        {"id": "paris", "prompt": "The capital of France is"},
        {"prompt": "Hello"},  # no id: its line number
        {"id": "zero", "prompt": "x", "top_k": 0},  # refused: 422
        {"id": 4, "prompt": "Once upon a time", "top_k": 5},  # its own top_k wins
    ]
    source = write_jsonl(tmp_path / "prompts.ndjson", rows)
    out = tmp_path / "out.jsonl"
    proc = cli("run", "predict", "top_k=3", "--input", str(source), "--output", str(out), "--url", lm.url)
    assert proc.returncode == 1, proc.stderr
    lines = outcomes_of(out)
    assert [line["id"] for line in lines] == ["paris", "2", "zero", "4"]
    assert [len(line["result"]["predictions"]) for line in lines if "result" in line] == [3, 3, 5]
    error = lines[2]["error"]
    assert error["code"] == "invalid_params" and error["status"] == 422 and error["field"] == "top_k"
    with Client(lm.url) as client:
        alone = client.run("predict", {"prompt": "Hello", "top_k": 3})
    assert [p["id"] for p in lines[1]["result"]["predictions"]] == [p["id"] for p in alone["predictions"]]
    # A line of the wrong type is refused alone; --quiet says nothing.
    rows = [{"text": "a"}, {"text": "b", "repeat": "many"}, {"text": "c"}]
    out = tmp_path / "echo.out.jsonl"
    proc = cli("run", "echo", "--input", str(write_jsonl(tmp_path / "e.jsonl", rows)), "--output", str(out),
               "--url", lm.url, "--quiet")
    assert proc.returncode == 1 and proc.stderr == ""
    assert [("result" in line, line.get("error", {}).get("code")) for line in outcomes_of(out)] == [
        (True, None), (False, "invalid_params"), (True, None),
    ]
    # A tool error (an `error` event) is the record's error too.
    fail = cli("run", "fail", "--input", str(write_jsonl(tmp_path / "f.jsonl", [{}, {"message": "x"}])), "--output",
               str(tmp_path / "f.out.jsonl"), "--url", lm.url)
    assert fail.returncode == 1
    assert [line["error"]["code"] for line in outcomes_of(tmp_path / "f.out.jsonl")] == ["tool_error"] * 2


# -- usage errors: exit 2 (or 3) before any job ------------------------------------------------------


def test_a_run_that_cannot_start_exits_2_before_any_job(lm, tmp_path):
    jobs = track_jobs(lm)
    fasta = write_fasta(tmp_path / "p.fasta", proteins(3))
    out = tmp_path / "out.jsonl"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        proc = cli("run", *args, "--url", lm.url)
        assert proc.returncode == 2, (args, proc.stderr)
        return proc

    # No param to put the sequences in: several required (loglikelihood), or none (generate).
    several = run("loglikelihood", "--input", str(fasta), "--output", str(out)).stderr
    assert "several text params: prompts, continuations" in several and "--field" in several
    none = run("generate", "--input", str(fasta), "--output", str(out)).stderr
    assert "requires no text param" in none and "prompts" in none and "--field" in none
    assert "no param nope" in run("generate", "--field", "nope", "--input", str(fasta), "--output", str(out)).stderr
    # Duplicate ids, in either format; a file that is not there; a format the name does not say.
    dup = write_fasta(tmp_path / "dup.fasta", [("a", "MK"), ("b", "GG"), ("a", "AA")])
    assert "dup.fasta:5: the id 'a' again (first on line 1)" in run("embed", "--input", str(dup), "--output", str(out)).stderr
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}])
    assert "dup.jsonl:2: the id 'x' again" in run("predict", "--input", str(dup), "--output", str(out)).stderr
    missing = run("embed", "--input", str(tmp_path / "nowhere.fasta"), "--output", str(out)).stderr
    assert "cannot read" in missing and "nowhere.fasta" in missing
    assert "--input-format" in run("embed", "--input", str(tmp_path / "p.txt"), "--output", str(out)).stderr
    # Options that do not go together, params the tool does not have, a tool or model the gateway does not have.
    assert "--output" in run("embed", "--input", str(fasta)).stderr
    assert "--input" in run("embed", "--output", str(out)).stderr
    assert "--field is for FASTA" in run("predict", "--field", "prompt", "--input", str(dup), "--output", str(out)).stderr
    assert "no param nonsense" in run("predict", "nonsense=1", "--input", str(fasta), "--output", str(out)).stderr
    assert "top_k: expected integer" in run("predict", "top_k=many", "--input", str(fasta), "--output", str(out)).stderr
    assert "unknown tool embd" in run("embd", "--input", str(fasta), "--output", str(out)).stderr
    assert "unknown_model" in run("predict", "--model", "nope", "--input", str(fasta), "--output", str(out)).stderr
    assert "fill_mask needs" in run("fill_mask", "--input", str(fasta), "--output", str(out)).stderr
    assert jobs == {} and not out.exists()


def test_an_unreachable_gateway_exits_3(tmp_path):
    fasta = write_fasta(tmp_path / "p.fasta", proteins(3))
    url = f"http://127.0.0.1:{free_port()}"
    proc = cli("run", "embed", "--input", str(fasta), "--output", str(tmp_path / "out.jsonl"), "--url", url)
    assert proc.returncode == 3 and url in proc.stderr, proc.stderr


# -- run_many: the Python clients ------------------------------------------------------------------


def echo_params(count: int, bad: int | None = None) -> list[dict[str, Any]]:
    params: list[dict[str, Any]] = [{"text": f"text {i}", "repeat": 1 + i % 3, "delay": 0.05} for i in range(count)]
    if bad is not None:
        params[bad] = {"text": "x", "nonsense": 1}  # 422 invalid_params
    return params


def test_run_many_gives_each_outcome_in_input_order_within_its_concurrency(serve):
    server = serve(tools=ECHO_TOOLS)
    params = echo_params(12, bad=5)
    _, at_once = jobs_at_once(server)
    with Client(server.url) as client:
        outcomes = list(client.run_many("echo", iter(params), concurrency=3))
        assert max(at_once) == 3 and len(at_once) == 11  # the refused one is no job
        assert [o.index for o in outcomes] == list(range(12))
        assert [o.params for o in outcomes] == params
        bad = outcomes[5]
        assert not bad.ok and bad.result is None
        assert isinstance(bad.error, HttpError) and bad.error.code == "invalid_params" and bad.error.status == 422
        for outcome in outcomes[:5] + outcomes[6:]:
            assert outcome.ok and outcome.error is None
            assert outcome.result == client.run("echo", outcome.params)
        # A job that fails is its outcome's JobError; model= goes with every job.
        model = client.models()["default"]
        failed = list(client.run_many("fail", [{"message": "one"}, {"message": "two"}], model=model))
        assert [(type(o.error), o.error.code, o.error.message) for o in failed] == [
            (JobError, "tool_error", "RuntimeError: one"), (JobError, "tool_error", "RuntimeError: two"),
        ]
        assert [o.params for o in failed] == [{"message": "one"}, {"message": "two"}]
        assert list(client.run_many("echo", [])) == []
        with pytest.raises(ValueError, match="concurrency"):
            client.run_many("echo", params, concurrency=0)


def test_run_many_reads_its_input_as_jobs_start(serve):
    server = serve(tools=ECHO_TOOLS)
    read: list[int] = []

    def params() -> Iterator[dict[str, Any]]:
        for i in range(1000):
            read.append(i)
            yield {"text": str(i)}

    with Client(server.url) as client:
        outcomes = client.run_many("echo", params(), concurrency=2)
        first = next(outcomes)
        assert first.index == 0 and first.result["text"] == "0"
        assert len(read) <= 2 + asynchronous.LOOKAHEAD * 2 + 1
        outcomes.close()


def test_leaving_run_many_early_cancels_its_jobs(serve):
    server = serve(tools=ECHO_TOOLS)

    def params() -> Iterator[dict[str, Any]]:
        yield {"text": "quick"}
        # The quick one first in the gateway's queue, then slow ones (10 s each).
        wait_until(lambda: httpx.get(server.url + "/jobs", timeout=30).json()["jobs"] != [], 30, "the quick job")
        for _ in range(4):
            yield {"text": "slow", "repeat": 100, "delay": 0.1}

    with Client(server.url) as client:
        outcomes = client.run_many("echo", params(), concurrency=3)
        assert next(outcomes).result["text"] == "quick"
        wait_until(lambda: len(httpx.get(server.url + "/jobs?state=running", timeout=30).json()["jobs"]) == 1,
                   30, "a slow job to run")
        started = time.monotonic()
        outcomes.close()  # cancels the jobs running and queued; starts no more
        assert time.monotonic() - started < 5
    wait_until(lambda: httpx.get(server.url + "/jobs?state=active", timeout=30).json()["jobs"] == [], 10, "no job left")
    jobs = httpx.get(server.url + "/jobs", timeout=30).json()["jobs"]
    # The quick one, and the two slow ones started beside it, cancelled: the next one never started.
    assert sorted(j["status"] for j in jobs) == ["FAILED", "FAILED", "SUCCEEDED"], json.dumps(jobs, indent=1)
    assert all(j["terminal"]["data"]["error"]["code"] == "cancelled" for j in jobs if j["status"] == "FAILED")


def test_run_many_waits_out_a_full_queue(serve):
    """A 429 queue_full is tried again after its Retry-After, not recorded as the record's failure."""
    server = serve(tools=ECHO_TOOLS, queue_size=1)
    params = [{"text": str(i), "delay": 0.2} for i in range(4)]
    with Client(server.url) as client:
        outcomes = list(client.run_many("echo", params, concurrency=4))
    assert [o.error for o in outcomes] == [None] * 4
    assert [o.result["text"] for o in outcomes] == ["0", "1", "2", "3"]


@pytest.mark.parametrize("queued", [True, False])
def test_an_interrupt_while_work_is_handed_to_the_clients_loop_still_closes_it_first(monkeypatch: pytest.MonkeyPatch, queued: bool) -> None:
    """Ctrl-C can land inside the hand-over itself (waking the loop's thread), after the work was
    queued there or before: queued, it is started, cancelled and waited for before the interrupt
    goes on; not queued, it never runs."""
    loop = synchronous._Loop()
    handover = asyncio.run_coroutine_threadsafe
    ran: list[str] = []

    calls = []

    def interrupted(coro: Any, target: asyncio.AbstractEventLoop) -> Any:
        calls.append(coro)
        if len(calls) > 1:  # what the interrupted call hands over after: as it is
            return handover(coro, target)
        if queued:
            handover(coro, target)
        raise KeyboardInterrupt

    async def work() -> None:
        ran.append("started")
        try:
            await asyncio.sleep(30)
        finally:
            ran.append("closed")

    monkeypatch.setattr(synchronous.asyncio, "run_coroutine_threadsafe", interrupted)
    with pytest.raises(KeyboardInterrupt):
        loop.call(work())
    monkeypatch.setattr(synchronous.asyncio, "run_coroutine_threadsafe", handover)

    async def others() -> int:
        return len(asyncio.all_tasks() - {asyncio.current_task()})

    # Nothing of it is left running there (cancelled before its first step, or closed after it).
    assert loop.call(others()) == 0
    assert ran in ([], ["started", "closed"])

    async def nothing() -> None:
        pass

    loop.close(nothing())


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """Ctrl-C as a terminal's Python gets it, whatever started the tests: a process started in the
    background of a shell inherits SIGINT ignored, and then Python raises nothing for it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupted_client_closes_its_stream_before_the_interrupt_goes_on(serve, ctrl_c):
    """Ctrl-C while `Client` waits on its loop's thread: what the call opened there is closed
    first, and the client still answers (the CLI then cancels the job)."""
    server = serve(tools=ECHO_TOOLS, detach_grace=30)
    with Client(server.url) as client:
        events = client.stream("echo", {"text": "s", "repeat": 100, "delay": 0.1})
        assert next(events).type == "status"  # lazily: the job has ten seconds to go
        threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            for _ in events:
                pass
        wait_until(lambda: value(scrape(server.url), "streamgate_active_streams") == 0, 10, "the stream to close")
        assert client.cancel()["cancelled"] is True


def test_a_client_sends_every_call_through_the_sync_transport_it_is_given(serve):
    server = serve(tools=ECHO_TOOLS)
    seen: list[tuple[str, str]] = []

    class Recording(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            seen.append((request.method, request.url.path))
            return super().handle_request(request)

    with Client(server.url, transport=Recording()) as client:
        assert client.ready()["ready"] is True
        assert client.run("echo", {"text": "t"})["text"] == "t"
        assert [o.result["text"] for o in client.run_many("echo", [{"text": "a"}, {"text": "b"}], concurrency=2)] == ["a", "b"]
    assert sorted(seen) == [("GET", "/readyz")] + [("POST", "/echo/run")] * 3


# -- AsyncClient ---------------------------------------------------------------------------------


async def test_the_async_client_runs_streams_and_lists_as_the_sync_one(serve):
    server = serve(tools=ECHO_TOOLS)
    with Client(server.url) as sync:
        expected = sync.run("echo", {"text": "hi", "repeat": 2})
        tools, models = sync.tools(), sync.models()
    async with AsyncClient(server.url) as client:
        assert await client.tools() == tools and await client.models() == models
        assert (await client.ready())["ready"] is True
        statuses, logs = [], []

        async def on_log(frame: dict[str, Any]) -> None:  # a coroutine handler is awaited
            logs.append(frame["message"])

        result = await client.run("echo", {"text": "hi", "repeat": 2}, on_status=statuses.append, on_log=on_log)
        assert result == expected
        assert [s["status"] for s in statuses][:3] == ["RECEIVED", "QUEUED", "RUNNING"]
        assert logs == ["echoing 'hi'"]
        events = [event async for event in client.stream("echo", query=[("text", "q")])]
        job_id = client.job_id
        assert events[-1].type == "data" and events[-1].data == {"text": "q", "tokens": 2}
        assert [e.id for e in events] == [f"{job_id}:{n}" for n in range(1, len(events) + 1)]
        with pytest.raises(JobError) as failed:
            await client.run("fail", {"message": "kaputt"})
        assert failed.value.code == "tool_error"
        with pytest.raises(HttpError) as refused:
            await client.run("echo", {"text": "x", "nonsense": 1})
        assert refused.value.status == 422 and refused.value.field == "nonsense"
        # Cancel a running job.
        stream = client.stream("echo", {"text": "s", "repeat": 100, "delay": 0.1})
        async for event in stream:
            if event.type == "status" and event.data["status"] == "RUNNING":
                break
        assert (await client.cancel())["cancelled"] is True
        await stream.aclose()


async def test_async_run_many_gives_each_outcome_in_input_order_within_its_concurrency(serve):
    server = serve(tools=ECHO_TOOLS)
    params = echo_params(12, bad=7)
    _, at_once = jobs_at_once(server)

    async def produce() -> AsyncIterator[dict[str, Any]]:
        for p in params:
            await asyncio.sleep(0)
            yield p

    async with AsyncClient(server.url) as client:
        outcomes = [o async for o in client.run_many("echo", produce(), concurrency=4)]
        from_list = [o async for o in client.run_many("echo", params, concurrency=2)]
    assert max(at_once) == 4
    assert [o.index for o in outcomes] == list(range(12))
    assert [(o.index, o.params, o.result) for o in outcomes] == [(o.index, o.params, o.result) for o in from_list]
    assert isinstance(outcomes[7].error, HttpError) and outcomes[7].error.code == "invalid_params"
    with Client(server.url) as sync:
        expected = [Outcome(i, p, sync.run("echo", p)) for i, p in enumerate(params) if i != 7]
    assert [o for o in outcomes if o.ok] == expected


class AsyncDropOnce(httpx.AsyncHTTPTransport):
    """An async transport whose first run stream breaks after `after` bytes, like a dropped connection."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after, self.dropped, self.requests = after, False, []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append((request.method, request.url.path, request.headers.get("idempotency-key")))
        response = await super().handle_async_request(request)
        if self.dropped or not request.url.path.endswith("/run"):
            return response
        self.dropped = True
        return httpx.Response(response.status_code, headers=response.headers, stream=_AsyncCut(response.stream, self.after))


class _AsyncCut(httpx.AsyncByteStream):
    def __init__(self, stream: Any, after: int) -> None:
        self.stream, self.after = stream, after

    async def __aiter__(self) -> AsyncIterator[bytes]:
        sent = 0
        async for chunk in self.stream:
            if sent + len(chunk) > self.after:
                yield chunk[: self.after - sent]
                raise httpx.ReadError("connection dropped")
            sent += len(chunk)
            yield chunk

    async def aclose(self) -> None:
        await self.stream.aclose()


async def test_the_async_client_resumes_a_dropped_stream(serve):
    server = serve(tools=ECHO_TOOLS, detach_grace=10)  # the job outlives its dropped connection
    transport = AsyncDropOnce(300)
    async with AsyncClient(server.url, transport=transport) as client:
        events = [e async for e in client.stream("echo", {"text": "r", "repeat": 5, "delay": 0.1})]
        job_id = client.job_id
    assert events[-1].type == "data" and events[-1].data == {"text": "rrrrr", "tokens": 2}
    assert [e.id for e in events] == [f"{job_id}:{n}" for n in range(1, len(events) + 1)]  # each event once
    assert [(m, p) for m, p, _ in transport.requests] == [("POST", "/echo/run"), ("GET", f"/jobs/{job_id}/events")]
    assert transport.requests[0][2]  # the POST carried an Idempotency-Key


def test_a_fasta_runs_result_files_are_fetched_into_out_one_folder_per_record(esm, tmp_path):
    """Long proteins embedded per token as files (windows, `file`): each record's safetensors is
    fetched into OUT/<id>/ and named in its line; a single run's into OUT; every file is the one
    the gateway serves, and its vectors are the record's."""
    from safetensors.numpy import load_file

    records = [("P1", "".join(random.Random(3).choice(ESM_ALPHABET) for _ in range(900))), ("P/2", "MKTAYIAK")]
    fasta = write_fasta(tmp_path / "long.fasta", records)
    out, files = tmp_path / "out.jsonl", tmp_path / "files"
    params = json.dumps({"pooling": "per_token", "window": 0, "file": "safetensors"})
    proc = cli("run", "embed", "--json", params, "--input", str(fasta), "--output", str(out), "--out", str(files), "--url", esm.url)
    assert proc.returncode == 0, proc.stderr
    lines = {line["id"]: line for line in outcomes_of(out)}
    for name, sequence in records:
        path = Path(lines[name]["files"]["embeddings.safetensors"])
        assert path.parent == files / name.replace("/", "_")
        arrays = load_file(str(path))
        assert arrays["embeddings.0"].shape == (len(sequence), 32) and arrays["token_ids.0"].shape == (len(sequence),)
    with Client(esm.url) as client:
        alone = client.run("embed", {"texts": [records[1][1]], "pooling": "per_token"})
    np.testing.assert_allclose(load_file(lines["P/2"]["files"]["embeddings.safetensors"])["embeddings.0"], np.array(alone["embeddings"][0]), atol=2e-6)
    single = cli("run", "embed", "--json", json.dumps({"texts": [records[0][1]], **json.loads(params)}), "--out", str(tmp_path / "one"), "--url", esm.url)
    assert single.returncode == 0, single.stderr
    assert json.loads(single.stdout)["files"][0]["name"] == "embeddings.safetensors" and "wrote " in single.stderr
    assert (tmp_path / "one" / "embeddings.safetensors").read_bytes() == Path(lines["P1"]["files"]["embeddings.safetensors"]).read_bytes()
