"""scripts/check-system: `make test` stops at once, naming the missing system tools and the
one command that installs them, rather than failing or skipping tests later.

The script runs with PATH holding only stand-ins for the tools, so each case is the same
whatever this machine has installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.processes import ROOT

SCRIPT = ROOT / "scripts" / "check-system"
BASH = shutil.which("bash") or "/bin/bash"
SUDO = "" if os.geteuid() == 0 else "sudo "
ALL = ["redis-server", "chromium", "nodejs", "npm"]
NODE_NOTE = "NodeSource"


def stand_ins(folder: Path, *, missing: tuple[str, ...] = (), node_version: str = "v20.11.1") -> dict[str, str]:
    """The environment of a system that has every tool but those in `missing` (package names)."""
    bin_ = folder / "bin"
    bin_.mkdir()
    tools = {"redis-server": "redis-server", "nodejs": "node", "npm": "npm"}
    for package, tool in tools.items():
        if package not in missing:
            (bin_ / tool).write_text(f"#!/bin/sh\necho {node_version}\n")
            (bin_ / tool).chmod(0o755)
    chromium = folder / "chromium"
    if "chromium" not in missing:
        chromium.write_text("#!/bin/sh\n")
        chromium.chmod(0o755)
    return {"PATH": str(bin_), "CHROMIUM_PATH": str(chromium)}


def check(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BASH, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=10)


def test_a_system_with_everything_passes(tmp_path):
    env = stand_ins(tmp_path)
    done = check(env)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert check(env, "--packages").stdout == "\n"


def test_a_bare_system_is_told_the_one_command(tmp_path):
    env = stand_ins(tmp_path, missing=tuple(ALL))
    done = check(env)
    assert done.returncode == 1
    assert done.stdout == ""
    for tool in ("redis-server", env["CHROMIUM_PATH"], "node", "npm"):
        assert f"\n  {tool} " in done.stderr
    for package in ALL:
        assert f"(Debian package {package})" in done.stderr
    assert f"\n  {SUDO}apt-get install -y redis-server chromium nodejs npm\n" in done.stderr
    assert NODE_NOTE in done.stderr
    assert check(env, "--packages").stdout == "redis-server chromium nodejs npm\n"


@pytest.mark.parametrize("package", ALL)
def test_only_the_missing_package_is_named(tmp_path, package):
    env = stand_ins(tmp_path, missing=(package,))
    done = check(env)
    assert done.returncode == 1
    assert f"\n  {SUDO}apt-get install -y {package}\n" in done.stderr
    assert (NODE_NOTE in done.stderr) == (package == "nodejs")
    assert check(env, "--packages").stdout == f"{package}\n"


def test_an_old_node_is_refused_with_where_to_get_a_new_one(tmp_path):
    done = check(stand_ins(tmp_path, node_version="v18.20.4"))
    assert done.returncode == 1
    assert "  node" in done.stderr and " is v18.20.4; web/ needs Node.js 20 or later\n" in done.stderr
    assert "apt-get" not in done.stderr, "Debian 12's nodejs is 18: installing it would not help"
    assert NODE_NOTE in done.stderr


def test_the_redis_server_the_tests_use_is_the_one_checked(tmp_path):
    env = stand_ins(tmp_path) | {"STREAMGATE_REDIS_SERVER": str(tmp_path / "nowhere" / "redis-server")}
    done = check(env)
    assert done.returncode == 1
    assert f"\n  {SUDO}apt-get install -y redis-server\n" in done.stderr


def test_make_test_stops_before_installing_anything(tmp_path):
    # A venv and npm that cannot work: had the check let `make test` go on, the first
    # install step would show in its output (and fail at once rather than run the suite).
    # Not the flags of a `make test` this may run under: its jobserver is not passed down.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env |= {"CHROMIUM_PATH": "/nonexistent/chromium", "STREAMGATE_REDIS_SERVER": "/nonexistent/redis-server"}
    started = time.monotonic()
    done = subprocess.run(
        ["make", "-j4", "test", f"VENV={tmp_path / 'venv'}", "PYTHON=false", "NPM=false"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
    )
    assert done.returncode != 0
    assert time.monotonic() - started < 10
    assert f"\n  {SUDO}apt-get install -y redis-server chromium\n" in done.stderr
    assert done.stdout.strip() == "scripts/check-system", done.stdout
