"""A job's checkpoint: the pieces of work its run has finished, kept where the process that runs
it again after a crash finds them.

A job of a tool whose work falls into independent chunks (`embed`'s and
`pseudo_loglikelihood`'s texts and windows: gateway/tools/batching.py) that runs
in an engine process (backends/engines.py) is given a folder of the gateway's
own. After each chunk, the run appends that chunk's outputs for the job (each
window's share of its text, a few floats) to the folder's journal; a job that
writes result files writes them into the folder too. If the engine dies, the
gateway submits the job again to the new engine with the same folder, and the
run skips every piece the journal holds: the job goes on from its last finished
window instead of from the start, and its progress counts each window once.

The journal is a list of records, each its length and a pickle (the folder is
this user's alone, 0700, and only its own processes write it). A record is
written with one `write` after its chunk's files are: a process killed
mid-record leaves a torn last record, which is dropped, and its chunk runs
again, which writes the same rows at the same places.
"""

from __future__ import annotations

import contextvars
import os
import pickle
import struct
from collections.abc import Hashable
from typing import Any

JOURNAL = "journal"
_LENGTH = struct.Struct("<Q")


class Checkpoint:
    """One job's checkpoint folder (`folder`), and whether a run before this one left it (`resumed`)."""

    def __init__(self, folder: str, resumed: bool = False) -> None:
        self.folder = folder
        self.resumed = resumed
        self.path = os.path.join(folder, JOURNAL)

    def finished(self) -> dict[Hashable, Any]:
        """Each piece a run before this one finished, with its output (none if this run is the first)."""
        if not self.resumed:
            return {}
        try:
            with open(self.path, "rb") as file:
                data = file.read()
        except FileNotFoundError:
            return {}
        done: dict[Hashable, Any] = {}
        at = 0
        while at + _LENGTH.size <= len(data):
            (n,) = _LENGTH.unpack_from(data, at)
            if at + _LENGTH.size + n > len(data):
                break  # torn: its process died writing it
            done.update(pickle.loads(data[at + _LENGTH.size : at + _LENGTH.size + n]))
            at += _LENGTH.size + n
        if at < len(data):
            with open(self.path, "r+b") as file:  # a record appended after a torn one would be lost behind it
                file.truncate(at)
        return done

    def record(self, pieces: list[tuple[Hashable, Any]]) -> None:
        """Append pieces just finished (their outputs final: their files written)."""
        body = pickle.dumps(pieces, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except FileNotFoundError:  # its folder is gone with its job (cancelled, timed out): nothing to go on from
            return
        try:
            data = memoryview(_LENGTH.pack(len(body)) + body)
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)


# The checkpoint of the job being admitted (an executor sets it around its admission, as its gateway
# asked); the backend that queues the job hands it on (backends/local.py).
given: contextvars.ContextVar[Checkpoint | None] = contextvars.ContextVar("checkpoint", default=None)
