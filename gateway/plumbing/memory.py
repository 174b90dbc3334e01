"""Memory given back: what big work freed returns to the OS, and to the device, once it is done.

glibc keeps the heap a process frees for reuse, and torch's CUDA allocator keeps
the device blocks it freed: after one big job (a long per-token embedding, a
large batch) the process would hold its peak for as long as it lives, though
nothing uses that memory. `give_back` returns it: `malloc_trim(0)` (glibc on
Linux; elsewhere there is nothing to call) and the CUDA allocator's unused
blocks.

The one rule: it runs on a device's thread as its worker goes idle, and only
once the process's resident memory grew by more than GIVE_BACK_MIB since the
last time (or, on a CUDA device, its allocator holds that much unused). A
small job so pays one read of /proc/self/statm, off the event loop; and
nothing is given back between the steps of work that would only take the
same memory again.

`free_device_memory` is the other way back, after an out-of-memory error:
unconditional, and with a garbage collection first.

`settle` takes what a process holds for its whole life (imported modules,
loaded models, the server's routes: 300 to 400 thousand objects tracked by the
garbage collector in a gateway) out of the collector's full passes: each of
those walked all of it, and a gateway streaming tokens to 64 clients stopped
its event loop for 170 to 210 ms every few seconds to do so.

`bound_heap` keeps a job's peak to what it holds: glibc raises its threshold
for mapping a block on its own each time a big mapped block is freed, up to
32 MiB, after which the activations of one forward pass after another are
carved from the heap, which fragments and holds several passes' worth (a
patching job's 63 passes of 118 MB each peaked at 570 MB, against 160 MB with
the threshold fixed). Fixed at 1 MiB, every block that size or more is mapped
when allocated and unmapped when freed: a big pass pays its page faults
again, a few percent of its time; small allocations are untouched.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import threading
import time
from collections.abc import Callable

import torch

log = logging.getLogger("streamgate.memory")

GIVE_BACK_MIB = 64
_GIVE_BACK = GIVE_BACK_MIB << 20
# Between a chunked job's steps: what a long job holds past its work's own peak (a trim costs 26 ms
# for a 300 MiB heap; one every few dozen steps of a 5,208-window job is 1% of its time).
TRIM_MIB = 16


def _glibc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library is another (musl, macOS)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        return ctypes.CDLL(None).malloc_trim
    except (ValueError, OSError, AttributeError):  # no such confstr name, or no such symbol
        return None


class _Process:
    """This process's resident memory, and how low it was since memory was last given back."""

    def __init__(self) -> None:
        self.trim = _glibc_trim()
        try:
            self._statm: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._statm = None
        self._page = os.sysconf("SC_PAGE_SIZE") if self._statm is not None else 0
        self.floor: int | None = None  # bytes
        self.lock = threading.Lock()  # one device's thread gives back at a time

    def resident(self) -> int | None:
        if self._statm is None:
            return None
        return int(os.pread(self._statm, 64, 0).split()[1]) * self._page

    def grew(self, by: int = _GIVE_BACK) -> bool:
        """Whether resident memory grew by more than `by` (GIVE_BACK_MIB) over its lowest since the last give-back."""
        now = self.resident()
        if now is None:
            return False
        if self.floor is None or now < self.floor:
            self.floor = now
        return now - self.floor > by

    def gave_back(self) -> None:
        self.floor = self.resident()


_process = _Process()


def _cuda_unused(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def give_back(device: torch.device | str) -> None:
    """On `device`'s thread as its worker goes idle: give back what big work freed (see the rule above)."""
    device = torch.device(device)
    cuda = device.type == "cuda" and torch.cuda.is_initialized()
    heap = _process.trim is not None and _process.grew()
    if not heap and not (cuda and _cuda_unused(device) > _GIVE_BACK):
        return
    with _process.lock:
        started, before = time.perf_counter(), _process.resident()
        if cuda:
            torch.cuda.empty_cache()
        if _process.trim is not None:
            # ctypes lets go of the GIL: the event loop runs on, but for a malloc that waits on the
            # arena being trimmed (26 ms for a 300 MiB heap).
            _process.trim(0)
        _process.gave_back()
    if before is not None and _process.floor is not None:
        log.debug("gave back %d MiB in %.1f ms", (before - _process.floor) >> 20, (time.perf_counter() - started) * 1000)


def trim_heap() -> None:
    """Between the steps of long work (a chunked job's chunks): the heap's freed pages back, by the
    rule of `give_back` with TRIM_MIB (grown by that since the last time), the device's cache left
    alone. A small output kept step after step (a window's pooled vector) is allocated among the
    step's freed activations and keeps them from being taken whole again: a job of 5,208 windows
    grew by 2 MB a step, 760 MB in all, where this holds it within TRIM_MIB."""
    if _process.trim is None or not _process.grew(TRIM_MIB << 20):
        return
    with _process.lock:
        _process.trim(0)
        _process.gave_back()


# Blocks this size or more are mapped and unmapped on their own (see `bound_heap`).
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def bound_heap() -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD, once per process (a model-running one); False
    where the C library is not glibc or will not take it."""
    if _process.trim is None:
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def settle() -> None:
    """Once the process has loaded what it keeps: move every object the garbage collector tracks now
    out of its generations (`gc.freeze`), so that no collection walks them again. They are still
    freed when nothing refers to them; only a cycle among them would stay (none is made at start)."""
    gc.collect()
    gc.freeze()


def free_device_memory() -> None:
    """Hand cached blocks back after an out-of-memory error, so the next job starts clean."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    mps = getattr(torch, "mps", None)
    if mps is not None and torch.backends.mps.is_available():
        mps.empty_cache()
