"""Masked language models and their encoders (ESM-2, BERT, RoBERTa, …): a masked-LM head, hidden states, layers.

Loaded with `AutoModelForMaskedLM`. Every position sees the whole sequence,
so nothing here is a next-token prediction: `generate`, `predict`,
`loglikelihood` and activation patching are refused, and the masked-LM tools
(`fill_mask`, `pseudo_loglikelihood`) and `embed` serve instead. The lens
reads each layer through the model's whole head (ESM's and BERT's dense +
norm before the decoder), so its last layer is the model's own prediction.
"""

from __future__ import annotations

import torch

from gateway.models import huggingface, probes
from gateway.models.base import Capability, Kind, Model

ENCODER_ONLY = "every position of a masked LM sees the whole sequence, so it makes no next-token predictions"


def load(name: str, source: str, device: str, dtype: torch.dtype, trust_remote_code: bool = False) -> Model:
    from transformers import AutoModelForMaskedLM

    from gateway.models.anatomy import find

    model = huggingface.load(name, source, Kind.MASKED_LM, AutoModelForMaskedLM, device, dtype, trust_remote_code)
    probes.prove(
        model,
        {
            Capability.MASKED_LM: lambda ids: mask_head(model, ids),
            Capability.HIDDEN_STATES: lambda ids: probes.hidden_states(model, ids),
            Capability.LAYERS: lambda ids: probes.layers(model, ids, lambda: find(model.module)),
        },
    )
    model.missing[Capability.NEXT_TOKEN] = ENCODER_ONLY
    model.missing[Capability.INCREMENTAL] = ENCODER_ONLY
    return model


def mask_head(model: Model, ids: list[int]) -> str | None:
    """None if the tokenizer has a mask token and the head scores every position; else why not."""
    if model.mask_token_id is None:
        return "its tokenizer has no mask token"
    masked = list(ids)
    masked[len(ids) // 2] = model.mask_token_id
    input_ids = torch.tensor([masked], device=model.device)
    logits = model.logits(input_ids, torch.ones_like(input_ids))
    if logits.shape[:2] != (1, len(ids)) or logits.shape[-1] < model.vocab_size:
        return "its head does not score every position over the vocabulary"
    return None
