"""`logprobs`: the log-probability of every token of a text given the tokens before it.

What evaluation harnesses call scoring a prompt (OpenAI's `echo` with `logprobs`):
one forward pass per text, each token's log-probability read from the logits at
the position before it. The first token has nothing before it and no number.
Texts are tokenised as prompts are (special tokens included), or given as token
ids, which are scored exactly as given. `top` adds the most likely tokens at each
position, and `next_token` the greedy token after the text (what `generate` at
temperature 0 would produce first), both from the same pass.

With `window` (gateway/tools/windows.py) a text longer than the context is
scored with a stride, as the well-known sliding-window perplexity does: windows
of `window` own tokens, `window - overlap` apart, each token scored in the
first window that holds it, so every token has at least `overlap` tokens of
its text before it (the first `window`, all of theirs). Each window begins with
the tokenizer's special tokens (a BOS), as a text of its own would. Windows
run in passes of at most `PASS_TOKENS` tokens and `windows.PASS_ROWS` windows.

A pass is a step (`Chunked`, gateway/tools/batching.py): progress counts the
windows, another job may run between two passes, a cancel stops the job at the
next, and each pass's scores are kept in the job's checkpoint, so that a job
whose engine died goes on from its last finished pass (gateway/checkpoints.py).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import IO, Annotated, Any, NamedTuple

import msgspec
import torch

from gateway.cost import JOURNAL_PIECE, JSON_ENTRY, JSON_FLOAT, JSON_FRAME, JSON_TOKEN, PY_ENTRY, PY_FLOAT, Cost, Shape
from gateway.errors import ParamError
from gateway.protocol import ResultFile
from gateway.models.anatomy import readout_chunks, readout_rows
from gateway.tools.base import Capability, Context, Model, tool
from gateway.tools.batching import Chunk, Chunked, WindowItem, each_item
from gateway.tools import windows
from gateway.tools.numbers import floats
from gateway.tools.windows import Strided, WindowParams, WindowPlan

MAX_TOP = 20
PASS_TOKENS = 16384  # padded tokens in one pass over a windowed text's windows
FILE_LINES = 1 << 16  # of a scores file formatted and written at once


class ScoresFile(str, enum.Enum):
    TSV = "tsv"
    JSONL = "jsonl"


FILE_DOC = (
    "Write the scores as a file, fetched from GET /jobs/{id}/files/{name}, a line per token: tsv, logprobs.tsv with "
    "columns sequence, position, token_id, token, logprob (empty for the first token; tab, newline, carriage return "
    "and backslash in a token written \\t, \\n, \\r, \\\\); jsonl, logprobs.jsonl, {sequence, position, token_id, token, logprob, top?} per line. "
    "Default: none, or the one that holds the result (jsonl with top, else tsv) when it would be over the gateway's "
    "--max-result-bytes as JSON."
)


PARTIALS_DOC = (
    "With window: send the tokens each window scores as a partial event as soon as its pass ends ({sequence, start, "
    "end, token_ids, tokens, logprobs, top?}: tokens start..end-1 of the text, each scored given those before it), "
    "in order within each text; a text's first token, which nothing scores, is in none. The result still holds them all."
)


class LogprobsParams(WindowParams, forbid_unknown_fields=True):
    prompts: Annotated[list[str], msgspec.Meta(min_length=1, description="Texts to score, tokenised as prompts are.")] | None = None
    token_ids: Annotated[
        list[Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=1)]],
        msgspec.Meta(min_length=1, description="Token id sequences to score as they are, instead of prompts."),
    ] | None = None
    top: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP, description="The most likely tokens to list at each position.")] = 0
    next_token: Annotated[bool, msgspec.Meta(description="Also the greedy token after each text, with its log-probability.")] = False
    file: Annotated[ScoresFile, msgspec.Meta(description=FILE_DOC)] | None = None
    partials: Annotated[bool, msgspec.Meta(description=PARTIALS_DOC)] = False


class TokenLogprob(msgspec.Struct):
    id: int
    text: str
    logprob: float


class Scored(msgspec.Struct, omit_defaults=True):
    """One text: its tokens, each token's log-probability given those before it (null for the
    first), the `top` alternatives at each position (from the second), and the next token."""

    token_ids: list[int] | None = None
    tokens: list[str] | None = None
    logprobs: list[float | None] | None = None
    """None (as its ids and tokens) when the scores are in the result's file."""
    length: int | None = None
    """With file: its tokens, a line each in the file."""
    top: list[list[TokenLogprob]] | None = None
    next_token: TokenLogprob | None = None
    next_top: list[TokenLogprob] | None = None  # the `top` alternatives at the next token's position
    plan: WindowPlan | None = None
    """With window: the windows, in the text's own tokens; each token scored in the first that holds it."""


class LogprobsPartial(msgspec.Struct, omit_defaults=True):
    """With partials: the tokens one window scored, as soon as its pass ends."""

    sequence: int
    start: int
    end: int
    token_ids: list[int]
    tokens: list[str]
    logprobs: list[float]
    top: list[list[TokenLogprob]] | None = None


class LogprobsResult(msgspec.Struct, omit_defaults=True):
    sequences: list[Scored]
    files: list[ResultFile] | None = None
    """With file: the file holding every token's score."""


class _Line(msgspec.Struct, omit_defaults=True):
    """A token's line of a JSONL scores file."""

    sequence: int
    position: int
    token_id: int
    token: str
    logprob: float | None
    top: list[TokenLogprob] | None = None


def rows(model: Model, params: LogprobsParams) -> list[list[int]]:
    if params.token_ids is not None:
        return params.token_ids
    bounded = params.window is None
    return [model.encode(text, f"prompts[{i}]", bounded=bounded) for i, text in enumerate(params.prompts or [])]


def _own(model: Model, params: LogprobsParams, ids: list[int]) -> list[int]:
    """The positions of a text's own tokens: token ids are scored as given, every one its own."""
    return model.own(ids) if params.token_ids is None else list(range(len(ids)))


def check(model: Model, params: LogprobsParams) -> None:
    if (params.prompts is None) == (params.token_ids is None):
        raise ParamError("prompts", "give prompts (text) or token_ids, one of the two")
    field = "prompts" if params.prompts is not None else "token_ids"
    windows.resolve(params, model.context_length)  # window-only params without a window
    with windows.naming_window():
        texts = rows(model, params)
    for i, ids in enumerate(texts):
        if params.token_ids is not None and (bad := next((t for t in ids if t >= model.vocab_size), None)) is not None:
            raise ParamError(f"token_ids[{i}]", f"token id {bad} is not below the vocabulary size {model.vocab_size}")
        if params.window is not None:
            Strided(model, params, ids, _own(model, params, ids), f"{field}[{i}]")
            continue
        with windows.naming_window():
            model.fit(len(ids), f"{field}[{i}]")
    if params.partials and params.window is None:
        raise ParamError("partials", "a partial event is the tokens a window scored: only with window")
    if params.partials and params.file is not None:
        raise ParamError("partials", "not with file: the scores go into the file")
    if params.file is ScoresFile.TSV and params.top:
        raise ParamError("top", "a TSV file holds one score a token: use file jsonl for the top tokens")


def cost(model: Model, params: LogprobsParams) -> Cost:
    """The pass with the last block's states kept, one readout chunk's logits, and the tokens scored."""
    shape = Shape.of(model)
    texts = rows(model, params)
    lengths = [len(ids) for ids in texts]
    positions = sum(lengths)
    passes = [(len(lengths), max(lengths))]
    counted = positions
    if params.window is not None:
        cut = [Strided(model, params, ids, _own(model, params, ids), "prompts") for ids in texts]
        widest = max(len(row) for text in cut for row in text.rows)
        passes = [(max(1, min(PASS_TOKENS // widest, windows.PASS_ROWS, sum(len(text.rows) for text in cut))), widest)]
        counted = sum(len(row) for text in cut for row in text.rows)
    rows_, width = passes[0]
    # A model without a layer stack gives its logits at every position at once.
    read = min(positions, readout_rows(model)) if model.has(Capability.LAYERS) else positions
    per_token = 8 + JSON_TOKEN + JSON_FLOAT + params.top * (JSON_ENTRY + JSON_TOKEN)
    result = positions * per_token
    memory = shape.block_bytes(rows_, width) + shape.states_bytes(rows_, width, 1)
    held = memory + shape.logits_bytes(read) + positions * (8 + 4 + PY_FLOAT + params.top * (12 + PY_ENTRY))
    inline = Cost(
        memory=held + result,
        result=result,
        memory_field="window" if params.window is not None else ("prompts" if params.prompts is not None else "token_ids"),
        result_field="top" if params.top else ("prompts" if params.prompts is not None else "token_ids"),
        tokens=width,
        counted=counted,
        # Its checkpoint keeps each text's or window's `_Scores` (six tensors): two ids and two floats a
        # position, and its top.
        journal=(sum(len(text.rows) for text in cut) if params.window is not None else len(lengths)) * 3 * JOURNAL_PIECE
        + positions * (24 + params.top * 12),
    )
    # As a file: a line per token (its numbers, its text, escaped), formatted a block of lines at a
    # time; the JSON keeps each text's length, plan and next token.
    fmt = ScoresFile(params.file) if params.file is not None else ScoresFile.JSONL if params.top else ScoresFile.TSV
    line = 3 * 8 + JSON_TOKEN + JSON_FLOAT + (48 + params.top * (JSON_ENTRY + JSON_TOKEN) if fmt is ScoresFile.JSONL else 4)
    small = JSON_FRAME * (len(lengths) + 1) + (2 * JSON_FLOAT * sum(len(text.rows) for text in cut) if params.window is not None else 0)
    written = dataclasses.replace(
        inline, memory=held + small + min(positions, FILE_LINES) * line, result=small, result_field=inline.memory_field,
        files=positions * line + 128,
    )
    if params.file is not None:
        return written
    if params.partials:  # every score is in the job's log too (its partial events) until it ends; never a file
        return dataclasses.replace(inline, memory=inline.memory + result)
    return dataclasses.replace(inline, as_files=written, file_format=fmt.value)


class _Scores(NamedTuple):
    """An item's scores (a whole text, or the positions a window reads, from `start` on), on the CPU: at
    each position t, the token t + 1 it scores and its log-probability, the greedy token and its
    log-probability, and the job's `top`."""

    start: int
    length: int  # the text's tokens: the read at its last position scores the next token
    scored: torch.Tensor
    own: torch.Tensor
    best: torch.Tensor
    best_logprob: torch.Tensor
    top_ids: torch.Tensor | None
    top_values: torch.Tensor | None


def _plan(model: Model, jobs: list[LogprobsParams], ctxs: Any = None) -> list[Chunk]:
    # Every whole text of every job in the first right-padded pass, as one pass ran them; windows in
    # passes of at most PASS_TOKENS padded tokens, in order.
    passes = windows.ReadPasses(PASS_TOKENS)
    for job, params in enumerate(jobs):
        for i, ids in enumerate(rows(model, params)):
            targets = torch.tensor([*ids[1:], 0])  # position t scores token t + 1; the last, the next token
            if params.window is None:
                passes.whole((job, i), ids, torch.arange(len(ids)), targets, 0, len(ids))
                continue
            cut = Strided(model, params, ids, _own(model, params, ids), f"prompts[{i}]")
            for w, (row, (start, end)) in enumerate(zip(cut.rows, cut.spans())):
                passes.window((job, WindowItem(i, w)), row, torch.arange(start, end) - cut.cut[w][0], targets[start:end], start, len(ids))
    return passes.chunks()


def _run(model: Model, jobs: list[LogprobsParams], chunk: Chunk) -> list[_Scores]:
    input_ids, mask, at_rows, at_cols, scored, counts = windows.read_pass(model, chunk)
    k = max(jobs[job].top for job, _ in chunk.items)  # one top-k for the pass, as deep as its deepest job asks
    own, best, best_lp, top_ids, top_values = [], [], [], [], []
    for part, logits in readout_chunks(model, input_ids, mask, at_rows, at_cols):
        logprobs = logits.log_softmax(dim=-1)
        own.append(logprobs.gather(1, scored[part, None])[:, 0])
        greedy = logprobs.argmax(dim=-1)
        best.append(greedy)
        best_lp.append(logprobs.gather(1, greedy[:, None])[:, 0])
        if k:
            top = logprobs.topk(k, dim=-1)
            top_ids.append(top.indices)
            top_values.append(top.values)
    # Each item's share, a tensor of its own: one kept in a checkpoint pickles its numbers, not the pass's.
    pieces = [
        [piece.clone() for piece in torch.cat(parts).cpu().split(counts)] if parts else [None] * len(counts)
        for parts in (own, best, best_lp, top_ids, top_values)
    ]
    out = []
    for key, o, b, blp, ti, tv in zip(chunk.items, *pieces):
        _, tokens, start, length = chunk.extra[windows.READS][key]
        top = jobs[key[0]].top
        out.append(_Scores(
            int(start), int(length), tokens.to(torch.int32), o.float(), b, blp.float(), ti[:, :top] if top else None, tv[:, :top].float() if top else None,
        ))
    return out


def _assemble(model: Model, jobs: list[LogprobsParams], outputs: dict[Any, _Scores], ctxs: Sequence[Context]) -> list[LogprobsResult]:
    results = []
    for job, (params, ctx) in enumerate(zip(jobs, ctxs)):
        entries = []
        out = _ScoresFile(ctx, params.file) if params.file is not None else None
        for i, ids in enumerate(rows(model, params)):
            if params.window is None:
                plan, scores = None, outputs[job, i]
            else:
                plan = Strided(model, params, ids, _own(model, params, ids), f"prompts[{i}]").plan
                pieces = [outputs[job, WindowItem(i, w)] for w in range(len(plan.windows))]
                scores = _Scores(0, len(ids), *(None if parts[0] is None else torch.cat(parts) for parts in list(zip(*pieces))[2:]))
            entries.append(_scored(model, params, ids, scores, plan, i, out))
        results.append(LogprobsResult(entries, files=[out.close()] if out is not None else None))
    return results


def _scored(model: Model, params: LogprobsParams, ids: list[int], scores: _Scores, plan: WindowPlan | None, i: int, out: _ScoresFile | None) -> Scored:
    """A text's entry: its scores inline, or written into the job's file a block of lines at a time."""
    n = len(ids)
    wanted = [*ids, int(scores.best[-1]), *(scores.top_ids.flatten().tolist() if params.top else ())]
    texts = model.token_texts(wanted)

    def alternatives(start: int, end: int) -> list[list[TokenLogprob]]:
        assert scores.top_ids is not None and scores.top_values is not None
        values = floats(scores.top_values[start:end])
        return [[TokenLogprob(t, texts[t], v) for t, v in zip(ids_, vs)] for ids_, vs in zip(scores.top_ids[start:end].tolist(), values)]

    if out is not None:
        entry = Scored(length=n, plan=plan)
        for start in range(0, n, FILE_LINES):
            # Token t is scored at the position before it, t - 1: the first token has nothing before it.
            stop = min(n, start + FILE_LINES)
            before, first = (start - 1, []) if start else (0, [None])
            tops = [*first, *alternatives(before, stop - 1)] if params.top else []
            out.write(i, start, ids[start:stop], texts, [*first, *floats(scores.own[before : stop - 1])], tops)
    else:
        entry = Scored(token_ids=list(ids), tokens=[texts[t] for t in ids], logprobs=[None, *floats(scores.own[: n - 1])], plan=plan)
        if params.top:
            entry.top = alternatives(0, n - 1)
    if params.next_token:
        best = int(scores.best[-1])
        entry.next_token = TokenLogprob(best, texts[best], floats(scores.best_logprob[-1:])[0])
        if params.top:
            entry.next_top = alternatives(n - 1, n)[0]
    return entry


class _ScoresFile:
    """A job's scores, a line per token, written a block of lines at a time (`file`)."""

    def __init__(self, ctx: Context, fmt: ScoresFile | str) -> None:
        self.format = ScoresFile(fmt)
        self.name = f"logprobs.{self.format.value}"
        self.file: IO[bytes] = ctx.file(self.name)
        if self.format is ScoresFile.TSV:
            self.file.write(b"sequence\tposition\ttoken_id\ttoken\tlogprob\n")

    def write(self, sequence: int, start: int, ids: list[int], texts: dict[int, str], logprobs: list[float | None], top: list[Any]) -> None:
        """Text `sequence`'s tokens from position `start`: their ids, scores and (jsonl) top alternatives, one a token."""
        if self.format is ScoresFile.JSONL:
            lines = [
                _Line(sequence, start + k, t, texts[t], lp, top[k] if top else None) for k, (t, lp) in enumerate(zip(ids, logprobs))
            ]
            self.file.write(b"\n".join(msgspec.json.encode(line) for line in lines) + b"\n")
            return
        self.file.write(
            "".join(
                f"{sequence}\t{start + k}\t{t}\t{_escaped(texts[t])}\t{'' if lp is None else repr(lp)}\n"
                for k, (t, lp) in enumerate(zip(ids, logprobs))
            ).encode()
        )

    def close(self) -> ResultFile:
        self.file.flush()
        size = self.file.tell()
        self.file.close()
        return ResultFile(self.name, self.format.value, size)


def _escaped(token: str) -> str:
    return token.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _partial(model: Model, params: LogprobsParams, item: Any, scores: _Scores) -> LogprobsPartial | None:
    """The tokens a window scored, as a partial event (`partials`): position t scores token t + 1,
    and a window's last read past the text is the next token, which is in the result only."""
    if not params.partials or not isinstance(item, WindowItem):
        return None
    count = min(len(scores.own), scores.length - 1 - scores.start)
    ids = scores.scored[:count].tolist()
    texts = model.token_texts(ids + (scores.top_ids[:count].flatten().tolist() if scores.top_ids is not None else []))
    partial = LogprobsPartial(
        item.item, scores.start + 1, scores.start + 1 + count, ids, [texts[t] for t in ids], floats(scores.own[:count]),
    )
    if scores.top_ids is not None and scores.top_values is not None:
        partial.top = [
            [TokenLogprob(t, texts[t], v) for t, v in zip(ts, vs)]
            for ts, vs in zip(scores.top_ids[:count].tolist(), floats(scores.top_values[:count]))
        ]
    return partial


# A pass a step: the whole texts, or a pass of windows; each kept in the job's checkpoint, so that
# a job whose engine died goes on from its last pass.
work = Chunked(
    plan=_plan, run=_run, assemble=_assemble, unit="sequences", resumable=lambda params: True, partial=each_item(_partial),
    whole=lambda params: params.partials,
)


@tool(
    check=check,
    cost=cost,
    caps={"prompts": "max_prompts", "token_ids": "max_prompts"},
    sequences=("prompts",),
    batch=work.batch,
    spread=work,
    needs={Capability.NEXT_TOKEN},
    partial=LogprobsPartial,
)
def logprobs(model: Model, params: LogprobsParams, ctx: Context) -> LogprobsResult:
    """Each token's log-probability given the tokens before it, with the top alternatives and the next greedy token if asked."""
    return work.many(model, [params], [ctx])[0]
