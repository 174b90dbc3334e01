"""How a generation batch keeps its rows' contexts between tokens: the decoders `generate` steps.

Three ways, the fastest a model's proven capabilities allow (`decoder_for`), each
giving the same tokens: a transformers KV cache, left-padded so that rows of any
length decode together and join a running batch (`KVCache`); a custom model's own
incremental state (`ModelState`); or every row's whole context run again each token
(`Recompute`). They belong to the model, not to a tool: the model's load probes one
(gateway/models/causal_lm.py) before `generate` (gateway/tools/generate.py) or
`sae_steer` uses it.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch
from transformers.cache_utils import DynamicLayer

from gateway.models.base import Capability, Kind, Model, right_padded


class Decoder(Protocol):
    """How a generation batch keeps its rows' contexts between tokens."""

    @property
    def mergeable(self) -> bool:
        """True while new rows can join the rows decoding."""

    def prefill(self, rows: list[list[int]], share: bool = True, columns: int | None = None) -> torch.Tensor:
        """Take new rows (their prompts) after those there are; their next-token logits (rows × vocab).
        `share`: rows of one prompt may share its pass (False where a pass treats each row its own way);
        `columns`: at most this many columns of them a pass, where the decoder runs them in pieces."""

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed each row its next token; the next-token logits of every row."""

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows, in this order."""


def decoder_for(model: Model) -> Decoder:
    """The fastest decoder the model's capabilities allow; each gives the same tokens."""
    if not model.has(Capability.INCREMENTAL):
        return Recompute(model)
    if model.kind is Kind.CUSTOM:
        return ModelState(model)
    return KVCache(model)


# Prompt tokens a prefill runs at once (rows × columns), at most: a longer one goes in pieces.
PREFILL_TOKENS = 4096


def prefill_columns(rows: int, width: int) -> int:
    """How many columns of a `rows`-row prefill run at once."""
    return width if rows * width <= PREFILL_TOKENS else max(1, PREFILL_TOKENS // rows)


class KVCache:
    """A transformers KV cache, left-padded so that rows of any length decode together.

    Merging left-pads the shorter cache; the attention mask hides the padding
    and each row's position ids count only its own tokens, so a row computes
    what it would alone. While no row is padded (a lone job, prompts of one
    length, or once the longer rows have left) there is no mask: the model runs
    as a plain decoding loop runs it, without the mask's per-step growth and
    its check by transformers. A prompt several new rows share is run once and
    its cache copied to each. Caches other than plain dynamic ones
    (sliding-window layers) cannot be padded that way: with them new jobs wait
    for the batch to empty.
    """

    def __init__(self, model: Model) -> None:
        self.model = model
        self.cache: Any = None
        self.rows = 0
        self.length = 0  # cached tokens per row, padding included
        # Both None while no row is padded; else the mask is (rows, length + 1), the +1 for the
        # pending token, and the positions (rows, 1), the pending token's position in its row.
        self.mask: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.mergeable = True

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.mask is None:
            out = self.model.module(input_ids=tokens[:, None], cache=self.cache, use_cache=True)
        else:
            assert self.positions is not None
            out = self.model.module(
                input_ids=tokens[:, None],
                attention_mask=self.mask,
                position_ids=self.positions,
                cache=self.cache,
                use_cache=True,
            )
            self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
            self.positions = self.positions + 1
        self.cache = out.cache
        self.length += 1
        return out.logits[:, -1, :]

    def prefill(self, rows: list[list[int]], share: bool = True, columns: int | None = None) -> torch.Tensor:
        # A prompt sent by several rows (`n` completions of it, clients asking the same) is run
        # once: its rows take copies of its cache and logits, which are what each would compute.
        first: dict[tuple[int, ...], int] = {}
        of = [first.setdefault(tuple(ids), len(first)) for ids in rows]
        if not share or len(first) == len(rows):
            return self._prefill(rows, columns=columns)
        return self._prefill([list(ids) for ids in first], copies=torch.tensor(of, device=self.model.device), columns=columns)

    def _prefill(self, rows: list[list[int]], copies: torch.Tensor | None = None, columns: int | None = None) -> torch.Tensor:
        """Run `rows`' prompts and take them in; with `copies`, rows `copies[i]` are taken in as row i."""
        # Left padding: every prompt ends at the last column, where its next token is read.
        width = max(len(ids) for ids in rows)
        device = self.model.device
        padded = any(len(ids) < width for ids in rows)
        pad = self.model.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in rows], device=device)
        keep: dict[str, Any] = {"logits_to_keep": 1} if _keeps_logits(self.model) else {}
        mask = positions = None
        if padded:
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows], device=device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # A long prefill in pieces of columns, each attending to the cache of those before it: one
        # piece's activations and attention are held at a time, not the whole prompt's.
        step = min(columns or width, prefill_columns(len(rows), width))
        cache: Any = None
        for start in range(0, width, step):
            end = min(start + step, width)
            extra = dict(keep)
            if mask is not None and positions is not None:
                extra |= {"attention_mask": mask[:, :end], "position_ids": positions[:, start:end]}
            out = self.model.module(input_ids=input_ids[:, start:end], cache=cache, use_cache=True, **extra)
            cache = out.cache
        logits = out.logits[:, -1, :]
        if copies is not None:
            cache.batch_select_indices(copies)
            logits = logits[copies]
            rows = [rows[i] for i in copies.tolist()]
            if mask is not None and positions is not None:
                mask, positions = mask[copies], positions[copies]
        if self.cache is None:
            self.cache, self.rows, self.length = cache, len(rows), width
            if mask is not None and positions is not None:
                self.mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
                self.positions = positions[:, -1:] + 1
            self.mergeable = _paddable(self.cache)
        else:
            self._merge(cache, rows, width)
        return logits

    def _merge(self, cache: Any, rows: list[list[int]], width: int) -> None:
        device = self.model.device
        lengths = torch.tensor([len(ids) for ids in rows], device=device)
        # The new rows' mask and positions: each prompt at the right end, then its pending token.
        mask = (torch.arange(width + 1, device=device)[None, :] >= width - lengths[:, None]).long()
        positions = lengths[:, None]
        ours_mask, ours_positions = self.mask, self.positions
        if ours_mask is None or ours_positions is None:  # no row padded: every column is a token
            ours_mask = torch.ones((self.rows, self.length + 1), dtype=torch.long, device=device)
            ours_positions = torch.full((self.rows, 1), self.length, dtype=torch.long, device=device)
        total = max(self.length, width)
        ours, theirs = total - self.length, total - width
        for mine, new in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, ours), _left_pad(new.keys, theirs)])
            mine.values = torch.cat([_left_pad(mine.values, ours), _left_pad(new.values, theirs)])
        self.mask = torch.cat([_left_pad(ours_mask, ours, dim=1), _left_pad(mask, theirs, dim=1)])
        self.positions = torch.cat([ours_positions, positions])
        self.rows, self.length = self.rows + len(rows), total
        self._unpad()

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows; drop cache columns that are padding in every row left."""
        index = torch.tensor(rows, device=self.model.device)
        self.cache.batch_select_indices(index)
        self.rows = len(rows)
        if self.mask is None or self.positions is None:
            return
        self.mask, self.positions = self.mask[index], self.positions[index]
        if self.mergeable:
            unused = int(self.mask.any(dim=0).long().argmax())
            if unused:
                for layer in self.cache.layers:
                    layer.keys, layer.values = layer.keys[..., unused:, :], layer.values[..., unused:, :]
                self.mask = self.mask[:, unused:]
                self.length -= unused
        self._unpad()

    def _unpad(self) -> None:
        """Drop the mask once no row is padded (every row's positions then count every column)."""
        if self.mask is not None and bool(self.mask.all()):
            self.mask = self.positions = None


def _keeps_logits(model: Model) -> bool:
    """Whether the model's forward takes `logits_to_keep` (transformers' causal LMs): a prefill
    then computes the head's logits for the last position only, not for the whole prompt."""
    if "logits_to_keep" not in model.memo:
        try:
            model.memo["logits_to_keep"] = "logits_to_keep" in inspect.signature(model.module.forward).parameters
        except (TypeError, ValueError):
            model.memo["logits_to_keep"] = False
    return bool(model.memo["logits_to_keep"])


class ModelState:
    """A custom model's own incremental state (`start`, `step`, `select`; gateway/models/custom.py).

    The state is the model's: rows leave through its `select`, but new rows
    cannot be merged into it, so jobs join only a batch that is empty.
    """

    def __init__(self, model: Model) -> None:
        self.model = model
        self.state: Any = None

    @property
    def mergeable(self) -> bool:
        return self.state is None

    def prefill(self, rows: list[list[int]], share: bool = True, columns: int | None = None) -> torch.Tensor:
        assert self.state is None, "a custom model's state takes rows only when empty"
        logits, self.state = self.model.module.start(rows)
        return logits

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        logits, self.state = self.model.module.step(self.state, tokens)
        return logits

    def keep(self, rows: list[int]) -> None:
        self.state = self.model.module.select(self.state, torch.tensor(rows, device=self.model.device))


class Recompute:
    """Every row's whole context, run again each token: for a model with no incremental step.

    Slower by the context's length, and exactly what the model computes:
    rows are right-padded and each row's next token is read at its own last
    position.
    """

    mergeable = True

    def __init__(self, model: Model) -> None:
        self.model = model
        self.rows: list[list[int]] = []

    def _last_logits(self, rows: list[list[int]]) -> torch.Tensor:
        input_ids, mask = right_padded(self.model, rows)
        logits = self.model.logits(input_ids, mask)
        last = torch.tensor([len(ids) - 1 for ids in rows], device=logits.device)
        return logits[torch.arange(len(rows), device=logits.device), last]

    def prefill(self, rows: list[list[int]], share: bool = True, columns: int | None = None) -> torch.Tensor:
        self.rows.extend(list(ids) for ids in rows)
        return self._last_logits(rows)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        for ids, token in zip(self.rows, tokens.tolist()):
            ids.append(token)
        return self._last_logits(self.rows)

    def keep(self, rows: list[int]) -> None:
        self.rows = [self.rows[i] for i in rows]


def _paddable(cache: Any) -> bool:
    """A cache whose layers are plain key/value tensors, which left padding leaves correct."""
    return all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None]))


def _left_pad(t: torch.Tensor, n: int, dim: int = -2) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)
