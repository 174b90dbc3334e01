"""A hostile tenant of a shared gateway: requests built to freeze it, exhaust it or hold it.

Each test sends what a careless or malicious client would and asserts what a
shared deployment needs: a 4xx before any work, the loop still answering
others, and nothing held past its bound.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.params import MAX_NESTING, nesting
from tests.conftest import Server, make_server, run_stream, wait_until

MIB = 1 << 20


@pytest.fixture(scope="module")
def gw(tiny_model_path: Path) -> Iterator[Server]:
    s = make_server(tiny_model_path, max_body_bytes=2 * MIB)
    yield s
    s.stop()


# -- bodies whose parsing could cost more than their size --------------------------------


PATHOLOGICAL = {
    # An unterminated string of escapes: a backtracking string matcher rescans the rest from every quote.
    "unterminated escapes": b'{"prompt": "' + b'"\\' * (MIB // 2),
    "quotes": b'"' * MIB,
    "escaped quotes in a string": b'{"prompt": "' + b'\\"' * (MIB // 2) + b'"}',
    "open brackets": b"[" * MIB,
    "open objects": b'{"a":' * (MIB // 5),
    "brackets in strings": b'{"prompt": "' + b"[{" * (MIB // 2) + b'"}',
}


@pytest.mark.parametrize("name", PATHOLOGICAL)
def test_pathological_bodies_are_refused_with_400_while_healthz_answers(gw: Server, name: str) -> None:
    body = PATHOLOGICAL[name]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sent = pool.submit(httpx.post, f"{gw.url}/predict/run", content=body, timeout=60)
        # Probed while the body is read and checked: the loop is never the parser's.
        slowest = 0.0
        while not sent.done():
            started = time.monotonic()
            assert httpx.get(f"{gw.url}/healthz", timeout=10).status_code == 200
            slowest = max(slowest, time.monotonic() - started)
        r = sent.result()
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["code"] in ("bad_request", "too_long")
    # The quadratic scan this replaced took 22 s for 64 KB: a 1 MiB body would take minutes.
    assert slowest < 2.0, slowest


def test_nesting_is_counted_outside_strings_and_to_the_end_of_an_unterminated_one() -> None:
    assert nesting(b'{"a": "[[[[{{{{", "b": [[1]]}') == 3
    assert nesting(b'{"a": "\\"[[[["}') == 1  # an escaped quote does not end the string
    assert nesting(b'{"a": "\\\\", "b": [[[1]]]}') == 4  # an escaped backslash does not escape the quote
    assert nesting(b'{"a": "unterminated [[[[') == 1
    assert nesting(b'{"a": "ends in a backslash \\') == 1
    assert nesting(b"") == nesting(b"12") == 0
    assert nesting(b"]]]]") == 0
    deep = b"[" * (MAX_NESTING + 1) + b"]" * (MAX_NESTING + 1)
    assert nesting(deep) == MAX_NESTING + 1


def test_openai_routes_refuse_deep_nesting_with_a_400_in_openais_shape(gw: Server) -> None:
    deep = b'{"model": "x", "prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(gw.url + path, content=deep, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "bad_request"
        assert "nests 2001 levels deep" in error["message"]


# -- headers --------------------------------------------------------------------------------


def _raw(url: str, request: bytes) -> bytes:
    """Send `request` on a socket of its own; what comes back until the server closes or 10 s pass."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # cut off mid-send: what it answered first is still to be read
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_headers_over_the_limit_get_431_and_the_connection_closes(gw: Server) -> None:
    huge = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (4 * MIB) + b"\r\n\r\n"
    answer = _raw(gw.url, huge)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), head
    assert b"connection: close" in head.lower()
    assert b'"code":"headers_too_large"' in body and b"65536 bytes" in body
    many = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(1000)) + b"\r\n"
    assert _raw(gw.url, many).startswith(b"HTTP/1.1 431 ")


def test_headers_under_the_limit_and_a_big_body_in_the_same_read_are_served(gw: Server) -> None:
    r = httpx.get(gw.url + "/healthz", headers={"X-Big": "a" * 60_000})
    assert r.status_code == 200
    # Small headers, then a 1.5 MiB body sent with them: the body's bytes are not the head's.
    body = b'{"prompt": "' + b"a" * (3 * MIB // 2) + b'", "top_k": 0}'
    r = httpx.post(gw.url + "/predict/run", content=body, timeout=60)
    assert r.status_code == 422 and r.json()["error"]["field"] == "top_k", r.text


def test_each_request_on_a_kept_alive_connection_has_its_own_header_budget(gw: Server) -> None:
    # Three heads of 40 KB on one connection: 120 KB in all, each under the limit.
    with httpx.Client() as client:
        codes = [client.get(gw.url + "/healthz", headers={"X-Big": "a" * 40_000}).status_code for _ in range(3)]
    assert codes == [200, 200, 200]


# -- long passes stop within a step of a cancel or a timeout ----------------------------------


class Gate:
    """Holds the `nth` wide pass (over `min_width` tokens or more) at the model's first block until
    released, and counts the block calls of wide passes after that: what ran past a cancel."""

    def __init__(self, model: Any, min_width: int, nth: int = 1) -> None:
        from backends.stopping import stop_points

        self.min_width, self.nth, self.passes = min_width, nth, 0
        self.entered = threading.Event()
        self.release = threading.Event()
        self.after = 0
        points = stop_points(model)
        # Set before any job's stop hooks, so this runs first at each point.
        self.handles = [points[0].register_forward_pre_hook(self._hold)]
        self.handles += [p.register_forward_pre_hook(self._count) for p in points]

    def _width(self, args: Any) -> int:
        return int(args[0].shape[1]) if args and hasattr(args[0], "shape") and args[0].dim() >= 2 else 0

    def _hold(self, module: Any, args: Any) -> None:
        if self._width(args) >= self.min_width and not self.entered.is_set():
            self.passes += 1
            if self.passes == self.nth:
                self.entered.set()
                assert self.release.wait(60)

    def _count(self, module: Any, args: Any) -> None:
        if self.release.is_set() and self._width(args) >= self.min_width:
            self.after += 1

    def remove(self) -> None:
        self.release.set()
        for handle in self.handles:
            handle.remove()


@pytest.fixture
def wide_gw(wide_model_path: Path) -> Iterator[Server]:
    s = make_server(wide_model_path, job_timeout=600)
    yield s
    s.stop()


def _job_started(url: str, tool: str, params: dict[str, Any], events: list[dict[str, Any]]) -> threading.Thread:
    thread = threading.Thread(target=lambda: events.extend(run_stream(url, tool, params, timeout=120).events), daemon=True)
    thread.start()
    return thread


def _cancel_holds_then_releases(server: Server, tool: str, params: dict[str, Any], stop: Any) -> tuple[list[dict[str, Any]], int]:
    """Start a long job, hold its first wide pass, `stop(job_id)` it, let the pass go on: its events,
    and the wide block calls that ran after the release."""
    gate = Gate(server.backend.model, min_width=1000)
    try:
        events: list[dict[str, Any]] = []
        thread = _job_started(server.url, tool, params, events)
        assert gate.entered.wait(60)
        (job,) = httpx.get(server.url + "/jobs").json()["jobs"]
        stop(job["job_id"])
        bystander: list[dict[str, Any]] = []
        waiting = _job_started(server.url, "predict", {"prompt": "Hello", "top_k": 3}, bystander)
        gate.release.set()
        thread.join(60)
        waiting.join(60)
    finally:
        gate.remove()
    assert bystander[-1]["event"] == "data", bystander[-1]
    return events, gate.after


LONG_JOBS = [
    ("embed", {"texts": ["a" * 6000] * 4}),
    ("logprobs", {"prompts": ["a" * 6000] * 2}),
    ("generate", {"prompts": ["a" * 6000], "max_tokens": 64}),
]


@pytest.mark.parametrize(("tool", "params"), LONG_JOBS, ids=[t for t, _ in LONG_JOBS])
def test_a_cancel_stops_a_long_pass_at_its_next_block(wide_gw: Server, tool: str, params: dict[str, Any]) -> None:
    events, after = _cancel_holds_then_releases(
        wide_gw, tool, params, lambda job_id: httpx.delete(f"{wide_gw.url}/jobs/{job_id}")
    )
    assert events[-1]["event"] == "error" and events[-1]["data"]["error"]["code"] == "cancelled", events[-1]
    assert after == 1  # the held block's own call, counted as it is let go; not one block more


def test_a_job_timeout_stops_a_long_pass_at_its_next_block(wide_model_path: Path) -> None:
    server = make_server(wide_model_path, job_timeout=1)
    try:
        def timed_out(job_id: str) -> None:
            wait_until(lambda: httpx.get(f"{server.url}/jobs/{job_id}").json()["status"] == "FAILED", 30, "the timeout")

        events, after = _cancel_holds_then_releases(server, "embed", {"texts": ["a" * 6000] * 4}, timed_out)
    finally:
        server.stop()
    assert events[-1]["data"]["error"]["code"] == "timeout"
    assert after == 1


def test_another_tools_job_runs_between_two_chunks_of_a_long_embed(wide_gw: Server) -> None:
    """A's embed of 8 long texts runs in 4 chunks, one a step; B's predict, sent while the first
    runs, ends while the second is held: it ran between them, not after the whole embed."""
    gate = Gate(wide_gw.backend.model, min_width=1000, nth=2)
    try:
        first = Gate(wide_gw.backend.model, min_width=1000)
        a_events: list[dict[str, Any]] = []
        a = _job_started(wide_gw.url, "embed", {"texts": ["a" * 6000] * 8}, a_events)
        assert first.entered.wait(60)
        b_events: list[dict[str, Any]] = []
        b = _job_started(wide_gw.url, "predict", {"prompt": "Hello", "top_k": 3}, b_events)
        wait_until(lambda: httpx.get(wide_gw.url + "/jobs?state=active").json()["jobs"].__len__() == 2, 30, "B queued")
        first.remove()
        b.join(60)
        assert b_events and b_events[-1]["event"] == "data", b_events[-1:]
        # Then A goes on to its second chunk, held there: B did not wait for the whole embed.
        assert gate.entered.wait(60) and not a_events
    finally:
        gate.remove()
    a.join(120)
    assert a_events[-1]["event"] == "data"


class BlockGate:
    """Holds the first wide pass (over `min_width` tokens) at its `index`-th stop point until released."""

    def __init__(self, model: Any, min_width: int, index: int) -> None:
        from backends.stopping import stop_points

        self.min_width = min_width
        self.entered = threading.Event()
        self.release = threading.Event()
        # Set before any job's stop hooks, so this runs first at its point.
        self.handle = stop_points(model)[index].register_forward_pre_hook(self._hold)

    def _hold(self, module: Any, args: Any) -> None:
        wide = args and hasattr(args[0], "shape") and args[0].dim() >= 2 and int(args[0].shape[1]) >= self.min_width
        if wide and not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(60)

    def remove(self) -> None:
        self.release.set()
        self.handle.remove()


def _b_waits_inside_a(server: Server, b_events: list[dict[str, Any]]) -> threading.Thread:
    """Start B's predict while A's pass is held, and wait until B has left the queue for A's pass:
    it waits for A's next stop point."""
    b = _job_started(server.url, "predict", {"prompt": "Hello", "top_k": 3}, b_events)
    wait_until(lambda: len(httpx.get(server.url + "/jobs?state=active").json()["jobs"]) == 2, 30, "B queued")
    queue = next(iter(server.backend.served.values())).queue
    wait_until(lambda: len(queue) == 0, 30, "B to be let into A's pass")
    return b


LONE_PASSES = [  # a batch's one step (embed: one chunk; logprobs), and a job that runs alone (the lens)
    ("embed", {"texts": ["a" * 6000]}),
    ("logprobs", {"prompts": ["a" * 6000]}),
    ("logit_lens", {"prompt": "a" * 6000, "positions": [-1]}),
]


@pytest.mark.parametrize(("tool", "params"), LONE_PASSES, ids=[t for t, _ in LONE_PASSES])
def test_another_tenants_short_job_runs_inside_one_long_pass(wide_gw: Server, tool: str, params: dict[str, Any]) -> None:
    """A's job is one pass over 6,000 tokens: one chunk, one step. B's predict, queued while it runs,
    runs inside that pass at its next stop point and ends while the pass is held further on: it
    waited a block of A's pass, not the whole of it. A's result is then what it is alone."""
    from backends.stopping import stop_points

    model = wide_gw.backend.model
    points = stop_points(model)
    # The last point inside the layer stack (the head, a stop point after it, sees a position at a time).
    last_block = max(i for i, point in enumerate(points) if point is not model.module.get_output_embeddings())
    early = BlockGate(model, min_width=1000, index=0)
    late = BlockGate(model, min_width=1000, index=last_block)
    try:
        a_events: list[dict[str, Any]] = []
        a = _job_started(wide_gw.url, tool, params, a_events)
        assert early.entered.wait(60)
        b_events: list[dict[str, Any]] = []
        b = _b_waits_inside_a(wide_gw, b_events)
        early.remove()
        b.join(60)
        assert b_events and b_events[-1]["event"] == "data", b_events[-1:]
        assert late.entered.wait(60) and not a_events  # A is still in its one pass, further on
    finally:
        early.remove()
        late.remove()
    a.join(120)
    # Each as it is alone: neither pass saw the other's activations (nor its hooks).
    assert a_events[-1]["event"] == "data"
    assert a_events[-1]["data"] == run_stream(wide_gw.url, tool, params, timeout=120).terminal["data"]
    assert b_events[-1]["data"] == run_stream(wide_gw.url, "predict", {"prompt": "Hello", "top_k": 3}).terminal["data"]


def test_another_tenants_short_job_runs_inside_one_attention(wide_gw: Server) -> None:
    """A's pass over 6,000 tokens is held inside its first block's attention, after the queries are
    projected: B's predict, queued then, runs inside that attention (between two pieces of queries,
    backends/stopping.py `_Pieces`), before the attention module returns, not at the stop point
    after it. A's result is what it is alone."""
    from gateway.plumbing import handoff

    model = wide_gw.backend.model
    attention = model.module.model.layers[0].self_attn
    held, release = threading.Event(), threading.Event()
    b_waiting_after: list[bool] = []

    def wide(tensor: Any) -> bool:
        return hasattr(tensor, "shape") and tensor.dim() >= 2 and int(tensor.shape[1]) >= 1000

    def hold(module: Any, args: Any, output: Any) -> None:
        if wide(args[0]) and not held.is_set():
            held.set()
            assert release.wait(60)

    def returned(module: Any, args: Any, kwargs: Any, output: Any) -> None:
        device = handoff.current()
        if wide(kwargs.get("hidden_states", args[0] if args else None)) and device is not None and not b_waiting_after:
            b_waiting_after.append(device.waiting_between)

    handles = [
        attention.q_proj.register_forward_hook(hold),
        attention.register_forward_hook(returned, with_kwargs=True),
    ]
    params = {"prompts": ["a" * 6000]}
    try:
        a_events: list[dict[str, Any]] = []
        a = _job_started(wide_gw.url, "logprobs", params, a_events)
        assert held.wait(60)
        b_events: list[dict[str, Any]] = []
        b = _b_waits_inside_a(wide_gw, b_events)
        release.set()
        b.join(60)
        a.join(120)
    finally:
        release.set()
        for handle in handles:
            handle.remove()
    assert b_waiting_after == [False]  # B had run when A's first attention returned
    assert b_events[-1]["event"] == "data" and a_events[-1]["event"] == "data"
    assert a_events[-1]["data"] == run_stream(wide_gw.url, "logprobs", params, timeout=120).terminal["data"]


def test_attention_and_linear_layers_in_pieces_compute_what_the_whole_pass_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every attention and linear layer of a pass cut into pieces (a causal prompt, a right-padded
    batch, a bidirectional encoder's masked batch) gives the whole pass's outputs, to float rounding,
    with a stop point between every two pieces."""
    import torch
    import transformers

    from backends import stopping

    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024)).eval()
    esm = transformers.EsmForMaskedLM(transformers.EsmConfig(
        vocab_size=33, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=1026, position_embedding_type="rotary", pad_token_id=1, mask_token_id=32)).eval()
    ids = torch.randint(3, 300, (2, 700))
    mask = torch.ones_like(ids)
    mask[1, 500:] = 0
    cases = [
        (llama, {"input_ids": ids[:1], "use_cache": False}),
        (llama, {"input_ids": ids, "attention_mask": mask, "use_cache": False}),
        (esm, {"input_ids": ids % 30 + 3, "attention_mask": mask}),
    ]
    for module, inputs in cases:
        with torch.inference_mode():
            whole = module(**inputs, output_hidden_states=True)
            stops: list[int] = []
            monkeypatch.setattr(stopping, "PIECE_MACS", 1 << 18)
            with stopping._Pieces(lambda: stops.append(1)):
                cut = module(**inputs, output_hidden_states=True)
            monkeypatch.undo()
        assert len(stops) > 100  # every attention and the head in many pieces
        keep = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
        assert (cut.logits - whole.logits)[keep].abs().max() < 1e-5
        for a, b in zip(cut.hidden_states, whole.hidden_states, strict=True):
            assert (a - b)[keep].abs().max() < 1e-5


def test_only_a_priced_short_job_is_let_into_a_long_pass() -> None:
    """A job with no price could run for as long as it likes inside another's pass: it waits its
    turn in the queue instead. A priced short one fits; a long one, or one over the memory left, not."""
    from types import SimpleNamespace

    from backends.stopping import STOPPABLE_TOKENS
    from backends.workers import Worker
    from gateway.cost import Cost

    worker = SimpleNamespace(batch_memory=1000)
    priced = SimpleNamespace(cost=Cost(memory=100, result=10, memory_field="x", result_field="x", tokens=10))
    long = SimpleNamespace(cost=Cost(memory=100, result=10, memory_field="x", result_field="x", tokens=STOPPABLE_TOKENS))
    assert Worker._fits_in(worker, priced, held=900)
    assert not Worker._fits_in(worker, priced, held=901)
    assert not Worker._fits_in(worker, long, held=0)
    assert not Worker._fits_in(worker, SimpleNamespace(cost=None), held=0)


def test_a_job_waiting_to_join_a_batch_whose_members_are_all_cancelled_runs_on(wide_gw: Server) -> None:
    """A's long prefill is held; B, compatible, is offered to join A's batch; A is cancelled. The
    step stops for A, and ends A alone: B, never cancelled, runs in a batch of its own to its end."""
    gate = BlockGate(wide_gw.backend.model, min_width=1000, index=0)
    try:
        a_events: list[dict[str, Any]] = []
        a = _job_started(wide_gw.url, "generate", {"prompts": ["a" * 6000], "max_tokens": 8}, a_events)
        assert gate.entered.wait(60)
        b_events: list[dict[str, Any]] = []
        b = _job_started(wide_gw.url, "generate", {"prompts": ["Hello"], "max_tokens": 4}, b_events)
        wait_until(lambda: len(httpx.get(wide_gw.url + "/jobs?state=active").json()["jobs"]) == 2, 30, "B queued")
        queue = next(iter(wide_gw.backend.served.values())).queue
        wait_until(lambda: len(queue) == 0, 30, "B offered to A's batch")
        a_job = min(httpx.get(wide_gw.url + "/jobs?state=active").json()["jobs"], key=lambda j: j["created"])  # A came first
        assert httpx.delete(f"{wide_gw.url}/jobs/{a_job['job_id']}").json()["cancelled"] is True
        gate.remove()
        a.join(60)
        b.join(60)
    finally:
        gate.remove()
    assert a_events[-1]["event"] == "error" and a_events[-1]["data"]["error"]["code"] == "cancelled"
    assert b_events[-1]["event"] == "data", b_events[-1]
    assert b_events[-1]["data"] == run_stream(wide_gw.url, "generate", {"prompts": ["Hello"], "max_tokens": 4}).terminal["data"]
