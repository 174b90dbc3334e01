"""Where a causal LM keeps its residual stream: its decoder layers, final norm and unembedding.

The interpretability tools need three things from any model: the list of
decoder blocks (to read or overwrite each block's output, the residual stream),
the final norm, and the unembedding, so that `logits(h)` turns any layer's
residual stream into next-token logits exactly as the model does at its last
layer. They are found from the model itself rather than from a table of
families:

- the unembedding is `get_output_embeddings()`;
- the decoder blocks are the `ModuleList` holding `num_hidden_layers` modules;
- the final norm is the last norm-like module of the base model outside the
  blocks (`norm`, `ln_f`, `final_layer_norm`, … whatever its name);
- a final logit soft-cap (`final_logit_softcapping`, Gemma 2 and later) is
  applied when the config has one.

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
from gateway.tools.base import Model


class ModelShapeError(Exception):
    """The model's layers, norm or unembedding could not be found."""


@dataclass(eq=False)
class Anatomy:
    layers: nn.ModuleList
    final_norm: nn.Module | None
    unembed: nn.Module
    softcap: float | None = None

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits (float32) from residual-stream vectors of any layer."""
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        logits = self.unembed(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

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
    """The model's anatomy, found once and kept on the `Model`."""
    if "anatomy" not in model.memo:
        model.memo["anatomy"] = find(model.module)
    return model.memo["anatomy"]


def find(module: nn.Module) -> Anatomy:
    config = module.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers = next(
        (getattr(text_config, k) for k in ("num_hidden_layers", "n_layer", "num_layers") if getattr(text_config, k, None)),
        None,
    )
    unembed = module.get_output_embeddings()
    if unembed is None:
        raise ModelShapeError("the model has no output embeddings (is it a causal LM?)")
    lists = [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) > 0 and (n_layers is None or len(m) == n_layers)
    ]
    if not lists:
        raise ModelShapeError(f"no list of {n_layers} decoder layers found in the model")
    # The shallowest such list is the decoder stack (deeper ones live inside blocks).
    layers_name, layers = min(lists, key=lambda item: item[0].count("."))
    parent_name = layers_name.rpartition(".")[0]
    parent = module.get_submodule(parent_name) if parent_name else module
    norms = [
        m
        for name, m in parent.named_children()
        if m is not layers and _is_norm(name, m)
    ]
    softcap = getattr(text_config, "final_logit_softcapping", None)
    return Anatomy(layers=layers, final_norm=norms[-1] if norms else None, unembed=unembed, softcap=softcap)


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
