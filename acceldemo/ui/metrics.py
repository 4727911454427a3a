"""Prometheus metrics of the serving process, fed from results and read from the manager."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..engine import SessionManager
from ..records import GenerateResult

LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """One registry per server, so tests can run several servers in one process."""

    def __init__(self, manager: SessionManager):
        self.registry = CollectorRegistry()
        labels = ("model", "hardware", "mode")
        self.requests = Counter("acceldemo_requests", "Generate requests by outcome", ("outcome",),
                                registry=self.registry)
        self.latency = Histogram("acceldemo_phase_seconds", "Seconds per request phase", ("phase",) + labels,
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.graphs = Counter("acceldemo_compiled_graphs", "Graphs compiled by dynamo", labels,
                              registry=self.registry)
        self.compile_seconds = Counter("acceldemo_compile_seconds", "Seconds spent compiling", labels,
                                       registry=self.registry)
        self.shape_hits = Counter("acceldemo_shape_cache_hits", "Requests at an already compiled shape", labels,
                                  registry=self.registry)
        Gauge("acceldemo_queue_depth", "Jobs waiting for a device", registry=self.registry) \
            .set_function(manager.queue_depth)
        Gauge("acceldemo_resident_pipelines", "Pipelines resident in memory", registry=self.registry) \
            .set_function(lambda: sum(p.resident for p in manager.status()))
        # Precompiled (AOTInductor) packages this process built or loaded from the persistent cache instead.
        packages = Gauge("acceldemo_precompiled_packages", "AOTInductor packages by event since start", ("event",),
                         registry=self.registry)
        for event in ("built", "loaded", "rejected"):
            packages.labels(event).set_function(lambda event=event: manager.package_events()[event])

    def observe(self, result: GenerateResult) -> None:
        k = result.key
        labels = (k.model, k.hardware, k.mode)
        self.requests.labels("ok").inc()
        for phase, seconds in (("total", result.seconds), ("queue", result.queue_wait),
                               ("load", result.load_seconds), ("compile", result.compile_seconds)):
            self.latency.labels(phase, *labels).observe(seconds)
        self.graphs.labels(*labels).inc(result.new_graphs)
        self.compile_seconds.labels(*labels).inc(result.compile_seconds)
        if result.warm:
            self.shape_hits.labels(*labels).inc()
