"""Causal language models (Llama, GPT-2, Qwen, Gemma, OPT, …): next-token logits, a KV cache, layers.

Loaded with `AutoModelForCausalLM`. Each capability is proven on the loaded
weights (`probes.py`): the logits must be causal, one cached step must equal
the whole sequence run again (else `generate` recomputes each token's
context: slower, the same tokens), and the lens's readout must reproduce the
model's own logits (else the lens and patching are refused with the reason).
"""

from __future__ import annotations

import torch

from gateway.models import huggingface, probes
from gateway.models.base import Capability, Kind, Model


def load(name: str, source: str, device: str, dtype: torch.dtype, trust_remote_code: bool = False) -> Model:
    from transformers import AutoModelForCausalLM

    from gateway.models.anatomy import find

    model = huggingface.load(name, source, Kind.CAUSAL_LM, AutoModelForCausalLM, device, dtype, trust_remote_code)
    probes.prove(
        model,
        {
            Capability.NEXT_TOKEN: lambda ids: probes.causal(model, ids),
            Capability.INCREMENTAL: lambda ids: cache_as_generate_uses_it(model, ids),
            Capability.HIDDEN_STATES: lambda ids: probes.hidden_states(model, ids),
            Capability.LAYERS: lambda ids: probes.layers(model, ids, lambda: find(model.module)),
            Capability.CHAT: lambda ids: probes.chat(model),
        },
    )
    model.missing[Capability.MASKED_LM] = "a causal LM predicts the next token; it has no masked-LM head"
    return model


def cache_as_generate_uses_it(model: Model, ids: list[int]) -> str | None:
    """None if `generate`'s KV cache (left padding, position ids, rows leaving) gives each row's
    full-pass logits; else why not (then `generate` recomputes the context instead)."""
    from gateway.models.decoders import KVCache

    long, short = ids, ids[: max(2, len(ids) // 2)]
    extra = long[1]
    try:
        cache = KVCache(model)
        cache.prefill([long[:-1], short[:-1]])  # rows of two lengths: the short one left-padded
        got = [cache.decode(torch.tensor([long[-1], short[-1]], device=model.device))]
        cache.keep([1])  # the long row leaves, as a finished job does
        got.append(cache.decode(torch.tensor([extra], device=model.device)))
    except Exception as exc:
        return f"its cache cannot be used to decode a batch: {type(exc).__name__}: {exc}"
    pairs = [(got[0][0], long), (got[0][1], short), (got[1][0], short + [extra])]
    for logits, row in pairs:
        want = model.logits(*probes.batch(model, row))[0, -1]
        if not probes.close(logits, want, model.dtype):
            return "decoding on its cache does not give the logits of the whole sequence"
    return None
