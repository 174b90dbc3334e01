"""Proving what an inference server can answer, before it serves a job.

An OpenAI-compatible server promises streamed completions; what else it gives
(vLLM's extensions: each chunk's token ids, a tokenizer's endpoints, log-probabilities
keyed by token id, prompt log-probabilities) differs between servers and versions, and a
field that is there but means something else would make silently wrong numbers. So, as
gateway/models/probes.py does for a model's weights, each capability is shown on one
short prompt once the server is up, and granted or recorded, in words, as missing:

- `stream`: a streamed greedy completion gives text;
- `token_ids`: its chunks carry the ids of their tokens (`return_token_ids`);
- `tokenizer`: `/tokenize` and `/detokenize` give the prompt back;
- `logprobs_ids`: a greedy token's `logprobs`, keyed by token id, have it first;
- `prompt_logprobs`: the prompt with that greedy token appended scores it, at its
  position, with the same log-probability (to rounding) and rank 1: the numbers are
  causal next-token log-probabilities, aligned as the tools read them;
- `priority`: a request's `priority` is read (one that is not a number is refused) and
  taken (vLLM: it orders its queue by it under `--scheduling-policy priority`, and by
  arrival under `fcfs`): a job's class of users is then sent as its request's priority.
  A server that ignores the field, or refuses it, is sent none.

A tool needs a set of these (backends/server_requests.py: each `Work.needs`); one whose
needs are not all shown is not offered, and says which check failed.
"""

from __future__ import annotations

from typing import Any, Protocol

import httpx
import msgspec

from backends.server_requests import refusal
from gateway.errors import ApiError
from gateway.protocol import Code

PROMPT = "The capital of France is"
# One server scoring the same token twice, in batches of another shape: float32 rounding.
SAME_NUMBER = 1e-3

MEANINGS = {
    "stream": "streamed completions",
    "token_ids": "each streamed chunk's token ids",
    "tokenizer": "its tokenizer's /tokenize and /detokenize",
    "logprobs_ids": "log-probabilities keyed by token id",
    "prompt_logprobs": "prompt log-probabilities",
    "priority": "request priorities (vLLM's --scheduling-policy priority)",
}


class Server(Protocol):
    """What a probe asks of an inference server's link (backends/inference.py)."""

    http: httpx.AsyncClient
    upstream: str | None

    async def post(self, path: str, body: dict[str, Any]) -> Any: ...


class _StreamChunk(msgspec.Struct):
    class _ProbeChoice(msgspec.Struct):
        text: str | None = None
        token_ids: list[int] | None = None

    choices: list[_ProbeChoice] = msgspec.field(default_factory=list)


async def _streamed(server: Server) -> tuple[str, list[int] | None]:
    """A streamed greedy completion's text, and its token ids if every chunk with text carries them."""
    body = {"model": server.upstream, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "stream": True, "return_token_ids": True}
    text, ids, every = "", [], True
    async with server.http.stream("POST", "/completions", json=body, timeout=60.0) as answer:
        if answer.status_code != 200:
            raise refusal(answer.status_code, await answer.aread(), "POST /completions")
        async for line in answer.aiter_lines():
            data = line.removeprefix("data:").strip()
            if not line.startswith("data:") or data == "[DONE]":
                continue
            for choice in msgspec.json.decode(data, type=_StreamChunk).choices:
                text += choice.text or ""
                if choice.text and choice.token_ids is None:
                    every = False
                ids += choice.token_ids or []
    return text, (ids if every and ids else None)


async def _refusal(server: Server, body: dict[str, Any]) -> ApiError | None:
    """The server's refusal of a completion of `body` (None: taken); `overloaded` is raised: ask again."""
    try:
        await server.post("/completions", body)
    except ApiError as exc:
        if exc.code == Code.OVERLOADED:
            raise
        return exc
    return None


async def _priority(server: Server) -> tuple[str | None, None]:
    """Whether the server reads a request's `priority` (see the module's doc). A refusal is a reason
    it is not sent one, never the server's trouble: only `overloaded` says to ask again."""
    body = {"model": server.upstream, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    refused = await _refusal(server, {**body, "priority": "first"})
    if refused is None:
        return "a priority that is not a number was taken: the server does not read the field", None
    if refused.code != Code.INVALID_PARAMS:
        return f"a priority that is not a number was answered {refused.status}: {refused.message}", None
    refused = await _refusal(server, {**body, "priority": -1})
    return (None if refused is None else f"a priority of -1 was refused: {refused.message}"), None


async def prove(server: Server) -> tuple[set[str], dict[str, str]]:
    """The capabilities shown, and why each of the others is missing. Raises what says that the
    server did not answer (a transport error, its 5xx or 429 as the protocol's error)."""
    have: set[str] = set()
    missing: dict[str, str] = {}

    async def check(name: str, step: Any) -> Any:
        try:
            reason, value = await step()
        except httpx.TransportError:
            raise  # not an answer: the server is not up after all, and is probed again when it is
        except ApiError as exc:
            if exc.code in (Code.BACKEND_UNAVAILABLE, Code.OVERLOADED):
                raise
            reason, value = f"asking for it failed: {exc.message}", None
        except (httpx.HTTPError, msgspec.DecodeError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            reason, value = f"asking for it failed: {exc!r}", None
        if reason is None:
            have.add(name)
        else:
            missing[name] = f"{MEANINGS[name]}: {reason}"
        return value

    async def stream() -> tuple[str | None, Any]:
        text, ids = await _streamed(server)
        return (None if text else "a streamed completion gave no text"), ids

    streamed_ids = await check("stream", stream)

    async def token_ids() -> tuple[str | None, None]:
        return (None if streamed_ids else "the chunks do not carry them (vLLM's return_token_ids)"), None

    await check("token_ids", token_ids)
    await check("priority", lambda: _priority(server))

    async def tokenizer() -> tuple[str | None, list[int]]:
        ids = [int(t) for t in (await server.post("/tokenize", {"model": server.upstream, "prompt": PROMPT}))["tokens"]]
        text = (await server.post("/detokenize", {"model": server.upstream, "tokens": ids}))["prompt"]
        return (None if PROMPT in text else f"the prompt's tokens detokenize to {text!r}"), ids

    ids = await check("tokenizer", tokenizer)
    if ids is None:
        for name in ("logprobs_ids", "prompt_logprobs"):
            missing[name] = f"{MEANINGS[name]}: not checked, for want of the tokenizer's tokens to check them on"
        return have, missing

    async def logprobs_ids() -> tuple[str | None, tuple[int, float] | None]:
        body = {
            "model": server.upstream, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1,
            "return_tokens_as_token_ids": True,
        }
        logprobs = (await server.post("/completions", body))["choices"][0]["logprobs"]
        token, logprob, top = logprobs["tokens"][0], float(logprobs["token_logprobs"][0]), logprobs["top_logprobs"][0]
        if not str(token).startswith("token_id:"):
            return f"the tokens are given as {token!r}, not by id (vLLM's return_tokens_as_token_ids)", None
        if max(top, key=top.get) != token:
            return "the greedy token is not the most likely of its top log-probabilities", None
        return None, (int(token.removeprefix("token_id:")), logprob)

    greedy = await check("logprobs_ids", logprobs_ids)
    if greedy is None:
        missing["prompt_logprobs"] = f"{MEANINGS['prompt_logprobs']}: not checked, for want of a greedy token's log-probability to check them against"
        return have, missing

    async def prompt_logprobs() -> tuple[str | None, None]:
        token, logprob = greedy
        body = {"model": server.upstream, "prompt": [*ids, token], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
        entries = (await server.post("/completions", body))["choices"][0]["prompt_logprobs"]
        if not isinstance(entries, list) or len(entries) != len(ids) + 1 or entries[0] is not None:
            return "they are not one per prompt token, the first without a number", None
        scored = entries[-1][str(token)]
        if scored["rank"] != 1 or abs(float(scored["logprob"]) - logprob) > SAME_NUMBER:
            return (
                f"the greedy token after the prompt scores {scored['logprob']} (rank {scored['rank']}) as the prompt's last token, "
                f"and {logprob} (rank 1) as the next token: they are not the causal next-token log-probabilities"
            ), None
        return None, None

    await check("prompt_logprobs", prompt_logprobs)
    return have, missing
