"""Each tool's price against what its job takes, side by side (gateway/cost.py).

For every case, the tool's estimate of its peak memory and result bytes, and
what a run of it measured: on a CUDA device `torch.cuda.max_memory_allocated`
over the run (the weights before it subtracted); on the CPU the process's peak
RSS (`VmHWM`, reset through /proc/self/clear_refs after `malloc_trim`) with
the gateway's heap bound (gateway/plumbing/memory.py). The model is random, built from
a config: `--shape wide` is a 2-layer Llama of hidden 256 with an 8k context
(what tests/test_cost.py measures); `--shape smollm2` has SmolLM2-135M's
shape (30 layers, hidden 576, 9 heads, 3 key-value heads, vocabulary 49,152).
Both read text byte by byte. Standalone: it needs torch, transformers,
tokenizers and the gateway's core (msgspec, orjson, starlette), not the server.

    python bench/cost.py --shape smollm2 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import platform
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import torch  # noqa: E402

from gateway.cost import Cost  # noqa: E402
from gateway.encoding import to_json  # noqa: E402
from gateway.tools import Model, builtin_tools  # noqa: E402

TOOLS = {t.name: t for t in builtin_tools()}
MIB = 1 << 20
AT_LEAST = 0.75  # an estimate may be under what was measured by a quarter at most


class Quiet:
    """A `Context` that keeps nothing: the frames of a run measured for its memory."""

    job_id = "bench"
    cancelled = False

    def progress(self, done: int, total: int | None = None, unit: str | None = None) -> None:
        pass

    def log(self, message: str, level: str = "info") -> None:
        pass

    def partial(self, obj: Any) -> None:
        pass

    def count(self, tokens_in: int = 0, tokens_out: int = 0) -> None:
        pass

    def raise_if_cancelled(self) -> None:
        pass


def cases(scale: int) -> list[tuple[str, dict[str, Any]]]:
    """The jobs measured: each tool on inputs long enough that its work shows over the noise; `scale`
    multiplies the lengths (1 for the tests' wide model, more on a GPU)."""
    n = 1000 * scale
    return [
        ("embed", {"texts": ["a" * 4 * n]}),
        ("embed", {"texts": ["a" * 2 * n] * 4, "pooling": "per_token"}),
        ("embed", {"texts": ["ab" * 100] * 64, "pooling": "per_token"}),
        ("logprobs", {"prompts": ["a" * 3 * n]}),
        ("logprobs", {"prompts": ["a" * 2 * n] * 3, "top": 5}),
        ("loglikelihood", {"prompts": ["a" * n] * 4, "continuations": ["b" * n] * 4}),
        ("predict", {"prompt": "a" * 4 * n, "top_k": 50}),
        ("logit_lens", {"prompt": "a" * 2 * n, "top_k": 20}),
        ("logit_lens", {"prompt": "a" * 300, "top_k": 100, "layers": [0] * 100, "positions": [0] * 100}),
        ("lens_grid", {"prompt": "a" * 3 * n}),
        ("lens_line", {"prompt": "a" * 3 * n}),
        # Every layer and position patched: passes grow with the square of the length.
        ("activation_patching", {"src_prompt": "a" * 250 * scale, "tgt_prompt": "b" * 250 * scale}),
        ("generate", {"prompts": ["a" * n] * 4, "max_tokens": 64}),
        # Longer than the context, in windows (docs/sequences.md).
        ("embed", {"texts": ["a" * 20 * n], "window": 2 * n, "pooling": "per_token"}),
        ("logprobs", {"prompts": ["a" * 20 * n], "window": 2 * n, "overlap": n // 2}),
    ]


_libc = ctypes.CDLL(None) if platform.system() == "Linux" else None


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        found = re.search(key + r":\s+(\d+)", f.read())
    return int(found.group(1)) * 1024 if found else 0


def measure(model: Model, tool_name: str, raw: dict[str, Any]) -> tuple[Cost, int, int]:
    """The tool's price for `raw` params, the peak its run and the encoding of its result took
    (device memory on CUDA, else the process's resident memory), and the result's bytes."""
    t = TOOLS[tool_name]
    params = msgspec.convert(raw, t.params)
    if t.check is not None:
        t.check(model, params)
    cost = t.cost(model, params)
    gc.collect()
    cuda = torch.device(model.device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        if _libc is not None:
            _libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM from the current RSS on
        before = _status("VmRSS")
    with torch.inference_mode():
        size = len(to_json(t.run(model, params, Quiet())))
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _status("VmHWM") - before
    return cost, peak, size


SHAPES = {
    "wide": {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 512, "vocab": 0, "context": 8192},
    "smollm2": {"hidden": 576, "layers": 30, "heads": 9, "kv_heads": 3, "intermediate": 1536, "vocab": 49152, "context": 8192},
}


def save(shape: str, folder: Path, tokenizer_from: Path | None = None) -> None:
    """A random Llama of `shape` saved at `folder`, with the byte tokenizer, or the one in
    `tokenizer_from` (a model folder: SmolLM2's own, for a model of its shape that reads text as it does)."""
    import transformers as tf

    from tests.support.tiny_models import byte_tokenizer

    s = SHAPES[shape]
    if tokenizer_from is not None:
        tokenizer = tf.AutoTokenizer.from_pretrained(tokenizer_from)
        vocab = {"<s>": tokenizer.bos_token_id, "</s>": tokenizer.eos_token_id, "<pad>": tokenizer.pad_token_id}
        vocab["<pad>"] = vocab["<pad>"] if vocab["<pad>"] is not None else vocab["</s>"]
        size = len(tokenizer)
    else:
        tokenizer, vocab = byte_tokenizer()
        size = len(vocab)
    config = tf.LlamaConfig(
        vocab_size=max(s["vocab"], size), hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        max_position_embeddings=s["context"], tie_word_embeddings=shape == "smollm2",
        bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"],
    )
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def build(shape: str, folder: Path, device: str, dtype: str | None) -> Model:
    """A random Llama of `shape` with the byte tokenizer, saved and loaded as the gateway loads a model."""
    from backends import loading as models
    from gateway.plumbing.memory import bound_heap

    bound_heap()
    save(shape, folder)
    return models.load(models.resolve(str(folder)), device, dtype=dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="wide")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--scale", type=int, default=1, help="multiply the cases' lengths")
    parser.add_argument("--quick", action="store_true", help="a few cases, for CI")
    parser.add_argument("--tool", action="append", help="only this tool's cases (repeatable)")
    parser.add_argument("--save", type=Path, default=None, help="only save a random model of --shape in this folder")
    parser.add_argument("--tokenizer-from", type=Path, default=None, help="with --save: the tokenizer of this model folder")
    args = parser.parse_args()
    if args.save is not None:
        save(args.shape, args.save, args.tokenizer_from)
        return 0
    from backends.workers import set_torch_threads

    set_torch_threads(None)
    with tempfile.TemporaryDirectory() as folder:
        model = build(args.shape, Path(folder) / args.shape, args.device, args.dtype)
    device = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else platform.processor() or "cpu"
    print(f"machine: {device}; torch {torch.__version__}; model: random {args.shape} ({model.dtype}) on {args.device}")
    print("| tool | params | priced MiB | measured MiB | ratio | result priced KiB | result KiB | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    worst = float("inf")
    chosen = [(name, raw) for name, raw in cases(args.scale) if not args.tool or name in args.tool]
    chosen = chosen[::4] if args.quick else chosen
    for tool_name, raw in chosen:
        cost, peak, size = measure(model, tool_name, raw)
        ratio, result_ratio = cost.memory / max(peak, 1), cost.result / max(size, 1)
        worst = min(worst, ratio, result_ratio)
        shown = ", ".join(f"{k}={_short(v)}" for k, v in raw.items())
        print(
            f"| {tool_name} | {shown} | {cost.memory / MIB:.1f} | {peak / MIB:.1f} | {ratio:.2f} "
            f"| {cost.result / 1024:.1f} | {size / 1024:.1f} | {result_ratio:.2f} |"
        )
    verdict = "met" if worst >= AT_LEAST else "missed"
    print(f"target: every estimate >= {AT_LEAST}x what was measured (lowest {worst:.2f}): {verdict}")
    return 0 if verdict == "met" else 1


def _short(value: Any) -> str:
    if isinstance(value, str):
        return f"{len(value)} chars"
    if isinstance(value, list):
        return f"{len(value)} × {_short(value[0])}" if value else "[]"
    return str(value)


if __name__ == "__main__":
    raise SystemExit(main())
