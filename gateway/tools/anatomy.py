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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gateway.errors import ParamError
from gateway.models.base import Capability, Model


class ModelShapeError(Exception):
    """The model's layers or readout could not be found, or do not reproduce its output."""


@dataclass(eq=False)
class Anatomy:
    layers: Sequence[nn.Module]
    readout: Callable[[torch.Tensor], torch.Tensor]
    # The modules the readout applies, in order, for messages ("model.norm → lm_head").
    path: str = ""

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (float32) from residual-stream vectors of any layer, as the model's last layer gives them."""
        return self.readout(hidden).float()

    @contextlib.contextmanager
    def capture(
        self, layers: Sequence[int], check: Callable[[], None] | None = None
    ) -> Iterator[dict[int, torch.Tensor]]:
        """Record the output of each block in `layers` during the forward passes inside.

        `check` runs after every block (e.g. to raise `Cancelled` between layers).
        """
        wanted = set(layers)
        captured: dict[int, torch.Tensor] = {}

        def hook(index: int) -> Callable[..., None]:
            def record(module: nn.Module, args: object, output: object) -> None:
                if index in wanted:
                    captured[index] = _hidden(output).detach()
                if check is not None:
                    check()

            return record

        handles = [block.register_forward_hook(hook(i)) for i, block in enumerate(self.layers)]
        try:
            yield captured
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
    steps = [m for _, m in after] + [head]

    def readout(hidden: torch.Tensor) -> torch.Tensor:
        for step in steps:
            hidden = step(hidden)
        if softcap:
            hidden = torch.tanh(hidden.float() / softcap) * softcap
        return hidden

    names = [f"{parent_name}.{name}" if parent_name else name for name, _ in after] + [head_name]
    return Anatomy(layers=layers, readout=readout, path=" → ".join(names + (["soft-cap"] if softcap else [])))


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
