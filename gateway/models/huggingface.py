"""What the Hugging Face kinds share: the tokenizer, the weights through a kind's auto-class, and the facts tools read.

Each kind (`causal_lm.py`, `masked_lm.py`, `encoder.py`) names its
transformers auto-class and the capabilities it claims; this module loads the
checkpoint through that class and fills in the `Model` the same way for all.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from gateway.models import alphabet
from gateway.models.base import Kind, Model
from gateway.models.detect import UnsupportedModel

log = logging.getLogger("streamgate.model")


def text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def context_length(config: Any, tokenizer: Any) -> int:
    config = text_config(config)
    found = next(
        (getattr(config, k) for k in ("max_position_embeddings", "n_positions", "n_ctx") if getattr(config, k, None)),
        None,
    )
    return int(found or min(tokenizer.model_max_length, 1 << 20))


def load(
    name: str, source: str, kind: Kind, auto_class: Any, device: str, dtype: torch.dtype, trust_remote_code: bool
) -> Model:
    """The checkpoint at `source` through `auto_class`, on `device`, as a `Model` of `kind` (capabilities not yet proven)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    module, info = auto_class.from_pretrained(
        source, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True
    )
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        # transformers fills them with random values and only logs it: those numbers would be noise.
        raise UnsupportedModel(
            f"the checkpoint lacks {len(missing)} weights {type(module).__name__} needs "
            f"(e.g. {missing[0]}); served, they would be random"
        )
    module.to(device).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    eos: set[int] = set()
    # A model without a generation config (an encoder) has only its tokenizer's EOS.
    generation_eos = getattr(getattr(module, "generation_config", None), "eos_token_id", None)
    for ids in (tokenizer.eos_token_id, generation_eos):
        if ids is not None:
            eos.update(ids if isinstance(ids, (list, tuple)) else [ids])
    mask = tokenizer.mask_token_id
    added = set(tokenizer.all_special_ids) - {mask, tokenizer.unk_token_id}
    config = text_config(module.config)
    vocab = int(getattr(config, "vocab_size", None) or len(tokenizer))
    context = context_length(module.config, tokenizer)
    if kind in (Kind.MASKED_LM, Kind.ENCODER) and tokenizer.model_max_length < 1 << 20:
        # RoBERTa-style positions start after the padding index: the tokenizer knows the usable length.
        context = min(context, int(tokenizer.model_max_length))
    log.info("loaded %s (%s, %s) on %s (%s), context %d tokens", name, kind.value, type(module).__name__, device, dtype, context)
    return Model(
        name=name,
        module=module,
        tokenizer=tokenizer,
        device=torch.device(device),
        dtype=dtype,
        context_length=context,
        eos_token_ids=frozenset(eos),
        kind=kind,
        vocab_size=vocab,
        pad_token_id=int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else 0,
        special_ids=frozenset(i for i in added if i is not None),
        mask_token_id=mask,
        bidirectional=kind in (Kind.MASKED_LM, Kind.ENCODER),
        alphabet=alphabet.from_tokenizer(tokenizer),
    )
