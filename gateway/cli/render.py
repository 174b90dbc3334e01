"""Terminal views of tool results, for `streamgate run`.

The result itself always goes to stdout as JSON; these views are for a person
at a terminal and go to stderr after it: the lens as a layer × position table
of top tokens, predictions as bars, patching as a table of effects. Tools
without a view print nothing extra.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from typing import Any

CELL = 10  # characters per table column
BAR = 30  # characters of a full bar


def view(tool: str, result: Any) -> str | None:
    """A text view of `result`, or None if the tool has none or the result is not the expected shape."""
    render = VIEWS.get(tool)
    if render is None or not isinstance(result, dict):
        return None
    try:
        return render(result)
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _clip(text: str, width: int = CELL - 1) -> str:
    # Tokens often start with a space, or are one: make it visible.
    text = text.replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t")
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(
    columns: Sequence[str], rows: Sequence[tuple[str, Sequence[str]]], corner: str = "layer"
) -> str:
    """Rows of cells under column headers; keeps the last columns that fit the terminal."""
    fit = max(1, (shutil.get_terminal_size((120, 40)).columns - CELL) // CELL)
    first = max(0, len(columns) - fit)
    lines = [f"{corner:>{CELL - 2}}  " + "".join(f"{_clip(c):<{CELL}}" for c in columns[first:])]
    for label, cells in rows:
        lines.append(f"{label:>{CELL - 2}}  " + "".join(f"{_clip(c):<{CELL}}" for c in cells[first:]))
    if first:
        lines.append(f"({first} earlier positions not shown)")
    return "\n".join(lines)


def _bar(value: float, top: float) -> str:
    n = 0 if top <= 0 else round(BAR * max(0.0, value) / top)
    return "█" * n


def logit_lens(result: dict[str, Any]) -> str:
    tokens = [result["tokens"][p] for p in result["positions"]]
    rows = [
        (str(layer), [f"{cell[0]['text']}" for cell in per_position])
        for layer, per_position in zip(result["layers"], result["topk"])
    ]
    return "Top token at each layer (rows) and position (columns):\n" + _table(tokens, rows)


def lens_grid(result: dict[str, Any]) -> str:
    rows = [
        (str(layer), [f"{tok}" if result["stat"] != "probability" else f"{tok} {v:.0%}" for tok, v in zip(tops, values)])
        for layer, tops, values in zip(result["layers"], result["top_tokens"], result["values"])
    ]
    return f"Top token and {result['stat']} of the final prediction:\n" + _table(result["tokens"], rows)


def lens_line(result: dict[str, Any]) -> str:
    values = result["values"]
    top = max(values) if values else 0
    lines = [f"{result['stat']} of {result['token']!r} at position {result['position']}, by layer:"]
    lines += [f"{layer:>5}  {v:10.4g}  {_bar(v, top)}" for layer, v in zip(result["layers"], values)]
    return "\n".join(lines)


def predict(result: dict[str, Any]) -> str:
    preds = result["predictions"]
    top = max((p["prob"] for p in preds), default=0)
    return "\n".join(f"{_clip(repr(p['text']), 14):>14}  {p['prob']:7.2%}  {_bar(p['prob'], top)}" for p in preds)


def activation_patching(result: dict[str, Any]) -> str:
    rows = [
        (str(layer), [f"{d:+.3f}" for d in diffs]) for layer, diffs in zip(result["layers"], result["prob_diff"])
    ]
    head = (
        f"Change in p({', '.join(map(repr, result['target_tokens']))}) when patching "
        f"(clean {result['clean_prob']:.3f}, source {result['source_prob']:.3f}):\n"
    )
    return head + _table(result["labels"], rows)


def embed(result: dict[str, Any]) -> str:
    n = len(result["embeddings"])
    return f"{n} embedding{'s' * (n != 1)} of dimension {result['dim']} from hidden state {result['layer']} ({result['pooling']} pooling)"


def loglikelihood(result: dict[str, Any]) -> str:
    return "\n".join(
        f"{i:>3}  ll {ll:10.4f}  {'greedy' if g else ''}" for i, (ll, g) in enumerate(zip(result["ll"], result["is_greedy"]))
    )


VIEWS: dict[str, Callable[[dict[str, Any]], str]] = {
    "logit_lens": logit_lens,
    "lens_grid": lens_grid,
    "lens_line": lens_line,
    "predict": predict,
    "activation_patching": activation_patching,
    "embed": embed,
    "loglikelihood": loglikelihood,
}
