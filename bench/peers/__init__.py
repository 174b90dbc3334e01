"""Other servers the benchmarks measure streamgate against, each in an environment of its own.

A peer runs in `bench/peers/.venv`, made from `requirements.txt` beside this
file, not in the project's environment: its dependencies (LitServe, and what
LitServe pins of FastAPI and uvicorn) must not change what streamgate itself
runs on, and the project must not depend on them. The pins of torch,
transformers, tokenizers and safetensors are the project's own, so that both
sides run the same code on the same weights.

`start()` runs a peer's server from that environment, in a session of its
own: LitServe forks an API server and spawns a worker and a manager process,
and stopping it stops them all.

`ensure_env()` makes the environment once: `python -m venv`, then `pip install
-r requirements.txt` (torch as the local CPU wheel, about 2.5 minutes on 2
cores), and writes the requirements' hash in a stamp file. Later calls find
the stamp and return at once; a changed requirements file installs again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.common import Bench
    from tests.support.processes import ServeProcess

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements.txt"
ENV = HERE / ".venv"
STAMP = ENV / "requirements.sha256"
INSTALL_TIMEOUT_S = 1800
SERVERS = {"litserve": HERE / "litserve_server.py"}


def python() -> Path:
    return ENV / "bin" / "python"


def installed() -> bool:
    """True when the environment holds what requirements.txt says now."""
    try:
        return python().exists() and STAMP.read_text().strip() == _digest()
    except OSError:
        return False


def ensure_env(say: Callable[[str], None] = print) -> Path:
    """The peers' Python, after making or updating bench/peers/.venv if requirements.txt changed.

    Two runs at once wait for each other: a lock on requirements.txt is held
    while installing. `say` is told what is done, and how long it took.
    """
    with REQUIREMENTS.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if installed():
            return python()
        start = time.monotonic()
        where = ENV.relative_to(HERE.parents[1])
        if not python().exists():
            say(f"creating {where} for the peers (once: about 2.5 minutes)")
            # This interpreter's version: the torch wheel on disk is built for it.
            _run([sys.executable, "-m", "venv", "--clear", str(ENV)])
        else:
            say(f"{REQUIREMENTS.name} changed: installing it into {where}")
        _run([str(python()), "-m", "pip", "install", "--disable-pip-version-check", "-r", str(REQUIREMENTS)])
        STAMP.write_text(_digest() + "\n")
        say(f"peer environment ready in {time.monotonic() - start:.0f} s")
        return python()


def _digest() -> str:
    return hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()


def _run(argv: list[str]) -> None:
    """Run an install step; its output is kept in the environment's install.log, and shown if it fails."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    with contextlib.suppress(OSError), (ENV / "install.log").open("a") as log:
        log.write(f"$ {' '.join(argv)}\n{output}\n")
    if proc.returncode != 0:
        tail = "\n".join(output.splitlines()[-20:])
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{tail}")


class _Group(subprocess.Popen):
    """A process that leads a session of its own: SIGTERM goes to it alone (LitServe then stops its
    children itself), and once it has exited, whatever it left in its group is killed."""

    swept = False

    def wait(self, timeout: float | None = None) -> int:
        code = super().wait(timeout)
        if not self.swept:  # once: later, another session could have come to hold this number
            self.swept = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        return code

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)


def start(bench: Bench, peer: str, argv: Sequence[str], port: int, env: dict[str, str] | None = None) -> ServeProcess:
    """Start `peer`'s server on `port` with `argv` from the repository root; not yet waited for.

    Its process is one of `bench`'s, stopped with the others; `wait_ready()`
    waits for LitServe's `/health`, which answers once its worker has loaded the model.
    """
    from tests.support.processes import ROOT, ServeProcess, clean_env

    class Peer(ServeProcess):
        def wait_ready(self) -> None:
            wait_health(self)

    log = bench.dir / f"{peer}.log"
    command = [str(python()), str(SERVERS[peer]), "--port", str(port), *argv]
    with log.open("wb") as out:
        proc = _Group(command, cwd=ROOT, env=clean_env(**(env or {})), stdout=out, stderr=subprocess.STDOUT,
                      start_new_session=True)
    process = Peer(proc, f"http://127.0.0.1:{port}", log)
    bench.processes.append(process)
    return process


def wait_health(process: ServeProcess, path: str = "/health") -> None:
    import httpx

    from tests.support.processes import START_TIMEOUT

    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.proc.poll() is not None:
            raise RuntimeError(f"the peer exited with {process.proc.returncode}:\n{process.output()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(process.url + path, timeout=5).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"the peer did not become ready in {START_TIMEOUT} s:\n{process.output()}")


def info(process: ServeProcess) -> dict[str, Any]:
    """LitServe's `GET /info`: the `model_metadata` the server was given (device, dtype, versions…)."""
    import httpx

    return httpx.get(process.url + "/info", timeout=10).json()
