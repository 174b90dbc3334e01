"""Tools for the engine-process tests: a batched nap that holds its engine for as long as asked, a memory hog, and
a job whose texts are cut over a model's engines."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import time
from typing import Any, Literal

import msgspec
import torch

from gateway.cost import Cost
from gateway.tools import Cancelled, Context, Model, tool
from gateway.tools import embed as embed_tool
from gateway.tools import logprobs as logprobs_tool
import gateway.tools.sae_annotate as annotating
from gateway.tools.base import Capability
from gateway.tools.batching import Chunk, Chunked, WindowItem, in_steps, one_pass, sorted_chunks
from gateway.tools.embed import EmbedParams
from gateway.tools.logprobs import LogprobsParams
from gateway.tools.sae_annotate import AnnotateParams


class NapParams(msgspec.Struct, forbid_unknown_fields=True):
    seconds: float
    tag: str = ""


class Napped(msgspec.Struct):
    tag: str
    batch: int  # how many jobs napped together


def _nap_many(model: Model, params: list[NapParams], ctxs: list[Context]) -> list[Napped]:
    end = time.monotonic() + max(p.seconds for p in params)
    while time.monotonic() < end:
        if all(ctx.cancelled for ctx in ctxs):
            raise Cancelled()
        time.sleep(0.01)
    return [Napped(p.tag, len(params)) for p in params]


@tool(batch=one_pass(_nap_many))
def nap(model: Model, params: NapParams, ctx: Context) -> Napped:
    """Hold the engine for `seconds`, batched with the naps that came with it."""
    return _nap_many(model, [params], [ctx])[0]


class HogParams(msgspec.Struct, forbid_unknown_fields=True):
    gib: float


class Hogged(msgspec.Struct):
    bytes: int


@tool
def hog(model: Model, params: HogParams, ctx: Context) -> Hogged:
    """Allocate (and touch) `gib` GiB: a job that runs away with memory."""
    block = torch.ones(int(params.gib * (1 << 30)), dtype=torch.uint8)
    return Hogged(block.numel())


class LengthsParams(msgspec.Struct, forbid_unknown_fields=True):
    texts: list[str]
    trace: str = ""  # a file each chunk run appends a line to


class Lengths(msgspec.Struct):
    lengths: list[int]  # per text
    pids: list[int]  # per text: the process that measured it
    unit: str = "characters"  # the same in every part


def _lengths_plan(model: Model, jobs: list[LengthsParams], ctxs: Any = None) -> list[Chunk]:
    return sorted_chunks([((j, i), list(t.encode())) for j, p in enumerate(jobs) for i, t in enumerate(p.texts)], 4)


def _lengths_run(model: Model, jobs: list[LengthsParams], chunk: Chunk) -> list[int]:
    texts = [jobs[j].texts[i] for j, i in chunk.items]
    if "boom" in texts:
        raise ValueError("boom")
    time.sleep(0.5 * texts.count("slow"))
    if jobs[0].trace:
        with open(jobs[0].trace, "a") as trace:
            trace.write(f"{os.getpid()}\n")
    return [len(t) for t in texts]


def _lengths_assemble(model: Model, jobs: list[LengthsParams], out: dict[tuple[int, int], int], ctxs: Any = None) -> list[Lengths]:
    return [Lengths([out[j, i] for i in range(len(p.texts))], [os.getpid()] * len(p.texts)) for j, p in enumerate(jobs)]


_lengths = Chunked(
    plan=_lengths_plan, run=_lengths_run, assemble=_lengths_assemble, unit="texts", items="texts", per_item=("lengths", "pids")
)


def _lengths_cost(model: Model, params: LengthsParams) -> Cost:
    """Priced as a tool's: a spread job's parts' prices are the job's."""
    return Cost(memory=1024 * len(params.texts), result=64 + 24 * len(params.texts), memory_field="texts", result_field="texts")


@tool(batch=_lengths.batch, spread=_lengths, cost=_lengths_cost)
def lengths(model: Model, params: LengthsParams, ctx: Context) -> Lengths:
    """Each text's length and the process that measured it: a job cut over a model's engines."""
    return _lengths.many(model, [params], [ctx])[0]


class Dying(msgspec.Struct, kw_only=True):
    """A dying tool's params beside its own: when its engine is to die, before the first chunk that
    holds window `die_at` of a text, if the file `marker` does not exist yet (it is made then: one
    death). `kill: gateway`: the engine's gateway is sent `signal` instead (SIGKILL: the engine dies
    with it; SIGTERM: it drains and stops, and stops its engines, while this chunk waits). `kill:
    none`: nothing dies, the chunk waits (up to 30 s) for the file `release` (a gateway with threads,
    stopped meanwhile)."""

    die_at: int = 0
    marker: str = ""
    kill: Literal["engine", "gateway", "none"] = "engine"
    signal: Literal["SIGKILL", "SIGTERM"] = "SIGKILL"
    release: str = ""


def _dying_params(base: type) -> Any:
    """`base`'s params with `Dying`'s after them."""
    fields = [(f.name, f.type, f.default) for f in msgspec.structs.fields(Dying)]
    return msgspec.defstruct(f"Dying{base.__name__}", fields, bases=(base,), kw_only=True, forbid_unknown_fields=True)


DyingEmbedParams = _dying_params(EmbedParams)
DyingLogprobsParams = _dying_params(LogprobsParams)
DyingAnnotateParams = _dying_params(AnnotateParams)


def _run_or_die(work: Chunked, model: Model, jobs: list[Any], chunk: Chunk) -> list[Any]:
    for job, item in chunk.items:
        params = jobs[job]
        if isinstance(item, WindowItem) and item.window >= params.die_at and params.marker and not os.path.exists(params.marker):
            open(params.marker, "x").close()
            if params.kill == "none":
                until = time.monotonic() + 30
                while not os.path.exists(params.release) and time.monotonic() < until:
                    time.sleep(0.05)
                return work.run(model, jobs, chunk)
            # The engine, mid-job, as the out-of-memory killer would; or its gateway, whose engines die with it.
            os.kill(os.getppid() if params.kill == "gateway" else os.getpid(), getattr(signal, params.signal))
            if params.kill == "gateway":  # the chunk never ends here: the engine dies with its gateway, or is stopped
                time.sleep(60)
    return work.run(model, jobs, chunk)


def _dying(work: Chunked) -> Chunked:
    """`work` whose run dies as its job's params say, on one engine (never cut over several)."""
    return dataclasses.replace(work, run=functools.partial(_run_or_die, work), items="", per_item=())


_dying_embed = _dying(embed_tool.work)
_dying_logprobs = _dying(logprobs_tool.work)


@tool(check=embed_tool.check, cost=embed_tool.cost, sequences=("texts",), batch=_dying_embed.batch, spread=_dying_embed)
def embed_dying(model: Model, params: DyingEmbedParams, ctx: Context) -> embed_tool.EmbedResult:
    """`embed`, whose engine is killed once mid-job: its job goes on from its checkpoint in the next one."""
    return _dying_embed.many(model, [params], [ctx])[0]


@tool(
    check=logprobs_tool.check, cost=logprobs_tool.cost, sequences=("prompts",), batch=_dying_logprobs.batch, spread=_dying_logprobs,
    needs={Capability.NEXT_TOKEN},
)
def logprobs_dying(model: Model, params: DyingLogprobsParams, ctx: Context) -> logprobs_tool.LogprobsResult:
    """`logprobs`, whose engine is killed once mid-job: its job goes on from its last finished pass in the next one."""
    return _dying_logprobs.many(model, [params], [ctx])[0]


def _annotate_or_die(model: Model, jobs: list[Any], ctxs: list[Context]) -> Any:
    """`sae_annotate`'s passes; its engine killed once its first job has run `die_at` of them (each kept
    in its checkpoint as it ended)."""
    steps = annotating._annotate_steps(model, jobs, ctxs)
    passes = 0
    while True:
        try:
            next(steps)
        except StopIteration as finished:
            return finished.value
        passes += 1
        params = jobs[0]
        if passes >= params.die_at and params.marker and not os.path.exists(params.marker):
            open(params.marker, "x").close()
            os.kill(os.getpid(), signal.SIGKILL)
        yield


@tool(
    check=annotating._check_annotate, cost=annotating._cost_annotate, sequences=("sequences",), batch=in_steps(_annotate_or_die),
    resumable=annotating._resumable, needs={Capability.LAYERS, Capability.SAE},
)
def sae_annotate_dying(model: Model, params: DyingAnnotateParams, ctx: Context) -> annotating.AnnotateResult:
    """`sae_annotate`, whose engine is killed once after `die_at` passes: its job goes on from its checkpoint in the next one."""
    return annotating.run_through(_annotate_or_die(model, [params], [ctx]))[0]
