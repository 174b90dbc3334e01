"""A tool's job as requests to an OpenAI-compatible server, and its result from the server's answers.

One class per tool an inference server can answer (backends/inference.py drives them):

- `generate`: `/completions` (prompts, token ids) or `/chat/completions` (messages),
  streamed; a partial per chunk, the result assembled from them;
- `loglikelihood`: each prompt and continuation tokenized by the server as a local
  model tokenizes them (`/tokenize`, with and without special tokens), then one
  `/completions` of the joined ids with `prompt_logprobs`: each continuation token's
  log-probability given what precedes it, and whether it was the most likely one
  (its rank 1);
- `logprobs`: the texts tokenized so (or the ids given), one `/completions` with
  `prompt_logprobs` = top (each token's number, and the alternatives at its position)
  and, for `next_token`, one generated greedy token's `logprobs`;
- `predict`: one `/completions` of one token with `logprobs` = top_k, the tokens as ids
  (`return_tokens_as_token_ids`), each id's text from `/detokenize`.

All but `generate` use vLLM's extensions of the API (`/tokenize`, `/detokenize`,
`prompt_logprobs`, `return_tokens_as_token_ids`); each class `needs` the capabilities
backends/server_probes.py shows on the server at start, and is offered only where they
are. Numbers are the server's own, as it computed them (float32 on CPU:
tests/test_inference_servers.py measures how far they are from transformers' on the
same weights); a sum is taken in float64 and given as float32, as the local tools give
theirs. A token's text is the server's decoding of it alone: `/detokenize`, or the
`decoded_token` it gives with prompt log-probabilities (for a SentencePiece tokenizer vLLM
keeps a leading space there that decoding the token alone drops).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import msgspec
import numpy as np

from gateway.cost import Cost, Shape
from gateway.errors import ApiError
from gateway.jobs import Job
from gateway.protocol import Code, Status
from gateway.tools.base import CostFn
from gateway.tools.generate import GeneratePartial, GenerateResult, Usage
from gateway.tools.loglikelihood import LoglikelihoodResult
from gateway.tools.logprobs import LogprobsResult, Scored, TokenLogprob
from gateway.tools.predict import PredictResult, TokenProb

# A JSON request to the server; raises the protocol's refusal. The link bounds how many are open at
# once (backends/inference.py), so a job's many /tokenize or /detokenize requests wait their turn there.
Post = Callable[[str, dict[str, Any]], Awaitable[Any]]


class StreamedChunk(msgspec.Struct):
    """What one streamed chunk of `/completions` or `/chat/completions` carries that a job reads."""

    class _Delta(msgspec.Struct):
        content: str | None = None

    class _StreamedChoice(msgspec.Struct):
        index: int = 0
        text: str | None = None  # /completions
        delta: StreamedChunk._Delta | None = None  # /chat/completions
        finish_reason: str | None = None
        token_ids: list[int] | None = None  # vLLM's, with `return_token_ids`

    class _Usage(msgspec.Struct):
        prompt_tokens: int = 0
        completion_tokens: int = 0

    class _Error(msgspec.Struct):
        message: str = ""
        code: int | str | None = None

    choices: list[_StreamedChoice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    # A refusal the server makes once its stream has begun (vLLM checks token ids there).
    error: _Error | None = None


def refusal(status: int, body: bytes, server: str) -> ApiError:
    """The protocol's error for a server's non-2xx answer to a request."""
    message = ""
    with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError):
        decoded = msgspec.json.decode(body)
        error = decoded.get("error", decoded) if isinstance(decoded, dict) else {}
        message = str(error.get("message", "")) if isinstance(error, dict) else str(error)
    message = message or body[:500].decode(errors="replace") or f"HTTP {status}"
    if status in (400, 413, 422):
        lowered = message.lower()
        if "context length" in lowered or "maximum model length" in lowered or "too long" in lowered:
            return ApiError(Code.TOO_LONG, f"{server}: {message}")
        return ApiError(Code.INVALID_PARAMS, f"{server}: {message}")
    if status == 429:
        return ApiError(Code.OVERLOADED, f"{server} is overloaded: {message}", retry_after=1)
    return ApiError(Code.BACKEND_UNAVAILABLE, f"{server} answered {status}: {message}", retry_after=5)


class _Counted:
    """What a tool's `cost` reads of its model, for a model on an inference server: the texts' token
    ids as the server gave them (one token for a text not tokenized yet: a lower bound, as no price
    grows smaller with more tokens), and one for every size of the model. The result a tool prices
    depends on its params and those token counts alone; the memory it prices is the server's own
    concern (backends/inference.py, `ServerLink.price`), so the sizes it is worked out from do not matter."""

    vocab_size = 1

    def __init__(self, tokenized: dict[tuple[str, bool], list[int]]) -> None:
        self.tokenized = tokenized
        self.memo: dict[str, Any] = {"shape": Shape(layers=1, hidden=1, intermediate=1, heads=1, kv_heads=1, vocab=1, dtype_bytes=1)}

    def has(self, capability: Any) -> bool:
        return False

    def encode(self, text: str, field: str = "input", bounded: bool = True) -> list[int]:
        return self.tokenized.get((text, True)) or [0]

    def encode_continuation(self, text: str, field: str = "input", bounded: bool = True) -> list[int]:
        return self.tokenized.get((text, False)) or [0]

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return [0]


class Work:
    """One job's requests. `check` (the params alone) runs first, then `prepare` (tokenizing, the
    request's body) before the main request is sent; a streamed one feeds `take` and ends with
    `result`, another ends with `answer` of its body. `price` is the tool's own price of it."""

    stream: ClassVar[bool] = False
    needs: ClassVar[frozenset[str]] = frozenset()  # capabilities the server must have shown (backends/server_probes.py)
    path = "/completions"

    def __init__(self, params: Any, model: str, post: Post, *, token_ids: bool = False, context: int | None = None) -> None:
        self.params, self.model, self.post = params, model, post
        self.token_ids, self.context = token_ids, context
        self.body: dict[str, Any] = {}
        self.tokenized: dict[tuple[str, bool], list[int]] = {}  # (text, with special tokens): the server's ids

    def check(self) -> None:
        """The params' own refusals, before the job is priced or the server asked anything."""

    def refuse_windows(self) -> None:
        """Windows (gateway/tools/windows.py) are passes run here, over a model's own tokens and
        states: an inference server scores whole sequences within its context."""
        if getattr(self.params, "window", None) is not None:
            raise ApiError(
                Code.INVALID_PARAMS,
                "windows run on models served by the gateway itself, not on an inference server; "
                "leave window out and keep the sequence within the model's context",
                field="window",
            )

    def price(self, cost: CostFn) -> Cost:
        """The local tool's `cost` of this job, its texts counted in the server's tokens where it has
        tokenized them: one formula prices a job on either kind of model (gateway/cost.py)."""
        return cost(_Counted(self.tokenized), self.params)  # type: ignore[arg-type]

    async def tokenize(self, texts: list[tuple[str, bool]]) -> list[list[int]]:
        """Each text's token ids from the server, with the special tokens a prompt gets or without."""
        ids = await _tokenize(self.post, self.model, texts)
        self.tokenized.update(zip(texts, ids))
        return ids

    async def prepare(self) -> None:
        pass

    def take(self, chunk: StreamedChunk, job: Job) -> None:
        raise NotImplementedError

    def result(self) -> Any:
        raise NotImplementedError

    async def answer(self, data: Any) -> Any:
        raise NotImplementedError


class Generating(Work):
    """`generate`: streamed, a partial per chunk."""

    stream = True
    needs = frozenset({"stream"})

    def check(self) -> None:
        given = [name for name in ("prompts", "messages", "token_ids") if getattr(self.params, name) is not None]
        if not given:
            raise ApiError(Code.INVALID_PARAMS, "required: prompts (plain text), messages (a conversation) or token_ids", field="prompts")
        if len(given) > 1:
            raise ApiError(
                Code.INVALID_PARAMS, f"give one of prompts (plain text), messages (a conversation) and token_ids, not {' and '.join(given)}",
                field=given[1],
            )

    async def prepare(self) -> None:
        params = self.params
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if params.n > 1:
            body["n"] = params.n  # choice i * n + j: prompt i's j-th, as the gateway orders them
        for key in ("top_k", "seed", "stop"):
            if getattr(params, key) is not None:
                body[key] = getattr(params, key)
        if self.token_ids:
            body["return_token_ids"] = True  # each chunk's token ids, as a local model's partials carry
        if params.messages is not None:
            self.path = "/chat/completions"
            body["messages"] = [msgspec.structs.asdict(m) for m in params.messages]
            rows = params.n
        else:
            body["prompt"] = params.token_ids if params.token_ids is not None else params.prompts
            rows = len(body["prompt"]) * params.n
        self.body = body
        self.texts = [""] * rows
        self.finish = ["length"] * rows
        self.usage = Usage(0, 0, 0)
        self.started = False

    def take(self, chunk: StreamedChunk, job: Job) -> None:
        for choice in chunk.choices:
            i = choice.index
            if not 0 <= i < len(self.texts):
                continue
            text = choice.text if choice.text is not None else (choice.delta.content if choice.delta else None) or ""
            if choice.finish_reason is not None:
                self.finish[i] = "length" if choice.finish_reason == "length" else "stop"
            if not text and not choice.token_ids:
                continue
            if not self.started:
                self.started = True
                job.set_status(Status.RUNNING)
            self.texts[i] += text
            job.partial(GeneratePartial(i, text, choice.token_ids or []))
        if chunk.usage is not None:
            prompt, completion = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            self.usage = Usage(prompt, completion, prompt + completion)

    def result(self) -> GenerateResult:
        return GenerateResult(self.texts, self.usage, self.finish)


async def _tokenize(post: Post, model: str, texts: list[tuple[str, bool]]) -> list[list[int]]:
    """Each text's token ids, with the special tokens a prompt gets or without."""
    answers = await asyncio.gather(*(post("/tokenize", {"model": model, "prompt": text, "add_special_tokens": special}) for text, special in texts))
    return [[int(t) for t in answer["tokens"]] for answer in answers]


async def _texts(post: Post, model: str, ids: list[int]) -> dict[int, str]:
    """Each distinct token's text, decoded alone."""
    distinct = list(dict.fromkeys(ids))
    answers = await asyncio.gather(*(post("/detokenize", {"model": model, "tokens": [i]}) for i in distinct))
    return {i: str(answer["prompt"]) for i, answer in zip(distinct, answers)}


def _room(context: int | None, length: int, field: str, what: str) -> None:
    # The server takes a prompt only with room for the one token it generates after it.
    if context is not None and length + 1 > context:
        raise ApiError(
            Code.TOO_LONG, f"{what} {length} tokens; the model's inference server takes at most {context - 1} (with one to generate)",
            field=field,
        )


def _generated(choice: dict[str, Any]) -> tuple[int, float, list[tuple[int, float]]]:
    """A one-token completion's token, its log-probability and its top alternatives (ids, most likely first)."""
    logprobs = choice["logprobs"]
    token = int(str(logprobs["tokens"][0]).removeprefix("token_id:"))
    top = sorted(((int(key.removeprefix("token_id:")), float(lp)) for key, lp in logprobs["top_logprobs"][0].items()), key=lambda kv: -kv[1])
    return token, float(logprobs["token_logprobs"][0]), top


class Likelihood(Work):
    """`loglikelihood`: the continuation's tokens scored by the server's `prompt_logprobs`."""

    needs = frozenset({"tokenizer", "prompt_logprobs"})

    def check(self) -> None:
        params = self.params
        if len(params.continuations) != len(params.prompts):
            raise ApiError(
                Code.INVALID_PARAMS,
                f"must have one entry per prompt ({len(params.prompts)}), got {len(params.continuations)}",
                field="continuations",
            )

    async def prepare(self) -> None:
        params = self.params
        ids = await self.tokenize([(p, True) for p in params.prompts] + [(c, False) for c in params.continuations])
        n = len(params.prompts)
        self.pairs = list(zip(ids[:n], ids[n:]))
        for i, (context, continuation) in enumerate(self.pairs):
            if not context:
                raise ApiError(Code.INVALID_PARAMS, "must not be empty on a model served by an inference server", field=f"prompts[{i}]")
            if not continuation:
                raise ApiError(Code.INVALID_PARAMS, "must not be empty", field=f"continuations[{i}]")
            _room(self.context, len(context) + len(continuation), f"prompts[{i}]", "prompt + continuation are")
        self.body = {
            "model": self.model, "prompt": [c + k for c, k in self.pairs], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1,
        }

    async def answer(self, data: Any) -> LoglikelihoodResult:
        choices = sorted(data["choices"], key=lambda c: c["index"])
        ll, greedy = [], []
        for (context, continuation), choice in zip(self.pairs, choices):
            positions = choice["prompt_logprobs"][len(context):]
            scored = [entry[str(token)] for entry, token in zip(positions, continuation)]
            ll.append(float(np.float32(math.fsum(s["logprob"] for s in scored))))
            greedy.append(all(s["rank"] == 1 for s in scored))
        return LoglikelihoodResult(ll=ll, is_greedy=greedy)


class PromptScoring(Work):
    """`logprobs`: each token's number and the alternatives at its position from `prompt_logprobs`,
    the next greedy token from the same request's one generated token."""

    needs = frozenset({"tokenizer", "prompt_logprobs", "logprobs_ids"})

    def check(self) -> None:
        if (self.params.prompts is None) == (self.params.token_ids is None):
            raise ApiError(Code.INVALID_PARAMS, "give prompts (text) or token_ids, one of the two", field="prompts")

    async def prepare(self) -> None:
        params = self.params
        field = "prompts" if params.prompts is not None else "token_ids"
        self.rows = params.token_ids if params.token_ids is not None else await self.tokenize([(p, True) for p in params.prompts])
        for i, ids in enumerate(self.rows):
            if not ids:
                raise ApiError(Code.INVALID_PARAMS, "has no tokens to score", field=f"{field}[{i}]")
            _room(self.context, len(ids), f"{field}[{i}]", "the text is")
        self.body = {
            "model": self.model, "prompt": self.rows, "max_tokens": 1, "temperature": 0, "prompt_logprobs": params.top,
            "return_tokens_as_token_ids": True,
        }
        if params.next_token:
            self.body["logprobs"] = params.top

    async def answer(self, data: Any) -> LogprobsResult:
        top = self.params.top
        choices = sorted(data["choices"], key=lambda c: c["index"])
        texts: dict[int, str] = {}
        for choice in choices:
            for entry in choice["prompt_logprobs"][1:]:
                texts.update((int(k), v["decoded_token"]) for k, v in entry.items() if isinstance(v.get("decoded_token"), str))
        generated = [_generated(choice) for choice in choices] if self.params.next_token else []
        wanted = [ids[0] for ids in self.rows] + [i for token, _, alts in generated for i in (token, *(a for a, _ in alts[:top]))]
        texts |= await _texts(self.post, self.model, [i for i in wanted if i not in texts])
        sequences = []
        for n, (ids, choice) in enumerate(zip(self.rows, choices)):
            entries = choice["prompt_logprobs"]
            scored = Scored(
                token_ids=list(ids), tokens=[texts[t] for t in ids],
                logprobs=[None, *(float(entries[t][str(ids[t])]["logprob"]) for t in range(1, len(ids)))],
            )
            if top:
                scored.top = [
                    [TokenLogprob(int(k), texts[int(k)], float(v["logprob"])) for k, v in sorted(entry.items(), key=lambda kv: kv[1]["rank"]) if v["rank"] <= top][:top]
                    for entry in entries[1:]
                ]
            if generated:
                token, logprob, alts = generated[n]
                scored.next_token = TokenLogprob(token, texts[token], logprob)
                if top:
                    scored.next_top = [TokenLogprob(i, texts[i], lp) for i, lp in alts[:top]]
            sequences.append(scored)
        return LogprobsResult(sequences)


class Prediction(Work):
    """`predict`: the top_k next tokens, by one token's `logprobs`."""

    needs = frozenset({"tokenizer", "logprobs_ids"})

    async def prepare(self) -> None:
        self.body = {
            "model": self.model, "prompt": self.params.prompt, "max_tokens": 1, "temperature": 0,
            "logprobs": self.params.top_k, "return_tokens_as_token_ids": True,
        }

    async def answer(self, data: Any) -> PredictResult:
        ranked = _generated(data["choices"][0])[2][: self.params.top_k]
        texts = await _texts(self.post, self.model, [i for i, _ in ranked])
        return PredictResult([TokenProb(id=i, text=texts[i], prob=float(np.float32(math.exp(lp)))) for i, lp in ranked])


WORKS: dict[str, type[Work]] = {"generate": Generating, "loglikelihood": Likelihood, "logprobs": PromptScoring, "predict": Prediction}
