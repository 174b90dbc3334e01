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

With a job store that every gateway replica shares (Redis), the checkpoints
lie in a folder that outlives the process (`lasting_folder`): a job whose
gateway stopped goes on in the replica that takes it over
(gateway/server/redis_store/), from the same folder where they share a disk,
and from its start where they do not. Folders whose job has ended everywhere
are removed by the store's sweep (gateway/server/redis_store/replicas.py `_sweep`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import hashlib
import logging
import os
import pickle
import shutil
import struct
import tempfile
import time
from collections.abc import Hashable, Iterator
from typing import Any

JOURNAL = "journal"
log = logging.getLogger("streamgate.checkpoints")
_LENGTH = struct.Struct("<Q")


class Checkpoint:
    """One job's checkpoint folder (`folder`), whether a run before this one left it (`resumed`),
    and the most bytes its journal may take (`most`, the job's `--max-checkpoint-bytes`; 0: the job
    keeps none, its price being over it; None: unbounded)."""

    def __init__(self, folder: str, resumed: bool = False, most: int | None = None) -> None:
        self.folder = folder
        self.resumed = resumed
        self.path = os.path.join(folder, JOURNAL)
        self.most = most

    @property
    def keeps(self) -> bool:
        """Whether pieces are kept in it (its job's journal was priced within its bound)."""
        return self.most != 0

    def finished(self) -> dict[Hashable, Any]:
        """Each piece a run before this one finished, with its output (none if this run is the first)."""
        if not self.resumed:
            # A run from the start: a journal already there is another run's (a part of a job cut again
            # after its gateway stopped, maybe into other parts), whose pieces would be taken for this one's.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
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
        """Append pieces just finished (their outputs final: their files written); raises OSError
        where the journal would grow past `most` (what it holds stays good to go on from)."""
        body = pickle.dumps(pieces, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except FileNotFoundError:  # its folder is gone with its job (cancelled, timed out): nothing to go on from
            return
        try:
            if self.most is not None and os.fstat(fd).st_size + _LENGTH.size + len(body) > self.most:
                # Its price was under the bound: a guard against an estimate gone wrong, not a path taken.
                raise OSError(errno.EFBIG, f"the journal would pass its {self.most} bytes (--max-checkpoint-bytes)")
            data = memoryview(_LENGTH.pack(len(body)) + body)
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)


def keep(checkpoints: dict[Any, Checkpoint], job: Any, pieces: list[tuple[Hashable, Any]]) -> None:
    """Append `pieces` to `job`'s checkpoint (one of a run's, by job); on a full disk the job goes on
    without one to go on from, and leaves `checkpoints`."""
    if not pieces:
        return
    try:
        checkpoints[job].record(pieces)
    except OSError as exc:
        log.warning("a checkpoint could not be written (%s); its job goes on without", exc)
        del checkpoints[job]


# The checkpoint of the job being admitted (an executor sets it around its admission, as its gateway
# asked); the backend that queues the job hands it on (backends/local.py).
given: contextvars.ContextVar[Checkpoint | None] = contextvars.ContextVar("checkpoint", default=None)


def of(ctx: Any) -> Checkpoint | None:
    """The checkpoint a job's run keeps its finished pieces in (its context's), if it keeps one."""
    checkpoint = getattr(ctx, "checkpoint", None)
    return checkpoint if checkpoint is not None and checkpoint.keeps else None


def removed_with(job: Any, folder: str) -> None:
    """Remove `folder` (a checkpoint, on a thread) when `job` ends, unless another gateway process goes on with it."""
    job.when_ended(
        lambda job: None if job.handed_off else asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, folder, True)
    )


def resumable(tool: Any, params: Any) -> bool:
    """Whether a job of `tool` with `params` keeps a checkpoint it can go on from (`Tool.resumable`)."""
    check = getattr(tool, "resumable", None)
    return check is not None and bool(check(params))


def lasting_folder(spool: str | None, store: str) -> str | None:
    """Where jobs' checkpoints lie when another gateway process may go on with them: beside the result
    spool (`spool`, default the temporary folder), one folder per shared store; None with a store of
    this process's own (`memory`), whose jobs end with it."""
    if store == "memory":
        return None
    where = store.split("@")[-1]  # the same store whatever password reaches it
    return os.path.join(spool or tempfile.gettempdir(), f"streamgate-checkpoints-{hashlib.sha256(where.encode()).hexdigest()[:12]}")


def folders(root: str, older_than: float, most: int) -> Iterator[str]:
    """Up to `most` job ids of `root`'s checkpoint folders last changed more than `older_than` s ago (a
    folder just made may belong to a job not yet recorded in the store)."""
    until = time.time() - older_than
    found = 0
    try:
        entries = os.scandir(root)
    except OSError:
        return
    with entries:
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime < until:
                    yield entry.name
                    found += 1
            except OSError:
                continue
            if found >= most:
                return
