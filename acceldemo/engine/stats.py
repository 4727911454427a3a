"""What the engine counts for every request, whichever front end sent it: Prometheus metrics in one registry, which
/metrics serves as they are and /status and the page read back."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Histogram

from ..errors import (
    Cancelled,
    CapacityExceeded,
    HardwareUnavailable,
    InvalidRequest,
    ModelUnavailable,
    UnsupportedCombination,
)
from ..records import GenerateResult


class Outcome(StrEnum):
    """How a request ended: done (ok), the person's to fix (invalid), the operator's limits (refused), stopped
    (cancelled), or the engine's fault (failed)."""

    OK = "ok"
    INVALID = "invalid"
    REFUSED = "refused"
    CANCELLED = "cancelled"
    FAILED = "failed"


class Kind(StrEnum):
    """What a request asked for."""

    GENERATE = "generate"
    WARMUP = "warmup"


OUTCOMES = tuple(Outcome)
# The parts of a request's time the latency histogram has, `total` first.
PHASES = ("total", "queue", "load", "compile")
BATCH_BUCKETS = (1, 2, 3, 4, 8, 16)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
_LABELS = ("model", "hardware", "mode")


def outcome_of(error: BaseException) -> Outcome:
    """The outcome of a request that ended in `error`."""
    if isinstance(error, Cancelled):
        return Outcome.CANCELLED
    if isinstance(error, CapacityExceeded):
        return Outcome.REFUSED
    if isinstance(error, (InvalidRequest, UnsupportedCombination, HardwareUnavailable, ModelUnavailable)):
        return Outcome.INVALID
    return Outcome.FAILED


@dataclass(frozen=True)
class Counters:
    """The engine's counts since start, as plain numbers."""

    requests: dict[Outcome, int]
    warmups: dict[Outcome, int]
    graphs: int
    compile_seconds: float
    shape_hits: int
    compile_cache_hits: int
    loads: int
    evictions: int
    replica_restarts: int
    # Pipeline calls, and the requests they drew (more requests than calls: some were drawn together).
    calls: int = 0
    drawn: int = 0
    # Per step cache that ran ("none" too): transformer calls, and those the cache answered.
    step_caches: dict[str, dict[str, int]] | None = None
    # Requests answered from the exact-result cache (ACCELDEMO_RESULT_CACHE).
    result_cache_hits: int = 0


class EngineStats:
    """Counters and histograms of one engine (one registry each, so several can live in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("acceldemo_requests", "Requests by outcome and kind (generate, warmup)",
                                ("outcome", "kind"), registry=self.registry)
        self.latency = Histogram("acceldemo_phase_seconds", "Seconds per request phase", ("phase", *_LABELS),
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.graphs = Counter("acceldemo_compiled_graphs", "Graphs compiled by dynamo (and packages built)", _LABELS,
                              registry=self.registry)
        self.compile_seconds = Counter("acceldemo_compile_seconds", "Seconds spent compiling", _LABELS,
                                       registry=self.registry)
        self.shape_hits = Counter("acceldemo_shape_cache_hits", "Requests at an already compiled shape", _LABELS,
                                  registry=self.registry)
        self.compile_cache_hits = Counter("acceldemo_compile_cache_hits",
                                          "Persistent compile artifacts reused (inductor caches, packages)", _LABELS,
                                          registry=self.registry)
        self.loads = Counter("acceldemo_pipeline_loads", "Pipelines loaded", registry=self.registry)
        self.evictions = Counter("acceldemo_pipeline_evictions", "Resident pipelines evicted", registry=self.registry)
        self.restarts = Counter("acceldemo_replica_restarts", "Replicas lost (process died or hung) and restarted",
                                registry=self.registry)
        self.transformer_calls = Counter("acceldemo_transformer_calls",
                                         "Transformer calls by step cache, computed or answered by the cache "
                                         "(skipped)", ("model", "cache", "answer"), registry=self.registry)
        self.result_hits = Counter("acceldemo_result_cache_hits", "Requests answered from the exact-result cache",
                                   registry=self.registry)
        # Counted by the server's doors (a key's name, `visitor` or `unauthenticated`: never the key itself).
        self.clients = Counter("acceldemo_client_requests", "Requests at each door by client, admitted or refused by "
                               "the keys", ("door", "client", "outcome"), registry=self.registry)
        self.batches = Histogram("acceldemo_batch_requests", "Requests drawn together in one pipeline call", _LABELS,
                                 buckets=BATCH_BUCKETS, registry=self.registry)
        for outcome in Outcome:  # every outcome shows from the start, at 0
            for kind in Kind:
                self.requests.labels(outcome, kind)

    def count(self, kind: Kind, outcome: Outcome) -> None:
        self.requests.labels(outcome, kind).inc()

    def observe(self, result: GenerateResult, count_call: bool = True) -> None:
        """A finished image's phases (a warm-up's too); with `count_call`, also its pipeline call's compile facts and
        batch — once per call, for the first of the requests drawn in it."""
        labels = (result.key.model, result.key.hardware, result.key.mode)
        for phase, seconds in zip(PHASES, (result.seconds, result.queue_wait, result.load_seconds,
                                           result.compile_seconds)):
            self.latency.labels(phase, *labels).observe(seconds)
        if result.warm:
            self.shape_hits.labels(*labels).inc()
        if count_call:
            self.graphs.labels(*labels).inc(result.new_graphs)
            self.compile_seconds.labels(*labels).inc(result.compile_seconds)
            self.compile_cache_hits.labels(*labels).inc(result.compile_cache_hits)
            self.batches.labels(*labels).observe(result.batch)
            if result.cache is not None:
                cache = result.cache.name or "none"
                self.transformer_calls.labels(result.key.model, cache, "computed").inc(
                    result.cache.calls - result.cache.skipped)
                self.transformer_calls.labels(result.key.model, cache, "skipped").inc(result.cache.skipped)

    def step_caches(self) -> dict[str, dict[str, int]]:
        """Per step cache: transformer calls, and those it answered."""
        found: dict[str, dict[str, int]] = {}
        for metric in self.registry.collect():
            if metric.name != "acceldemo_transformer_calls":
                continue
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    entry = found.setdefault(sample.labels["cache"], {"calls": 0, "skipped": 0})
                    entry["calls"] += int(sample.value)
                    if sample.labels["answer"] == "skipped":
                        entry["skipped"] += int(sample.value)
        return found

    def _total(self, counter: str) -> float:
        return self._sum(counter, "_total")

    def _sum(self, metric_name: str, suffix: str) -> float:
        return sum(sample.value for metric in self.registry.collect() if metric.name == metric_name
                   for sample in metric.samples if sample.name.endswith(suffix))

    def outcomes(self, kind: Kind = Kind.GENERATE) -> dict[Outcome, int]:
        return {outcome: int(self.registry.get_sample_value("acceldemo_requests_total",
                                                            {"outcome": outcome, "kind": kind}) or 0)
                for outcome in Outcome}

    def snapshot(self) -> Counters:
        """The counters as plain numbers, for /status and the page."""
        return Counters(requests=self.outcomes(Kind.GENERATE), warmups=self.outcomes(Kind.WARMUP),
                        graphs=int(self._total("acceldemo_compiled_graphs")),
                        compile_seconds=round(self._total("acceldemo_compile_seconds"), 3),
                        shape_hits=int(self._total("acceldemo_shape_cache_hits")),
                        compile_cache_hits=int(self._total("acceldemo_compile_cache_hits")),
                        loads=int(self._total("acceldemo_pipeline_loads")),
                        evictions=int(self._total("acceldemo_pipeline_evictions")),
                        replica_restarts=int(self._total("acceldemo_replica_restarts")),
                        calls=int(self._sum("acceldemo_batch_requests", "_count")),
                        drawn=int(self._sum("acceldemo_batch_requests", "_sum")),
                        step_caches=self.step_caches(),
                        result_cache_hits=int(self._total("acceldemo_result_cache_hits")))
