"""Traces: one OpenTelemetry trace per job, across every process it runs through, and nothing without `OTEL_*`.

The standard variables configure it, as the SDK reads them (`OTEL_TRACES_EXPORTER`,
`OTEL_EXPORTER_OTLP_*`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`), with two deliberate differences:

- Nothing is exported unless asked for. The SDK's default exporter is `otlp`;
  here a process with neither `OTEL_TRACES_EXPORTER` nor an OTLP endpoint set
  installs no provider, so every span the code starts is the API's no-op one,
  no id is made and no context is sent on. An OTLP endpoint alone means `otlp`.
- `console` writes each span as one JSON line on stdout (the SDK's writes
  indented JSON), to read with `jq` beside the JSON log lines on stderr.

The rule this module owns: a job's trace is carried by the job, not by the task
that happens to run it. The request span is current only while its request is
handled (`RequestSpans`); admission starts the job's span under it
(gateway/admission.py), and from then on the job's own span is the parent of what
happens to it, on the event loop or a device's thread, in this process or as a
W3C `traceparent` in another: a submit's `traceparent` field (backends/remote.py,
backends/engines.py), a Ray call's argument (backends/ray_serve.py), a header on
the request to an inference server (backends/inference.py). A job that outlives
its request (detached, resumed) stays in the trace of the request that started it.

What it does not do: instrument httpx or Starlette wholesale (a span for every
write of a stream, or for every health poll between a gateway and its engines,
would bury the jobs); trace the probes (`/healthz`, `/readyz`, `/metrics`); or
export metrics and logs through OpenTelemetry (`GET /metrics` and the JSON log
lines are those).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, NoOpTracerProvider, SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.plumbing import logs

log = logging.getLogger("streamgate.tracing")
tracer = trace.get_tracer("streamgate")
_PROPAGATOR = TraceContextTextMapPropagator()
# Probes and scrapes: a span for each would be a trace a second per poller, and none of them is a job's.
UNTRACED = frozenset({"/healthz", "/readyz", "/metrics"})
_NOTHING = contextlib.nullcontext(INVALID_SPAN)


class _Tracers(trace.TracerProvider):
    """The provider this process installs, once (the API takes one per process), in front of the
    one in use: a process that runs several services (the tests) turns tracing on and off with
    `install`, and without it every tracer is the no-op one again."""

    def __init__(self) -> None:
        self.provider: trace.TracerProvider = NoOpTracerProvider()

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Any = None,
    ) -> trace.Tracer:
        return _Tracer(self, (instrumenting_module_name, instrumenting_library_version, schema_url, attributes))


class _Tracer(trace.Tracer):
    """A tracer of whichever provider `_Tracers` holds now."""

    def __init__(self, tracers: _Tracers, scope: tuple[Any, ...]) -> None:
        self._tracers, self._scope = tracers, scope
        self._of: trace.TracerProvider | None = None
        self._tracer: trace.Tracer = trace.NoOpTracer()

    def _current(self) -> trace.Tracer:
        provider = self._tracers.provider
        if provider is not self._of:
            self._of, self._tracer = provider, provider.get_tracer(*self._scope)
        return self._tracer

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:  # type: ignore[override]
        return self._current().start_span(*args, **kwargs)

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self._current().start_as_current_span(*args, **kwargs)


_TRACERS = _Tracers()


def install(provider: trace.TracerProvider | None) -> None:
    """Record spans with `provider` from now on (an SDK `TracerProvider`), or none (None)."""
    if provider is not None and trace.get_tracer_provider() is not _TRACERS:
        trace.set_tracer_provider(_TRACERS)
        if trace.get_tracer_provider() is not _TRACERS:  # the API keeps the first one set, and says so once
            log.warning("another tracer provider was installed in this process first: streamgate's spans go to it")
    _TRACERS.provider = provider if provider is not None else NoOpTracerProvider()


def enabled() -> bool:
    """Whether spans are recorded at all (a provider is installed)."""
    return not isinstance(_TRACERS.provider, NoOpTracerProvider)


def configure(service: str, environ: Mapping[str, str] | None = None, **resource: str) -> bool:
    """Trace as the `OTEL_*` variables say, as `service` unless `OTEL_SERVICE_NAME` names it otherwise,
    with `resource`'s attributes added; False (nothing installed) when they ask for nothing.
    Raises ValueError for an exporter it does not know. `environ` (os.environ) decides whether and
    where to; what the SDK reads itself (the sampler, an endpoint's details, the resource) is os.environ's."""
    environ = os.environ if environ is None else environ
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names and (environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        names = ["otlp"]
    disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    exporters = [] if disabled else [_exporter(name, environ) for name in names if name != "none"]
    if not exporters:
        install(None)
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    named = OTELResourceDetector().detect().attributes.get(SERVICE_NAME)
    attributes = {**({} if named else {SERVICE_NAME: service}), "process.pid": os.getpid(), **resource}
    # The sampler is the SDK's reading of OTEL_TRACES_SAMPLER (parent-based, always on, by default),
    # and a batch processor's thread exports: a span's end costs the event loop a queue append.
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    install(provider)
    return True


def _exporter(name: str, environ: Mapping[str, str]) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(out=sys.stdout, formatter=lambda span: span.to_json(indent=None) + "\n")
    if name == "otlp":
        protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
        if protocol != "http/protobuf":
            raise ValueError(f"OTLP over {protocol} is not installed: streamgate exports OTLP over http/protobuf (port 4318)")
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()  # its endpoint, headers, timeout and compression from OTEL_EXPORTER_OTLP_*
    raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: streamgate exports to otlp, console or none")


def shutdown() -> None:
    """Export what is left and stop (before the process exits, which may skip `atexit`)."""
    provider = _TRACERS.provider
    if hasattr(provider, "shutdown"):
        provider.shutdown()
    install(None)


# -- across processes ---------------------------------------------------------------------


def traceparent(span: trace.Span) -> str | None:
    """`span`'s W3C `traceparent`, for another process to continue its trace; None without tracing."""
    if not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent")


def continued(value: str | None) -> contextlib.AbstractContextManager[Any]:
    """Within it, the spans started are children of the span a `traceparent` names (a job another
    process submitted); without one, or without tracing, nothing changes."""
    if not value or not enabled():
        return _NOTHING
    return _attached(_PROPAGATOR.extract({"traceparent": value}))


@contextlib.contextmanager
def _attached(context: otel_context.Context) -> Iterator[None]:
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


def headers(span: trace.Span) -> dict[str, str]:
    """The `traceparent` header naming `span`, for an HTTP request made on its behalf."""
    value = traceparent(span)
    return {"traceparent": value} if value else {}


# -- spans of a job ---------------------------------------------------------------------


def child(parent: trace.Span, name: str, kind: SpanKind = SpanKind.INTERNAL, **attributes: Any) -> trace.Span:
    """A span under `parent` (a job's), started now; the no-op one when `parent` is not recorded."""
    if not parent.is_recording():
        return INVALID_SPAN
    return tracer.start_span(name, trace.set_span_in_context(parent), kind, attributes=attributes)


def queued(job: Any) -> None:
    """The time `job` waited, from its span's start (as it was submitted) to now."""
    submitted = getattr(job.span, "start_time", None)
    if submitted is not None and job.span.is_recording():
        tracer.start_span("queued", trace.set_span_in_context(job.span), start_time=submitted).end()


def on_device(job: Any, ctx: Any, device: str) -> None:
    """`job` starts on `device`: the time it queued, and the span of its run there, which its steps
    and encoding go under (`ctx.span`) and which ends with the job."""
    if not job.span.is_recording():
        return
    queued(job)
    run = ctx.span = child(job.span, "run", **{"streamgate.device": device})
    job.when_ended(lambda _: run.end())


def step(ctx: Any, began: int, size: int, index: int, **attributes: Any) -> None:
    """One device step `ctx`'s job took part in (its `index`-th), from `began` (ns) to now, among `size`."""
    _step(trace.set_span_in_context(ctx.span), began, size, index, attributes)


def _step(parent: otel_context.Context, began: int, size: int, index: int, attributes: Mapping[str, Any]) -> None:
    tracer.start_span(
        "step", parent, start_time=began, attributes={"streamgate.batch.size": size, "streamgate.step": index, **attributes}
    ).end()


class Steps:
    """The traced members of a batch stepping on a device's thread, and how many steps each has
    taken: a span per step for each, and nothing at all when none is traced."""

    def __init__(self) -> None:
        self.members: dict[Any, list[Any]] = {}  # a member's context: [its run's context, its steps so far]

    def __bool__(self) -> bool:
        return bool(self.members)

    def join(self, ctx: Any) -> None:
        span = getattr(ctx, "span", INVALID_SPAN)
        if span.is_recording():
            self.members[ctx] = [trace.set_span_in_context(span), 0]

    def stepped(self, began: int, size: int) -> None:
        for member in self.members.values():
            _step(member[0], began, size, member[1], {})
            member[1] += 1

    def leave(self, ctxs: Iterable[Any]) -> None:
        for ctx in ctxs:
            self.members.pop(ctx, None)


def encoding(ctx: Any) -> contextlib.AbstractContextManager[trace.Span]:
    """The span of encoding `ctx`'s job's result, under its run (the no-op one when not traced)."""
    span = getattr(ctx, "span", INVALID_SPAN)
    if not span.is_recording():
        return _NOTHING
    return tracer.start_as_current_span("encoding", trace.set_span_in_context(span))


# -- the request span ---------------------------------------------------------------------


class RequestSpans:
    """ASGI middleware: a server span per request, under the client's `traceparent` if it sent one.

    Plain ASGI in the request's own task, as `logs.RequestIds` is (and inside it, to name the
    request's id): what the route starts, a job's span among it, is its child. It is named by
    the route's template once routing has found it (`POST /{tool}/run`), and says the job the
    response follows (`X-Job-Id`). A stream's request span lasts as long as the stream.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED:
            await self.app(scope, receive, send)
            return
        given = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in (b"traceparent", b"tracestate")}
        method = scope["method"]
        span = tracer.start_span(
            method, _PROPAGATOR.extract(given), SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": scope["path"], "streamgate.request.id": logs.request_id.get() or ""},
        )

        async def send_traced(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(StatusCode.ERROR)
                for key, value in message.get("headers", ()):
                    if key.lower() == b"x-job-id":
                        span.set_attribute("streamgate.job.id", value.decode("latin-1"))
            await send(message)

        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            await self.app(scope, receive, send_traced)
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
            # Left attached: Starlette's outermost handler answers (and logs) the 500 after this
            # returns, in this task, and its log line names the trace too.
            raise
        else:
            otel_context.detach(token)
        finally:
            route = getattr(scope.get("route"), "path", None)
            if route:
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
            span.end()
