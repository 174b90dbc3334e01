"""The floors of the code: imports only point down.

    cli        gateway/cli/        the `streamgate` command, file runs, config files
    server     gateway/server/     routes, streams, job stores, auth, the OpenAI routes
    backends   backends/           (beside the server: neither imports the other)
    plumbing   gateway/plumbing/   draining, logs, metrics, memory, device threads, slow clients, send buffers
    core       gateway/            protocol, jobs, errors, encoding, params, cost, config, tenants, admission,
                                   the Backend interface, tools/ and models/, the Python client

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
# The folders of the floors above the core; `python -m gateway` is the CLI's.
FOLDERS = {"plumbing": "plumbing", "server": "server", "cli": "cli", "__main__": "cli"}

# The upward imports still there, (importer, imported): what is left of the floors to build.
NOT_YET: set[tuple[str, str]] = set()


def floor(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "backends":
        return "backends"
    return FOLDERS.get(parts[1], "core") if len(parts) > 1 else "core"


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


def test_the_core_calls_the_opentelemetry_api_and_sets_up_nothing() -> None:
    """A job's spans are the core's to start (gateway/jobs.py, gateway/admission.py); the SDK, its exporters
    and their configuration are the plumbing's (gateway/plumbing/tracing.py), installed only when asked for."""
    used = set()
    for path in (ROOT / "gateway").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if floor(module) != "core":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names] if isinstance(node, ast.Import) else []
            used |= {(module, name) for name in names if name.startswith("opentelemetry")}
    assert used and all(name in ("opentelemetry", "opentelemetry.trace", "opentelemetry.context") for _, name in used), sorted(used)


def test_each_floor_above_the_core_is_a_folder_of_its_own() -> None:
    flat = sorted(p.stem for p in (ROOT / "gateway").glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert [m for m in flat if floor(f"gateway.{m}") != "core"] == []
    for folder in ("plumbing", "server", "cli"):
        assert (ROOT / "gateway" / folder / "__init__.py").is_file()


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


def _defined(kind: type | tuple[type, ...]) -> list[tuple[str, ast.AST]]:
    """Every definition of `kind` in gateway/ and backends/, nested ones too, with its file."""
    found = []
    for package in ("gateway", "backends"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found += [(path.relative_to(ROOT).as_posix(), n) for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, kind)]
    return found


def test_no_two_classes_share_a_name() -> None:
    """A class is found by its name: two of one name (a `Surface` in two modules) are two things a reader confuses."""
    where: dict[str, list[str]] = {}
    for path, node in _defined(ast.ClassDef):
        where.setdefault(node.name, []).append(path)  # type: ignore[attr-defined]
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


MOST_LINES = 80


def test_no_function_is_over_80_lines() -> None:
    """A function a reader holds in mind at once: a longer one is cut into named parts."""
    long = sorted(
        (path, node.name)  # type: ignore[attr-defined]
        for path, node in _defined((ast.FunctionDef, ast.AsyncFunctionDef))
        if node.end_lineno - node.lineno + 1 > MOST_LINES  # type: ignore[attr-defined,operator]
    )
    assert long == []


MOST_MODULE_LINES = 600


def test_no_module_is_over_600_lines() -> None:
    """A module is one concept: past this, it holds two, each of which deserves its own file name."""
    long = sorted(
        (path.relative_to(ROOT).as_posix(), n)
        for package in ("gateway", "backends")
        for path in (ROOT / package).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MOST_MODULE_LINES
    )
    assert long == []
