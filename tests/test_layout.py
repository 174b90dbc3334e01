"""The floors of the code: imports only point down.

    cli        gateway.cli, client, fileruns, records, render, configfile, dryrun
    server     gateway.app, admission, stream, store, redis_store, auth, openai, openapi, apidocs, schema_text
    backends   backends.*                    (beside the server: neither imports the other)
    plumbing   gateway.drain, logs, metrics, slowclients, sendbuffer
    core       gateway.protocol, errors, encoding, jobs, params, cost, config, tenants, tools.*, models.*

and inside the core, the models know no tools. Every `import` of the project's own modules is read
from the source (function-level ones too, TYPE_CHECKING ones too); one that points up or sideways
fails here, unless it is one of `NOT_YET`: the imports the layout still has to fold away, each named.
A fixed one must leave that list too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FLOORS = {
    "core": 0,
    "plumbing": 1,
    "backends": 2,
    "server": 2,
    "cli": 3,
}
PLUMBING = {"drain", "logs", "metrics", "slowclients", "sendbuffer"}
SERVER = {"app", "admission", "stream", "store", "redis_store", "auth", "openai", "openapi", "apidocs", "schema_text"}
CLI = {"cli", "client", "fileruns", "records", "render", "configfile", "dryrun", "__main__"}

# The upward imports still there, (importer, imported): what is left of the floors to build.
NOT_YET = {
    # The app bounds the heap and gives memory back (backends/memory.py): the CLI's to do.
    ("gateway.app", "backends.memory"),
    # Tenancy names a token's principal, which auth (server) defines.
    ("gateway.tenants", "gateway.auth"),
    # Draining waits for the engines' step handoff.
    ("gateway.drain", "backends.handoff"),
    # The executor service and the Ray replica admit jobs through the server's admission path.
    ("backends.executor", "gateway.admission"),
    ("backends.ray_serve", "gateway.admission"),
    # The Ray app builds its backend through the CLI's serve and reads the config file's defaults.
    ("backends.ray_app", "gateway.cli"),
    ("backends.ray_app", "gateway.configfile"),
}


def floor(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "backends":
        return "backends"
    name = parts[1] if len(parts) > 1 else ""
    if name in PLUMBING:
        return "plumbing"
    if name in SERVER:
        return "server"
    if name in CLI:
        return "cli"
    return "core"


def imports() -> list[tuple[str, str]]:
    """Every (importer, imported) pair of the project's modules, imported names resolved to modules."""
    found = []
    for package in ("gateway", "backends"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    named = [f"{node.module}.{alias.name}" for alias in node.names]
                    targets = [n for n in named if _is_module(n)] or [node.module]
                elif isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                else:
                    continue
                found += [(module, t) for t in targets if t.split(".")[0] in ("gateway", "backends") and t != module]
    return found


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_imports_only_point_down() -> None:
    upward = set()
    for importer, imported in imports():
        mine, theirs = floor(importer), floor(imported)
        if FLOORS[theirs] > FLOORS[mine] or (FLOORS[theirs] == FLOORS[mine] and mine != theirs):
            upward.add((importer, imported))
    assert upward - NOT_YET == set(), "imports pointing up or sideways"
    assert NOT_YET - upward == set(), "folded away: take these out of NOT_YET"


def test_the_models_know_no_tools() -> None:
    assert [(a, b) for a, b in imports() if a.startswith("gateway.models") and b.startswith("gateway.tools")] == []


def test_the_floors_name_only_modules_that_exist() -> None:
    modules = {a for a, _ in imports()} | {b for _, b in imports()}
    named = PLUMBING | SERVER | CLI
    present = {m.split(".")[1] for m in modules if m.startswith("gateway.") and m.count(".") == 1}
    assert named - present == set(), "a module the floors name is gone: update the floors"


def test_the_architecture_pages_layout_names_every_module_and_no_other() -> None:
    section = (ROOT / "docs" / "architecture.md").read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`((?:gateway|backends)/[\w/.]*)`", section))
    assert [path for path in named if not (ROOT / path).exists()] == []
    modules = [p.relative_to(ROOT).as_posix() for package in ("gateway", "backends") for p in (ROOT / package).rglob("*.py")]
    unnamed = [
        m for m in modules
        if not m.endswith("__init__.py") and m not in named and not any(n.endswith("/") and m.startswith(n) for n in named)
    ]
    assert unnamed == [], "modules the layout in docs/architecture.md does not name"
