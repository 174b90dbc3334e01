"""A real `redis-server` for tests: started on a free loopback port in a temporary folder, no persistence.

Import the `redis_server` fixture into a test module. Where Debian's redis-server
is missing the tests that use it fail, never skip: `make test` checks for it first
(scripts/check-system) and says how to install it. STREAMGATE_REDIS_SERVER names
another redis-server binary.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.processes import free_port

# As scripts/check-system reads it: a path, or a name looked up on PATH.
_GIVEN = os.environ.get("STREAMGATE_REDIS_SERVER") or "redis-server"
REDIS_SERVER = shutil.which(_GIVEN) or _GIVEN


@dataclass
class RedisServer:
    """One redis-server process; `stop` and `start` again keep its port (and lose its data)."""

    folder: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        log = open(self.folder / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.folder)],
            cwd=self.folder,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.folder / 'redis.log').read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


def start_redis(folder: Path) -> RedisServer:
    if not os.access(REDIS_SERVER, os.X_OK):
        pytest.fail(f"no redis-server at {REDIS_SERVER}: install Debian's redis-server (apt-get install redis-server)")
    return RedisServer(folder, free_port()).start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()
