"""The `streamgate` commands that talk to a gateway: `run` (one job, or one a record of a file), `chat`,
`tools`, `models` and `me`; gateway/cli/commands.py adds them to the `streamgate` group. Exit codes are
in commands.py's docstring.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from gateway.cli import configfile
from gateway.cli.views import RunView, describe_tool, printable, terminal_width

DEFAULT_URL = "http://127.0.0.1:8000"


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
    command = configfile.option("--token", default=None, help="A client token, sent as Authorization: Bearer (prefer the env var: a command line is visible to other users).")(command)
    return configfile.option("--url", default=DEFAULT_URL, help="The gateway's address.")(command)


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


@click.command()
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
@click.option("--callback-url", default=None, help="Also POST the job's terminal event there, signed, once it ends (a completion webhook: the gateway needs --webhook-secret).")
def run(
    tool: str, pairs: tuple[str, ...], params_json: str | None, input_path: str | None, output_path: str | None,
    input_format: str | None, field: str | None, concurrency: int | None, out_dir: str | None,
    model: str | None, url: str, token: str | None, quiet: bool, callback_url: str | None,
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
        if callback_url is not None:
            raise click.UsageError("--callback-url goes with one run, not --input")
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
                    tool, params, query=query, on_status=shown.status, on_log=shown.log, on_partial=shown.partial,
                    callback_url=callback_url,
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


@click.command()
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


@click.command()
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


@click.command()
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


@click.command()
@_client_options(model=False)
@click.option("--json", "as_json", is_flag=True, help="Print GET /me as it is.")
def me(url: str, token: str | None, as_json: bool) -> None:
    """Say who the token is to the gateway: its name, class and priority, what it may use, and its limits in use."""
    caller = _fetch(url, token, lambda client: client.me())
    if as_json:
        click.echo(json.dumps(caller, indent=2))
        return
    if caller["name"] is None:
        click.echo(f"this gateway has no auth: jobs count against {caller['tenant']}")
        return
    in_class = f"class {caller['class']} (priority {caller['priority']})" if caller["class"] is not None else "no class"
    click.echo(f"{caller['name']}: {in_class}, weight {caller['weight']:g}{', admin' if caller['admin'] else ''}")
    if caller["groups"]:
        click.echo(f"  groups: {', '.join(caller['groups'])}")
    for key in ("tools", "models"):
        click.echo(f"  {key}: {', '.join(caller[key]) if caller[key] is not None else 'all'}")
    usage = caller["usage"]
    for key, used in (("max_concurrent", "running"), ("jobs_per_minute", "started_last_minute")):
        limit = usage[key] if usage[key] is not None else "no limit"
        click.echo(f"  {used.replace('_', ' ')}: {usage[used]} of {limit} ({key.replace('_', ' ')})")
    if usage.get("max_job_memory") is not None:
        click.echo(f"  memory one job may be priced at: {usage['max_job_memory']} bytes")
    if usage.get("job_timeout") is not None:
        click.echo(f"  seconds one job may run: {usage['job_timeout']:g}")
    for quota in caller.get("quotas", []):
        held = f", {quota['held']:g} held by running jobs" if quota.get("held") else ""
        click.echo(f"  {quota['name'].replace('_', ' ')}: {quota['used']:g} of {quota['limit']:g} used{held}, turns in {quota['resets_in_s']:.0f} s")


@click.command()
@_client_options(model=False)
@click.option("--by", default="tenant,class,model", show_default=True, help="What rows are kept apart: tenant, class, model (comma-separated).")
@click.option("--tenant", default=None, help="Only this tenant's rows (an admin's token).")
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True, help="Rows at most, the largest device-seconds first.")
@click.option("--json", "as_json", is_flag=True, help="Print GET /usage as it is.")
def usage(url: str, token: str | None, by: str, tenant: str | None, limit: int, as_json: bool) -> None:
    """What jobs used, by tenant, class and model: jobs, tokens in and out, device-seconds, result bytes."""
    report = _fetch(url, token, lambda client: client.usage(by, tenant, limit))
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    keys = [key.strip() for key in by.split(",") if key.strip()]
    header = [*keys, "jobs", "tokens in", "tokens out", "device s", "result bytes"]
    lines = [header]
    for row in report["rows"]:
        used = row["usage"]
        lines.append([
            *(row[key] or "-" for key in keys), str(used.get("jobs", 0)), str(used.get("tokens_in", 0)), str(used.get("tokens_out", 0)),
            f"{used.get('device_s', 0):.2f}", str(used.get("result_bytes", 0)),
        ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    if report["rows_total"] > len(report["rows"]):
        click.echo(f"({report['rows_total'] - len(report['rows'])} more rows; --limit)")
