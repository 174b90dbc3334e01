"""Tiny random models on disk, built from configs: a causal LM of any of several families with a
byte-level tokenizer (one token per byte). Only torch, transformers and tokenizers are needed, so
benchmarks (bench/cost.py) build them too, on machines without the test dependencies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

TINY_CONTEXT = 256


# The families `build_tiny_model` can make, each from a tiny config; see `_tiny_config`.
FAMILIES = ("llama", "gpt2", "gpt_neox", "qwen2", "gemma", "gemma2")
TINY_SOFTCAP = 5.0  # gemma2's final_logit_softcapping: small, so that it changes the numbers


# ChatML, as SmolLM2 and Qwen write it, with the refusal real templates make of a misplaced system message.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('the system message must come first') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_tokenizer(chat: bool = True) -> tuple[PreTrainedTokenizerFast, dict[str, int]]:
    """A byte-level tokenizer (one token per byte, then <s> </s> <pad>) that prepends <s>;
    with `chat`, CHAT_TEMPLATE as its chat template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for special in ("<s>", "</s>", "<pad>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer, vocab


def _tiny_config(
    family: str, vocab: dict[str, int], layers: int, init: float | None, hidden: int = 32, context: int = TINY_CONTEXT
) -> tuple[Any, type]:
    """A tiny config of `family` (hidden 32, 4 heads, context TINY_CONTEXT by default) and its causal-LM class.

    Heads are tied to the input embeddings in gpt2, gemma and gemma2 (as in those
    families' real checkpoints) and separate in llama, gpt_neox and qwen2.
    """
    import transformers as tf

    ids = {"bos_token_id": vocab["<s>"], "eos_token_id": vocab["</s>"], "pad_token_id": vocab["<pad>"]}
    extra: dict[str, Any] = {} if init is None else {"initializer_range": init}
    common = dict(
        vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, max_position_embeddings=context, **ids, **extra,
    )
    if family == "llama":
        return tf.LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=False), tf.LlamaForCausalLM
    if family == "gpt2":
        config = tf.GPT2Config(
            vocab_size=len(vocab), n_embd=32, n_inner=64, n_layer=layers, n_head=4, n_positions=TINY_CONTEXT,
            tie_word_embeddings=True, **ids, **extra,
        )
        return config, tf.GPT2LMHeadModel
    if family == "gpt_neox":
        # Parallel attention + MLP residual and partial rotary, as in Pythia.
        return tf.GPTNeoXConfig(**common, tie_word_embeddings=False, use_parallel_residual=True), tf.GPTNeoXForCausalLM
    if family == "qwen2":
        return tf.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=False), tf.Qwen2ForCausalLM
    if family == "gemma":
        return tf.GemmaConfig(**common, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True), tf.GemmaForCausalLM
    if family == "gemma2":
        config = tf.Gemma2Config(
            **common, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, tie_word_embeddings=True,
            final_logit_softcapping=TINY_SOFTCAP,
        )
        return config, tf.Gemma2ForCausalLM
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def build_tiny_model(
    path: Path, *, seed: int = 0, family: str = "llama", layers: int = 2, init: float | None = None, chat: bool = True,
    hidden: int = 32, context: int = TINY_CONTEXT,
) -> Path:
    """A tiny random causal LM with a byte-level tokenizer (one token per byte), saved at `path`.

    By default a 2-layer Llama; `family` picks another of FAMILIES (same tokenizer,
    hidden size 32, context TINY_CONTEXT), `layers` its depth and `init` its
    `initializer_range` (larger weights: peakier, less tie-prone distributions).

    Its EOS row of the output head is zero, so greedy decoding never ends early by
    chance: tests that need EOS say which token it is. Where the head is tied to the
    input embeddings (gpt2, gemma, gemma2) the shared row is zeroed, which also
    zeroes EOS's input embedding; no prompt ever contains EOS, so only its logit changes.
    `chat=False` leaves the tokenizer without a chat template. `hidden` and `context` make
    a wider, longer one (for what memory a pass takes).
    """
    tokenizer, vocab = byte_tokenizer(chat)
    config, model_class = _tiny_config(family, vocab, layers, init, hidden, context)
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        model.get_output_embeddings().weight[vocab["</s>"]] = 0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
