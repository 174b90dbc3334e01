"""`generate`: sample completions for a batch of prompts, streaming tokens as `partial` events.

Decoding is a plain loop over the model's forward pass with a KV cache rather
than `model.generate()`: the loop is where cancellation is checked between
tokens, where each new token becomes a `partial` frame, and where stop strings
end one completion while the others go on. Prompts are left-padded into one
batch; position ids come from the attention mask, so padding changes nothing.

Text sent as `partial` is final: a tail that could still become a stop string,
or an incomplete UTF-8 character, is held back until it is decided.
"""

from __future__ import annotations

import random
from typing import Annotated

import msgspec
import torch

from gateway.errors import ParamError
from gateway.tools.base import Context, Model, tool


class GenerateParams(msgspec.Struct, forbid_unknown_fields=True):
    prompts: Annotated[list[str], msgspec.Meta(min_length=1, description="Prompts, completed as one batch.")]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, description="Most tokens to generate per prompt.")] = 16
    temperature: Annotated[
        float, msgspec.Meta(ge=0, le=2, description="0 picks the most likely token (greedy).")
    ] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1, description="Nucleus sampling mass.")] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=1, description="Sample from the k most likely tokens.")] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1, description="Same seed, same completions.")] | None = None
    stop: Annotated[
        list[Annotated[str, msgspec.Meta(min_length=1)]],
        msgspec.Meta(max_length=16, description="Strings that end a completion (not included)."),
    ] | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class GenerateResult(msgspec.Struct):
    completions: list[str]
    usage: Usage
    finish_reasons: list[str]


class GeneratePartial(msgspec.Struct):
    index: int
    text: str
    token_ids: list[int]


def check(model: Model, params: GenerateParams) -> None:
    for i, prompt in enumerate(params.prompts):
        model.fit(len(model.encode(prompt)) + params.max_tokens, f"prompts[{i}]", "prompt + max_tokens")
    if params.top_k is not None and params.top_k > model.module.config.vocab_size:
        raise ParamError("top_k", f"must be <= the vocabulary size {model.module.config.vocab_size}")


class _Completion:
    """One row of the batch: its tokens, the text already sent, and whether it ended."""

    def __init__(self, stop: list[str]) -> None:
        self.tokens: list[int] = []
        self.unsent: list[int] = []
        self.sent = ""
        self.text = ""
        self.stop = stop
        self.finish: str | None = None  # "stop" (EOS or a stop string) or "length"

    def add(self, token: int, model: Model) -> str:
        """Take one token; return the text that is now final and not yet sent."""
        self.tokens.append(token)
        self.unsent.append(token)
        if token in model.eos_token_ids:
            return self.end("stop", model.decode(self.tokens[:-1]))
        text = model.decode(self.tokens)
        cuts = [at for at in (text.find(s) for s in self.stop) if at >= 0]
        if cuts:
            return self.end("stop", text[: min(cuts)])
        self.text = text
        final = text.rstrip("\ufffd")  # an incomplete multi-byte character waits
        hold = max(
            (n for s in self.stop for n in range(1, len(s)) if final.endswith(s[:n])),
            default=0,
        )
        return self._take(final[: len(final) - hold])

    def end(self, reason: str, text: str) -> str:
        """Finish with `text` as the whole completion; return what is left to send."""
        self.finish, self.text = reason, text
        return self._take(text)

    def _take(self, final: str) -> str:
        if not final.startswith(self.sent) or len(final) <= len(self.sent):
            return ""
        delta, self.sent = final[len(self.sent) :], final
        return delta


def sample(logits: torch.Tensor, p: GenerateParams, generator: torch.Generator) -> torch.Tensor:
    """Next token per row from float32 logits of shape (batch, vocab)."""
    if p.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / p.temperature
    if p.top_k is not None:
        kth = torch.topk(logits, p.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        drop = (cumulative - sorted_logits.softmax(dim=-1)) >= p.top_p
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1).cpu()
    return torch.multinomial(probs, 1, generator=generator).squeeze(1).to(logits.device)


@tool(partial=GeneratePartial, check=check, caps={"prompts": "max_prompts", "max_tokens": "max_tokens"})
def generate(model: Model, params: GenerateParams, ctx: Context) -> GenerateResult:
    """Complete each prompt, streaming tokens as they are sampled."""
    encoded = [model.encode(prompt) for prompt in params.prompts]
    batch, width = len(encoded), max(len(ids) for ids in encoded)
    pad = model.tokenizer.pad_token_id
    input_ids = torch.full((batch, width), pad, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for row, ids in enumerate(encoded):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        mask[row, width - len(ids) :] = 1
    input_ids, mask = input_ids.to(model.device), mask.to(model.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    seed = params.seed if params.seed is not None else random.getrandbits(63)
    generator = torch.Generator().manual_seed(seed)
    rows = [_Completion(params.stop or []) for _ in encoded]
    cache = None
    step_ids = input_ids
    for step in range(params.max_tokens):
        ctx.raise_if_cancelled()
        out = model.module(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        cache = out.past_key_values
        next_ids = sample(out.logits[:, -1, :].float(), params, generator)
        for index, (row, token) in enumerate(zip(rows, next_ids.tolist())):
            if row.finish is not None:
                continue
            text = row.add(token, model)
            # A finished row sends its last tokens even without text (EOS), so the
            # partials' token_ids always add up to the completion's tokens.
            if text or (row.finish is not None and row.unsent):
                ctx.partial(GeneratePartial(index, text, row.unsent))
                row.unsent = []
        ctx.progress(step + 1, params.max_tokens, "tokens")
        if all(row.finish is not None for row in rows):
            break
        step_ids = next_ids[:, None]
        mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)
        positions = positions[:, -1:] + 1

    for index, row in enumerate(rows):
        if row.finish is None:
            tail = row.end("length", model.decode(row.tokens))
            if tail or row.unsent:
                ctx.partial(GeneratePartial(index, tail, row.unsent))
    prompt_tokens = sum(len(ids) for ids in encoded)
    completion_tokens = sum(len(row.tokens) for row in rows)
    return GenerateResult(
        completions=[row.text for row in rows],
        usage=Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens),
        finish_reasons=[row.finish for row in rows],
    )
