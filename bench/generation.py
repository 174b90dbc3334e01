"""Generation at the limit: `generate` through the gateway against plain transformers on the same model.

One gateway on the default model (SmolLM2-135M-Instruct, converted once and
cached; `--model PATH` for another; --quick: a tiny random model built for the
run), and the same checkpoint loaded with plain transformers in this process,
on the same device, dtype and number of torch threads. The two sides never run
at the same time: round by round they take turns, the order alternating.

A lone job. A greedy `generate` job of N tokens (`--tokens`, default 32) on one
prompt, sent as `token_ids` so that both sides start from the same ids,
against a plain decoding loop on them: `model(input_ids, use_cache=True)`
(with `logits_to_keep=1` where the model takes it, as `model.generate()` runs
a prompt), then `model(next_token, cache=..., use_cache=True)` and an
argmax per step, each token read back as a Python int (what any streaming
server does), ending at EOS as `generate` does. The plain loop's per-token
time is its decoding steps' time over their count. The gateway's is read two
ways:

- partial span: the time between the first and the last `partial` event at the
  client, over the tokens those events carried after the first. It is the
  decoding rate a client sees, with the prefill and each job's fixed costs
  (HTTP, queueing, the batch wait, the result) outside it. This is the figure
  the target is judged on.
- job time less prefill: the time from the request to the `data` event of the
  N-token job, less that of a 1-token job on the same prompt (prefill, first
  token and every fixed cost), over N - 1. It also counts what partials do not
  show (a slow last step, a late result).

Median and best of `--rounds` rounds, each an N-token job, a 1-token job and a
plain run; the gateway's ids (the partials' `token_ids`) must be the plain
loop's, or the script exits 1 after its report.

Batched. B concurrent one-prompt jobs through the gateway (`--batch-sizes`,
default 4 and 16; the gateway batches them), from the first request to the
last `data` event, against one `model.generate()` call on the same B prompts,
left-padded, greedy, N new tokens, in this process. jobs/s, tokens/s (tokens
generated, EOS included, over the wall time), the median of the rounds, how
many of the B completions are token for token the same on both sides, and the
CPU time the gateway and its engine processes spent per token event a client
got (their user + system time over the rounds, the model's steps included).

`--device cuda` runs both sides on the GPU, in bfloat16 unless `--dtype` says
otherwise (bench/common.py's flags; without `--device`, the device the gateway
would pick, one of them). The plain side takes the device and dtype the
gateway reports on /readyz. `--torch-threads N` (default: one less than the
cores, at least 1) is set in this process and in the gateway (its
`--torch-threads` flag, or OMP_NUM_THREADS where it has none); inter-op
threads are 1 on both sides.

Targets: a lone job's per-token time (partial span, median) <= 1.1x the plain
loop's; its greedy ids identical to the plain loop's.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402

from bench import common  # noqa: E402

TITLE = "generation: generate through the gateway vs plain transformers on the same model"
TARGET_PER_TOKEN = 1.1

# The default model continues it for well over 64 tokens without an EOS.
PROMPT = "Once upon a time, in a land far away, there lived"
# The lone job's prompt, then the batching benchmark's short prompts (its "tallest mountain" one left out).
PROMPTS = [PROMPT, *common.SHORT_PROMPTS[:6], common.SHORT_PROMPTS[7]]

def options(parser) -> None:
    parser.add_argument("--tokens", type=int, default=None, help="Tokens per job (default 32; --quick 8).")
    parser.add_argument("--rounds", type=int, default=None, help="Rounds of each measure (default 7; --quick 3).")
    parser.add_argument("--batch-sizes", default=None, help="Concurrent jobs, comma-separated (default 4,16; --quick 4).")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch threads on both sides (default: one less than the cores, at least 1).")
    parser.add_argument("--engine", default=None, choices=["thread", "process"],
                        help="The gateway's --engine (default: its own default).")


def has_threads_flag() -> bool:
    shown = subprocess.run([str(common.STREAMGATE), "serve", "--help"], capture_output=True, text=True, timeout=60)
    return "--torch-threads" in shown.stdout


def threads_flags(threads: int, threads_flag: bool) -> tuple[list[str], dict[str, str] | None]:
    """The gateway's torch threads: by `--torch-threads` where this streamgate has it, else OMP_NUM_THREADS."""
    if threads_flag:
        return ["--torch-threads", str(threads)], None
    return [], {"OMP_NUM_THREADS": str(threads)}


def default_device() -> str:
    """One device of those the gateway picks from by default (CUDA, then MPS, then CPU): with every GPU
    it would run a worker on each, and the plain side has one."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def plain_side(ready: dict[str, Any]) -> tuple[str, Any]:
    """The device and torch dtype the gateway reports on /readyz, for the plain side."""
    import torch

    return str(ready["device"]).split(",")[0], getattr(torch, str(ready["dtype"]))


def model_source(model: str | None) -> str:
    """Where the gateway's checkpoint is: the folder given, or the default model's converted copy."""
    if model:
        return model
    from backends.loading import cache_root, converted_path, resolve

    return str(converted_path(resolve(None), cache_root()))


class Plain:
    """The checkpoint as plain transformers runs it, in this process."""

    def __init__(self, source: str, device: str, dtype: Any) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        self.model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device).eval()
        # The prompt's last logits only, as model.generate() computes them (and the gateway).
        keeps = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.keep_last = {"logits_to_keep": 1} if keeps else {}
        eos = self.model.generation_config.eos_token_id
        self.eos = {self.tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
        # What the gateway pads with: the tokenizer's pad token, else its EOS.
        pad = self.tokenizer.pad_token_id
        self.pad = pad if pad is not None else self.tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()
        elif self.device.startswith("mps"):
            self.torch.mps.synchronize()

    def decode(self, ids: list[int], n: int) -> tuple[list[int], float, float]:
        """Greedy tokens (up to `n`, ending at EOS), the seconds to the first, and those after it."""
        torch = self.torch
        with torch.inference_mode():
            input_ids = torch.tensor([ids], device=self.device)
            self.sync()
            start = time.perf_counter()
            out = self.model(input_ids=input_ids, use_cache=True, **self.keep_last)
            past = out.cache
            token = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
            tokens = [token.item()]
            first = time.perf_counter()
            while len(tokens) < n and tokens[-1] not in self.eos:
                out = self.model(input_ids=token, cache=past, use_cache=True)
                past = out.cache
                token = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
                tokens.append(token.item())
            end = time.perf_counter()
        return tokens, first - start, end - first

    def generate(self, rows: list[list[int]], n: int) -> tuple[list[list[int]], float]:
        """`model.generate()` on the rows left-padded, greedy: each row's new tokens (to its EOS) and the seconds."""
        torch = self.torch
        width = max(len(ids) for ids in rows)
        input_ids = torch.tensor([[self.pad] * (width - len(ids)) + ids for ids in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows], device=self.device)
        with torch.inference_mode():
            self.sync()
            start = time.perf_counter()
            out = self.model.generate(
                input_ids=input_ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                temperature=None, top_p=None, top_k=None, pad_token_id=self.pad, eos_token_id=sorted(self.eos),
            )
            self.sync()
            seconds = time.perf_counter() - start
        completions = []
        for row in out[:, width:].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in self.eos), len(row))
            completions.append(row[:end])
        return completions, seconds


@dataclass
class GatewayJob:
    """One `generate` job as the client saw it: its tokens, and when the partials carrying them arrived."""

    tokens: list[int]
    arrivals: list[tuple[float, int]]  # (time, tokens received so far) at each partial
    latency: float  # request to `data` event, seconds
    first: float  # request to first partial, seconds
    done: float  # time.time() at the `data` event

    @property
    def span_per_token(self) -> float | None:
        if len(self.arrivals) < 2:
            return None
        (t0, n0), (t1, n1) = self.arrivals[0], self.arrivals[-1]
        return (t1 - t0) / (n1 - n0) if n1 > n0 else None


async def gateway_job(port: int, ids: list[int], n: int) -> GatewayJob:
    run = await common.run_job(port, "/generate/run", {"token_ids": [ids], "max_tokens": n})
    if not run.ok:
        raise RuntimeError(f"a generate job failed: {run.status} {run.events[-1].data if run.events else b''!r}")
    tokens: list[int] = []
    arrivals = []
    for event in run.events:
        if event.event == "partial":
            tokens += msgspec.json.decode(event.data)["token_ids"]
            arrivals.append((event.at, len(tokens)))
    assert run.terminal is not None
    first = arrivals[0][0] - run.sent if arrivals else float("nan")
    return GatewayJob(tokens, arrivals, run.latency, first, run.terminal.at)


async def gateway_batch(port: int, rows: list[list[int]], n: int) -> tuple[list[list[int]], float, list[float], int]:
    """B concurrent one-prompt jobs: each one's tokens, the seconds from the first request to the last result,
    each one's seconds from its request to its first token, and the token events (partials) they sent."""
    start = time.time()
    jobs = await asyncio.gather(*(gateway_job(port, ids, n) for ids in rows))
    return [job.tokens for job in jobs], max(job.done for job in jobs) - start, [job.first for job in jobs], sum(len(job.arrivals) for job in jobs)


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def best(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return min(values) if values else None


def ms(value: float | None) -> str:
    """Milliseconds to two places: a small model's tokens take a few."""
    return common.fmt(None if value is None else value * 1000, 2)


def _x(value: float | None) -> str:
    return common.fmt(value, 2) + ("x" if value is not None else "")


async def run(bench: common.Bench, report: common.Report) -> list[str] | None:
    args = bench.args
    quick = bench.quick
    n = args.tokens or (8 if quick else 32)
    rounds = args.rounds or (3 if quick else 7)
    sizes = [int(b) for b in (args.batch_sizes or ("4" if quick else "4,16")).split(",")]
    threads = args.torch_threads or max(1, len(os.sched_getaffinity(0)) - 1)

    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)

    model = bench.model(default_tiny=False)
    # The jobs of a batch are admitted by their priced memory (and --max-decoding-jobs, 256), as the gateway runs by default.
    flags = ["--queue-size", "256", "--max-queued-per-owner", "256", "--max-tokens", str(max(n, 16))]
    flags += common.device_flags(argparse.Namespace(device=args.device or default_device(), dtype=args.dtype))
    threads_flag = has_threads_flag()
    more, env = threads_flags(threads, threads_flag)
    flags += more
    if args.engine:
        flags += ["--engine", args.engine]
    threads_how = "--torch-threads" if threads_flag else "OMP_NUM_THREADS"
    common.step("starting the gateway")
    gateway = bench.streamgate("serve", *flags, model=model, name="gateway", env=env)
    bench.ready(gateway)
    port = common.port_of(gateway)
    ready = common.readyz(gateway)
    common.step("loading the model with plain transformers")
    device, dtype = plain_side(ready)
    plain = Plain(model_source(model), device, dtype)
    report.fact("machine", common.machine(ready.get("device", "?")))
    report.fact("engine", ready.get("engine", "thread") + (" (each model in a process of its own)" if ready.get("engine") == "process" else " (the model on the gateway's threads)"))
    report.fact("model", f"{ready.get('model', '?')}: gateway {ready.get('dtype', '?')} on {ready.get('device', '?')}, "
                f"plain transformers {str(dtype).removeprefix('torch.')} on {device}")
    report.fact("torch threads", f"{threads} on both sides (gateway: {threads_how}; this process: "
                f"torch.set_num_threads), inter-op 1")

    ids = plain.encode(PROMPT)
    report.fact("lone job", f"{len(ids)} prompt tokens, {n} new, greedy; {rounds} rounds, each a job of {n} tokens, "
                "one of 1 token and a plain run, the order alternating")

    common.step("warming up")
    for _ in range(2):
        await gateway_job(port, ids, n)
        await gateway_job(port, ids, 1)
        plain.decode(ids, n)

    span, less_prefill, first, plain_step, plain_first = [], [], [], [], []
    same: bool | None = True
    got: list[int] = []
    want: list[int] = []
    for r in range(rounds):
        common.step(f"lone job: round {r + 1} of {rounds}")
        gateway_first = r % 2 == 0
        if not gateway_first:
            want, prefill_s, decode_s = plain.decode(ids, n)
        job = await gateway_job(port, ids, n)
        one = await gateway_job(port, ids, 1)
        if gateway_first:
            want, prefill_s, decode_s = plain.decode(ids, n)
        got = job.tokens
        same = same and got == want
        span.append(job.span_per_token)
        less_prefill.append((job.latency - one.latency) / (len(got) - 1) if len(got) > 1 else None)
        first.append(job.first)
        plain_step.append(decode_s / (len(want) - 1) if len(want) > 1 else None)
        plain_first.append(prefill_s)

    plain_p50, plain_best = median(plain_step), best(plain_step)
    rows = []
    for name, values in (("partial span", span), ("job time less prefill", less_prefill)):
        p50, low = median(values), best(values)
        rows.append([name, ms(p50), ms(low), ms(plain_p50), ms(plain_best), _x(common.ratio(p50, plain_p50)),
                     _x(common.ratio(low, plain_best))])
    rows.append(["first token", ms(median(first)), ms(best(first)), ms(median(plain_first)), ms(best(plain_first)),
                 _x(common.ratio(median(first), median(plain_first))), _x(common.ratio(best(first), best(plain_first)))])
    report.table(["measure", "gateway p50 ms", "gateway best ms", "plain p50 ms", "plain best ms", "p50 ratio",
                  "best ratio"], rows, title=f"a lone job, {n} tokens: ms per token (first token: ms to it)")
    report.note("partial span: first to last partial event at the client, over the tokens after the first; job time "
                f"less prefill: ({n}-token job - 1-token job, request to data event) / {n - 1}; plain: the loop's "
                "decoding steps / their count; first token: request to first partial (gateway), prefill and "
                "argmax (plain)")

    # The CPU the gateway and its engine processes (with --engine process) spend per token event a client gets.
    pids = [gateway.proc.pid, *(e["pid"] for e in ready.get("engines", []) if e.get("pid"))]
    batch_rows = []
    for size in sizes:
        batch = [plain.encode(PROMPTS[i % len(PROMPTS)]) for i in range(size)]
        await gateway_batch(port, batch, n)  # warm-up: a first batch of this size on each side
        plain.generate(batch, n)
        walls, plain_walls, firsts, gateway_tokens, plain_tokens, matched = [], [], [], 0, 0, size
        cpu, token_events = 0.0, 0
        for r in range(max(2, rounds // 2)):
            common.step(f"batched: {size} jobs, round {r + 1}")
            if r % 2:
                theirs, plain_wall = plain.generate(batch, n)
            used = sum(map(common.cpu_seconds, pids))
            ours, wall, first_s, events = await gateway_batch(port, batch, n)
            cpu += sum(map(common.cpu_seconds, pids)) - used
            token_events += events
            firsts += first_s
            if not r % 2:
                theirs, plain_wall = plain.generate(batch, n)
            walls.append(wall)
            plain_walls.append(plain_wall)
            gateway_tokens, plain_tokens = sum(map(len, ours)), sum(map(len, theirs))
            matched = min(matched, sum(a == b for a, b in zip(ours, theirs)))
        wall, plain_wall = median(walls), median(plain_walls)
        assert wall is not None and plain_wall is not None
        jobs_s, plain_jobs_s = size / wall, size / plain_wall
        tokens_s, plain_tokens_s = gateway_tokens / wall, plain_tokens / plain_wall
        batch_rows.append([size, jobs_s, plain_jobs_s, _x(common.ratio(jobs_s, plain_jobs_s)), tokens_s,
                           plain_tokens_s, _x(common.ratio(tokens_s, plain_tokens_s)), ms(median(firsts)), f"{matched}/{size}",
                           f"{cpu / max(1, token_events) * 1e6:.0f}"])
    report.table(["jobs", "gateway jobs/s", "generate() jobs/s", "jobs/s ratio", "gateway tokens/s",
                  "generate() tokens/s", "tokens/s ratio", "first token p50 ms", "same tokens", "CPU us per token event"], batch_rows,
                 title=f"batched: concurrent one-prompt jobs of {n} tokens vs one model.generate() call")
    report.note("gateway: first request to last data event; generate(): the call, prompts left-padded; first token: "
                "each job's request to its first partial event, the median over every job of every round; median of "
                f"{max(2, rounds // 2)} rounds; same tokens: completions identical token for token in every round "
                "(left padding may change the last bits of a row's numbers, and so a near-tie); CPU per token event: the "
                "user + system time of the gateway and its engine processes over every round, over the partial events "
                "the clients got (the model's steps included)")

    ratio = common.ratio(median(span), plain_p50)
    report.target(f"a lone job's per-token time <= {TARGET_PER_TOKEN:g}x the plain decoding loop's (partial span, "
                  "median)", f"{_x(ratio)} ({ms(median(span))} vs {ms(plain_p50)} ms; "
                  f"job time less prefill: {_x(common.ratio(median(less_prefill), plain_p50))})",
                  None if ratio is None else ratio <= TARGET_PER_TOKEN)
    report.target("a lone job's greedy ids identical to the plain loop's",
                  f"{'identical' if same else 'different'} ({len(got)} tokens through the gateway, {len(want)} plain)",
                  bool(same))
    # Batched rows may part on a near-tie (padding changes a row's last bits); a lone job has no padding.
    return None if same else ["a lone job's greedy ids"]


if __name__ == "__main__":
    common.main(run, TITLE, __doc__, options, disagreed="the gateway's generate and the plain loop disagree")
