"""Faults between a gateway and its executors, each injected for real; no job hangs, no frame is lost.

The executors are real `streamgate executor` subprocesses on the tiny model
with the test tools (`echo` sleeps `delay` per copy, reports progress, and
stops when cancelled); the gateways run in this process with the remote
backend. Where the network has to misbehave, a `FaultProxy` (tests/support/faultproxy.py)
sits between them.

- The session socket drops while the executor lives (mid-job, and while a job
  is queued): the gateway reconnects with backoff and resumes every job after
  its last seq; the client's stream is the undisturbed run's, frame for frame,
  with consecutive ids.
- The executor is SIGKILLed mid-job: the job ends with `backend_unavailable`
  once the deadline has passed, not before and not much later; killed and
  restarted within the deadline, the job ends at once ("lost the job") and new
  jobs run.
- The client goes away: the remote job is deleted and the executor's worker is
  free again within a step.
- A result download breaks: cut once, it is fetched again and the client gets
  the right data; corrupt or truncated every time, the job ends with an error.
- Two executors: new jobs go to the least-loaded ready one; a killed one gets
  none, and once back it is used again.
- Every executor endpoint, the socket's handshake included, answers 401
  without the token; a gateway with the wrong token is not ready and says why.

Every read of a stream is bounded: a job that hangs fails its test.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from websockets.sync.client import connect as ws_connect

from tests.conftest import Server, make_remote_server, parse_sse
from tests.support.faultproxy import FaultProxy, upstream_of, wait_for
from tests.support.processes import ServeProcess, start_executor

TOKEN = "fault-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STREAM_LIMIT = 60.0  # the most any one stream here may take before it counts as hung

# Long enough to span a fault, short enough to keep the file fast; 0.25 s a copy
# keeps the executor's progress frames apart (it coalesces at 0.1 s).
SLOW_ECHO = {"text": "ab", "repeat": 8, "delay": 0.25}
LONG_ECHO = {"text": "zz", "repeat": 600, "delay": 0.05}  # 30 s unless cancelled
QUICK_ECHO = {"text": "q", "repeat": 1}
# About 260 kB of msgpack: several 64 kB chunks on the executor's side.
BIG_EMBED = {"texts": [f"{i}" + "abcdefghij" * 24 for i in range(8)], "pooling": "none"}


# -- a client that reads a run as it streams -----------------------------------------------


class LiveStream:
    """One client's run, read on a thread; `events` fills as frames arrive.

    The gateway pings every second, so the reader wakes at least that often and
    gives up once `limit` seconds have passed: a hung job fails the test.
    """

    def __init__(self, url: str, tool: str, params: Any, limit: float = STREAM_LIMIT) -> None:
        self.events: list[dict[str, Any]] = []
        self.status: int | None = None
        self.job_id: str | None = None
        self.body: bytes | None = None
        self.hung = False
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self._raw = b""
        self._sock: socket.socket | None = None
        self._opened = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, tool, params, limit), daemon=True)
        self._thread.start()
        if not self._opened.wait(30):
            raise AssertionError(f"no answer to {tool} within 30 s")

    def _read(self, url: str, tool: str, params: Any, limit: float) -> None:
        deadline = time.monotonic() + limit
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(10.0, read=limit)) as client,
                client.stream("POST", f"{url}/{tool}/run", json=params) as response,
            ):
                self.status = response.status_code
                self.job_id = response.headers.get("x-job-id")
                if not response.headers.get("content-type", "").startswith("text/event-stream"):
                    self.body = response.read()
                    return
                self._sock = response.extensions["network_stream"].get_extra_info("socket")
                self._opened.set()
                for chunk in response.iter_raw():
                    self._raw += chunk
                    end = self._raw.rfind(b"\n\n") + 2
                    if end >= 2:
                        self.events.extend(parse_sse(self._raw[:end]))
                        self._raw = self._raw[end:]
                    if time.monotonic() > deadline:
                        self.hung = True
                        return
        except BaseException as exc:  # noqa: BLE001 - reported by result()
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self._opened.set()
            self._done.set()

    def wait_event(self, check: Callable[[dict[str, Any]], bool], what: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for event in list(self.events):
                if check(event):
                    return event
            if self._done.is_set() or time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout:g} s; got {[e['event'] for e in self.events]}")
            time.sleep(0.01)

    def result(self, timeout: float = STREAM_LIMIT + 15) -> list[dict[str, Any]]:
        """All events, once the stream ended with its terminal event; fails on a hang."""
        if not self._done.wait(timeout):
            raise AssertionError(f"the stream did not end within {timeout:g} s: {self.events[-3:]}")
        assert not self.hung, f"the job hung: no terminal event within {STREAM_LIMIT:g} s: {self.events[-3:]}"
        if self.error is not None:
            raise AssertionError(f"the stream broke: {self.error!r}; events {self.events}")
        assert self.status == 200, (self.status, self.body)
        assert self.events and self.events[-1]["event"] in ("data", "error"), self.events[-3:]
        return self.events

    def disconnect(self) -> None:
        """Drop the connection, as a client that goes away."""
        assert self._sock is not None
        self._sock.shutdown(socket.SHUT_RDWR)
        self._done.wait(10)


def progress_at_least(done: int) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "status" and (e["data"].get("progress") or {}).get("done", 0) >= done


def is_status(status: str) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "status" and e["data"]["status"] == status and "progress" not in e["data"]


def check_log(events: list[dict[str, Any]]) -> None:
    """Every event once: one job, ids 1..n in order, `seq` matching, one terminal and it is last."""
    job_id = events[0]["id"].rpartition(":")[0]
    ids = [e["id"] for e in events]
    assert ids == [f"{job_id}:{n}" for n in range(1, len(events) + 1)], ids
    for event in events:
        if isinstance(event["data"], dict) and "seq" in event["data"]:
            assert event["data"]["seq"] == int(event["id"].rpartition(":")[2]), event
    assert [e["event"] in ("data", "error") for e in events].count(True) == 1
    assert events[-1]["event"] in ("data", "error")


def frames(events: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """The events without what differs between two runs of the same job (ids, times, estimates)."""
    out = []
    for event in events:
        data = event["data"]
        if isinstance(data, dict) and event["event"] != "data":
            data = {k: v for k, v in data.items() if k not in ("job_id", "seq", "ts", "eta_s")}
        out.append((event["event"], data))
    return out


def error_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    assert events[-1]["event"] == "error", frames(events)[-3:]
    assert not [e for e in events if e["event"] == "data"]
    return events[-1]["data"]["error"]


def executor_state(url: str) -> dict[str, Any]:
    return httpx.get(url + "/readyz", headers=AUTH, timeout=10).json()


def wait_idle(url: str, timeout: float = 40) -> None:
    """Until the executor runs and queues nothing (earlier tests' jobs are gone)."""
    wait_for(lambda: (s := executor_state(url))["running"] == 0 and s["queued"] == 0, timeout, f"{url} idle")


def links(gateway: Server) -> list[dict[str, Any]]:
    return httpx.get(gateway.url + "/readyz", timeout=10).json()["executors"]


# -- executors, proxies, gateways ----------------------------------------------------------


class Restartable:
    """An executor that can be SIGKILLed and started again on the same port."""

    def __init__(self, model_path: Path, log_dir: Path, name: str) -> None:
        self.model_path, self.log_dir, self.name = model_path, log_dir, name
        self.starts = 0
        self.process = self._start(None)
        self.port = upstream_of(self.process.url)[1]

    def _start(self, port: int | None) -> ServeProcess:
        self.starts += 1
        log = self.log_dir / f"{self.name}-{self.starts}.log"
        return start_executor(self.model_path, log, token=TOKEN, port=port)

    @property
    def url(self) -> str:
        return self.process.url

    def kill(self) -> None:
        self.process.kill()

    def ensure_up(self) -> None:
        """Start it again if an earlier test left it dead."""
        if self.process.proc.poll() is not None:
            self.restart()

    def restart(self) -> None:
        self.process = self._start(self.port)

    def stop(self) -> None:
        self.process.stop()


@pytest.fixture(scope="module")
def executor(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """The executor every test may use; never killed."""
    process = start_executor(tiny_model_path, tmp_path_factory.mktemp("executor") / "executor.log", token=TOKEN)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def killable(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Restartable]:
    """An executor the tests kill and restart; up again after each test."""
    process = Restartable(tiny_model_path, tmp_path_factory.mktemp("killable"), "killable")
    yield process
    process.stop()


@pytest.fixture
def proxy(executor: ServeProcess) -> Iterator[FaultProxy]:
    """A fresh proxy in front of the shared executor, for one test."""
    wait_idle(executor.url)
    fault_proxy = FaultProxy(*upstream_of(executor.url)).start()
    yield fault_proxy
    fault_proxy.stop()


@pytest.fixture
def gateways() -> Iterator[Callable[..., Server]]:
    """`gateways([urls], deadline=…)`: in-process remote gateways, pinging every second; stopped after."""
    started: list[Server] = []

    def start(urls: list[str], *, token: str | None = TOKEN, deadline: float = 30.0, ready: bool = True) -> Server:
        server = make_remote_server(urls, token=token, deadline=deadline, ready=ready, ping_interval=1.0)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


# -- 1. the socket drops while the executor lives ------------------------------------------


def test_socket_drop_mid_job_resumes_every_frame_once(proxy: FaultProxy, gateways: Any) -> None:
    gateway = gateways([proxy.url])
    params = {**SLOW_ECHO, "repeat": 12}  # 3 s: it runs on after the socket is back
    baseline = LiveStream(gateway.url, "echo", params).result()
    check_log(baseline)

    live = LiveStream(gateway.url, "echo", params)
    live.wait_event(progress_at_least(2), "progress 2")
    proxy.block_sockets(True)
    assert proxy.cut_sockets() == 1
    attempts_before = len(proxy.stats.ws_attempts)
    # The executor runs on (its progress frames pile up there) while HTTP still works.
    time.sleep(1.2)
    assert httpx.get(proxy.url + "/healthz", headers=AUTH, timeout=10).status_code == 200
    assert not gateway.backend.links[0].connected
    retries = len(proxy.stats.ws_attempts) - attempts_before
    proxy.block_sockets(False)

    events = live.result()
    check_log(events)
    assert frames(events) == frames(baseline)
    assert events[-1]["data"] == {"text": "ab" * 12, "tokens": 3}
    # It reconnected, retrying with backoff: more than once, but not in a tight loop.
    assert proxy.stats.ws_opened >= 2
    assert 2 <= retries <= 15, retries


def test_socket_drop_while_queued_loses_nothing(proxy: FaultProxy, gateways: Any) -> None:
    gateway = gateways([proxy.url])
    queued_params = {"text": "qq", "repeat": 3, "delay": 0.25}
    baseline = LiveStream(gateway.url, "echo", queued_params).result()  # on an idle executor: QUEUED at 1 of 1

    first = LiveStream(gateway.url, "echo", SLOW_ECHO)
    first.wait_event(is_status("RUNNING"), "the first job running")
    second = LiveStream(gateway.url, "echo", queued_params)
    second.wait_event(is_status("QUEUED"), "the second job queued")
    assert executor_state(proxy.url)["queued"] == 1
    proxy.block_sockets(True)
    proxy.cut_sockets()
    time.sleep(0.8)
    proxy.block_sockets(False)

    first_events, second_events = first.result(), second.result()
    for events in (first_events, second_events):
        check_log(events)
    assert frames(second_events) == frames(baseline)
    assert second_events[-1]["data"] == {"text": "qq" * 3, "tokens": 3}
    assert first_events[-1]["data"] == {"text": "ab" * 8, "tokens": 3}
    assert proxy.stats.ws_opened >= 2


# -- 2. the executor dies --------------------------------------------------------------------


def test_executor_killed_mid_job_ends_it_after_the_deadline_and_a_restart_ends_it_at_once(
    killable: Restartable, gateways: Any
) -> None:
    killable.ensure_up()
    deadline = 2.0
    short = gateways([killable.url], deadline=deadline)
    patient = gateways([killable.url], deadline=120.0)  # outlives the restart
    running = LiveStream(short.url, "echo", LONG_ECHO)
    running.wait_event(progress_at_least(1), "the job running")
    waiting = LiveStream(patient.url, "echo", LONG_ECHO)
    waiting.wait_event(is_status("QUEUED"), "the second job queued behind it")

    killed_at = time.monotonic()  # before: the gateway may see the socket drop before kill() returns
    killable.kill()
    events = running.result(timeout=deadline + 20)
    check_log(events)
    error = error_of(events)
    assert error["code"] == "backend_unavailable" and error["retryable"] is True
    assert "unreachable" in error["message"]
    took = running.ended_at - killed_at
    assert deadline <= took <= deadline + 4.0, took  # not before the deadline; the watchdog looks every 0.5 s
    assert not [e for e in waiting.events if e["event"] in ("data", "error")], "the patient gateway gave up early"

    killable.restart()
    back_at = time.monotonic()
    events = waiting.result(timeout=30)
    check_log(events)
    error = error_of(events)
    assert error["code"] == "backend_unavailable"
    assert "lost the job" in error["message"]
    assert waiting.ended_at - back_at < 15, waiting.ended_at - back_at  # far inside its 120 s deadline

    # Both gateways use the executor again.
    for gateway in (short, patient):
        gateway.wait_ready(30)
        events = LiveStream(gateway.url, "echo", QUICK_ECHO).result(timeout=30)
        check_log(events)
        assert events[-1]["data"] == {"text": "q", "tokens": 2}


# -- 3. the client goes away -------------------------------------------------------------------


def test_client_disconnect_cancels_the_remote_job_and_frees_the_worker(
    proxy: FaultProxy, gateways: Any
) -> None:
    gateway = gateways([proxy.url])
    live = LiveStream(gateway.url, "echo", LONG_ECHO)
    live.wait_event(progress_at_least(3), "progress 3")
    queued = LiveStream(gateway.url, "echo", LONG_ECHO)
    queued.wait_event(is_status("QUEUED"), "the second job queued")
    assert (executor_state(proxy.url)["running"], executor_state(proxy.url)["queued"]) == (1, 1)

    # A queued job whose client goes away leaves the executor's queue; the running one runs on.
    queued.disconnect()
    wait_for(lambda: executor_state(proxy.url)["queued"] == 0, 10, "the executor's queue empty")
    assert executor_state(proxy.url)["running"] == 1
    assert f"DELETE /jobs/{queued.job_id} HTTP/1.1" in proxy.stats.requests

    live.disconnect()
    gone_at = time.monotonic()

    wait_for(lambda: f"DELETE /jobs/{live.job_id} HTTP/1.1" in proxy.stats.requests, 10, "the DELETE")
    wait_for(lambda: executor_state(proxy.url)["running"] == 0, 10, "the executor's worker free")
    freed = time.monotonic() - gone_at
    assert executor_state(proxy.url)["queued"] == 0
    assert gateway.backend.links[0].jobs == {}

    started = time.monotonic()
    events = LiveStream(gateway.url, "echo", QUICK_ECHO).result(timeout=30)
    check_log(events)
    assert events[-1]["data"] == {"text": "q", "tokens": 2}
    assert time.monotonic() - started < 10
    assert freed < 10, freed


# -- 4. a result download breaks ---------------------------------------------------------------


def test_a_result_download_cut_once_is_fetched_again(proxy: FaultProxy, gateways: Any) -> None:
    gateway = gateways([proxy.url])
    expected = LiveStream(gateway.url, "embed", BIG_EMBED).result()[-1]
    assert expected["event"] == "data" and len(expected["data"]["embeddings"]) == 8
    assert proxy.stats.result_requests == 1

    proxy.break_results("cut", times=1)
    events = LiveStream(gateway.url, "embed", BIG_EMBED).result()
    check_log(events)
    assert events[-1]["event"] == "data"
    assert events[-1]["data"] == expected["data"]
    assert proxy.stats.results_broken == 1
    assert proxy.stats.result_requests == 3  # the first run's, the broken one, the retry


@pytest.mark.parametrize("fault", ["corrupt", "truncate", "truncate_close", "cut"])
def test_a_result_broken_every_time_is_an_error_not_garbage(
    proxy: FaultProxy, gateways: Any, fault: str
) -> None:
    gateway = gateways([proxy.url])
    proxy.break_results(fault)
    started = time.monotonic()
    events = LiveStream(gateway.url, "embed", BIG_EMBED).result()
    took = time.monotonic() - started
    check_log(events)
    error = error_of(events)
    assert error["code"] == "backend_unavailable", error
    assert "could not be downloaded intact" in error["message"], error
    assert proxy.stats.results_broken >= 2  # it did try again
    assert took < 15, took
    # The executor is told to drop the result it still holds.
    wait_for(lambda: f"DELETE /jobs/{events[0]['data']['job_id']} HTTP/1.1" in proxy.stats.requests, 10, "the DELETE")
    assert httpx.get(f"{proxy.url}/jobs/{events[0]['data']['job_id']}/result", headers=AUTH).status_code == 404


# -- 5. two executors ----------------------------------------------------------------------------


def test_two_executors_least_loaded_and_a_killed_one_gets_no_jobs_until_it_is_back(
    executor: ServeProcess, killable: Restartable, gateways: Any
) -> None:
    killable.ensure_up()
    wait_idle(executor.url)
    gateway = gateways([executor.url, killable.url])
    wait_for(lambda: all(link["ready"] for link in links(gateway)), 30, "both executors ready")

    # Least-loaded: with a long job on one, the next goes to the other.
    one = LiveStream(gateway.url, "echo", LONG_ECHO)
    one.wait_event(progress_at_least(1), "the first long job running")
    two = LiveStream(gateway.url, "echo", LONG_ECHO)
    two.wait_event(progress_at_least(1), "the second long job running")  # running, so not queued behind one
    assert [link["jobs"] for link in links(gateway)] == [1, 1]
    for live in (one, two):
        live.disconnect()
    wait_for(lambda: [link["jobs"] for link in links(gateway)] == [0, 0], 10, "both jobs gone")

    killable.kill()
    wait_for(lambda: not links(gateway)[1]["ready"], 10, "the killed executor seen as not ready")
    # Two jobs at once, though the dead executor would be the least loaded: both go to the live one.
    jobs = [LiveStream(gateway.url, "echo", LONG_ECHO) for _ in range(2)]
    for live in jobs:
        live.wait_event(is_status("DISPATCHED"), "the job dispatched")
    assert [link["jobs"] for link in links(gateway)] == [2, 0]
    quick = LiveStream(gateway.url, "echo", QUICK_ECHO)
    assert [link["jobs"] for link in links(gateway)] == [3, 0]
    quick.disconnect()

    killable.restart()
    wait_for(lambda: links(gateway)[1]["ready"], 30, "the restarted executor ready again")
    back = LiveStream(gateway.url, "echo", SLOW_ECHO)
    back.wait_event(is_status("DISPATCHED"), "the job dispatched")
    assert [link["jobs"] for link in links(gateway)] == [2, 1]  # the one that came back got it
    for live in jobs:
        live.disconnect()
    events = back.result()
    check_log(events)
    assert events[-1]["data"] == {"text": "ab" * 8, "tokens": 3}
    assert executor_state(killable.url)["sessions"] == 1
    wait_idle(executor.url, 15)


# -- 6. the token ------------------------------------------------------------------------------


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}],
                         ids=["none", "wrong", "no-scheme"])
def test_every_executor_endpoint_needs_the_token(executor: ServeProcess, headers: dict[str, str]) -> None:
    calls = [
        ("POST", "/jobs", {"content": b'{"tool":"echo","params":{"text":"x"},"job_id":"j1"}',
                           "headers": {"X-Session-Id": "s1", "Content-Type": "application/json"}}),
        ("GET", "/jobs/j1/result", {}),
        ("DELETE", "/jobs/j1", {}),
        ("GET", "/tools", {}),
        ("GET", "/healthz", {}),
        ("GET", "/readyz", {}),
    ]
    with httpx.Client(base_url=executor.url, timeout=10) as client:
        for method, path, kwargs in calls:
            response = client.request(method, path, **{**kwargs, "headers": {**kwargs.get("headers", {}), **headers}})
            assert response.status_code == 401, (method, path, response.status_code, response.text)
            assert response.json()["error"]["code"] == "unauthorized", (method, path)
        # With the token, the same calls get past the check.
        assert client.get("/healthz", headers=AUTH).status_code == 200
        assert client.get("/jobs/j1/result", headers=AUTH).status_code == 404

    ws_url = "ws" + executor.url.removeprefix("http") + "/session?id=auth-test"
    with (
        pytest.raises(websockets.exceptions.InvalidStatus) as refused,
        ws_connect(ws_url, additional_headers=headers, open_timeout=10),
    ):
        pass
    assert refused.value.response.status_code == 401
    with ws_connect(ws_url, additional_headers=AUTH, open_timeout=10) as socket_:
        socket_.send(json.dumps({"op": "resume", "job_id": "nope", "after_seq": 0}))
        lost = json.loads(socket_.recv(timeout=10))
        assert lost["job_id"] == "nope" and lost["seq"] == 0 and lost["kind"] == "error"


def test_a_gateway_with_the_wrong_token_is_not_ready_and_says_why(
    executor: ServeProcess, gateways: Any
) -> None:
    gateway = gateways([executor.url], token="not-the-token", ready=False)

    def readyz() -> httpx.Response:
        return httpx.get(gateway.url + "/readyz", timeout=10)

    def says_why(text: str) -> bool:
        return "refused the token" in text

    wait_for(lambda: "token" in readyz().text, 10, "the reason on /readyz")
    for _ in range(10):  # whichever of the two loops wrote last, the reason stays clear
        answer = readyz()
        assert answer.status_code == 503
        assert answer.json()["ready"] is False
        assert says_why(answer.json()["reason"]), answer.json()
        time.sleep(0.15)
    run = httpx.post(gateway.url + "/echo/run", json=QUICK_ECHO, timeout=10)
    assert run.status_code == 503, run.text
    error = run.json()["error"]
    assert error["code"] == "not_ready"
    assert says_why(error["message"]), error
    # Waiting will not mend a refused token: not retryable, no Retry-After.
    assert error["retryable"] is False
    assert "retry-after" not in run.headers
