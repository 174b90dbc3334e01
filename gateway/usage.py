"""What a job used: tokens in and out, device-seconds, result bytes.

Counted where its work runs: a worker (backends/workers.py) times each step on the device and
shares it between the step's members, and counts each result's bytes; a tool counts its own tokens
through its context (`Context.count`: `generate`'s prompt and completion tokens, a chunked tool's
rows), and a job whose tool counts none is taken to have read the tokens it was priced for
(gateway/cost.py `Cost.tokens`). An engine, an executor or a Ray replica sends the count back with
the job's terminal event (gateway/protocol.py `RemoteFrame.usage`); the gateway's meter
(gateway/server/metering.py) adds it up by tenant, class and model, and checks quotas with it.
"""

from __future__ import annotations

import msgspec


class JobUsage(msgspec.Struct, omit_defaults=True):
    """One job's use, or a sum of jobs' (`jobs` of them)."""

    jobs: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    device_s: float = 0.0
    result_bytes: int = 0

    @property
    def tokens(self) -> int:
        return self.tokens_in + self.tokens_out

    def add(self, other: JobUsage) -> None:
        self.jobs += other.jobs
        self.tokens_in += other.tokens_in
        self.tokens_out += other.tokens_out
        self.device_s += other.device_s
        self.result_bytes += other.result_bytes

    def __bool__(self) -> bool:
        return bool(self.jobs or self.tokens_in or self.tokens_out or self.device_s or self.result_bytes)
