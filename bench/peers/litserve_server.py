"""A LitServe server of the three jobs bench/batching.py sends: predict, loglikelihood, generate (greedy).

The peer streamgate is measured against: the same model folder, the same
dtype and torch threads, and the same answers, served the way a careful
LitServe user would write it. One route, `POST /run`, takes a tool's params
as streamgate's `/{tool}/run` does, plus `"tool"`, and answers the tool's
result as one JSON object (streamgate's `data` event). LitServe's own dynamic
batching gathers the requests (`max_batch_size` 32, `batch_timeout` 5 ms, as
streamgate's defaults; one worker; `fast_queue`, its ZeroMQ transport, on),
and each batch is one padded forward pass per tool, under
`torch.inference_mode()`:

- predict: the top k of the next-token distribution after the prompt.
- loglikelihood: the sum of the continuation's token log-probabilities after
  its prompt (the two tokenised apart and joined, as streamgate does).
- generate: greedy decoding on a KV cache, all the batch's rows a token per
  step, each row ending at EOS or `max_tokens`.

Where it differs from streamgate: rows are left-padded (positions from the
attention mask) so that the output head runs only on the positions read
(`logits_to_keep`: the last one for predict and generate, the continuation's
span for loglikelihood), and there is no stream of events, both less work;
and LitServe's batches are static, so a generate batch decodes until its last
row ends and no job joins it meanwhile (streamgate's rows join and leave
between tokens).

It runs in its own environment (bench/peers/.venv, requirements.txt beside
this file), started by batching.py:

    bench/peers/.venv/bin/python bench/peers/litserve_server.py --model DIR --port 8001 --torch-threads 1
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import signal
import sys
from typing import Any

import litserve as ls
from fastapi import HTTPException


def resolve_device(requested: str | None) -> tuple[str, str]:
    """(device, dtype name), chosen as streamgate chooses them: CUDA if present, bf16 there, else float32."""
    import torch

    device = requested if requested and requested != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return device, "bfloat16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32"


class ModelTools(ls.LitAPI):
    """The three tools on one model; a batch of requests is grouped by tool, one forward pass each."""

    def __init__(self, model: str, dtype: str, threads: int, max_batch_size: int, batch_timeout: float) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout, api_path="/run")
        self.model_path, self.dtype_name, self.threads = model, dtype, threads

    def setup(self, device: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(self.threads)
        try:
            torch.set_num_interop_threads(1)  # as the gateway: one model call at a time, no inter-op pool
        except RuntimeError:  # already set in this process
            pass
        self.torch = torch
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, self.dtype_name))
        self.model.to(self.device).eval()
        tokenizer = self.tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
        self.pad_id = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else 0
        eos: set[int] = set()
        for ids in (tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if ids is not None:
                eos.update(ids if isinstance(ids, (list, tuple)) else [ids])
        self.eos = eos

    # -- requests in, results out ----------------------------------------------------------

    # No annotations on `request` nor on encode_response's return: LitServe reads them as the route's
    # types, and without them it passes the JSON body on and sends back what it is given, as JSON.
    def decode_request(self, request):
        """The params, tokenised as streamgate tokenises them: prompts with the tokenizer's special
        tokens (at least one token), continuations without. Only what batching.py sends is checked:
        a request without a field it needs is a 422 (which LitServe gives the whole batch)."""
        tool = request.get("tool")
        try:
            if tool == "predict":
                return {"tool": tool, "rows": [self._encode(request["prompt"])], "top_k": int(request.get("top_k", 10))}
            if tool == "loglikelihood":
                pairs = [(self._encode(p), self.tokenizer(c, add_special_tokens=False)["input_ids"])
                         for p, c in zip(request["prompts"], request["continuations"], strict=True)]
                return {"tool": tool, "pairs": pairs}
            if tool == "generate":
                return {"tool": tool, "rows": [self._encode(p) for p in request["prompts"]],
                        "max_tokens": int(request.get("max_tokens", 16))}
        except (KeyError, TypeError, ValueError) as exc:
            raise HTTPException(422, f"{tool}: {type(exc).__name__}: {exc}") from None
        raise HTTPException(422, f"unknown tool {tool!r}: predict, loglikelihood or generate")

    def _encode(self, text: str) -> list[int]:
        ids = list(self.tokenizer(text)["input_ids"])
        if not ids:
            start = getattr(self.tokenizer, "bos_token_id", None)
            ids = [start if start is not None else min(self.eos or {self.pad_id})]
        return ids

    def batch(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return inputs  # ragged token rows: padded per tool in predict

    def unbatch(self, outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return outputs

    def encode_response(self, output):
        return output

    def predict(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        results: list[dict[str, Any] | None] = [None] * len(requests)
        run = {"predict": self._predict, "loglikelihood": self._loglikelihood, "generate": self._generate}
        with self.torch.inference_mode():
            for tool, fn in run.items():
                indices = [i for i, request in enumerate(requests) if request["tool"] == tool]
                if indices:
                    for i, result in zip(indices, fn([requests[i] for i in indices])):
                        results[i] = result
        return results  # type: ignore[return-value]

    # -- the forward passes ----------------------------------------------------------------

    def _left_padded(self, rows: list[list[int]]) -> tuple[Any, Any, Any]:
        """(input_ids, attention_mask, position_ids): every row ends at the last column."""
        torch = self.torch
        width = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(rows):
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            mask[i, width - len(ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return input_ids.to(self.device), mask.to(self.device), positions.to(self.device)

    def _predict(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        input_ids, mask, positions = self._left_padded([r["rows"][0] for r in requests])
        logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, logits_to_keep=1).logits
        probs = logits[:, -1].float().softmax(dim=-1)
        results = []
        for row, request in enumerate(requests):
            top = probs[row].topk(request["top_k"])
            ids = top.indices.tolist()
            results.append({"predictions": [
                {"id": i, "text": self.tokenizer.decode([i], clean_up_tokenization_spaces=False), "prob": p}
                for i, p in zip(ids, top.values.tolist())
            ]})
        return results

    def _loglikelihood(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        torch = self.torch
        pairs = [pair for request in requests for pair in request["pairs"]]
        input_ids, mask, positions = self._left_padded([context + continuation for context, continuation in pairs])
        # Left padding puts every continuation at the end: the logits that score it are among the last
        # (longest continuation + 1), and only those go through the output head.
        keep = max(len(continuation) for _, continuation in pairs) + 1
        logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep).logits
        scored = []
        for row, (_, continuation) in enumerate(pairs):
            n = len(continuation)
            span = logits[row, keep - 1 - n: keep - 1].float().log_softmax(dim=-1)
            target = torch.tensor(continuation, device=span.device)
            scored.append((span.gather(1, target[:, None]).sum().item(), bool((span.argmax(dim=-1) == target).all())))
        results, start = [], 0
        for request in requests:
            mine = scored[start: start + len(request["pairs"])]
            start += len(request["pairs"])
            results.append({"ll": [ll for ll, _ in mine], "is_greedy": [greedy for _, greedy in mine]})
        return results

    def _generate(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        torch = self.torch
        rows = [ids for request in requests for ids in request["rows"]]
        limits = [request["max_tokens"] for request in requests for _ in request["rows"]]
        input_ids, mask, positions = self._left_padded(rows)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        cache, positions = out.cache, positions[:, -1:] + 1
        tokens: list[list[int]] = [[] for _ in rows]
        finished = [False] * len(rows)
        next_ids = out.logits[:, -1].float().argmax(dim=-1)
        for step in range(max(limits)):
            for row, token in enumerate(next_ids.tolist()):
                if not finished[row]:
                    tokens[row].append(token)
                    finished[row] = token in self.eos or len(tokens[row]) >= limits[row]
            if all(finished) or step == max(limits) - 1:
                break
            # Rows that ended still run (a static batch), their tokens unused.
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
            out = self.model(input_ids=next_ids[:, None], attention_mask=mask, position_ids=positions,
                             cache=cache, use_cache=True)
            cache, positions = out.cache, positions + 1
            next_ids = out.logits[:, -1].float().argmax(dim=-1)
        results, start = [], 0
        for request in requests:
            mine = tokens[start: start + len(request["rows"])]
            mine_rows = rows[start: start + len(request["rows"])]
            start += len(request["rows"])
            completions, reasons = [], []
            for ids in mine:
                stopped = bool(ids) and ids[-1] in self.eos
                completions.append(self.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=True,
                                                         clean_up_tokenization_spaces=False))
                reasons.append("stop" if stopped else "length")
            prompt_tokens, completion_tokens = sum(map(len, mine_rows)), sum(map(len, mine))
            results.append({"completions": completions, "finish_reasons": reasons,
                            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                      "total_tokens": prompt_tokens + completion_tokens}})
        return results


MAIN_PID = os.getpid()


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM as Ctrl-C in the main process: LitServe then stops its worker and API server processes.

    The API server is forked with this handler; there the signal comes from that
    shutdown (uvicorn raises it again once it has stopped), and it just exits.
    """
    if os.getpid() != MAIN_PID:
        raise SystemExit(0)
    raise KeyboardInterrupt()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="A model folder (config, safetensors, tokenizer).")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA if present, else cpu).")
    parser.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default: bfloat16 on CUDA, else float32).")
    parser.add_argument("--torch-threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1),
                        help="torch's intra-op threads in the worker (inter-op: 1); default: cores - 1, at least 1.")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-timeout", type=float, default=0.005, help="Seconds a batch waits to fill.")
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds a request may wait in LitServe's queue.")
    # LitServe's advice for more than 100 requests/s; on 2 CPU cores it was as fast or faster at every level tried.
    parser.add_argument("--fast-queue", action=argparse.BooleanOptionalAction, default=True,
                        help="LitServe's ZeroMQ transport between its API server and worker (default: on).")
    args = parser.parse_args()
    # The spawned worker inherits these: its OpenMP pool is sized before torch.set_num_threads runs,
    # and LitServe numbers the devices it sees from 0, so cuda:N is made the only one it sees.
    os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
    if args.device and args.device.startswith("cuda:"):
        os.environ["CUDA_VISIBLE_DEVICES"] = args.device.partition(":")[2]
    device, default_dtype = resolve_device(args.device)
    dtype = args.dtype or default_dtype
    api = ModelTools(args.model, dtype, args.torch_threads, args.max_batch_size, args.batch_timeout)
    server = ls.LitServer(
        api, accelerator=device.partition(":")[0], devices=1, workers_per_device=1,
        timeout=args.timeout, fast_queue=args.fast_queue,
        model_metadata={"model": args.model, "device": device, "dtype": dtype, "torch_threads": args.torch_threads,
                        "max_batch_size": args.max_batch_size, "batch_timeout": args.batch_timeout,
                        "fast_queue": args.fast_queue,
                        "litserve": importlib.metadata.version("litserve"), "torch": importlib.metadata.version("torch")},
    )
    signal.signal(signal.SIGTERM, _interrupt)
    server.run(host="127.0.0.1", port=args.port, log_level="warning", generate_client_file=False)
    sys.exit(0)


if __name__ == "__main__":
    main()
