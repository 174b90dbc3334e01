"""Stream invariants, checked on a real server over generated tool behaviour.

A test tool, `script`, performs a generated list of steps on the worker thread
(log, progress, partial, sleep, raise, check for cancellation). Every stream it
produces is checked byte for byte against the protocol's invariants, and its
events against a model of what the script did:

- the stream starts with a `retry:` line, every frame ends with a blank line,
  every `data:` line is one line of valid JSON;
- every event has `id: <job_id>:<seq>`, seq 1, 2, 3 … without gaps, equal to the
  `seq` inside status, log and error data;
- exactly one terminal event (`data` or `error`), last, nothing after it;
- `log` events carry no status; statuses go RECEIVED, QUEUED, RUNNING and then
  only RUNNING with progress;
- a tool that raises ends with `tool_error`, `ExceptionType: message`, no traceback;
- progress is coalesced (see `gateway/jobs.py`): a pending progress frame goes out
  before the job's next event of any kind (terminal included), so frames stay in
  the order the tool emitted them; otherwise progress frames are at least 100 ms
  apart; newest wins.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.tools import Context, Model, tool
from tests.conftest import Server, track_jobs, wait_until, make_server, parse_sse, run_stream

RETRY = b"retry: 3000\n\n"
PING = b": ping\n\n"
MARKER = "__await_disconnect__"  # logged by the `await_disconnect` step
DISCONNECT_TIMEOUT_S = 15.0  # how long that step waits for the cancellation
EXAMPLES = settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# -- the test tools ----------------------------------------------------------------------


class LogStep(msgspec.Struct, tag="log"):
    message: str
    level: str = "info"


class ProgressStep(msgspec.Struct, tag="progress"):
    done: int
    total: int | None = None


class BurstStep(msgspec.Struct, tag="burst"):
    """`n` progress updates in a tight loop."""

    n: int


class PartialStep(msgspec.Struct, tag="partial"):
    value: Any


class SleepStep(msgspec.Struct, tag="sleep"):
    ms: int


class RaiseStep(msgspec.Struct, tag="raise"):
    message: str


class CheckStep(msgspec.Struct, tag="check"):
    pass


class AwaitDisconnectStep(msgspec.Struct, tag="await_disconnect"):
    """Log MARKER, then wait until the job is cancelled (the client goes away on MARKER)."""


Step = (
    LogStep | ProgressStep | BurstStep | PartialStep | SleepStep | RaiseStep | CheckStep | AwaitDisconnectStep
)


class ScriptParams(msgspec.Struct, forbid_unknown_fields=True):
    script: list[Step]


class ScriptResult(msgspec.Struct):
    job_id: str
    steps: int


class ScriptError(Exception):
    pass


@tool
def script(model: Model, params: ScriptParams, ctx: Context) -> ScriptResult:
    """Do the steps of a script: the test's stand-in for any user tool."""
    for i, step in enumerate(params.script):
        if isinstance(step, LogStep):
            ctx.log(step.message, step.level)
        elif isinstance(step, ProgressStep):
            ctx.progress(step.done, step.total, f"{i}/0")
        elif isinstance(step, BurstStep):
            for k in range(step.n):
                ctx.progress(k, step.n, f"{i}/{k}")
        elif isinstance(step, PartialStep):
            ctx.partial({"step": i, "value": step.value})
        elif isinstance(step, SleepStep):
            time.sleep(step.ms / 1000)
        elif isinstance(step, RaiseStep):
            raise ScriptError(step.message)
        elif isinstance(step, CheckStep):
            ctx.raise_if_cancelled()
        elif isinstance(step, AwaitDisconnectStep):
            ctx.log(MARKER)
            deadline = time.monotonic() + DISCONNECT_TIMEOUT_S
            while not ctx.cancelled:
                if time.monotonic() > deadline:
                    raise RuntimeError("the job was never cancelled after its client went away")
                time.sleep(0.005)
    return ScriptResult(ctx.job_id, len(params.script))


class SpinParams(msgspec.Struct):
    n: int
    fail: bool = False


class SpinResult(msgspec.Struct):
    n: int


@tool
def spin(model: Model, params: SpinParams, ctx: Context) -> SpinResult:
    """Report progress `n` times in a tight loop."""
    for i in range(1, params.n + 1):
        ctx.progress(i, params.n, "it")
    if params.fail:
        raise ScriptError("spun out")
    return SpinResult(params.n)


class NapParams(msgspec.Struct):
    seconds: float


class NapResult(msgspec.Struct):
    slept: float


@tool
def nap(model: Model, params: NapParams, ctx: Context) -> NapResult:
    """Do nothing for a while."""
    time.sleep(params.seconds)
    return NapResult(params.seconds)


class ChatterParams(msgspec.Struct):
    n: int
    every_ms: int


@tool
def chatter(model: Model, params: ChatterParams, ctx: Context) -> NapResult:
    """Log every `every_ms` milliseconds, `n` times."""
    for i in range(params.n):
        ctx.log(f"line {i}")
        time.sleep(params.every_ms / 1000)
    return NapResult(params.n * params.every_ms / 1000)


# -- servers and the jobs they run -------------------------------------------------------




@pytest.fixture(scope="module")
def gw(tiny_model_path: Any) -> Iterator[Server]:
    """One server for the module with the test tools; `gw.jobs` maps job ids to Jobs."""
    server = make_server(tiny_model_path, tools=[script, spin])
    server.jobs = track_jobs(server)  # type: ignore[attr-defined]
    yield server
    server.stop()


# -- checking a stream -------------------------------------------------------------------

_ID = re.compile(r"([0-9a-f]{32}):([0-9]+)")
TYPES = {"status", "log", "partial", "data", "error"}


def frames_of(raw: bytes) -> list[bytes]:
    """Split a complete stream into frames, asserting each ends with a blank line."""
    assert raw.endswith(b"\n\n"), f"the stream does not end with a blank line: {raw[-80:]!r}"
    frames = raw.split(b"\n\n")
    assert frames[-1] == b""
    frames = frames[:-1]
    assert all(frames), "an empty frame (three newlines in a row)"
    return [f + b"\n\n" for f in frames]


def check_events(frames: list[bytes], job_id: str) -> list[dict[str, Any]]:
    """Every frame is a ping or exactly `id`, `event`, `data` lines; the event-level invariants hold."""
    events: list[dict[str, Any]] = []
    for frame in frames:
        if frame == PING:
            continue
        lines = frame[:-2].split(b"\n")
        assert len(lines) == 3, f"not an id/event/data frame: {frame!r}"
        assert lines[0].startswith(b"id: ") and lines[1].startswith(b"event: "), frame
        assert lines[2].startswith(b"data: "), frame
        text = lines[2][len(b"data: ") :].decode("utf-8")
        events.append(
            {
                "id": lines[0][4:].decode(),
                "event": lines[1][7:].decode(),
                "data": json.loads(text),  # valid JSON, on one line
            }
        )
    assert events, "no events"
    for n, event in enumerate(events, start=1):
        assert event["id"] == f"{job_id}:{n}", (event["id"], n)
        assert _ID.fullmatch(event["id"])
        assert event["event"] in TYPES
        if event["event"] in ("status", "log", "error"):
            assert event["data"]["seq"] == n
            assert event["data"]["job_id"] == job_id
        if event["event"] == "log":
            assert set(event["data"]) == {"job_id", "seq", "ts", "level", "message"}
    terminals = [i for i, e in enumerate(events) if e["event"] in ("data", "error")]
    assert terminals == [len(events) - 1], f"terminal events at {terminals} of {len(events)}"
    return events


def check_stream(raw: bytes, job_id: str) -> list[dict[str, Any]]:
    """The whole stream as a client got it: retry line first, then the job's events, then nothing."""
    assert raw.startswith(RETRY), raw[:40]
    frames = frames_of(raw)
    assert frames[0] == RETRY and RETRY not in frames[1:]
    events = check_events(frames[1:], job_id)
    # The framing parser and the WHATWG one in conftest agree.
    assert [(e["id"], e["event"], e["data"]) for e in parse_sse(raw)] == [
        (e["id"], e["event"], e["data"]) for e in events
    ]
    return events


def check_statuses(events: list[dict[str, Any]], job_id: str) -> list[dict[str, Any]]:
    """RECEIVED, QUEUED 1 of 1 (the worker is idle), RUNNING; afterwards only RUNNING with progress."""
    statuses = [e["data"] for e in events if e["event"] == "status"]
    assert [s["status"] for s in statuses[:3]] == ["RECEIVED", "QUEUED", "RUNNING"]
    assert [e["event"] for e in events[:3]] == ["status"] * 3
    assert statuses[1]["position"] == 1 and statuses[1]["queue_size"] == 1
    assert "progress" not in statuses[2]
    for s in statuses[3:]:
        assert s["status"] == "RUNNING" and "progress" in s, s
    return statuses


# -- what a script should produce --------------------------------------------------------


def model_of(steps: list[dict[str, Any]], *, disconnected: bool = False) -> dict[str, Any]:
    """The events a script must produce (progress aside), and how it ends.

    Returns `events`: [(step, kind, payload)] for log and partial; `progress`:
    {(step, k): (done, total)}; `segments`: lists of progress keys between two
    log/partial events; `terminal`: ("data", None) or ("error", (code, message)).
    """
    events: list[tuple[int, str, Any]] = []
    progress: dict[tuple[int, int], tuple[int, int | None]] = {}
    segments: list[list[tuple[int, int]]] = [[]]
    cancelled = False
    terminal: tuple[str, Any] = ("data", None)
    for i, step in enumerate(steps):
        kind = step["type"]
        if kind == "log":
            events.append((i, "log", (step["message"], step["level"])))
            segments.append([])
        elif kind == "partial":
            events.append((i, "partial", {"step": i, "value": step["value"]}))
            segments.append([])
        elif kind == "progress":
            progress[(i, 0)] = (step["done"], step.get("total"))
            segments[-1].append((i, 0))
        elif kind == "burst":
            for k in range(step["n"]):
                progress[(i, k)] = (k, step["n"])
                segments[-1].append((i, k))
        elif kind == "raise":
            terminal = ("error", ("tool_error", f"ScriptError: {step['message']}"))
            break
        elif kind == "check" and cancelled:
            terminal = ("error", ("cancelled", None))
            break
        elif kind == "await_disconnect":
            events.append((i, "log", (MARKER, "info")))
            segments.append([])
            cancelled = True
    else:
        if cancelled:  # returned normally, but the job had been cancelled
            terminal = ("error", ("cancelled", None))
    assert disconnected == cancelled
    return {"events": events, "progress": progress, "segments": segments, "terminal": terminal}


def check_against_model(events: list[dict[str, Any]], model: dict[str, Any]) -> None:
    body = events[3:-1]  # after RECEIVED, QUEUED, RUNNING; before the terminal
    # Logs and partials: exactly what the script sent, in order.
    got = []
    for e in body:
        if e["event"] == "log":
            got.append(("log", (e["data"]["message"], e["data"]["level"])))
        elif e["event"] == "partial":
            got.append(("partial", e["data"]))
        else:
            assert e["event"] == "status", e
    assert got == [(kind, payload) for _, kind, payload in model["events"]]

    # Progress frames: each one an update the script made, with its values.
    keyed: list[tuple[tuple[int, int], int]] = []  # (step key, index in body)
    for n, e in enumerate(body):
        if e["event"] == "status":
            p = e["data"]["progress"]
            step, k = (int(x) for x in p["unit"].split("/"))
            assert model["progress"][(step, k)] == (p["done"], p.get("total")), p
            keyed.append(((step, k), n))

    # Order: logs and partials in emission order (above); progress frames among
    # themselves too. A progress frame waits for its 100 ms slot, so it may follow
    # logs and partials emitted after its update, but never precedes one emitted before.
    keys = [key for key, _ in keyed]
    assert keys == sorted(keys) and len(set(keys)) == len(keys), keys
    for key, n in keyed:
        sent_before = sum(1 for e in body[:n] if e["event"] != "status")
        emitted_before = sum(1 for step, _, _ in model["events"] if step < key[0])
        assert sent_before >= emitted_before, (key, sent_before, emitted_before)

    # Newest wins: the tool's last update before the end is sent, right before the terminal.
    updates = [key for segment in model["segments"] for key in segment]
    if updates:
        assert keyed and keyed[-1][0] == updates[-1], (keyed[-1:], updates[-1])
    # The rate: consecutive progress frames are >= 100 ms apart, except the final
    # flush just before the terminal event.
    for (_, prev), (_, n) in zip(keyed, keyed[1:]):
        flushed_by_terminal = n == len(body) - 1
        if not flushed_by_terminal:
            gap = body[n]["data"]["ts"] - body[prev]["data"]["ts"]
            assert gap >= 0.09, (gap, body[prev]["data"], body[n]["data"])


def check_terminal(events: list[dict[str, Any]], model: dict[str, Any], job_id: str, n_steps: int) -> None:
    last = events[-1]
    kind, detail = model["terminal"]
    assert last["event"] == kind, (last, model["terminal"])
    if kind == "data":
        assert last["data"] == {"job_id": job_id, "steps": n_steps}
        return
    code, message = detail
    error = last["data"]["error"]
    assert last["data"]["job_id"] == job_id
    assert error["code"] == code, error
    assert error["retryable"] is False
    if message is not None:
        assert error["message"] == message
        assert "Traceback" not in error["message"] and 'File "' not in error["message"]


# -- strategies --------------------------------------------------------------------------

TRICKY = [
    "", "\n", "\n\n", "\r\n\r\n", "\r", "data: {}\n\nid: x:1", "event: data", ": ping",
    "retry: 1", "\u2028\u2029\x85", "é€𝄞", "\x00", '"}', "\\", "id: a:2\n\n",
]
TEXT = st.one_of(st.sampled_from(TRICKY), st.text(max_size=24))
MESSAGE = TEXT.filter(lambda s: "Traceback" not in s and 'File "' not in s)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
LEVELS = st.sampled_from(["debug", "info", "warning", "error"])


def steps_strategy(*, allow_raise: bool = True) -> st.SearchStrategy[dict[str, Any]]:
    options = [
        st.builds(lambda m, lvl: {"type": "log", "message": m, "level": lvl}, TEXT, LEVELS),
        st.builds(
            lambda d, t: {"type": "progress", "done": d, "total": t},
            st.integers(0, 10**6), st.none() | st.integers(0, 10**6),
        ),
        st.builds(lambda n: {"type": "burst", "n": n}, st.integers(1, 300)),
        st.builds(lambda v: {"type": "partial", "value": v}, JSON),
        st.builds(lambda ms: {"type": "sleep", "ms": ms}, st.integers(0, 40)),
        st.just({"type": "check"}),
    ]
    if allow_raise:
        options.append(st.builds(lambda m: {"type": "raise", "message": m}, MESSAGE))
    return st.one_of(options)


SCRIPTS = st.lists(steps_strategy(), max_size=14)


# -- the tests ---------------------------------------------------------------------------


@EXAMPLES
@given(steps=SCRIPTS)
def test_any_script_keeps_the_stream_invariants(gw: Server, steps: list[dict[str, Any]]) -> None:
    s = run_stream(gw.url, "script", {"script": steps}, timeout=30)
    assert s.status == 200
    job_id = s.headers["x-job-id"]
    events = check_stream(s.raw, job_id)
    check_statuses(events, job_id)
    model = model_of(steps)
    check_terminal(events, model, job_id, len(steps))
    check_against_model(events, model)
    # The server's own log agrees with what went over the wire.
    job = gw.jobs[job_id]  # type: ignore[attr-defined]
    assert job.done
    assert b"".join(e.sse() for e in job.events) == s.raw[len(RETRY) :]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    before=st.lists(steps_strategy(allow_raise=False), max_size=6),
    after=st.lists(steps_strategy(), max_size=6),
)
def test_client_disconnect_mid_stream_ends_the_job_with_one_terminal(
    gw: Server, before: list[dict[str, Any]], after: list[dict[str, Any]]
) -> None:
    steps = [*before, {"type": "await_disconnect"}, *after]
    received = b""
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{gw.url}/script/run", json={"script": steps}) as response:
            assert response.status_code == 200
            job_id = response.headers["x-job-id"]
            for chunk in response.iter_raw():
                received += chunk
                complete = received[: received.rfind(b"\n\n") + 2]
                if any(e["event"] == "log" and e["data"]["message"] == MARKER
                       for e in parse_sse(complete)):
                    break
            else:
                pytest.fail(f"the stream ended before the marker: {received[-300:]!r}")
        # Leaving the block closes the connection with the job still running.

    job = gw.jobs[job_id]  # type: ignore[attr-defined]
    wait_until(lambda: job.done, 20, "the cancelled job's terminal event")
    server_side = b"".join(e.sse() for e in job.events)
    # What the client got is a prefix of the job's log, and it saw no terminal.
    assert received.startswith(RETRY)
    assert server_side.startswith(received[len(RETRY) :])
    assert b"event: data\n" not in received and b"event: error\n" not in received

    events = check_events(frames_of(server_side), job_id)
    check_statuses(events, job_id)
    model = model_of(steps, disconnected=True)
    check_terminal(events, model, job_id, len(steps))
    check_against_model(events, model)
    # And once ended, it stays ended: nothing more is appended.
    n = len(job.events)
    time.sleep(0.05)
    assert len(job.events) == n and job.terminal is job.events[-1]


def test_a_tool_that_raises_ends_with_tool_error_and_no_traceback(gw: Server) -> None:
    s = run_stream(gw.url, "script", {"script": [
        {"type": "log", "message": "about to fail"},
        {"type": "raise", "message": "disk on fire"},
        {"type": "log", "message": "never sent"},
    ]})
    events = check_stream(s.raw, s.headers["x-job-id"])
    assert [e["event"] for e in events[3:]] == ["log", "error"]
    assert events[-1]["data"]["error"] == {
        "code": "tool_error", "message": "ScriptError: disk on fire", "retryable": False,
    }
    assert b"Traceback" not in s.raw and b"never sent" not in s.raw


def test_a_thousand_progress_updates_are_coalesced_and_the_newest_wins(gw: Server) -> None:
    n = 1000
    s = run_stream(gw.url, "spin", {"n": n})
    job_id = s.headers["x-job-id"]
    events = check_stream(s.raw, job_id)
    check_statuses(events, job_id)
    assert s.terminal["event"] == "data" and s.terminal["data"] == {"n": n}
    progress = [e["data"] for e in events if e["event"] == "status" and "progress" in e["data"]]
    done = [p["progress"]["done"] for p in progress]
    # Far fewer frames than updates: the first goes out at once, then at most one per
    # 100 ms, and the pending one is flushed before the result (newest wins).
    job = gw.jobs[job_id]  # type: ignore[attr-defined]
    ran_for = job.finished - job.started
    assert 1 <= len(done) <= 3 + ran_for / 0.1, (done, ran_for)
    assert len(done) < 50
    assert done[0] == 1
    assert done == sorted(set(done))
    assert done[-1] == n and events[-2]["data"] is progress[-1]
    assert all(p["progress"] == {"done": p["progress"]["done"], "total": n, "unit": "it"} for p in progress)


def test_a_failing_tool_still_sends_its_newest_progress_before_the_error(gw: Server) -> None:
    s = run_stream(gw.url, "spin", {"n": 1000, "fail": True})
    events = check_stream(s.raw, s.headers["x-job-id"])
    assert events[-1]["event"] == "error"
    assert events[-1]["data"]["error"]["message"] == "ScriptError: spun out"
    done = [e["data"]["progress"]["done"] for e in events if "progress" in e["data"]]
    assert 1 <= len(done) < 50 and done == sorted(set(done))
    assert done[-1] == 1000 and events[-2]["data"]["progress"]["done"] == 1000


def test_a_ping_is_written_only_while_nothing_else_is(serve: Any) -> None:
    server = serve(tools=[nap, chatter], ping_interval=0.25)
    started = time.monotonic()
    quiet = run_stream(server.url, "nap", {"seconds": 1.0})
    took = time.monotonic() - started
    assert quiet.terminal["event"] == "data"
    frames = frames_of(quiet.raw)
    check_events(frames[1:], quiet.headers["x-job-id"])
    pings = frames.count(PING)
    # ~4 quiet intervals of 0.25 s while the tool sleeps; never more than one per interval.
    assert 2 <= pings <= took / 0.25 + 1, (pings, took)

    # A tool that talks every 10 ms leaves no quiet interval of 0.25 s: no ping.
    busy = run_stream(server.url, "chatter", {"n": 60, "every_ms": 10})
    assert busy.terminal["event"] == "data"
    assert len(busy.of("log")) == 60
    assert PING not in frames_of(busy.raw)


def test_concurrent_streams_each_keep_their_own_sequence(gw: Server) -> None:
    """Several clients at once: jobs queue behind each other, each stream stays whole."""
    steps = [{"type": "log", "message": "a"}, {"type": "burst", "n": 50},
             {"type": "sleep", "ms": 30}, {"type": "partial", "value": [1, 2]}]
    results: list[Any] = [None] * 4
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = run_stream(gw.url, "script", {"script": steps}, timeout=30)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    ids = set()
    for s in results:
        job_id = s.headers["x-job-id"]
        ids.add(job_id)
        events = check_stream(s.raw, job_id)
        assert events[-1]["event"] == "data"
        statuses = [e["data"] for e in events if e["event"] == "status"]
        queued = [st_["position"] for st_ in statuses if st_["status"] == "QUEUED"]
        assert queued == sorted(queued, reverse=True) and queued[-1] == 1, queued
        assert [e["event"] for e in events if e["event"] in ("log", "partial")] == ["log", "partial"]
    assert len(ids) == 4
