"""The tool API: what a tool is, what it is given, and how it talks back.

A tool is a name, a description, a params Struct, a result Struct and a run
function `run(model, params, ctx) -> result`. The run function is ordinary
blocking code: it runs on the device's worker thread, never on the event loop,
so it may call torch freely. Through `ctx` it reports progress, logs and
partial output, and learns it was cancelled.

    import msgspec
    from gateway.tools import Context, Model, tool

    class EchoParams(msgspec.Struct):
        text: str

    class EchoResult(msgspec.Struct):
        text: str

    @tool
    def echo(model: Model, params: EchoParams, ctx: Context) -> EchoResult:
        "Return the text unchanged."
        return EchoResult(params.text)

Load a module of tools with `streamgate serve --tools mypkg.tools`.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import IO, Annotated, Any, Protocol

import msgspec

from gateway.models.base import Capability, Model, right_padded  # noqa: F401  (the tools' name for it)
from gateway.protocol import ToolInfo

__all__ = ["Cancelled", "Capability", "Context", "Model", "Tool", "right_padded", "tool"]


class Cancelled(Exception):
    """Raised inside a run function when its job was cancelled; ends it with `cancelled`."""


class Context(Protocol):
    """What a run function can tell its job, and learn from it. Safe to call from any thread."""

    job_id: str

    def progress(self, done: int, total: int | None = None, unit: str | None = None) -> None:
        """Report progress; frames are coalesced to about ten a second."""

    def log(self, message: str, level: str = "info") -> None:
        """Send a `log` event. It never changes the job's status."""

    def partial(self, obj: Any) -> None:
        """Send a `partial` event carrying `obj` (a Struct, dict or list)."""

    def count(self, tokens_in: int = 0, tokens_out: int = 0) -> None:
        """Count tokens the job read and wrote, for its usage (gateway/usage.py); a tool that counts
        none is taken to have read the tokens its price names."""

    @property
    def cancelled(self) -> bool:
        """True once the job was cancelled; the tool should stop at its next step."""

    def raise_if_cancelled(self) -> None:
        """Raise `Cancelled` if the job was cancelled."""

    def file(self, name: str) -> IO[bytes]:
        """A new file of the job's result, open for writing (and reading back): a result too big for
        one event written in parts (gateway/tools/files.py). Its result names it in a `ResultFile`;
        clients fetch it from `GET /jobs/{id}/files/{name}`."""

    @property
    def checkpoint(self) -> Any:
        """Where the run keeps the pieces it finished (gateway/checkpoints.py), if its job has a checkpoint:
        a run that goes on after a crash skips them. `Chunked` tools use it (gateway/tools/batching.py)."""


_NAME = re.compile(r"[A-Za-z0-9_-]+")

RunFn = Callable[[Model, Any, Context], Any]
CheckFn = Callable[[Model, Any], None]
CostFn = Callable[[Model, Any], Any]  # -> gateway.cost.Cost


@dataclass(frozen=True)
class Tool:
    """A model tool served at `POST /{name}/run`.

    `check(model, params)` runs before the job is queued, off the event loop, for
    rules that need the model (context length): raise `ParamError` or `TooLong`.
    `caps` binds a field to a server limit by name (`{"max_tokens": "max_tokens"}`):
    the limit bounds the field's value, or its length for lists and strings, both
    in validation and in the JSON Schema that `GET /tools` serves.
    `batch` runs several queued jobs together (see batching.py); only jobs whose
    params give equal `batch_key(params)` share a batch (any, without one).
    `needs` are the model capabilities the tool cannot run without; a model
    that lacks one is refused with 422 `unsupported_by_model` before queueing.
    `spread` lets one job's work run on every device at once (see batching.py).
    `resumable(params)` says whether a job keeps a checkpoint that a run after its
    engine died goes on from (gateway/checkpoints.py); default: its `spread`'s.
    `cost(model, params) -> gateway.cost.Cost` prices a job before it is queued: the
    memory of its largest step and the bytes of its result (gateway/cost.py); a job
    over `--max-job-memory` or `--max-result-bytes` is refused with 413 `too_large`.
    `sequences` names the fields (a string, or a list of them) that hold the model's
    input text: on a protein or DNA model they are cleaned and checked against its
    alphabet before the job is queued (gateway/models/alphabet.py), and a `tag` param
    puts the model's named prefix before those of them in `tagged` (default: all).
    """

    name: str
    description: str
    params: type[msgspec.Struct]
    result: type[Any]
    run: RunFn
    partial: type[Any] | None = None
    check: CheckFn | None = None
    cost: CostFn | None = None
    caps: Mapping[str, str] = field(default_factory=dict)
    batch: Callable[[Model], Any] | None = None
    batch_key: Callable[[Any], Hashable] | None = None
    needs: frozenset[Capability] = frozenset()
    spread: Any = None
    resumable: Callable[[Any], bool] | None = None
    sequences: tuple[str, ...] = ()
    tagged: tuple[str, ...] | None = None  # of `sequences`, those a `tag` goes before (None: all)
    # Published schemas, for a tool learned from another service's `GET /tools`.
    info: ToolInfo | None = None

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"tool name {self.name!r}: use letters, digits, '_' and '-' only")
        if not (isinstance(self.params, type) and issubclass(self.params, msgspec.Struct)):
            raise TypeError(f"tool {self.name!r}: params must be a msgspec.Struct type")
        if self.info is None:  # a learned tool's params are relayed as sent, or those of its own tool here
            object.__setattr__(self, "params", _with_model(self.name, self.params, tag=bool(self.sequences)))

    @property
    def streams_partial(self) -> bool:
        return self.partial is not None


MODEL_FIELD = "model"
TAG_FIELD = "tag"
_TAG = (
    Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            description="A named prefix the model declares (GET /models: tags), put before each sequence; "
            "per-position results leave its tokens out.",
        ),
    ]
    | None
)
_MODEL = (
    Annotated[
        str,
        msgspec.Meta(min_length=1, description="The served model to run on, by name (GET /models); left out, the default model."),
    ]
    | None
)


def _with_model(tool_name: str, params: type[msgspec.Struct], tag: bool = False) -> type[msgspec.Struct]:
    """`params` with the `model` field every tool takes (and, for a tool of sequences, `tag`): a
    subclass of the same name, so the tool's own code and JSON Schema are unchanged but for them."""
    if MODEL_FIELD in params.__struct_fields__:
        if getattr(params, "__streamgate_model__", False) or _is_model_field(params):
            return params  # the same Struct given to a second tool, or one rebuilt from a published schema
        raise TypeError(f"tool {tool_name!r}: `{MODEL_FIELD}` is the field every tool takes for the model to run on; rename its own")
    if tag and TAG_FIELD in params.__struct_fields__:
        raise TypeError(f"tool {tool_name!r}: `{TAG_FIELD}` is the field every tool of sequences takes for a named prefix; rename its own")
    fields = [(MODEL_FIELD, _MODEL, None), *([(TAG_FIELD, _TAG, None)] if tag else [])]
    with_model = msgspec.defstruct(params.__name__, fields, bases=(params,), module=params.__module__)
    with_model.__doc__ = params.__doc__
    with_model.__streamgate_model__ = True  # type: ignore[attr-defined]
    return with_model


def _is_model_field(params: type[msgspec.Struct]) -> bool:
    """True when `params` has a `model` field as every tool's: an optional string, default None."""
    field = next(f for f in msgspec.structs.fields(params) if f.name == MODEL_FIELD)
    return field.default is None and typing.get_args(field.type)[-1:] == (type(None),)


def tool(
    fn: RunFn | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    partial: type[Any] | None = None,
    check: CheckFn | None = None,
    cost: CostFn | None = None,
    caps: Mapping[str, str] | None = None,
    batch: Callable[[Model], Any] | None = None,
    batch_key: Callable[[Any], Hashable] | None = None,
    needs: Iterable[Capability] = (),
    spread: Any = None,
    resumable: Callable[[Any], bool] | None = None,
    sequences: Iterable[str] = (),
    tagged: Iterable[str] | None = None,
) -> Any:
    """Make a `Tool` from a run function, reading params and result types from its annotations."""

    def make(run: RunFn) -> Tool:
        hints = typing.get_type_hints(run)
        params_type = list(inspect.signature(run).parameters)[1]
        return Tool(
            name=name or run.__name__,
            description=description or inspect.getdoc(run) or "",
            params=hints[params_type],
            result=hints["return"],
            run=run,
            partial=partial,
            check=check,
            cost=cost,
            caps=dict(caps or {}),
            batch=batch,
            batch_key=batch_key,
            needs=frozenset(needs),
            spread=spread,
            resumable=resumable if resumable is not None else getattr(spread, "resumable", None),
            sequences=tuple(sequences),
            tagged=tuple(tagged) if tagged is not None else None,
        )

    return make(fn) if fn is not None else make
