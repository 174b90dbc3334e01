"""The files that package streamgate for others: compose.yaml, the Dockerfile and deploy/.

compose.yaml is checked as strictly as `docker compose --profile X config` checks it, with
no Docker engine or compose binary: YAML with unique keys, Compose's variable
interpolation, the Compose Specification's JSON Schema (tests/data/compose-spec.json,
which refuses unknown keys), durations Compose can parse, and every volume, network,
service, build context and target a service names defined.

deploy/kuberay-rayservice.yaml is checked with no Kubernetes cluster: its Serve config by
Ray Serve's own schema and by building the application from it, and the names that tie
its objects together (the head's Service, the application, Redis, labels, ports).

deploy/vllm-baseline.yaml, compose's `vllm` profile on Kubernetes, likewise: its gateway's
command and environment by the gateway's own configuration, vLLM's args and probes by the
vLLM of .vllm (the image's release), and the names that tie the gateway to vLLM's Service.
"""

from __future__ import annotations

import importlib
import json
import re
import tomllib
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import jsonschema
import pytest
import yaml

from tests.support.processes import ROOT

COMPOSE = ROOT / "compose.yaml"
SPEC = ROOT / "tests" / "data" / "compose-spec.json"
PROFILES = ["cpu", "gpu"]  # a gateway and an executor
RAY_PROFILE = "ray"  # a Ray head and a gateway on it
VLLM_PROFILE = "vllm"  # vLLM's server and a gateway fronting it
TRACING_PROFILE = "tracing"  # a trace collector beside any of the others
KUBERAY = ROOT / "deploy" / "kuberay-rayservice.yaml"
VLLM_BASELINE = ROOT / "deploy" / "vllm-baseline.yaml"
# Other projects' images, by compose service, each pinned to a release (deploy/ names the same ones).
OTHER_IMAGES = {"vllm": r"vllm/vllm-openai:v\d+\.\d+\.\d+", "jaeger": r"jaegertracing/jaeger:\d+\.\d+\.\d+"}


class ComposeError(Exception):
    """What Compose would refuse in a file, one problem a line."""


# --- YAML ----------------------------------------------------------------------------

class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys; Compose (go-yaml) refuses the file."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            # `<<: *anchor` may repeat and its keys may be overridden: that is no duplicate.
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise ComposeError(f"line {key_node.start_mark.line + 1}: {key!r} is defined twice")
            seen.add(key)
        return super().construct_mapping(node, deep)


# --- Interpolation, per the spec's 12-interpolation.md ---------------------------------

NAME = re.compile(r"[_A-Za-z][_A-Za-z0-9]*")
# Longest first, so that `:-` is not read as `:` followed by a default.
OPERATORS = (":-", ":?", ":+", "-", "?", "+")


def interpolate(text: str, env: Mapping[str, str], unset: set[str] | None = None) -> str:
    """`text` with its variables substituted as Compose does; the names used but not in `env`
    (which Compose warns about) go into `unset`. Raises ComposeError on a malformed `${...}`
    or a required variable without a value."""
    unset = set() if unset is None else unset
    out = []
    i = 0
    while i < len(text):
        if text[i] != "$":
            out.append(text[i])
            i += 1
        elif text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            end = _closing_brace(text, i + 2)
            out.append(_braced(text[i + 2 : end], env, unset, text))
            i = end + 1
        elif name := NAME.match(text, i + 1):
            out.append(_lookup(name.group(), env, unset))
            i = name.end()
        else:
            # Neither a name nor a brace: Compose keeps the `$` as it is.
            out.append("$")
            i += 1
    return "".join(out)


def _closing_brace(text: str, start: int) -> int:
    depth = 1
    i = start
    while i < len(text):
        if text.startswith("$$", i):
            i += 2
            continue
        if text.startswith("${", i):
            depth += 1
            i += 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ComposeError(f"invalid interpolation format for {text!r}: a `${{` is never closed")


def _lookup(name: str, env: Mapping[str, str], unset: set[str]) -> str:
    if name not in env:
        unset.add(name)
    return env.get(name, "")


def _braced(inner: str, env: Mapping[str, str], unset: set[str], text: str) -> str:
    name = NAME.match(inner)
    if name is None:
        raise ComposeError(f"invalid interpolation format for {text!r}: {'${' + inner + '}'!r} names no variable")
    rest = inner[name.end() :]
    if not rest:
        return _lookup(name.group(), env, unset)
    operator = next((op for op in OPERATORS if rest.startswith(op)), None)
    if operator is None:
        raise ComposeError(f"invalid interpolation format for {text!r}: {rest!r} after the variable name")
    argument = rest[len(operator) :]
    value = env.get(name.group())
    # With a colon an empty value counts as unset, as in the shell.
    has_value = bool(value) if operator.startswith(":") else value is not None
    if operator.endswith("-"):
        return value if has_value else interpolate(argument, env, unset)
    if operator.endswith("+"):
        return interpolate(argument, env, unset) if has_value else ""
    if not has_value:
        raise ComposeError(f"required variable {name.group()} is missing a value: {interpolate(argument, env, unset)}")
    return value


def interpolated(node: Any, env: Mapping[str, str], unset: set[str]) -> Any:
    """Compose interpolates values only, never keys."""
    if isinstance(node, dict):
        return {key: interpolated(value, env, unset) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolated(value, env, unset) for value in node]
    if isinstance(node, str):
        return interpolate(node, env, unset)
    return node


# --- Schema and references ---------------------------------------------------------------

@cache
def spec_validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SPEC.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


# Go's time.ParseDuration, which Compose applies to these fields after the schema (a plain string).
DURATION = re.compile(r"[-+]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|ms|s|m|h))+|0")
DURATION_FIELDS = ("stop_grace_period",)
HEALTHCHECK_DURATIONS = ("interval", "timeout", "start_period", "start_interval")


def dockerfile_targets(dockerfile: str) -> set[str]:
    return set(re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, flags=re.M | re.I))


def _names(entry: list[str] | dict[str, Any] | None) -> list[str]:
    """Compose's short (a list) and long (a mapping) forms alike."""
    return list(entry or [])


def _named_volume(volume: str | dict[str, Any]) -> str | None:
    if isinstance(volume, dict):
        return volume.get("source") if volume.get("type", "volume") == "volume" else None
    source, colon, _ = volume.partition(":")
    # A path (or no source: an anonymous volume) is a bind mount or needs no declaration.
    if not colon or source.startswith((".", "/", "~")):
        return None
    return source


def reference_problems(document: dict[str, Any]) -> list[str]:
    problems = []
    services = document.get("services", {})
    volumes = set(document.get("volumes") or {})
    networks = {"default", *(document.get("networks") or {})}
    for name, service in services.items():
        where = f"services.{name}"
        for volume in service.get("volumes", []):
            source = _named_volume(volume)
            if source is not None and source not in volumes:
                problems.append(f"{where}.volumes: {source!r} is not declared under the top-level volumes")
        for network in _names(service.get("networks")):
            if network not in networks:
                problems.append(f"{where}.networks: {network!r} is neither default nor declared under networks")
        for other in _names(service.get("depends_on")):
            if other not in services:
                problems.append(f"{where}.depends_on: no service {other!r}")
        for field in DURATION_FIELDS:
            if field in service and not DURATION.fullmatch(str(service[field])):
                problems.append(f"{where}.{field}: {service[field]!r} is not a duration")
        for field in HEALTHCHECK_DURATIONS:
            value = service.get("healthcheck", {}).get(field)
            if value is not None and not DURATION.fullmatch(str(value)):
                problems.append(f"{where}.healthcheck.{field}: {value!r} is not a duration")
        build = service.get("build")
        if build is None:
            continue
        build = {"context": build} if isinstance(build, str) else build
        context = ROOT / build.get("context", ".")
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        if not context.is_dir():
            problems.append(f"{where}.build.context: no folder {context}")
        elif not dockerfile.is_file():
            problems.append(f"{where}.build.dockerfile: no file {dockerfile}")
        elif "target" in build and build["target"] not in dockerfile_targets(dockerfile.read_text()):
            problems.append(f"{where}.build.target: no stage {build['target']!r} in {dockerfile}")
    return problems


def load_compose(text: str, env: Mapping[str, str] | None = None) -> tuple[dict[str, Any], set[str]]:
    """The file's document, interpolated from `env`, and the variables it used that `env`
    lacks; raises ComposeError with every problem Compose would refuse the file for."""
    document = interpolated(yaml.load(text, Loader=_UniqueKeyLoader), env or {}, unset := set())
    errors = sorted(spec_validator().iter_errors(document), key=lambda e: list(map(str, e.absolute_path)))
    problems = [f"{'.'.join(map(str, e.absolute_path)) or '(top level)'}: {e.message}" for e in errors]
    # The references are looked at only in a document of the right shape.
    problems = problems or reference_problems(document)
    if problems:
        raise ComposeError("\n".join(problems))
    return document, unset


def active_services(document: dict[str, Any], profile: str) -> dict[str, Any]:
    """What `--profile` starts: the services without profiles, and those with this one."""
    return {
        name: service
        for name, service in document["services"].items()
        if not service.get("profiles") or profile in service["profiles"]
    }


def environment(service: dict[str, Any]) -> dict[str, Any]:
    env = service.get("environment", {})
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return env


# --- The file ----------------------------------------------------------------------------

@pytest.mark.parametrize("profile", PROFILES)
def test_compose_file_is_valid_for_each_profile(profile):
    document, _ = load_compose(COMPOSE.read_text())
    services = active_services(document, profile)
    assert set(services) == {"gateway", f"executor-{profile}"}
    for name, service in services.items():
        for other in _names(service.get("depends_on")):
            assert other in services, f"{name} depends on {other}, which --profile {profile} does not start"
    executor = services[f"executor-{profile}"]
    assert executor["build"]["target"] == "executor"
    assert environment(services["gateway"])["STREAMGATE_EXECUTOR"] == "http://executor:9000"
    aliases = executor["networks"]["default"]["aliases"]
    assert "executor" in aliases
    devices = executor.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    assert (profile == "gpu") == any("gpu" in d.get("capabilities", []) for d in devices)


def test_compose_variables_have_defaults_and_reach_both_services():
    _, unset = load_compose(COMPOSE.read_text())
    assert unset == set(), "Compose would warn that these are not set"
    document, _ = load_compose(COMPOSE.read_text(), {"STREAMGATE_EXECUTOR_TOKEN": "t0k", "STREAMGATE_TOKENS": "a=b"})
    services = document["services"]
    assert environment(services["gateway"])["STREAMGATE_TOKENS"] == "a=b"
    for name in ("gateway", "executor-cpu", "executor-gpu"):
        assert environment(services[name])["STREAMGATE_EXECUTOR_TOKEN"] == "t0k"
    assert environment(services["gateway-ray"])["STREAMGATE_TOKENS"] == "a=b"
    assert environment(services["gateway-ray"])["STREAMGATE_RAY_REPLICAS"] == "1"


def test_the_ray_profile_is_a_head_and_a_gateway_that_joins_it():
    document, _ = load_compose(COMPOSE.read_text())
    services = active_services(document, RAY_PROFILE)
    assert set(services) == {"ray-head", "gateway-ray"}
    head, gateway = services["ray-head"], services["gateway-ray"]
    assert head["build"]["target"] == gateway["build"]["target"] == "ray"
    assert "pip install -c constraints.txt '.[ray]'" in (ROOT / "Dockerfile").read_text()
    assert gateway["depends_on"] == {"ray-head": {"condition": "service_healthy"}}
    env = environment(gateway)
    assert (env["STREAMGATE_BACKEND"], env["STREAMGATE_RAY_ADDRESS"]) == ("ray", "auto")
    # A node with nothing to place replicas on, then the gateway as PID 1's child (exec): SIGTERM drains it.
    script = gateway["command"][-1]
    assert script.startswith("ray start --address=ray-head:6379 --num-cpus=0 --num-gpus=0 ")
    assert script.endswith("&& exec streamgate serve --host 0.0.0.0 --port 8000")
    assert gateway["init"] is True
    assert "model-cache:/cache" in head["volumes"]  # the replicas load the model on the head


def test_every_profile_is_checked_and_publishes_each_port_once():
    document, _ = load_compose(COMPOSE.read_text())
    named = {p for service in document["services"].values() for p in service.get("profiles", [])}
    assert named == {*PROFILES, RAY_PROFILE, VLLM_PROFILE, TRACING_PROFILE}
    for profile in named:
        published = [
            port.rsplit(":", 1)[0] for service in active_services(document, profile).values()
            for port in service.get("ports", [])
        ]
        assert len(published) == len(set(published)), f"--profile {profile} publishes a port twice: {published}"


def test_the_tracing_profile_is_a_collector_every_service_sends_its_traces_to():
    document, unset = load_compose(COMPOSE.read_text(), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"})
    assert unset == set()
    assert set(active_services(document, TRACING_PROFILE)) == {"jaeger"}
    jaeger = document["services"]["jaeger"]
    assert "receivers.otlp.protocols.http.endpoint=0.0.0.0:4318" in jaeger["command"]
    # Every streamgate process (and the Ray head, whose replicas run there) is told where the collector is.
    for name, service in document["services"].items():
        if name not in ("jaeger", "vllm"):
            assert environment(service)["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318", name
    unset_document, _ = load_compose(COMPOSE.read_text())
    assert environment(unset_document["services"]["gateway"])["OTEL_EXPORTER_OTLP_ENDPOINT"] == ""  # nothing traced


def test_the_constraints_pin_every_dependency_within_its_range():
    """constraints.txt (what the Makefile installs) holds one version of each requirement in
    pyproject.toml, runtime and extras, that the requirement itself allows; torch is pyproject's."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and canonicalize_name(name) not in pinned, line
            pinned[canonicalize_name(name)] = version
    wanted = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    for requirement in map(Requirement, wanted):
        name = canonicalize_name(requirement.name)
        if name in ("streamgate", "torch"):
            continue
        assert name in pinned, f"{requirement} is not in constraints.txt: make lock"
        assert requirement.specifier.contains(pinned[name], prereleases=True), f"constraints.txt has {name}=={pinned[name]}, outside {requirement}"
    assert "torch" not in pinned and any(r.startswith("torch==") for r in project["dependencies"])


def test_dockerfile_has_a_target_per_service():
    targets = dockerfile_targets((ROOT / "Dockerfile").read_text())
    assert {"gateway", "executor"} <= targets
    compose = yaml.safe_load(COMPOSE.read_text())
    for name, service in compose["services"].items():
        if name in OTHER_IMAGES:  # another project's image, pinned to a release
            assert "build" not in service and re.fullmatch(OTHER_IMAGES[name], service["image"]), name
            continue
        assert service["build"]["target"] in targets


def test_the_vllm_profile_is_vllms_server_and_a_gateway_serving_a_model_beside_it():
    from backends import loading as models

    document, _ = load_compose(COMPOSE.read_text())
    services = active_services(document, VLLM_PROFILE)
    assert set(services) == {"vllm", "gateway-vllm"}
    server, gateway = services["vllm"], services["gateway-vllm"]
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in server["command"])
    assert flags["served-model-name"] == "baseline" and flags["model"] == "/models/baseline"
    # The gateway's models as it resolves them: the bundled one here, the baseline on the server.
    given = [arg.removeprefix("--model=") for arg in gateway["command"] if arg.startswith("--model=")]
    candidate, baseline = models.specs(given)
    assert candidate.gguf is not None and candidate.server is None
    assert (baseline.server, baseline.source) == ("openai", "http://vllm:8000/v1")
    for service in (server, gateway):
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert "gpu" in device["capabilities"]
    assert float(flags["gpu-memory-utilization"]) < 1  # the gateway's model shares the GPU


# --- deploy/kuberay-rayservice.yaml -------------------------------------------------------

def manifest(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """A file's Kubernetes objects by kind and name."""
    documents = list(yaml.load_all(path.read_text(), Loader=_UniqueKeyLoader))
    objects = {(d["kind"], d["metadata"]["name"]): d for d in documents}
    assert len(objects) == len(documents), f"{path.name}: two objects of one kind share a name"
    return objects


def kuberay() -> dict[tuple[str, str], dict[str, Any]]:
    return manifest(KUBERAY)


def assert_service_reaches(objects: dict[tuple[str, str], dict[str, Any]], service: str, deployment: str) -> dict[str, Any]:
    """A Service selects the pods of its Deployment, on ports those pods have; returns the Service's spec."""
    spec = objects[("Service", service)]["spec"]
    template = objects[("Deployment", deployment)]["spec"]["template"]
    assert spec["selector"] == template["metadata"]["labels"]
    assert objects[("Deployment", deployment)]["spec"]["selector"]["matchLabels"] == template["metadata"]["labels"]
    ports = {p["name"] for c in template["spec"]["containers"] for p in c["ports"]}
    assert {p["targetPort"] for p in spec["ports"]} <= ports
    return spec


def pod_env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_the_rayservice_builds_the_application_gateways_attach_to():
    import ray
    from ray.serve.schema import ServeDeploySchema

    from backends.ray_serve import APP_NAME, DEPLOYMENT

    service = kuberay()[("RayService", "streamgate")]
    assert service["apiVersion"] == "ray.io/v1"
    config = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    [app] = config.applications
    assert (app.name, app.route_prefix) == (APP_NAME, None)
    module, _, attr = app.import_path.partition(":")
    built = getattr(importlib.import_module(module), attr)(app.args)._bound_deployment
    assert built.name == DEPLOYMENT
    assert built.ray_actor_options["num_gpus"] == 1
    scaling = built._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas) == (app.args["ray-min-replicas"], app.args["ray-max-replicas"])
    cluster = service["spec"]["rayClusterConfig"]
    [gpu_group] = cluster["workerGroupSpecs"]
    assert gpu_group["maxReplicas"] >= scaling.max_replicas  # a GPU pod for each replica
    [worker] = gpu_group["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    pin = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["ray"]
    assert pin == [f"ray[serve]=={cluster['rayVersion']}"] and ray.__version__ == cluster["rayVersion"]


def test_the_application_builder_checks_its_args_as_a_config_file():
    from backends.ray_app import app

    fixed = app({"ray-replicas": 3, "ray-gpus-per-replica": 0, "max_batch_size": 4})._bound_deployment
    assert (fixed.num_replicas, fixed.ray_actor_options["num_gpus"], fixed.max_ongoing_requests) == (3, 0, 64 + 4)
    assert json.loads(fixed.init_args[0])["device"] == "cpu"  # no GPU: the replica says so to the model
    with pytest.raises(ValueError, match=re.escape("args: unknown setting 'max-batch-sise'")):
        app({"max-batch-sise": 8})
    with pytest.raises(ValueError, match=re.escape("args: max-batch-size: 0 is not in the range")):
        app({"max-batch-size": 0})
    with pytest.raises(ValueError, match="not both"):
        app({"ray-replicas": 2, "ray-max-replicas": 3})


def test_the_gateways_join_the_rayservice_and_share_jobs_through_redis():
    from backends.ray_serve import APP_NAME
    from gateway.config import Settings

    objects = kuberay()
    [(_, name)] = [key for key in objects if key[0] == "RayService"]
    service = objects[("RayService", name)]
    pod = objects[("Deployment", "streamgate-gateway")]["spec"]["template"]
    [gateway] = pod["spec"]["containers"]
    env = pod_env(gateway)
    assert env["RAY_HEAD"] == f"{name}-head-svc"  # the Service KubeRay makes for a RayService's head
    assert (env["STREAMGATE_BACKEND"], env["STREAMGATE_RAY_ADDRESS"]) == ("ray", "auto")
    script = gateway["args"][0]
    assert f"get('{APP_NAME}', {{}})" in script  # waits for the RayService's application first
    assert 'ray start --address="$RAY_HEAD:6379" --num-cpus=0 --num-gpus=0 ' in script
    assert script.rstrip().endswith("exec streamgate serve --host 0.0.0.0 --port 8000")
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    worker = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert head["image"] == worker["image"] == gateway["image"]  # one Ray, one Python
    assert pod["spec"]["terminationGracePeriodSeconds"] > Settings().drain_timeout
    assert (gateway["readinessProbe"]["httpGet"]["path"], gateway["livenessProbe"]["httpGet"]["path"]) == ("/readyz", "/healthz")
    # Services select the pods they name, on ports those pods have.
    redis = urlparse(env["STREAMGATE_STORE"]).hostname
    for svc, deployment in (("streamgate-gateway", "streamgate-gateway"), (redis, "streamgate-redis")):
        assert_service_reaches(objects, svc, deployment)


# --- deploy/vllm-baseline.yaml ------------------------------------------------------------

def vllm_baseline() -> dict[tuple[str, str], dict[str, Any]]:
    return manifest(VLLM_BASELINE)


def container(objects: dict[tuple[str, str], dict[str, Any]], deployment: str) -> dict[str, Any]:
    [only] = objects[("Deployment", deployment)]["spec"]["template"]["spec"]["containers"]
    return only


def flags(args: list[str]) -> dict[str, str]:
    """`--name=value` arguments by name; any other form is refused, so that none is overlooked."""
    assert all(arg.startswith("--") and "=" in arg for arg in args), args
    return dict(arg.removeprefix("--").split("=", 1) for arg in args)


def port_number(pod: dict[str, Any], name: str) -> int:
    [number] = [p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"] if p["name"] == name]
    return number


def secret_ref(container: dict[str, Any], name: str) -> dict[str, Any]:
    [entry] = [e for e in container.get("env", []) if e["name"] == name]
    return entry["valueFrom"]["secretKeyRef"]


def test_the_vllm_baseline_is_composes_vllm_server_on_a_gpu_of_its_own():
    objects = vllm_baseline()
    assert set(objects) == {
        ("PersistentVolumeClaim", "vllm-models"),
        ("Deployment", "vllm-baseline"), ("Service", "vllm-baseline"),
        ("Deployment", "streamgate-gateway-vllm"), ("Service", "streamgate-gateway-vllm"),
    }
    compose, _ = load_compose(COMPOSE.read_text())  # as run with no variables set
    composed = compose["services"]["vllm"]
    server = container(objects, "vllm-baseline")
    # vLLM's image as compose pins it, and its args, less the share of a GPU that compose splits.
    assert server["image"] == composed["image"] and re.fullmatch(OTHER_IMAGES["vllm"], server["image"])
    assert "command" not in server  # the image's own `vllm serve`, given compose's command as args
    given = flags(server["args"])
    assert given == {k: v for k, v in flags(composed["command"]).items() if k != "gpu-memory-utilization"}
    assert given["served-model-name"] == "baseline"
    # The model's folder is on the volume mounted where --model looks.
    pod = objects[("Deployment", "vllm-baseline")]["spec"]["template"]["spec"]
    [mount] = [m for m in server["volumeMounts"] if Path(given["model"]).is_relative_to(m["mountPath"])]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in objects
    assert {"/dev/shm", "/root/.cache/huggingface"} <= {m["mountPath"] for m in server["volumeMounts"]}
    # Probes on compose's healthcheck route, on a port the container has.
    [checked] = re.findall(r"http://[^'\"]+", composed["healthcheck"]["test"][-1])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert server[probe]["httpGet"] == {"path": urlparse(checked).path, "port": "http"}, probe
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # compose's start_period: a first start compiles
    # Each GPU pod has one GPU to itself; a rolling update would wait for a second GPU (and the claim).
    for name in ("vllm-baseline", "streamgate-gateway-vllm"):
        deployment = objects[("Deployment", name)]["spec"]
        [pod_container] = deployment["template"]["spec"]["containers"]
        assert pod_container["resources"]["limits"]["nvidia.com/gpu"] == 1, name
        assert deployment["strategy"]["type"] == "Recreate", name
        assert deployment["replicas"] == 1, name  # the gateway's jobs are in its memory
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in deployment["template"]["spec"]["tolerations"]
    for name in ("vllm-baseline", "streamgate-gateway-vllm"):
        assert_service_reaches(objects, name, name)


def test_the_vllm_baselines_gateway_serves_the_bundled_model_and_vllms_under_its_served_name(monkeypatch):
    import subprocess

    from backends import inference
    from backends import loading as models
    from gateway.server import openapi
    from tests.support.processes import STREAMGATE, clean_env

    objects = vllm_baseline()
    gateway, server = container(objects, "streamgate-gateway-vllm"), container(objects, "vllm-baseline")
    pod = objects[("Deployment", "streamgate-gateway-vllm")]["spec"]["template"]
    assert gateway["image"] == container(kuberay(), "streamgate-gateway")["image"]  # the project's image, one name in deploy/
    assert gateway["command"][:2] == ["streamgate", "serve"]
    # The command and environment as the real gateway reads them (secrets by a stand-in).
    env = {e["name"]: e.get("value", "from-a-secret") for e in gateway["env"]}
    printed = subprocess.run(
        [str(STREAMGATE), *gateway["command"][1:], "--print-config=json"],
        env=clean_env(**env), capture_output=True, text=True, timeout=60, check=False,
    )
    assert printed.returncode == 0, printed.stderr
    settings = json.loads(printed.stdout)["settings"]
    assert (settings["host"], settings["port"], settings["backend"]) == ("0.0.0.0", port_number(pod, "http"), "local")
    assert settings["tokens"] == ["REDACTED"]  # STREAMGATE_TOKENS reached it
    assert pod["spec"]["terminationGracePeriodSeconds"] > settings["drain_timeout"]
    # Its models: the bundled one, as compose's gateway names it; the baseline at vLLM's Service.
    candidate, baseline = models.specs(settings["model"])
    assert (candidate.name, candidate.server) == ("candidate", None) and candidate.gguf is not None
    composed = load_compose(COMPOSE.read_text())[0]["services"]["gateway-vllm"]["command"]
    local = [arg for arg in gateway["command"] if arg.startswith("--model=") and models.OPENAI not in arg]
    assert local == [arg for arg in composed if arg.startswith("--model=") and models.OPENAI not in arg]
    assert (baseline.name, baseline.server) == (flags(server["args"])["served-model-name"], "openai")
    url = urlparse(baseline.source)
    service = assert_service_reaches(objects, url.hostname, "vllm-baseline")
    [port] = [p for p in service["ports"] if p["port"] == url.port]
    assert port_number(objects[("Deployment", "vllm-baseline")]["spec"]["template"], port["targetPort"]) == 8000  # vLLM's default
    assert (url.scheme, url.path) == ("http", "/v1")
    # vLLM's key: from the Secret vLLM takes it from, into the variable --model-api-key names for the baseline.
    keys = dict(entry.split("=", 1) for entry in settings["model_api_key"])
    assert set(keys) == {baseline.name}
    assert secret_ref(gateway, keys[baseline.name]) == secret_ref(server, "VLLM_API_KEY")
    monkeypatch.setenv(keys[baseline.name], "the-key")
    monkeypatch.setenv("OPENAI_API_KEY", "another")
    assert inference.api_key(baseline.name, keys) == "the-key"
    # Probes on the gateway's routes: ready (503 until both models are) and alive.
    paths = openapi.document([], {"max_prompts": 1, "max_tokens": 1, "max_sequences": 1})["paths"]
    ready, alive = gateway["readinessProbe"]["httpGet"], gateway["livenessProbe"]["httpGet"]
    assert "503" in paths[ready["path"]]["get"]["responses"] and "503" not in paths[alive["path"]]["get"]["responses"]
    assert gateway["startupProbe"]["httpGet"] == alive and ready["port"] == alive["port"] == "http"


@pytest.mark.vllm
def test_vllm_takes_the_baselines_args_and_answers_its_probes():
    """vLLM's own parser and routes, from .vllm: the release the image is pinned to."""
    import subprocess

    from backends.vllm_server import vllm_python

    server = container(vllm_baseline(), "vllm-baseline")
    compose, _ = load_compose(COMPOSE.read_text())
    script = """
import json, sys
from fastapi import FastAPI
import vllm
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.entrypoints.serve.instrumentator import register_instrumentator_api_routers
from vllm.utils.argparse_utils import FlexibleArgumentParser
app = FastAPI()
register_instrumentator_api_routers(app)
parsed = [vars(make_arg_parser(FlexibleArgumentParser()).parse_args(args)) for args in json.loads(sys.argv[1])]
print(json.dumps({"version": vllm.__version__, "routes": sorted({r.path for r in app.routes}),
                  "parsed": [{k: p[k] for k in ("model", "served_model_name", "port")} for p in parsed]}))
"""
    given = [server["args"], compose["services"]["vllm"]["command"]]
    run = subprocess.run(
        [vllm_python(None), "-c", script, json.dumps(given)], capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.splitlines()[-1])
    assert f"vllm/vllm-openai:v{found['version']}" == server["image"]
    ours, composed = found["parsed"]
    assert ours == composed == {"model": "/models/baseline", "served_model_name": ["baseline"], "port": 8000}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert server[probe]["httpGet"]["path"] in found["routes"], probe


# --- The checker catches what Compose would refuse ----------------------------------------

@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        # Indented four, only the gateway's healthcheck matches (x-executor's is indented two).
        ("\n    healthcheck:", "\n    healthchek:", "'healthchek' does not match any of the regexes"),
        ("volumes:\n  model-cache:", "volmues:\n  model-cache:", "'volmues' does not match any of the regexes"),
        ("STREAMGATE_TOKENS: ${STREAMGATE_TOKENS:-}", "STREAMGATE_TOKENS: ${STREAMGATE_TOKENS:-", "never closed"),
        ("${STREAMGATE_TOKENS:-}", "${STREAMGATE_TOKENS/a/b}", "'/a/b' after the variable name"),
        ("${STREAMGATE_TOKENS:-}", "${STREAMGATE_TOKENS:?set STREAMGATE_TOKENS}", "set STREAMGATE_TOKENS"),
        ("restart: unless-stopped\n  stop_grace_period: 40s\n\nservices:",
         "restart: unless-stopped\n  restart: always\n  stop_grace_period: 40s\n\nservices:",
         "'restart' is defined twice"),
        ("    - model-cache:/cache", "    - model-cahce:/cache", "'model-cahce' is not declared"),
        ("      aliases: [executor]", "      aliases: [executor]\n    backend: {}", "'backend' is neither default nor declared"),
        ("    profiles: [cpu]", "    profiles: [cpu]\n    depends_on: [gatewya]", "no service 'gatewya'"),
        ("    interval: 10s\n    timeout: 5s\n    start_period", "    interval: 10 s\n    timeout: 5s\n    start_period",
         "'10 s' is not a duration"),
        ("    target: executor", "    target: exectuor", "no stage 'exectuor'"),
        ("    context: .\n    target: executor", "    context: ./nowhere\n    target: executor", "no folder"),
        ("capabilities: [gpu]", "capabilities: gpu", "services.executor-gpu.deploy.resources.reservations.devices.0.capabilities"),
    ],
)
def test_a_broken_compose_file_is_refused(old, new, problem):
    text = COMPOSE.read_text()
    assert old in text
    with pytest.raises(ComposeError, match=re.escape(problem)):
        load_compose(text.replace(old, new, 1))


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("plain", {}, "plain"),
        ("$$VAR and $${VAR}", {"VAR": "x"}, "$VAR and ${VAR}"),
        ("$VAR/${VAR}", {"VAR": "x"}, "x/x"),
        ("${VAR:-d}", {}, "d"),
        ("${VAR:-d}", {"VAR": ""}, "d"),
        ("${VAR-d}", {"VAR": ""}, ""),
        ("${VAR-d}", {}, "d"),
        ("${VAR:+alt}", {"VAR": "x"}, "alt"),
        ("${VAR:+alt}", {"VAR": ""}, ""),
        ("${VAR+alt}", {"VAR": ""}, "alt"),
        ("${VAR:?err}", {"VAR": "x"}, "x"),
        ("${VAR?err}", {"VAR": ""}, ""),
        ("${VAR:-${OTHER:-inner}}", {}, "inner"),
        ("${VAR:-$OTHER}", {"OTHER": "o"}, "o"),
        ("${VAR:-a}}", {}, "a}"),
        ("costs $5 or $", {}, "costs $5 or $"),
    ],
)
def test_interpolation(text, env, expected):
    assert interpolate(text, env) == expected


@pytest.mark.parametrize(
    ("text", "env", "problem"),
    [
        ("${VAR", {}, "never closed"),
        ("${VAR:-${OTHER}", {}, "never closed"),
        ("${}", {}, "names no variable"),
        ("${1VAR}", {}, "names no variable"),
        ("${VAR/a/b}", {}, "after the variable name"),
        ("${VAR:x}", {}, "after the variable name"),
        ("${VAR:?needed here}", {"VAR": ""}, "VAR is missing a value: needed here"),
        ("${VAR?needed}", {}, "VAR is missing a value: needed"),
    ],
)
def test_malformed_or_missing_interpolation_is_refused(text, env, problem):
    with pytest.raises(ComposeError, match=re.escape(problem)):
        interpolate(text, env)


def test_unset_variables_are_reported_as_compose_warns_about_them():
    unset: set[str] = set()
    assert interpolate("$A ${B} ${C:-c} ${D-d} ${E:+e}", {"E": "x"}, unset) == "  c d e"
    assert unset == {"A", "B"}
