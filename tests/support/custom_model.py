"""A custom model served through `--model-loader`: a plain `nn.Module`, recurrent, with no KV cache.

A byte-level GRU language model: each block is a GRU over the sequence with a
residual connection (its output is the residual stream), then a final norm
and an output head. It implements the whole `CustomModel` protocol
(gateway/models/custom.py); `load_plain` serves the same weights with none
of the optional parts, so that generation recomputes the context each token.

    streamgate serve --model-loader tests.support.custom_model:load
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB = 258  # the 256 bytes, then BOS and EOS
BOS, EOS = 256, 257
WIDTH = 32
N_LAYERS = 3
CONTEXT = 512


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.gru = nn.GRU(WIDTH, WIDTH, batch_first=True)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        out, self.last_state = self.gru(self.norm(x), state)
        return x + out


class ByteGRU(nn.Module):
    """A recurrent byte-level LM: tokens → embedding → GRU blocks (residual) → norm → head."""

    vocab_size = VOCAB
    context_length = CONTEXT
    bos_token_id = BOS
    eos_token_ids = (EOS,)
    pad_token_id = 0
    name = "byte-gru"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
            self.head.weight[EOS] = 0  # greedy decoding never ends early by chance

    # -- required ---------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # Right padding follows each row's real tokens, so a recurrence over them is unchanged by it.
        return self.head(self.norm(self._run(input_ids)[-1]))

    # -- optional: hidden states, layers and readout -------------------------------------------

    @property
    def layers(self) -> nn.ModuleList:
        return self.blocks

    def _run(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        x = self.embed(input_ids)
        states = [x]
        for block in self.blocks:
            x = block(x)
            states.append(x)
        return states

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        states = self._run(input_ids)
        return [*states[:-1], self.norm(states[-1])]

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden))

    # -- optional: an incremental step with the model's own state --------------------------------

    def start(self, rows: list[list[int]]) -> tuple[torch.Tensor, Any]:
        logits, states = [], []
        for ids in rows:  # rows differ in length; a recurrence takes each as it is
            x = self.embed(torch.tensor([ids], device=self.head.weight.device))
            row_states = []
            for block in self.blocks:
                x = block(x)
                row_states.append(block.last_state)
            logits.append(self.head(self.norm(x[:, -1])))
            states.append(torch.stack(row_states))  # layers × 1 × 1 × width
        return torch.cat(logits), torch.cat(states, dim=2)

    def step(self, state: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
        x = self.embed(tokens[:, None])
        new = []
        for layer, block in enumerate(self.blocks):
            x = block(x, state[layer])
            new.append(block.last_state)
        return self.head(self.norm(x[:, -1])), torch.stack(new)

    def select(self, state: Any, rows: torch.Tensor) -> Any:
        return state[:, :, rows]


class PlainByteGRU(ByteGRU):
    """The same model with only the required parts: no step, no hidden states, no layers."""

    def __getattribute__(self, name: str) -> Any:
        if name in ("start", "step", "select", "hidden_states", "readout", "layers"):
            raise AttributeError(name)
        return super().__getattribute__(name)


def load(source: str | None, device: torch.device, dtype: torch.dtype) -> ByteGRU:
    return ByteGRU().to(device=device, dtype=dtype)


# Evo2-style organism tags: lineage prefixes whose characters are not bases.
DNA_TAGS = {"bacteria": "|D__BACTERIA;P__PSEUDOMONADOTA|", "human": "|D__EUKARYOTA;S__HOMO_SAPIENS|"}


def load_dna(source: str | None, device: torch.device, dtype: torch.dtype) -> ByteGRU:
    """The same byte-level model as a DNA model: an alphabet of bases, and tags."""
    model = ByteGRU(seed=3).to(device=device, dtype=dtype)
    model.alphabet = "ACGTN"
    model.tags = dict(DNA_TAGS)
    return model


def load_plain(source: str | None, device: torch.device, dtype: torch.dtype) -> ByteGRU:
    return PlainByteGRU().to(device=device, dtype=dtype)


def greedy(model: ByteGRU, prompt: str, n: int) -> list[int]:
    """Full-context greedy decoding, written out: the reference `generate` must equal."""
    ids = [BOS, *model.tokenize(prompt)]
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model.head(model.norm(model._run(torch.tensor([ids + out]))[-1]))[0, -1]
            token = int(logits.argmax())
            out.append(token)
            if token == EOS:
                break
    return out
