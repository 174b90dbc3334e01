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
underscores), decoded and checked by the same code (gateway/config.py); as there, a
`STREAMGATE_*` variable set where the application is built wins over them. The ray_*
ones say how the deployment scales.
"""

from __future__ import annotations

from typing import Any

from backends.ray_serve import APP_NAME, application
from gateway import config
from gateway.config import Settings


def app(args: dict[str, Any]) -> Any:
    """Serve's application builder (`import_path: backends.ray_app:app`)."""
    return application(settings(args), paths=[])


def settings(args: dict[str, Any]) -> Settings:
    """The settings `args` give; ValueError naming the key at fault."""
    given = config.decode(args, "serve", f"the {APP_NAME} application's args")
    return config.build({**given, **config.environ("serve")})
