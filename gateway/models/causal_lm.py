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

    from gateway.tools.anatomy import find

    model = huggingface.load(name, source, Kind.CAUSAL_LM, AutoModelForCausalLM, device, dtype, trust_remote_code)
    probes.prove(
        model,
        {
            Capability.NEXT_TOKEN: lambda ids: probes.causal(model, ids),
            Capability.INCREMENTAL: lambda ids: probes.incremental(model, ids, lambda ids: cached_step(model, ids)),
            Capability.HIDDEN_STATES: lambda ids: probes.hidden_states(model, ids),
            Capability.LAYERS: lambda ids: probes.layers(model, ids, lambda: find(model.module)),
        },
    )
    model.missing[Capability.MASKED_LM] = "a causal LM predicts the next token; it has no masked-LM head"
    return model


def cached_step(model: Model, ids: list[int]) -> torch.Tensor:
    """The last token's logits from a cache of the tokens before it: what `generate` does each step."""
    input_ids = torch.tensor([ids], device=model.device)
    first = model.module(input_ids=input_ids[:, :-1], use_cache=True)
    if first.past_key_values is None:
        raise ValueError("the model returns no cache")
    out = model.module(input_ids=input_ids[:, -1:], past_key_values=first.past_key_values, use_cache=True)
    return out.logits[0, -1]
