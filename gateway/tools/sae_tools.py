"""The SAE tools: list a served SAE's features, annotate a prompt with them, steer generation.

They exist only when `--sae` gives at least one SAE (gateway/models/sae.py); each
finds it on `model.saes`, by the `sae` param's name, or the only one when
the param is left out. Feature ids are checked in `check`, before the job is
queued: an id past the SAE's features is a 422 naming the field, never a
wrong or negative index at run time.

`sae_steer` is `generate` with clamps: at the SAE's layer it encodes each
row's residual stream, sets the clamped features to their strengths, and adds
the decoded difference, `(strength - f) @ W_dec[id]`, to the stream. The hook
doing that is installed for one forward pass and removed after it, and each
row gets its own job's clamps, so steering never reaches another job, in the
same batch or the next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from collections.abc import Callable, Generator, Iterator
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
import numpy as np
import torch

from gateway import checkpoints
from gateway.cost import JOURNAL_PIECE, JSON_ENTRY, JSON_FLOAT, JSON_FRAME, JSON_TOKEN, Cost, Shape
from gateway.errors import ParamError
from gateway.models.anatomy import anatomy
from gateway.models.decoders import ModelState, Recompute
from gateway.models.sae import SAE
from gateway.protocol import ResultFile
from gateway.tools.base import Capability, Context, Model, Tool, right_padded, tool
from gateway.tools.files import MAX_FILES, TrackFiles
from gateway.tools.batching import in_steps, partial_once, raise_if_all_cancelled, run_alone, run_through
from gateway.tools import windows
from gateway.tools.numbers import floats
from gateway.tools.windows import Framed, Share, WindowParams, WindowPlan
from gateway.tools.generate import (
    GenerateParams,
    GeneratePartial,
    GenerateResult,
    Generation,
    _Member,
)
from gateway.tools.generate import check as generate_check
from gateway.tools.generate import cost as generate_cost

# Beyond this a clamp only blows the residual stream up; real activations are far smaller.
MAX_STRENGTH = 1e4

SaeName = Annotated[str, msgspec.Meta(description="Which SAE (its name); may be left out when one is served.")]
FeatureId = Annotated[int, msgspec.Meta(ge=0)]


def resolve_sae(model: Model, name: str | None, field: str = "sae") -> SAE:
    """The SAE called `name`, or the only one served; 422 on `field` otherwise."""
    names = ", ".join(model.saes) or "none"
    if name is None:
        if len(model.saes) != 1:
            raise ParamError(field, f"required: several SAEs are served ({names})")
        return next(iter(model.saes.values()))
    if name not in model.saes:
        raise ParamError(field, f"unknown SAE {name!r}; served: {names}")
    return model.saes[name]


def check_feature_ids(sae: SAE, ids: list[int], field: str, suffix: str = "") -> None:
    """422 naming `field[i]` for an id out of range or given twice."""
    seen: set[int] = set()
    for i, fid in enumerate(ids):
        where = f"{field}[{i}]{suffix}"
        if not 0 <= fid < sae.n_features:
            raise ParamError(where, f"feature {fid} is out of range: {sae.name} has {sae.n_features} features (0..{sae.n_features - 1})")
        if fid in seen:
            raise ParamError(where, f"feature {fid} is given twice")
        seen.add(fid)


# -- sae_features ---------------------------------------------------------------------


class FeaturesParams(msgspec.Struct, forbid_unknown_fields=True):
    sae: SaeName | None = None
    query: Annotated[str, msgspec.Meta(description="Keep features whose label contains this (any case).")] | None = None
    offset: Annotated[int, msgspec.Meta(ge=0)] = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 50


class FeatureInfo(msgspec.Struct):
    id: int
    label: str | None
    decoder_norm: float
    encoder_bias: float


class FeaturesResult(msgspec.Struct):
    sae: str
    layer: int
    n_features: int
    total: int  # features matching `query`
    offset: int
    features: list[FeatureInfo]


def _check_features(model: Model, params: FeaturesParams) -> None:
    resolve_sae(model, params.sae)


@tool(check=_check_features, needs={Capability.SAE})
def sae_features(model: Model, params: FeaturesParams, ctx: Context) -> FeaturesResult:
    """List an SAE's features with their labels and decoder norms, filtered by label and paginated."""
    sae = resolve_sae(model, params.sae)
    labels = sae.spec.labels
    if params.query is None:
        matching: Any = range(sae.n_features)
    else:
        needle = params.query.lower()
        matching = [i for i in sorted(labels) if needle in labels[i].lower()]
    page = matching[params.offset : params.offset + params.limit]
    norms, biases = floats(sae.decoder_norms), floats(sae.b_enc)
    return FeaturesResult(
        sae=sae.name,
        layer=sae.spec.layer,
        n_features=sae.n_features,
        total=len(matching),
        offset=params.offset,
        features=[FeatureInfo(i, labels.get(i), norms[i], biases[i]) for i in page],
    )


# -- sae_annotate ---------------------------------------------------------------------


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


class AnnotatePartial(msgspec.Struct):
    """With partials: the chosen features' values at a stretch of a sequence's positions, final."""

    sequence: int
    start: int
    end: int
    features: list[int]
    values: list[list[float]]


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


# Features × positions encoded at once, at most: a long sequence is encoded a stretch at a time.
ENCODE_FLOATS = 1 << 24


def _annotate_sequence(model: Model, sae: SAE, params: AnnotateParams, x: torch.Tensor, ids: list[int]) -> SequenceAnnotation:
    own = model.own(ids)  # positions are the sequence's own tokens: BOS, CLS, EOS are not letters of it
    return _annotate_own(model, sae, params, x[own], [ids[i] for i in own])


def _annotate_own(
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


class _Stream:
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
    A windowed sequence holds the rows of two windows at most as they are stitched (`_Stream`); with
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
            batch = [row for row in batch if not ctxs[row[0][0] if isinstance(row[0], tuple) else row[0]].cancelled]
            for row, x in zip(batch, _residuals(model, layer, [_ids(streams, row) for row in batch]) if batch else ()):
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
                    outputs[j, s] = _annotate_sequence(model, sae, params, x, ids)
                progress.advance(j)
            kept.record()
            progress.tell()
            yield
        rows = windows_left()  # those that run again (mode top): their features are chosen now
    for j, s in sorted(held):
        x, own = held.pop((j, s))
        if not ctxs[j].cancelled:
            outputs[j, s] = _annotate_own(model, saes[j], jobs[j], x.to(model.device), own, (tracks[j], _names(jobs[j])[s]))
    for key in sorted(streams):
        stream = streams.pop(key)
        if not ctxs[key[0]].cancelled:
            outputs[key] = stream.annotation()
    return _results(jobs, ctxs, saes, tracks, outputs)


def _rows(
    model: Model, jobs: list[AnnotateParams], ctxs: list[Context], saes: list[SAE], tracks: dict[int, TrackFiles]
) -> tuple[list[tuple[int, int, list[int]]], dict[tuple[int, int], _Stream]]:
    """What the passes run: the texts within the context, (job, its index, token ids), longest first;
    and the long sequences' streams by (job, sequence), whose windows run in their plans' order."""
    texts: list[tuple[int, int, list[int]]] = []
    streams: dict[tuple[int, int], _Stream] = {}
    sent = [0] * len(jobs)  # each job's partial events, in this run's order
    for j, p in enumerate(jobs):
        if p.window is not None:
            for s in range(len(p.sequences or [])):
                framed, plan, shares = _windowed(model, p, s)
                files = (tracks[j], _names(p)[s]) if j in tracks else None
                streams[j, s] = stream = _Stream(model, saes[j], p, framed, plan, shares, files)
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

    def __init__(self, jobs: list[AnnotateParams], ctxs: list[Context], streams: dict[tuple[int, int], _Stream]) -> None:
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


def _ids(streams: dict[tuple[int, int], _Stream], row: Any) -> list[int]:
    return streams[row[0]].ids(row[1]) if isinstance(row[0], tuple) else row[2]


class _Progress:
    """Each job's rows done of its total: its texts, or its windows times the runs of them (mode top: two,
    unless the first finds no feature active)."""

    def __init__(self, jobs: list[AnnotateParams], ctxs: list[Context], texts: list[Any], streams: dict[tuple[int, int], _Stream]) -> None:
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


# -- sae_steer ------------------------------------------------------------------------


class Clamp(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    feature_id: FeatureId
    strength: Annotated[
        float,
        msgspec.Meta(ge=-MAX_STRENGTH, le=MAX_STRENGTH, description="The value the feature is clamped to at the positions steered."),
    ]
    start: Annotated[
        int, msgspec.Meta(ge=0, description="The first position clamped, counting the prompt's tokens from 0.")
    ] = 0
    end: Annotated[
        int, msgspec.Meta(ge=1, description="The position after the last one clamped; left out, every position from start on.")
    ] | None = None


class SteerParams(GenerateParams, forbid_unknown_fields=True, kw_only=True):
    clamps: Annotated[list[Clamp], msgspec.Meta(min_length=1, max_length=64)]
    sae: SaeName | None = None
    # The default is "all": feature clamping as the SAE literature does it (Templeton et al. 2024's
    # "Scaling Monosemanticity" clamps a feature at every position, prompt included), which also
    # leaves the prompt's reading shaped by the feature, as a prompt about the topic would.
    steer: Annotated[
        Literal["all", "generated"],
        msgspec.Meta(
            description="all: clamp at every position, the prompt's included; generated: only at the tokens "
            "generated, so the prompt is read as it would be without steering."
        ),
    ] = "all"


def _check_steer(model: Model, params: SteerParams) -> None:
    sae = resolve_sae(model, params.sae)
    check_feature_ids(sae, [c.feature_id for c in params.clamps], "clamps", ".feature_id")
    for i, clamp in enumerate(params.clamps):
        if clamp.end is not None and clamp.end <= clamp.start:
            raise ParamError(f"clamps[{i}].end", f"must be after start ({clamp.start})")
    generate_check(model, params)


def _cost_steer(model: Model, params: SteerParams) -> Cost:
    """`generate`'s, with every step's residuals at the SAE's layer encoded into every feature."""
    plain = generate_cost(model, params)
    sae = resolve_sae(model, params.sae)
    return dataclasses.replace(plain, memory=plain.memory + plain.tokens * sae.n_features * 4 * 2)


@dataclass(frozen=True)
class SteeredRows:
    """One job's rows of a forward pass: rows start..end of the batch, their clamps, and where
    each row's columns are in its sequence: column c is position c + offsets[r], and positions
    from firsts[r] on may be steered (0 for steer "all", the prompt's length for "generated")."""

    start: int
    end: int
    clamps: list[Clamp]
    offsets: list[int]
    firsts: list[int]


@contextlib.contextmanager
def steering(model: Model, sae: SAE, rows: list[SteeredRows]) -> Iterator[None]:
    """Steer the forward passes inside: each block of rows gets its clamps, at its positions; other rows nothing."""
    if not rows:
        yield
        return
    device = sae.W_dec.device
    blocks = [
        (
            block,
            torch.tensor([c.feature_id for c in block.clamps], device=device),
            torch.tensor([c.strength for c in block.clamps], dtype=torch.float32, device=device),
            torch.tensor([[c.start, c.end if c.end is not None else 2**62] for c in block.clamps], device=device),
            torch.tensor(block.offsets, device=device),
            torch.tensor(block.firsts, device=device),
        )
        for block in rows
    ]

    def write(hidden: torch.Tensor) -> None:
        width = hidden.shape[1]
        columns = torch.arange(width, device=device)
        for block, ids, strengths, spans, offsets, firsts in blocks:
            positions = columns[None, :] + offsets[:, None]  # rows × width
            where = (positions[..., None] >= spans[:, 0]) & (positions[..., None] < spans[:, 1])  # rows × width × clamps
            where &= (positions >= firsts[:, None])[..., None]
            f = sae.encode(hidden[block.start : block.end])[..., ids]
            delta = ((strengths - f) * where) @ sae.W_dec[ids]
            hidden[block.start : block.end] += delta.to(hidden.dtype)

    with anatomy(model).overwrite(sae.spec.layer, write):
        yield


class Steering(Generation):
    """`generate`'s continuous batch, each row steered by its own job's clamps (one SAE per batch)."""

    shares_prompts = False  # one prompt's rows may be steered apart

    def __init__(self, model: Model) -> None:
        super().__init__(model)
        self.sae: SAE | None = None
        if isinstance(self.decoder, ModelState):
            # A custom model's `start` may read rows one at a time, so a block's output would not
            # hold every row of the batch for `steering` to tell apart: run whole batches instead.
            self.decoder = Recompute(model)

    def add(self, params: SteerParams, ctx: Context) -> None:
        _check_steer(self.model, params)  # a job at fault fails alone, even if `check` was skipped
        self.sae = resolve_sae(self.model, params.sae)
        super().add(params, ctx)

    def _forward(self, members: list[_Member], run: Callable[[], torch.Tensor], prefill: bool) -> torch.Tensor:
        assert self.sae is not None
        # Where each row's columns are in its sequence: the KV cache decodes one column, the pending
        # token, and prefills prompts left-padded to the longest; Recompute runs every row whole from 0.
        width = max(len(ids) for m in members for ids in m.encoded)
        rows, start = [], 0
        for member in members:
            end = start + len(member.rows)
            lengths = [len(ids) for ids in member.encoded]
            if isinstance(self.decoder, Recompute):
                offsets = [0] * len(lengths)
            elif prefill:
                offsets = [n - width for n in lengths]
            else:
                offsets = [n + member.steps - 1 for n in lengths]
            params: SteerParams = member.params  # type: ignore[assignment]
            firsts = lengths if params.steer == "generated" else [0] * len(lengths)
            rows.append(SteeredRows(start, end, params.clamps, offsets, firsts))
            start = end
        with steering(self.model, self.sae, rows):
            return super()._forward(members, run, prefill)


@tool(
    partial=GeneratePartial,
    check=_check_steer,
    cost=_cost_steer,
    caps={"prompts": "max_prompts", "token_ids": "max_prompts", "max_tokens": "max_tokens"},
    sequences=("prompts",),
    batch=Steering,
    batch_key=lambda params: params.sae,
    needs={Capability.NEXT_TOKEN, Capability.LAYERS, Capability.SAE},
)
def sae_steer(model: Model, params: SteerParams, ctx: Context) -> GenerateResult:
    """Generate like `generate`, with SAE features clamped to given strengths at the SAE's layer."""
    return run_alone(Steering(model), params, ctx)


def sae_tools() -> list[Tool]:
    """The tools served when at least one SAE is loaded."""
    return [sae_features, sae_annotate, sae_steer]
