"""The `streamgate` Serve application built from a Serve config, for clusters that deploy it themselves.

A gateway with `--backend ray` deploys the application when none is running
(backends/ray_serve.py). A cluster whose applications are declared in a Serve
config (KubeRay's RayService `serveConfigV2`, `serve deploy`) names this builder
instead, and gateways attach to the application by name:

    applications:
      - name: streamgate
        import_path: backends.ray_app:app
        route_prefix: null
        args: {model: /models/my-model, max-batch-size: 16, ray-gpus-per-replica: 1}

`args` are `streamgate serve`'s settings keyed as in a `--config` file (dashes or
underscores), checked the same way; as there, a `STREAMGATE_*` variable set where the
application is built wins over them. The ray_* ones say how the deployment scales.
"""

from __future__ import annotations

from typing import Any

import msgspec

from backends.ray_serve import APP_NAME, application
from gateway.config import Settings

_FIELDS = {f.name for f in msgspec.structs.fields(Settings)}


def app(args: dict[str, Any]) -> Any:
    """Serve's application builder (`import_path: backends.ray_app:app`)."""
    return application(settings(args), paths=[])


def settings(args: dict[str, Any]) -> Settings:
    """The settings `args` give; ValueError naming the key at fault."""
    import click

    from gateway.cli import commands as cli
    from gateway.cli import configfile

    try:
        probe = click.Context(cli.serve, info_name="streamgate serve")
        found = configfile._defaults(probe, dict(args), f"the {APP_NAME} application's args")
        params = cli.serve.make_context("streamgate serve", [], default_map=found).params
    except click.ClickException as exc:
        raise ValueError(exc.message) from None
    settings = msgspec.convert({k: v for k, v in params.items() if k in _FIELDS}, Settings)
    if settings.ray_replicas is not None and (settings.ray_min_replicas, settings.ray_max_replicas) != (None, None):
        raise ValueError("give ray-replicas, or ray-min-replicas/ray-max-replicas, not both")
    return settings
