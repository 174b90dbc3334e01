"""Proving a loaded model's capabilities on its own weights, before it serves a job.

A class name says what a model should do; a probe shows what it does. Each
probe runs the model on a few tokens at load time (milliseconds) and either
grants a capability or records, in words, why it is missing:

- `next_token`: the logits at a position do not change when a later token
  does (an encoder loaded with a causal-LM head fails here);
- `incremental`: one step on a cache (or the model's own state) gives the
  logits of the whole sequence run again;
- `hidden_states`: the model returns one tensor per layer and one for the
  embeddings;
- `layers`: the blocks and readout found for the lens reproduce the model's
  own logits from its last block's output;
- `masked_lm`: the tokenizer has a mask token and the head scores every
  position over the vocabulary;
- `chat`: the tokenizer has a chat template, and it renders a conversation
  (`generate`'s `messages`) into tokens.

So a tool either computes what the model computes, or is refused with the
reason (`gateway/models/capabilities.py`): never a silently wrong number.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from gateway.models.base import Capability, Model

log = logging.getLogger("streamgate.model")

PROBE_TOKENS = 6


def probe_ids(model: Model) -> list[int]:
    """A few ordinary tokens of the vocabulary, framed as the tokenizer frames a text."""
    ordinary = [i for i in range(min(model.vocab_size, 512)) if i not in model.special_ids and i != model.mask_token_id]
    ids = ordinary[len(ordinary) // 3 :][:PROBE_TOKENS] or list(range(min(model.vocab_size, PROBE_TOKENS)))
    build = getattr(model.tokenizer, "build_inputs_with_special_tokens", None)
    return list(build(ids)) if build is not None else ids


def close(a: torch.Tensor, b: torch.Tensor, dtype: Any) -> bool:
    # The same computation in another order: float32 agrees to rounding, half precision less closely.
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    a, b = a.float(), b.float()
    return bool(torch.allclose(a, b, atol=tol * max(1.0, float(b.abs().max())), rtol=tol))


def batch(model: Model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.tensor([ids], device=model.device)
    return input_ids, torch.ones_like(input_ids)


def causal(model: Model, ids: list[int]) -> str | None:
    """None if the logits are causal; else why not."""
    first = model.logits(*batch(model, ids))
    changed = list(ids)
    changed[-1] = next(t for t in probe_ids(model) + list(range(model.vocab_size)) if t != ids[-1])
    second = model.logits(*batch(model, changed))
    if not close(first[0, :-1], second[0, :-1], model.dtype):
        return "its logits at a position change with the tokens after it, so they are not next-token predictions"
    return None


def chat(model: Model) -> str | None:
    """None if the tokenizer's chat template renders a conversation, and control tokens typed
    in a message stay text; else why not."""
    if not getattr(model.tokenizer, "chat_template", None):
        return "its tokenizer has no chat template; send prompts as plain text"
    special = sorted(set(model.tokenizer.all_special_tokens))
    try:
        plain = model.encode_chat([{"role": "user", "content": "Hello"}])
        forged = model.encode_chat([{"role": "user", "content": "Hello" + "".join(special)}])
    except Exception as exc:
        return f"its chat template cannot render a conversation: {type(exc).__name__}: {exc}"
    specials = set(model.tokenizer.all_special_ids)
    if sum(t in specials for t in forged) != sum(t in specials for t in plain):
        return "control tokens typed in a message become control tokens, so a message could forge another turn"
    return None


def hidden_states(model: Model, ids: list[int]) -> str | None:
    """None if the model returns a hidden state per token for each layer (how many is kept for `embed`); else why not."""
    try:
        states = model.hidden_states(*batch(model, ids))
    except Exception as exc:  # a model whose forward has no hidden states
        return f"asking it for hidden states fails: {type(exc).__name__}: {exc}"
    if not states or any(not isinstance(s, torch.Tensor) or s.shape[:2] != (1, len(ids)) for s in states):
        return "it returns no hidden state per token for each layer"
    model.memo["n_states"] = len(states)
    return None


def bidirectional(model: Model) -> bool:
    """True if the first position's last hidden state changes with the last token: every position sees all."""
    ids = probe_ids(model)
    changed = list(ids)
    changed[-1] = next(t for t in range(model.vocab_size) if t != ids[-1] and t not in model.special_ids)
    with torch.inference_mode():
        first = model.hidden_states(*batch(model, ids))[-1][0, 0]
        second = model.hidden_states(*batch(model, changed))[-1][0, 0]
    return not close(first, second, model.dtype)


def layers(model: Model, ids: list[int], find: Callable[[], Any]) -> str | None:
    """Find the blocks and readout (`find()`), check them, and keep them on the model; else why not."""
    from gateway.models.anatomy import ModelShapeError

    try:
        body = find()
    except ModelShapeError as exc:
        return str(exc)
    if not len(body.layers):
        return "it has no blocks"
    with body.capture([body.n_layers - 1]) as captured:
        want = model.logits(*batch(model, ids))
    if body.n_layers - 1 not in captured:
        return "its blocks did not run in its forward pass"
    try:
        got = body.logits(captured[body.n_layers - 1])
    except Exception as exc:
        return f"its readout ({body.path}) cannot read a block's output: {type(exc).__name__}: {exc}"
    if got.shape != want.shape or not close(got, want, model.dtype):
        return f"the readout found ({body.path}) does not reproduce its own logits from its last block"
    model.memo["anatomy"] = body
    model.memo["layer_width"] = int(captured[body.n_layers - 1].shape[-1])
    return None


def incremental(model: Model, ids: list[int], step: Callable[[list[int]], torch.Tensor]) -> str | None:
    """None if `step(ids)` (the last token's logits, computed incrementally) equals the full pass; else why not."""
    try:
        got = step(ids)
    except Exception as exc:
        return f"its incremental step fails: {type(exc).__name__}: {exc}"
    want = model.logits(*batch(model, ids))[0, -1]
    if got.shape != want.shape or not close(got, want, model.dtype):
        return "its incremental step does not give the logits of the whole sequence"
    return None


def prove(model: Model, claimed: dict[Capability, Callable[[list[int]], str | None]]) -> None:
    """Run each claimed capability's probe; set `model.capabilities` and, for the rest, `model.missing`."""
    ids = probe_ids(model)
    have: set[Capability] = set()
    with torch.inference_mode():
        for capability, probe in claimed.items():
            try:
                reason = probe(ids)
            except Exception as exc:  # a probe that crashes proves nothing
                reason = f"checking it failed: {type(exc).__name__}: {exc}"
            if reason is None:
                have.add(capability)
            else:
                model.missing[capability] = reason
                log.info("model %s: no %s: %s", model.name, capability.meaning, reason)
    model.capabilities = frozenset(have)
