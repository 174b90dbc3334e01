"""The one capability check: can this model run this tool, and if not, why.

Each tool states the capabilities it needs (`Tool.needs`); each loaded model
has the ones its probes proved (`Model.capabilities`). `GET /tools`, the
OpenAPI document, the dashboard, the local backend and the executor all ask
here, so a tool is refused for the same reason everywhere: before the job is
queued, with 422 `unsupported_by_model` naming the tool, the model's kind and
what is missing.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Protocol

from gateway.errors import ApiError
from gateway.models.base import Capability, Model
from gateway.protocol import Code


class Needing(Protocol):
    """What is asked of a tool here (gateway/tools/base.py's `Tool`): models know no tools."""

    @property
    def name(self) -> str: ...

    @property
    def needs(self) -> Set[Capability]: ...


def unsupported(tool: Needing, model: Model) -> str | None:
    """Why `model` cannot run `tool`, in one sentence; None when it can."""
    lacking = [cap for cap in tool.needs if cap not in model.capabilities]
    if not lacking:
        return None
    reasons = "; ".join(
        f"{cap.meaning}" + (f" ({model.missing[cap]})" if cap in model.missing else "") for cap in lacking
    )
    return f"{tool.name} needs what the model {model.name} ({model.kind.value}) does not have: {reasons}"


def refuse(reason: str) -> ApiError:
    """The 422 for a tool the served model cannot run (`reason` from `unsupported`)."""
    return ApiError(Code.UNSUPPORTED_BY_MODEL, reason)


def require(model: Model, capability: Capability, field: str) -> None:
    """Refuse a param (`field`) that needs what the model lacks: 422 `unsupported_by_model` naming it."""
    if capability not in model.capabilities:
        why = model.missing.get(capability, f"it has no {capability.meaning}")
        raise ApiError(
            Code.UNSUPPORTED_BY_MODEL,
            f"{field} needs {capability.meaning}, which the model {model.name} ({model.kind.value}) does not have: {why}",
            field=field,
        )
