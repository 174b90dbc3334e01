"""The backends whose tools run in other services (executors, engine processes, Ray Serve replicas):
the tools and models learned from what those services publish."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from gateway.backend import Backend
from gateway.cost import inline_only
from gateway.params import Relayed
from gateway.protocol import ModelInfo, ToolInfo, encode
from gateway.tools.base import Tool


class Relaying(Backend):
    """A backend whose tools and models run in other services (executors, Ray Serve replicas)
    and are learned from what those services publish (`GET /tools`, `GET /models`).

    Their params are relayed as they came (gateway/params.py's `Relayed`), for the service that runs
    the job to decode, check and refuse: a request is decoded once, where it runs.
    """

    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {}
        self._models: list[ModelInfo] = []

    @property
    def tools(self) -> Mapping[str, Tool]:
        return self._tools

    def tool(self, name: str) -> Tool:
        if not self._tools:
            # No service has said what it serves: the gateway is not ready, the tool not unknown.
            raise self.not_ready_error()
        return super().tool(name)

    def models(self) -> list[ModelInfo]:
        return self._models

    # What every request asks (its model's name, whether the model runs the tool) read from the models as
    # learned: `models()` may add what it costs more to say (readiness, queue counts) for `GET /models`.
    def model_names(self) -> list[str]:
        return [m.name for m in self._models]

    def unsupported(self, tool: Tool, model: str | None = None) -> str | None:
        for info in self._models:
            if info.name == model or (model is None and info.default):
                return info.unsupported.get(tool.name)
        return tool.info.unsupported if tool.info is not None else None

    @property
    def tools_version(self) -> object:
        return (id(self._tools), id(self._models))

    def learn(self, infos: Iterable[ToolInfo], models: list[ModelInfo]) -> None:
        """Take the tools and models published, the first of each name winning; a tool whose
        schemas did not change keeps its object."""
        learned: dict[str, Tool] = {}
        for info in infos:
            if info.name not in learned:
                known = self._tools.get(info.name)
                learned[info.name] = known if known is not None and known.info == info else remote_tool(info)
        if learned.keys() != self._tools.keys() or any(learned[n] is not self._tools.get(n) for n in learned):
            self._tools = learned
        if models != self._models:
            self._models = models


def _relayed_only(model: Any, params: Any, ctx: Any) -> Any:
    raise RuntimeError("this tool runs in another service")


def remote_tool(info: ToolInfo) -> Tool:
    """A tool known from another service's `GET /tools`: its schemas, no code; its params relayed."""
    return Tool(name=info.name, description=info.description, params=Relayed, result=object, run=_relayed_only, info=info)


NULL = msgspec.Raw(b"null")


def answers_inline(job: Any) -> bool:
    """Whether `job`'s result must come whole in its JSON, never as files: a part of a job cut over
    engines (backends/spreading.py), or a job whose surface builds its answer from the result (the
    OpenAI routes set `inline_only` around its admission). Kept on the job, for a submit made again
    later, out of that context (its engine restarted)."""
    if inline_only.get():
        job.inline_only = True
    return bool(getattr(job, "inline_only", False))


def sent(params: Any) -> dict[str, Any]:
    """A job's params as the wire carries them to the service that runs it (`SubmitRequest`'s
    `params`, `query` and `model`): relayed ones as their client sent them, others as JSON."""
    if isinstance(params, Relayed):
        return {"params": params.body, "query": params.query, "model": params.model}
    return {"params": msgspec.Raw(encode(params))}


FILES_PREFIX = "streamgate-files-"


def files_folder(base: str | None) -> str:
    """A folder of this process's own, in `base` (default: the system's temporary folder), where its
    jobs' result files lie while they are written and kept (gateway/jobs.py `ResultFiles`); first,
    the folders of processes that died without removing theirs (an engine killed) are removed."""
    base = base or tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(base):
            pid = entry.name.removeprefix(FILES_PREFIX).split("-", 1)[0]
            if entry.name.startswith(FILES_PREFIX) and pid.isdigit() and not _alive(int(pid)) and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{FILES_PREFIX}{os.getpid()}-", dir=base)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def remove_files_folder(folder: str | None) -> None:
    """At stop: the files of jobs no store took (a process that dies leaves its folder behind)."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
