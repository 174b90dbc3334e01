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
run in passes of at most `PASS_TOKENS` tokens.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import IO, Annotated, Any

import msgspec
import torch

from gateway.cost import JSON_ENTRY, JSON_FLOAT, JSON_FRAME, JSON_TOKEN, PY_ENTRY, PY_FLOAT, Cost, Shape
from gateway.errors import ParamError
from gateway.protocol import ResultFile
from gateway.models.anatomy import readout_chunks, readout_rows
from gateway.tools.base import Capability, Context, Model, right_padded, tool
from gateway.tools.batching import one_pass
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


class LogprobsParams(WindowParams, forbid_unknown_fields=True):
    prompts: Annotated[list[str], msgspec.Meta(min_length=1, description="Texts to score, tokenised as prompts are.")] | None = None
    token_ids: Annotated[
        list[Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=1)]],
        msgspec.Meta(min_length=1, description="Token id sequences to score as they are, instead of prompts."),
    ] | None = None
    top: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP, description="The most likely tokens to list at each position.")] = 0
    next_token: Annotated[bool, msgspec.Meta(description="Also the greedy token after each text, with its log-probability.")] = False
    file: Annotated[ScoresFile, msgspec.Meta(description=FILE_DOC)] | None = None


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
    if params.file is ScoresFile.TSV and params.top:
        raise ParamError("top", "a TSV file holds one score a token: use file jsonl for the top tokens")


def cost(model: Model, params: LogprobsParams) -> Cost:
    """The pass with the last block's states kept, one readout chunk's logits, and the tokens scored."""
    shape = Shape.of(model)
    texts = rows(model, params)
    lengths = [len(ids) for ids in texts]
    positions = sum(lengths)
    passes = [(len(lengths), max(lengths))]
    if params.window is not None:
        cut = [Strided(model, params, ids, _own(model, params, ids), "prompts") for ids in texts]
        widest = max(len(row) for text in cut for row in text.rows)
        passes = [(max(1, min(PASS_TOKENS // widest, sum(len(text.rows) for text in cut))), widest)]
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
    return dataclasses.replace(inline, as_files=written, file_format=fmt.value)


def _logprobs_many(model: Model, jobs: list[LogprobsParams], ctxs: list[Context]) -> list[LogprobsResult]:
    # Every text of every job in right-padded forward passes (one, unless windows make more), read
    # out a chunk of positions at a time. Each position t of a text reads the logits of one
    # (row, column): they score token t + 1, and at the text's last position, the next token.
    per_job = [rows(model, params) for params in jobs]
    passes = windows.Passes(PASS_TOKENS)
    reads: list[tuple[int, int, int, int]] = []  # (pass, row, column, token scored), text after text
    plans: list[WindowPlan | None] = []
    for job, params in zip(per_job, jobs):
        for i, ids in enumerate(job):
            targets = [*ids[1:], 0]
            if params.window is None:
                placed = passes.whole(ids)
                reads += [(*placed, t, targets[t]) for t in range(len(ids))]
                plans.append(None)
                continue
            cut = Strided(model, params, ids, _own(model, params, ids), f"prompts[{i}]")
            in_passes = [passes.window(window) for window in cut.rows]
            reads += [(*in_passes[w], col, targets[t]) for t, (w, col) in enumerate(cut.reads)]
            plans.append(cut.plan)
    k = max(params.top for params in jobs)  # one top-k for every position, as deep as the deepest job asks
    own_parts, best_parts, best_lp_parts, top_id_parts, top_value_parts = [], [], [], [], []
    order: list[int] = []  # the reads in the order they are computed
    by_pass: list[list[int]] = [[] for _ in passes.rows]
    for r, read in enumerate(reads):
        by_pass[read[0]].append(r)
    for pass_rows, mine in zip(passes.rows, by_pass):
        if not pass_rows:
            continue
        input_ids, mask = right_padded(model, pass_rows)
        device = input_ids.device
        order += mine
        at_rows = torch.tensor([reads[r][1] for r in mine], device=device)
        at_cols = torch.tensor([reads[r][2] for r in mine], device=device)
        scored = torch.tensor([reads[r][3] for r in mine], device=device)
        for part, logits in readout_chunks(model, input_ids, mask, at_rows, at_cols):
            logprobs = logits.log_softmax(dim=-1)
            own_parts.append(logprobs.gather(1, scored[part, None])[:, 0])
            best = logprobs.argmax(dim=-1)
            best_parts.append(best)
            best_lp_parts.append(logprobs.gather(1, best[:, None])[:, 0])
            if k:
                top = logprobs.topk(k, dim=-1)
                top_id_parts.append(top.indices)
                top_value_parts.append(top.values)
    # Back in the reads' order (text after text, position after position).
    back = torch.empty(len(order), dtype=torch.long)
    back[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    back = back.to(own_parts[0].device)
    own = floats(torch.cat(own_parts)[back])
    best_ids = torch.cat(best_parts)[back].tolist()
    best_logprobs = floats(torch.cat(best_lp_parts)[back])
    top_ids: list[Any] = torch.cat(top_id_parts)[back].tolist() if k else []
    top_values: Any = torch.cat(top_value_parts)[back].cpu() if k else None
    flat = [ids for job in per_job for ids in job]
    texts = model.token_texts([*(t for ids in flat for t in ids), *best_ids, *(i for position in top_ids for i in position)])

    def alternatives(start: int, end: int, top: int) -> list[list[TokenLogprob]]:
        values = floats(top_values[start:end, :top])
        return [[TokenLogprob(i, texts[i], v) for i, v in zip(ids[:top], vs)] for ids, vs in zip(top_ids[start:end], values)]

    results, at = [], 0  # `at`: the first position of the text at hand, in the flat order
    text_plans = iter(plans)
    for job, params, ctx in zip(per_job, jobs, ctxs):
        entries = []
        out = _ScoresFile(ctx, params.file) if params.file is not None else None
        for i, ids in enumerate(job):
            n = len(ids)
            last = at + n - 1
            if out is not None:
                entry = Scored(length=n, plan=next(text_plans))
                for start in range(0, n, FILE_LINES):
                    # Token t is scored at the position before it, t - 1: the first token has nothing before it.
                    stop = min(n, start + FILE_LINES)
                    before, first = (at + start - 1, []) if start else (at, [None])
                    tops = [*first, *alternatives(before, at + stop - 1, params.top)] if params.top else []
                    out.write(i, start, ids[start:stop], texts, [*first, *own[before : at + stop - 1]], tops)
            else:
                entry = Scored(
                    token_ids=list(ids), tokens=[texts[t] for t in ids], logprobs=[None, *own[at:last]], plan=next(text_plans)
                )
                if params.top:
                    entry.top = alternatives(at, last, params.top)
            if params.next_token:
                entry.next_token = TokenLogprob(best_ids[last], texts[best_ids[last]], best_logprobs[last])
                if params.top:
                    entry.next_top = alternatives(last, last + 1, params.top)[0]
            entries.append(entry)
            at += n
        ctx.progress(len(job), len(job), "sequences")
        results.append(LogprobsResult(entries, files=[out.close()] if out is not None else None))
    return results


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


@tool(
    check=check,
    cost=cost,
    caps={"prompts": "max_prompts", "token_ids": "max_prompts"},
    sequences=("prompts",),
    batch=one_pass(_logprobs_many),
    needs={Capability.NEXT_TOKEN},
)
def logprobs(model: Model, params: LogprobsParams, ctx: Context) -> LogprobsResult:
    """Each token's log-probability given the tokens before it, with the top alternatives and the next greedy token if asked."""
    return _logprobs_many(model, [params], [ctx])[0]
