"""Build a tiny random Llama whose context holds 8,448 tokens at argv[1], for the SAE track view's test.

The same byte-level tokenizer as the test suite's tiny model (tests/conftest.py `byte_tokenizer`:
one token per byte, <s> prepended), so a DNA sequence of n letters is n positions; hidden size 32,
2 layers, 4 heads, as that model, but max_position_embeddings 8448 (its own is 256). Weights are
drawn with a fixed seed, so every run builds the same model.
"""

import sys
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.conftest import byte_tokenizer  # noqa: E402

CONTEXT = 8448


def build(path: Path, seed: int = 0) -> Path:
    tokenizer, vocab = byte_tokenizer(chat=False)
    config = tf.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
