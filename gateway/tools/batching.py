"""Running several jobs of one tool together: the `Batch` a tool may offer.

A tool that batches sets `Tool.batch`, a factory `batch(model) -> Batch`. The
worker adds the queued jobs it gathered (same tool, equal `Tool.batch_key`),
then calls `step()` until the batch is empty. Each step returns the members
that ended in it, each with its result or the exception that ends that job
alone. A member whose job was cancelled leaves at the next step. A batch that
is `continuous` (`generate`'s) also takes new members between steps, so a job
that finishes early frees its place for a waiting one at once. One that is also
`Preemptible` lets a member leave between two steps for a job of a higher class,
and take it back later where it stopped (backends/workers.py decides when).

A batching tool's single-job `run` is `run_alone` over the same batch: a batch
of one and a batch of 32 run the same code, and their results differ only by
what padding can change (tests hold that to 1e-4 in float32).

A one-pass tool whose work falls into independent chunks (`embed`'s texts,
`pseudo_loglikelihood`'s masked copies) describes it as `Chunked`: a plan of
chunks, sorted by length so that padding is small, the work of one chunk, and
the assembly of the results in the caller's order. On one device the chunks
run in turn, one a step (`InSteps`: another tool's job may run between two); with several (`--devices`), the worker spreads one job's chunks
over every device at once (`Tool.spread`, backends/workers.py). Either way
each chunk is the same padded pass, so the results are the same.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Collection, Generator, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from gateway import checkpoints
from gateway.tools.base import Cancelled, Context

if TYPE_CHECKING:
    from gateway.tools.base import Model


class Batch(Protocol):
    """Jobs of one tool running together on one model."""

    @property
    def continuous(self) -> bool:
        """True while the batch takes new members between steps."""

    def add(self, params: Any, ctx: Context) -> None:
        """Take a job in; raise if its own input is at fault (that job alone fails)."""

    def step(self) -> list[tuple[Context, Any]]:
        """Run one step; return the members that ended, each with a result or an exception."""

    def __len__(self) -> int:
        """Members not ended yet."""


@runtime_checkable
class Preemptible(Protocol):
    """A continuous batch whose members may leave between two steps and come back later, their
    output the same as if they had never left (`generate`'s: a member keeps its tokens and its
    sampler, and takes its context up again from its prompt and those tokens)."""

    def preempt(self, ctxs: Collection[Context]) -> list[tuple[Context, Any]]:
        """Take these members out (those still in the batch); each with what it keeps for `resume`."""

    def resume(self, kept: Any, ctx: Context) -> None:
        """Take back a member `preempt` took out, as `ctx` now (its job's run on this worker)."""


@dataclass(frozen=True)
class Resumed:
    """A preempted job's place in a batch: what the batch kept of it (`Preemptible.resume`), not its params."""

    kept: Any


BatchFactory = Callable[["Model"], Batch]
BatchKey = Callable[[Any], Hashable]
ManyFn = Callable[["Model", list[Any], list[Context]], list[Any]]


def run_alone(batch: Batch, params: Any, ctx: Context) -> Any:
    """Run one job as a batch of one: its result, or raise what ended it."""
    batch.add(params, ctx)
    while True:
        for _, outcome in batch.step():
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome


def raise_if_all_cancelled(ctxs: Sequence[Context]) -> None:
    """Stop work that no member wants any more; a member cancelled alone leaves after it."""
    if all(ctx.cancelled for ctx in ctxs):
        raise Cancelled()


class OnePass:
    """A batch run in one step by `many(model, params_list, ctxs) -> results`.

    For tools whose work is a padded forward pass over every member's inputs
    (`predict`, `loglikelihood`, `embed`). If the batch as a whole fails, each
    member runs again alone, so that an error reaches only the job at fault.
    """

    continuous = False

    def __init__(self, model: Model, many: ManyFn) -> None:
        self.model = model
        self.many = many
        self.members: list[tuple[Any, Context]] = []

    def __len__(self) -> int:
        return len(self.members)

    def add(self, params: Any, ctx: Context) -> None:
        self.members.append((params, ctx))

    def step(self) -> list[tuple[Context, Any]]:
        members, self.members = self.members, []
        ended: list[tuple[Context, Any]] = [(ctx, Cancelled()) for _, ctx in members if ctx.cancelled]
        live = [(params, ctx) for params, ctx in members if not ctx.cancelled]
        if not live:
            return ended
        try:
            results = self.many(self.model, [p for p, _ in live], [c for _, c in live])
        except Exception as exc:
            if len(live) == 1 or isinstance(exc, Cancelled):  # stopped: every member was cancelled
                return [*ended, *((ctx, exc) for _, ctx in live)]
            results = [self._alone(params, ctx) for params, ctx in live]
        for (_, ctx), result in zip(live, results):
            ended.append((ctx, Cancelled() if ctx.cancelled else result))
        return ended

    def _alone(self, params: Any, ctx: Context) -> Any:
        try:
            return self.many(self.model, [params], [ctx])[0]
        except Exception as exc:
            return exc


def one_pass(many: ManyFn) -> BatchFactory:
    """The batch factory for a tool whose jobs run together as `many(model, params_list, ctxs)`."""
    return functools.partial(OnePass, many=many)


@dataclass
class Chunk:
    """Items of some jobs that run as one padded pass: `items` are (job, item) pairs; `data` what the pass needs."""

    items: list[tuple[int, int]]
    data: Any = None
    # The padded width, for sorting: chunks of similar length waste the least on padding.
    width: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Chunked:
    """A one-pass tool's work as independent chunks.

    `plan(model, jobs, ctxs)` lists the chunks covering every job's items (a job that
    writes result files opens them through its ctx);
    `run(model, jobs, chunk)` computes one (its outputs moved off the device,
    since another device's worker may assemble them); `assemble(model, jobs,
    outputs, ctxs)` builds each job's result from `{(job, item): output}`. `unit`
    names the items in progress frames.

    Across engine processes (backends/spreading.py) a job is cut by its input
    list instead: `items` names the params field whose entries are independent
    (`texts`), `per_item` the result fields with one entry per input (the others
    are the same in every part), and `weight(entry)` is an entry's share of the
    work, by which the parts are balanced.
    """

    plan: Callable[[Model, list[Any], Sequence[Context]], list[Chunk]]
    run: Callable[[Model, list[Any], Chunk], list[Any]]
    assemble: Callable[[Model, list[Any], dict[tuple[int, int], Any], Sequence[Context]], list[Any]]
    unit: str
    items: str = ""
    per_item: tuple[str, ...] = ()
    weight: Callable[[str], float] = len
    # Whether a job's finished chunks may be kept in its checkpoint (gateway/checkpoints.py) and
    # skipped when it runs again after its engine died: its outputs pickle, and a chunk run twice
    # gives what it gave once. None: never.
    resumable: Callable[[Any], bool] | None = None
    # `partial(model, params, done, carry)`: the `partial` events a job's items carry once done, `done`
    # its (item, output) pairs of a chunk (or of a run before this one), in its plan's order; sent in
    # that order, once each (a run that goes on from a checkpoint sends its finished items' again
    # first, for its gateway to skip, by count: so an event's items must not depend on how the items
    # fell into chunks, which other jobs share). `carry`, a list of the job's own, keeps items done
    # for the events of later calls. `each_item` makes one from a function of one item.
    partial: Callable[[Model, Any, list[tuple[Any, Any]], list[Any]], list[Any]] | None = None
    # A job that may not be cut over engines (one whose partial events name its inputs by index).
    whole: Callable[[Any], bool] | None = None
    # A job of one input, cut over engines by its window plan instead (gateway/tools/windows.py,
    # the `part` param): `by_windows(params, context_length)`, the most parts it may be cut into
    # (its plan's windows at most; below 2, not cut); `join(params, results)`, the whole's JSON
    # result from its parts', in order.
    by_windows: Callable[[Any, int | None], int] | None = None
    join: Callable[[Any, list[bytes]], bytes] | None = None

    def batch(self, model: Model) -> InSteps:
        """The tool's `batch`: its jobs' chunks, one a step (`InSteps`)."""
        return InSteps(model, functools.partial(chunk_steps, self))

    def many(self, model: Model, jobs: list[Any], ctxs: list[Context]) -> list[Any]:
        """Every chunk in turn on this device, in one call (a job run alone, or again after a failure)."""
        return run_through(chunk_steps(self, model, jobs, ctxs))


def each_item(partial: Callable[[Model, Any, Any, Any], Any]) -> Callable[[Model, Any, list[tuple[Any, Any]]], list[Any]]:
    """A `Chunked.partial` from `partial(model, params, item, output)`: an event an item, or None."""

    def partials(model: Model, params: Any, done: list[tuple[Any, Any]], carry: list[Any]) -> list[Any]:
        return [obj for item, output in done if (obj := partial(model, params, item, output)) is not None]

    return partials


def partial_once(ctx: Context, sent: int, obj: Any) -> None:
    """Send `obj` as the `sent`-th partial event (from 1) of this run of `ctx`'s job, unless a run of the
    same job in this process sent it already (its batch failed, and it runs again alone, sending its
    events again in the same order)."""
    if sent > _PARTIALS_SENT.get(ctx, 0):
        _PARTIALS_SENT[ctx] = sent
        ctx.partial(obj)


_NOT_THERE = object()
# Per job's context, the partial events its runs in this process have sent: a job run again alone
# after its batch failed sends its windows' again, in the same order, and the first ones are dropped.
_PARTIALS_SENT: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
SINKS = "sinks"  # a Chunk's extra: {job: what its outputs are written into (its result files)}, each of its items' output
_IN_SINK = "in sink"  # what a checkpoint keeps for an output that is its job's sink: its rows are in the job's files


class ChunkRun:
    """A `Chunked` tool's jobs' plan, as it runs: the chunks left (`chunks`), the outputs so far
    (`outputs`), their progress, and their checkpoints. A job with a checkpoint that a run
    before this one left (its engine died) has its finished items' outputs back, and those
    items leave the plan; each chunk done is kept in its jobs' checkpoints before its progress
    is told."""

    def __init__(self, work: Chunked, model: Model, jobs: list[Any], ctxs: Sequence[Context]) -> None:
        self.work, self.model, self.jobs, self.ctxs = work, model, jobs, ctxs
        self.sent = [0] * len(jobs)  # each job's partial events so far, in this run's order
        self.carry: list[list[Any]] = [[] for _ in jobs]  # each job's items done, for its partial events to come
        self.lock = threading.Lock()  # its chunks `done` one at a time where several devices share them
        chunks = work.plan(model, jobs, ctxs)
        self.progress = ChunkProgress(chunks, ctxs, work.unit)
        self.outputs: dict[tuple[int, int], Any] = {}
        self.checkpoints = {
            job: checkpoint
            for job, ctx in enumerate(ctxs)
            if (checkpoint := checkpoints.of(ctx)) is not None and work.resumable is not None and work.resumable(jobs[job])
        }
        self.chunks = self._resumed(chunks) if self.checkpoints else chunks

    def _resumed(self, chunks: list[Chunk]) -> list[Chunk]:
        finished = {job: checkpoint.finished() for job, checkpoint in self.checkpoints.items()}
        if not any(finished.values()):
            return chunks
        again: list[tuple[int, Any]] = []  # finished, but run again: counted done already
        writing = {job for chunk in chunks for job in chunk.extra.get(SINKS, {})}
        for job in finished.keys() & writing:
            # Its last item runs again: a run that writes files opens them with its first rows.
            last = next((key for chunk in reversed(chunks) for key in reversed(chunk.items) if key[0] == job), None)
            if last is not None and finished[job].pop(last[1], _NOT_THERE) is not _NOT_THERE:
                again.append(last)
        left: list[Chunk] = []
        restored: list[list[tuple[int, int]]] = []  # by chunk: their partial events as the chunks sent them
        for chunk in chunks:
            keep = [at for at, (job, item) in enumerate(chunk.items) if item not in finished.get(job, ())]
            if len(keep) == len(chunk.items) or not isinstance(chunk.data, list):
                left.append(chunk)
                continue
            sinks = chunk.extra.get(SINKS, {})
            restored.append([])
            for at, key in enumerate(chunk.items):
                if at not in keep:
                    output = finished[key[0]][key[1]]
                    self.outputs[key] = sinks[key[0]] if isinstance(output, str) and output == _IN_SINK else output
                    restored[-1].append(key)
            if keep:
                data = [chunk.data[at] for at in keep]
                left.append(Chunk([chunk.items[at] for at in keep], data, max(len(row) for row in data), chunk.extra))
        self.progress.count([*(key for keys in restored for key in keys), *again])
        for keys in restored:
            self._partials(keys)
        return left

    def _partials(self, keys: Sequence[tuple[int, Any]]) -> None:
        """The items' partial events, each job's in its plan's order (`partial_once`)."""
        if self.work.partial is None:
            return
        for job in dict.fromkeys(job for job, _ in keys):
            done = [(item, self.outputs[job, item]) for j, item in keys if j == job]
            for obj in self.work.partial(self.model, self.jobs[job], done, self.carry[job]):
                self.sent[job] += 1
                partial_once(self.ctxs[job], self.sent[job], obj)

    def done(self, chunk: Chunk, outputs: list[Any]) -> None:
        """`chunk` ran: its outputs kept, in its jobs' checkpoints too, and its progress told."""
        self.outputs.update(zip(chunk.items, outputs))
        if isinstance(chunk.data, list):  # rows of token ids: what each job's passes read (windows overlap)
            from gateway.tools.windows import WindowIds  # windows.py builds on this module

            for (job, _), row in zip(chunk.items, chunk.data):
                if isinstance(row, list | WindowIds):  # a window's row: its ids made as its pass runs
                    self.ctxs[job].count(tokens_in=len(row))
        sinks = chunk.extra.get(SINKS, {})
        for job in list(self.checkpoints):
            if self.ctxs[job].cancelled:  # ended: nothing of it will go on, and its folder may be gone
                continue
            sink = sinks.get(job)
            pieces = [(item, _IN_SINK if sink is not None and out is sink else out) for (j, item), out in zip(chunk.items, outputs) if j == job]
            checkpoints.keep(self.checkpoints, job, pieces)
        self.progress.advance(chunk)
        self._partials(chunk.items)


StepsFn = Callable[["Model", list[Any], list[Context]], Generator[None, None, list[Any]]]


class InSteps:
    """A batch whose work is a generator, `steps(model, params_list, ctxs)`, that yields between its
    pieces (a pass, a chunk) and returns every member's result: a piece a step.

    Run as one step, a big job's pieces would keep the worker for all of them; a
    piece a step lets the worker run a waiting job of another tool (another
    owner's `predict`) between two pieces, and stop the work at the next one
    when every member is cancelled. The batch takes no member once started.
    As with `OnePass`, if a piece fails, each member runs again alone, so that
    an error reaches only the job at fault.
    """

    continuous = False

    def __init__(self, model: Model, steps: StepsFn) -> None:
        self.model, self.steps = model, steps
        self.members: list[tuple[Any, Context]] = []
        self._running: Generator[None, None, list[Any]] | None = None

    def __len__(self) -> int:
        return len(self.members)

    def add(self, params: Any, ctx: Context) -> None:
        assert self._running is None, "a batch in steps takes no member once started"
        self.members.append((params, ctx))

    def step(self) -> list[tuple[Context, Any]]:
        jobs, ctxs = [p for p, _ in self.members], [c for _, c in self.members]
        if all(ctx.cancelled for ctx in ctxs):
            return self._end([Cancelled()] * len(ctxs))
        try:
            if self._running is None:
                self._running = self.steps(self.model, jobs, ctxs)
            next(self._running)
            return []
        except StopIteration as finished:
            results: list[Any] = finished.value
        except Exception as exc:
            if len(jobs) == 1 or isinstance(exc, Cancelled):
                return self._end([exc] * len(jobs))
            results = [self._alone(params, ctx) for params, ctx in self.members]
        return self._end([Cancelled() if ctx.cancelled and not isinstance(r, BaseException) else r for ctx, r in zip(ctxs, results)])

    def _end(self, outcomes: list[Any]) -> list[tuple[Context, Any]]:
        ended = [(ctx, outcome) for (_, ctx), outcome in zip(self.members, outcomes)]
        if self._running is not None:
            self._running.close()  # unfinished (every member cancelled): what it holds open is closed now
        self.members, self._running = [], None
        return ended

    def _alone(self, params: Any, ctx: Context) -> Any:
        try:
            return run_through(self.steps(self.model, [params], [ctx]))[0]
        except Exception as exc:
            return exc


def run_through(steps: Generator[None, None, list[Any]]) -> list[Any]:
    """Every piece of `steps` in one call: their results."""
    while True:
        try:
            next(steps)
        except StopIteration as finished:
            return finished.value


def in_steps(steps: StepsFn) -> BatchFactory:
    """The batch factory for a tool whose jobs run together a piece a step (`InSteps`)."""
    return functools.partial(InSteps, steps=steps)


def chunk_steps(work: Chunked, model: Model, jobs: list[Any], ctxs: Sequence[Context]) -> Generator[None, None, list[Any]]:
    """A `Chunked` tool's jobs, a chunk a piece: its last chunk and the assembly in one."""
    run = ChunkRun(work, model, jobs, ctxs)
    for i, chunk in enumerate(run.chunks):
        raise_if_all_cancelled(ctxs)
        run.done(chunk, work.run(model, jobs, chunk))
        if i < len(run.chunks) - 1:
            yield
    return work.assemble(model, jobs, run.outputs, ctxs)


class WindowItem(NamedTuple):
    """An item that is one window of a long input (gateway/tools/windows.py): its job's progress counts windows."""

    item: int
    window: int


class ChunkProgress:
    """Each job's items done, reported as chunks finish (in any order); windows where a job's items are `WindowItem`s."""

    def __init__(self, chunks: list[Chunk], ctxs: Sequence[Context], unit: str) -> None:
        self.ctxs = ctxs
        self.units = [unit] * len(ctxs)
        self.total = [0] * len(ctxs)
        self.done = [0] * len(ctxs)
        self.counted: set[tuple[int, Any]] = set()
        for chunk in chunks:
            for job, item in chunk.items:
                self.total[job] += 1
                if isinstance(item, WindowItem):
                    self.units[job] = "windows"

    def advance(self, chunk: Chunk) -> None:
        self.count(chunk.items)

    def count(self, items: Sequence[tuple[int, Any]]) -> None:
        """These items are done (a chunk ran, or a run before this one finished them); each counts once."""
        fresh = [key for key in items if key not in self.counted]
        self.counted.update(fresh)
        for job, _ in fresh:
            self.done[job] += 1
        for job in sorted({job for job, _ in items}):
            self.ctxs[job].progress(self.done[job], self.total[job], self.units[job])


def sorted_chunks(
    items: list[tuple[tuple[int, int], list[int]]], size: int, max_tokens: int | None = None, by_length: bool = True
) -> list[Chunk]:
    """Rows of token ids grouped into chunks of at most `size` rows (and `max_tokens` padded tokens), longest first.

    Sorting by length keeps rows of similar length together, so a chunk pads
    little; longest first puts the biggest chunks at the start, so that
    devices sharing the chunks finish together. (`by_length=False` keeps the
    caller's order, for benchmarks to measure what sorting saves.)
    """
    order = sorted(items, key=lambda item: -len(item[1])) if by_length else items
    chunks: list[Chunk] = []
    current: list[tuple[tuple[int, int], list[int]]] = []
    for item in order:
        width = max(len(item[1]), len(current[0][1]) if current else 0)
        if current and (len(current) >= size or (max_tokens and width * (len(current) + 1) > max_tokens)):
            chunks.append(_chunk(current))
            current = []
        current.append(item)
    if current:
        chunks.append(_chunk(current))
    return chunks


def chunk_peak(lengths: Sequence[int], size: int, max_tokens: int | None, pass_bytes: Callable[[int, int], int]) -> int:
    """The most `pass_bytes(rows, width)` of the chunks `sorted_chunks` cuts rows of these lengths into:
    what a `Chunked` tool's largest pass holds (gateway/cost.py)."""
    chunks = sorted_chunks([((0, i), range(n)) for i, n in enumerate(lengths)], size, max_tokens)  # type: ignore[misc]
    return max((pass_bytes(len(chunk.items), chunk.width) for chunk in chunks), default=0)


def _chunk(rows: list[tuple[tuple[int, int], list[int]]]) -> Chunk:
    return Chunk(items=[key for key, _ in rows], data=[ids for _, ids in rows], width=max(len(ids) for _, ids in rows))
