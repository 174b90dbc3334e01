"""`generate`: sample completions for a batch of prompts, streaming tokens as `partial` events.

Decoding is a plain loop over the model's forward pass rather than
`model.generate()`: the loop is where cancellation is checked between tokens,
where each new token becomes a `partial` frame, where stop strings end one
completion while the others go on, and where jobs join and leave a running
batch (`Generation`). A model with a KV cache decodes one token a step with
prompts left-padded (position ids come from the attention mask, so padding
changes nothing); a custom model with its own state steps that; a model with
neither runs its whole context again for each token, slower and the same.

Text sent as `partial` is final: a tail that could still become a stop string,
or an incomplete UTF-8 character, is held back until it is decided.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Collection
from typing import Annotated, Any, Literal

import msgspec
import torch
from jinja2 import TemplateError

from gateway.cost import Cost, Shape
from gateway.errors import ParamError
from gateway.models import capabilities
from gateway.models.base import Capability
from gateway.models.decoders import decoder_for, prefill_columns
from gateway.tools.base import Cancelled, Context, Model, tool
from gateway.tools.batching import run_alone


# Turns in one conversation: far more than fit any context, so the limit only keeps rendering short.
MAX_MESSAGES = 1024
# Completions of one prompt: each is a row of the batch, priced as a prompt is (`cost`).
MAX_N = 16
# A stop string's characters, at most: stop strings are markers (a blank line, `</answer>`), and each
# is matched with a table of its length (`_Stops`).
MAX_STOP_CHARS = 512


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Annotated[
        Literal["system", "user", "assistant"], msgspec.Meta(description="Who says it.")
    ]
    content: str


class GenerateParams(msgspec.Struct, forbid_unknown_fields=True):
    prompts: Annotated[
        list[str], msgspec.Meta(min_length=1, description="Prompts, completed as one batch (raw text, no chat template).")
    ] | None = None
    messages: Annotated[
        list[ChatMessage],
        msgspec.Meta(
            min_length=1,
            max_length=MAX_MESSAGES,
            description="A conversation instead of prompts: rendered by the model's chat template, "
            "and the reply to it generated (one completion).",
        ),
    ] | None = None
    token_ids: Annotated[
        list[Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=1)]],
        msgspec.Meta(min_length=1, description="Prompts as token ids, completed as they are (nothing added), instead of prompts."),
    ] | None = None
    n: Annotated[
        int,
        msgspec.Meta(
            ge=1, le=MAX_N,
            description="Completions of each prompt (or of the conversation), each its own row: prompt i's j-th is "
            "completions[i * n + j]. Sampled ones differ; greedy ones are the same.",
        ),
    ] = 1
    max_tokens: Annotated[int, msgspec.Meta(ge=1, description="Most tokens to generate per completion.")] = 16
    temperature: Annotated[
        float, msgspec.Meta(ge=0, le=2, description="0 picks the most likely token (greedy).")
    ] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1, description="Nucleus sampling mass.")] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=1, description="Sample from the k most likely tokens.")] | None = None
    # 2**53 - 1: the largest integer every JSON client (JavaScript's numbers) holds exactly.
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**53 - 1, description="Same seed, same completions.")] | None = None
    stop: Annotated[
        list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]],
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


def inputs(model: Model, params: GenerateParams) -> list[list[int]]:
    """The token ids to complete: `n` rows per prompt, or of the conversation rendered for its reply."""
    if params.messages is not None:
        given = [model.encode_chat([msgspec.structs.asdict(m) for m in params.messages])]
    elif params.token_ids is not None:
        given = params.token_ids
    else:
        given = [model.encode(prompt, f"prompts[{i}]") for i, prompt in enumerate(params.prompts or [])]
    return [ids for ids in given for _ in range(params.n)]


def check(model: Model, params: GenerateParams) -> None:
    given = [name for name in ("prompts", "messages", "token_ids") if getattr(params, name) is not None]
    if not given:
        raise ParamError("prompts", "required: prompts (plain text), messages (a conversation) or token_ids")
    if len(given) > 1:
        raise ParamError(given[1], f"give one of prompts (plain text), messages (a conversation) and token_ids, not {' and '.join(given)}")
    if params.messages is not None:
        capabilities.require(model, Capability.CHAT, "messages")
        try:
            ids = inputs(model, params)[0]
        except (TemplateError, ValueError, TypeError) as exc:  # the template refuses (roles that do not alternate…)
            raise ParamError("messages", f"the model's chat template cannot render them: {exc}") from None
        model.fit(len(ids) + params.max_tokens, "messages", "messages + max_tokens")
    for i, prompt in enumerate(params.prompts or []):
        model.fit(len(model.encode(prompt, f"prompts[{i}]")) + params.max_tokens, f"prompts[{i}]", "prompt + max_tokens")
    for i, ids in enumerate(params.token_ids or []):
        if (bad := next((t for t in ids if t >= model.vocab_size), None)) is not None:
            raise ParamError(f"token_ids[{i}]", f"token id {bad} is not below the vocabulary size {model.vocab_size}")
        model.fit(len(ids) + params.max_tokens, f"token_ids[{i}]", "token_ids + max_tokens")
    if params.top_k is not None and params.top_k > model.vocab_size:
        raise ParamError("top_k", f"must be <= the vocabulary size {model.vocab_size}")


# What one streamed token costs a job's event log: its `partial` event (id, text, frame) and its share of progress frames.
EVENT_BYTES = 192


def cost(model: Model, params: GenerateParams) -> Cost:
    """The prefill of every row (a piece of columns at a time) with its last logits, the decoding
    cache at full length, and what each token adds to the job's event log and its completion."""
    shape = Shape.of(model)
    rows = inputs(model, params)
    width = max(len(ids) for ids in rows)
    n, new = len(rows), params.max_tokens
    result = n * new * 12
    memory = (
        shape.block_bytes(n, prefill_columns(n, width), attended=width)
        + shape.cache_bytes(n, width + new)
        + shape.logits_bytes(n)
        + n * new * EVENT_BYTES
        + result
    )
    field = "messages" if params.messages is not None else "token_ids" if params.token_ids is not None else "prompts"
    counted = sum(len(ids) for ids in rows) + n * new
    return Cost(memory=memory, result=result, memory_field=field, result_field="max_tokens", tokens=n * width, counted=counted)


class _Completion:
    """One row of the batch: its tokens, the text already sent, and whether it ended.

    Its text grows a piece a token from the model's incremental decoder
    (`Model.decoding`), and ends as the decode of all its tokens. Its stop
    strings (`_Stops`) read each piece once; what could be the start of one is
    held back until the next piece says.
    """

    def __init__(self, stop: list[str], model: Model) -> None:
        self.tokens: list[int] = []
        self.unsent: list[int] = []
        self.sent = ""
        self.text = ""
        self.finish: str | None = None  # "stop" (EOS or a stop string) or "length"
        self._decoding = model.decoding()
        self._stops = _Stops(stop) if stop else None

    def add(self, token: int, model: Model) -> str:
        """Take one token; return the text that is now final and not yet sent."""
        self.tokens.append(token)
        self.unsent.append(token)
        if token in model.eos_token_ids:
            return self.end("stop", model.decode(self.tokens[:-1]))
        piece = self._decoding(token)
        if not piece:
            return ""
        at = len(self.text)
        self.text += piece
        if self._stops is None:  # (every step of most rows)
            self.sent = self.text
            return piece
        cut = self._stops.scan(piece, at)
        if cut is not None:
            return self.end("stop", self.text[:cut])
        return self._take(self.text[: len(self.text) - self._stops.held])

    def end(self, reason: str, text: str) -> str:
        """Finish with `text` as the whole completion; return what is left to send. Its characters not
        read yet (the last token left one incomplete) may still hold a stop string: it ends there."""
        if self._stops is not None and len(text) > len(self.text) and text.startswith(self.text):
            cut = self._stops.scan(text[len(self.text) :], len(self.text))
            if cut is not None:
                reason, text = "stop", text[:cut]
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
    # Less the row's max, over a temperature float32 can hold (1e-300 is 0 there): a tiny
    # temperature then leaves only the top token (greedy, its limit), never inf or 0/0 and NaN.
    temperature = max(p.temperature, torch.finfo(logits.dtype).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if p.top_k is not None:
        kth = torch.topk(logits, p.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        drop = (cumulative - sorted_logits.softmax(dim=-1)) >= p.top_p
        drop[:, 0] = False  # even for a top_p that float32 holds as 0
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1).cpu()
    return torch.multinomial(probs, 1, generator=generator).squeeze(1).to(logits.device)


class _Stops:
    """A row's stop strings against its text, a character at a time (Knuth-Morris-Pratt): where one
    first ends in it, and how much of the text's end could begin one. A piece costs its length times
    the number of stop strings, whatever their lengths: a check from each position, as `str.find`
    and `endswith` for every prefix did, cost a stop string's length squared, every token."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [(stop, _fallbacks(stop)) for stop in stops]
        self.matched = [0] * len(stops)  # of each stop string, the first characters the text ends with

    def scan(self, piece: str, at: int) -> int | None:
        """Read `piece`, which is the text from `at` on: where in the text the first stop string it
        completes begins, or None."""
        first: int | None = None
        for j, (stop, fallbacks) in enumerate(self.stops):
            k = self.matched[j]
            for i, char in enumerate(piece, at):
                while k and stop[k] != char:
                    k = fallbacks[k - 1]
                if stop[k] == char:
                    k += 1
                    if k == len(stop):
                        first = min(i + 1 - k, first if first is not None else i + 1 - k)
                        break
            self.matched[j] = k
        return first

    @property
    def held(self) -> int:
        """The most of the text's end that begins a stop string: not final until the next piece."""
        return max(self.matched)


@functools.lru_cache(maxsize=256)
def _fallbacks(stop: str) -> list[int]:
    """For each prefix of `stop`, the longest shorter prefix that also ends it (shared by a job's rows)."""
    fallbacks = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fallbacks[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fallbacks[i] = k
    return fallbacks


class _Member:
    """One job in a generation batch: its rows (one per prompt), sampler and step count."""

    def __init__(self, model: Model, params: GenerateParams, ctx: Context) -> None:
        self.params, self.ctx = params, ctx
        self.encoded = inputs(model, params)
        self.rows = [_Completion(params.stop or [], model) for _ in self.encoded]
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        # A generator per job: its samples do not depend on who else is in the batch.
        self.generator = torch.Generator().manual_seed(seed)
        self.steps = 0
        self.failure: Exception | None = None  # what a step of its own raised: it alone ends with it
        ctx.count(tokens_in=sum(len(ids) for ids in self.encoded))

    @property
    def done(self) -> bool:
        return self.failure is not None or self.steps >= self.params.max_tokens or all(row.finish is not None for row in self.rows)

    @property
    def context(self) -> list[list[int]]:
        """Its rows' contexts to prefill: their prompts, and the tokens taken so far (a member that
        was preempted takes up again where it stopped: the next token is what its step would give)."""
        return [ids + row.tokens if row.tokens else ids for ids, row in zip(self.encoded, self.rows)]

    @property
    def columns(self) -> int:
        """The columns of its context a prefill piece may run within its price: its prompt's pieces,
        narrower as the tokens taken lengthen what each column attends to (gateway/cost.py prices
        the prompt's prefill, and the cache at full length)."""
        width = max(len(ids) for ids in self.encoded)
        now = max(len(ids) for ids in self.context)
        return max(1, prefill_columns(len(self.rows), width) * width // now)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """This job's next tokens from its rows' logits (rows × vocab, any float dtype)."""
        return sample(logits.float(), self.params, self.generator)

    def take(self, tokens: list[int], model: Model) -> None:
        """Take this step's token of each row; send what became final."""
        self.steps += 1
        taken = 0
        for index, (row, token) in enumerate(zip(self.rows, tokens)):
            if row.finish is not None:
                continue
            taken += 1
            text = row.add(token, model)
            # A finished row sends its last tokens even without text (EOS), so the
            # partials' token_ids always add up to the completion's tokens.
            if text or (row.finish is not None and row.unsent):
                self.ctx.partial(GeneratePartial(index, text, row.unsent))
                row.unsent = []
        self.ctx.count(tokens_out=taken)
        self.ctx.progress(self.steps, self.params.max_tokens, "tokens")

    def result(self, model: Model) -> GenerateResult | Exception:
        if self.failure is not None:
            return self.failure
        for index, row in enumerate(self.rows):
            if row.finish is None:
                tail = row.end("length", model.decode(row.tokens))
                if tail or row.unsent:
                    self.ctx.partial(GeneratePartial(index, tail, row.unsent))
        prompt_tokens = sum(len(ids) for ids in self.encoded)
        completion_tokens = sum(len(row.tokens) for row in self.rows)
        return GenerateResult(
            completions=[row.text for row in self.rows],
            usage=Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens),
            finish_reasons=[row.finish for row in self.rows],
        )


class Generation:
    """`generate`'s continuous batch: every member's rows decode together, a token per step.

    A job that ends (or is cancelled) leaves at the end of its step, and a job
    added between steps is prefilled at the start of the next one, its first
    token sent before the running rows step, and joins them in that step, so
    no job waits for the longest completion in the batch, nor for a step of
    the others before its first token. How the
    rows' contexts are kept is the decoder's business (`decoder_for`): a KV
    cache, a custom model's own state, or the whole context run again.

    It is `Preemptible` (gateway/tools/batching.py): a member taken out between
    two steps keeps its tokens and its sampler, and its rows' contexts go; back,
    it is prefilled with its prompts and the tokens it took, whose logits are the
    ones its next step would have given. Its completions are those it would have
    made never taken out (greedy, or sampled with its seed), to the last bits of
    a prefill against a decoding step.
    """

    # Rows of one prompt share its prefill: their pass is the same (not where each row is steered its own way).
    shares_prompts = True

    def __init__(self, model: Model) -> None:
        self.model = model
        self.members: list[_Member] = []  # in row order: each owns a contiguous block
        self.joining: list[_Member] = []
        self.decoder = decoder_for(model)
        self.pending: torch.Tensor | None = None  # (rows,): the token each row feeds next

    @property
    def continuous(self) -> bool:
        return self.decoder.mergeable or not self.members

    def __len__(self) -> int:
        return len(self.members) + len(self.joining)

    def add(self, params: GenerateParams, ctx: Context) -> None:
        self.joining.append(_Member(self.model, params, ctx))

    def step(self) -> list[tuple[Context, Any]]:
        ended: list[tuple[Context, Any]] = []
        self.joining, joining = [], self.joining
        for member in joining:
            if member.ctx.cancelled:
                ended.append((member.ctx, Cancelled()))
        joining = [m for m in joining if not m.ctx.cancelled]
        for member in self.members:
            if member.ctx.cancelled:
                ended.append((member.ctx, Cancelled()))
        self._keep([m for m in self.members if not m.ctx.cancelled])
        decoding = bool(self.members)
        if joining:
            # The newcomers first: their first tokens go out now, not after the running rows' step;
            # then they decode with those rows (a second token) unless the first ended them.
            rows = [ids for member in joining for ids in member.context]
            columns = min(member.columns for member in joining) if any(m.steps for m in joining) else None
            logits = self._forward(joining, lambda: self.decoder.prefill(rows, self.shares_prompts, columns), prefill=True)
            tokens = self._sample(joining, logits)
            self.pending = tokens if self.pending is None else torch.cat([self.pending, tokens])
            self.members.extend(joining)
            if decoding and any(m.done for m in joining):
                ended.extend((m.ctx, m.result(self.model)) for m in joining if m.done)
                self._keep([m for m in self.members if not m.done])
        if decoding:
            assert self.pending is not None
            pending = self.pending
            logits = self._forward(self.members, lambda: self.decoder.decode(pending), prefill=False)
            self.pending = self._sample(self.members, logits)
        finished = [m for m in self.members if m.done]
        ended.extend((m.ctx, m.result(self.model)) for m in finished)
        self._keep([m for m in self.members if not m.done])
        return ended

    def preempt(self, ctxs: Collection[Context]) -> list[tuple[Context, _Member]]:
        """Take these members out between two steps, each with its rows' tokens and sampler as they are."""
        out = [(m.ctx, m) for m in [*self.joining, *self.members] if m.ctx in ctxs]
        if out:
            self.joining = [m for m in self.joining if m.ctx not in ctxs]
            self._keep([m for m in self.members if m.ctx not in ctxs])
        return out

    def resume(self, kept: _Member, ctx: Context) -> None:
        """Take a preempted member back: prefilled at the next step with its prompt and its tokens so far."""
        kept.ctx = ctx
        self.joining.append(kept)

    def _forward(self, members: list[_Member], run: Callable[[], torch.Tensor], prefill: bool) -> torch.Tensor:
        """One forward pass over `members`' rows, in order: their prompts (`prefill`), or their next
        tokens (sae_steer wraps it to steer each row)."""
        return run()

    def _sample(self, members: list[_Member], logits: torch.Tensor) -> torch.Tensor:
        """Each row's next token, on the device, and handed to its member: one read back for the batch.

        Greedy rows of every member take one argmax over the whole batch, in the
        logits' own dtype (float32 would pick the same: widening keeps order and ties).
        """
        if all(member.params.temperature == 0 for member in members):
            tokens = logits.argmax(dim=-1)
        else:
            parts, start = [], 0
            for member in members:
                end = start + len(member.rows)
                parts.append(member.sample(logits[start:end]))
                start = end
            tokens = torch.cat(parts)
        ids, start = tokens.tolist(), 0
        for member in members:
            end = start + len(member.rows)
            try:
                member.take(ids[start:end], self.model)
            except Exception as exc:  # noqa: BLE001 (its own job ends with it, not the batch's others)
                member.failure = exc
            start = end
        return tokens

    def _keep(self, members: list[_Member]) -> None:
        """Keep only these members' rows (with none left, the next batch starts afresh)."""
        if members == self.members:
            return
        keep, start = [], 0
        for member in self.members:
            if member in members:
                keep.extend(range(start, start + len(member.rows)))
            start += len(member.rows)
        self.members = members
        if not members:
            self.pending = None
            self.decoder = type(self.decoder)(self.model)
            return
        assert self.pending is not None
        self.pending = self.pending[torch.tensor(keep, device=self.pending.device)]
        self.decoder.keep(keep)


# The server's caps on a generation's params (`sae_steer`'s too).
CAPS = {"prompts": "max_prompts", "token_ids": "max_prompts", "max_tokens": "max_tokens"}


@tool(
    partial=GeneratePartial,
    check=check,
    cost=cost,
    caps=CAPS,
    sequences=("prompts",),
    batch=Generation,
    needs={Capability.NEXT_TOKEN},
)
def generate(model: Model, params: GenerateParams, ctx: Context) -> GenerateResult:
    """Complete each prompt, streaming tokens as they are sampled."""
    return run_alone(Generation(model), params, ctx)
