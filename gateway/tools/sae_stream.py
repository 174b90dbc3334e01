"""One long sequence through an SAE, for `sae_annotate` (gateway/tools/sae_annotate.py): its windows'
final stretches encoded as they come, a feature's values summed and its peaks kept, rows written into
the track files in order; what a sequence's annotation and its partials hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

import msgspec
import numpy as np
import torch

from gateway.models.sae import SAE
from gateway.tools.base import Model
from gateway.tools.files import TrackFiles
from gateway.tools import windows
from gateway.tools.numbers import floats
from gateway.tools.windows import Framed, Share, WindowPlan

if TYPE_CHECKING:
    from gateway.tools.sae_annotate import AnnotateParams

class AnnotatePartial(msgspec.Struct):
    """With partials: the chosen features' values at a stretch of a sequence's positions, final."""

    sequence: int
    start: int
    end: int
    features: list[int]
    values: list[list[float]]


class FeatureTrack(msgspec.Struct, omit_defaults=True):
    """One feature over one sequence: its largest and mean activation, where the largest is, and where it
    is above the threshold (with file: in features.bed instead)."""

    id: int
    label: str | None
    max: float
    mean: float
    argmax: int
    above: list[int] | None = None


# float32 arrays: raw buffers between services (gateway/encoding.py), JSON numbers for clients.
_Tracks = Annotated[
    Any,
    msgspec.Meta(
        description="features × positions: row i is features[i]'s activation at each position.",
        extra_json_schema={"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
    ),
]
_PerPosition = Annotated[
    Any,
    msgspec.Meta(description="One number per position.", extra_json_schema={"type": "array", "items": {"type": "number"}}),
]


class SequenceAnnotation(msgspec.Struct, omit_defaults=True):
    """One sequence: its own tokens (special tokens left out), aligned with every per-position array;
    with file, its features' summaries, the arrays being in the files."""

    features: list[FeatureTrack]
    tokens: list[str] | None = None
    tracks: _Tracks = None
    relative_error: _PerPosition = None  # |x - decode(encode(x))| / |x| at each position
    name: str | None = None
    """With file: its name (a chromosome's) in the files."""
    length: int | None = None
    """With file: its positions (own tokens)."""
    plan: WindowPlan | None = None
    """With window: how the sequence was cut; its residual stream stitched before it is encoded."""
    context: Annotated[
        Any,
        msgspec.Meta(
            description="With window: per position, [left, right], its least context on each side.",
            extra_json_schema={
                "anyOf": [{"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}}, {"type": "null"}]
            },
        ),
    ] = None


# Features × positions encoded at once, at most: a long sequence is encoded a stretch at a time.
ENCODE_FLOATS = 1 << 24


def annotate_sequence(model: Model, sae: SAE, params: AnnotateParams, x: torch.Tensor, ids: list[int]) -> SequenceAnnotation:
    own = model.own(ids)  # positions are the sequence's own tokens: BOS, CLS, EOS are not letters of it
    return annotate_own(model, sae, params, x[own], [ids[i] for i in own])


def annotate_own(
    model: Model, sae: SAE, params: AnnotateParams, x: torch.Tensor, ids: list[int], files: tuple[TrackFiles, str] | None = None
) -> SequenceAnnotation:
    """A sequence's annotation from its own positions' residual stream `x` (positions × d_model),
    encoded a stretch of positions at a time: every feature's activation at every position of a
    long sequence is never held at once (a second pass reads the chosen features' tracks). With
    `files` (and the sequence's name in them), the tracks go there a stretch at a time."""
    n = x.shape[0]
    step = max(1, ENCODE_FLOATS // sae.n_features)
    stretches = [(a, min(a + step, n)) for a in range(0, n, step)]
    peaks = x.new_full((sae.n_features,), float("-inf")) if n else x.new_zeros(sae.n_features)
    relative = x.new_empty(n)
    for a, b in stretches:
        f = sae.encode(x[a:b])
        relative[a:b] = (x[a:b] - sae.decode(f)).norm(dim=-1) / x[a:b].norm(dim=-1).clamp(min=1e-12)
        peaks = torch.maximum(peaks, f.max(dim=0).values)
    if params.mode == "pick":
        assert params.feature_ids is not None
        chosen = params.feature_ids
    else:  # the k features with the largest activation anywhere in the sequence, largest first
        top = torch.topk(peaks, min(params.k, sae.n_features))
        chosen = [i for i, v in zip(top.indices.tolist(), top.values.tolist()) if v > 0]
    if files is not None:
        return _annotate_into(sae, x, stretches, chosen, peaks, relative, *files)
    tracks = x.new_empty((len(chosen), n))  # features × positions
    index = torch.tensor(chosen, dtype=torch.long, device=x.device)
    for a, b in stretches if chosen else ():
        tracks[:, a:b] = sae.encode(x[a:b]).index_select(1, index).T
    labels = sae.spec.labels
    if n:
        peaks = tracks.max(dim=1)  # the first position of the largest, as argmax gives it
        maxima, means = floats(torch.stack([peaks.values, tracks.mean(dim=1)]))
        argmax = peaks.indices.tolist()
        where = torch.nonzero(tracks > params.threshold).tolist()  # (feature, position), in order
    else:
        maxima = means = [0.0] * len(chosen)
        argmax, where = [0] * len(chosen), []
    above: list[list[int]] = [[] for _ in chosen]
    for row, position in where:
        above[row].append(position)
    summary = [
        FeatureTrack(fid, labels.get(fid), maxima[k], means[k], argmax[k], above[k]) for k, fid in enumerate(chosen)
    ]
    texts = model.token_texts(ids)
    return SequenceAnnotation(
        features=summary,
        tokens=[texts[i] for i in ids],
        tracks=tracks.cpu().numpy(),
        relative_error=relative.cpu().numpy(),
    )


class _Summed:
    """The chosen features' summaries, gathered a stretch of positions at a time: each one's largest
    value and its first position (as argmax gives it), and the sum of its values."""

    def __init__(self, count: int) -> None:
        self.best = [float("-inf")] * count
        self.argmax = [0] * count
        self.sums = [0.0] * count

    def add(self, start: int, values: np.ndarray) -> None:
        """The values at positions `start`.. (chosen × positions)."""
        for k, row in enumerate(values):
            top = int(row.argmax())
            if row[top] > self.best[k]:
                self.best[k], self.argmax[k] = float(row[top]), start + top
            self.sums[k] += float(row.astype(np.float64).sum())


def _annotate_into(
    sae: SAE, x: torch.Tensor, stretches: list[tuple[int, int]], chosen: list[int], peaks: torch.Tensor,
    relative: torch.Tensor, files: TrackFiles, name: str,
) -> SequenceAnnotation:
    """The chosen features' tracks and the relative error into `files`, a stretch at a time; the
    summary of each (largest, where, mean) gathered as they go."""
    n = x.shape[0]
    index = torch.tensor(chosen, dtype=torch.long, device=x.device)
    most = {fid: float(v) for fid, v in zip(chosen, peaks[index].tolist())} if chosen else {}
    summed = _Summed(len(chosen))
    for a, b in stretches if chosen else ():
        part = sae.encode(x[a:b]).index_select(1, index).T.float().cpu().numpy()  # chosen × stretch
        for k, fid in enumerate(chosen):
            files.write(name, f"f{fid}", a, part[k], fires=True)
        summed.add(a, part)
    for a, b in stretches:
        files.write(name, "relative_error", a, relative[a:b].cpu().numpy())
    files.end_chrom(name, n, {f"f{fid}": most[fid] for fid in chosen})
    labels = sae.spec.labels
    summary = [
        FeatureTrack(fid, labels.get(fid), summed.best[k] if n else 0.0, summed.sums[k] / n if n else 0.0, summed.argmax[k])
        for k, fid in enumerate(chosen)
    ]
    return SequenceAnnotation(features=summary, name=name, length=n)


class _Stretch(NamedTuple):
    """What a stretch of a windowed sequence's positions gave when encoded: from position `start`, the
    relative error and each feature's largest value (the first run), and the chosen features' values
    (chosen × positions, once they are chosen)."""

    start: int
    relative: np.ndarray | None
    most: torch.Tensor | None
    values: np.ndarray | None


@dataclass
class _Encoded:
    """A window's encoded stretches, as a job's checkpoint keeps them, and (the last window of a
    pass) the stitched rows not final yet and where they start (`mean`), and each feature's largest
    value so far (a first run of mode top)."""

    stretches: list[_Stretch]
    pending: tuple[torch.Tensor, int] | None = None
    peaks: torch.Tensor | None = None


class StreamedSequence:
    """A windowed sequence's annotation, built as its windows come, in plan order. A window's share of
    the stitched residual stream is final once no later window holds its positions (at once with
    center and left; with mean, up to the next window's start) and is encoded then, a stretch at a
    time: the sequence holds one window's rows and its result, whatever its length. With mode top
    the k features are known only once every position is encoded, so the windows run twice: first
    for each feature's peak (and the error), then for the chosen features' tracks (`rounds`)."""

    def __init__(
        self, model: Model, sae: SAE, params: AnnotateParams, framed: Framed, plan: WindowPlan, shares: list[Share],
        files: tuple[TrackFiles, str] | None,
    ) -> None:
        self.model, self.sae, self.params, self.files = model, sae, params, files
        self.framed, self.plan, self.shares = framed, plan, shares
        # Each window's encoded stretches, with the round it ran in, since they were last taken
        # (`logged`): what a job's checkpoint keeps, for a run after its engine died to go on from
        # (None: the job keeps none).
        self.log: list[tuple[int, int, _Encoded]] | None = None
        # With partials: sends the chosen features' values of each stretch, final (`AnnotatePartial`).
        self.emit: Callable[[AnnotatePartial], None] | None = None
        self.sequence = 0
        self.n = len(framed.own)
        self.relative = np.empty(self.n, dtype=np.float32) if files is None else None
        self.peaks: torch.Tensor | None = None
        self.chosen: list[int] | None = None
        self.rounds = 1 if params.mode == "pick" else 2
        self.round = 0
        if params.mode == "pick":
            assert params.feature_ids is not None
            self._choose(list(params.feature_ids))
        self._again()

    def _again(self) -> None:
        self.next = 0  # the window expected next
        self.pending: torch.Tensor | None = None  # (mean) positions from `lo` on, summed, not final yet
        self.lo = 0

    def _choose(self, chosen: list[int]) -> None:
        self.chosen = chosen
        self.tracks = np.empty((len(chosen), self.n), dtype=np.float32) if self.files is None else None
        self.summed = _Summed(len(chosen))
        self.above: list[list[int]] = [[] for _ in chosen]

    def ids(self, w: int) -> list[int]:
        start, end = self.plan.windows[w]
        return self.framed.window(start, end)

    @property
    def wanted(self) -> bool:
        """Whether its windows run (again)."""
        return self.round < self.rounds

    def add(self, w: int, x: torch.Tensor) -> None:
        """Window `w`'s residual stream (its row of a pass): its share, final where no later window goes."""
        assert w == self.next, f"window {w} came before window {self.next}"
        self.next += 1
        if self.log is not None:
            self.log.append((self.round, w, _Encoded([])))
        share = self.shares[w]
        begin = len(self.framed.head) + share.offset
        rows = x[begin : begin + share.end - share.start]
        if share.weights is None:
            self._encode(share.start, rows)
        else:
            rows = rows * torch.from_numpy(share.weights).to(rows.device)[:, None]
            if self.pending is None:
                self.pending, self.lo = rows, share.start
            else:
                have = self.lo + len(self.pending)
                if share.end > have:
                    self.pending = torch.cat([self.pending, rows.new_zeros((share.end - have, rows.shape[1]))])
                self.pending[share.start - self.lo : share.end - self.lo] += rows
            final = self.plan.windows[w + 1][0] if w + 1 < len(self.plan.windows) else self.n
            if final > self.lo:
                self._encode(self.lo, self.pending[: final - self.lo])
                self.pending, self.lo = self.pending[final - self.lo :], final
        if self.next == len(self.plan.windows):
            self._ended()

    def _encode(self, start: int, x: torch.Tensor) -> None:
        step = max(1, ENCODE_FLOATS // self.sae.n_features)
        for a in range(0, len(x), step):
            xs = x[a : a + step]
            f = self.sae.encode(xs)
            relative = most = values = None
            if self.round == 0:
                relative = ((xs - self.sae.decode(f)).norm(dim=-1) / xs.norm(dim=-1).clamp(min=1e-12)).float().cpu().numpy()
                most = f.max(dim=0).values.float().cpu()
            if self.chosen is not None and self.chosen:
                index = torch.tensor(self.chosen, dtype=torch.long, device=f.device)
                values = f.index_select(1, index).T.float().cpu().numpy()
            stretch = _Stretch(start + a, relative, most, values)
            if self.log is not None:  # the peaks as they stand once its pass ends, not each stretch's (`logged`)
                self.log[-1][2].stretches.append(stretch._replace(most=None))
            self._apply(stretch)

    def _apply(self, stretch: _Stretch) -> None:
        """A stretch's numbers, encoded now or by a run before this one: written, kept, summed up."""
        if stretch.relative is not None:
            if self.files is not None:
                self.files[0].write(self.files[1], "relative_error", stretch.start, stretch.relative)
            else:
                assert self.relative is not None
                self.relative[stretch.start : stretch.start + len(stretch.relative)] = stretch.relative
        if stretch.most is not None:
            self.peaks = stretch.most if self.peaks is None else torch.maximum(self.peaks, stretch.most)
        if stretch.values is not None:
            self._tracks(stretch.start, stretch.values)

    def logged(self) -> list[tuple[tuple[int, int], _Encoded]]:
        """The windows encoded since the last call, each by (round, window), for the job's checkpoint;
        the last one with what the next windows go on from: the stitched rows not final yet (`mean`),
        and, from a first run that chooses the features, each one's largest value so far."""
        if not self.log:
            return []
        done, self.log = self.log, []
        if self.pending is not None:
            done[-1][2].pending = (self.pending.float().cpu().clone(), self.lo)  # a view pickles its whole storage
        if any(r == 0 for r, _, _ in done) and self.params.mode == "top":
            done[-1][2].peaks = self.peaks
        return [((r, w), encoded) for r, w, encoded in done]

    def replay(self, w: int, encoded: _Encoded) -> None:
        """Window `w` as a run before this one encoded it (`logged`): its numbers, without the model."""
        assert w == self.next, f"window {w} came before window {self.next}"
        self.next += 1
        for stretch in encoded.stretches:
            self._apply(stretch)
        if encoded.peaks is not None:
            self.peaks = encoded.peaks
        if encoded.pending is not None:
            rows, self.lo = encoded.pending
            self.pending = rows.to(self.model.device)
        if self.next == len(self.plan.windows):
            self._ended()

    def _tracks(self, start: int, values: np.ndarray) -> None:
        """The chosen features' values at positions `start`.. (chosen × positions): kept or written, summed up."""
        assert self.chosen is not None
        self.summed.add(start, values)
        if self.emit is not None:
            self.emit(AnnotatePartial(self.sequence, start, start + values.shape[1], list(self.chosen), floats(torch.from_numpy(values))))
        for k, fid in enumerate(self.chosen):
            row = values[k]
            if self.files is not None:
                self.files[0].write(self.files[1], f"f{fid}", start, row, fires=True)
            else:
                self.above[k] += (np.flatnonzero(row > self.params.threshold) + start).tolist()
        if self.tracks is not None:
            self.tracks[:, start : start + values.shape[1]] = values

    def _ended(self) -> None:
        """A run of every window is done: with mode top, the first picks the features the second tracks."""
        self.round += 1
        if self.chosen is None:
            assert self.peaks is not None
            top = torch.topk(self.peaks, min(self.params.k, self.sae.n_features))
            self._choose([i for i, v in zip(top.indices.tolist(), top.values.tolist()) if v > 0])
            if not self.chosen:
                self.rounds = self.round  # no feature is active anywhere: nothing to track
        if self.files is not None and self.round == self.rounds:
            # Its last run is done: its BED lines, before the next sequence's (the files are in order).
            files, name = self.files
            files.end_chrom(name, self.n, {f"f{fid}": self.summed.best[k] for k, fid in enumerate(self.chosen)})
        self._again()

    def annotation(self) -> SequenceAnnotation:
        assert self.chosen is not None
        labels = self.sae.spec.labels
        summed = self.summed
        maxima, means = floats(torch.tensor([summed.best, [total / self.n for total in summed.sums]], dtype=torch.float64)) if self.chosen else ([], [])
        features = [
            FeatureTrack(fid, labels.get(fid), maxima[k], means[k], summed.argmax[k], self.above[k] if self.files is None else None)
            for k, fid in enumerate(self.chosen)
        ]
        if self.files is not None:
            return SequenceAnnotation(features=features, name=self.files[1], length=self.n, plan=self.plan)
        texts = self.model.token_texts(self.framed.own)
        return SequenceAnnotation(
            features=features,
            tokens=[texts[i] for i in self.framed.own],
            tracks=self.tracks,
            relative_error=self.relative,
            plan=self.plan,
            context=windows.context(self.plan.windows, self.plan.stitch),
        )
