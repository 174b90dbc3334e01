"""`--dry-run`: load what a real start would load, say what it is, and stop without serving.

A local backend loads the model exactly as a start does (`start()`, then
`wait_ready()`), so a bad path, device or dtype fails here, before a deploy.
A remote gateway's model lives on its executors: its dry run checks the
configuration only and contacts nothing. So do models on inference servers
(`vllm:`, `openai+`): a dry run loads the models served here, checks that a
`vllm:` model's source and vLLM's interpreter are there, and starts no server.
"""

from __future__ import annotations

import asyncio
from typing import Any

import click

import msgspec

from gateway.config import Settings
from gateway.cli.configfile import redact_url


def on_servers(settings: Settings) -> tuple[Settings, list[str]]:
    """The settings with only the models served here, and a line for each model on an inference server."""
    from backends.vllm_server import vllm_python
    from backends.loading import ModelError, _named, resolve

    kept, lines = [], []
    try:
        for entry in settings.model:
            name, source = _named(entry, "--model")
            spec = resolve(source)
            if spec.server is None:
                kept.append(entry)
            elif spec.server == "vllm":
                python = vllm_python(settings.vllm_python)
                lines.append(f"model: {name or spec.name} on a vLLM server the gateway starts: {spec.gguf or spec.source}, with {python} (not started)")
            else:
                lines.append(f"model: {name} on the inference server at {redact_url(spec.source)} (not contacted)")
    except (ModelError, ValueError) as exc:
        raise click.ClickException(f"dry run: {exc}") from None
    return msgspec.structs.replace(settings, model=kept), lines


def report(backend: Any, settings: Settings, servers: list[str] = (), load: bool = True) -> None:  # type: ignore[assignment]
    """Print what `backend` loaded (or, for the remote and Ray backends, what was checked), and `servers`,
    the models on inference servers; exit 1 if loading fails. Without `load` only the servers are told."""
    if settings.backend == "remote":
        executors = ", ".join(redact_url(url) for url in settings.executors)
        click.echo(f"backend: remote, executors: {executors}")
        click.echo("dry run: configuration checked; executors were not contacted")
        return
    if settings.backend == "ray":
        sizing = (
            f"{settings.ray_min_replicas or 1}-{settings.ray_max_replicas or settings.ray_min_replicas or 1} replicas (autoscaled)"
            if (settings.ray_min_replicas, settings.ray_max_replicas) != (None, None)
            else f"{settings.ray_replicas or 1} replicas"
        )
        click.echo(f"backend: ray, address: {settings.ray_address or 'a local Ray instance'}, {sizing}")
        click.echo("dry run: configuration checked, Ray Serve importable; Ray was not contacted")
        return
    for line in servers:
        click.echo(line)
    if not load:  # every model is on a server
        click.echo("dry run: checked; not serving")
        return
    info, served = _load(backend)
    for model in served:
        if len(served) > 1:
            click.echo(f"[{model.name}]" + (" (the default)" if model.default else ""))
        click.echo(f"model: {model.name} ({model.kind})")
        click.echo(f"device: {model.device}")
        click.echo(f"dtype: {model.dtype}")
        click.echo(f"context: {model.context_length} tokens")
        if model.default:
            click.echo(f"capabilities: {', '.join(info.get('capabilities', [])) or 'none'}")
        click.echo(f"tools: {', '.join(model.tools)}")
        for reason in model.unsupported.values():
            click.echo(f"not for this model: {reason}")
    if info.get("saes"):
        click.echo(f"saes: {'; '.join(info['saes'])}")
    if settings.tools:
        click.echo(f"tool modules: {', '.join(settings.tools)}")
    click.echo("dry run: loaded; not serving")


def _load(backend: Any) -> tuple[dict[str, Any], list[Any]]:
    async def load() -> tuple[dict[str, Any], list[Any]]:
        await backend.start()
        try:
            await backend.wait_ready()
            return backend.describe(), backend.models()
        finally:
            await backend.stop()

    from backends.loading import ModelError

    try:
        return asyncio.run(load())
    except ModelError as exc:  # what a real start would report as not ready
        raise click.ClickException(f"dry run: cannot load the model: {exc}") from None
