"""Settings from a TOML file (`--config`), where each setting came from, and redaction for showing them.

`--config FILE` is an eager option: click processes it before every other
option, and its callback puts the file's values, decoded and checked by the
core (gateway/config.py: `decode`), into `ctx.default_map`. Click then fills
each option from, in this order, the command line, its `STREAMGATE_*`
variable, the default map and the option's own default. So flags win over the
environment, the environment over the file and the file over the defaults,
with no per-option code here, and `ctx.get_parameter_source` says which of the
four each value came from (`--print-config` shows it). Errors name the file and
the key rather than a flag the user never typed. Paths in the file are relative
to the working directory, as they are on the command line.

Redaction (`redact`) hides the values of settings named like a secret (token,
secret, password), except numbers and paths to files that hold secrets, and the
credentials in URLs (`redis://user:pass@host` -> `redis://user:REDACTED@host`).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import click
import msgspec
from click.core import ParameterSource

from gateway import config
from gateway.config import Settings

REDACTED = "REDACTED"
_FILE = "streamgate.config_file"  # ctx.meta key: the file that was read, for --print-config

SOURCES = {
    ParameterSource.COMMANDLINE: "flag",
    ParameterSource.ENVIRONMENT: "env",
    ParameterSource.DEFAULT_MAP: "file",
    ParameterSource.DEFAULT: "default",
    ParameterSource.PROMPT: "prompt",
}

_FIELDS = set(Settings.__struct_fields__)


def option(name: str, *decls: str, **kwargs: Any) -> Any:
    """A click option that its `STREAMGATE_*` variable also sets (shown in `--help`)."""
    env = "STREAMGATE_" + name.lstrip("-").replace("-", "_").upper()
    return click.option(name, *decls, envvar=env, show_envvar=True, show_default=True, **kwargs)


def load(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """The `--config` callback: check the file and make its values the command's defaults."""
    if value is None:
        return
    try:
        with open(value, "rb") as f:
            data = msgspec.toml.decode(f.read(), type=dict[str, Any])
    except OSError as exc:
        raise click.BadParameter(f"cannot read {value}: {exc.strerror or exc}") from None
    except msgspec.DecodeError as exc:
        raise click.BadParameter(f"{value} is not valid TOML: {exc}") from None
    assert ctx.command.name is not None
    try:
        found = config.decode(data, ctx.command.name, value)
    except config.SettingsError as exc:
        raise click.BadParameter(str(exc)) from None
    ctx.default_map = {**(ctx.default_map or {}), **found}
    ctx.meta[_FILE] = value


# -- where each setting came from, redacted -----------------------------------------


def effective(settings: Settings, ctx: click.Context) -> list[tuple[str, Any, str]]:
    """(name, redacted value, source) for each of the command's settings, in --help order."""
    rows = []
    for param in ctx.command.params:
        if isinstance(param, click.Option) and param.name in _FIELDS:
            source = ctx.get_parameter_source(param.name)
            word = SOURCES.get(source, "default") if source is not None else "default"
            rows.append((param.name, redact(param.name, getattr(settings, param.name)), word))
    return rows


def print_settings(settings: Settings, form: str) -> None:
    """`--print-config[=json]`: print the effective settings and their sources, then exit 0."""
    ctx = click.get_current_context()
    rows = effective(settings, ctx)
    where = ctx.meta.get(_FILE)
    if form == "json":
        out = {
            "command": ctx.command_path,
            "config_file": where,
            "settings": {name: value for name, value, _ in rows},
            "sources": {name: source for name, _, source in rows},
        }
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(_as_toml(ctx.command_path, where, rows))
    ctx.exit(0)


def _as_toml(command: str, where: str | None, rows: list[tuple[str, Any, str]]) -> str:
    lines = [
        f"# {command}: the effective settings, each with where it came from:",
        "# a flag, an env variable (STREAMGATE_*), the --config file, or the default.",
        f"# config file: {where or 'none'}",
    ]
    entries = [(f"{name} = {_toml(value)}" if value is not None else f"# {name}: not set", source)
               for name, value, source in rows]
    width = min(max(len(text) for text, _ in entries), 48)
    lines += [f"{text:<{width}}  # {source}" for text, source in entries]
    return "\n".join(lines)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value))  # JSON's escapes are all valid in a TOML basic string


# -- redaction ------------------------------------------------------------------------

_SECRET_NAME = re.compile(r"token|secret|password", re.IGNORECASE)
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^/?#\s]*)@")
_SECRET_QUERY = re.compile(r"(?P<key>[?&;][^=&#\s]*(?:token|secret|password|key)[^=&#\s]*=)[^&#\s]*", re.IGNORECASE)


def is_secret(name: str) -> bool:
    """A setting whose value is a secret: named so, and not a path to a file of secrets."""
    return bool(_SECRET_NAME.search(name)) and not name.endswith(("_file", "_dir", "_path"))


def redact(name: str, value: Any) -> Any:
    """`value` fit to show: secrets replaced by REDACTED, URLs stripped of credentials.

    Numbers are never secrets (max_concurrent_per_token is a limit). In a list,
    `name=secret` entries (--tokens) keep their name, which says which client it is.
    """
    if isinstance(value, (list, tuple)):
        return [_redact_entry(name, item) for item in value]
    if not isinstance(value, str):
        return value
    return REDACTED if is_secret(name) else redact_url(value)


def _redact_entry(name: str, item: Any) -> Any:
    if isinstance(item, str) and is_secret(name):
        label, sep, _ = item.partition("=")
        return f"{label}={REDACTED}" if sep else REDACTED
    return redact(name, item)


def redact_url(text: str) -> str:
    """`text` with any URL's password (or lone user, often a token) and secret query values replaced."""

    def userinfo(match: re.Match[str]) -> str:
        user, sep, _ = match["userinfo"].partition(":")
        return match["scheme"] + (f"{user}:{REDACTED}@" if sep else f"{REDACTED}@")

    return _SECRET_QUERY.sub(lambda m: m["key"] + REDACTED, _URL_USERINFO.sub(userinfo, text))
