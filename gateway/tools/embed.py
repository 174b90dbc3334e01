"""`embed`: hidden-state embeddings of texts (or protein and DNA sequences), pooled per text or per token.

Embeddings are returned as numpy arrays: clients get JSON numbers in
float32's shortest form, executors send the raw buffers (see `encoding.py`).

`layer` indexes the model's hidden states the way transformers numbers them
(`output_hidden_states=True`): 0 is the token embeddings, i ≥ 1 the output of
the i-th block (the lens tools' layer i − 1), and -1 the last, after the
model's final norm (and, where a model projects its output, OPT-350m, after
that: `dim` is always the length of the vectors returned).

Pooling reads a text's own tokens only: the special tokens the tokenizer adds
around it (`<cls>` and `<eos>` for ESM and BERT, a BOS for Llama) are left out
of `mean`, `last` and `per_token`, so a protein's mean embedding is the mean
over its residues. `cls` reads the first token, `<cls>`, where an encoder
gathers the whole sequence.

Texts are sorted by length into chunks of at most `EMBED_BATCH` texts and
`EMBED_TOKENS` padded tokens (padding stays small, and so does one pass's
memory) and run chunk by chunk, or on every device at once (`--devices`) for
one big job; each chunk needs about its rows × its longest text's tokens ×
hidden size × (layers + 1) × 4 bytes for the hidden states it returns, plus
the attention of one layer (`cost` prices the largest before the job is queued).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from gateway.encoding import to_json
from gateway.cost import JOURNAL_PIECE, JSON_FLOAT, JSON_FRAME, JSON_TOKEN, Cost, Shape
from gateway.errors import ParamError
from gateway.tools.base import Capability, Context, Model, right_padded, tool
from gateway.tools.files import file_bytes
from gateway.tools import windows
from gateway.tools.batching import SINKS, Chunk, Chunked, WindowItem, chunk_peak, each_item, sorted_chunks
from gateway.tools.windows import Framed, Share, Sizes, Stitch, WindowIds, WindowPlan
from gateway.tools.embed_files import EmbedFiles, file_arrays
from gateway.tools.embed_params import EmbedParams, EmbedPartial, EmbedResult, FileFormat, Pooling, as_array, is_per_token

EMBED_BATCH = 16  # texts per forward pass at most
EMBED_TOKENS = 16384  # padded tokens per forward pass at most (a longer text runs alone)


def _n_states(model: Model) -> int:
    return model.memo["n_states"]


def _framed(model: Model, text: str, field: str) -> Framed:
    ids = model.encode(text, field, bounded=False)
    return Framed.of(ids, model.own(ids), field)


def _sizes(model: Model, params: EmbedParams, framed: Framed) -> Sizes | None:
    return windows.resolve(params, model.context_length - framed.around, causal=not model.bidirectional)


def check(model: Model, params: EmbedParams) -> None:
    if params.part is not None:
        _check_part(params)
    if params.file is not None:
        _check_file(params)
    if params.partials:
        _check_partials(params)
    if params.window is not None:
        _check_windows(model, params)
        return
    windows.resolve(params, model.context_length)  # window-only params without a window
    with windows.naming_window():
        _check(model, params)


def _check_file(params: EmbedParams) -> None:
    if not is_per_token(Pooling(params.pooling)):
        raise ParamError("file", "files hold per-token vectors: use pooling per_token (a pooled result is one vector a text)")
    if params.precision is not None:
        raise ParamError("precision", "a file holds float32 as computed; leave out precision")
    if params.file is FileFormat.NPY and len(params.texts) > 1:
        raise ParamError("file", "an .npy file holds one array: npy takes one text; safetensors takes several")


def _check_part(params: EmbedParams) -> None:
    summed = params.stitch is not None and Stitch(params.stitch) is Stitch.MEAN and is_per_token(Pooling(params.pooling))
    windows.check_part(params, params.texts, "texts", summed)
    if params.file is not None:
        raise ParamError("part", "a part's vectors come back in its result, to be put together with the other parts': not with file")
    if params.partials:
        raise ParamError("part", "not with partials: the job's partial events are the whole's")


def _check_partials(params: EmbedParams) -> None:
    if params.window is None:
        raise ParamError("partials", "a partial event is a window's rows: only with window")
    if not is_per_token(Pooling(params.pooling)):
        raise ParamError("partials", "a partial event holds per-token vectors: use pooling per_token")
    if params.stitch is not None and Stitch(params.stitch) is Stitch.MEAN:
        raise ParamError("partials", "with stitch mean a position is final only once every window holding it is in: use center or left")
    if params.file is not None:
        raise ParamError("partials", "not with file: the rows go into the files, which progress counts by window")


def _check_windows(model: Model, params: EmbedParams) -> None:
    _check_layer(model, params)
    if params.pooling is Pooling.CLS:
        raise ParamError("pooling", "cls reads one window's first token; with windows use mean, last or per_token")
    for i, text in enumerate(params.texts):
        if not text:
            raise ParamError(f"texts[{i}]", "must not be empty")
        framed = _framed(model, text, f"texts[{i}]")
        sizes = _sizes(model, params, framed)
        assert sizes is not None
        windows.plan(len(framed.own), sizes)  # a plan of too many windows is refused here


def _check_layer(model: Model, params: EmbedParams) -> None:
    n = _n_states(model)
    if not -n <= params.layer < n:
        raise ParamError("layer", f"layer {params.layer} is out of range; the model has {n} hidden states (0..{n - 1}, or -{n}..-1)")
    if params.pooling is Pooling.CLS and not model.bidirectional:
        raise ParamError(
            "pooling",
            "cls reads the first token, which in a causal model sees nothing after it; use mean or last",
        )


def _check(model: Model, params: EmbedParams) -> None:
    _check_layer(model, params)
    for i, text in enumerate(params.texts):
        if not text:
            raise ParamError(f"texts[{i}]", "must not be empty")
        ids = model.encode(text, f"texts[{i}]")
        model.fit(len(ids), f"texts[{i}]")
        if params.pooling is not Pooling.CLS and not model.own(ids):
            raise ParamError(f"texts[{i}]", "has no tokens of its own, only the tokenizer's special tokens")


def cost(model: Model, params: EmbedParams) -> Cost:
    """The largest chunk's pass with every hidden state it returns, then the vectors kept and their JSON.
    With windows the passes are the windows', and a per-token result is held twice at the end (the
    windows' rows and the stitched array) with each position's context beside it in the JSON.
    Written as files (`file`), a per-token result is the files' bytes on disk, and in memory one
    window's rows at a time: the price is the largest pass's, whatever the length."""
    shape = Shape.of(model)
    per_token = is_per_token(params.pooling)
    planned = 0  # windows in the plans the result states
    if params.window is None:
        lengths = [len(model.encode(text)) for text in params.texts]
        passes, n_own, held = lengths, lengths, 1
        vectors = sum(n_own) if per_token else len(n_own)
        kept = vectors
    else:
        passes, n_own, sums = [], [], 0
        for i, text in enumerate(params.texts):
            framed = _framed(model, text, f"texts[{i}]")
            sizes = _sizes(model, params, framed)
            assert sizes is not None
            cut = windows.plan(len(framed.own), sizes)
            picked = windows.part_windows(params.part, len(cut))
            passes += [cut[w][1] - cut[w][0] + framed.around for w in picked]
            planned += len(cut)
            # Pooled: a vector a window until they are summed (with last, the last window's alone).
            sums += len(picked) if Pooling(params.pooling) is Pooling.MEAN else 1
            if params.part is not None and per_token:
                start, end = windows.span(windows.shares(cut, sizes.stitch), picked, len(framed.own))
                n_own.append(end - start)
            else:
                n_own.append(len(framed.own))
        held = 2 if per_token else 1
        vectors = sum(n_own) if per_token else len(n_own)  # a part's pooled: its sum, or the last vector
        kept = sum(n_own) if per_token else sums
    n_states = _n_states(model)
    peak = chunk_peak(passes, EMBED_BATCH, EMBED_TOKENS, lambda rows, width: shape.pass_bytes(rows, width, states=n_states))
    per_vector = shape.hidden * JSON_FLOAT + (JSON_TOKEN if per_token else 0)
    if params.window is not None and per_token:
        per_vector += 2 * JSON_FLOAT  # its [left, right] context
    result = vectors * per_vector + 2 * JSON_FLOAT * planned
    # Its checkpoint keeps each text's or window's output: a vector, or its rows with their ids
    # (a window's rows: its share, no longer than the window); a window's rows in files, a marker.
    journal = len(passes) * JOURNAL_PIECE
    inline = Cost(
        memory=peak + held * kept * shape.hidden * 4 + result,
        result=result,
        memory_field="window" if params.window is not None else "texts",
        result_field="pooling" if per_token else "texts",
        tokens=max(passes, default=0),
        counted=sum(passes),
        journal=journal + (sum(passes) * (shape.hidden * 4 + 8) if per_token else len(passes) * shape.hidden * 4),
    )
    if params.partials:
        # Each window's rows are in the job's log too (as partial events) until it ends; as
        # partial events they cannot be files either.
        return dataclasses.replace(inline, memory=inline.memory + result)
    if params.part is not None:
        return inline  # to be put together with the other parts': never files
    if not per_token or params.precision is not None:
        return inline
    # The plans' windows stay in the JSON (two numbers each), the rest is in the files.
    plans = JSON_FRAME * (len(n_own) + 1) + 2 * JSON_FLOAT * planned
    arrays = [array for i, n in enumerate(n_own) for array in file_arrays(i, n, shape.hidden, params.window is not None)]
    written = Cost(
        memory=peak + plans,
        result=plans,
        memory_field=inline.memory_field,
        result_field="texts",
        tokens=inline.tokens,
        counted=inline.counted,
        files=sum(file_bytes([a]) for a in arrays) if params.file is FileFormat.NPY else file_bytes(arrays),
        journal=journal,
    )
    if params.file is not None:
        return written
    return dataclasses.replace(inline, as_files=written, file_format=FileFormat.SAFETENSORS.value)


@dataclass(frozen=True)
class _InWindow:
    """A window's row of a chunk: where the text's own tokens begin in it, its share of the stitched
    text, and the text's length in own tokens."""

    head: int
    share: Share
    n: int


def _plan(model: Model, jobs: list[EmbedParams], ctxs: Any = None, by_length: bool = True) -> list[Chunk]:
    items: list[tuple[Any, list[int]]] = []
    placed: dict[Any, _InWindow] = {}
    sinks: dict[int, EmbedFiles] = {}
    for job, params in enumerate(jobs):
        if params.file is not None:
            lengths = [len(model.own(model.encode(text, bounded=False))) for text in params.texts]
            sinks[job] = EmbedFiles(ctxs[job], params, lengths)
        for i, text in enumerate(params.texts):
            if params.window is None:
                items.append(((job, i), model.encode(text)))
                continue
            framed = _framed(model, text, f"texts[{i}]")
            sizes = _sizes(model, params, framed)
            assert sizes is not None
            cut = windows.plan(len(framed.own), sizes)
            picked = windows.part_windows(params.part, len(cut))
            for w, ((start, end), share) in enumerate(zip(cut, windows.shares(cut, sizes.stitch))):
                if w not in picked:
                    continue
                key = (job, WindowItem(i, w))
                items.append((key, WindowIds(framed, start, end)))
                placed[key] = _InWindow(len(framed.head), share, len(framed.own))
    chunks = sorted_chunks(items, EMBED_BATCH, max_tokens=EMBED_TOKENS, by_length=by_length)
    for chunk in chunks:
        chunk.extra["windows"] = {key: placed[key] for key in chunk.items if key in placed}
        chunk.extra[SINKS] = {job: sinks[job] for job, _ in chunk.items if job in sinks}
    return chunks


def _run(model: Model, jobs: list[EmbedParams], chunk: Chunk) -> list[Any]:
    """Each text's vector(s); with per_token pooling, (vectors, its own token ids) for the tokens' texts.

    The rows of the chunk that ask for the same (layer, pooling, normalize, precision), one job's
    usually, are pooled together: their own tokens gathered in one index, and their vectors moved
    off the device in one copy.
    """
    n_states = _n_states(model)
    data = [row.ids() if isinstance(row, WindowIds) else row for row in chunk.data]
    input_ids, mask = right_padded(model, data)
    states = model.hidden_states(input_ids, mask)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for row, (job, _) in enumerate(chunk.items):
        params = jobs[job]
        # Pooling(…): params built in Python (not decoded) may hold the plain string.
        pooling = Pooling(params.pooling)
        pooling = Pooling.PER_TOKEN if is_per_token(pooling) else pooling
        groups.setdefault((params.layer % n_states, pooling, params.normalize, params.precision), []).append(row)
    out: list[Any] = [None] * len(chunk.items)
    owns: dict[int, list[int]] = {}  # each pooled row's own token positions (CLS reads none)
    in_windows = chunk.extra.get("windows", {})
    sinks: dict[int, EmbedFiles] = chunk.extra.get(SINKS, {})
    for row, key in enumerate(chunk.items):
        if key in in_windows:
            params = jobs[key[0]]
            shared = _window_share(states[params.layer % n_states][row], data[row], in_windows[key], Pooling(params.pooling))
            if key[0] in sinks:  # into the job's files now; nothing of it held
                assert shared.rows is not None
                sinks[key[0]].put(key[1].item, shared.start, shared.rows, shared.ids, summed=in_windows[key].share.weights is not None)
                out[row] = sinks[key[0]]
            else:
                out[row] = shared
    for (layer, pooling, normalize, precision), rows in groups.items():
        rows = [row for row in rows if chunk.items[row] not in in_windows]
        if not rows:
            continue
        device = states[layer].device
        if pooling is Pooling.CLS:
            vectors = states[layer][torch.tensor(rows, device=device), 0].float()
        else:
            owns.update((row, model.own(data[row])) for row in rows)
            counts = [len(owns[row]) for row in rows]
            index = (
                torch.tensor([row for row, n in zip(rows, counts) for _ in range(n)], device=device),
                torch.tensor([at for row in rows for at in owns[row]], device=device),
            )
            vectors = states[layer][index].float()  # every row's own tokens, row after row
            if pooling is Pooling.MEAN:
                vectors = torch.stack([own.mean(0) for own in vectors.split(counts)])
            elif pooling is Pooling.LAST:
                vectors = vectors[torch.tensor(counts, device=device).cumsum(0) - 1]
        if normalize:
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
        array = as_array(vectors, precision)
        if pooling is Pooling.PER_TOKEN:
            for row, part in zip(rows, np.split(array, np.cumsum(counts)[:-1])):
                ids = [data[row][at] for at in owns[row]]
                job, i = chunk.items[row]
                if job in sinks:  # normalized above, as whole texts are
                    sinks[job].put(i, 0, part, ids, summed=False, normalized=True)
                    out[row] = sinks[job]
                else:
                    out[row] = (part, ids)
        else:
            for row, vector in zip(rows, array):
                out[row] = vector
    return out


@dataclass(frozen=True)
class _Shared:
    """What one window gives its text: positions [start, end) of it; `rows` its (weighted) states
    there (per_token), their sum (mean), or the text's last position's (last; None if not its);
    `ids` the tokens at those positions."""

    start: int
    end: int
    rows: np.ndarray | None
    ids: list[int]


def _window_share(states: torch.Tensor, ids: list[int], at: _InWindow, pooling: Pooling) -> _Shared:
    """One window row's share of its text, off the device: only what the stitched result needs of it."""
    share = at.share
    begin = at.head + share.offset
    rows = states[begin : begin + share.end - share.start].float()
    if share.weights is not None:
        rows = rows * torch.from_numpy(share.weights).to(rows.device)[:, None]
    own = ids[begin : begin + share.end - share.start]
    if pooling is Pooling.MEAN:
        return _Shared(share.start, share.end, as_array(rows.sum(0), None), [])
    if pooling is Pooling.LAST:
        return _Shared(share.start, share.end, as_array(rows[-1], None) if share.end == at.n else None, [])
    return _Shared(share.start, share.end, as_array(rows, None), own)


def _stitched(params: EmbedParams, shared: list[_Shared], precision: int | None, start: int = 0) -> tuple[Any, list[int]]:
    """A windowed text's vector(s) from its windows' shares, and (per_token) its own token ids; the
    positions from `start` on (a part of the plan's)."""
    n = max(part.end for part in shared)
    pooling = Pooling(params.pooling)
    ids: list[int] = []
    if not is_per_token(pooling):
        return _pooled(params, [part.rows for part in shared if part.rows is not None], n), ids
    width = next(part.rows.shape[-1] for part in shared if part.rows is not None)
    vector = torch.zeros((n - start, width))
    ids = [0] * (n - start)
    for part in shared:
        assert part.rows is not None
        vector[part.start - start : part.end - start] += torch.from_numpy(part.rows)
        ids[part.start - start : part.end - start] = part.ids
    return _finished(params, vector, precision), ids


def _pooled(params: EmbedParams, sums: list[np.ndarray], n: int) -> np.ndarray:
    """A windowed text's pooled vector from its windows' sums (mean, over its `n` positions) or its last
    position's vector (last): in one place for a job run whole and one put together from parts."""
    total = np.sum(sums, axis=0)
    vector = torch.from_numpy(total / n if Pooling(params.pooling) is Pooling.MEAN else total)
    return _finished(params, vector, params.precision)


def _finished(params: EmbedParams, vector: torch.Tensor, precision: int | None) -> np.ndarray:
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return as_array(vector, precision)


def _assemble(model: Model, jobs: list[EmbedParams], outputs: dict[Any, Any], ctxs: Any = None) -> list[EmbedResult]:
    # A job writing files has its `EmbedFiles` as every item's output: its rows are in them already.
    sinks = {job: output for (job, _), output in outputs.items() if isinstance(output, EmbedFiles)}
    shared: dict[tuple[int, int], list[_Shared]] = {}
    for (job, item), output in outputs.items():
        if job in sinks:
            continue
        if isinstance(item, tuple):
            shared.setdefault((job, item[0]), []).append(output)
    for key, parts in shared.items():
        if jobs[key[0]].part is not None:
            continue  # `_part_result`
        outputs[key] = _stitched(jobs[key[0]], sorted(parts, key=lambda part: part.start), jobs[key[0]].precision)
        if not is_per_token(jobs[key[0]].pooling):
            outputs[key] = outputs[key][0]
    texts = model.token_texts(t for key, output in outputs.items() if not isinstance(key[1], tuple) and isinstance(output, tuple) for t in output[1])
    results = []
    for job, params in enumerate(jobs):
        if job in sinks:
            plans = _plans(model, params, context=False)[0] if params.window is not None else None
            files = sinks[job].close(plans)
            results.append(EmbedResult(dim=sinks[job].width, layer=params.layer % _n_states(model), pooling=params.pooling, plans=plans, files=files))
            continue
        if params.part is not None:
            results.append(_part_result(model, params, sorted(shared.get((job, 0), []), key=lambda part: part.start)))
            continue
        vectors = [outputs[job, i] for i in range(len(params.texts))]
        tokens = None
        if is_per_token(params.pooling):
            tokens = [[texts[t] for t in ids] for _, ids in vectors]
            vectors = [v for v, _ in vectors]
        plans = context = None
        if params.window is not None:
            plans, context = _plans(model, params, context=is_per_token(params.pooling))
        results.append(
            EmbedResult(
                dim=int(vectors[0].shape[-1]),
                layer=params.layer % _n_states(model),
                pooling=params.pooling,
                embeddings=vectors,
                tokens=tokens,
                plans=plans,
                context=context if is_per_token(params.pooling) else None,
            )
        )
    return results


def _part_result(model: Model, params: EmbedParams, shared: list[_Shared]) -> EmbedResult:
    """A part's result (`part`): the plan whole; its positions' vectors, tokens and context (per_token),
    or its windows' sums (pooled), as the whole would have them before they are put together (`_joined`)."""
    (plan,), _ = _plans(model, params, context=False)
    layer = params.layer % _n_states(model)
    if not is_per_token(Pooling(params.pooling)):
        rows = [part.rows for part in shared if part.rows is not None]
        total = np.sum(rows, axis=0) if rows else None
        return EmbedResult(dim=int(total.shape[-1]) if total is not None else 0, layer=layer, pooling=params.pooling, plans=[plan], sums=[total])
    n = plan.windows[-1][1]
    start, end = windows.span(windows.shares(plan.windows, plan.stitch), windows.part_windows(params.part, len(plan.windows)), n)
    if shared:
        vectors, ids = _stitched(params, shared, params.precision, start)
    else:
        vectors, ids = np.zeros((0, 0), dtype=np.float32), []
    texts = model.token_texts(ids)
    return EmbedResult(
        dim=int(vectors.shape[-1]),
        layer=layer,
        pooling=params.pooling,
        embeddings=[vectors],
        tokens=[[texts[t] for t in ids]],
        plans=[plan],
        context=[windows.context(plan.windows, plan.stitch, start, end)],
        span=[(start, end)],
    )


class _EmbedPart(msgspec.Struct):
    """A part's result as the gateway reads it to put the parts together: its values as the engine wrote them."""

    dim: int
    layer: int
    pooling: Pooling
    plans: list[msgspec.Raw]
    embeddings: list[list[msgspec.Raw]] | None = None
    tokens: list[list[msgspec.Raw]] | None = None
    context: list[list[msgspec.Raw]] | None = None
    span: list[tuple[int, int]] | None = None
    sums: list[list[float] | None] | None = None


def _joined(params: EmbedParams, results: list[bytes]) -> bytes:
    """The whole's result from its parts' (`part`: 0..count-1, in order): per-token rows, tokens and
    context put one after another, as written; a pooled vector from every window's sum, as one engine
    sums them. Raises ValueError where the parts do not make one whole."""
    parts = [msgspec.json.decode(result, type=_EmbedPart) for result in results]
    first = parts[0]
    if any(bytes(part.plans[0]) != bytes(first.plans[0]) or part.layer != first.layer for part in parts):
        raise ValueError("the parts disagree on the plan")
    plan = msgspec.json.decode(first.plans[0], type=WindowPlan)
    n = plan.windows[-1][1]
    dim = max(part.dim for part in parts)
    if not is_per_token(Pooling(params.pooling)):
        sums = [np.asarray(vector, dtype=np.float32) for part in parts for vector in (part.sums or [None])[:1] if vector is not None]
        if not sums:
            raise ValueError("no part holds the text's vectors")
        return to_json(EmbedResult(dim=dim, layer=first.layer, pooling=params.pooling, embeddings=[_pooled(params, sums, n)], plans=[first.plans[0]]))  # type: ignore[list-item]
    spans = [(part.span or [(0, 0)])[0] for part in parts]
    if spans[0][0] != 0 or spans[-1][1] != n or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        raise ValueError(f"the parts' positions {spans} do not cover the text's {n} one after another")

    def joined(field: str) -> list[list[msgspec.Raw]]:
        values = [value for part in parts for value in (getattr(part, field) or [[]])[0]]
        if len(values) != n:
            raise ValueError(f"the parts hold {len(values)} of the text's {n} positions' {field}")
        return [values]

    whole = EmbedResult(
        dim=dim, layer=first.layer, pooling=params.pooling, embeddings=joined("embeddings"), tokens=joined("tokens"),  # type: ignore[arg-type]
        plans=[first.plans[0]], context=joined("context"),  # type: ignore[list-item]
    )
    return to_json(whole)


def _plans(model: Model, params: EmbedParams, context: bool = True) -> tuple[list[WindowPlan], list[Any]]:
    """Each text's window plan, and (`context`) each own token's least context on each side."""
    plans: list[WindowPlan] = []
    least: list[Any] = []
    for i, text in enumerate(params.texts):
        framed = _framed(model, text, f"texts[{i}]")
        sizes = _sizes(model, params, framed)
        assert sizes is not None
        cut = windows.plan(len(framed.own), sizes)
        plans.append(WindowPlan(windows=cut, stitch=sizes.stitch, window=sizes.window, overlap=sizes.overlap))
        least.append(windows.context(cut, sizes.stitch) if context else None)
    return plans, least


def _partial(model: Model, params: EmbedParams, item: Any, output: Any) -> EmbedPartial | None:
    """A window's share of its text as a partial event (`partials`), as the result will hold it."""
    if not params.partials or not isinstance(output, _Shared) or output.rows is None:
        return None
    rows = torch.from_numpy(output.rows)
    if params.normalize:
        rows = torch.nn.functional.normalize(rows, dim=-1)
    texts = model.token_texts(output.ids)
    return EmbedPartial(item.item, output.start, output.end, as_array(rows, params.precision), [texts[t] for t in output.ids])


def _by_windows(params: EmbedParams, context_length: int | None) -> int:
    """The most parts a one-text job may be cut into over engines by its window plan (`part`): none
    for one that is a part already, one whose values leave as files or partial events, or one where a
    position's vector is summed over windows (`mean` per token), which two parts would each hold a
    share of."""
    if params.window is None or params.part is not None or len(params.texts) != 1 or params.file is not None or params.partials:
        return 0
    if is_per_token(Pooling(params.pooling)) and params.stitch is not None and Stitch(params.stitch) is Stitch.MEAN:
        return 0
    return windows.most_windows(params, params.texts[0], context_length)


def _resumable(params: EmbedParams) -> bool:
    """Rows a window adds into a file (`mean`) would be added twice by a chunk run again after its
    run died mid-way; every other output is final as a chunk gives it (a window's share, written
    at its place)."""
    return not (params.file is not None and params.stitch is not None and Stitch(params.stitch) is Stitch.MEAN)


# Per text, a pass over its tokens: its length is its share of the work.
work = Chunked(
    plan=_plan,
    run=_run,
    assemble=_assemble,
    unit="texts",
    items="texts",
    per_item=("embeddings", "tokens", "plans", "context"),
    resumable=_resumable,
    partial=each_item(_partial),
    whole=lambda params: params.partials,  # a part's partial events would number its texts from 0
    by_windows=_by_windows,
    join=_joined,
)


@tool(
    check=check,
    cost=cost,
    caps={"texts": "max_sequences"},
    sequences=("texts",),
    batch=work.batch,
    spread=work,
    needs={Capability.HIDDEN_STATES},
    partial=EmbedPartial,
)
def embed(model: Model, params: EmbedParams, ctx: Context) -> EmbedResult:
    """Hidden-state embeddings of each text at one layer: mean over its own tokens, cls, last, or per token."""
    return work.many(model, [params], [ctx])[0]
