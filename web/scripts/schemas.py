"""Print the JSON Schemas the TypeScript types are generated from.

`tools` is the gateway's own `GET /tools` answer for the built-in tools and the
SAE tools (those a gateway serves with `--sae`), asked of the app in-process (no
model or SAE is loaded); `sae_tools` names the latter; `frames` are the protocol's event
frames and error body, and the answers of `GET /tools`, `GET /models` (ModelList,
with ModelInfo under it), `GET /jobs/{id}`, `GET /me` and `GET /usage`, from the same
Structs the gateway encodes them with.
Run with the project's Python: `.venv/bin/python web/scripts/schemas.py`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from starlette.testclient import TestClient

from gateway.backend import Backend
from gateway import protocol
from gateway.server import openapi
from gateway.server.app import create_app
from gateway.params import schema
from gateway.tools import builtin_tools, collect
from gateway.tools.sae_tools import sae_tools

# The protocol's Structs the client reads: the frames and error body, and the `GET /tools`,
# `GET /models` and `GET /jobs/{id}` answers; and the server's `GET /me` and `GET /usage` answers.
FRAMES = ["StatusFrame", "LogFrame", "ErrorFrame", "ErrorBody", "ToolInfo", "ModelList", "JobSnapshot"]
ANSWERS = {"Me": openapi.Me, "UsageReport": openapi.UsageReport}


class ToolsOnly(Backend):
    """Just enough of a backend for `GET /tools`: the built-in and SAE tools, never started."""

    def __init__(self) -> None:
        self._tools = collect([*builtin_tools(), *sae_tools()])  # as backends/local.py adds them

    @property
    def tools(self):  # type: ignore[override]
        return self._tools

    @property
    def ready(self) -> bool:
        return False

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def submit(self, job) -> None:  # type: ignore[override]
        raise NotImplementedError

    def cancel(self, job) -> None:  # type: ignore[override]
        raise NotImplementedError


def main() -> None:
    client = TestClient(create_app(ToolsOnly()))  # no `with`: no lifespan, nothing loads
    answer = client.get("/tools")
    answer.raise_for_status()
    frames = {name: schema(getattr(protocol, name)) for name in FRAMES} | {name: schema(struct) for name, struct in ANSWERS.items()}
    sae = [t.name for t in sae_tools()]
    json.dump({"tools": answer.json(), "sae_tools": sae, "frames": frames}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
