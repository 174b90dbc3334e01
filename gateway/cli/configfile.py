"""Settings from a TOML file (`--config`), where each setting came from, and redaction for showing them.

`--config FILE` is an eager option: click processes it before every other
option, and its callback puts the file's values into `ctx.default_map`. Click
then fills each option from, in this order, the command line, its
`STREAMGATE_*` variable, the default map and the option's own default. So flags
win over the environment, the environment over the file and the file over the
defaults, with no per-option code here, and `ctx.get_parameter_source` says
which of the four each value came from (`--print-config` shows it).

The file is checked when it is read, strictly (TOML has real types: `port =
"9000"` is a mistake, not a string to parse), against the Settings Struct and
then the option's own range, choices and callback, so that an error names the
file and the key rather than a flag the user never typed. Paths in the file
are relative to the working directory, as they are on the command line.

Redaction (`redact`) hides the values of settings named like a secret (token,
secret, password), except numbers and paths to files that hold secrets, and the
credentials in URLs (`redis://user:pass@host` -> `redis://user:REDACTED@host`).
"""

from __future__ import annotations

import difflib
import json
import math
import re
import tomllib
import typing
from typing import Any

import click
import msgspec
from click.core import ParameterSource

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

_FIELDS = {f.name: f.type for f in msgspec.structs.fields(Settings)}


def load(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """The `--config` callback: check the file and make its values the command's defaults."""
    if value is None:
        return
    try:
        with open(value, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise click.BadParameter(f"cannot read {value}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise click.BadParameter(f"{value} is not valid TOML: {exc}") from None
    ctx.default_map = {**(ctx.default_map or {}), **_defaults(ctx, data, value)}
    ctx.meta[_FILE] = value


def _settable(command: click.Command) -> dict[str, click.Option]:
    """The options a file may set, under each accepted key: the setting's name and its flag's."""
    keys: dict[str, click.Option] = {}
    for param in command.params:
        # --config, --print-config and --dry-run are actions, not settings.
        if isinstance(param, click.Option) and param.name in _FIELDS:
            keys[param.name] = param
            for opt in param.opts:
                if opt.startswith("--"):
                    keys[opt[2:].replace("-", "_")] = param
    return keys


def _defaults(ctx: click.Context, data: dict[str, Any], where: str) -> dict[str, Any]:
    settable = _settable(ctx.command)
    found: dict[str, Any] = {}
    for key, value in data.items():
        option = settable.get(key.replace("-", "_"))
        if option is None:
            raise click.BadParameter(_unknown(ctx, key, where, settable))
        assert option.name is not None
        if option.name in found:
            raise click.BadParameter(f"{where}: {key!r} sets {option.name}, which is already set in that file")
        found[option.name] = _check(ctx, option, key, value, where)
    return found


def _unknown(ctx: click.Context, key: str, where: str, settable: dict[str, click.Option]) -> str:
    name = key.replace("-", "_")
    if name in _FIELDS:
        return f"{where}: {key!r} is not a setting of `{ctx.command_path}`"
    close = difflib.get_close_matches(name, list(settable), n=1)
    return f"{where}: unknown setting {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def _check(ctx: click.Context, option: click.Option, key: str, value: Any, where: str) -> Any:
    """The value to put in the default map, checked as strictly as the command line would be."""
    assert option.name is not None
    kind = _FIELDS[option.name]
    if option.multiple and not isinstance(value, list):
        value = [value]  # one entry needs no array
    elif not option.multiple and typing.get_origin(kind) is list:
        # Flags such as --devices take one comma-separated string; a file may give an array.
        if isinstance(value, list):
            _convert(value, kind, key, where)
            value = ",".join(value) or None  # [] is the default: none given
        kind = str | None
    _convert(value, kind, key, where)
    try:
        option.process_value(ctx, value)
    except click.BadParameter as exc:
        detail = "invalid value" if is_secret(option.name) else exc.message
        raise click.BadParameter(f"{where}: {key}: {detail}") from None
    return value


def _convert(value: Any, kind: Any, key: str, where: str) -> None:
    try:
        msgspec.convert(value, kind, strict=True)
    except msgspec.ValidationError as exc:
        # msgspec says `null` for None; TOML has no null, the setting is just optional.
        raise click.BadParameter(f"{where}: {key}: {str(exc).replace(' | null', '')}") from None


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
