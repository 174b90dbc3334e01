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

Every test runs against both kinds of gateway (conftest's KINDS): the local
backend, and the remote backend driving a real executor process that loads the
same tools (`tests/support/script_tools.py`). A remote stream says DISPATCHED right
after RECEIVED; the checks below see it, then drop it and hold the rest of the
stream to the very same rules. Where remote differs by design it is said so
at the check.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import (
    Server,
    parse_sse,
    run_stream,
    tool_error_code,
    track_jobs,
    wait_until,
    without_dispatched,
)
from tests.support.script_tools import MARKER

RETRY = b"retry: 3000\n\n"
PING = b": ping\n\n"
EXAMPLES = settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# -- servers and the jobs they run -------------------------------------------------------


@pytest.fixture(scope="module")
def tool_modules() -> tuple[str, ...]:
    """The test tools, for servers of either kind."""
    return ("tests.support.script_tools",)


@pytest.fixture(scope="module")
def gw(any_server: Server) -> Server:
    """The module's server, local or remote; `gw.jobs` maps job ids to the gateway's Jobs."""
    any_server.jobs = track_jobs(any_server)  # type: ignore[attr-defined]
    return any_server


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


def check_against_model(
    events: list[dict[str, Any]], model: dict[str, Any], *, kind: str = "local", cut: bool = False
) -> None:
    """`cut`: the job was ended when its client left, without waiting for the tool (remote)."""
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
    expected = [(event, payload) for _, event, payload in model["events"]]
    if cut:
        # Everything up to the marker the client saw; of the rest, what arrived before the end.
        assert (MARKER, "info") in [payload for _, payload in got]
        expected = expected[: len(got)]
    assert got == expected

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
    if updates and not cut:
        assert keyed and keyed[-1][0] == updates[-1], (keyed[-1:], updates[-1])
    # The rate: consecutive progress frames are >= 100 ms apart, except the final
    # flush just before the terminal event.
    gaps = [
        body[n]["data"]["ts"] - body[prev]["data"]["ts"]
        for (_, prev), (_, n) in itertools.pairwise(keyed)
        if n != len(body) - 1  # not the flush before the terminal
    ]
    if kind == "local":
        assert all(gap >= 0.09 for gap in gaps), gaps
    else:
        # The executor spaced them; the gateway stamps them as they arrive, so one late
        # delivery can bring two closer. Over the run the rate holds.
        assert sum(gaps) >= 0.09 * len(gaps) - 0.2, gaps


def check_terminal(
    events: list[dict[str, Any]], model: dict[str, Any], job_id: str, n_steps: int, backend: str = "local"
) -> None:
    last = events[-1]
    kind, detail = model["terminal"]
    assert last["event"] == kind, (last, model["terminal"])
    if kind == "data":
        assert last["data"] == {"job_id": job_id, "steps": n_steps}
        return
    code, message = detail
    error = last["data"]["error"]
    assert last["data"]["job_id"] == job_id
    assert error["code"] == (tool_error_code(backend) if code == "tool_error" else code), error
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
    events = without_dispatched(check_stream(s.raw, job_id), gw.kind)
    check_statuses(events, job_id)
    model = model_of(steps)
    check_terminal(events, model, job_id, len(steps), gw.kind)
    check_against_model(events, model, kind=gw.kind)
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

    events = without_dispatched(check_events(frames_of(server_side), job_id), gw.kind)
    check_statuses(events, job_id)
    model = model_of(steps, disconnected=True)
    if gw.kind == "local":
        # The job ends when the tool next looks (a `check` step, or its end), and
        # everything it emitted until then is in the job's log.
        check_terminal(events, model, job_id, len(steps))
        check_against_model(events, model)
    else:
        # A remote gateway ends the job as soon as its client is gone and tells the
        # executor to cancel it there; what the tool emits afterwards goes nowhere.
        check_terminal(events, {"terminal": ("error", ("cancelled", None))}, job_id, len(steps))
        check_against_model(events, model, kind="remote", cut=True)
    # And once ended, it stays ended: nothing more is appended.
    n = len(job.events)
    time.sleep(0.05)
    assert len(job.events) == n and job.terminal is job.events[-1]
    # The tool was stopped where it runs: the worker is free for the next job at once
    # (a tool never cancelled would hold it for script_tools.DISCONNECT_TIMEOUT_S).
    assert run_stream(gw.url, "script", {"script": []}, timeout=5).terminal["event"] == "data"


def test_a_tool_that_raises_ends_with_tool_error_and_no_traceback(gw: Server) -> None:
    s = run_stream(gw.url, "script", {"script": [
        {"type": "log", "message": "about to fail"},
        {"type": "raise", "message": "disk on fire"},
        {"type": "log", "message": "never sent"},
    ]})
    events = without_dispatched(check_stream(s.raw, s.headers["x-job-id"]), gw.kind)
    assert [e["event"] for e in events[3:]] == ["log", "error"]
    assert events[-1]["data"]["error"] == {
        "code": tool_error_code(gw.kind), "message": "ScriptError: disk on fire", "retryable": False,
    }
    assert b"Traceback" not in s.raw and b"never sent" not in s.raw


def test_a_thousand_progress_updates_are_coalesced_and_the_newest_wins(gw: Server) -> None:
    n = 1000
    s = run_stream(gw.url, "spin", {"n": n})
    job_id = s.headers["x-job-id"]
    events = without_dispatched(check_stream(s.raw, job_id), gw.kind)
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
    events = without_dispatched(check_stream(s.raw, s.headers["x-job-id"]), gw.kind)
    assert events[-1]["event"] == "error"
    assert events[-1]["data"]["error"]["message"] == "ScriptError: spun out"
    done = [e["data"]["progress"]["done"] for e in events if "progress" in e["data"]]
    assert 1 <= len(done) < 50 and done == sorted(set(done))
    assert done[-1] == 1000 and events[-2]["data"]["progress"]["done"] == 1000


def test_a_ping_is_written_only_while_nothing_else_is(serve_any: Any, kind: str) -> None:
    server = serve_any(kind, ping_interval=0.25)
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
