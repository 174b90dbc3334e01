"""Tiny random models of every kind the service meets, built from configs, tokenizers written by hand.

- `esm_mlm` / `esm_encoder`: ESM-2 (`EsmForMaskedLM`, `EsmModel`) with ESM-2's own 33-token vocabulary;
- `bert_mlm`: `BertForMaskedLM` with a small WordPiece vocabulary (letters, so any lowercase word tokenizes);
- `opt350`: an OPT-350m-style causal LM: post-LN blocks, no final norm, `project_out` to a smaller width;
- `hrm`: transformers' `hrm_text`, whose blocks are not one list;
- `t5`: an encoder-decoder config, which cannot be served.

`build(kind, path)` writes one to `path` and returns it.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch

from tests.conftest import TINY_CONTEXT, byte_tokenizer

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


def build(kind: str, path: Path, seed: int = 0) -> Path:
    """A tiny random model of `kind` (one of KINDS) saved at `path`."""
    makers: dict[str, Any] = {
        "esm_mlm": lambda: _esm(path, True, seed),
        "esm_encoder": lambda: _esm(path, False, seed),
        "bert_mlm": lambda: _bert(path, seed),
        "opt350": lambda: _opt350(path, seed),
        "hrm": lambda: _hrm(path, seed),
        "t5": lambda: _t5(path, seed),
    }
    return makers[kind]()
