"""What a job will cost, known before it is queued: the memory of its largest step and the size of its result.

A tool states its cost with `Tool.cost(model, params) -> Cost`, from its params
and the model's shape (`Shape`: layers, widths, heads, vocabulary, dtype). The
admission step (backends/local.py `prepare`, which every way a job enters goes
through: a gateway's runs, `/v1`, an executor's, a Ray replica's) compares it
with the server's `Budget` and refuses a job over either bound with 413
`too_large`, naming the bound, the estimate and the field to shrink, before the
job is queued. A tool that states no cost is bounded by the time limit alone.

The one rule: an estimate is an upper bound of what the job's work holds at its
peak beyond the weights (activations, attention, the states and logits kept,
the result being built), never an average. It counts what a forward pass of
transformers holds at once on the device, row by row of the padded batch:

- one block's working set: the block's input and output, the attention's
  queries, keys, values and output, the MLP's up and gate projections and their
  product (`BLOCK_WIDTHS`), in the model's dtype;
- attention: eager attention materialises each head's scores and their softmax
  (2 × heads × width × width floats a row); a fused kernel (SDPA, flash) holds
  the mask of width × width alone;
- what the tool keeps across blocks (hidden states, logits), in float32 where it
  reads them so.

tests/test_cost.py measures peaks on small models (the process's peak RSS) and
holds each estimate to at least 3/4 of what was measured.
"""

from __future__ import annotations

import contextvars
import os
import dataclasses
from dataclasses import dataclass
from typing import Any

from gateway.errors import ApiError
from gateway.protocol import Code

MIB = 1 << 20
GIB = 1 << 30
DEFAULT_JOURNAL_BYTES = GIB

# Bytes one float takes in a JSON result ("-0.123456789," at most, float32's shortest form).
JSON_FLOAT = 14
# A `{"id":…,"text":"…","prob":…}` entry, its token's text aside.
JSON_ENTRY = 48
# A token's text in JSON, quotes and escapes included, for a vocabulary of words and pieces.
JSON_TOKEN = 24
# A result's own keys, scalars and short lists, around what grows with the params.
JSON_FRAME = 256
# What the result holds in Python before it is encoded: an entry Struct with its int and float,
# and a float in a list (the object and its slot).
PY_ENTRY = 144
PY_FLOAT = 32


# What a checkpoint's journal keeps beside each piece's numbers: its key, and the pickled tuple and
# two tensors around them (a tensor's pickle is about 400 bytes before its data).
JOURNAL_PIECE = 1024


# The param by which a job asks for its per-position result as files (gateway/tools/files.py).
FILE_FIELD = "file"


@dataclass(frozen=True)
class Cost:
    """A job's price: `memory` bytes at its peak (beyond the weights), `result` bytes of JSON,
    `files` bytes of result files on disk, `journal` bytes of its checkpoint's journal on disk at
    most (gateway/checkpoints.py: 0, none kept).

    `memory_field` and `result_field` name the param that drives each most (what to shrink);
    `tokens` is the most tokens one forward pass of it runs over; `counted`, the most its metered use
    may count, read and written, over all its passes (0: `tokens`, what a tool that counts none is
    metered by): a class's token quotas hold it while the job runs. `as_files` is the same job's
    price with its result written as files of `file_format` (a tool that can, asked for none):
    admission takes it, and sets the job's `file` param, when the result is over the bound.
    """

    memory: int
    result: int
    memory_field: str
    result_field: str
    tokens: int = 0
    counted: int = 0
    files: int = 0
    as_files: Cost | None = None
    file_format: str | None = None
    journal: int = 0

    @property
    def most_counted(self) -> int:
        """The most tokens the job's metered use may count."""
        return max(self.counted, self.tokens)


@dataclass(frozen=True)
class Shape:
    """A model's sizes, as its config gives them (or its probes measured)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    dtype_bytes: int
    # Whether attention materialises its scores (eager), or a fused kernel does without (SDPA, flash).
    eager: bool = False

    @classmethod
    def of(cls, model: Any) -> Shape:
        """The shape of a served `gateway.models.base.Model`, worked out once per model."""
        if (known := model.memo.get("shape")) is not None:
            return known
        config = getattr(model.module, "config", None)

        def get(*names: str) -> int | None:
            for name in names:
                value = getattr(config, name, None)
                if isinstance(value, int) and value > 0:
                    return value
            return None

        hidden = get("hidden_size", "n_embd", "d_model", "dim") or int(model.memo.get("layer_width", 0)) or 1
        layers = get("num_hidden_layers", "n_layer", "num_layers") or max(1, int(model.memo.get("n_states", 2)) - 1)
        shape = cls(
            layers=layers,
            hidden=hidden,
            intermediate=get("intermediate_size", "n_inner", "ffn_dim", "encoder_ffn_dim") or 4 * hidden,
            heads=(heads := get("num_attention_heads", "n_head", "encoder_attention_heads") or 1),
            kv_heads=get("num_key_value_heads", "multi_query_group_num") or heads,
            vocab=max(int(model.vocab_size), 1),
            dtype_bytes=_itemsize(model.dtype),
            eager=_materialises_scores(config, model),
        )
        model.memo["shape"] = shape
        return shape

    def block_bytes(self, rows: int, width: int, attended: int | None = None) -> int:
        """One block's working set over `rows` padded rows of `width` tokens, each attending to
        `attended` positions (default: the same `width`; more for a piece of a longer prefill)."""
        activations = rows * width * (BLOCK_WIDTHS * self.hidden + 3 * self.intermediate) * self.dtype_bytes
        # Eager attention holds each head's scores and their softmax; a fused kernel, the mask alone.
        scores = (2 * self.heads if self.eager else 1) * rows * width * (attended or width) * 4
        return activations + scores

    def states_bytes(self, rows: int, width: int, n: int) -> int:
        """`n` hidden states (one per layer read) kept for every token of the batch."""
        return n * rows * width * self.hidden * self.dtype_bytes

    def logits_bytes(self, n_positions: int, copies: int = 2) -> int:
        """Full-vocabulary logits at `n_positions` positions in float32, and `copies - 1` softmaxes of them."""
        return copies * n_positions * self.vocab * 4

    def cache_bytes(self, rows: int, tokens: int) -> int:
        """A decoding cache of `tokens` positions for `rows` rows: each layer's keys and values."""
        return 2 * self.layers * rows * tokens * (self.hidden * self.kv_heads // self.heads) * self.dtype_bytes

    def pass_bytes(self, rows: int, width: int, *, states: int = 0, logits: int = 0) -> int:
        """Peak of one forward pass: a block's working set, the hidden states kept, the logits read."""
        return self.block_bytes(rows, width) + self.states_bytes(rows, width, states) + self.logits_bytes(logits)


# The block's input, norm, query, key, value, attention output, projection and residual sum
# (`hidden` wide each), beside the MLP's up, gate and product (`intermediate` wide).
BLOCK_WIDTHS = 8


def _materialises_scores(config: Any, model: Any) -> bool:
    """Whether attention holds each head's scores: eager attention does; SDPA does on a CUDA
    device in float32, where its fused kernels do not run (bench/RESULTS.md: an 8k-token embed
    took 6.2 GB there, 0.5 GB in bfloat16); on the CPU its flash kernel runs in float32 too."""
    implementation = getattr(config, "_attn_implementation", "eager")
    if implementation in (None, "eager"):
        return True
    device = str(getattr(model, "device", "cpu"))
    return implementation == "sdpa" and device.startswith("cuda") and _itemsize(model.dtype) >= 4


def _itemsize(dtype: Any) -> int:
    return int(getattr(dtype, "itemsize", 4) or 4)


@dataclass(frozen=True)
class Budget:
    """The bounds every job is priced against (`--max-job-memory`, `--max-result-bytes`,
    `--max-result-file-bytes`, `--max-checkpoint-bytes`; `files` 0 where the backend keeps no
    result files)."""

    memory: int
    result: int
    files: int = 0
    journal: int = DEFAULT_JOURNAL_BYTES

    def admit(self, cost: Cost) -> Cost:
        """The price admitted (`cost.as_files` for a result over the bound that can be files; its
        `journal` 0 where it is over `journal`), or 413 `too_large` for a job over a bound: the
        bound, the estimate, and what to shrink."""
        if cost.result > self.result and cost.as_files is not None and self.files:
            cost = cost.as_files
        if cost.journal > self.journal:
            # A checkpoint only lets the job go on after a crash; its answer needs none. Over the
            # bound the job keeps none, and starts again from nothing after a crash.
            cost = dataclasses.replace(cost, journal=0)
        # The result first: where it is over, it is also what makes the memory (the result is held).
        if cost.result > self.result:
            _refuse(f"this job's result would be about {_size(cost.result)}", self.result, "--max-result-bytes", cost.result_field)
        if cost.files > self.files:
            if not self.files:
                raise ApiError(Code.TOO_LARGE, "this backend keeps no result files: leave out file", field=FILE_FIELD)
            _refuse(f"this job's result files would be about {_size(cost.files)}", self.files, "--max-result-file-bytes", cost.result_field)
        refuse_memory(cost, self.memory, "--max-job-memory")
        return cost


def refuse_memory(cost: Cost, bound: int, limit: str) -> None:
    """413 `too_large` if `cost`'s peak memory is over `bound` (`limit` names whose bound it is)."""
    if cost.memory > bound:
        _refuse(f"this job needs about {_size(cost.memory)} of memory at its peak", bound, limit, cost.memory_field)


def _refuse(what: str, bound: int, flag: str, field: str) -> None:
    raise ApiError(Code.TOO_LARGE, f"{what}; the limit is {_size(bound)} ({flag}): shrink {field}", field=field)


def _size(n: int) -> str:
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.0f} KiB"


DEFAULT_FILE_BYTES = 4 * GIB
# Set while a job whose result must come whole in its event is admitted (a part of a job cut over
# engines, merged with the others'): its price may not be `as_files` (backends/local.py `check`).
inline_only: contextvars.ContextVar[bool] = contextvars.ContextVar("inline_only", default=False)


def default_job_memory(devices: list[str] | None = None) -> int:
    """`--max-job-memory`'s default: on GPUs, half the smallest one's memory (the weights and the
    allocator's cache take the rest); else a quarter of this machine's memory, so that a big job,
    the jobs batched beside it and the gateway itself fit together."""
    import torch  # only where models run

    cuda = [d for d in devices or [] if d.startswith("cuda")] or (["cuda"] if devices is None and torch.cuda.is_available() else [])
    if cuda:
        return min(torch.cuda.get_device_properties(torch.device(d)).total_memory for d in cuda) // 2
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * GIB
    return max(total // 4, 256 * MIB)


DEFAULT_RESULT_BYTES = 64 * MIB
