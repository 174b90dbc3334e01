"""Streamgate processes for tests: `serve` and `executor` as real subprocesses on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
STREAMGATE = Path(sys.executable).parent / "streamgate"
START_TIMEOUT = 180  # importing torch and loading the model on a slow, busy machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without PYTHONPATH or any STREAMGATE_* or OTEL_* setting (a process traces only
    when its test says so), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STREAMGATE_", "OTEL_")) and k != "PYTHONPATH"}
    env.update(extra)
    return env


@dataclass
class ServeProcess:
    """A `streamgate serve` or `streamgate executor` subprocess and its log."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    headers: dict[str, str] | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the process exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/readyz", headers=self.headers, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the process did not become ready:\n{self.output()}")

    def kill(self) -> None:
        """SIGKILL: the process dies mid-whatever, as in a crash."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def start_serve(
    args: list[str],
    env: dict[str, str],
    port: int,
    log: Path,
    *,
    command: str = "serve",
    headers: dict[str, str] | None = None,
    timeout: float = START_TIMEOUT,
) -> ServeProcess:
    """Start `streamgate <command> <args>` from the repository root; ready when it returns."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(STREAMGATE), command, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    server = ServeProcess(proc, f"http://127.0.0.1:{port}", log, headers)
    try:
        server.wait_ready(timeout)
    except BaseException:
        server.stop()
        raise
    return server


def start_executor(
    model_path: Path | str | list[str], log: Path, *, token: str | None = None, port: int | None = None, extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> ServeProcess:
    """`streamgate executor` on the tiny model (or on several, as ["NAME=SOURCE", …]) with the test user tools, its
    environment ours plus `env`; ready when it returns."""
    port = port or free_port()
    models = model_path if isinstance(model_path, list) else [str(model_path)]
    args = [*(arg for model in models for arg in ("--model", model)), "--port", str(port), "--tools", "tests.support.user_tools",
            "--device", "cpu", "--log-level", "warning", *(extra or [])]
    env = clean_env(**(env or {}), **({"STREAMGATE_EXECUTOR_TOKEN": token} if token else {}))
    return start_serve(args, env, port, log, command="executor", headers={"Authorization": f"Bearer {token}"} if token else None)
