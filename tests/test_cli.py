"""The `streamgate` command as a user runs it: real subprocesses against a real server.

`streamgate serve` runs from the repository root with `--tools tests.support.user_tools`
and no PYTHONPATH, the way a user serves `--tools mypkg.tools` from their own
project folder. `run` exits 0 with the result on stdout, 1 on an `error` event,
2 when the server refuses the request, 3 when it cannot be reached.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import click
import httpx
import msgspec
import pytest

from gateway.cli.views import describe_tool
from gateway.cli.commands import serve as serve_command
from gateway.tools import builtin_tools
from tests.support.processes import ROOT, STREAMGATE, ServeProcess, clean_env, free_port, start_serve

CLI_TIMEOUT = 120


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(STREAMGATE), *args],
        cwd=ROOT,
        env=env if env is not None else clean_env(COLUMNS="120"),  # the width its tables fit, whatever runs the tests
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    assert STREAMGATE.exists(), f"no console script at {STREAMGATE}: pip install -e ."
    port = free_port()
    args = ["--model", str(tiny_model_path), "--port", str(port), "--tools", "tests.support.user_tools",
            "--device", "cpu", "--log-level", "warning"]
    server = start_serve(args, clean_env(), port, tmp_path_factory.mktemp("cli") / "serve.log")
    yield server
    server.stop()


def result_of(proc: subprocess.CompletedProcess[str]) -> Any:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# -- tools ---------------------------------------------------------------------


def test_tools_lists_builtin_and_user_tools(gateway):
    proc = cli("tools", "--url", gateway.url)
    assert proc.returncode == 0, proc.stderr
    served, _, refused = proc.stdout.partition("\nnot for this model:\n")
    lines = {line.split()[0]: line for line in served.splitlines() if line.strip()}
    builtin = {t.name for t in builtin_tools()}
    assert {"generate", "loglikelihood", "predict", "logit_lens", "embed"} <= builtin
    # The masked-LM tools are listed apart, with why this causal LM cannot run them.
    masked = {"fill_mask", "pseudo_loglikelihood"}
    assert set(lines) == (builtin - masked) | {"echo", "fail"}
    apart = {line.split()[0]: line for line in refused.splitlines() if line.strip()}
    assert set(apart) == masked and all("a masked-LM head" in line for line in apart.values())
    # Each with the first line of its description.
    assert "Return the text, repeated" in lines["echo"]
    assert "Always raises" in lines["fail"]
    assert "Complete each prompt" in lines["generate"]


def test_tools_json_gives_the_schemas(gateway):
    listed = result_of(cli("tools", "--json", "--url", gateway.url))
    by_name = {t["name"]: t for t in listed}
    assert set(by_name["echo"]["params_schema"]["properties"]) == {"text", "repeat", "delay", "model"}
    assert by_name["echo"]["params_schema"]["required"] == ["text"]
    assert set(by_name["echo"]["result_schema"]["properties"]) == {"text", "tokens"}
    assert by_name["generate"]["streams_partial"] is True
    assert listed == httpx.get(gateway.url + "/tools", timeout=30).json()


def param_blocks(text: str) -> dict[str, list[str]]:
    """`tools TOOL`'s params: each param's name to its lines (its head first), dedented."""
    blocks: dict[str, list[str]] = {}
    lines = text.split("\nparams:\n", 1)[1].splitlines()
    for line in lines:
        if line.startswith("  ") and not line.startswith("   "):
            name = line.split()[0]
            blocks[name] = [line.strip()]
        else:
            blocks[name].append(line.strip())
    return blocks


def test_tools_tool_describes_its_params(gateway):
    proc = cli("tools", "generate", "--url", gateway.url)
    assert proc.returncode == 0, proc.stderr
    entry = next(t for t in httpx.get(gateway.url + "/tools", timeout=30).json() if t["name"] == "generate")
    props = entry["params_schema"]["properties"]
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["generate", "  " + entry["description"]]
    assert "streams partial results: yes" in lines and "runs on this model: yes" in lines
    params = param_blocks(proc.stdout)
    assert list(params) == list(props)
    # Name and default (or "required"), the type with its limits, the description.
    assert params["max_tokens"] == [
        "max_tokens = 16", f"integer (1 ≤ x ≤ {props['max_tokens']['maximum']})", "Most tokens to generate per completion."
    ]
    assert params["top_p"] == ["top_p = 1.0", "number (0 < x ≤ 1)", "Nucleus sampling mass."]
    # An Optional's description sits in its non-null alternative; lengths of the list and of its items.
    assert params["stop"] == [
        "stop = null",
        "list (at most 16 items) of string (1 to 512 characters), or null",
        "Strings that end a completion (not included).",
    ]
    prompts = props["prompts"]["anyOf"][0]
    assert params["prompts"][1] == f"list ({prompts['minItems']} to {prompts['maxItems']} items) of string, or null"
    # A list of objects: its items' fields under it, behind their $ref.
    messages = params["messages"]
    assert messages[1] == "list (1 to 1024 items) of ChatMessage, or null"
    nested = messages[messages.index("ChatMessage:") + 1:]
    assert nested[:2] == ["role (required)", 'one of "assistant", "system", "user"']
    assert nested[3:5] == ["content (required)", "string"]


def test_tools_tool_resolves_enums_and_says_why_a_model_cannot_run_it(gateway):
    embed = param_blocks(cli("tools", "embed", "--url", gateway.url).stdout)
    assert embed["texts"][0] == "texts (required)"
    assert embed["pooling"][:2] == ['pooling = "mean"', 'one of "cls", "last", "mean", "none", "per_token"']
    assert embed["pooling"][2].startswith("mean (the default)")
    echo = cli("tools", "echo", "--url", gateway.url).stdout
    assert "streams partial results: no" in echo
    blocks = param_blocks(echo)
    assert blocks.pop("model")[0] == "model = null"  # every tool's: the model to run on
    assert blocks == {
        "text": ["text (required)", "string"], "repeat": ["repeat = 1", "integer"], "delay": ["delay = 0.0", "number"],
    }
    fill_mask = cli("tools", "fill_mask", "--url", gateway.url).stdout
    assert "runs on this model: no: fill_mask needs what the model" in fill_mask and "a masked-LM head" in fill_mask
    assert param_blocks(cli("tools", "fail", "--url", gateway.url).stdout)["message"] == ['message = "boom"', "string"]


def test_tools_tool_json_is_its_entry(gateway):
    entry = result_of(cli("tools", "echo", "--json", "--url", gateway.url))
    assert entry == next(t for t in httpx.get(gateway.url + "/tools", timeout=30).json() if t["name"] == "echo")


def test_tools_unknown_tool_exits_2_with_the_names_and_a_near_one(gateway):
    names = [t["name"] for t in httpx.get(gateway.url + "/tools", timeout=30).json()]
    proc = cli("tools", "genrate", "--url", gateway.url)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"error: unknown tool genrate; the server has: {', '.join(names)}\ndid you mean generate?\n"
    far = cli("tools", "qqqq", "--url", gateway.url)
    assert far.returncode == 2 and "did you mean" not in far.stderr and "unknown tool qqqq" in far.stderr


# Nested structs, as a tool's params might have them (at module level: annotations are resolved there).
class Point(msgspec.Struct):
    x: Annotated[int, msgspec.Meta(ge=0)]
    y: int = 0


class Node(msgspec.Struct):
    label: Annotated[str, msgspec.Meta(min_length=1, max_length=8)]
    children: list[Node] = []


class Params(msgspec.Struct):
    points: Annotated[list[Point], msgspec.Meta(max_length=4, description="Where.")]
    named: dict[str, Point] = {}
    tree: Node | None = None
    pair: tuple[int, str] = (1, "a")
    mode: Literal["a", "b"] = "a"
    scale: Annotated[float, msgspec.Meta(gt=0, lt=1, multiple_of=0.25)] = 0.5


def test_describe_tool_lists_nested_objects_once():
    schema = msgspec.json.schema(Params)  # the root itself a $ref, as msgspec makes it for a struct
    text = describe_tool({"name": "t", "description": "Test.", "params_schema": schema, "streams_partial": False,
                          "unsupported": "no reason"}, width=80)
    assert text.splitlines()[:5] == ["t", "  Test.", "", "streams partial results: no", "runs on this model: no: no reason"]
    params = param_blocks(text)
    assert params["points"] == ["points (required)", "list (at most 4 items) of Point", "Where.", "Point:",
                                "x (required)", "integer (x ≥ 0)", "y = 0", "integer"]
    assert params["named"] == ["named = {}", "map of string to Point"]  # Point is listed once, above
    assert params["tree"] == ["tree = null", "Node, or null", "Node:", "label (required)",
                              "string (1 to 8 characters)", "children = []", "list of Node"]
    assert params["pair"] == ['pair = [1, "a"]', "list (2 items) of (integer, string)"]
    assert params["mode"] == ['mode = "a"', 'one of "a", "b"']
    assert params["scale"] == ["scale = 0.5", "number (0 < x < 1, a multiple of 0.25)"]


def test_url_can_come_from_the_environment(gateway):
    env = clean_env(STREAMGATE_URL=gateway.url)
    assert "echo" in cli("tools", env=env).stdout
    assert result_of(cli("run", "echo", "text=env", env=env))["text"] == "env"


# -- run: exit 0 -----------------------------------------------------------------


def test_run_prints_the_result_json_on_stdout(gateway):
    proc = cli("run", "echo", "text=hi", "--url", gateway.url)
    assert result_of(proc) == {"text": "hi", "tokens": 3}  # BOS + one token per byte
    # Status and logs go to stderr, never stdout.
    assert "RECEIVED" in proc.stderr
    assert "[info] echoing 'hi'" in proc.stderr


def test_run_key_value_pairs_are_coerced(gateway):
    proc = cli("run", "echo", "text=ab", "repeat=3", "--url", gateway.url)
    assert result_of(proc) == {"text": "ababab", "tokens": 3}


def test_run_quiet_prints_only_the_result(gateway):
    proc = cli("run", "echo", "text=q", "--quiet", "--url", gateway.url)
    assert result_of(proc) == {"text": "q", "tokens": 2}
    assert proc.stderr.strip() == ""


def test_run_shows_the_lens_as_a_table_after_the_json(gateway):
    proc = cli("run", "logit_lens", "prompt=Hi there", "layers=0", "layers=-1", "--url", gateway.url)
    result = result_of(proc)
    assert result["layers"] == [0, 1]
    table = proc.stderr[proc.stderr.index("Top token at each layer"):].splitlines()
    header, rows = table[1], table[2:]
    # One column per token (this tokenizer: one per byte), spaces made visible.
    assert header.split() == ["layer", "<s>", "H", "i", "␣", "t", "h", "e", "r", "e"]
    assert [row.split()[0] for row in rows] == ["0", "1"]
    # Each cell is that layer's top-1 token from the JSON result.
    first = result["topk"][1][-1][0]["text"].replace(" ", "␣")
    assert rows[1].split()[-1] == first[:9]


def test_run_shows_predictions_as_bars(gateway):
    proc = cli("run", "predict", "prompt=Hi", "top_k=3", "--url", gateway.url)
    predictions = result_of(proc)["predictions"]
    bars = [line for line in proc.stderr.splitlines() if "%" in line and "█" in line]
    assert len(bars) == 3
    assert bars[0].count("█") == 30  # the most likely token gets the full bar
    assert f"{predictions[0]['prob']:.2%}" in bars[0]


def test_run_json_form(gateway):
    proc = cli("run", "echo", "--json", '{"text": "j\u00e9", "repeat": 2}', "--url", gateway.url)
    assert result_of(proc) == {"text": "j\u00e9j\u00e9", "tokens": 4}


def test_run_generate_with_a_list_matches_the_http_api(gateway):
    proc = cli("run", "generate", "prompts=ab", "prompts=cd", "max_tokens=4", "--url", gateway.url)
    out = result_of(proc)
    direct = httpx.post(
        gateway.url + "/generate/run", json={"prompts": ["ab", "cd"], "max_tokens": 4}, timeout=60
    )
    data = [json.loads(line[5:]) for line in direct.text.splitlines() if line.startswith("data:")]
    assert out == data[-1]
    assert len(out["completions"]) == 2
    assert out["usage"]["completion_tokens"] == 8
    as_json = result_of(cli("run", "generate", "--json", '{"prompts": ["ab", "cd"], "max_tokens": 4}',
                            "--url", gateway.url))
    assert as_json == out


# -- run: exit 1, 2, 3 -----------------------------------------------------------


def test_an_error_event_exits_1(gateway):
    proc = cli("run", "fail", "message=kaputt", "--url", gateway.url)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert "tool_error" in proc.stderr
    assert "RuntimeError: kaputt" in proc.stderr
    assert "[warning] about to fail" in proc.stderr
    assert "Traceback" not in proc.stderr  # no server traceback without --debug


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["generate", "prompts=hi", "max_tokens=0"], ["422 invalid_params", "(field: max_tokens)"]),
        (["generate", "--json", '{"prompts": ["hi"], "max_tokens": 0}'], ["422 invalid_params", "field: max_tokens"]),
        (["echo", "text=x", "nonsense=1"], ["422 invalid_params", "(field: nonsense)"]),
        (["predict", "prompt=" + "a" * 300], ["413 too_long", "(field: prompt)"]),
        (["nosuchtool", "x=1"], ["404 unknown_tool", "generate"]),
    ],
)
def test_a_refused_request_exits_2_with_the_message_on_stderr(gateway, args, expected):
    proc = cli("run", *args, "--url", gateway.url)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    for text in expected:
        assert text in proc.stderr


def test_usage_errors_exit_2_without_contacting_anything():
    unreachable = f"http://127.0.0.1:{free_port()}"
    both = cli("run", "echo", "text=x", "--json", "{}", "--url", unreachable)
    assert both.returncode == 2 and "not both" in both.stderr
    bad_json = cli("run", "echo", "--json", "{nope", "--url", unreachable)
    assert bad_json.returncode == 2 and "not valid JSON" in bad_json.stderr
    for not_object in ("[1]", "null", '"text"'):
        proc = cli("run", "echo", "--json", not_object, "--url", unreachable)
        assert proc.returncode == 2 and "JSON object" in proc.stderr, proc.stderr
    bad_pair = cli("run", "echo", "justtext", "--url", unreachable)
    assert bad_pair.returncode == 2 and "key=value" in bad_pair.stderr


def test_an_unreachable_server_exits_3():
    url = f"http://127.0.0.1:{free_port()}"
    proc = cli("run", "echo", "text=hi", "--url", url)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert url in proc.stderr
    proc = cli("tools", "--url", url)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert url in proc.stderr


# -- serve: errors and STREAMGATE_* ------------------------------------------------


def test_serve_refuses_a_model_path_that_does_not_exist(tmp_path):
    proc = cli("serve", "--model", str(tmp_path / "no" / "such" / "model"), "--port", str(free_port()))
    assert proc.returncode == 1
    assert "not a model folder" in proc.stderr


def test_serve_refuses_a_tools_module_it_cannot_import(tiny_model_path):
    proc = cli("serve", "--model", str(tiny_model_path), "--tools", "tests.no_such_module",
               "--port", str(free_port()))
    assert proc.returncode == 1
    assert "cannot import" in proc.stderr and "tests.no_such_module" in proc.stderr


def test_every_serve_flag_has_a_streamgate_variable():
    options = [p for p in serve_command.params if isinstance(p, click.Option)]
    assert len(options) >= 15
    help_text = cli("serve", "--help").stdout
    for option in options:
        # Named after the flag: --executor (repeatable) is STREAMGATE_EXECUTOR.
        flag = max(option.opts, key=len).lstrip("-")
        want = "STREAMGATE_" + flag.replace("-", "_").upper()
        assert option.envvar == want, option.name
        assert want in help_text, option.name


def _read_until(lines: Iterator[str], predicate, limit: int = 200) -> list[str]:
    seen = []
    for line in lines:
        seen.append(line)
        if predicate(line) or len(seen) > limit:
            break
    return seen


def test_serve_is_configured_entirely_by_streamgate_variables(tiny_model_path, tmp_path):
    port = free_port()
    env = clean_env(
        STREAMGATE_HOST="127.0.0.1",
        STREAMGATE_PORT=str(port),
        STREAMGATE_MODEL=str(tiny_model_path),
        STREAMGATE_TOOLS="tests.support.user_tools",
        STREAMGATE_DEVICE="cpu",
        STREAMGATE_DTYPE="bfloat16",
        STREAMGATE_CACHE_DIR=str(tmp_path / "cache"),
        STREAMGATE_QUEUE_SIZE="1",
        STREAMGATE_MAX_PROMPTS="2",
        STREAMGATE_MAX_TOKENS="7",
        STREAMGATE_MAX_BODY_BYTES="300",
        STREAMGATE_PING_INTERVAL="0.2",
        STREAMGATE_RETRY_MS="1234",
        STREAMGATE_LOG_LEVEL="warning",
        STREAMGATE_DEBUG="1",
    )
    server = start_serve([], env, port, tmp_path / "serve.log")  # no flags at all
    url = server.url
    try:
        ready = httpx.get(url + "/readyz", timeout=30).json()
        assert ready["device"] == "cpu"
        assert ready["dtype"] == "bfloat16"
        assert ready["model"] == Path(tiny_model_path).name

        tools = {t["name"]: t for t in httpx.get(url + "/tools", timeout=30).json()}
        assert {"echo", "fail"} <= set(tools)  # STREAMGATE_TOOLS
        props = tools["generate"]["params_schema"]["properties"]
        assert props["max_tokens"]["maximum"] == 7
        assert props["prompts"]["anyOf"][0]["maxItems"] == 2  # prompts, or else messages: null allowed
        r = httpx.post(url + "/generate/run", json={"prompts": ["a"], "max_tokens": 8}, timeout=30)
        assert r.status_code == 422 and r.json()["error"]["field"] == "max_tokens"
        r = httpx.post(url + "/generate/run", json={"prompts": ["a", "b", "c"]}, timeout=30)
        assert r.status_code == 422 and r.json()["error"]["field"] == "prompts"
        r = httpx.post(url + "/echo/run", json={"text": "x" * 400}, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"

        # STREAMGATE_DEBUG: tool errors carry the traceback.
        proc = cli("run", "fail", "--url", url)
        assert proc.returncode == 1 and "Traceback" in proc.stderr

        # STREAMGATE_RETRY_MS and STREAMGATE_PING_INTERVAL, on a job that takes a while.
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", url + "/echo/run", json={"text": "p", "repeat": 2, "delay": 1.0}) as r:
                raw = r.read()
        assert raw.startswith(b"retry: 1234\n\n")
        assert b": ping\n\n" in raw
        assert b"event: data" in raw

        # STREAMGATE_QUEUE_SIZE=1: one job running, one waiting, the next refused.
        slow = {"text": "s", "repeat": 600, "delay": 0.1}  # a minute at most; cancelled below
        with httpx.Client(timeout=60) as a, httpx.Client(timeout=60) as b:
            # Keep the line iterators referenced: a collected one closes its connection,
            # and a client that goes away cancels its job.
            with a.stream("POST", url + "/echo/run", json=slow) as running:
                running_lines = running.iter_lines()
                seen = _read_until(running_lines, lambda line: '"status":"RUNNING"' in line)
                assert any('"status":"RUNNING"' in line for line in seen)
                with b.stream("POST", url + "/echo/run", json=slow) as queued:
                    queued_lines = queued.iter_lines()
                    seen = _read_until(queued_lines, lambda line: '"status":"QUEUED"' in line)
                    assert any('"status":"QUEUED"' in line for line in seen)
                    r = httpx.post(url + "/echo/run", json={"text": "no"}, timeout=30)
                    assert r.status_code == 429, r.text
                    assert r.json()["error"]["code"] == "queue_full"
                    assert r.headers["retry-after"].isdigit()
                    del queued_lines
                del running_lines
        # Closing those streams cancelled both jobs; the queue frees up. (Not read off /readyz: an
        # engine's figures there are its last report, a fifth of a second old.)
        deadline = time.monotonic() + 60
        while (done := cli("run", "echo", "text=done", "--url", url)).returncode != 0:
            assert "queue_full" in done.stderr and time.monotonic() < deadline, done.stderr
            time.sleep(0.1)
        assert result_of(done)["text"] == "done"
    finally:
        server.stop()
    # STREAMGATE_LOG_LEVEL=warning: uvicorn's info lines (e.g. its access log) stay quiet.
    assert "GET /readyz" not in server.output()
