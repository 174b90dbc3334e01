"""A job's events received from another process (an executor, a Ray replica), re-emitted on the gateway's `Job`."""

from __future__ import annotations

import msgspec

from gateway.jobs import Job
from gateway.protocol import Code, ErrorFrame, LogFrame, RemoteFrame, RemoteKind, Status, StatusFrame

# Error codes that keep their meaning at the gateway; any other, a tool that raised
# included, becomes `remote_error` with the message it came with.
PASSED_THROUGH = {Code.CANCELLED, Code.TIMEOUT, Code.BACKEND_UNAVAILABLE}


def relay(job: Job, frame: RemoteFrame) -> None:
    """Re-emit a status, log or partial frame on `job` (its `seq` is the gateway's own)."""
    data = frame.data
    if frame.kind is RemoteKind.STATUS:
        status = msgspec.json.decode(data, type=StatusFrame)
        if status.progress is not None:
            # Relayed as sent, not through `job.progress`: the sender already coalesced
            # them, and coalescing again would drop the ones a resume replays at once.
            job.set_status(Status.RUNNING, progress=status.progress)
        elif status.status is Status.QUEUED:
            job.set_status(Status.QUEUED, position=status.position, queue_size=status.queue_size, eta_s=status.eta_s, message=status.message)
        elif status.status is Status.RUNNING:
            job.set_status(Status.RUNNING, message=status.message)
    elif frame.kind is RemoteKind.LOG:
        entry = msgspec.json.decode(data, type=LogFrame)
        job.log(entry.message, entry.level)
    elif frame.kind is RemoteKind.PARTIAL:
        job.partial(data)


def failure(frame: RemoteFrame, every_code: bool = False) -> tuple[Code, str]:
    """An `error` frame's code (as the gateway passes it on: all of them with `every_code`) and message."""
    error = msgspec.json.decode(frame.data, type=ErrorFrame).error
    return (error.code if every_code or error.code in PASSED_THROUGH else Code.REMOTE_ERROR), error.message
