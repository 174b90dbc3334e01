"""Base models without a head (`EsmModel`, `BertModel`, a `LlamaModel`): hidden states, nothing to read out.

Loaded with `AutoModel` (also a checkpoint saved with a task head, whose
encoder is all that can be served). They serve `embed` (the reason people load them: an
ESM-2 encoder's residue embeddings) and refuse every tool that needs logits,
saying that the checkpoint has no head and which class would have one.
"""

from __future__ import annotations

import torch

from gateway.models import huggingface, probes
from gateway.models.base import Capability, Kind, Model


def load(name: str, source: str, device: str, dtype: torch.dtype, trust_remote_code: bool = False) -> Model:
    from transformers import AutoModel

    model = huggingface.load(name, source, Kind.ENCODER, AutoModel, device, dtype, trust_remote_code)
    probes.prove(model, {Capability.HIDDEN_STATES: lambda ids: probes.hidden_states(model, ids)})
    # A base model of a causal family (LlamaModel) is no encoder: its first token sees nothing after it.
    model.bidirectional = model.has(Capability.HIDDEN_STATES) and probes.bidirectional(model)
    headless = f"{type(model.module).__name__} is a base model without a head (load a checkpoint with an LM head for this)"
    for capability in (Capability.NEXT_TOKEN, Capability.MASKED_LM, Capability.LAYERS, Capability.INCREMENTAL):
        model.missing[capability] = headless
    return model
