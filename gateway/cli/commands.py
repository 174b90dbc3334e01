"""The `streamgate` command: `serve`, `executor`, `run`, `chat`, `tools`, `models` and `me`.

Every `serve` and `executor` flag can also be set with a `STREAMGATE_*` variable (shown in `--help`).
`run` and `chat` exit 0 with the result (`chat`: the reply) on stdout, 1 on an
`error` event, 2 when the server refuses the request before streaming, 3 when
the server cannot be reached or the stream breaks, 130 on Ctrl-C (the job is
cancelled). `run --input FILE --output OUT` runs one job per record of FILE
(`_Batch`): 0 when every record has a result, 1 when any failed, 2 when the run
cannot start, 3 when the server cannot be reached, 130 on Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from gateway import config
from gateway.cli import client_commands, configfile
from gateway.config import Settings

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


@click.group()
@click.version_option(package_name="streamgate")
def main() -> None:
    """streamgate: long-running model tools behind one streaming endpoint each."""


def _settings_options(command: str) -> Any:
    """`command`'s options (`serve` or `executor`): one for each of its settings, as gateway/config.py
    declares them, then the actions that are no setting."""
    options = [_setting_option(setting, command) for setting in config.settings_of(command)] + [
        # Eager, so the file's values are click's default map before any other option is read.
        configfile.option("--config", type=click.Path(exists=True, dir_okay=False), is_eager=True, expose_value=False, callback=configfile.load, help="A TOML file of settings (port = 9000, max-batch-size = 8). Flags and STREAMGATE_* variables win over it."),
        configfile.option("--print-config", is_flag=False, flag_value="toml", default=None, type=click.Choice(["toml", "json"]), help="Print the effective settings and where each came from (secrets redacted), then exit."),
        configfile.option("--dry-run", is_flag=True, default=False, help="Load the model and tools as a start would, report them, and exit."),
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
    return configfile.option(f"--{setting.flag}", setting.name, **kwargs)


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


# The commands that talk to a gateway (gateway/cli/client_commands.py).
for _command in (client_commands.run, client_commands.chat, client_commands.tools, client_commands.models, client_commands.me, client_commands.usage):
    main.add_command(_command)
