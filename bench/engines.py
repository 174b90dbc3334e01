"""Engines: generation on vLLM, bare and through the gateway, against the gateway's own engine, on one model.

One gateway serves the bundled SmolLM2-135M-Instruct twice: `local` in an engine
process of its own, and `vllm` on a vLLM server the gateway starts (`vllm:`, from
the project's `.vllm`, `make vllm`), both with a 2048-token context and as the
gateway starts them by default: no `--dtype`, no KV cache setting (on a CPU the
gateway gives vLLM a 2 GiB cache and, without bfloat16 instructions, float32;
the report states what it chose). Three ways to the same completions:

- bare vLLM: the server's own `/v1/completions`, on its own port;
- streamgate over vLLM: the gateway's `/v1/completions`, model `vllm`;
- streamgate local: the gateway's `/v1/completions`, model `local`.

At each level of C concurrent clients (`--clients`, default 1,4,16,64) each way
runs a closed loop: every client sends `--per-client` requests (default 2) one
after the other, each a streamed greedy completion of `--tokens` tokens (default
64) of one prompt (a fixed list of 16, in turn). The three take turns, round by
round (`--rounds`, default 2), the order rotating. `--distinct`: every request
of a round its own prompt (the list's, numbered), so that no prefill sees one
prompt twice (the gateway's engine runs a prompt that several joining rows
share once). Per way and level, the median
round: tokens/s (completion tokens, from each answer's usage, over the round's
wall time), and the first token's time (request to the first chunk with text),
p50 and p99 over every request of every round.

The completions are checked as well as timed: the gateway's over vLLM against
bare vLLM's, prompt by prompt (the same server: they must be equal, or the
script exits 1), and the local engine's against them (reported: another
runtime's float32 may pick another token where two are close).

Targets: streamgate over vLLM >= 0.95x bare vLLM's tokens/s and its first token
p50 within +10 ms of bare vLLM's, at every level; streamgate over vLLM >= 1.8x
streamgate local's tokens/s at 16 and 64 clients; streamgate local's first
token p50 <= 2x bare vLLM's at 64 clients. --quick: 1 and 4 clients, 8
tokens, one request each, one round (vLLM's start, about 100 s the first time,
is most of it).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

TITLE = "engines: generation on vLLM, bare and through the gateway, against the gateway's own engine"
PROMPTS = [
    "Once upon a time", "The capital of France is", "Here is a recipe for pancakes:", "The three laws of motion are",
    "Write a haiku about the sea.", "A good name for a cat is", "The history of Rome begins", "In computer science, a hash table",
    "The weather today is", "My favourite book is", "To make a paper plane,", "The largest planet in the solar system",
    "Dear diary, today", "The best way to learn a language is", "Photosynthesis is the process", "A list of prime numbers:",
]
WAYS = ["bare vLLM", "streamgate over vLLM", "streamgate local"]
VLLM_START_S = 900


@dataclass
class Completion:
    """One streamed request: when it was sent, when its first text came, what it said, and its tokens."""

    prompt: int
    sent: float
    first: float | None = None
    text: str = ""
    tokens: int = 0
    error: str | None = None


@dataclass
class Round:
    completions: list[Completion] = field(default_factory=list)
    wall: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return sum(c.tokens for c in self.completions) / self.wall


def options(parser: Any) -> None:
    parser.add_argument("--clients", default=None, help="Levels of concurrent clients, comma-separated (default 1,4,16,64).")
    parser.add_argument("--tokens", type=int, default=None, help="Tokens per completion (default 64).")
    parser.add_argument("--per-client", type=int, default=None, help="Requests each client sends per round (default 2).")
    parser.add_argument("--rounds", type=int, default=None, help="Rounds per level (default 2).")
    parser.add_argument(
        "--distinct", action="store_true",
        help="Every request of a round its own prompt (the list's, numbered), so that no two are the same text.",
    )


async def _data(response: common.Response) -> Any:
    """The `data:` of each event of an OpenAI stream, with when it arrived (LF or CRLF line ends: the
    gateway's OpenAI routes write CRLF, as sse-starlette does, and vLLM LF)."""
    buffer = b""
    async for chunk in response.chunks():
        at = time.time()
        buffer += chunk.replace(b"\r\n", b"\n")
        *blocks, buffer = buffer.split(b"\n\n")
        for block in blocks:
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    yield at, line[5:].strip()


def prompt_text(key: int) -> str:
    """The prompt of `key`: the list's in turn, numbered past the list's length (--distinct)."""
    text = PROMPTS[key % len(PROMPTS)]
    return text if key < len(PROMPTS) else f"{key}. {text}"


async def complete(port: int, model: str, prompt: int, tokens: int) -> Completion:
    body = {
        "model": model, "prompt": prompt_text(prompt), "max_tokens": tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await common.Response.open(port, "POST", "/v1/completions", msgspec.json.encode(body))
    done = Completion(prompt, response.sent)
    try:
        if response.status != 200:
            done.error = f"{response.status}: {(await response.body())[:200]!r}"
            return done
        async for at, data in _data(response):
            if data == b"[DONE]":
                break
            chunk = msgspec.json.decode(data)
            if "error" in chunk:
                done.error = str(chunk["error"])
                break
            for choice in chunk.get("choices") or []:
                if choice.get("text") and done.first is None:
                    done.first = at
                done.text += choice.get("text") or ""
            if chunk.get("usage"):
                done.tokens = chunk["usage"]["completion_tokens"]
    finally:
        response.close()
    return done


async def one_round(port: int, model: str, clients: int, per_client: int, tokens: int, distinct: bool = False) -> Round:
    result = Round()
    counter = iter(range(clients * per_client))

    async def client() -> None:
        for index in counter:
            result.completions.append(await complete(port, model, index if distinct else index % len(PROMPTS), tokens))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    result.wall = time.perf_counter() - start
    return result


def _ms(values: list[float], q: float) -> float:
    return common.percentile(values, q) * 1000 if values else float("nan")


async def run(bench: common.Bench, report: common.Report) -> list[str]:
    args, quick = bench.args, bench.quick
    levels = [int(c) for c in (args.clients or ("1,4" if quick else "1,4,16,64")).split(",")]
    tokens = args.tokens or (8 if quick else 64)
    per_client = args.per_client or (1 if quick else 2)
    rounds = args.rounds or (1 if quick else 2)

    from backends.loading import default_gguf

    source = args.model or str(default_gguf())  # (`--model PATH`: another causal LM, both ways)
    common.step("starting a gateway with the model on its own engine and on a vLLM server")
    gateway = bench.streamgate(
        # The default start: what a user gets without tuning (the gateway sizes and types vLLM itself).
        "serve", "--model", f"local={source}", "--model", f"vllm=vllm:{source}",
        "--vllm-args", "--max-model-len 2048", "--queue-size", "512", "--max-queued-per-owner", "512",
        model=None, name="gateway",
    )
    gateway.wait_ready(VLLM_START_S)
    ready = common.readyz(gateway)
    (server,) = [e for e in ready["engines"] if e["device"] == "vllm server"]
    vllm_port = int(server["url"].rsplit(":", 1)[1].split("/")[0])
    port = common.port_of(gateway)
    report.fact("machine", common.machine(ready.get("device", "?")))
    report.fact("model", f"SmolLM2-135M-Instruct (the bundled model, converted), context 2048; local {ready.get('dtype')}, "
                f"vLLM {server.get('dtype') or 'its own dtype'} with a KV cache of {server.get('kv_cache_bytes') or 'its own sizing'} "
                "bytes, as the gateway starts them by default")
    prompts = ("every request its own prompt (the list's in turn, numbered)" if args.distinct
               else f"prompts in turn from a list of {len(PROMPTS)}")
    report.fact("load", f"closed loops of {', '.join(map(str, levels))} clients, {per_client} streamed greedy "
                f"/v1/completions each per round, {tokens} tokens, {prompts}")
    report.fact("rounds", f"{rounds} per level, the three ways in turn, the order rotating; tokens/s the median round's")
    ways = {"bare vLLM": (vllm_port, "vllm"), "streamgate over vLLM": (port, "vllm"), "streamgate local": (port, "local")}

    common.step("warming up each way")
    for name, (at, model) in ways.items():
        warm = await complete(at, model, 0, 4)
        if warm.error:
            raise RuntimeError(f"{name} failed its warm-up: {warm.error}")

    results: dict[tuple[str, int], list[Round]] = {}
    for clients in levels:
        for r in range(rounds):
            order = WAYS[r % 3:] + WAYS[: r % 3]
            for name in order:
                common.step(f"{clients} clients, round {r + 1}/{rounds}: {name}")
                at, model = ways[name]
                results.setdefault((name, clients), []).append(await one_round(at, model, clients, per_client, tokens, args.distinct))

    rows, disagreed, failed = [], [], []
    figures: dict[tuple[str, int], tuple[float, float, float]] = {}
    for clients in levels:
        texts: dict[str, dict[int, str]] = {}
        for name in WAYS:
            done = [c for rnd in results[name, clients] for c in rnd.completions]
            errors = [c.error for c in done if c.error]
            if errors:
                failed.append(f"{name} at {clients} clients: {len(errors)} errors, first {errors[0]}")
            firsts = [c.first - c.sent for c in done if c.first is not None]
            rate = statistics.median(rnd.tokens_per_s for rnd in results[name, clients])
            figures[name, clients] = (rate, _ms(firsts, 50), _ms(firsts, 99))
            texts[name] = {c.prompt: c.text for c in done if not c.error}
        same_server = sum(texts["streamgate over vLLM"].get(p) == t for p, t in texts["bare vLLM"].items())
        same_local = sum(texts["streamgate local"].get(p) == t for p, t in texts["bare vLLM"].items())
        if same_server != len(texts["bare vLLM"]):
            disagreed.append(f"{clients} clients: {len(texts['bare vLLM']) - same_server} prompts")
            prompt, bare_text = next((p, t) for p, t in texts["bare vLLM"].items() if texts["streamgate over vLLM"].get(p) != t)
            report.note(f"{clients} clients, the first that differs: {prompt_text(prompt)!r}: bare vLLM {bare_text!r}, "
                        f"through the gateway {texts['streamgate over vLLM'].get(prompt)!r}")
        bare = figures["bare vLLM", clients]
        for name in WAYS:
            rate, p50, p99 = figures[name, clients]
            same = {"bare vLLM": "-", "streamgate over vLLM": f"{same_server}/{len(texts['bare vLLM'])}",
                    "streamgate local": f"{same_local}/{len(texts['bare vLLM'])}"}[name]
            rows.append([clients, name, rate, common.fmt(common.ratio(rate, bare[0]), 2) + "x", p50, p99, p50 - bare[1], same])
    report.table(
        ["clients", "way", "tokens/s", "vs bare vLLM", "first token p50 ms", "p99 ms", "p50 over bare ms", "same text as bare"],
        rows, title="Streamed greedy completions, closed loop",
    )
    report.note("vs bare vLLM: tokens/s over bare vLLM's at the same level; same text: prompts whose completion is bare "
                "vLLM's, character for character")

    for clients in levels:
        bare, over, local = (figures[name, clients] for name in WAYS)
        ratio = common.ratio(over[0], bare[0])
        report.target(f"streamgate over vLLM >= 0.95x bare vLLM's tokens/s at {clients} clients",
                      common.fmt(ratio, 2) + "x", ratio is not None and ratio >= 0.95)
        report.target(f"streamgate over vLLM's first token p50 within +10 ms of bare vLLM's at {clients} clients",
                      f"{over[1] - bare[1]:+.1f} ms", over[1] - bare[1] <= 10)
        if clients in (16, 64):
            ratio = common.ratio(over[0], local[0])
            report.target(f"streamgate over vLLM >= 1.8x streamgate local's tokens/s at {clients} clients",
                          common.fmt(ratio, 2) + "x", ratio is not None and ratio >= 1.8)
        if clients == 64:
            ratio = common.ratio(local[1], bare[1])
            report.target("streamgate local's first token p50 <= 2x bare vLLM's at 64 clients",
                          common.fmt(ratio, 2) + "x", ratio is not None and ratio <= 2)
    if failed:
        raise RuntimeError("; ".join(failed))
    return disagreed


if __name__ == "__main__":
    common.main(run, TITLE, __doc__, options, disagreed="the gateway's completions over vLLM differ from vLLM's own")
