"""Sequences longer than a model's context, as overlapping windows stitched back together.

A tool whose output is per position, or pooled over positions, takes three
params (`WindowParams`): `window`, the most own tokens of a sequence one pass
sees (the model's context less the special tokens the tokenizer adds and any
tag); `overlap`, the tokens two neighbouring windows share; and `stitch`, how a
position seen by two windows gets its value:

- `center` (the default on a model that reads both ways: ESM-2, BERT): from
  the window where it is farthest from an edge, so each position's state is one
  the model computed, with the most context on its nearer side the plan gives
  it; the stretch where two windows overlap is split at its middle.
- `left` (the default on a causal model: Llama, an Evo2-style DNA model): from
  the first window that holds it, where it has the most context on its left,
  which is all a causal model's state sees; every position keeps at least
  `overlap` tokens before it, as a strided perplexity's tokens do. `center`
  would give the second half of each overlap to the later window, where it has
  less (bench/sequences.py measures both).
- `mean`: the average of every window that saw it. Smoother across window
  edges, but a position in an overlap gets a mix of two passes' states, which
  no single pass computed.

A plan (`plan`) puts windows of `window` tokens `window - overlap` apart, the
last one ending at the sequence's end, so every window is full length (a
sequence no longer than `window` is one window: the whole pass, exactly). Each
window is run as a sequence of its own, with the tokenizer's special tokens
(and the sequence's tag) around it, as users of ESM-2 and Evo2 window by hand.

The answer states the plan: each window's (start, end) in the sequence's own
tokens, the rule, and, per position, the fewest tokens of context it had on
each side (`Stitched.context`), so that edge-affected positions can be told.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

from gateway.errors import ApiError, ParamError, TooLong
from gateway.protocol import Code
from gateway.tools.base import right_padded
from gateway.tools.batching import Chunk


class Stitch(str, enum.Enum):
    CENTER = "center"
    LEFT = "left"
    MEAN = "mean"


WINDOW_DOC = (
    "For a sequence longer than the model's context: the most of its own tokens one pass sees; longer "
    "sequences run as overlapping windows, stitched (see stitch). Default: none (a sequence over the context "
    "is refused with 413); 0 takes the model's context less its special tokens."
)
OVERLAP_DOC = "Tokens two neighbouring windows share. Default: a quarter of the window."
STITCH_DOC = (
    "How a position two windows saw gets its value: center takes it from the window where it is farthest from an "
    "edge, a state one pass computed; left from the first window that holds it, where it has the most context on its "
    "left (all a causal model's state sees); mean averages every window that saw it. Default: left on a causal model, "
    "center on one that reads both ways."
)


class WindowParams(msgspec.Struct, kw_only=True):
    """The window params a tool's params take (its own fields first)."""

    window: Annotated[int, msgspec.Meta(ge=0, description=WINDOW_DOC)] | None = None
    overlap: Annotated[int, msgspec.Meta(ge=0, description=OVERLAP_DOC)] | None = None
    stitch: Annotated[Stitch, msgspec.Meta(description=STITCH_DOC)] | None = None


MOST_PARTS = 1024  # parts a plan may be cut into

PART_DOC = (
    "With window and one sequence: compute only a part of its plan, [index, count], the index-th (from 0) of count "
    "runs of consecutive windows, windows len*index//count up to len*(index+1)//count: a part of one job, as the "
    "gateway cuts one long sequence over several engines. The result holds the plan whole, and of the values only "
    "the part's (see span); the parts' results put together in order are the whole's. Not with stitch mean where a "
    "position's value would be summed over two parts."
)

# A part of a plan: [index, count] (a list, not a tuple: JSON Schema readers of params take `items` as one schema).
Part = Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=MOST_PARTS)]], msgspec.Meta(min_length=2, max_length=2)]


class WindowPlan(msgspec.Struct, omit_defaults=True):
    """How one sequence was cut: its windows, in its own tokens, and how they were stitched."""

    windows: list[tuple[int, int]]
    """Each window's (start, end) in the sequence's own tokens, end exclusive."""
    stitch: Stitch
    window: int
    overlap: int


@dataclass(frozen=True)
class Sizes:
    """A job's window and overlap, resolved against the model."""

    window: int
    overlap: int
    stitch: Stitch

    @property
    def step(self) -> int:
        return self.window - self.overlap


def resolve(params: WindowParams, most: int, causal: bool = False) -> Sizes | None:
    """The window sizes `params` ask for, `most` own tokens being the most a pass takes (`causal`: on
    a causal model, whose default rule is `left`); None when no window was asked for. Raises
    `ParamError` naming the param at fault."""
    if params.window is None:
        for name in ("overlap", "stitch"):
            if getattr(params, name) is not None:
                raise ParamError(name, "only with window")
        return None
    window = params.window or most
    if window > most:
        raise ParamError("window", f"window {window} is more than the model takes in one pass: {most} tokens of a sequence")
    overlap = params.overlap if params.overlap is not None else window // 4
    if overlap >= window:
        raise ParamError("overlap", f"must be less than the window ({window})")
    stitch = Stitch(params.stitch) if params.stitch is not None else Stitch.LEFT if causal else Stitch.CENTER
    return Sizes(window, overlap, stitch)


WINDOW_HINT = "; give window (0: as much as the model takes) to run it as overlapping windows"


@contextlib.contextmanager
def naming_window() -> Iterator[None]:
    """Within: a 413 `too_long` says that the window param would take the sequence."""
    try:
        yield
    except TooLong as exc:
        exc.message += WINDOW_HINT
        exc.args = (exc.message,)
        raise


@dataclass(frozen=True)
class Framed:
    """A sequence's token ids as windows take them: the tokens before its own (special tokens, a
    tag), its own, and those after; each window is `head + own[start:end] + tail`."""

    head: list[int]
    own: list[int]
    tail: list[int]

    @classmethod
    def of(cls, ids: list[int], own: list[int], field: str) -> Framed:
        if not own:
            raise ParamError(field, "has no tokens of its own, only the tokenizer's special tokens")
        first, last = own[0], own[-1]
        if last - first + 1 != len(own):
            raise ParamError(field, "its own tokens are not one run between the special ones: it cannot be cut into windows")
        return cls(ids[:first], ids[first : last + 1], ids[last + 1 :])

    def window(self, start: int, end: int) -> list[int]:
        return [*self.head, *self.own[start:end], *self.tail]

    @property
    def around(self) -> int:
        """The tokens each window adds around the sequence's own."""
        return len(self.head) + len(self.tail)


class WindowIds:
    """A window's row of token ids, made when its pass runs (`ids`): a plan of thousands of windows
    holds where each is, not its ids (1.3 times the sequence's, 11 MB for 10^6 residues)."""

    __slots__ = ("framed", "start", "end")

    def __init__(self, framed: Framed, start: int, end: int) -> None:
        self.framed, self.start, self.end = framed, start, end

    def __len__(self) -> int:
        return self.end - self.start + self.framed.around

    def ids(self) -> list[int]:
        return self.framed.window(self.start, self.end)


# Windows one sequence may be cut into: a 1 Mbp genome in windows of 256 bases a quarter shared is
# 5,209; a window of a few tokens over a long sequence would be a pass per token.
MAX_WINDOWS = 20_000


def plan(n: int, sizes: Sizes) -> list[tuple[int, int]]:
    """Windows over `n` positions: `sizes.window` long, `sizes.step` apart, the last ending at `n`.
    Raises 413 `too_large` (the `window` param) past `MAX_WINDOWS`."""
    if n <= sizes.window:
        return [(0, n)]
    count = -(-(n - sizes.window) // sizes.step) + 1
    if count > MAX_WINDOWS:
        raise ApiError(
            Code.TOO_LARGE,
            f"window: {count} windows of {sizes.window} tokens {sizes.step} apart; at most {MAX_WINDOWS} a sequence: "
            "a longer window, or less overlap",
            field="window",
        )
    starts = list(range(0, n - sizes.window, sizes.step)) + [n - sizes.window]
    return [(start, start + sizes.window) for start in starts]


def check_part(params: Any, items: list[Any], field: str, summed: bool) -> None:
    """Refuse a `part` param (the `part` field) that cannot be a part of one sequence's plan: `summed`,
    a position's value would be added up over windows of two parts."""
    index, count = params.part
    if count < 1:
        raise ParamError("part", "count must be at least 1")
    if params.window is None:
        raise ParamError("part", "a part of a window plan: only with window")
    if len(items) != 1:
        raise ParamError("part", f"a part of one sequence's plan: {field} must hold one")
    if index >= count:
        raise ParamError("part", f"index {index} of {count} parts: it must be less than the count")
    if summed:
        raise ParamError("part", "with stitch mean a position's value is summed over windows the parts share: use center or left")


def most_windows(params: Any, text: str, context_length: int | None, around: int = 2) -> int:
    """At most how many windows a plan of `text` has, before it is tokenized (the gateway cuts a job
    by its plan where only its engines can tokenize): every own token is at least a byte of it, and
    `around` special tokens are taken from the context. Unknown, without a window or a context: 1."""
    window = params.window or (context_length - around if context_length else 0)
    if window <= 0:
        return 1
    overlap = params.overlap if params.overlap is not None else window // 4
    n = len(text.encode())
    if n <= window or overlap >= window:
        return 1
    return -(-(n - window) // (window - overlap)) + 1


def part_windows(part: list[int] | tuple[int, int] | None, count: int) -> range:
    """The windows of a plan of `count` that `part` computes (all without one)."""
    if part is None:
        return range(count)
    index, parts = part
    return range(count * index // parts, count * (index + 1) // parts)


def span(shares: list[Share], picked: range, n: int) -> tuple[int, int]:
    """The positions [start, end) whose values the windows `picked` give (center or left: each from one window)."""
    if not picked:
        start = shares[picked.start].start if picked.start < len(shares) else n
        return start, start
    return shares[picked[0]].start, shares[picked[-1]].end


@dataclass(frozen=True)
class Share:
    """What one window gives the stitched sequence: positions [start, end) in the sequence, each
    row of the window's output from `offset` on times its `weight`."""

    start: int
    end: int
    offset: int
    weights: np.ndarray | None  # None: every weight is 1


def shares(windows: list[tuple[int, int]], stitch: Stitch) -> list[Share]:
    """Each window's share of the stitched sequence; the shares of a position's windows sum to 1."""
    if stitch is Stitch.CENTER:
        # Where two neighbours overlap, each position goes to the window it is farther inside; the
        # overlap splits at its middle (the earlier window takes the middle position of an odd one).
        cuts = [0]
        for (_, end), (start, _) in zip(windows, windows[1:]):
            cuts.append((start + end + 1) // 2)
        cuts.append(windows[-1][1])
        return [Share(a, b, a - w[0], None) for w, a, b in zip(windows, cuts, cuts[1:])]
    if stitch is Stitch.LEFT:
        # Each position goes to the first window holding it: each window takes from where the one before ends.
        cuts = [0, *(end for _, end in windows)]
        return [Share(a, b, a - w[0], None) for w, a, b in zip(windows, cuts, cuts[1:])]
    n = windows[-1][1]
    cover = np.zeros(n, dtype=np.float32)
    for start, end in windows:
        cover[start:end] += 1
    return [Share(start, end, 0, 1.0 / cover[start:end]) for start, end in windows]


def context(windows: list[tuple[int, int]], stitch: Stitch, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Per position, the fewest tokens of context it had on its left and on its right (n × 2) among
    the windows its value came from: a position at the sequence's own end has what the sequence has.
    Positions `start`..`stop` only (default all), for a caller that writes them a stretch at a time."""
    n = windows[-1][1]
    stop = n if stop is None else stop
    least = np.full((stop - start, 2), np.iinfo(np.int64).max, dtype=np.int64)
    # The windows that reach the stretch: their starts rise, and so do their ends.
    first = bisect.bisect_right([end for _, end in windows], start)
    last = bisect.bisect_left([begin for begin, _ in windows], stop)
    if stitch is not Stitch.MEAN:  # each position from one window
        for share, (begin, end) in zip(shares(windows, stitch)[first:last], windows[first:last]):
            a, b = max(share.start, start), min(share.end, stop)
            if a < b:
                at = np.arange(a, b)
                least[a - start : b - start, 0] = at - begin
                least[a - start : b - start, 1] = end - 1 - at
        return least
    for begin, end in windows[first:last]:
        a, b = max(begin, start), min(end, stop)
        at = np.arange(a, b)
        np.minimum(least[a - start : b - start, 0], at - begin, out=least[a - start : b - start, 0])
        np.minimum(least[a - start : b - start, 1], end - 1 - at, out=least[a - start : b - start, 1])
    return least


def stitched(n: int, parts: list[tuple[Share, np.ndarray]], width: int) -> np.ndarray:
    """The n × width sequence from each window's output rows and share."""
    out = np.zeros((n, width), dtype=np.float32)
    for share, rows in parts:
        piece = rows[share.offset : share.offset + share.end - share.start]
        if share.weights is None:
            out[share.start : share.end] = piece
        else:
            out[share.start : share.end] += piece * share.weights[:, None]
    return out


class Strided:
    """A causal model's text scored with a stride: its windows' rows (`rows`), and the positions t of
    the text each window reads (`spans`), whose logits score token t + 1 (at the last position: the
    next token). Each token is scored in the first window that holds it, from the token before it
    there: it has at least `overlap` tokens of its text before it."""

    def __init__(self, model: Any, params: WindowParams, ids: list[int], own: list[int], field: str) -> None:
        self.framed = framed = Framed.of(ids, own, field)
        sizes = resolve(params, model.context_length - framed.around, causal=not model.bidirectional)
        assert sizes is not None
        if sizes.overlap < 1 and not framed.head:
            raise ParamError("overlap", "at least 1: a token is scored from the one before it in its window")
        self.length = len(ids)
        self.cut = plan(len(framed.own), sizes)
        self.plan = WindowPlan(windows=self.cut, stitch=sizes.stitch, window=sizes.window, overlap=sizes.overlap)

    @property
    def rows(self) -> list[WindowIds]:
        """Each window's row (its ids made when its pass runs)."""
        return [WindowIds(self.framed, start, end) for start, end in self.cut]

    def spans(self) -> list[tuple[int, int]]:
        """Per window, the positions [start, end) of the text it reads, one run after another. Window w
        (starting at own token s) reads position t at its column t - s: the head's tokens, and the own
        tokens up to its end not in an earlier window, in the first; the tail and the next token in the
        last."""
        head, last = len(self.framed.head), len(self.cut) - 1
        ends = [end + head - 1 for _, end in self.cut[:last]] + [self.length]
        return list(zip([0, *ends[:-1]], ends))


def cut(model: Any, params: WindowParams, text: str, field: str) -> tuple[Framed, Sizes, list[tuple[int, int]]]:
    """A text to run in windows: its tokens framed, its window sizes and its plan (`params.window` given)."""
    ids = model.encode(text, field, bounded=False)
    framed = Framed.of(ids, model.own(ids), field)
    sizes = resolve(params, model.context_length - framed.around, causal=not model.bidirectional)
    assert sizes is not None
    return framed, sizes, plan(len(framed.own), sizes)


# Windows in one pass at most, where a pass is a step (another job may run between two) and what a
# job's checkpoint keeps: a job whose engine died goes on from its last pass (gateway/checkpoints.py).
PASS_ROWS = 16


class Passes:
    """Rows of token ids packed into right-padded passes: whole texts into the first pass, as one pass
    runs them; windows into passes of at most `tokens` padded tokens (and `most_rows` rows), in
    order (a long sequence's windows would be one pass of thousands of rows)."""

    def __init__(self, tokens: int, most_rows: int | None = None) -> None:
        self.tokens, self.most_rows = tokens, most_rows
        self.rows: list[list[list[int]]] = [[]]
        self.widths = [0]

    def whole(self, ids: list[int]) -> tuple[int, int]:
        """Put a text's row in the first pass: its (pass, row)."""
        return self._put(0, ids)

    def window(self, ids: Any) -> tuple[int, int]:
        """Put a window's row in the last pass, or a new one if it would not fit: its (pass, row)."""
        full = self.most_rows is not None and len(self.rows[-1]) >= self.most_rows
        if self.rows[-1] and (full or (len(self.rows[-1]) + 1) * max(len(ids), self.widths[-1]) > self.tokens):
            self.rows.append([])
            self.widths.append(0)
        return self._put(len(self.rows) - 1, ids)

    def _put(self, at: int, ids: list[int]) -> tuple[int, int]:
        self.rows[at].append(ids)
        self.widths[at] = max(self.widths[at], len(ids))
        return at, len(self.rows[at]) - 1



READS = "reads"  # a Chunk's extra: {item: (columns, tokens scored)}, where its row's logits are read


class ReadPasses:
    """A causal scorer's rows packed as `Passes` packs them, each with the columns its logits are read
    at and the tokens they score; a pass is a chunk (gateway/tools/batching.py): a step, and a record
    of the job's checkpoint."""

    def __init__(self, tokens: int) -> None:
        self.passes = Passes(tokens, PASS_ROWS)
        self.keys: list[list[Any]] = [[]]
        self.reads: dict[Any, tuple[Any, Any]] = {}

    def whole(self, key: Any, ids: list[int], cols: Any, scored: Any, *more: Any) -> None:
        """A whole text's row, into the first pass: its columns read, the tokens (or weights) they
        score, and what else its run needs of each read (`more`: one value a read)."""
        self._put(self.passes.whole(ids)[0], key, cols, scored, *more)

    def window(self, key: Any, row: WindowIds, cols: Any, scored: Any, *more: Any) -> None:
        """A window's row, into the last pass or a new one, as `whole`'s."""
        self._put(self.passes.window(row)[0], key, cols, scored, *more)

    def _put(self, at: int, key: Any, *reads: Any) -> None:
        import torch

        self.keys.extend([] for _ in range(len(self.passes.rows) - len(self.keys)))
        self.keys[at].append(key)
        self.reads[key] = tuple(torch.as_tensor(values) for values in reads)

    def chunks(self) -> list[Chunk]:
        return [
            Chunk(items, data, width, {READS: {key: self.reads[key] for key in items}})
            for items, data, width in zip(self.keys, self.passes.rows, self.passes.widths)
            if items
        ]


def read_pass(model: Any, chunk: Chunk) -> tuple[Any, Any, Any, Any, Any, list[int]]:
    """A `ReadPasses` chunk on the model's device: its padded rows and their mask; per read, its row,
    its column and the token it scores; and how many reads each item has."""
    import torch

    input_ids, mask = right_padded(model, [row.ids() if isinstance(row, WindowIds) else row for row in chunk.data])
    device = input_ids.device
    reads = [chunk.extra[READS][key] for key in chunk.items]
    counts = [len(read[0]) for read in reads]
    rows = torch.repeat_interleave(torch.arange(len(reads)), torch.tensor(counts)).to(device)
    cols = torch.cat([read[0] for read in reads]).to(device)
    scored = torch.cat([read[1] for read in reads]).to(device)
    return input_ids, mask, rows, cols, scored, counts
