"""Prometheus metrics for `GET /metrics`, in a registry that belongs to one app.

Shaped this way for three reasons:

- Each app (gateway or executor) gets its own `CollectorRegistry`, never the
  global one: tests start many apps in one process, and each must count only
  its own jobs.
- What the backend already knows is read when Prometheus scrapes, not kept a
  second time: queue depth, jobs running, readiness, each executor's health,
  and the batch sizes the workers count in `Worker.batch_sizes` (one
  observation per batched forward step; a continuous `generate` batch makes one
  per token). Nothing in the backends has to call in, and nothing can drift.
- What only happens in passing is counted where it happens, through hooks kept
  small: a job's end (`Job.when_ended`, added to by `track`: outcome, queue wait and run
  time, all observed then so that a job counts once in each, with the same
  labels), a client's stream (`stream_opened`/`stream_closed`, `sent`), and a
  client cut for being too slow (`client_timeout`: gateway/plumbing/slowclients.py for
  headers and unread bodies, `read_body` for bodies, the stream for writes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import msgspec
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString
from starlette.requests import Request
from starlette.responses import Response

from gateway.jobs import Job
from gateway.protocol import Code, Event, EventType

# Seconds: from a few milliseconds (a predict) to minutes (a long generate).
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
RUN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Where a slow client was cut: its request headers, its request body, or a write to it.
TIMEOUT_PHASES = ("headers", "body", "write")


class Metrics:
    """One app's metrics: counters and histograms fed by hooks, gauges read from `backend`."""

    def __init__(self, backend: Any) -> None:
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        self.jobs = Counter(
            "streamgate_jobs",
            "Jobs that ended, by tool, model and outcome (succeeded, failed, cancelled) and error code",
            ["tool", "model", "outcome", "code"],
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "streamgate_job_queue_wait_seconds",
            "Seconds from a job's creation to its start, observed when it ends",
            ["tool", "model"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.run_time = Histogram(
            "streamgate_job_run_seconds",
            "Seconds from a job's start to its end",
            ["tool", "model"],
            buckets=RUN_BUCKETS,
            registry=self.registry,
        )
        self.streams = Gauge("streamgate_active_streams", "Event streams open to clients", registry=self.registry)
        self.events = Counter(
            "streamgate_events_sent", "Events written to clients' streams, by event type", ["event"], registry=self.registry
        )
        # Looked up once: `labels()` takes a lock and builds a key, for every event of every stream.
        self._event_children = {kind: self.events.labels(kind.value) for kind in EventType}
        self._children: dict[tuple[Any, ...], Any] = {}
        self.client_timeouts = Counter(
            "streamgate_client_timeouts",
            "Clients cut for being too slow: sending their headers or body, or reading a stream (phase)",
            ["phase"],
            registry=self.registry,
        )
        for phase in TIMEOUT_PHASES:  # each at 0 from the start, so that a rate over it is defined
            self.client_timeouts.labels(phase)
        self.registry.register(_BackendState(backend))

    def results(self, facts: Callable[[], Mapping[str, int]]) -> None:
        """Gauges of where finished results are kept (`MemoryStore.results_kept`), read at each scrape."""
        self.registry.register(_ResultsState(facts))

    def usage(self, counted: Callable[[], Iterable[tuple[tuple[str, str, str], Any]]]) -> None:
        """Counters of what jobs used, by tenant, class and model (gateway/server/metering.py), read at each scrape."""
        self.registry.register(_UsageCounters(counted))

    # -- hooks ---------------------------------------------------------------------

    def track(self, job: Job) -> None:
        """Count `job`'s outcome and times when it ends."""
        job.when_ended(self._ended)

    def _ended(self, job: Job) -> None:
        terminal = job.terminal
        assert terminal is not None
        if terminal.type is EventType.DATA:
            outcome, code = "succeeded", ""
        else:
            code = _error_code(terminal.data)
            outcome = "cancelled" if code == Code.CANCELLED.value else "failed"
        model = job.model or ""
        self._child(self.jobs, job.tool, model, outcome, code).inc()
        if job.started is not None:
            self._child(self.queue_wait, job.tool, model).observe(max(0.0, job.started - job.created))
            self._child(self.run_time, job.tool, model).observe(max(0.0, (job.finished or job.started) - job.started))

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once: `labels()` takes a lock and builds a key, for every job.
        As many as the label sets there are (tools, models, outcomes, codes: all finite)."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def stream_opened(self) -> None:
        self.streams.inc()

    def stream_closed(self) -> None:
        self.streams.dec()

    def sent(self, events: Iterable[Event]) -> None:
        counts: dict[EventType, int] = {}
        for event in events:
            counts[event.type] = counts.get(event.type, 0) + 1
        for kind, count in counts.items():  # a lock taken per kind, not per event
            self._event_children[kind].inc(count)

    def client_timeout(self, phase: str) -> None:
        """Count a client cut for slowness in `phase`, one of TIMEOUT_PHASES."""
        self.client_timeouts.labels(phase).inc()

    # -- exposition ----------------------------------------------------------------

    async def endpoint(self, request: Request) -> Response:
        """`GET /metrics`: the Prometheus text format. On the event loop, so reads are consistent."""
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _Code(msgspec.Struct):
    code: str


class _ErrorEvent(msgspec.Struct):
    error: _Code


def _error_code(data: bytes) -> str:
    # Never raise here: the job's other end-of-job callbacks (rate-limit slots) run after this one.
    try:
        return msgspec.json.decode(data, type=_ErrorEvent).error.code
    except msgspec.MsgspecError:
        return "unknown"


class _ResultsState:
    """Where finished results are kept: bytes in memory and in the spool, its disk, promises and budget."""

    HELP = {
        "memory_bytes": "Bytes of finished jobs' events held in memory (--result-memory-bytes bounds them)",
        "bytes": "Bytes of results kept in the result spool on disk",
        "results": "Results kept in the result spool on disk",
        "files_bytes": "Bytes of jobs' result files kept (a per-position result written as files)",
        "disk_bytes": "Bytes the result spool's files take on disk",
        "promised_bytes": "Bytes of priced results promised to jobs admitted and not ended",
        "budget_bytes": "Most bytes the result spool keeps (--result-store-bytes)",
    }
    NAMES = {"memory_bytes": "streamgate_results_memory_bytes", "bytes": "streamgate_result_spool_bytes",
             "results": "streamgate_result_spool_results", "disk_bytes": "streamgate_result_spool_disk_bytes",
             "promised_bytes": "streamgate_result_spool_promised_bytes", "budget_bytes": "streamgate_result_spool_budget_bytes",
             "files_bytes": "streamgate_result_files_bytes"}

    def __init__(self, facts: Callable[[], Mapping[str, int]]) -> None:
        self.facts = facts

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for key, value in self.facts().items():
            if key in self.NAMES:
                yield GaugeMetricFamily(self.NAMES[key], self.HELP[key], value=value)


class _UsageCounters:
    """What this process's ended jobs used, by tenant, class and model (as many rows as the meter keeps)."""

    MEASURES = (
        ("jobs", "streamgate_usage_jobs", "Jobs that ended"),
        ("tokens_in", "streamgate_usage_tokens_in", "Tokens the jobs read"),
        ("tokens_out", "streamgate_usage_tokens_out", "Tokens the jobs wrote"),
        ("device_s", "streamgate_usage_device_seconds", "Device-seconds the jobs took"),
        ("result_bytes", "streamgate_usage_result_bytes", "Bytes of the jobs' results"),
    )

    def __init__(self, counted: Callable[[], Iterable[tuple[tuple[str, str, str], Any]]]) -> None:
        self.counted = counted

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        families = [(field, CounterMetricFamily(name, help, labels=["tenant", "class", "model"])) for field, name, help in self.MEASURES]
        for labels, usage in self.counted():
            for field, family in families:
                family.add_metric(list(labels), getattr(usage, field))
        for _, family in families:
            yield family


class _BackendState:
    """Gauges and the batch-size histogram, read from the backend at each scrape."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration: the names are this module's own

    def collect(self) -> Iterator[Metric]:
        backend = self.backend
        yield GaugeMetricFamily(
            "streamgate_model_ready",
            "1 when jobs can start (the model is loaded, or an executor is ready), else 0",
            value=1 if backend.ready else 0,
        )
        facts = backend.describe()
        if "queued" in facts:  # the models are in this process: their queues are known
            queued = GaugeMetricFamily("streamgate_queue_depth", "Jobs waiting for a worker", labels=["model"])
            running = GaugeMetricFamily("streamgate_jobs_running", "Jobs running, batched ones each counted", labels=["model"])
            for model in backend.models():
                queued.add_metric([model.name], model.queued)
                running.add_metric([model.name], model.running)
            yield queued
            yield running
        if "executors" in facts:
            up = GaugeMetricFamily("streamgate_executor_up", "1 when the executor is ready (socket up, /readyz 200), else 0", labels=["executor"])
            jobs = GaugeMetricFamily("streamgate_executor_jobs", "This gateway's jobs in flight on the executor", labels=["executor"])
            for executor in facts["executors"]:
                up.add_metric([executor["url"]], 1 if executor["ready"] else 0)
                jobs.add_metric([executor["url"]], executor["jobs"])
            yield up
            yield jobs
        if "engines" in facts:  # models in engine processes (backends/engines.py)
            families = {
                "up": GaugeMetricFamily("streamgate_engine_up", "1 when the engine process of the model's copy on the device is ready, else 0", labels=["model", "device", "copy"]),
                "restarts": CounterMetricFamily("streamgate_engine_restarts", "Times the engine process of the model's copy on the device ended and was started again", labels=["model", "device", "copy"]),
                "jobs": GaugeMetricFamily("streamgate_engine_jobs", "Jobs queued or running in the engine", labels=["model", "device", "copy"]),
                "waiting": GaugeMetricFamily("streamgate_engine_waiting", "Jobs of a lost engine waiting in the gateway for the next one", labels=["model", "device", "copy"]),
                "queued": GaugeMetricFamily("streamgate_engine_queue_depth", "Jobs waiting in the engine's queue, as it last said", labels=["model", "device", "copy"]),
                "batches": CounterMetricFamily("streamgate_engine_batches", "Batched steps the engine has run, as it last said", labels=["model", "device", "copy"]),
                "rss": GaugeMetricFamily("streamgate_engine_resident_memory_bytes", "The engine process's resident memory", labels=["model", "device", "copy"]),
            }
            for engine in facts["engines"]:
                labels = [engine["model"], engine["device"], str(engine["copy"])]
                families["up"].add_metric(labels, 1 if engine["state"] == "ready" else 0)
                families["restarts"].add_metric(labels, engine["restarts"])
                families["jobs"].add_metric(labels, engine["jobs"])
                families["waiting"].add_metric(labels, engine["waiting"])
                families["queued"].add_metric(labels, engine["queued"])
                families["batches"].add_metric(labels, engine["batches"])
                if engine["rss_bytes"] is not None:
                    families["rss"].add_metric(labels, engine["rss_bytes"])
            yield from families.values()
        if "replica_load" in facts:
            jobs = GaugeMetricFamily("streamgate_replica_jobs", "Jobs queued or running on each Ray Serve replica", labels=["replica"])
            queued = GaugeMetricFamily("streamgate_replica_queue_depth", "Jobs waiting on each Ray Serve replica", labels=["replica"])
            for load in facts["replica_load"]:
                jobs.add_metric([load["replica"]], load["jobs"])
                queued.add_metric([load["replica"]], load["queued"])
            yield jobs
            yield queued
        counts = backend.batch_size_counts()
        if counts is not None:
            yield _batch_sizes(counts)


def _batch_sizes(counts: list[Any]) -> HistogramMetricFamily:
    """The workers' counts of batch sizes as one cumulative histogram."""
    sizes: dict[int, int] = {}
    for count in counts:
        for size, n in list(count.items()):
            sizes[size] = sizes.get(size, 0) + n
    buckets = [(floatToGoString(bound), float(sum(n for size, n in sizes.items() if size <= bound))) for bound in BATCH_BUCKETS]
    buckets.append(("+Inf", float(sum(sizes.values()))))
    return HistogramMetricFamily(
        "streamgate_batch_size",
        "Jobs in each batched forward step of a worker",
        buckets=buckets,
        sum_value=float(sum(size * n for size, n in sizes.items())),
    )
