"""Spans for the tests: this process's, in the SDK's in-memory exporter, and other processes', as an
OTLP collector on loopback receives them; both as `Span`s, to compare and to walk as a tree."""

from __future__ import annotations

import contextlib
import gzip
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.plumbing import tracing
from tests.support import loopback_http


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent: str | None
    service: str
    kind: str  # SERVER, CLIENT, INTERNAL
    status: str  # UNSET, OK, ERROR
    start: int  # ns
    end: int
    attributes: dict[str, Any] = field(default_factory=dict)


def from_sdk(span: ReadableSpan) -> Span:
    context, parent = span.get_span_context(), span.parent
    assert context is not None and span.start_time is not None and span.end_time is not None
    return Span(
        span.name, f"{context.trace_id:032x}", f"{context.span_id:016x}", f"{parent.span_id:016x}" if parent else None,
        str(span.resource.attributes.get("service.name")), span.kind.name, span.status.status_code.name,
        span.start_time, span.end_time, dict(span.attributes or {}),
    )


@contextlib.contextmanager
def recording(service: str = "gateway") -> Iterator[InMemorySpanExporter]:
    """This process's spans, recorded in memory (as by `tracing.configure`, exported at once) until the end."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        yield exporter
    finally:
        tracing.install(None)
        provider.shutdown()


def recorded(exporter: InMemorySpanExporter) -> list[Span]:
    return [from_sdk(span) for span in exporter.get_finished_spans()]


class Collector:
    """An OTLP/HTTP (protobuf) receiver on a loopback port: what other processes export, as `Span`s."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(loopback_http.Handler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.body()
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                collector._take(request)
                self.answer(ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")

        self._server, self.url = loopback_http.serve(Handler)

    def env(self, service: str) -> dict[str, str]:
        """The standard variables that make a process export its spans here at once, as `service`."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.url, "OTEL_SERVICE_NAME": service,
            "OTEL_BSP_SCHEDULE_DELAY": "50",  # ms: spans arrive while the test waits, not 5 s later
        }

    def _take(self, request: ExportTraceServiceRequest) -> None:
        kinds = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
        statuses = {0: "UNSET", 1: "OK", 2: "ERROR"}
        taken = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    taken.append(Span(
                        span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex() or None,
                        str(resource.get("service.name")), kinds.get(span.kind, "UNSPECIFIED"), statuses[span.status.code],
                        span.start_time_unix_nano, span.end_time_unix_nano, {a.key: _value(a.value) for a in span.attributes},
                    ))
        with self._lock:
            self.spans += taken

    def wait_for(self, wanted: Any, timeout: float = 60) -> list[Span]:
        """The spans received once `wanted(spans)` holds; fails the test past `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if wanted(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"the collector did not get the spans awaited; it has {[s.name for s in spans]}")
            time.sleep(0.05)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


# -- a trace as a tree ------------------------------------------------------------------------


def named(spans: Iterable[Span], name: str, **attributes: Any) -> list[Span]:
    return [s for s in spans if s.name == name and all(s.attributes.get(k) == v for k, v in attributes.items())]


def one(spans: Iterable[Span], name: str, **attributes: Any) -> Span:
    found = named(spans, name, **attributes)
    assert len(found) == 1, f"{len(found)} spans named {name!r} with {attributes}: {[s.name for s in spans]}"
    return found[0]


def children(spans: Iterable[Span], parent: Span) -> list[Span]:
    return sorted((s for s in spans if s.parent == parent.span_id and s.trace_id == parent.trace_id), key=lambda s: s.start)
