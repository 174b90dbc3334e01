"""`sae_annotate`: a prompt's tokens, or long sequences in windows, annotated with a served SAE's
features (gateway/tools/sae_tools.py says how an SAE is found and its ids checked).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Generator, Iterator
from typing import Annotated, Any, Literal

import msgspec
import torch

from gateway import checkpoints
from gateway.cost import JOURNAL_PIECE, JSON_ENTRY, JSON_FLOAT, JSON_FRAME, JSON_TOKEN, Cost, Shape
from gateway.errors import ParamError
from gateway.models.anatomy import anatomy
from gateway.models.sae import SAE
from gateway.protocol import ResultFile
from gateway.tools.base import Capability, Context, Model, right_padded, tool
from gateway.tools.files import MAX_FILES, TrackFiles
from gateway.tools.batching import in_steps, partial_once, raise_if_all_cancelled, run_through
from gateway.tools import windows
from gateway.tools.numbers import floats
from gateway.tools.windows import Framed, Share, WindowParams, WindowPlan
from gateway.tools.sae_stream import ENCODE_FLOATS, AnnotatePartial, SequenceAnnotation, StreamedSequence, annotate_own, annotate_sequence
from gateway.tools.sae_tools import FeatureId, SaeName, check_feature_ids, resolve_sae


class AnnotateParams(WindowParams, forbid_unknown_fields=True):
    prompt: Annotated[str, msgspec.Meta(description="One text: each token's features (`tokens` in the result).")] | None = None
    sae: SaeName | None = None
    mode: Annotated[
        Literal["top", "pick"],
        msgspec.Meta(
            description="top: per token of a prompt, its k most active features; per sequence, the k features "
            "most active anywhere in it. pick: the features of feature_ids."
        ),
    ] = "top"
    k: Annotated[int, msgspec.Meta(ge=1, le=100)] = 5
    feature_ids: Annotated[list[FeatureId], msgspec.Meta(min_length=1, max_length=256)] | None = None
    sequences: Annotated[
        list[str],
        msgspec.Meta(
            min_length=1,
            description="Many sequences instead of a prompt: per sequence, each feature's activation at every "
            "position (`tracks`) and a summary (`sequences` in the result). Batched with other jobs'.",
        ),
    ] | None = None
    threshold: Annotated[
        float, msgspec.Meta(description="Per sequence: a feature's positions with an activation above this are listed.")
    ] = 0.0
    file: Annotated[
        Literal["bigwig"],
        msgspec.Meta(
            description="With sequences: the tracks as files, fetched from GET /jobs/{id}/files/{name}: a bigWig per "
            "feature (f<id>.bw) and relative_error.bw, each sequence a chromosome of it (named by names, its "
            "positions its own tokens), and features.bed, the stretches where a feature is above threshold (name "
            "f<id>, score 0-1000 of its largest value in the sequence). Genome browsers (IGV, JBrowse) open them. "
            "Default: none, or bigwig when the tracks as JSON would be over the gateway's --max-result-bytes."
        ),
    ] | None = None
    names: Annotated[
        list[Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:|-]{1,128}$")]],
        msgspec.Meta(description="Each sequence's name (a chromosome's) in the files, when the tracks are written as files. Default: seq1, seq2, ..."),
    ] | None = None
    partials: Annotated[
        bool,
        msgspec.Meta(
            description="With sequences and window: send the chosen features' values as partial events as soon as a "
            "stretch of positions is final ({sequence, start, end, features, values}: positions start..end-1 of the "
            "sequence's own tokens, a row of values per feature), in order within each sequence; with mode top, once "
            "the first run over the windows has chosen the features. The result still holds them all."
        ),
    ] = False


class Activation(msgspec.Struct):
    id: int
    label: str | None
    value: float


class TokenAnnotation(msgspec.Struct):
    token: str
    token_id: int
    features: list[Activation]
    error: float  # |x - decode(encode(x))|
    relative_error: float  # error / |x|


class AnnotateResult(msgspec.Struct, omit_defaults=True):
    sae: str
    layer: int
    tokens: list[TokenAnnotation] | None = None
    sequences: list[SequenceAnnotation] | None = None
    files: list[ResultFile] | None = None
    """With file: the bigWig tracks and the BED of where features fire."""


def _check_annotate(model: Model, params: AnnotateParams) -> None:
    sae = resolve_sae(model, params.sae)
    if (params.prompt is None) == (params.sequences is None):
        raise ParamError("prompt", "give prompt (one text, token by token) or sequences (many, as tracks), one of the two")
    if params.mode == "pick":
        if params.feature_ids is None:
            raise ParamError("feature_ids", "required when mode is pick")
        check_feature_ids(sae, params.feature_ids, "feature_ids")
    elif params.feature_ids is not None:
        raise ParamError("feature_ids", "only with mode pick")
    if params.prompt is not None:
        with windows.naming_window():
            model.fit(len(model.encode(params.prompt, "prompt")), "prompt")
    windows.resolve(params, model.context_length)  # window-only params without a window
    _check_files(sae, params)
    if params.window is not None and params.sequences is None:
        raise ParamError("window", "with sequences: a prompt's tokens are annotated one by one, within the context")
    if params.partials and params.window is None:
        raise ParamError("partials", "a partial event is a stretch of a sequence's windows: only with sequences and window")
    if params.partials and params.file is not None:
        raise ParamError("partials", "not with file: the tracks go into the files")
    for i, sequence in enumerate(params.sequences or []):
        if params.window is not None:
            _windowed(model, params, i)
            continue
        with windows.naming_window():
            model.fit(len(model.encode(sequence, f"sequences[{i}]")), f"sequences[{i}]")


def _check_files(sae: SAE, params: AnnotateParams) -> None:
    if params.names is not None and params.sequences is None:
        raise ParamError("names", "with sequences: the names of the files' chromosomes")
    if params.names is not None and len(params.names) != len(params.sequences or []):
        raise ParamError("names", f"one per sequence: {len(params.sequences or [])} sequences, {len(params.names)} names")
    if params.names is not None and len(set(params.names)) != len(params.names):
        raise ParamError("names", "each name once: they are the files' chromosomes")
    if params.file is None:
        return
    if params.sequences is None:
        raise ParamError("file", "with sequences: a prompt's annotation is token by token, within the context")
    tracks = len(params.feature_ids or []) if params.mode == "pick" else min(params.k, sae.n_features) * len(params.sequences)
    if tracks + 2 > MAX_FILES:
        raise ParamError(
            "file" if params.mode == "pick" else "k",
            f"{tracks} feature tracks, a bigWig each: at most {MAX_FILES - 2} (fewer features, or fewer sequences a job)",
        )


def _windowed(model: Model, params: AnnotateParams, i: int) -> tuple[Framed, WindowPlan, list[Share]]:
    """A windowed sequence's tokens, its plan and each window's share of the stitched stream."""
    assert params.sequences is not None
    framed, sizes, cut = windows.cut(model, params, params.sequences[i], f"sequences[{i}]")
    plan = WindowPlan(windows=cut, stitch=sizes.stitch, window=sizes.window, overlap=sizes.overlap)
    return framed, plan, windows.shares(cut, sizes.stitch)


def _residuals(model: Model, layer: int, rows: list[list[int]]) -> list[torch.Tensor]:
    """Each row's residual stream at `layer` (tokens × d_model, float32), from one right-padded pass
    that stops there: the blocks after it and the head are not run."""
    with anatomy(model).capture([layer], stop=True) as captured:
        input_ids, mask = right_padded(model, rows)
        model.logits(input_ids, mask)
    return [captured[layer][i, : len(ids)].float() for i, ids in enumerate(rows)]


def _annotate_prompt(model: Model, sae: SAE, params: AnnotateParams, x: torch.Tensor, ids: list[int]) -> list[TokenAnnotation]:
    f = sae.encode(x)
    error = (x - sae.decode(f)).norm(dim=-1)
    relative = error / x.norm(dim=-1).clamp(min=1e-12)
    if params.mode == "pick":
        assert params.feature_ids is not None
        chosen = torch.tensor(params.feature_ids, device=f.device)
        picked = [params.feature_ids] * len(ids)
        values = floats(f[:, chosen])
    else:
        top = torch.topk(f, min(params.k, sae.n_features), dim=-1)
        picked, values = top.indices.tolist(), floats(top.values)
    labels = sae.spec.labels
    errors, relatives = floats(torch.stack([error, relative]))
    texts = model.token_texts(ids)
    tokens = []
    for pos, token_id in enumerate(ids):
        acts = [
            Activation(fid, labels.get(fid), value)
            for fid, value in zip(picked[pos], values[pos])
            if params.mode == "pick" or value > 0  # `top` lists active features only
        ]
        tokens.append(TokenAnnotation(texts[token_id], token_id, acts, errors[pos], relatives[pos]))
    return tokens


# Tokens in one forward pass of `sae_annotate`: thousands of long sequences go through in passes of this size.
PASS_TOKENS = 16384


def _passes(rows: list[tuple[int, int, Any]]) -> Iterator[tuple[int, list[Any]]]:
    """Rows (SAE layer, tokens, row) in passes of one layer of at most `PASS_TOKENS` padded tokens, in
    their order (a row may pass it alone): each pass's layer and rows."""
    batch: list[Any] = []
    layer, width = -1, 0
    for at, n, row in rows:
        if batch and (at != layer or (len(batch) + 1) * max(width, n) > PASS_TOKENS):
            yield layer, batch
            batch, width = [], 0
        batch.append(row)
        layer, width = at, max(width, n)
    if batch:
        yield layer, batch


def _journal(params: AnnotateParams, shape: Shape, n_features: int, chosen: int, cut: list[tuple[Framed, WindowPlan, list[Share]]]) -> int:
    """The most a job's checkpoint keeps (`_Kept`): each window's stretches in each round (a relative
    error and the chosen features' values a position), and after each pass (at most a window each)
    the peaks (mode top's first round) and the stitched rows not final yet (`mean`: an overlap's)."""
    rounds = 1 if params.mode == "pick" else 2
    windows_count = sum(len(plan.windows) for _, plan, _ in cut)
    pending = max((plan.overlap for _, plan, _ in cut if plan.stitch is windows.Stitch.MEAN), default=0)
    per_pass = (n_features * 4 if params.mode == "top" else 0) + pending * shape.hidden * 4
    return windows_count * rounds * (JOURNAL_PIECE + per_pass) + sum(len(framed.own) for framed, _, _ in cut) * (chosen + 1) * 4


def _cost_annotate(model: Model, params: AnnotateParams) -> Cost:
    """A pass's residuals at the SAE's layer encoded into every feature, then what is kept per token:
    a prompt's k features each, or each sequence's tracks (a float per chosen feature and position).
    A windowed sequence holds the rows of two windows at most as they are stitched (`StreamedSequence`); with
    files, a sequence within the context holds its residual stream until the job's are written, in
    order. With files the tracks are the files' bytes on disk."""
    shape = Shape.of(model)
    sae = resolve_sae(model, params.sae)
    chosen = len(params.feature_ids) if params.mode == "pick" and params.feature_ids else min(params.k, sae.n_features)
    stitched = journal = 0
    if params.window is None:
        lengths = [len(model.encode(t)) for t in ([params.prompt] if params.prompt is not None else params.sequences or [])]
        passes = lengths
        windows_count = 0
    else:  # each window a pass's row; its share of the residual stream encoded once final
        cut = [_windowed(model, params, i) for i in range(len(params.sequences or []))]
        lengths = [len(framed.own) for framed, _, _ in cut]
        passes = [end - start + framed.around for framed, plan, _ in cut for start, end in plan.windows]
        windows_count = len(passes)
        stitched = 2 * max(passes) * shape.hidden * 4
        journal = _journal(params, shape, sae.n_features, chosen, cut)
    if params.prompt is not None:
        result = lengths[0] * (JSON_TOKEN + 16 + 2 * JSON_FLOAT + chosen * (JSON_ENTRY + 16))
    else:
        per_position = JSON_TOKEN + JSON_FLOAT + chosen * (JSON_FLOAT + 8) + (2 * JSON_FLOAT if params.window is not None else 0)
        result = sum(n * per_position + chosen * 96 for n in lengths)
    widest = max(passes)
    rows = max(1, min(len(passes), PASS_TOKENS // widest))
    # A pass's features (its top-k or chosen rows beside them), or a stretch's when encoded a stretch at a time.
    encoded = min(rows * widest * sae.n_features, max(ENCODE_FLOATS, sae.n_features)) * 4 * 2
    working = shape.pass_bytes(rows, widest, states=1) + encoded
    inline = Cost(
        memory=working + stitched + sum(lengths) * (chosen + 1) * 4 + result,
        result=result,
        memory_field="window" if params.window is not None else ("sequences" if params.sequences is not None else "prompt"),
        result_field="k" if params.mode == "top" else "feature_ids",
        tokens=widest,
        # Rows read: mode top runs a windowed sequence's windows twice (its features chosen after the first).
        counted=sum(passes) * (2 if params.window is not None and params.mode == "top" else 1),
        journal=journal,
    )
    if params.sequences is None:
        return inline
    if params.partials:  # the tracks are in the job's log too (its partial events) until it ends; never files
        return dataclasses.replace(inline, memory=inline.memory + result)
    summary = JSON_FRAME * (len(lengths) + 1) + sum(chosen * 96 for _ in lengths) + 2 * JSON_FLOAT * windows_count
    tracks = (chosen if params.mode == "pick" else chosen * len(lengths)) + 1  # files: one per feature, and the error's
    written = dataclasses.replace(
        inline,
        memory=working + (stitched if params.window is not None else sum(lengths) * shape.hidden * 4) + summary,
        result=summary,
        result_field="sequences",
        files=sum(lengths) * (chosen + 1) * TRACK_BYTES + tracks * FILE_OVERHEAD + max(lengths) * chosen * SPILL_BYTES,
    )
    if params.file is not None:
        return written
    if tracks + 1 > MAX_FILES:  # too many features' tracks for files: the JSON's bound stands
        return inline
    return dataclasses.replace(inline, as_files=written, file_format="bigwig")


# A position of a track on disk at most: its value in the bigWig and its zoom levels' summaries
# (uncompressed, as the bound), and its share of a BED line where a feature fires in every other.
TRACK_BYTES = 40
FILE_OVERHEAD = 64 * 1024  # a bigWig's header, index and zoom headers
# A position of a feature's track, at most, in the stretches above the threshold kept on disk until
# its sequence ends (gateway/tools/files.py `_Spill`): 24 bytes a stretch, one every other position.
SPILL_BYTES = 12


def _annotate_steps(model: Model, jobs: list[AnnotateParams], ctxs: list[Context]) -> Generator[None, None, list[AnnotateResult]]:
    """The jobs' passes, a step each (another tool's job may run between two: a long sequence's windows
    are thousands of passes; a job cancelled meanwhile has no rows in the next); their results at the
    end (None for a job cancelled). Files of a run that stops unfinished are closed."""
    for params in jobs:
        _check_annotate(model, params)  # also when called directly, without the gateway's check
    saes = [resolve_sae(model, params.sae) for params in jobs]
    tracks = {j: _track_files(model, p, ctxs[j]) for j, p in enumerate(jobs) if p.file is not None}
    try:
        return (yield from _annotate_passes(model, jobs, ctxs, saes, tracks))
    except BaseException:  # failed, or dropped unfinished (its batch ended): nothing writes them any more
        for files in tracks.values():
            files.abandon()
        raise


def _annotate_passes(
    model: Model, jobs: list[AnnotateParams], ctxs: list[Context], saes: list[SAE], tracks: dict[int, TrackFiles]
) -> Generator[None, None, list[AnnotateResult]]:
    texts, streams = _rows(model, jobs, ctxs, saes, tracks)
    progress = _Progress(jobs, ctxs, texts, streams)
    outputs: dict[tuple[int, int], Any] = {}
    held: dict[tuple[int, int], tuple[torch.Tensor, list[int]]] = {}  # file jobs' texts, written in order at the end

    def windows_left() -> list[tuple[int, int, Any]]:
        """Each sequence's windows, in its plan's order, while it wants a run of them (mode top: twice)."""
        return [
            (saes[key[0]].spec.layer, len(stream.framed.window(*stream.plan.windows[w])), (key, w))
            for key, stream in streams.items() if stream.wanted and not ctxs[key[0]].cancelled
            for w in range(stream.next, len(stream.plan.windows))
        ]

    kept = _Kept(jobs, ctxs, streams)
    for key, w in kept.replay():
        progress.advance(key[0])
    progress.tell()

    rows: list[tuple[int, int, Any]] = [(saes[row[0]].spec.layer, len(row[2]), row) for row in texts] + windows_left()
    while rows:
        for layer, batch in _passes(rows):
            raise_if_all_cancelled(ctxs)
            batch = [row for row in batch if not ctxs[_job(row)].cancelled]
            ids = [_ids(streams, row) for row in batch]
            residuals = _residuals(model, layer, ids) if batch else []
            for row, read in zip(batch, ids):  # once read: a pass that failed counts nothing
                ctxs[_job(row)].count(tokens_in=len(read))  # a window each time it runs (mode top: twice)
            for row, x in zip(batch, residuals):
                if isinstance(row[0], tuple):  # a window
                    streams[row[0]].add(row[1], x)
                    progress.advance(row[0][0])
                    continue
                j, s, ids = row
                params, sae = jobs[j], saes[j]
                if params.prompt is not None:
                    outputs[j, s] = _annotate_prompt(model, sae, params, x, ids)
                elif params.file is not None:
                    own = model.own(ids)
                    held[j, s] = (x[own].cpu(), [ids[i] for i in own])  # off the device while other jobs run between passes
                else:
                    outputs[j, s] = annotate_sequence(model, sae, params, x, ids)
                progress.advance(j)
            kept.record()
            progress.tell()
            yield
        rows = windows_left()  # those that run again (mode top): their features are chosen now
    for j, s in sorted(held):
        x, own = held.pop((j, s))
        if not ctxs[j].cancelled:
            outputs[j, s] = annotate_own(model, saes[j], jobs[j], x.to(model.device), own, (tracks[j], _names(jobs[j])[s]))
    for key in sorted(streams):
        stream = streams.pop(key)
        if not ctxs[key[0]].cancelled:
            outputs[key] = stream.annotation()
    return _results(jobs, ctxs, saes, tracks, outputs)


def _rows(
    model: Model, jobs: list[AnnotateParams], ctxs: list[Context], saes: list[SAE], tracks: dict[int, TrackFiles]
) -> tuple[list[tuple[int, int, list[int]]], dict[tuple[int, int], StreamedSequence]]:
    """What the passes run: the texts within the context, (job, its index, token ids), longest first;
    and the long sequences' streams by (job, sequence), whose windows run in their plans' order."""
    texts: list[tuple[int, int, list[int]]] = []
    streams: dict[tuple[int, int], StreamedSequence] = {}
    sent = [0] * len(jobs)  # each job's partial events, in this run's order
    for j, p in enumerate(jobs):
        if p.window is not None:
            for s in range(len(p.sequences or [])):
                framed, plan, shares = _windowed(model, p, s)
                files = (tracks[j], _names(p)[s]) if j in tracks else None
                streams[j, s] = stream = StreamedSequence(model, saes[j], p, framed, plan, shares, files)
                if p.partials:
                    stream.sequence, stream.emit = s, functools.partial(_emit, ctxs[j], sent, j)
            continue
        texts += [(j, s, model.encode(t)) for s, t in enumerate([p.prompt] if p.prompt is not None else p.sequences or [])]
    texts.sort(key=lambda row: (saes[row[0]].spec.layer, -len(row[2])))
    return texts, streams


def _results(
    jobs: list[AnnotateParams], ctxs: list[Context], saes: list[SAE], tracks: dict[int, TrackFiles], outputs: dict[tuple[int, int], Any]
) -> list[AnnotateResult | None]:
    """Each job's result from its texts' and sequences' outputs (None: cancelled, its files abandoned)."""
    results: list[Any] = []
    for j, (params, sae) in enumerate(zip(jobs, saes)):
        if ctxs[j].cancelled:
            if j in tracks:
                tracks.pop(j).abandon()
            results.append(None)
        elif params.prompt is not None:
            results.append(AnnotateResult(sae=sae.name, layer=sae.spec.layer, tokens=outputs[j, 0]))
        else:
            done = [outputs[j, s] for s in range(len(params.sequences or []))]
            files = tracks.pop(j).close() if j in tracks else None
            results.append(AnnotateResult(sae=sae.name, layer=sae.spec.layer, sequences=done, files=files))
    return results


class _Kept:
    """The checkpoints of a run's jobs that keep one (`_resumable`): after each pass, the windows each
    sequence encoded in it go to its job's journal, in the order they ran; a run after its engine
    died replays them in that order (the same numbers into the same files) before running the rest."""

    def __init__(self, jobs: list[AnnotateParams], ctxs: list[Context], streams: dict[tuple[int, int], StreamedSequence]) -> None:
        self.streams = streams
        self.checkpoints = {
            j: checkpoint for j, (params, ctx) in enumerate(zip(jobs, ctxs))
            if _resumable(params) and (checkpoint := checkpoints.of(ctx)) is not None
        }
        self.ctxs = ctxs
        self.order = 0  # the windows encoded so far, in this job's runs: each record's place
        for key, stream in streams.items():
            if key[0] in self.checkpoints:
                stream.log = []

    def replay(self) -> Iterator[tuple[tuple[int, int], int]]:
        """The windows the runs before this one kept, each replayed in its sequence's stream: (sequence's key, window)."""
        kept = []
        for j, checkpoint in self.checkpoints.items():
            kept += [(order, (j, s), w, encoded) for (order, s, _, w), encoded in checkpoint.finished().items()]
        for order, key, w, encoded in sorted(kept, key=lambda entry: entry[0]):
            self.streams[key].replay(w, encoded)
            self.order = max(self.order, order + 1)
            yield key, w

    def record(self) -> None:
        """The windows each job's sequences encoded in the pass just run, into its checkpoint."""
        for j in list(self.checkpoints):
            if self.ctxs[j].cancelled:  # ended: nothing of it will go on, and its folder may be gone
                continue
            pieces = []
            for (job, s), stream in self.streams.items():
                if job == j:
                    for (r, w), encoded in stream.logged():
                        pieces.append(((self.order, s, r, w), encoded))
                        self.order += 1
            checkpoints.keep(self.checkpoints, j, pieces)
            if j not in self.checkpoints:  # its checkpoint could not be written: nothing more is kept of it
                for (job, _), stream in self.streams.items():
                    if job == j:
                        stream.log = None


def _emit(ctx: Context, sent: list[int], j: int, partial: AnnotatePartial) -> None:
    sent[j] += 1
    partial_once(ctx, sent[j], partial)


def _resumable(params: AnnotateParams) -> bool:
    """A job of long sequences in windows keeps what each window encoded (gateway/checkpoints.py); its
    other jobs are a pass each, or a prompt."""
    return params.window is not None and params.sequences is not None


def _annotate_many(model: Model, jobs: list[AnnotateParams], ctxs: list[Context]) -> list[AnnotateResult]:
    return run_through(_annotate_steps(model, jobs, ctxs))


def _job(row: Any) -> int:
    """The job a pass's row is of: a text's (job, index, ids) or a window's ((job, sequence), window)."""
    return row[0][0] if isinstance(row[0], tuple) else row[0]


def _ids(streams: dict[tuple[int, int], StreamedSequence], row: Any) -> list[int]:
    return streams[row[0]].ids(row[1]) if isinstance(row[0], tuple) else row[2]


class _Progress:
    """Each job's rows done of its total: its texts, or its windows times the runs of them (mode top: two,
    unless the first finds no feature active)."""

    def __init__(self, jobs: list[AnnotateParams], ctxs: list[Context], texts: list[Any], streams: dict[tuple[int, int], StreamedSequence]) -> None:
        self.jobs, self.ctxs, self.streams = jobs, ctxs, streams
        self.done = [0] * len(jobs)
        self.texts = [sum(1 for row in texts if row[0] == j) for j in range(len(jobs))]
        self.touched: set[int] = set()

    def advance(self, j: int) -> None:
        self.done[j] += 1
        self.touched.add(j)

    def tell(self) -> None:
        for j in sorted(self.touched):
            total = self.texts[j] + sum(len(s.plan.windows) * s.rounds for (job, _), s in self.streams.items() if job == j)
            self.ctxs[j].progress(self.done[j], total, "windows" if self.jobs[j].window is not None else "sequences")
        self.touched.clear()


def _names(params: AnnotateParams) -> list[str]:
    return params.names or [f"seq{i + 1}" for i in range(len(params.sequences or []))]


def _track_files(model: Model, params: AnnotateParams, ctx: Context) -> TrackFiles:
    """A file job's tracks: its sequences, by name, each as long as its own tokens."""
    lengths = [len(model.own(model.encode(sequence, bounded=False))) for sequence in params.sequences or []]
    return TrackFiles(ctx.file, list(zip(_names(params), lengths)), params.threshold)


@tool(
    check=_check_annotate,
    cost=_cost_annotate,
    caps={"sequences": "max_sequences"},
    sequences=("prompt", "sequences"),
    batch=in_steps(_annotate_steps),
    resumable=_resumable,
    needs={Capability.LAYERS, Capability.SAE},
    partial=AnnotatePartial,
)
def sae_annotate(model: Model, params: AnnotateParams, ctx: Context) -> AnnotateResult:
    """Per token of a prompt, its most active SAE features (or the chosen ones) and the reconstruction error;
    or, for many sequences, each chosen feature's activation at every position, with a summary."""
    return _annotate_many(model, [params], [ctx])[0]
