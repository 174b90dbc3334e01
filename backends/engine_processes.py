"""Engine processes, supervised by the gateway (`--engine process`, backends/engines.py drives them).

For each `--model` the gateway starts an engine on each of its devices, `python -m gateway engine`:
an executor service (backends/executor.py) with that one copy, listening on a Unix socket in a
folder only this user may enter. A vLLM model's engine is vLLM's own server (`VllmEngine`).

- an engine that exits, whatever the cause (a crash, `kill -9`, the kernel's
  out-of-memory killer, exit 70 after a device failed: backends/local.py), is started
  again, after a pause that doubles from 0.5 s to 30 s and starts over once an engine
  has lived a minute; its link hears of it (`lost`), and deals with its jobs;
- `--engine-memory-limit` caps each engine's address space (RLIMIT_AS), so that a
  runaway job fails with that job's error instead of taking the host's memory;
- an engine dies with its gateway (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import resource
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import msgspec

from backends import vllm_server
from backends import loading as models
from gateway.config import Settings


log = logging.getLogger("streamgate.engines")

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
HEALTHY_AFTER_S = 60.0  # an engine that lived this long starts the backoff over when it exits
STOP_GRACE_S = 5.0  # on the gateway's stop: SIGTERM, then SIGKILL after this long
SOCKET_VAR = "STREAMGATE_ENGINE_SOCKET"  # an engine's Unix socket; its settings (JSON) arrive on stdin


def exit_reason(code: int) -> str:
    """How a process ended, as `asyncio`'s return code says it."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}" + (" (the out-of-memory killer sends it, among others)" if -code == signal.SIGKILL else "")
    if code == 70:
        return "exited after its device failed"
    return f"exited with status {code}"



class Supervised(Protocol):
    """What an engine tells its link (backends/engines.py's `EngineLink`, or a vLLM server's `ServerLink`)."""

    problem: str
    ready_since_start: bool

    @property
    def ready(self) -> bool: ...

    def lost(self, reason: str) -> None:
        """The engine's process ended (`reason` says how): its jobs end, or wait for the next one."""
        ...


@dataclass(eq=False)
class Engine:
    """One engine process: how to start it, and what became of it."""

    name: str  # the model's
    device: str  # the one device its copy of the model is on
    link: Supervised
    memory_limit: int | None = None
    settings: Settings | None = None
    socket: Path | None = None
    restarts: int = 0
    state: str = "starting"  # starting, running, restarting, failed (to launch; tried again), given up (`unfixable`), stopped
    pid: int | None = None
    last_exit: str | None = None
    process: asyncio.subprocess.Process | None = None

    @property
    def shown_state(self) -> str:
        """The state as a reader of `/readyz` should take it: a process still up whose link is down is not
        "running" to anyone (it is loading its model, or dying and not yet reaped)."""
        if self.state == "running" and not self.link.ready:
            return "starting" if not self.link.ready_since_start else "not answering"
        return self.state

    async def _launch(self) -> asyncio.subprocess.Process:
        assert self.socket is not None and self.settings is not None
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()  # a dead engine's socket: the next one binds anew
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "engine",
            stdin=asyncio.subprocess.PIPE,
            env={**os.environ, SOCKET_VAR: str(self.socket)},
            start_new_session=True,  # Ctrl-C reaches the gateway, which stops its engines itself
        )
        assert process.stdin is not None
        process.stdin.write(msgspec.json.encode(self.settings))
        process.stdin.close()
        return process

    async def supervise(self) -> None:
        pause = BACKOFF_FIRST_S
        while True:
            self.state = "starting" if self.restarts == 0 else "restarting"
            try:
                self.process = await self._launch()
            except Exception as exc:  # nothing to start (vLLM's Python gone, a GGUF that does not convert)
                self.state, self.last_exit = "failed", f"could not be started: {exc}"
                self.link.problem = self.last_exit
                log.error("the engine of model %s on %s %s; trying again in %.1f s", self.name, self.device, self.last_exit, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, BACKOFF_MAX_S)
                continue
            self.pid = self.process.pid
            born = time.monotonic()
            self.state = "running"
            code = await self.process.wait()
            self.pid = None
            self.last_exit = exit_reason(code)
            if (reason := self.unfixable()) is not None:
                self.state, self.last_exit = "given up", f"{self.last_exit}: {reason}"
                log.error("the engine of model %s on %s failed to start twice the same way (%s); not started again: "
                          "fix its settings and restart the gateway", self.name, self.device, reason)
                self.link.give_up(f"its server failed to start twice the same way, and is not started again: {reason}")
                return
            self.restarts += 1
            log.error("the engine of model %s on %s %s; starting it again in %.1f s", self.name, self.device, self.last_exit, pause)
            self.state = "restarting"
            self.link.lost(f"of model {self.name} on {self.device} {self.last_exit}")
            if time.monotonic() - born > HEALTHY_AFTER_S:
                pause = BACKOFF_FIRST_S
            await asyncio.sleep(pause)
            pause = min(pause * 2, BACKOFF_MAX_S)

    grace_s: ClassVar[float] = STOP_GRACE_S

    def unfixable(self) -> str | None:
        """Why the process that just ended cannot be fixed by starting it again, if it cannot."""
        return None

    def _signal(self, process: asyncio.subprocess.Process, sig: signal.Signals) -> None:
        process.send_signal(sig)

    async def stop(self) -> None:
        """SIGTERM (it drains), then SIGKILL to what is left after `grace_s`."""
        self.state = "stopped"
        process = self.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self._signal(process, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.grace_s):
                await process.wait()
        with contextlib.suppress(ProcessLookupError):
            self._signal(process, signal.SIGKILL)
        await process.wait()

    def rss(self) -> int | None:
        """The engine's resident memory in bytes, while it runs (Linux)."""
        if self.pid is None:
            return None
        try:
            return int(Path(f"/proc/{self.pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return None


@dataclass(eq=False)
class VllmEngine(Engine):
    """A vLLM OpenAI server for one model, started from vLLM's own environment; its lines are the gateway's."""

    command: list[str] = field(default_factory=list)
    spec: models.ModelSpec | None = None
    cache_dir: str | None = None

    async def _launch(self) -> asyncio.subprocess.Process:
        assert self.spec is not None
        if self.process is not None:  # the last server's engine processes, should any outlive it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        if self.spec.gguf is not None and self.restarts == 0:
            # vLLM reads a folder: the GGUF converted once, as for a model here (it is cached).
            folder = await asyncio.to_thread(models.converted_folder, self.spec, self.cache_dir)
            self.command[self.command.index(vllm_server.MODEL_PLACEHOLDER)] = str(folder)
        process = await asyncio.create_subprocess_exec(
            *self.command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        assert process.stdout is not None
        self.error = None
        task = asyncio.create_task(vllm_server.relay_lines(process.stdout, f"{self.name} (vllm)", self._errored))
        self._relays.add(task)
        task.add_done_callback(self._relays.discard)
        return process

    def __post_init__(self) -> None:
        self._relays: set[asyncio.Task[None]] = set()
        self.error: str | None = None  # the last exception its server printed, since it was started
        self._failed_before: str | None = None  # the exception of the last start that never got ready

    def _errored(self, line: str) -> None:
        self.error = line

    def sizing(self) -> dict[str, Any]:
        """The server's KV cache and dtype as its command gives them (None: vLLM's own choice)."""
        def flag(name: str) -> str | None:
            for i, arg in enumerate(self.command):
                if arg == name and i + 1 < len(self.command):
                    return self.command[i + 1]
                if arg.startswith(name + "="):
                    return arg.split("=", 1)[1]
            return None

        kv = flag("--kv-cache-memory-bytes")
        return {"kv_cache_bytes": int(kv) if kv is not None and kv.isdigit() else kv, "dtype": flag("--dtype")}

    def unfixable(self) -> str | None:
        """A server that never got ready, twice in a row with the same exception (numbers aside: free
        memory moves), fails for its settings or its machine: a restart would fail the same way."""
        error, self.error = self.error, None
        if self.link.ready_since_start or error is None:
            self._failed_before = None
            return None
        same = re.sub(r"\d+(?:\.\d+)?", "#", error)
        if same == self._failed_before:
            return error
        self._failed_before = same
        return None

    grace_s: ClassVar[float] = STOP_GRACE_S * 3  # vLLM drains its requests and its engine first

    def _signal(self, process: asyncio.subprocess.Process, sig: signal.Signals) -> None:
        os.killpg(process.pid, sig)  # the server's group: its own engine processes too


def engine_devices(settings: Settings, spec: models.ModelSpec) -> list[str]:
    """The devices `spec`'s copies go on, an engine each: as a gateway with threads would put them."""
    if spec.devices:
        return list(spec.devices)
    if settings.devices:
        return list(settings.devices)
    if settings.device:
        return [settings.device]
    return models.default_devices()


def engine_settings(settings: Settings, spec: models.ModelSpec, first: bool, token: str, device: str) -> Settings:
    """The settings of the engine of `spec` on `device`: the gateway's, with that one copy alone."""
    loader = [f"{spec.name}={spec.loader}"] if spec.loader else []
    # A GGUF (the bundled default's too) by its path: the engine converts it, or finds it converted, as threads would.
    source = str(spec.gguf) if spec.gguf is not None else spec.source
    return msgspec.structs.replace(
        settings,
        model=[f"{spec.name}={source}"] if source else [],
        model_loader=loader,
        model_devices=[f"{spec.name}={device}"],
        devices=[device],  # its job memory is that device's (backends/local.py)
        device=None,
        sae=settings.sae if first else [],  # SAEs are read on the default model's layers
        executor_token=token,
        # The gateway checked the body's size already; what it sends on is its params re-encoded.
        max_body_bytes=max(settings.max_body_bytes * 2, 1 << 20),
        tokens=[],
        tokens_file=None,
    )


def child_settings() -> tuple[Settings, str]:
    """In an engine process (`python -m gateway engine`): its settings and socket, as its gateway
    gave them; and from here on it dies with that gateway (Linux: PR_SET_PDEATHSIG), however
    the gateway dies, and holds no more address space than `--engine-memory-limit`."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the gateway died before the line above ran
        os._exit(0)
    settings = msgspec.json.decode(sys.stdin.buffer.read(), type=Settings)
    if settings.engine_memory_limit:
        resource.setrlimit(resource.RLIMIT_AS, (settings.engine_memory_limit, settings.engine_memory_limit))
    return settings, os.environ[SOCKET_VAR]


def engine_name(settings: Settings) -> str:
    """What an engine's log lines call it: its model, and its device."""
    spec = models.specs(settings.model, settings.model_loader, settings.model_devices)[0]
    return f"{spec.name} on {','.join(spec.devices)}" if spec.devices else spec.name
