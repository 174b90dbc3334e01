"""Custom models: a model that is not a transformers class, served through `--model-loader`.

`streamgate serve --model-loader mypkg.models:load [--model PATH]` imports
`mypkg.models`, calls `load(source, device, dtype)` once per device (`source`
is `--model` as given, or None) and serves what it returns: an object with
the attributes and methods of `CustomModel` below. Only the first four are
required; each optional one, when present, is proven on the loaded weights
before it is used, like a transformers model's (`probes.py`):

- `step`: an incremental step with the model's own state (`start`, `step`,
  `select`), for fast generation. Without it, `generate` runs the whole
  context again for every token: slower, and the same tokens (in float32).
- `hidden_states`: the embeddings and each layer's output, for `embed`.
- `tags`: named prefixes (`{"bacteria": "|D__BACTERIA;...|"}`, as Evo2 tags a
  sequence with its organism's lineage) that a run picks with its `tag` param;
  per-position results leave the tag's tokens out.
- `alphabet`: the letters of its sequences (a DNA model's "ACGTN"): texts it is
  given as sequences are upper-cased, stripped of whitespace and checked against
  it (gateway/models/alphabet.py).
- `layers` and `readout`: the blocks whose outputs are the residual stream
  (forward hooks read and overwrite them) and the function from a block's
  output to logits, for the lens, activation patching and SAEs.

A custom model is a causal LM: its logits at position t score token t + 1.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from gateway.models import probes
from gateway.models.base import Capability, Kind, Model


class CustomModel(Protocol):
    """What a `--model-loader` function returns."""

    vocab_size: int
    context_length: int

    def tokenize(self, text: str) -> list[int]:
        """A text's token ids, without special tokens."""

    def detokenize(self, ids: list[int]) -> str:
        """The text of token ids."""

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(batch × tokens × vocab) for right-padded rows (mask 1 on real tokens); position t scores token t + 1."""


class Incremental(Protocol):
    """Optional: decoding one token at a time from the model's own state."""

    def start(self, rows: list[list[int]]) -> tuple[torch.Tensor, Any]:
        """Read each row's tokens (rows may differ in length); (each row's next-token logits, rows × vocab; the state)."""

    def step(self, state: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Feed each row one token (`tokens`: rows); (next-token logits, rows × vocab; the new state)."""

    def select(self, state: Any, rows: torch.Tensor) -> Any:
        """The state of these rows only, in this order (rows that ended leave)."""


class WithLayers(Protocol):
    """Optional: what the lens, patching and SAEs need."""

    layers: Sequence[torch.nn.Module]

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from a block's output, as the model computes them after its last block."""

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Sequence[torch.Tensor]:
        """The embeddings and each layer's output: layers + 1 tensors (batch × tokens × width)."""


class LoaderError(Exception):
    """The loader cannot be imported or called, or returned something that is not a model."""


class Custom(Model):
    """A `CustomModel` as tools see it: the same `Model`, tokens and passes from the user's object."""

    def _tokenize(self, text: str, special: bool) -> list[int]:
        ids = [int(t) for t in self.module.tokenize(text)]
        bos = getattr(self.module, "bos_token_id", None)
        return [bos, *ids] if special and bos is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self.module.detokenize([t for t in ids if t not in self.special_ids and t not in self.eos_token_ids])

    def token_text(self, token_id: int) -> str:
        return self.module.detokenize([token_id])

    def token_texts(self, ids: Iterable[int]) -> dict[int, str]:
        return {i: self.module.detokenize([i]) for i in dict.fromkeys(ids)}

    def logits(self, input_ids: Any, attention_mask: Any) -> Any:
        return self.module.logits(input_ids, attention_mask)

    def hidden_states(self, input_ids: Any, attention_mask: Any) -> tuple[Any, ...]:
        return tuple(self.module.hidden_states(input_ids, attention_mask))


def resolve(spec: str) -> Any:
    """The function `module:function` names."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise LoaderError(f"--model-loader {spec}: expected module:function (mypkg.models:load)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise LoaderError(f"--model-loader {spec}: cannot import {module_name}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise LoaderError(f"--model-loader {spec}: {module_name} has no function {attr}")
    return fn


def load(spec: str, source: str | None, device: str, dtype: torch.dtype) -> Model:
    """Call the loader, check what it returned, and prove its optional capabilities."""
    obj = resolve(spec)(source, torch.device(device), dtype)
    lacking = [name for name in ("vocab_size", "context_length", "tokenize", "detokenize", "logits") if not hasattr(obj, name)]
    if lacking:
        raise LoaderError(f"--model-loader {spec}: the model it returned has no {', '.join(lacking)} (see CustomModel)")
    if isinstance(obj, torch.nn.Module):
        obj.eval()
    bos = getattr(obj, "bos_token_id", None)
    eos = getattr(obj, "eos_token_ids", ()) or ()
    model = Custom(
        name=getattr(obj, "name", None) or spec.partition(":")[0].rpartition(".")[2],
        module=obj,
        tokenizer=None,
        device=torch.device(device),
        dtype=dtype,
        context_length=int(obj.context_length),
        eos_token_ids=frozenset(int(t) for t in eos),
        kind=Kind.CUSTOM,
        vocab_size=int(obj.vocab_size),
        pad_token_id=int(getattr(obj, "pad_token_id", 0) or 0),
        special_ids=frozenset([bos]) if bos is not None else frozenset(),
        alphabet=_alphabet(spec, getattr(obj, "alphabet", None)),
        tags=_tags(spec, getattr(obj, "tags", None)),
    )
    claimed: dict[Capability, Any] = {Capability.NEXT_TOKEN: lambda ids: probes.causal(model, ids)}
    if all(hasattr(obj, name) for name in ("start", "step", "select")):
        claimed[Capability.INCREMENTAL] = lambda ids: probes.incremental(model, ids, lambda ids: _stepped(model, ids))
    else:
        model.missing[Capability.INCREMENTAL] = "it has no start, step and select (generation recomputes the context)"
    if hasattr(obj, "hidden_states"):
        claimed[Capability.HIDDEN_STATES] = lambda ids: probes.hidden_states(model, ids)
    else:
        model.missing[Capability.HIDDEN_STATES] = "it has no hidden_states method"
    if hasattr(obj, "layers") and hasattr(obj, "readout"):
        claimed[Capability.LAYERS] = lambda ids: probes.layers(model, ids, lambda: _anatomy(obj))
    else:
        model.missing[Capability.LAYERS] = "it has no layers and readout"
    model.missing[Capability.MASKED_LM] = "a custom model is a causal LM"
    model.missing[Capability.CHAT] = "a custom model has no chat template; send prompts as plain text"
    probes.prove(model, claimed)
    return model


def _alphabet(spec: str, letters: Any) -> str | None:
    """A loader's `alphabet`: its sequences' letters, upper-case, each once."""
    if letters is None:
        return None
    if not isinstance(letters, str) or not letters or letters != letters.upper() or len(set(letters)) != len(letters):
        raise LoaderError(f"--model-loader {spec}: alphabet must be a string of distinct upper-case letters, got {letters!r}")
    return letters


def _tags(spec: str, tags: Any) -> dict[str, str]:
    """A loader's `tags`: names to the prefix text each puts before a sequence."""
    if tags is None:
        return {}
    if not isinstance(tags, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in tags.items()):
        raise LoaderError(f"--model-loader {spec}: tags must map names to prefix texts, got {tags!r}")
    return dict(tags)


def _stepped(model: Model, ids: list[int]) -> torch.Tensor:
    """The last token's logits through `start` on all but it, then one `step`: what `generate` does."""
    _, state = model.module.start([ids[:-1]])
    logits, _ = model.module.step(state, torch.tensor([ids[-1]], device=model.device))
    return logits[0]


def _anatomy(obj: Any) -> Any:
    from gateway.models.anatomy import Anatomy

    return Anatomy(layers=list(obj.layers), readout=obj.readout, path=f"{type(obj).__name__}.readout")
