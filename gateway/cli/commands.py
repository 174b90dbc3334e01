"""The `streamgate` command: `serve`, `executor`, `run`, `chat` and `tools`.

Every `serve` and `executor` flag can also be set with a `STREAMGATE_*` variable (shown in `--help`).
`run` and `chat` exit 0 with the result (`chat`: the reply) on stdout, 1 on an
`error` event, 2 when the server refuses the request before streaming, 3 when
the server cannot be reached or the stream breaks, 130 on Ctrl-C (the job is
cancelled). `run --input FILE --output OUT` runs one job per record of FILE
(`_Batch`): 0 when every record has a result, 1 when any failed, 2 when the run
cannot start, 3 when the server cannot be reached, 130 on Ctrl-C.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from gateway import config
from gateway.cli import configfile
from gateway.config import Settings
from gateway.cli.views import RunView, describe_tool, printable, terminal_width

DEFAULT_URL = "http://127.0.0.1:8000"


class _CommaListed(click.ParamType):
    """Text whose `STREAMGATE_*` variable lists several values split at commas (not whitespace, which paths hold)."""

    name = "text"
    envvar_list_splitter = ","

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        return value.strip() if isinstance(value, str) else value


class _Listed(click.ParamType):
    """One value listing several at commas (cuda:0,cuda:1); a config file's array as it is."""

    name = "text"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, list):
            return value
        items = config.split(str(value))
        if not items:
            self.fail("expected values separated by commas", param, ctx)
        return items


class _Bytes(click.ParamType):
    """A size in bytes: 1048576, 512MiB, 8GiB, 4G (1024-based)."""

    name = "bytes"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        try:
            return value if isinstance(value, int) else config.parse_size(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def _option(name: str, *decls: str, **kwargs: Any) -> Any:
    env = "STREAMGATE_" + name.lstrip("-").replace("-", "_").upper()
    return click.option(name, *decls, envvar=env, show_envvar=True, show_default=True, **kwargs)


@click.group()
@click.version_option(package_name="streamgate")
def main() -> None:
    """streamgate: long-running model tools behind one streaming endpoint each."""


def _settings_options(command: str) -> Any:
    """`command`'s options (`serve` or `executor`): one for each of its settings, as gateway/config.py
    declares them, then the actions that are no setting."""
    options = [_setting_option(setting, command) for setting in config.settings_of(command)] + [
        # Eager, so the file's values are click's default map before any other option is read.
        _option("--config", type=click.Path(exists=True, dir_okay=False), is_eager=True, expose_value=False, callback=configfile.load, help="A TOML file of settings (port = 9000, max-batch-size = 8). Flags and STREAMGATE_* variables win over it."),
        _option("--print-config", is_flag=False, flag_value="toml", default=None, type=click.Choice(["toml", "json"]), help="Print the effective settings and where each came from (secrets redacted), then exit."),
        _option("--dry-run", is_flag=True, default=False, help="Load the model and tools as a start would, report them, and exit."),
    ]

    def decorate(function: Any) -> Any:
        for option in reversed(options):
            function = option(function)
        return function

    return decorate


def _setting_option(setting: config.Setting, command: str) -> Any:
    """The flag of one setting: its type, range, choices and help from the Struct's field."""

    def check(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        problem = None if value is None else setting.problem(value)
        if problem is not None:
            raise click.BadParameter(problem)
        return value

    kwargs: dict[str, Any] = {"help": setting.help, "callback": check}
    if setting.kind is bool:
        kwargs.update(is_flag=True, default=setting.default)
    elif setting.listed and "split" not in setting.extra:
        kwargs.update(multiple=True, type=_CommaListed() if "env_split" in setting.extra else _type(setting))
    else:
        kwargs.update(default=None if setting.listed else setting.default_for(command), type=_type(setting))
    return _option(f"--{setting.flag}", setting.name, **kwargs)


def _type(setting: config.Setting) -> Any:
    if setting.choices is not None:
        return click.Choice(setting.choices)
    if "split" in setting.extra:
        return _Listed()
    if setting.extra.get("unit") == "bytes":
        return _Bytes()
    if "path" in setting.extra:
        return click.Path(exists=setting.extra["path"].startswith("existing"), dir_okay=False)
    if setting.kind in (int, float) and (setting.ge, setting.le) != (None, None):
        return (click.IntRange if setting.kind is int else click.FloatRange)(min=setting.ge, max=setting.le)
    return setting.kind


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _settings(options: dict[str, Any]) -> Settings:
    # Like `python -m` and uvicorn: `--tools mypkg.tools` finds ./mypkg; a console
    # script's sys.path starts at its own bin folder, not the working directory.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    print_as = options.pop("print_config", None)
    try:  # click's None is "not given": the Struct's default
        settings = config.build({name: value for name, value in options.items() if value is not None})
    except config.SettingsError as exc:
        raise click.UsageError(str(exc)) from None
    if print_as:
        configfile.print_settings(settings, print_as)  # exits
    from gateway.plumbing.logs import configure_logging

    # uvicorn's loggers too: uvicorn.run gets log_config=None so that it keeps them this way.
    configure_logging(settings.log_level, settings.log_format)
    # A remote gateway polls each executor every second: keep those out of the logs.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.access").addFilter(_HealthChecks())
    return settings


class _HealthChecks(logging.Filter):
    """Drops access-log lines of successful health and readiness probes."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) >= 5 and args[2] in ("/healthz", "/readyz") and args[4] == 200)


@main.command()
@_settings_options("serve")
def serve(**options: Any) -> None:
    """Start the gateway, with the model in this process or on executors."""
    from gateway.server.app import create_app

    dry_run = options.pop("dry_run")
    settings = _settings(options)
    here, servers = settings, []
    if dry_run and settings.backend == "local":
        from gateway.cli.dryrun import on_servers

        here, servers = on_servers(settings)  # models on inference servers: checked, not started
    if not dry_run:
        _trace("streamgate")
    from backends.build import BackendError, backend_from

    try:
        backend = backend_from(settings, dry_run=dry_run, here=here if servers else None)
    except BackendError as exc:
        raise click.ClickException(str(exc)) from None
    from gateway.server.auth import AuthConfigError

    try:
        app = create_app(backend, settings)
    except AuthConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if dry_run:
        from gateway.cli.dryrun import report

        report(backend, settings, servers, load=not servers or bool(here.model))
        return
    if not app.state.auth.enabled and not _is_loopback(settings.host):
        logging.getLogger("streamgate").warning(
            "\n%s\n  streamgate listens on %s WITHOUT AUTH: anyone who can reach it can run jobs.\n"
            "  Give client tokens with --tokens-file or STREAMGATE_TOKENS.\n%s",
            "!" * 78, settings.host, "!" * 78,
        )
    from gateway.server.stream import FD_MARGIN, raise_fd_limit

    if (have := raise_fd_limit(settings.max_streams + FD_MARGIN)) < settings.max_streams + FD_MARGIN:
        logging.getLogger("streamgate").warning(
            "--max-streams %d, but this process may open only %d files (ulimit -n): past about %d streams "
            "new connections fail; raise the limit or lower --max-streams",
            settings.max_streams, have, max(0, have - FD_MARGIN),
        )
    _run_server(app, settings, app.state.metrics.client_timeout)


@main.command()
@_settings_options("executor")
def executor(**options: Any) -> None:
    """Start an executor: runs tools on this machine for remote gateways."""
    from backends.executor import create_executor_app

    dry_run = options.pop("dry_run")
    settings = _settings(options)
    if not settings.executor_token and not _is_loopback(settings.host):
        logging.getLogger("streamgate").warning(
            "the executor listens on %s without --executor-token: anyone who reaches it can run jobs",
            settings.host,
        )
    service = _executor_service(settings)
    if dry_run:
        from gateway.cli.dryrun import report

        report(service.backend, settings)
        return
    _trace("streamgate-executor")
    _run_server(create_executor_app(service), settings, service.metrics.client_timeout, ws=WS)


@main.command(hidden=True)
def engine() -> None:
    """An engine process of a gateway with --engine process (backends/engines.py): its settings on stdin."""
    from backends.engine_processes import child_settings, engine_name
    from backends.executor import create_executor_app
    from gateway.plumbing.logs import configure_logging

    settings, socket = child_settings()
    configure_logging(settings.log_level, settings.log_format, engine=engine_name(settings))
    _trace("streamgate-engine", **{"streamgate.engine": engine_name(settings)})  # as the OTEL_* variables it inherits say
    # The gateway logs each request; the engine's own access lines would be its polls and submits
    # (`access_log=False` below: uvicorn sets its access logger's level from --log-level itself).
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # Results as the JSON the gateway's clients get, in their `completed` frames: nothing to convert or fetch.
    service = _executor_service(settings, inline_results=True)
    # A submit on the socket carries a job's params, which may be as big as the gateway's bodies:
    # uvicorn's 16 MiB cap on a message would close the socket every job shares.
    ws_max_size = max(settings.max_body_bytes + (1 << 16), 16 << 20)
    _run_server(
        create_executor_app(service), settings, service.metrics.client_timeout, ws=WS, uds=socket, ws_max_size=ws_max_size,
        ws_per_message_deflate=False, access_log=False,
    )


def _trace(service: str, **resource: str) -> None:
    """Trace as the OTEL_* variables say (gateway/plumbing/tracing.py): nothing when none is set."""
    from gateway.plumbing import tracing

    try:
        tracing.configure(service, **resource)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _executor_service(settings: Settings, inline_results: bool = False) -> Any:
    from backends.build import BackendError, executor_from

    try:
        return executor_from(settings, inline_results)
    except BackendError as exc:
        raise click.ClickException(str(exc)) from None


# The executor's and an engine's session socket: uvicorn's sans-I/O websockets protocol (its legacy
# one, deprecated, warned on every start).
WS = "websockets-sansio"


def _run_server(app: Any, settings: Settings, client_timeout: Callable[[str], None], **extra: Any) -> None:
    """Serve `app` until uvicorn stops (SIGTERM drains first), then leave as gateway/plumbing/drain.py says."""
    import uvicorn

    from gateway.plumbing import handoff, tracing
    from gateway.plumbing.drain import exit_cleanly
    from gateway.plumbing.slowclients import uvicorn_options

    before = handoff.alive()
    try:
        uvicorn.run(
            app, host=settings.host, port=settings.port, log_level=settings.log_level, log_config=None,
            **extra, **uvicorn_options(settings, client_timeout),
        )
    except KeyboardInterrupt:  # Ctrl-C, raised again by uvicorn once it is down: click exits 1
        tracing.shutdown()
        exit_cleanly(1, before)
        raise
    # The spans still held are exported now: the exit that follows may skip `atexit`.
    tracing.shutdown()
    exit_cleanly(0, before)


def _params_given(params_json: str | None, pairs: tuple[str, ...]) -> tuple[dict[str, Any] | None, list[tuple[str, str]] | None]:
    """`run`'s params: a JSON object from --json, else KEY=VALUE pairs in the query form."""
    if params_json is None:
        return None, _params_from_pairs(pairs)
    try:
        params = json.loads(params_json)
    except json.JSONDecodeError as exc:
        raise click.UsageError(f"--json is not valid JSON: {exc}") from None
    if not isinstance(params, dict):
        raise click.UsageError("--json must be a JSON object of params")
    return params, None


def _params_from_pairs(pairs: tuple[str, ...]) -> list[tuple[str, str]]:
    query = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.UsageError(f"expected key=value, got {pair!r}")
        query.append((key, value))
    return query


def _client_options(command: Any = None, *, model: bool = True) -> Any:
    """The options of a command that talks to a gateway: `run`, `tools`, `models` and `chat`
    (`model`: it also takes --model, the served model to use)."""
    if command is None:
        return lambda command: _client_options(command, model=model)
    if model:
        command = click.option("--model", default=None, help="The served model to use (GET /models). Default: the gateway's default model.")(command)
    command = _option("--token", default=None, help="A client token, sent as Authorization: Bearer (prefer the env var: a command line is visible to other users).")(command)
    return _option("--url", default=DEFAULT_URL, help="The gateway's address.")(command)


def _client(url: str, token: str | None) -> Any:
    from gateway.client import Client

    return Client(url, headers={"Authorization": f"Bearer {token}"} if token else None)


def _fetch(url: str, token: str | None, call: Any) -> Any:
    """`call(client)` on a client of the gateway; a refusal exits 2, a gateway out of reach 3."""
    import httpx

    from gateway.client import HttpError

    try:
        with _client(url, token) as client:
            return call(client)
    except HttpError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except httpx.HTTPError as exc:
        click.echo(f"error: cannot reach {url}: {exc}", err=True)
        sys.exit(3)


def _expected_texts(params: dict[str, Any] | None, query: list[tuple[str, str]] | None) -> int:
    """How many texts a job will stream side by side: one per prompt in `prompts`, else one."""
    if params is not None:
        prompts = params.get("prompts")
        return len(prompts) if isinstance(prompts, list) and prompts else 1
    return max(1, sum(1 for key, _ in query or () if key == "prompts"))


def _fetch_files(client: Any, result: Any, out_dir: str | None, quiet: bool) -> None:
    """A single run's result files into `out_dir` (`--out`); without it, where they are on the gateway."""
    from gateway.cli.fileruns import files_of, safe_name

    files = files_of(result)
    if not files:
        return
    if out_dir is None:
        if not quiet:
            names = ", ".join(f["name"] for f in files)
            click.echo(f"result files ({names}) at GET /jobs/{client.job_id}/files/NAME; --out DIR fetches them", err=True)
        return
    os.makedirs(out_dir, exist_ok=True)
    for file in files:
        path = os.path.join(out_dir, safe_name(file["name"]))
        client.download(path, client.job_id, file["name"])
        if not quiet:
            click.echo(f"wrote {path} ({file['size']} bytes)", err=True)


@main.command()
@click.argument("tool")
@click.argument("pairs", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--json", "params_json", default=None, help="All params as one JSON object.")
@click.option("--input", "input_path", default=None, type=click.Path(dir_okay=False), help="Run TOOL once per record of this file: FASTA (.fasta .fa .faa .fna .fas), each sequence one job's --field; or JSONL (.jsonl .ndjson), each line one job's params. .gz allowed. Needs --output.")
@click.option("--output", "output_path", default=None, type=click.Path(dir_okay=False), help="With --input: the JSONL file of outcomes, one line per record in input order, {\"id\", \"result\"} or {\"id\", \"error\"}. Run the same command again and the records it holds a result for are skipped.")
@click.option("--input-format", default=None, type=click.Choice(["fasta", "jsonl"]), help="The --input file's format, when its name does not say.")
@click.option("--field", default=None, help="With FASTA input: the param each sequence fills (a list param gets [sequence]). Default: the tool's one required text or list-of-text param.")
@click.option("--concurrency", default=None, type=click.IntRange(min=1), help="With --input: the most jobs at once. Default: the gateway's max batch size (GET /readyz), else 8.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False), help="Where a result's files go (a per-position result too big for one event: safetensors, npy, bigWig and BED): OUT/NAME, and with --input OUT/<record id>/NAME, each fetched whole and resumed if cut. Without it they stay on the gateway for its --retention, at GET /jobs/{id}/files/{name}.")
@_client_options
@click.option("--quiet", "-q", is_flag=True, help="Print only the result (with --input: no progress bar, failures or summary; only what stops the run).")
def run(
    tool: str, pairs: tuple[str, ...], params_json: str | None, input_path: str | None, output_path: str | None,
    input_format: str | None, field: str | None, concurrency: int | None, out_dir: str | None,
    model: str | None, url: str, token: str | None, quiet: bool,
) -> None:
    """Run TOOL and print its result as JSON (and, on stderr, a view of it).

    KEY=VALUE pairs use the server's query form (repeat a key for a list:
    prompts=a prompts=b); --json sends a JSON body instead. Streamed text is
    shown on stderr as it comes.

    With --input FILE --output OUT: one job per record of FILE, a few at a
    time, with a progress bar; OUT gets one JSON line per record, in input
    order. KEY=VALUE pairs or --json then give params for every record (a
    record's own win). Run the same command again and records with a result
    in OUT are skipped, those that failed run again. Exits 0 when every
    record has a result, 1 when any failed, 2 when the run cannot start (a
    bad input file, no param to fill), 3 when the gateway cannot be reached.
    """
    import httpx

    from gateway.client import HttpError, JobError, StreamEndedError

    if params_json is not None and pairs:
        raise click.UsageError("give KEY=VALUE pairs or --json, not both")
    params, query = _params_given(params_json, pairs)
    if input_path is not None or output_path is not None:
        from gateway.cli.fileruns import FileRun

        batch = FileRun(tool, params, query, model, url, token, quiet, concurrency, out_dir)
        sys.exit(batch.run(input_path, output_path, input_format, field))
    for name, value in (("--input-format", input_format), ("--field", field), ("--concurrency", concurrency)):
        if value is not None:
            raise click.UsageError(f"{name} goes with --input FILE --output OUT")
    if model is not None:  # the same as a `model` param, given once
        if params is not None:
            params["model"] = model
        else:
            query = [(k, v) for k, v in query or [] if k != "model"] + [("model", model)]

    shown = RunView(sys.stderr, _expected_texts(params, query), quiet)
    try:
        with _client(url, token) as client:
            try:
                result = client.run(
                    tool, params, query=query, on_status=shown.status, on_log=shown.log, on_partial=shown.partial
                )
                _fetch_files(client, result, out_dir, quiet)
            except KeyboardInterrupt:
                shown.finish()
                _cancel(client)
                sys.exit(130)
    except (HttpError, JobError, httpx.HTTPError, StreamEndedError) as exc:
        shown.finish()
        sys.exit(_report(exc, url))
    shown.finish()
    click.echo(json.dumps(result, ensure_ascii=False, indent=2))
    if not quiet:
        from gateway.cli.render import view

        rendered = view(tool, result)
        if rendered:
            click.echo(rendered, err=True)


def _report(exc: Exception, url: str) -> int:
    """Say on stderr why a job gave no result; return the exit code that goes with it."""
    from gateway.client import HttpError, JobError

    if isinstance(exc, HttpError):
        click.echo(f"error: {exc}" + (f" (field: {exc.field})" if exc.field else ""), err=True)
        return 2
    if isinstance(exc, JobError):
        click.echo(f"job failed: {exc}", err=True)
        return 1
    click.echo(f"error: cannot get a result from {url}: {exc}", err=True)
    return 3


def _cancel(client: Any) -> None:
    """Cancel the client's job on Ctrl-C, rather than leave it running through the server's detach grace."""
    import httpx

    from gateway.client import ClientError

    click.echo("cancelled", err=True)
    if client.job_id is not None:
        try:
            client.cancel()
        except (httpx.HTTPError, ClientError):
            pass  # leaving anyway: the server cancels it once its grace for a gone client ends


@main.command()
@click.argument("message", required=False)
@click.option("--system", default=None, help="A system message that opens the conversation.")
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(min=1), help="Most tokens in one reply.")
@click.option("--temperature", default=None, type=click.FloatRange(0, 2), help="0 picks the most likely token; higher samples more freely. Default: the server's (0).")
@click.option("--seed", default=None, type=click.IntRange(0, 2**53 - 1), help="Same seed, same reply (with --temperature above 0).")
@_client_options
def chat(
    message: str | None, system: str | None, max_tokens: int, temperature: float | None, seed: int | None,
    model: str | None, url: str, token: str | None,
) -> None:
    """Chat with the served model: send MESSAGE, print the reply on stdout as it comes.

    The model's chat template shapes the conversation (generate's `messages`).
    With no MESSAGE, the message is read from stdin when stdin is piped; on a
    terminal, the chat goes on turn by turn, each reply seeing the whole
    conversation, until Ctrl-D.
    """
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system is not None else []
    options: dict[str, Any] = {"max_tokens": max_tokens}
    options.update({k: v for k, v in (("temperature", temperature), ("seed", seed), ("model", model)) if v is not None})
    interactive = message is None and sys.stdin.isatty()
    if message is None and not interactive:
        message = sys.stdin.read().strip()
        if not message:
            raise click.UsageError("no message: give one as an argument, or on stdin")
    with _client(url, token) as client:
        if not interactive:
            assert message is not None
            _chat_turn(client, url, [*history, {"role": "user", "content": message}], options)
            return
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        while True:
            try:
                line = input("> ")
            except EOFError:
                click.echo()
                return
            except KeyboardInterrupt:
                click.echo()
                sys.exit(130)
            if not line.strip():
                continue
            turn = [*history, {"role": "user", "content": line}]
            reply = _chat_turn(client, url, turn, options, interactive=True)
            if reply is not None:
                history = [*turn, {"role": "assistant", "content": reply}]


def _chat_turn(
    client: Any, url: str, messages: list[dict[str, str]], options: dict[str, Any], interactive: bool = False
) -> str | None:
    """Run one reply to `messages`, streamed to stdout; its text, or None for a turn that failed.

    A failure that the next turn could escape (the job failed, the queue was
    full) is reported and the interactive chat goes on without the turn; any
    other, and any in a single run, exits with `run`'s code.
    """
    import httpx

    from gateway.client import HttpError, JobError, StreamEndedError

    out = sys.stdout
    shown = printable if out.isatty() else str
    sent: list[str] = []

    def on_partial(data: Any) -> None:
        if isinstance(data, dict) and data.get("index", 0) == 0 and isinstance(data.get("text"), str):
            sent.append(data["text"])
            out.write(shown(data["text"]))
            out.flush()

    def on_log(frame: dict[str, Any]) -> None:
        if frame.get("level") in ("warning", "error"):
            click.echo(f"[{frame['level']}] {frame['message']}", err=True)

    try:
        try:
            result = client.run("generate", {"messages": messages, **options}, on_log=on_log, on_partial=on_partial)
        except KeyboardInterrupt:
            out.write("\n")
            _cancel(client)
            if interactive:
                return None
            sys.exit(130)
    except (HttpError, JobError, httpx.HTTPError, StreamEndedError) as exc:
        if sent:
            out.write("\n")
            out.flush()
        code = _report(exc, url)
        # In a chat on a terminal, what this turn alone got wrong (a failed job, a full queue, a
        # conversation grown past the context or refused by the template) forgets the turn and goes on.
        if interactive and (
            isinstance(exc, JobError) or (isinstance(exc, HttpError) and (exc.retryable or exc.status in (413, 422)))
        ):
            if isinstance(exc, HttpError) and exc.code == "too_long":
                click.echo("(the conversation no longer fits the model's context: Ctrl-D and start a new chat)", err=True)
            return None
        sys.exit(code)
    reply = result["completions"][0]
    streamed = "".join(sent)
    if reply.startswith(streamed) and len(reply) > len(streamed):
        out.write(shown(reply[len(streamed) :]))  # partials missed (none should be): the result has it all
    out.write("" if reply.endswith("\n") else "\n")
    out.flush()
    if (result.get("finish_reasons") or [None])[0] == "length":
        click.echo(f"(the reply reached --max-tokens {options['max_tokens']})", err=True)
    return reply


@main.command()
@click.argument("tool", required=False)
@_client_options
@click.option("--json", "as_json", is_flag=True, help="Print the full descriptions with JSON Schema.")
def tools(tool: str | None, model: str | None, url: str, token: str | None, as_json: bool) -> None:
    """List the tools a gateway serves, or describe TOOL: its params, their limits and defaults
    (with --model, whether that model runs it; without, the default model)."""
    listed = _fetch(url, token, lambda client: client.tools(model))
    if tool is not None:
        entry = next((t for t in listed if t["name"] == tool), None)
        if entry is None:
            import difflib

            names = [t["name"] for t in listed]
            message = f"error: unknown tool {tool}; the server has: {', '.join(names)}"
            close = difflib.get_close_matches(tool, names, n=1)
            click.echo(message + (f"\ndid you mean {close[0]}?" if close else ""), err=True)
            sys.exit(2)
        click.echo(json.dumps(entry, indent=2) if as_json else describe_tool(entry, terminal_width(sys.stdout)))
        return
    if as_json:
        click.echo(json.dumps(listed, indent=2))
        return
    width = max((len(t["name"]) for t in listed), default=0)
    for t in listed:
        if t.get("unsupported"):
            continue
        summary = (t["description"].splitlines() or [""])[0]
        click.echo(f"{t['name']:<{width}}  {summary}")
    refused = [t for t in listed if t.get("unsupported")]
    if refused:
        click.echo("\nnot for this model:")
        for t in refused:
            click.echo(f"{t['name']:<{width}}  {t['unsupported']}")


@main.command()
@_client_options(model=False)
@click.option("--json", "as_json", is_flag=True, help="Print GET /models as it is.")
def models(url: str, token: str | None, as_json: bool) -> None:
    """List the models a gateway serves: kind, context, device, dtype, and the tools each runs."""
    listed = _fetch(url, token, lambda client: client.models())
    if as_json:
        click.echo(json.dumps(listed, indent=2))
        return
    for model in listed["models"]:
        facts = [model.get("kind") or "", f"{model['context_length']} tokens" if model.get("context_length") else "",
                 model.get("device") or "", model.get("dtype") or ""]
        state = "" if model["ready"] else f"  (not ready: {model.get('problem')})"
        click.echo(f"{model['name']}{' (default)' if model['default'] else ''}  {', '.join(f for f in facts if f)}{state}")
        if model.get("tools"):
            click.echo(f"  tools: {', '.join(model['tools'])}")
