"""Where a model keeps its residual stream: its layer stack, and the readout from it to logits.

The interpretability tools need two things from any model: the list of its
blocks (to read or overwrite each block's output, the residual stream), and
the readout that turns any layer's residual stream into logits exactly as the
model does after its last layer. For a transformers model they are found from
the model itself rather than from a table of families:

- the blocks are the `ModuleList` holding `num_hidden_layers` modules;
- after the blocks, the module holding them may apply a final norm (`norm`,
  `ln_f`, `final_layer_norm`, … whatever its name) and a projection
  (`project_out`, OPT-350m's smaller word-embedding width);
- then the head: the model's top-level child that holds its output
  embeddings, whole, so that a head with a transform before its decoder (a
  masked LM's dense + norm, BERT's and ESM's) is applied too;
- then a final logit soft-cap (`final_logit_softcapping`, Gemma 2 and later)
  when the config has one.

A readout found this way is trusted only once it reproduces the model's own
logits from its last layer on the loaded weights (`gateway/models/probes.py`);
a model where it does not, or that has no head or no single list of blocks,
lacks the `layers` capability and the tools that need it are refused.
A custom model (`gateway/models/custom.py`) gives its blocks and readout itself.

Reading and writing go through forward hooks on the blocks, so they see the
same tensors the model computes with, whatever the family's forward looks like.
A pass that needs no logits ends after the deepest block it reads (the rest,
and the head's matmul over every position, are not run), and one that needs
logits at a few positions only (`logits_at`) sends just those through the
readout. The readout comes in two parts where it splits, the final norm and
projection row by row, then the head, so the lens norms each layer as its
block finishes and unembeds every row in one matmul.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gateway.errors import ParamError
from gateway.models.base import Capability, Model


class ModelShapeError(Exception):
    """The model's layers or readout could not be found, or do not reproduce its output."""


class _Deep(Exception):
    """Raised after the deepest block a pass needs: the blocks after it, and the head, are not run."""


# Logits per readout matmul at most (64 MB in float32): rows × vocabulary, whatever the vocabulary.
READOUT_FLOATS = 1 << 24


@dataclass(eq=False)
class Anatomy:
    layers: Sequence[nn.Module]
    readout: Callable[[torch.Tensor], torch.Tensor]
    # The modules the readout applies, in order, for messages ("model.norm → lm_head").
    path: str = ""
    # The readout in its two parts, where it has them (a transformers model's): `prepare`, the
    # final norm and projection (row by row, cheap), and `head`, the unembedding and soft-cap
    # (the costly matmul). readout(h) == head(prepare(h)); a custom model's readout is whole.
    prepare: Callable[[torch.Tensor], torch.Tensor] | None = None
    head: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (float32) from residual-stream vectors of any layer, as the model's last layer gives them."""
        return self.readout(hidden).float()

    def prepared(self, hidden: torch.Tensor) -> torch.Tensor:
        """Residual-stream vectors through the readout's first part, ready for `unembed`."""
        return self.prepare(hidden) if self.prepare is not None and self.head is not None else hidden

    def unembed(self, prepared: torch.Tensor) -> torch.Tensor:
        """Logits (float32) of vectors from `prepared`: the head alone, or the whole readout where it is one."""
        whole = self.prepare is None or self.head is None
        return (self.readout if whole else self.head)(prepared).float()

    @contextlib.contextmanager
    def capture(
        self,
        layers: Sequence[int],
        check: Callable[[], None] | None = None,
        keep: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
        stop: bool = False,
    ) -> Iterator[dict[int, torch.Tensor]]:
        """Record the output of each block in `layers` during the forward passes inside.

        `check` runs after every block (e.g. to raise `Cancelled` between layers).
        `keep(layer, output)` says what to record of a block's output (default: all of it).
        `stop` ends the forward pass once every layer is recorded: a pass that needs no
        logits skips the blocks after the deepest and the head (the pass returns nothing).
        """
        wanted = set(layers)
        deepest = max(wanted, default=-1)
        captured: dict[int, torch.Tensor] = {}

        def hook(index: int) -> Callable[..., None]:
            def record(module: nn.Module, args: object, output: object) -> None:
                if index in wanted:
                    hidden = _hidden(output).detach()
                    captured[index] = keep(index, hidden) if keep is not None else hidden
                if check is not None:
                    check()
                if stop and index == deepest and wanted <= captured.keys():
                    raise _Deep()

            return record

        handles = [block.register_forward_hook(hook(i)) for i, block in enumerate(self.layers)]
        try:
            yield captured
        except _Deep:
            pass
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def overwrite(self, layer: int, write: Callable[[torch.Tensor], None]) -> Iterator[None]:
        """Let `write(hidden)` change block `layer`'s output in place during the passes inside."""

        def hook(module: nn.Module, args: object, output: object) -> None:
            write(_hidden(output))

        handle = self.layers[layer].register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()


def _hidden(output: object) -> torch.Tensor:
    # Blocks return the hidden states alone or first in a tuple, by family and version.
    return output if isinstance(output, torch.Tensor) else output[0]  # type: ignore[index]


def anatomy(model: Model) -> Anatomy:
    """The model's layer stack and readout, as its load proved them (the `layers` capability).

    Tools that call this state `needs=LAYERS`, so a model without it never gets here;
    the error is for a tool that forgot to.
    """
    found = model.memo.get("anatomy")
    if found is None or not model.has(Capability.LAYERS):
        raise ModelShapeError(model.missing.get(Capability.LAYERS, "the model has no layer stack and readout"))
    return found


def find(module: nn.Module) -> Anatomy:
    """The blocks and readout of a transformers model; `ModelShapeError` saying what is not there."""
    config = module.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers = next(
        (getattr(text_config, k) for k in ("num_hidden_layers", "n_layer", "num_layers") if getattr(text_config, k, None)),
        None,
    )
    unembed = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if unembed is None:
        raise ModelShapeError(f"{type(module).__name__} has no output head, so no layer can be read out as logits")
    lists = [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) > 0 and (n_layers is None or len(m) == n_layers)
    ]
    if not lists:
        raise ModelShapeError(f"its blocks are not one list of {n_layers} layers, so the residual stream cannot be read layer by layer")
    # The shallowest such list is the block stack (deeper ones live inside blocks).
    layers_name, layers = min(lists, key=lambda item: item[0].count("."))
    parent_name = layers_name.rpartition(".")[0]
    parent = module.get_submodule(parent_name) if parent_name else module
    children = [(name, m) for name, m in parent.named_children() if m is not layers]
    # After the blocks: the final norm, then a projection to the head's width (OPT's project_out).
    norms = [(name, m) for name, m in children if _is_norm(name, m)]
    after = norms[-1:] + [(name, m) for name, m in children if name == "project_out" and m is not None]
    head_name = next(
        (name for name, child in module.named_children() if any(m is unembed for m in child.modules())), None
    )
    if head_name is None or head_name == layers_name.split(".")[0]:
        # The output embeddings live inside the base model: nothing to read out with alone.
        raise ModelShapeError(f"the output head of {type(module).__name__} is not a module of its own")
    head = module.get_submodule(head_name)
    softcap = getattr(text_config, "final_logit_softcapping", None)
    steps = [m for _, m in after]

    def prepare(hidden: torch.Tensor) -> torch.Tensor:
        for step in steps:
            hidden = step(hidden)
        return hidden

    def unembed(hidden: torch.Tensor) -> torch.Tensor:
        hidden = head(hidden)
        if softcap:
            hidden = torch.tanh(hidden.float() / softcap) * softcap
        return hidden

    def readout(hidden: torch.Tensor) -> torch.Tensor:
        return unembed(prepare(hidden))

    names = [f"{parent_name}.{name}" if parent_name else name for name, _ in after] + [head_name]
    path = " → ".join(names + (["soft-cap"] if softcap else []))
    return Anatomy(layers=layers, readout=readout, path=path, prepare=prepare, head=unembed)


def _is_norm(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or "norm" in type(module).__name__.lower() or name in ("ln_f", "norm_f")


def resolve_layers(model: Model, layers: Sequence[int] | None, field: str = "layers") -> list[int]:
    """Layer indices, negatives counted from the end; all layers when None. 422 when out of range."""
    n = anatomy(model).n_layers
    if layers is None:
        return list(range(n))
    out = []
    for i, layer in enumerate(layers):
        if not -n <= layer < n:
            raise ParamError(f"{field}[{i}]", f"layer {layer} is out of range; the model has {n} layers (0..{n - 1}, or -{n}..-1)")
        out.append(layer % n)
    return out


def resolve_positions(n_tokens: int, positions: Sequence[int] | None, field: str = "positions") -> list[int]:
    """Token positions, negatives counted from the end; all positions when None. 422 when past the prompt."""
    if positions is None:
        return list(range(n_tokens))
    out = []
    for i, pos in enumerate(positions):
        if not -n_tokens <= pos < n_tokens:
            raise ParamError(f"{field}[{i}]", f"position {pos} is past the prompt, which has {n_tokens} tokens")
        out.append(pos % n_tokens)
    return out


def single_token(model: Model, text: str, field: str) -> int:
    """The id of the one token `text` stands for; 422 if it is not exactly one token."""
    ids = model.encode_continuation(text)
    if len(ids) != 1:
        got = "no tokens" if not ids else f"{len(ids)} tokens {[model.token_text(i) for i in ids]}"
        raise ParamError(field, f"{text!r} must be exactly one token of the model's vocabulary; it is {got}")
    return ids[0]


def readout_rows(model: Model) -> int:
    """Rows per readout matmul: as many as keep its logits within READOUT_FLOATS."""
    return max(1, READOUT_FLOATS // max(1, model.vocab_size))


def logits_at(model: Model, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: Any, cols: Any) -> torch.Tensor:
    """Float32 logits at (rows[i], cols[i]) of a padded batch, i × vocabulary.

    With a layer stack the pass stops after the last block and only these positions go
    through the final norm and head (its matmul over every position is a large part of a
    small model's work); without one, the model's own logits at these positions.
    For many positions, `readout_chunks` holds a few of them at a time.
    """
    (logits,) = (logits for _, logits in readout_chunks(model, input_ids, attention_mask, rows, cols, len(rows)))
    return logits


def readout_chunks(
    model: Model, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: Any, cols: Any, size: int | None = None
) -> Iterator[tuple[slice, torch.Tensor]]:
    """`logits_at`'s logits `size` positions at a time (default: as many as `readout_rows` allows), each
    chunk with the slice of (rows, cols) it covers: the full-vocabulary logits of every position are
    never held at once. A model without a layer stack gives its own logits, all of them (priced so).
    """
    size = max(1, size or readout_rows(model))
    n = len(rows)
    if not model.has(Capability.LAYERS):
        logits = model.logits(input_ids, attention_mask)
        for start in range(0, n, size):
            part = slice(start, min(start + size, n))
            yield part, logits[rows[part], cols[part]].float()
        return
    body = anatomy(model)
    last = body.n_layers - 1
    with body.capture([last], stop=True) as captured:
        model.logits(input_ids, attention_mask)
    for start in range(0, n, size):
        part = slice(start, min(start + size, n))
        yield part, body.logits(captured[last][rows[part], cols[part]])
