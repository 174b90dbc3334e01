"""Tiny random models on disk, of every kind the service meets, built from configs with
tokenizers written here: the one factory the tests, the web tests and the benchmarks build from.

- causal LMs of several families (FAMILIES: llama, gpt2, gpt_neox, qwen2, gemma, gemma2) with a
  byte-level tokenizer (one token per byte);
- `esm_mlm` / `esm_encoder`: ESM-2 (`EsmForMaskedLM`, `EsmModel`) with ESM-2's own 33-token vocabulary;
- `bert_mlm`: `BertForMaskedLM` with a small WordPiece vocabulary (letters, so any lowercase word tokenizes);
- `opt350`: an OPT-350m-style causal LM: post-LN blocks, no final norm, `project_out` to a smaller width;
- `hrm`: transformers' `hrm_text`, whose blocks are not one list;
- `t5`: an encoder-decoder config, which cannot be served.

`build(kind, path)` writes one to `path` and returns it. Only torch, transformers and tokenizers
are needed, so benchmarks (bench/) build them too, on machines without the test dependencies.
"""

from __future__ import annotations

import string
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


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Llama 2, Mistral): `▁` for a space, a few pieces, and a
    `<0xNN>` token for every byte of the rest (ByteFallback), then <s> </s> (ids 0 and 1): bytes that
    turn out to be no UTF-8 decode as U+FFFD each, so a token may change text decoded before it."""
    pieces = ["<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "a", "b", "▁a", "▁b", "ab", "▁ab"]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


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


# ESM-2's vocabulary, in its order.
ESM_VOCAB = [
    "<cls>", "<pad>", "<eos>", "<unk>",
    *"LAGVSERTIDPKQNFYMHWCXBUZO.-",
    "<null_1>", "<mask>",
]
PROTEINS = ["MKTAYIAKQR", "MVLSPADKTNVKAAWGKVGAHAGEYGAEALERMFLSFPTTKTYFPHF", "GG", "ACDEFGHIKLMNPQRSTVWY"]

BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_VOCAB = [*BERT_SPECIAL, *string.ascii_lowercase, *(f"##{c}" for c in string.ascii_lowercase), *".,!?'", "the", "cat", "sat"]

KINDS = ("esm_mlm", "esm_encoder", "bert_mlm", "opt350", "hrm", "t5")


def _esm(path: Path, head: bool, seed: int, hidden: int = 32, context: int = TINY_CONTEXT) -> Path:
    import transformers as tf

    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(ESM_VOCAB) + "\n")
    tokenizer = tf.EsmTokenizer(str(path / "vocab.txt"))
    config = tf.EsmConfig(
        vocab_size=len(ESM_VOCAB), hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * hidden,
        max_position_embeddings=context + 2, position_embedding_type="rotary", pad_token_id=ESM_VOCAB.index("<pad>"),
        mask_token_id=ESM_VOCAB.index("<mask>"), token_dropout=True, emb_layer_norm_before=False,
    )
    torch.manual_seed(seed)
    model = (tf.EsmForMaskedLM if head else tf.EsmModel)(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _bert(path: Path, seed: int) -> Path:
    import transformers as tf

    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(BERT_VOCAB) + "\n")
    tokenizer = tf.BertTokenizerFast(str(path / "vocab.txt"), do_lower_case=True)
    config = tf.BertConfig(
        vocab_size=len(BERT_VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=TINY_CONTEXT, pad_token_id=0,
    )
    torch.manual_seed(seed)
    tf.BertForMaskedLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _opt350(path: Path, seed: int) -> Path:
    import transformers as tf

    tokenizer, vocab = byte_tokenizer()
    config = tf.OPTConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
        do_layer_norm_before=False, word_embed_proj_dim=16, max_position_embeddings=TINY_CONTEXT,
        bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"], init_std=0.2,
    )
    torch.manual_seed(seed)
    model = tf.OPTForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight[vocab["</s>"]] = 0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _hrm(path: Path, seed: int) -> Path:
    import transformers as tf

    tokenizer, vocab = byte_tokenizer()
    config = tf.AutoConfig.for_model(
        "hrm_text", vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_attention_heads=4, head_dim=8,
        num_hidden_layers=4, num_layers_per_stack=2, H_cycles=1, L_cycles=1, L_bp_cycles=[1],
        max_position_embeddings=TINY_CONTEXT, bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
    )
    torch.manual_seed(seed)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _t5(path: Path, seed: int) -> Path:
    import transformers as tf

    tokenizer, vocab = byte_tokenizer()
    config = tf.T5Config(vocab_size=len(vocab), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    torch.manual_seed(seed)
    tf.T5ForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build(kind: str, path: Path, seed: int = 0, **options: Any) -> Path:
    """A tiny random model of `kind` (one of FAMILIES, a causal LM taking `build_tiny_model`'s
    options, or one of KINDS) saved at `path`."""
    if kind in FAMILIES:
        return build_tiny_model(path, seed=seed, family=kind, **options)
    makers: dict[str, Any] = {
        "esm_mlm": lambda: _esm(path, True, seed, **options),
        "esm_encoder": lambda: _esm(path, False, seed, **options),
        "bert_mlm": lambda: _bert(path, seed),
        "opt350": lambda: _opt350(path, seed),
        "hrm": lambda: _hrm(path, seed),
        "t5": lambda: _t5(path, seed),
    }
    return makers[kind]()
