"""The `streamgate` command: `serve`, `executor`, `run` and `tools`.

Every `serve` and `executor` flag can also be set with a `STREAMGATE_*` variable (shown in `--help`).
`run` exits 0 with the result on stdout, 1 on an `error` event, 2 when the
server refuses the request before streaming, 3 when the server cannot be
reached or the stream breaks.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import click

from gateway import configfile
from gateway.config import Settings

DEFAULT_URL = "http://127.0.0.1:8000"
_D = Settings()  # the defaults, shown in --help


def _option(name: str, *decls: str, **kwargs: Any) -> Any:
    env = "STREAMGATE_" + name.lstrip("-").replace("-", "_").upper()
    return click.option(name, *decls, envvar=env, show_envvar=True, show_default=True, **kwargs)


@click.group()
@click.version_option(package_name="streamgate")
def main() -> None:
    """streamgate: long-running model tools behind one streaming endpoint each."""


def _model_options(command: Any) -> Any:
    """The options of a process that loads the model and runs tools: `serve` and `executor`."""
    options = [
        _option("--model", default=None, help="Local folder, .gguf file or Hugging Face id. Default: the bundled SmolLM2-135M-Instruct."),
        _option("--model-loader", default=None, help="module:function that loads a custom model (see the README's Models section); --model is passed to it."),
        _option("--trust-remote-code", is_flag=True, default=False, help="Run the modelling code a checkpoint ships with it (transformers' trust_remote_code). Only for checkpoints you trust."),
        _option("--device", default=None, help="cuda, cuda:1, mps or cpu. Default: the best available."),
        _option("--devices", default=None, callback=_split_devices, help="Several devices, one worker and model copy each: cuda:0,cuda:1. Default: every GPU, else --device."),
        _option("--dtype", default=None, help="float32, float16 or bfloat16. Default: bfloat16 on CUDA, else float32."),
        _option("--cache-dir", default=None, help="Where converted models are kept. Default: the user cache folder."),
        _option("--tools", multiple=True, help="Import a module of user tools (repeatable)."),
        _option("--sae", multiple=True, type=click.Path(dir_okay=False), help="A sparse autoencoder: a .safetensors file with a .json or .toml sidecar (repeatable; adds the sae_* tools)."),
        _option("--drain-timeout", default=_D.drain_timeout, type=click.FloatRange(min=0), help="On SIGTERM: seconds jobs in flight may finish before they end with shutting_down."),
        _option("--job-timeout", default=_D.job_timeout, type=click.FloatRange(min=0), help="Seconds a job may run before it ends with error timeout and its work is stopped (0: no limit)."),
        _option("--queue-size", default=_D.queue_size, type=click.IntRange(min=1), help="Jobs that may wait; more get 429 queue_full."),
        _option("--max-batch-size", default=_D.max_batch_size, type=click.IntRange(min=1), help="Most jobs of one tool run together (1: no batching)."),
        _option("--batch-wait-ms", default=_D.batch_wait_ms, type=click.FloatRange(min=0), help="How long a lone job may wait for others to batch with."),
        _option("--max-prompts", default=_D.max_prompts, type=click.IntRange(min=1), help="Most prompts in one job."),
        _option("--max-tokens", default=_D.max_tokens, type=click.IntRange(min=1), help="Most tokens one generate job may ask for."),
        _option("--max-sequences", default=_D.max_sequences, type=click.IntRange(min=1), help="Most texts or sequences in one embed or pseudo_loglikelihood job."),
        _option("--max-body-bytes", default=_D.max_body_bytes, type=click.IntRange(min=1)),
        _option("--log-level", default=_D.log_level, type=click.Choice(["debug", "info", "warning", "error"])),
        _option("--log-format", default=_D.log_format, type=click.Choice(["text", "json"]), help="Log lines as text, or as one JSON object each (with request_id, job_id)."),
        _option("--debug", is_flag=True, default=False, help="Put tracebacks in tool_error messages."),
        _option("--executor-token", default=None, help="The bearer token shared by gateways and executors."),
        # Eager, so the file's values are click's default map before any other option is read.
        _option("--config", type=click.Path(exists=True, dir_okay=False), is_eager=True, expose_value=False, callback=configfile.load, help="A TOML file of settings (port = 9000, max-batch-size = 8). Flags and STREAMGATE_* variables win over it."),
        _option("--print-config", is_flag=False, flag_value="toml", default=None, type=click.Choice(["toml", "json"]), help="Print the effective settings and where each came from (secrets redacted), then exit."),
        _option("--dry-run", is_flag=True, default=False, help="Load the model and tools as a start would, report them, and exit."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _split_devices(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str]:
    devices = _split_list(ctx, param, value)
    if value is not None and not devices:
        raise click.BadParameter("expected devices separated by commas: cuda:0,cuda:1")
    return devices


def _split_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str]:
    return [item.strip() for item in (value or "").split(",") if item.strip()]


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _settings(options: dict[str, Any]) -> Settings:
    options["tools"] = list(options.get("tools", ()))
    options["sae"] = list(options.get("sae", ()))
    for key in ("executors", "tokens"):
        if key in options:
            options[key] = list(options[key])
    # Like `python -m` and uvicorn: `--tools mypkg.tools` finds ./mypkg; a console
    # script's sys.path starts at its own bin folder, not the working directory.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    print_as = options.pop("print_config", None)
    settings = Settings(**options)
    if print_as:
        configfile.print_settings(settings, print_as)  # exits
    from gateway.logs import configure_logging

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


def _local_backend(settings: Settings, **kwargs: Any) -> Any:
    from backends.local import LocalBackend
    from backends.model import ModelError
    from gateway.tools import builtin_tools, collect, load_module

    try:
        tools = collect(builtin_tools() + [t for name in settings.tools for t in load_module(name)])
        backend = LocalBackend(
            tools,
            model=settings.model,
            model_loader=settings.model_loader,
            trust_remote_code=settings.trust_remote_code,
            device=settings.device,
            devices=settings.devices,
            dtype=settings.dtype,
            cache_dir=settings.cache_dir,
            queue_size=settings.queue_size,
            debug=settings.debug,
            max_batch_size=settings.max_batch_size,
            batch_wait=settings.batch_wait_ms / 1000,
            job_timeout=settings.job_timeout,
            sae=settings.sae,
            exit_on_device_failure=True,
            **kwargs,
        )
        backend.check_kind()
        return backend
    except (ValueError, ModelError) as exc:
        raise click.ClickException(str(exc)) from None


def _check_store(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if value != "memory" and not value.startswith(("redis://", "rediss://", "unix://")):
        raise click.BadParameter("expected memory, or a Redis URL: redis://host:port/db (rediss://, unix://)")
    return value


@main.command()
@_option("--host", default=_D.host, help="Interface to listen on.")
@_option("--port", default=_D.port, type=int)
@_model_options
@_option("--backend", default=_D.backend, type=click.Choice(["local", "remote"]), help="Run tools in this process, or on executors.")
@_option("--executor", "executors", multiple=True, help="An executor's URL, for --backend remote (repeatable).")
@_option("--executor-deadline", default=_D.executor_deadline, type=click.FloatRange(min=0), help="Seconds an executor may be unreachable before its jobs end with backend_unavailable.")
@_option("--detach-grace", default=_D.detach_grace, type=click.FloatRange(min=0), help="Seconds a job runs on with no client attached before it is cancelled (0: cancel on disconnect).")
@_option("--retention", default=_D.retention, type=click.FloatRange(min=0), help="Seconds a finished job and its events stay readable.")
@_option("--store", default=_D.store, callback=_check_store, help="Where jobs are kept: memory (this process), or redis://host:port/db, shared by every replica.")
@_option("--ping-interval", default=_D.ping_interval, type=click.FloatRange(min=0), help="Seconds of quiet before a ': ping' comment (0: none).")
@_option("--retry-ms", default=_D.retry_ms, type=click.IntRange(min=0), help="The reconnect delay sent to EventSource clients.")
@_option("--tokens-file", default=None, type=click.Path(exists=True, dir_okay=False), help="A TOML file of client tokens ([tokens.<name>] token, tools, max_concurrent, jobs_per_minute). With tokens, runs need a bearer token.")
@_option("--tokens", multiple=True, help="Client tokens as name=token (repeatable; prefer the env var: a command line is visible to other users).")
@_option("--max-concurrent-per-token", default=None, type=click.IntRange(min=1), help="Jobs one token may run at once (429 rate_limited past it).")
@_option("--jobs-per-minute-per-token", default=None, type=click.IntRange(min=1), help="Jobs one token may start per minute (429 rate_limited past it).")
@_option("--ticket-ttl", default=_D.ticket_ttl, type=click.FloatRange(min=1, max=60), help="Seconds a ticket from POST /auth/ticket is valid.")
@_option("--write-timeout", default=_D.write_timeout, type=click.FloatRange(min=1), help="Seconds a stream's write may block (a half-open connection) before the client is detached.")
@_option("--cors-origins", default=None, callback=_split_list, help="Origins allowed to call from a browser, comma-separated (none by default).")
def serve(**options: Any) -> None:
    """Start the gateway, with the model in this process or on executors."""
    import uvicorn

    from gateway.app import create_app

    dry_run = options.pop("dry_run")
    settings = _settings(options)
    if settings.backend == "remote":
        from backends.remote import RemoteBackend

        if not settings.executors:
            raise click.UsageError("--backend remote needs at least one --executor URL")
        backend: Any = RemoteBackend(
            settings.executors, token=settings.executor_token, deadline=settings.executor_deadline
        )
    else:
        backend = _local_backend(settings)
    from gateway.auth import AuthConfigError

    try:
        app = create_app(backend, settings)
    except AuthConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if dry_run:
        from gateway.dryrun import report

        report(backend, settings)
        return
    if not app.state.auth.enabled and not _is_loopback(settings.host):
        logging.getLogger("streamgate").warning(
            "\n%s\n  streamgate listens on %s WITHOUT AUTH: anyone who can reach it can run jobs.\n"
            "  Give client tokens with --tokens-file or STREAMGATE_TOKENS.\n%s",
            "!" * 78, settings.host, "!" * 78,
        )
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, log_config=None)


@main.command()
@_option("--host", default=_D.host, help="Interface to listen on.")
@_option("--port", default=9000, type=int)
@_model_options
@_option("--result-ttl", default=_D.result_ttl, type=click.FloatRange(min=0), help="Seconds a finished job's result is kept if nobody fetches it.")
@_option("--session-grace", default=_D.session_grace, type=click.FloatRange(min=0), help="Seconds a gateway's jobs run on without its socket before they are cancelled.")
def executor(**options: Any) -> None:
    """Start an executor: runs tools on this machine for remote gateways."""
    import uvicorn

    from backends.executor import Executor, create_executor_app
    from gateway.encoding import to_msgpack

    dry_run = options.pop("dry_run")
    settings = _settings(options)
    if not settings.executor_token and not _is_loopback(settings.host):
        logging.getLogger("streamgate").warning(
            "the executor listens on %s without --executor-token: anyone who reaches it can run jobs",
            settings.host,
        )
    service = Executor(
        _local_backend(settings, encode=to_msgpack),
        token=settings.executor_token,
        max_body_bytes=settings.max_body_bytes,
        limits=settings.limits(),
        result_ttl=settings.result_ttl,
        session_grace=settings.session_grace,
        drain_timeout=settings.drain_timeout,
    )
    if dry_run:
        from gateway.dryrun import report

        report(service.backend, settings)
        return
    app = create_executor_app(service)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, log_config=None, ws="websockets")


def _params_from_pairs(pairs: tuple[str, ...]) -> list[tuple[str, str]]:
    query = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.UsageError(f"expected key=value, got {pair!r}")
        query.append((key, value))
    return query


@main.command()
@click.argument("tool")
@click.argument("pairs", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--json", "params_json", default=None, help="All params as one JSON object.")
@_option("--url", default=DEFAULT_URL, help="The gateway's address.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the result.")
def run(tool: str, pairs: tuple[str, ...], params_json: str | None, url: str, quiet: bool) -> None:
    """Run TOOL and print its result as JSON (and, on stderr, a view of it).

    KEY=VALUE pairs use the server's query form (repeat a key for a list:
    prompts=a prompts=b); --json sends a JSON body instead.
    """
    import httpx
    from tqdm import tqdm

    from gateway.client import Client, HttpError, JobError, StreamEndedError

    if params_json is not None and pairs:
        raise click.UsageError("give KEY=VALUE pairs or --json, not both")
    params, query = None, None
    if params_json is not None:
        try:
            params = json.loads(params_json)
        except json.JSONDecodeError as exc:
            raise click.UsageError(f"--json is not valid JSON: {exc}") from None
        if not isinstance(params, dict):
            raise click.UsageError("--json must be a JSON object of params")
    else:
        query = _params_from_pairs(pairs)

    bar: tqdm | None = None
    err = click.get_text_stream("stderr")

    def on_status(frame: dict[str, Any]) -> None:
        nonlocal bar
        if quiet:
            return
        progress = frame.get("progress")
        if progress:
            if bar is None:
                bar = tqdm(total=progress.get("total"), unit=progress.get("unit") or "it", file=err, leave=False)
            bar.n = progress["done"]
            bar.refresh()
            return
        line = frame["status"]
        if frame.get("position") is not None:
            line += f" (position {frame['position']} of {frame.get('queue_size', '?')})"
        if frame.get("message"):
            line += f": {frame['message']}"
        click.echo(line, err=True)

    def on_log(frame: dict[str, Any]) -> None:
        if not quiet:
            click.echo(f"[{frame['level']}] {frame['message']}", err=True)

    def on_partial(data: Any) -> None:
        if not quiet and isinstance(data, dict) and isinstance(data.get("text"), str) and bar is None:
            err.write(data["text"])
            err.flush()

    try:
        with Client(url) as client:
            result = client.run(
                tool, params, query=query, on_status=on_status, on_log=on_log, on_partial=on_partial
            )
    except HttpError as exc:
        click.echo(f"error: {exc}" + (f" (field: {exc.field})" if exc.field else ""), err=True)
        sys.exit(2)
    except JobError as exc:
        click.echo(f"\njob failed: {exc}", err=True)
        sys.exit(1)
    except (httpx.HTTPError, StreamEndedError) as exc:
        click.echo(f"error: cannot get a result from {url}: {exc}", err=True)
        sys.exit(3)
    finally:
        if bar is not None:
            bar.close()
    click.echo(json.dumps(result, ensure_ascii=False, indent=2))
    if not quiet:
        from gateway.render import view

        shown = view(tool, result)
        if shown:
            click.echo(shown, err=True)


@main.command()
@_option("--url", default=DEFAULT_URL, help="The gateway's address.")
@click.option("--json", "as_json", is_flag=True, help="Print the full descriptions with JSON Schema.")
def tools(url: str, as_json: bool) -> None:
    """List the tools a gateway serves."""
    import httpx

    from gateway.client import Client, HttpError

    try:
        with Client(url) as client:
            listed = client.tools()
    except HttpError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except httpx.HTTPError as exc:
        click.echo(f"error: cannot reach {url}: {exc}", err=True)
        sys.exit(3)
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
