"""The backend a gateway's settings choose, built in one place: `streamgate serve` and an executor
only call these.

- `--backend ray`: Ray Serve replicas (backends/ray_serve.py);
- `--backend remote`: executor services (backends/remote.py);
- `--backend local` with `--engine process` (the default): each model's copies in engine processes
  (backends/engines.py); with `--engine thread`, in this process (backends/local.py).

A dry run (`streamgate serve --dry-run`) builds the backend it would serve, but never starts it:
models on inference servers are only checked, and no engine process is spawned.
"""

from __future__ import annotations

from typing import Any

from gateway.backend import Backend
from gateway.config import Settings


class BackendError(Exception):
    """The settings name a backend that cannot be built here; the message says why (one line)."""


def backend_from(settings: Settings, *, dry_run: bool = False, here: Settings | None = None) -> Backend:
    """The backend `settings` choose. `dry_run`: built to be checked, never started; `here`: a dry
    run's settings for the models not on inference servers (gateway/cli/dryrun.py `on_servers`)."""
    from backends.loading import ModelError

    try:
        return _chosen(settings, dry_run, here)
    except (ValueError, ModelError) as exc:
        raise BackendError(str(exc)) from None


def _chosen(settings: Settings, dry_run: bool, here: Settings | None) -> Backend:
    if settings.backend == "ray":
        from backends.ray_serve import INSTALL_HINT, RayBackend, ray_available

        if not ray_available():
            raise ValueError(INSTALL_HINT)
        return RayBackend(settings)
    if settings.backend == "remote":
        from backends.remote import RemoteBackend

        return RemoteBackend(
            settings.executors, token=settings.executor_token, deadline=settings.executor_deadline, result_files=settings.result_spool
        )
    from backends.engines import EngineBackend
    from backends.local import from_settings

    if settings.engine == "process" and not dry_run:
        return EngineBackend(settings)
    if dry_run and here is not None:
        # Models on inference servers alone: nothing to load here (no --model would mean the bundled
        # default); the engines' backend, never started, for the app's checks.
        return from_settings(here) if here.model else EngineBackend(settings)
    return from_settings(settings)


def executor_from(settings: Settings, inline_results: bool = False) -> Any:
    """The executor service of `settings` (backends/executor.py): its local backend, with results as
    msgpack to fetch, or (`inline_results`, an engine's) as JSON in their `completed` frames."""
    from backends.executor import Executor
    from backends.loading import ModelError
    from backends.local import from_settings
    from gateway.encoding import to_json, to_msgpack

    try:
        backend = from_settings(settings, encode=to_json if inline_results else to_msgpack)
    except (ValueError, ModelError) as exc:
        raise BackendError(str(exc)) from None
    return Executor(backend, settings, inline_results=inline_results)
