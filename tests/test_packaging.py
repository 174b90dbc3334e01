"""The files that package streamgate for others: compose.yaml and the Dockerfile."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.processes import ROOT, clean_env


def compose_command() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.skipif(compose_command() is None, reason="neither `docker compose` nor docker-compose is installed (.ci/run installs it)")
@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_docker_compose_accepts_the_file(profile):
    command = compose_command()
    assert command is not None
    done = subprocess.run(
        [*command, "--profile", profile, "config"], cwd=ROOT, capture_output=True, text=True, env=clean_env()
    )
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    services = config["services"]
    assert {"gateway", f"executor-{profile}"} <= set(services)
    executor = services[f"executor-{profile}"]
    assert executor["build"]["target"] == "executor"
    assert services["gateway"]["environment"]["STREAMGATE_EXECUTOR"] == "http://executor:9000"
    aliases = executor["networks"]["default"]["aliases"]
    assert "executor" in aliases
    devices = executor.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    assert (profile == "gpu") == any("gpu" in d.get("capabilities", []) for d in devices)


def test_dockerfile_has_a_target_per_service():
    dockerfile = (ROOT / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, flags=re.M))
    assert {"gateway", "executor"} <= targets
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for service in compose["services"].values():
        assert service["build"]["target"] in targets
