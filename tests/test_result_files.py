"""Results bigger than one event, as files (gateway/tools/files.py): written in parts by the run,
kept with the job, fetched from `GET /jobs/{id}/files/{name}` with Range, opened here with the
field's own readers (the `safetensors` package, `numpy.load`) and compared with the same windows
computed here in plain transformers."""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import load as load_safetensors
from transformers import AutoTokenizer

from gateway.tools import windows
from gateway.tools.windows import Sizes, Stitch
from tests.conftest import make_server, run_stream
from tests.test_engines import start_gateway
from tests.test_tools import result
from tests.test_windows import protein, windowed_states


@pytest.fixture(scope="module")
def esm_path(tiny: Callable[..., Path]) -> Path:
    return tiny("esm_mlm")


@pytest.fixture(scope="module")
def server(esm_path: Path, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    # A result bound that a 3,000-residue per-token result (3,000 × 32 floats as JSON) is over.
    s = make_server(
        [f"esm={esm_path}", f"text={tiny_model_path}"], max_result_bytes=256 * 1024, result_spool=str(tmp_path_factory.mktemp("spool"))
    )
    yield s
    s.stop()


def fetch(url: str, job_id: str, name: str, **headers: str) -> httpx.Response:
    return httpx.get(f"{url}/jobs/{job_id}/files/{name}", headers=headers)


def ran(url: str, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    s = run_stream(url, "embed", params)
    assert s.terminal is not None and s.terminal["event"] == "data", s.terminal or s.body
    return s.events[0]["data"]["job_id"], s.terminal["data"]


@pytest.mark.parametrize("stitch", ["center", "mean"])
def test_a_per_token_result_over_the_bound_is_a_safetensors_file_of_the_windows_computed_here(server, esm_path: Path, stitch: str) -> None:
    """Asked for inline, a 3,000-residue per_token result over --max-result-bytes is written as
    safetensors instead (not refused): the vectors equal (1e-5) the windows run here in transformers
    and stitched here, the token ids are the residues', the context is the plan's."""
    sequence = protein(3000, seed=3)
    job_id, out = ran(server.url, {"model": "esm", "texts": [sequence], "window": 100, "overlap": 30, "stitch": stitch, "pooling": "per_token"})
    assert "embeddings" not in out and "context" not in out
    (file,) = out["files"]
    assert file["name"] == "embeddings.safetensors" and file["format"] == "safetensors"
    body = fetch(server.url, job_id, file["name"])
    assert body.status_code == 200 and len(body.content) == file["size"]
    arrays = load_safetensors(body.content)
    want = windowed_states(esm_path, sequence, 100, 30, stitch)
    got = arrays["embeddings.0"]
    assert got.dtype == np.float32 and got.shape == want.shape == (3000, out["dim"])
    assert np.abs(got - want).max() <= 1e-5
    cut = windows.plan(3000, Sizes(100, 30, Stitch(stitch)))
    assert out["plans"][0]["windows"] == [list(w) for w in cut]
    assert (arrays["context.0"] == windows.context(cut, Stitch(stitch))).all()
    assert arrays["token_ids.0"].tolist() == AutoTokenizer.from_pretrained(esm_path)(sequence)["input_ids"][1:-1]


def test_npy_files_of_one_text_normalized_over_windows_averaged(server, esm_path: Path) -> None:
    """`file: npy` on one text: three .npy files numpy.load reads; with normalize and mean, each row
    is the unit vector of the averaged windows computed here."""
    sequence = protein(700, seed=4)
    job_id, out = ran(server.url, {"model": "esm", "texts": [sequence], "window": 100, "overlap": 40, "stitch": "mean", "pooling": "per_token", "normalize": True, "file": "npy"})
    assert sorted(f["name"] for f in out["files"]) == ["context.npy", "embeddings.npy", "token_ids.npy"]
    got = np.load(io.BytesIO(fetch(server.url, job_id, "embeddings.npy").content))
    want = windowed_states(esm_path, sequence, 100, 40, "mean")
    want /= np.linalg.norm(want, axis=-1, keepdims=True)
    assert got.shape == (700, out["dim"]) and np.abs(got - want).max() <= 1e-5
    context = np.load(io.BytesIO(fetch(server.url, job_id, "context.npy").content))
    assert context.shape == (700, 2) and context[0].tolist() == [0, 99]


def test_a_text_within_the_context_written_as_a_file_is_its_inline_result(server) -> None:
    """Without windows, a file holds what the inline answer would: the same float32 vectors."""
    texts = [protein(120, seed=5), protein(40, seed=6)]
    inline = result(server.url, "embed", {"model": "esm", "texts": texts, "pooling": "per_token"})
    job_id, out = ran(server.url, {"model": "esm", "texts": texts, "pooling": "per_token", "file": "safetensors"})
    arrays = load_safetensors(fetch(server.url, job_id, "embeddings.safetensors").content)
    for i in range(2):
        assert arrays[f"embeddings.{i}"].tolist() == np.array(inline["embeddings"][i], dtype=np.float32).tolist()
    assert "context.0" not in arrays and "plans" not in out


def test_a_file_is_served_in_ranges_and_resumed(server) -> None:
    job_id, out = ran(server.url, {"model": "esm", "texts": [protein(3000, seed=7)], "window": 0, "pooling": "per_token"})
    (file,) = out["files"]
    whole = fetch(server.url, job_id, file["name"])
    etag = whole.headers["etag"]
    part = fetch(server.url, job_id, file["name"], range="bytes=1000-")
    assert part.status_code == 206 and part.headers["content-range"] == f"bytes 1000-{file['size'] - 1}/{file['size']}"
    assert whole.content[:1000] + part.content == whole.content
    stale = fetch(server.url, job_id, file["name"], range="bytes=1000-", **{"if-range": '"another"'})
    assert stale.status_code == 200 and stale.content == whole.content
    past = fetch(server.url, job_id, file["name"], range=f"bytes={file['size']}-")
    assert past.status_code == 416 and past.json()["error"]["code"] == "range_not_satisfiable"
    missing = fetch(server.url, job_id, "weights.safetensors")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found" and etag


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"pooling": "mean", "file": "safetensors"}, "file"),
        ({"pooling": "per_token", "file": "npy", "texts": ["MKV", "MKL"]}, "file"),
        ({"pooling": "per_token", "file": "safetensors", "precision": 3}, "precision"),
    ],
)
def test_a_file_that_cannot_be_written_is_refused_naming_the_param(server, params: dict[str, Any], field: str) -> None:
    response = httpx.post(f"{server.url}/embed/run", json={"model": "esm", "texts": ["MKV"], **params})
    assert response.status_code == 422 and response.json()["error"]["field"] == field, response.text


def test_files_over_their_bound_are_refused_before_queueing(esm_path: Path, tmp_path: Path) -> None:
    s = make_server([f"esm={esm_path}"], max_result_bytes=64 * 1024, max_result_file_bytes=100_000, result_spool=str(tmp_path))
    try:
        response = httpx.post(f"{s.url}/embed/run", json={"model": "esm", "texts": [protein(3000)], "window": 0, "pooling": "per_token"})
        error = response.json()["error"]
        assert response.status_code == 413 and error["code"] == "too_large" and "--max-result-file-bytes" in error["message"]
    finally:
        s.stop()
    off = make_server([f"esm={esm_path}"], max_result_bytes=64 * 1024, max_result_file_bytes=0)
    try:  # no files: the inline result over its bound is refused as before
        response = httpx.post(f"{off.url}/embed/run", json={"model": "esm", "texts": [protein(3000)], "window": 0, "pooling": "per_token"})
        assert response.status_code == 413 and "--max-result-bytes" in response.json()["error"]["message"]
    finally:
        off.stop()


def test_files_go_with_the_job_and_a_dead_processs_folder_with_the_next_start(esm_path: Path, tmp_path: Path) -> None:
    """A job's files are kept where they were written until its retention ends, then deleted (the
    route answers 404); a folder a dead process left (an engine killed mid-job) is removed by the
    next process that starts there; a gateway that stops leaves nothing."""
    orphan = tmp_path / "streamgate-files-999999999-abc"  # no such process
    orphan.mkdir()
    (orphan / "x.embeddings.safetensors").write_bytes(b"partial")
    s = make_server([f"esm={esm_path}"], max_result_bytes=64 * 1024, result_spool=str(tmp_path), retention=1)
    try:
        assert not orphan.exists()
        job_id, out = ran(s.url, {"model": "esm", "texts": [protein(2000)], "window": 0, "pooling": "per_token"})
        assert fetch(s.url, job_id, out["files"][0]["name"]).status_code == 200
        assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [f"{job_id}.embeddings.safetensors"]
        deadline = time.monotonic() + 10
        while fetch(s.url, job_id, out["files"][0]["name"]).status_code != 404:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    finally:
        s.stop()
    assert list(tmp_path.iterdir()) == []


def test_an_executor_and_an_engine_write_the_same_file_the_gateway_serves(server, serve_any, esm_path: Path, tmp_path: Path) -> None:
    """Through an executor process (asked for a file) and an engine process (over its result bound,
    written as a file by default), the gateway fetches the file from where it was written and serves
    the same bytes as the in-process run; the engines' and the gateway's folders keep no name."""
    params = {"texts": [protein(3000, seed=8)], "window": 200, "overlap": 50, "pooling": "per_token"}
    job_id, out = ran(server.url, {**params, "model": "esm"})
    here = fetch(server.url, job_id, "embeddings.safetensors").content
    remote = serve_any("remote", model_path=esm_path)
    job_id, there = ran(remote.url, {**params, "file": "safetensors"})
    assert there == out and fetch(remote.url, job_id, "embeddings.safetensors").content == here
    spool = tmp_path / "spool"
    spool.mkdir()
    gateway = start_gateway(tmp_path, f"esm={esm_path}", extra=("--max-result-bytes", str(256 * 1024), "--result-spool", str(spool)))
    try:
        job_id, engine = ran(gateway.url, {**params, "model": "esm"})
        assert engine == out and fetch(gateway.url, job_id, "embeddings.safetensors").content == here
        # The gateway keeps its copy in its own folder; the engine drops its own when `forget` reaches it.
        mine = f"streamgate-files-{gateway.proc.pid}-"
        deadline = time.monotonic() + 10
        while others := [p for p in spool.rglob("*") if p.is_file() and not p.parent.name.startswith(mine)]:
            assert time.monotonic() < deadline, others
            time.sleep(0.1)
        assert [p.name for p in spool.rglob("*") if p.is_file()] == [f"{job_id}.embeddings.safetensors"]
    finally:
        gateway.stop()


def test_a_job_over_two_engines_that_needs_files_runs_whole_on_one(server, esm_path: Path, tmp_path: Path) -> None:
    """A model on two devices cuts a job of several texts over both engines, whose parts' results are
    merged: a part may not be written as files, so a job whose parts would need them runs whole,
    its result in one file as on one device."""
    params = {"texts": [protein(3000, seed=9), protein(2500, seed=10)], "window": 0, "pooling": "per_token"}
    job_id, out = ran(server.url, {**params, "model": "esm"})
    here = load_safetensors(fetch(server.url, job_id, "embeddings.safetensors").content)
    gateway = start_gateway(tmp_path, f"esm={esm_path}", extra=("--model-devices", "esm=cpu,cpu", "--max-result-bytes", str(256 * 1024)))
    try:
        job_id, there = ran(gateway.url, {**params, "model": "esm"})
        assert there == out
        arrays = load_safetensors(fetch(gateway.url, job_id, "embeddings.safetensors").content)
        assert arrays.keys() == here.keys() and all(np.abs(arrays[k] - here[k]).max() <= 1e-5 for k in here)
        # Each text under the bound alone, the two over it: cut, each part would pass alone and the
        # merged answer would not. It runs whole, as files.
        texts = [protein(450, seed=11), protein(450, seed=12)]
        for text in texts:
            _, alone = ran(gateway.url, {"model": "esm", "texts": [text], "window": 0, "pooling": "per_token"})
            assert "files" not in alone and len(alone["embeddings"][0]) == 450
        job_id, both = ran(gateway.url, {"model": "esm", "texts": texts, "window": 0, "pooling": "per_token"})
        assert "embeddings" not in both and [f["name"] for f in both["files"]] == ["embeddings.safetensors"]
        arrays = load_safetensors(fetch(gateway.url, job_id, "embeddings.safetensors").content)
        assert [arrays[f"embeddings.{i}"].shape for i in range(2)] == [(450, 32), (450, 32)]
    finally:
        gateway.stop()


def test_the_files_of_a_job_that_fails_are_deleted_even_while_written(tmp_path: Path) -> None:
    import asyncio

    from gateway.jobs import Job
    from gateway.protocol import Code

    async def run() -> None:
        job = Job("embed", None)
        job.files.folder = str(tmp_path)
        f = job.files.open("embeddings.safetensors")
        f.write(b"x" * 10)
        job.fail(Code.CANCELLED, "cancelled")
        assert list(tmp_path.iterdir()) == []  # unlinked at once; the run's descriptor writes into nothing
        f.write(b"y")
        f.close()
        late = job.files.open("token_ids.npy")  # a batch's other jobs go on: this one's writes go nowhere
        late.write(b"z")
        late.close()
        assert list(tmp_path.iterdir()) == []

    asyncio.run(run())


# -- scores as TSV and JSONL --------------------------------------------------------------------

SCORED = "the quick brown fox\tjumps over the lazy dog.\n A \\ backslash. " * 40


def scored(url: str, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    s = run_stream(url, "logprobs", {"model": "text", **params})
    assert s.terminal is not None and s.terminal["event"] == "data", s.terminal or s.body
    return s.events[0]["data"]["job_id"], s.terminal["data"]


def unescaped(token: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"t": "\t", "n": "\n", "r": "\r", "\\": "\\"}[m.group(1)], token)


def test_logprobs_as_a_tsv_or_jsonl_file_hold_what_the_inline_answer_does(server) -> None:
    """A strided text scored into a file: a line per token, the same ids, tokens (tabs and newlines
    escaped in TSV) and log-probabilities as the inline answer, which keeps each text's plan and
    next token; JSONL with the top tokens too."""
    params = {"prompts": [SCORED, "a short one"], "window": 100, "overlap": 30, "next_token": True}
    _, inline = scored(server.url, params)
    job_id, out = scored(server.url, {**params, "file": "tsv"})
    assert [f["name"] for f in out["files"]] == ["logprobs.tsv"] and out["files"][0]["format"] == "tsv"
    text = fetch(server.url, job_id, "logprobs.tsv").text
    header, *lines = text.split("\n")[:-1]
    assert header == "sequence\tposition\ttoken_id\ttoken\tlogprob" and len(text.encode()) == out["files"][0]["size"]
    rows = [line.split("\t") for line in lines]
    for i, want in enumerate(inline["sequences"]):
        got = out["sequences"][i]
        assert got == {"length": len(want["token_ids"]), "plan": want["plan"], "next_token": want["next_token"]}
        mine = [r for r in rows if r[0] == str(i)]
        assert [int(r[1]) for r in mine] == list(range(len(want["token_ids"])))
        assert [int(r[2]) for r in mine] == want["token_ids"]
        assert [unescaped(r[3]) for r in mine] == want["tokens"]
        assert [None if r[4] == "" else float(r[4]) for r in mine] == want["logprobs"]
    assert any("\\t" in r[3] or "\\n" in r[3] for r in rows)  # escaped where the text had them

    # Fewer tokens with their top 3: the inline answer is under the bound.
    params = {**params, "prompts": [SCORED[:500], "a short one"], "top": 3}
    _, inline = scored(server.url, params)
    job_id, out = scored(server.url, {**params, "file": "jsonl"})
    lines = [json.loads(line) for line in fetch(server.url, job_id, "logprobs.jsonl").text.splitlines()]
    for i, want in enumerate(inline["sequences"]):
        mine = [line for line in lines if line["sequence"] == i]
        assert [m["token_id"] for m in mine] == want["token_ids"] and [m["token"] for m in mine] == want["tokens"]
        assert [m["logprob"] for m in mine] == want["logprobs"]
        assert [m.get("top") for m in mine] == [None, *want["top"]]
    refused = httpx.post(f"{server.url}/logprobs/run", json={"model": "text", "prompts": ["hi"], "top": 2, "file": "tsv"})
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "top"


def test_a_scores_result_over_the_bound_is_a_file_not_a_refusal(server) -> None:
    job_id, out = scored(server.url, {"prompts": [SCORED * 5], "window": 200})
    assert [f["name"] for f in out["files"]] == ["logprobs.tsv"] and out["sequences"][0]["length"] > 9000
    assert len(fetch(server.url, job_id, "logprobs.tsv").text.splitlines()) == out["sequences"][0]["length"] + 1
    _, out = scored(server.url, {"prompts": [SCORED * 5], "window": 200, "top": 2})
    assert [f["name"] for f in out["files"]] == ["logprobs.jsonl"]


def test_an_openai_answer_made_of_a_result_over_the_bound_is_refused_not_written_as_files(server) -> None:
    """/v1/completions with echo builds its answer from `logprobs`' tokens: past --max-result-bytes
    it is refused (413, naming the field), where a run of the tool itself would write a file."""
    prompts = [SCORED[i * 150 : i * 150 + 150] for i in range(30)]
    response = httpx.post(
        f"{server.url}/v1/completions", json={"model": "text", "prompt": prompts, "echo": True, "logprobs": 5, "max_tokens": 0}, timeout=60
    )
    assert response.status_code == 413, response.text
    assert "--max-result-bytes" in response.json()["error"]["message"]
    _, out = scored(server.url, {"prompts": prompts, "top": 5})
    assert [f["name"] for f in out["files"]] == ["logprobs.jsonl"]
