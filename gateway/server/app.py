"""The HTTP service: the gateway's routes (gateway/server/gateway.py), the OpenAI routes, `/mcp`
and the dashboard, as one Starlette app with its life (start, drain, stop) and its middleware.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gateway.backend import Backend
from gateway.config import Settings
from gateway.errors import ApiError, api_error_handler, http_error_handler
from gateway.plumbing import memory, tracing
from gateway.plumbing.drain import on_sigterm
from gateway.plumbing.logs import RequestIds, request_id_headers
from gateway.protocol import Code
from gateway.server import mcp, openai
from gateway.server.apidocs import endpoint as api_docs
from gateway.server.gateway import Gateway
from gateway.server.openapi import endpoint as openapi_json

log = logging.getLogger("streamgate.app")

# The dashboard, built from web/ and shipped as package data.
STATIC = Path(__file__).parent.parent / "static"


class _Assets(StaticFiles):
    """The dashboard's files, revalidated on every load so a new build is never served stale."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


async def dashboard(request: Request) -> Response:
    index = STATIC / "index.html"
    if not index.is_file():
        raise ApiError(Code.NOT_FOUND, "the dashboard is not built: run `npm run build:dashboard` in web/")
    return FileResponse(index, headers={"Cache-Control": "no-cache"})


def _cors(origins: list[str]) -> list[Middleware]:
    """Cross-origin access for the listed origins only (none by default): browsers elsewhere get no CORS headers."""
    if not origins:
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST", "DELETE"],
            # traceparent and tracestate: a page's own tracing continues into the gateway's spans; the
            # Mcp-* ones are what a browser's MCP client sends to /mcp (the 2025 handshake's and the
            # 2026 envelope's), without which its preflight fails.
            allow_headers=[
                "Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID", "X-Request-Id", "traceparent", "tracestate", "Callback-URL",
                "Mcp-Session-Id", "MCP-Protocol-Version", "Mcp-Method", "Mcp-Name",
            ],
            # A page elsewhere reads these from a run's response (fetch hides the rest).
            expose_headers=["X-Job-Id", "X-Request-Id", "Retry-After", "Mcp-Session-Id"],
            max_age=600,
        )
    ]


def create_app(backend: Backend, settings: Settings | None = None) -> Starlette:
    gateway = Gateway(backend, settings)
    settings = gateway.settings

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return ApiError(Code.INTERNAL, "internal error", headers=request_id_headers()).response()

    agents = mcp.McpServer(gateway)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        # What is loaded by now (modules, routes, a remote backend's clients) lives as long as the
        # process: out of the collector's full passes, which walked it all and held the loop.
        memory.settle()
        on_sigterm(gateway.drain, lambda: backend.in_flight, gateway.stop_jobs)
        watcher = asyncio.create_task(gateway.streams.watch(), name="streams' watcher")
        try:
            async with agents.running():
                yield
        finally:
            watcher.cancel()
            await gateway.stop()

    openapi_document = openapi_json(backend, gateway.limits, secured=gateway.auth.enabled)
    app = Starlette(
        routes=[
            Route("/openapi.json", openapi_document, methods=["GET"]),
            Route("/docs", api_docs(openapi_document), methods=["GET"]),
            Route("/tools", gateway.tools, methods=["GET"]),
            Route("/models", gateway.models, methods=["GET"]),
            Route("/healthz", gateway.healthz, methods=["GET"]),
            Route("/readyz", gateway.readyz, methods=["GET"]),
            Route("/metrics", gateway.metrics.endpoint, methods=["GET"]),
            Route("/{tool}/run", gateway.run, methods=["GET", "POST"]),
            Route("/jobs", gateway.list_jobs, methods=["GET"]),
            Route("/jobs/{job_id}", gateway.job_snapshot, methods=["GET"]),
            Route("/jobs/{job_id}", gateway.cancel_job, methods=["DELETE"]),
            Route("/jobs/{job_id}/events", gateway.job_events, methods=["GET"]),
            Route("/jobs/{job_id}/result", gateway.job_result, methods=["GET"]),
            Route("/jobs/{job_id}/files/{name}", gateway.job_file, methods=["GET"]),
            Route("/auth/ticket", gateway.ticket, methods=["POST"]),
            Route("/me", gateway.me, methods=["GET"]),
            Route("/usage", gateway.usage, methods=["GET"]),
            *openai.routes(gateway),
            Route("/mcp", agents, methods=["POST"]),
            Route("/", dashboard, methods=["GET"]),
            Mount("/assets", _Assets(directory=STATIC / "assets", check_dir=False), name="assets"),
        ],
        exception_handlers={
            ApiError: api_error_handler,
            HTTPException: http_error_handler,
            Exception: unexpected,
        },
        lifespan=lifespan,
        middleware=_cors(settings.cors_origins),
    )
    app.state.gateway = gateway
    app.state.auth = gateway.auth
    app.state.drain = gateway.drain
    app.state.backend = backend
    app.state.settings = settings
    app.state.store = gateway.store
    app.state.metrics = gateway.metrics
    app.state.mcp = agents
    if tracing.enabled():  # without tracing, not even a pass through it
        app.add_middleware(tracing.RequestSpans)
    # Added last, so it wraps the other middleware (CORS included): every answer carries X-Request-Id.
    app.add_middleware(RequestIds)
    return app
