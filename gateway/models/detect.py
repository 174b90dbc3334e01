"""A checkpoint's kind, from what its config says: never guessed, never forced.

In order: the config's `architectures` (the class it was saved from), then
its `auto_map` (a checkpoint with its own code, under
`--trust-remote-code`), then its `model_type` and `is_decoder` against
transformers' own tables. A causal LM loads as one; a masked LM or a base
encoder as what it is, so an encoder is never run as a causal LM (BERT's
config says `is_decoder: false`; its attention is bidirectional). A
checkpoint saved with a task head (`…ForSequenceClassification`) has no LM
head to serve: its encoder is served. An encoder-decoder, or a config none
of these name, stops the start with one sentence saying what it is and what
can be served.
"""

from __future__ import annotations

from typing import Any

from gateway.models.base import Kind

SERVED = (
    "streamgate serves causal LMs, masked LMs and encoders (ESM, BERT, RoBERTa), "
    "and any other model through --model-loader"
)


class UnsupportedModel(Exception):
    """The checkpoint is of a kind streamgate cannot serve; the message says what it is."""


def detect(config: Any) -> Kind:
    """The kind of the checkpoint whose transformers config is `config`."""
    from transformers.models.auto import modeling_auto as auto

    kind_name = type(config).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{kind_name} is an encoder-decoder model, which cannot be served: {SERVED}")
    causal = set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    masked = set(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES.values())
    base = set(auto.MODEL_MAPPING_NAMES.values())
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in causal:
            if arch in masked or not _causal_config(config, arch):
                break  # a class that is either, by its config: decided below
            return Kind.CAUSAL_LM
        if arch in masked:
            return Kind.MASKED_LM
        if arch in base:
            return Kind.ENCODER
    else:
        if architectures and getattr(config, "model_type", None) in auto.MODEL_MAPPING_NAMES and not getattr(config, "auto_map", None):
            # Saved with a task head (…ForSequenceClassification): its LM head is not in the
            # checkpoint, so only its encoder is served, never a head filled with random weights.
            return Kind.ENCODER
    auto_map = getattr(config, "auto_map", None) or {}
    if "AutoModelForCausalLM" in auto_map:
        return Kind.CAUSAL_LM
    if "AutoModelForMaskedLM" in auto_map:
        return Kind.MASKED_LM
    model_type = getattr(config, "model_type", None)
    has_causal = model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    has_masked = model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if has_causal and (not has_masked or getattr(config, "is_decoder", False)):
        return Kind.CAUSAL_LM
    if has_masked:
        return Kind.MASKED_LM
    if model_type in auto.MODEL_MAPPING_NAMES:
        return Kind.ENCODER
    raise UnsupportedModel(f"{kind_name} (model_type {model_type!r}) is not a kind transformers can load with a head here: {SERVED}")


def _causal_config(config: Any, arch: str) -> bool:
    """A causal-LM class whose family also has encoders (BERT's LMHeadModel) is causal only with `is_decoder`."""
    from transformers.models.auto import modeling_auto as auto

    model_type = getattr(config, "model_type", None)
    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return bool(getattr(config, "is_decoder", False))
    return True
