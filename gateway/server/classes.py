"""Classes of users: what the tokens file's `[classes.<name>]` tables give the tokens and the signed-in
users that belong to them.

```toml
[classes.staff]
priority = 10                   # served first (a larger number is a higher class)
weight = 2                      # a member's share of turns against the class's other members
max_concurrent = 8
jobs_per_minute = 120
groups = ["lab-staff"]          # signed-in users in any of these groups belong here
[classes.students]
priority = 0
tools = ["generate", "embed"]   # 403 for the others
models = ["smollm2"]            # 403 for a run on another model
max_concurrent = 2
max_queued = 32                 # the class's jobs waiting to start, all members' together (429 queue_full past it)
max_job_memory = "2GiB"         # 413 for a job priced over it (within the gateway's --max-job-memory)
job_timeout = 120               # seconds a job may run (within the gateway's --job-timeout)
tokens_per_hour = 200000        # each member's quotas: 429 once used up (gateway/server/metering.py)
device_seconds_per_day = 3600
callbacks = false               # its members' runs may not name a Callback-URL (403)
default = true                  # everyone without a class of their own
[tokens.ci]
token = "…"
class = "staff"                 # a token names its class; its own keys win over the class's
```

A token takes its class's values for every key it does not set itself, then the gateway-wide
defaults (`--max-concurrent-per-token`, `--jobs-per-minute-per-token`). A signed-in user
(gateway/server/signin.py) belongs to the highest class (by priority, then name) listing one of
their groups, else to the default class. Without a class, a token is as it was before classes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.config import parse_size

# What a token and its class both may set: a token's own value wins over its class's (auth.py `member`).
SHARED_KEYS = ("tools", "models", "max_concurrent", "jobs_per_minute", "max_job_memory", "job_timeout")
# Each member's use of the devices and of tokens in a clock hour and a UTC day (gateway/server/metering.py).
QUOTA_KEYS = ("tokens_per_hour", "tokens_per_day", "device_seconds_per_hour", "device_seconds_per_day")
CLASS_KEYS = frozenset({"priority", "weight", "groups", "default", "callbacks", "max_queued", *SHARED_KEYS, *QUOTA_KEYS})


@dataclass(frozen=True)
class Quotas:
    """A class's quotas on each member's use (None: no quota), settled as jobs end."""

    tokens_per_hour: int | None = None
    tokens_per_day: int | None = None
    device_seconds_per_hour: float | None = None
    device_seconds_per_day: float | None = None

    def __bool__(self) -> bool:
        return any(getattr(self, key) is not None for key in QUOTA_KEYS)


NO_QUOTAS = Quotas()


class ClassConfigError(ValueError):
    """A `[classes.<name>]` table cannot be used; the message names the table and the key."""


@dataclass(frozen=True)
class UserClass:
    """One class of users: its priority, its members' weight, limits and what they may use."""

    name: str
    priority: int = 0
    weight: float | None = None
    max_concurrent: int | None = None
    jobs_per_minute: int | None = None
    max_job_memory: int | None = None  # bytes; the gateway's --max-job-memory bounds it too
    job_timeout: float | None = None  # seconds; the gateway's --job-timeout bounds it too
    tools: frozenset[str] | None = None  # None: every tool
    models: frozenset[str] | None = None  # None: every model
    groups: frozenset[str] = frozenset()
    default: bool = False
    quotas: Quotas = NO_QUOTAS
    callbacks: bool = True  # whether its members' runs may name a Callback-URL (gateway/server/webhooks.py)
    # Its jobs waiting to start, every member's together, in this gateway: so that a class that floods
    # the queue fills its own part of it, not the places other classes' jobs would wait in.
    max_queued: int | None = None


def parse_classes(tables: Any, where: str) -> dict[str, UserClass]:
    """The `[classes.*]` tables of a tokens file (`where` names it in errors)."""
    if tables is None:
        return {}
    if not isinstance(tables, dict):
        raise ClassConfigError(f"{where}: classes must be tables, [classes.<name>]")
    found = {name: _parse(name, entry, f"{where}: [classes.{name}]") for name, entry in tables.items()}
    defaults = sorted(name for name, c in found.items() if c.default)
    if len(defaults) > 1:
        raise ClassConfigError(f"{where}: one class may be the default, not {defaults}")
    return found


def _parse(name: str, entry: Any, where: str) -> UserClass:
    if not isinstance(entry, dict):
        raise ClassConfigError(f"{where}: a table of {', '.join(sorted(CLASS_KEYS))}")
    if unknown := set(entry) - CLASS_KEYS:
        raise ClassConfigError(f"{where}: unknown keys {sorted(unknown)}")
    priority = entry.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ClassConfigError(f"{where}: priority must be an integer")
    for flag in ("default", "callbacks"):
        if not isinstance(entry.get(flag, flag == "callbacks"), bool):
            raise ClassConfigError(f"{where}: {flag} must be true or false")
    return UserClass(
        name=name,
        priority=priority,
        weight=check_weight(entry.get("weight"), where),
        **shared_keys(entry, where),
        groups=check_names(entry, "groups", where) or frozenset(),
        default=entry.get("default", False),
        callbacks=entry.get("callbacks", True),
        max_queued=check_count(entry, "max_queued", where),
        quotas=Quotas(
            tokens_per_hour=check_count(entry, "tokens_per_hour", where),
            tokens_per_day=check_count(entry, "tokens_per_day", where),
            device_seconds_per_hour=check_seconds(entry, "device_seconds_per_hour", where),
            device_seconds_per_day=check_seconds(entry, "device_seconds_per_day", where),
        ),
    )


def shared_keys(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`SHARED_KEYS` of a token's or a class's table, checked (None where not set)."""
    return {
        "tools": check_names(entry, "tools", where),
        "models": check_names(entry, "models", where),
        "max_concurrent": check_count(entry, "max_concurrent", where),
        "jobs_per_minute": check_count(entry, "jobs_per_minute", where),
        "max_job_memory": check_size(entry, "max_job_memory", where),
        "job_timeout": check_seconds(entry, "job_timeout", where),
    }


def check_weight(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ClassConfigError(f"{where}: weight must be a number > 0")
    return float(value)


def check_count(entry: Mapping[str, Any], key: str, where: str) -> int | None:
    value = entry.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ClassConfigError(f"{where}: {key} must be an integer >= 1")
    return value


def check_seconds(entry: Mapping[str, Any], key: str, where: str) -> float | None:
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ClassConfigError(f"{where}: {key} must be a number of seconds > 0")
    return float(value)


def check_size(entry: Mapping[str, Any], key: str, where: str) -> int | None:
    """A size in bytes: an integer, or a string such as "512MiB" or "2GiB"."""
    value = entry.get(key)
    if value is None:
        return None
    try:
        size = value if isinstance(value, int) and not isinstance(value, bool) else parse_size(value) if isinstance(value, str) else None
    except ValueError:
        size = None
    if size is None or size < 1:
        raise ClassConfigError(f"{where}: {key} must be a size (bytes, or \"512MiB\", \"2GiB\")")
    return size


def check_names(entry: Mapping[str, Any], key: str, where: str) -> frozenset[str] | None:
    value = entry.get(key)
    if value is None:
        return None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ClassConfigError(f"{where}: {key} must be a list of names")
    return frozenset(value)


def class_of_groups(classes: Mapping[str, UserClass], groups: Iterable[str]) -> UserClass | None:
    """A signed-in user's class: the highest listing one of `groups`, else the default one."""
    mine = set(groups)
    listed = [c for c in classes.values() if c.groups & mine]
    if listed:
        return min(listed, key=lambda c: (-c.priority, c.name))
    return default_class(classes)


def default_class(classes: Mapping[str, UserClass]) -> UserClass | None:
    return next((c for c in classes.values() if c.default), None)
