"""One job cut over several engine processes: its inputs in parts, a part per engine, one result.

On threads, a job's chunks are spread over every device of the process
(`Tool.spread`, backends/workers.py). Engines are processes, so the cut is
made where a job is still params: a tool whose work is `Chunked` names the list
its inputs are in (`Chunked.items`), and each idle engine of the model gets an
ordinary job over a part of that list. Each engine plans, prices, batches and
queues its part as any job; the gateway follows the parts and tells the client
one job's story:

- `queued` with the nearest part's position until one part runs, then
  `running`, with the parts' progress summed;
- their log lines as the job's;
- the first part to fail ends the job with that part's code and message, and the
  other parts are cancelled;
- once every part has succeeded, one result: the per-input fields
  (`Chunked.per_item`) put back in the order sent, the others (the same in every
  part, which is checked) once.

The parts are cut from the inputs sorted by `Chunked.weight`, contiguous runs
of nearly equal weight: each engine gets inputs of similar length (little
padding) and about the same work. An input's result does not depend on which
others share its pass beyond padding, as with batching (tests hold that to 1e-4
in float32).

A job of one long sequence run in windows (gateway/tools/windows.py) is cut by
its plan instead (`Chunked.by_windows`): part i of n computes the i-th of n
runs of consecutive windows (the `part` param, which the engine resolves
against the plan only it can make), and returns its positions' final values
(or, pooled, each window's sum); the tool's `Chunked.join` puts them one after
another, and pools, as one engine would. Every window is a pass of the same
length, so the numbers are the one-engine job's.

Deliberately not a chunk-level spread across processes: that would send every
chunk's outputs (tensors) between engines, and a part is a whole job to its
engine, with its own admission, fairness, cancellation and restart handling.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from gateway.cost import Cost
from gateway.jobs import Job
from gateway.plumbing import tracing
from gateway.protocol import Code, Status
from gateway.tools.batching import Chunked

log = logging.getLogger("streamgate.spreading")

_NULL = b"null"
_HELD = msgspec.Raw(b'"held by the job it is a part of"')


def cut(entries: Sequence[str], parts: int, weight: Callable[[str], float]) -> list[list[int]]:
    """`entries`' indices in at most `parts` non-empty runs of the weight order, of nearly equal weight."""
    order = sorted(range(len(entries)), key=lambda i: weight(entries[i]))
    weights = [max(float(weight(entries[i])), 1.0) for i in order]
    parts = max(1, min(parts, len(entries)))
    total = sum(weights)
    runs: list[list[int]] = [[] for _ in range(parts)]
    done = 0.0
    for position, (index, w) in enumerate(zip(order, weights)):
        # The run this entry's middle falls in; never past the last, and never so late that a run stays empty.
        run = min(int((done + w / 2) / total * parts), parts - 1)
        run = max(run, parts - (len(order) - position))
        run = min(run, next((k for k, r in enumerate(runs) if not r), parts - 1))
        runs[run].append(index)
        done += w
    return [run for run in runs if run]


def merge(results: Sequence[bytes], runs: Sequence[Sequence[int]], per_item: Sequence[str]) -> msgspec.Raw:
    """The parts' JSON results as one: per-input fields in the order sent, the others once (equal in every part).

    Each value is kept as the bytes the engine wrote (`msgspec.Raw`): no number is parsed or printed again.
    """
    decoded = [msgspec.json.decode(data, type=dict[str, msgspec.Raw]) for data in results]
    first = decoded[0]
    total = sum(len(run) for run in runs)
    merged: dict[str, Any] = {}
    for key in first:
        if key not in per_item:
            for other in decoded[1:]:
                if bytes(other.get(key, _NULL)) != bytes(first[key]):
                    raise ValueError(f"the parts disagree on {key!r}")
            merged[key] = first[key]
            continue
        if bytes(first[key]) == _NULL:
            merged[key] = first[key]
            continue
        entries: list[msgspec.Raw | None] = [None] * total
        for part, run in zip(decoded, runs):
            values = msgspec.json.decode(part.get(key, _NULL), type=list[msgspec.Raw])
            if len(values) != len(run):
                raise ValueError(f"a part's {key!r} has {len(values)} entries for {len(run)} inputs")
            for index, value in zip(run, values):
                entries[index] = value
        merged[key] = entries
    return msgspec.Raw(msgspec.json.encode(merged))


def split(
    params: Any, work: Chunked, count: int, context_length: int | None = None
) -> tuple[list[Any], Callable[[list[Any]], bytes | msgspec.Raw]] | None:
    """A job's params as those of at most `count` parts, and how the parts' results are put together;
    None for a job that does not split. `context_length`: its model's, for how many windows its plan
    may have."""
    entries = getattr(params, work.items, None)
    if not isinstance(entries, list) or (work.whole is not None and work.whole(params)):
        return None
    if len(entries) >= 2:
        runs = cut(entries, count, work.weight)
        parts = [msgspec.structs.replace(params, **{work.items: [entries[k] for k in run]}) for run in runs]
        return parts, functools.partial(merge, runs=runs, per_item=work.per_item)
    if work.join is not None and work.by_windows is not None:
        count = min(count, work.by_windows(params, context_length))
        if count > 1:
            return [msgspec.structs.replace(params, part=[i, count]) for i in range(count)], functools.partial(work.join, params)
    return None


class Part(Job):
    """One engine's share of a spread job: an ordinary job to its engine and link, whose events
    the spread reads as they are emitted. Its result is merged with the others': it must come
    whole, never as files (`inline_only`: an engine refuses it, and the job runs whole)."""

    inline_only = True

    def __init__(self, spread: Spread, index: int, params: Any) -> None:
        self.spread, self.index = spread, index  # before Job's own first status
        parent = spread.job
        super().__init__(parent.tool, params, f"{parent.id}.{index}", parent.owner, parent.tenant, parent.weight, priority=parent.priority, timeout=parent.timeout)
        # Its engine's spans go under it, in the job's trace.
        self.span = tracing.child(parent.span, "part", **{"streamgate.job.id": self.id, "streamgate.part": index})

    def set_status(self, status: Status, **fields: Any) -> None:
        super().set_status(status, **fields)
        self.spread.status(self, status, fields)

    def log(self, message: str, level: str = "info") -> None:
        super().log(message, level)
        self.spread.log(message, level)

    def succeed(self, result: Any) -> None:
        if not self.done:
            # Ended without its result in its own log: nobody reads a part's events, and a big result
            # would be held (and copied) once more until the job ends.
            super().succeed(_HELD)
            self.spread.job.usage.add(self.usage)  # what its engine counted, the whole job's
            self.spread.succeeded(self, result)

    def fail(self, code: Code, message: str) -> None:
        if not self.done:
            super().fail(code, message)
            self.spread.job.usage.add(self.usage)
            self.spread.failed(code, message)


def merged_cost(parts: Sequence[Job]) -> Cost | None:
    """A spread job's price from its parts' (each priced by its engine), for its admission to hold as
    any job's: results, files, journals and counted tokens add up; a part's memory and widest pass
    are on its own engine's device, so the most of them."""
    costs = [part.cost for part in parts if part.cost is not None]
    if not costs:
        return None
    widest = max(costs, key=lambda cost: cost.memory)
    return Cost(
        memory=widest.memory, result=sum(c.result for c in costs), memory_field=widest.memory_field,
        result_field=costs[0].result_field, tokens=max(c.tokens for c in costs), counted=sum(c.most_counted for c in costs),
        files=sum(c.files for c in costs), journal=sum(c.journal for c in costs),
    )


class Spread:
    """A job and its parts: what the parts say, told once as the job's."""

    def __init__(
        self, job: Job, params: list[Any], put_together: Callable[[list[Any]], bytes | msgspec.Raw], cancel: Callable[[Job], None]
    ) -> None:
        self.job, self.put_together = job, put_together
        self._cancel = cancel
        self.results: list[Any] = [None] * len(params)
        self.progress: list[tuple[int, int | None, str | None] | None] = [None] * len(params)
        self.positions: dict[int, int | None] = {}
        self.armed = False  # until every part is submitted: what they say is kept, not yet told
        self.dropped = False  # the parts were withdrawn: the job went on as a whole
        self.failure: tuple[Code, str] | None = None  # the first part's to fail
        self._held: list[tuple[str, str]] = []
        self._merging: asyncio.Task[None] | None = None
        self.parts = [Part(self, i, part) for i, part in enumerate(params)]

    # -- what the parts say ---------------------------------------------------

    def status(self, part: Part, status: Status, fields: dict[str, Any]) -> None:
        if status is Status.RUNNING and fields.get("progress") is not None:
            progress = fields["progress"]
            self.progress[part.index] = (progress.done, progress.total, progress.unit)
        elif status is Status.QUEUED:
            self.positions[part.index] = fields.get("position")
        self._tell()

    def log(self, message: str, level: str) -> None:
        self._held.append((message, level))
        self._tell()

    def succeeded(self, part: Part, result: Any) -> None:
        self.results[part.index] = result  # the JSON as the engine sent it (msgspec.Raw): not copied
        if self.progress[part.index] is None:
            self.progress[part.index] = (0, 0, None)  # a part with nothing to do (fewer windows than parts)
        self._tell()

    def failed(self, code: Code, message: str) -> None:
        if self.failure is None:
            self.failure = (code, message)
        self._tell()

    # -- told as the job's ----------------------------------------------------

    def arm(self) -> None:
        """Every part is submitted: from now on the job tells what its parts say."""
        self.armed = True
        self._tell()

    def drop(self) -> None:
        """Withdraw the parts (one was refused): the job is submitted whole instead."""
        self.dropped = True
        for part in self.parts:
            if not part.done:
                self._cancel(part)

    def cancel(self) -> None:
        for part in self.parts:
            if not part.done:
                self._cancel(part)

    def _tell(self) -> None:
        job = self.job
        if not self.armed or self.dropped or job.done:
            return
        held, self._held = self._held, []
        for message, level in held:
            job.log(message, level)
        if self.failure is not None:
            job.fail(*self.failure)
            self.cancel()
            return
        if any(part.started is not None for part in self.parts):
            if job.status is not Status.RUNNING:
                job.set_status(Status.RUNNING)
            known = [p for p in self.progress if p is not None]
            if known:
                totals = [p[1] for p in known]
                total = sum(t for t in totals if t is not None) if len(known) == len(self.parts) and None not in totals else None
                job.progress(sum(p[0] for p in known), total, next((p[2] for p in known if p[2]), None))
        else:
            waiting = [p for p in self.positions.values() if p is not None]
            if waiting and min(waiting) != job.position:
                job.set_status(Status.QUEUED, position=min(waiting))
        if all(result is not None for result in self.results) and self._merging is None:
            self._merging = asyncio.create_task(self._merge())

    async def _merge(self) -> None:
        try:
            # Off the loop: a big result's bytes are walked once more here.
            result = await asyncio.to_thread(self.put_together, self.results)
        except Exception as exc:  # whatever the parts said: the job ends, once
            log.error("job %s: its parts' results could not be put together: %s", self.job.id, exc, extra={"job_id": self.job.id})
            self.job.fail(Code.INTERNAL, f"the parts' results could not be put together: {exc}")
            return
        self.job.succeed(result if isinstance(result, msgspec.Raw) else msgspec.Raw(result))
