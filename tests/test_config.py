"""Configuration: `--config FILE`, `--print-config` (sources, redaction) and `--dry-run`.

Most run the command in this process with click's CliRunner; `--print-config`
shows the Settings the command built, so it is also how precedence is observed.
Nothing here may start a server: `uvicorn.run` is replaced by a failure.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from gateway.cli import commands as cli
from gateway.cli.configfile import redact, redact_url
from tests.support.processes import ROOT, STREAMGATE, clean_env, free_port


@pytest.fixture(autouse=True)
def no_servers_and_a_clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("this command should not start a server")

    monkeypatch.setattr(uvicorn, "run", refuse)
    for name in os.environ:
        if name.startswith("STREAMGATE_"):
            monkeypatch.delenv(name)
    # Logging set up in-process would hold CliRunner's captured stderr after the test.
    monkeypatch.setattr("gateway.plumbing.logs.configure_logging", lambda *args, **kwargs: None)


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli.main, list(args), env=env)


def effective(*args: str, command: str = "serve", env: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The settings `command` would run with, and where each came from."""
    result = invoke(command, *args, "--print-config=json", env=env)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    return printed["settings"], printed["sources"]


def write(tmp_path: Path, text: str, name: str = "streamgate.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- precedence: flag > env > file > default -------------------------------------------

PRECEDENCE = [
    # name, default, (file line, value), (env var, value), (flag args, value)
    ("port", 8000, ("port = 9001", 9001), ("STREAMGATE_PORT", "9002", 9002), (["--port", "9003"], 9003)),
    ("max_batch_size", 32, ("max-batch-size = 8", 8), ("STREAMGATE_MAX_BATCH_SIZE", "4", 4),
     (["--max-batch-size", "2"], 2)),
    ("tools", [], ('tools = ["a.tools", "b.tools"]', ["a.tools", "b.tools"]),
     ("STREAMGATE_TOOLS", "c.tools d.tools", ["c.tools", "d.tools"]), (["--tools", "e.tools"], ["e.tools"])),
    ("devices", [], ('devices = ["cuda:0", "cuda:1"]', ["cuda:0", "cuda:1"]),
     ("STREAMGATE_DEVICES", "cuda:2,cuda:3", ["cuda:2", "cuda:3"]), (["--devices", "cpu"], ["cpu"])),
    # The env var turns off what the file turned on; the flag turns it back on.
    ("debug", False, ("debug = true", True), ("STREAMGATE_DEBUG", "0", False), (["--debug"], True)),
    ("log_level", "info", ('log_level = "debug"', "debug"), ("STREAMGATE_LOG_LEVEL", "error", "error"),
     (["--log-level", "warning"], "warning")),
]


@pytest.mark.parametrize(("name", "default", "file", "env", "flag"), PRECEDENCE, ids=[p[0] for p in PRECEDENCE])
def test_flag_beats_env_beats_file_beats_default(tmp_path, name, default, file, env, flag):
    config = write(tmp_path, file[0] + "\n")
    var, env_value, from_env = env
    layers = [
        ((), None, default, "default"),
        (("--config", config), None, file[1], "file"),
        (("--config", config), {var: env_value}, from_env, "env"),
        (("--config", config, *flag[0]), {var: env_value}, flag[1], "flag"),
    ]
    for args, environ, want, source in layers:
        settings, sources = effective(*args, env=environ)
        assert (settings[name], sources[name]) == (want, source), (args, environ)
        # Nothing else moved.
        assert {k for k, s in sources.items() if s != "default"} == ({name} if source != "default" else set())


def test_the_config_file_can_come_from_STREAMGATE_CONFIG(tmp_path):
    config = write(tmp_path, "port = 9100\n")
    settings, sources = effective(env={"STREAMGATE_CONFIG": config})
    assert (settings["port"], sources["port"]) == (9100, "file")


def test_keys_are_setting_or_flag_names_with_dashes_or_underscores(tmp_path):
    config = write(tmp_path, "\n".join([
        'executor = ["http://a:9000"]',  # the flag's name (--executor) for `executors`
        "max_batch_size = 3",
        "batch-wait-ms = 2",  # an integer is fine for a float
        'cors-origins = "https://a.example,https://b.example"',  # comma-separated, as on the command line
        'tools = "one.tools"',  # a single entry needs no array
    ]))
    settings, _ = effective("--config", config)
    assert settings["executors"] == ["http://a:9000"]
    assert settings["max_batch_size"] == 3
    assert settings["batch_wait_ms"] == 2.0
    assert settings["cors_origins"] == ["https://a.example", "https://b.example"]
    assert settings["tools"] == ["one.tools"]


def test_the_executor_reads_its_own_settings_from_a_file(tmp_path):
    config = write(tmp_path, "port = 9500\nresult-ttl = 5\nsession_grace = 1.5\n")
    settings, sources = effective("--config", config, command="executor")
    assert (settings["port"], settings["result_ttl"], settings["session_grace"]) == (9500, 5.0, 1.5)
    assert sources["result_ttl"] == "file"
    assert "backend" not in settings  # a gateway setting: not shown for an executor


# -- errors in the file ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("prot = 9000\n", ["unknown setting 'prot'", "did you mean 'port'"]),
        ("[serve]\nport = 9000\n", ["unknown setting 'serve'"]),
        ("config = 'other.toml'\n", ["unknown setting 'config'"]),
        ("dry-run = true\n", ["unknown setting 'dry-run'"]),
        ("port = 1\nport_ = 2\n", ["unknown setting 'port_'"]),
        ("max-batch-size = 1\nmax_batch_size = 2\n", ["already set"]),
    ],
)
def test_an_unknown_key_is_an_error_naming_the_key_and_the_file(tmp_path, text, expected):
    config = write(tmp_path, text)
    result = invoke("serve", "--config", config, "--print-config")
    assert result.exit_code == 2, result.output
    assert config in result.output
    for part in expected:
        assert part in result.output


def test_a_gateway_setting_is_unknown_to_the_executor(tmp_path):
    config = write(tmp_path, 'backend = "remote"\n')
    result = invoke("executor", "--config", config, "--print-config")
    assert result.exit_code == 2
    assert config in result.output
    assert "'backend' is not a setting of" in result.output and "executor" in result.output


@pytest.mark.parametrize(
    ("text", "key", "detail"),
    [
        ('port = "9000"\n', "port", "Expected `int`, got `str`"),
        ("port = 9000.5\n", "port", "Expected `int`, got `float`"),
        ('debug = "yes"\n', "debug", "Expected `bool`, got `str`"),
        ("tools = [1, 2]\n", "tools", "Expected `str`, got `int`"),
        ("devices = 3\n", "devices", "Expected `str`, got `int`"),
        ("model = 7\n", "model", "Expected `str`, got `int`"),
        ("queue-size = 0\n", "queue-size", "0 is not in the range x>=1"),
        ('log-level = "loud"\n', "log-level", "'loud' is not one of"),
        ('store = "mysql://db"\n', "store", "expected memory, or a Redis URL"),
        ("[port]\nx = 1\n", "port", "Expected `int`, got `object`"),
    ],
)
def test_a_value_of_the_wrong_type_is_an_error_naming_the_key(tmp_path, text, key, detail):
    config = write(tmp_path, text)
    result = invoke("serve", "--config", config, "--print-config")
    assert result.exit_code == 2, result.output
    assert f"{config}: {key}: " in result.output
    assert detail in result.output


def test_a_size_in_a_file_may_have_units_as_on_the_command_line(tmp_path):
    settings, _ = effective("--config", write(tmp_path, 'max-job-memory = "2GiB"\nsend-buffer = 65536\n'))
    assert (settings["max_job_memory"], settings["send_buffer"]) == (2 << 30, 65536)
    assert settings == effective("--max-job-memory", "2GiB", "--send-buffer", "64KiB")[0]


def test_the_ray_apps_args_are_read_as_a_config_file_and_its_variables_win(monkeypatch):
    from backends.ray_app import settings

    monkeypatch.setenv("STREAMGATE_MAX_BATCH_SIZE", "4")
    monkeypatch.setenv("STREAMGATE_TOOLS", "a.tools b.tools")
    built = settings({"max-batch-size": 8, "ray_replicas": 2, "devices": "cuda:0,cuda:1", "tools": "c.tools"})
    assert (built.max_batch_size, built.ray_replicas, built.devices) == (4, 2, ["cuda:0", "cuda:1"])
    assert built.tools == ["a.tools", "b.tools"]
    monkeypatch.setenv("STREAMGATE_QUEUE_SIZE", "0")
    with pytest.raises(ValueError, match=re.escape("STREAMGATE_QUEUE_SIZE: 0 is not in the range x>=1")):
        settings({})


def test_a_file_that_is_not_toml_or_not_there_is_an_error(tmp_path):
    config = write(tmp_path, "port = \n")
    result = invoke("serve", "--config", config, "--print-config")
    assert result.exit_code == 2 and f"{config} is not valid TOML" in result.output
    missing = str(tmp_path / "nope.toml")
    result = invoke("serve", "--config", missing, "--print-config")
    assert result.exit_code == 2 and "does not exist" in result.output and missing in result.output


# -- --print-config ------------------------------------------------------------------------


def test_print_config_toml_shows_values_and_sources_and_reads_back_as_a_config(tmp_path):
    config = write(tmp_path, 'max-batch-size = 8\ntools = ["a.tools"]\ndebug = true\n')
    result = invoke("serve", "--config", config, "--port", "9001", "--print-config",
                    env={"STREAMGATE_LOG_LEVEL": "warning"})
    assert result.exit_code == 0, result.output
    lines = {line.split("=")[0].strip(): line for line in result.stdout.splitlines() if not line.startswith("#")}
    assert lines["port"].endswith("# flag") and "9001" in lines["port"]
    assert lines["log_level"].endswith("# env")
    assert lines["max_batch_size"].endswith("# file")
    assert lines["host"].endswith("# default")
    assert f"# config file: {config}" in result.stdout
    assert "# device: not set" in result.stdout  # TOML has no null

    # The output is a config file that gives the same settings back.
    printed = write(tmp_path, result.stdout, "printed.toml")
    assert set(tomllib.loads(result.stdout)) < set(effective()[0])
    assert effective("--config", printed)[0] == effective("--config", config, "--port", "9001",
                                                          env={"STREAMGATE_LOG_LEVEL": "warning"})[0]


SECRETS = ["sekrit-flag-token", "sekrit-env-token", "sekrit-file-token", "sekrit-exec", "sekrit-redis", "sekrit-url"]


@pytest.mark.parametrize("form", ["toml", "json"])
def test_print_config_never_shows_a_secret(tmp_path, form):
    config = write(tmp_path, "\n".join([
        'executor-token = "sekrit-exec"',
        'store = "redis://bob:sekrit-redis@localhost:6379/0"',
        'executor = ["https://ops:sekrit-url@exec.example:9000", "http://exec2.example:9000?token=sekrit-url"]',
        "max-concurrent-per-token = 3",
    ]))
    # --tokens on the command line wins over STREAMGATE_TOKENS; the env token is checked on its own below.
    result = invoke("serve", "--config", config, "--tokens", "ci=sekrit-flag-token", "--tokens", "sekrit-flag-token",
                    f"--print-config={form}")
    assert result.exit_code == 0, result.output
    for secret in SECRETS:
        assert secret not in result.output
    out = result.stdout
    assert "ci=REDACTED" in out  # which client it is stays visible
    assert "redis://bob:REDACTED@localhost:6379/0" in out
    assert "https://ops:REDACTED@exec.example:9000" in out
    assert "token=REDACTED" in out
    if form == "json":
        settings = json.loads(out)["settings"]
        assert settings["executor_token"] == "REDACTED"
        assert settings["tokens"] == ["ci=REDACTED", "REDACTED"]
        assert settings["max_concurrent_per_token"] == 3  # a number, not a secret

    env = {"STREAMGATE_TOKENS": "ops=sekrit-env-token", "STREAMGATE_EXECUTOR_TOKEN": "sekrit-exec"}
    for command in ("serve", "executor"):
        result = invoke(command, f"--print-config={form}", env=env)
        assert result.exit_code == 0, result.output
        assert "sekrit" not in result.output


def test_redaction_rules():
    assert redact("executor_token", "abc") == "REDACTED"
    assert redact("db_password", "abc") == "REDACTED"
    assert redact("tokens", ["a=x", "y"]) == ["a=REDACTED", "REDACTED"]
    assert redact("tokens_file", "/etc/streamgate/tokens.toml") == "/etc/streamgate/tokens.toml"
    assert redact("jobs_per_minute_per_token", 10) == 10
    assert redact("executor_token", None) is None
    assert redact("model", "HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    assert redact_url("redis://user:pass@host:6379/0") == "redis://user:REDACTED@host:6379/0"
    assert redact_url("rediss://:pass@host") == "rediss://:REDACTED@host"
    assert redact_url("https://ghp_abc@host/x") == "https://REDACTED@host/x"  # a lone user is often a token
    assert redact_url("redis://u:p@ss@host/0") == "redis://u:REDACTED@host/0"  # an unescaped @ in the password
    assert redact_url("unix:///run/redis.sock?db=0&password=pw") == "unix:///run/redis.sock?db=0&password=REDACTED"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"
    assert redact_url("memory") == "memory"


# -- --dry-run -------------------------------------------------------------------------------


def test_dry_run_loads_the_model_and_tools_and_exits_0(tiny_model_path):
    result = invoke("serve", "--model", str(tiny_model_path), "--device", "cpu", "--tools", "tests.support.user_tools",
                    "--dry-run")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"model: {tiny_model_path.name}" in out
    assert "device: cpu" in out
    assert "dtype: float32" in out
    tools = next(line for line in out.splitlines() if line.startswith("tools: "))
    assert {"generate", "predict", "echo", "fail"} <= set(tools.removeprefix("tools: ").split(", "))
    assert "tool modules: tests.support.user_tools" in out
    assert "not serving" in out


def test_dry_run_loads_the_models_here_and_names_those_on_inference_servers_without_starting_them(tiny_model_path, tmp_path):
    fake_python = tmp_path / "python"  # never run: a dry run starts no server
    result = invoke("serve", "--model", f"here={tiny_model_path}", "--model", f"base=vllm:{tiny_model_path}",
                    "--model", "far=openai+https://user:secret@gpu-box/v1", "--vllm-python", str(fake_python),
                    "--device", "cpu", "--dry-run")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"model: base on a vLLM server the gateway starts: {tiny_model_path}, with {fake_python} (not started)" in out
    assert "model: far on the inference server at https://user:REDACTED@gpu-box/v1 (not contacted)" in out
    assert "model: here (causal_lm)" in out and "loaded; not serving" in out
    # Only servers: nothing is loaded here (not the bundled default either).
    only = invoke("serve", "--model", "far=openai+http://127.0.0.1:9/v1", "--dry-run")
    assert only.exit_code == 0 and only.stdout.splitlines()[-1] == "dry run: checked; not serving", only.output
    assert "loaded" not in only.stdout
    missing = invoke("serve", "--model", "base=vllm:./no/such/model", "--dry-run")
    assert missing.exit_code == 1 and "not a model folder" in missing.output


def test_executor_dry_run_loads_the_model(tiny_model_path, tmp_path):
    config = write(tmp_path, f'model = "{tiny_model_path}"\ndevice = "cpu"\ndtype = "bfloat16"\n')
    result = invoke("executor", "--config", config, "--dry-run")
    assert result.exit_code == 0, result.output
    assert "device: cpu" in result.stdout and "dtype: bfloat16" in result.stdout


def test_dry_run_fails_with_the_reason_when_the_model_cannot_load(tmp_path):
    result = invoke("serve", "--model", str(tmp_path / "no" / "such" / "model"), "--dry-run")
    assert result.exit_code == 1
    assert "not a model folder" in result.output
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    result = invoke("serve", "--model", str(broken), "--device", "cpu", "--dry-run")
    # Its config is read before anything loads (to know the model's kind): one line naming the file.
    assert result.exit_code == 1
    assert "config.json" in result.output and "not a valid JSON file" in result.output
    assert result.output.strip().count("\n") == 0, result.output
    result = invoke("serve", "--model", str(broken), "--tools", "tests.no_such_module", "--dry-run")
    assert result.exit_code == 1 and "tests.no_such_module" in result.output


def test_a_remote_dry_run_checks_the_config_without_contacting_executors():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://ops:sekrit@127.0.0.1:{listener.getsockname()[1]}"
        result = invoke("serve", "--backend", "remote", "--executor", url, "--dry-run")
        assert result.exit_code == 0, result.output
        assert "executors were not contacted" in result.stdout
        assert "sekrit" not in result.output
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    # The configuration is still checked.
    result = invoke("serve", "--backend", "remote", "--dry-run")
    assert result.exit_code == 2 and "--executor" in result.output


def test_dry_run_with_a_config_file_as_a_user_runs_it(tiny_model_path, tmp_path):
    config = write(tmp_path, f'model = "{tiny_model_path}"\ndevice = "cpu"\ntools = ["tests.support.user_tools"]\n'
                             f"port = {free_port()}\n")
    proc = subprocess.run([str(STREAMGATE), "serve", "--dry-run"], check=False, cwd=ROOT, capture_output=True, text=True,
                          env=clean_env(STREAMGATE_CONFIG=config), timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "device: cpu" in proc.stdout and "echo" in proc.stdout


def test_the_job_memory_budget_follows_the_engine_memory_limit_or_is_refused_beside_it() -> None:
    from gateway.config import SettingsError, build

    assert build({"engine_memory_limit": 8 << 30}).max_job_memory == 2 << 30
    assert build({"engine_memory_limit": 8 << 30, "max_job_memory": 3 << 30}).max_job_memory == 3 << 30
    with pytest.raises(SettingsError, match=r"--max-job-memory .* more than half of --engine-memory-limit"):
        build({"engine_memory_limit": 8 << 30, "max_job_memory": 5 << 30})
    assert build({}).max_job_memory is None  # without a limit: the machine's default, worked out where models run
