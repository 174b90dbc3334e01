"""The vLLM server a `--model NAME=vllm:PATH` engine runs: its interpreter, its command line sized
for this machine, and its output relayed as the gateway's log lines (its last exception line kept
as the reason it stopped). backends/engine_processes.py `VllmEngine` supervises the process;
backends/inference.py `ServerLink` sends it jobs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

MODEL_PLACEHOLDER = "<converted>"  # in a vLLM command, the GGUF's folder once converted
# The environment `make vllm` builds beside the project's (vLLM pins its own transformers and companions).
VLLM_ENV = Path(__file__).resolve().parents[1] / ".vllm"


def vllm_python(given: str | None) -> str:
    """The interpreter of vLLM's environment: `--vllm-python`, else the project's `.vllm`."""
    if given:
        return given
    python = VLLM_ENV / "bin" / "python"
    if not python.exists():
        raise ValueError(f"vLLM's environment is not at {VLLM_ENV}: `make vllm` builds it, or give --vllm-python")
    return str(python)


# A Python exception's last line (`ValueError: Available memory on node 0 …`): why a server stopped.
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception): \S")


async def relay_lines(stream: asyncio.StreamReader, engine: str, on_error: Callable[[str], None] | None = None) -> None:
    """A server's output, line by line, as the gateway's log lines naming it; each exception's last
    line (with vLLM's prefixes) also to `on_error`."""
    out = logging.getLogger("streamgate.vllm")
    error = ""  # the last exception line, while the lines after it may say more (pydantic's do)
    while line := await stream.readline():
        text = line.decode(errors="replace").rstrip()
        if text:
            level = logging.WARNING if " WARNING " in text else logging.ERROR if " ERROR " in text or "Traceback" in text else logging.INFO
            out.log(level, "%s", text, extra={"engine": engine})
            if on_error is None:
                continue
            bare = _bare(text)
            if _EXCEPTION.match(bare):
                error = bare
                on_error(error)
            elif error and bare[:1].isspace() and not bare.strip().startswith("For further information"):
                error = f"{error}: {bare.strip()[:300]}"
                on_error(error)
            else:
                error = ""


def _bare(line: str) -> str:
    """A server's line without vLLM's prefix (`(EngineCore pid=12) ERROR 11-28 13:02:11 [core.py:12] `)."""
    if "] " in line and (" ERROR " in line or " WARNING " in line or " INFO " in line):
        return line.split("] ", 1)[1]
    return line.split(") ", 1)[1] if line.startswith("(") and ") " in line else line


# vLLM's OpenAI server, started so that it dies with the gateway (Linux: PR_SET_PDEATHSIG, SIGTERM so
# that it stops its own engine processes), however the gateway dies.
_LAUNCH = (
    "import ctypes, os, runpy, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(0)\n"
    "sys.argv = ['vllm-openai-server', *sys.argv[2:]]\n"
    "runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__', alter_sys=True)\n"
)


def vllm_command(
    python: str, path: str, name: str, port: int, dtype: str | None, extra: list[str], *, kv_cache_bytes: int | None = None,
    on_gpu: bool | None = None, cpuinfo: str | None = None,
) -> list[str]:
    """The command line of a vLLM OpenAI server on `path`, called `name`, on a loopback port.

    Sized and typed by the gateway unless `extra` (--vllm-args) says otherwise:
    - its KV cache is `kv_cache_bytes` (vLLM's --kv-cache-memory-bytes); on a CPU, without it,
      `KV_CACHE_CPU`: vLLM would otherwise reserve --gpu-memory-utilization (0.92) of the host's
      memory and refuse to start on a machine with other work on it. On a GPU, without it, vLLM
      sizes its cache itself, from its share of the GPU's memory;
    - on a CPU without bfloat16 instructions (AVX512-BF16, AMX), float32: vLLM casts a float32
      checkpoint to bfloat16 by default, which such a CPU runs 2.5-3.6x slower;
    - scheduled by request priority (`--scheduling-policy priority`), which the gateway sets from the
      job's class of users once its probe shows the server takes one (backends/server_probes.py).
    """
    command = [
        python, "-c", _LAUNCH, str(os.getpid()), "--model", path, "--served-model-name", name,
        "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
    ]
    on_gpu = gpu_present() if on_gpu is None else on_gpu
    if dtype and dtype != "auto":
        command += ["--dtype", dtype]
    elif dtype is None and not on_gpu and not _given(extra, "--dtype") and not cpu_has_bf16(cpuinfo):
        command += ["--dtype", "float32"]
    if not _given(extra, "--scheduling-policy"):
        command += ["--scheduling-policy", "priority"]
    if not _given(extra, "--kv-cache-memory-bytes", "--gpu-memory-utilization"):
        budget = kv_cache_bytes if kv_cache_bytes is not None else None if on_gpu else KV_CACHE_CPU
        if budget is not None:
            command += ["--kv-cache-memory-bytes", str(budget)]
    return command + extra


KV_CACHE_CPU = 2 << 30  # a vLLM server's KV cache on a CPU without --vllm-kv-cache-bytes


def _given(extra: list[str], *flags: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in extra for flag in flags)


def gpu_present() -> bool:
    """Whether an NVIDIA GPU is on this machine (its driver lists one), as a vLLM server would find it."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bfloat16 instructions (the flags Linux lists for AVX512-BF16 or AMX)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True  # unknown: vLLM's own default
    flags = {flag for line in cpuinfo.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[-1].split()}
    return bool(flags & {"avx512_bf16", "amx_bf16"})
