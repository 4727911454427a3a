"""The engine's front door: every front end's requests are checked here once into a typed `Request`, answered from
the result cache or handed to the backend (which admits them into one line with one limit as they arrive and runs
them), counted; and the two views every front end renders."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from prometheus_client import Gauge

from ..config import MAX_BATCH, Settings
from ..errors import AcceldemoError, GenerationFailed, InvalidRequest, UnknownName, describe_error
from ..executors.artifacts import EVENTS, ArtifactStore
from ..executors.remote import NO_TRUST, shown_url
from ..hardware import HardwareRegistry
from ..models.catalog import CATALOG, component_bytes_at, get_model, step_cache_views
from ..models.loading import model_availability
from ..models.loras import model_loras
from ..records import (
    GenerateParams,
    GenerateResult,
    Placement,
    ProgressCallback,
    Quantization,
    Request,
    Shape,
    no_progress,
)
from .compare import Comparison, check_pair, second_side
from .jobs import Backend, Job, never
from .ledger import CompiledShape
from .planning import HostPlan, named_host
from .planning import plan as plan_host
from .results import ResultCache
from .stats import EngineStats, Kind, Outcome, outcome_of
from .validation import (
    check_request,
    check_shape,
    mode_options,
    parse_resolution,
    propose_placement,
    tensor_parallel_options,
)
from .views import (
    Description,
    HardwareView,
    ModelView,
    Offer,
    Snapshot,
    Startup,
    StartupState,
)

log = logging.getLogger("acceldemo.engine")


class Engine:
    """The one way into the engine for every front end: `check` a request once, `submit` it (admitted at once or
    refused with QueueFull), `describe` and `snapshot` for the views. Where requests are admitted and run is its
    backend's business, chosen once by the builder: this host's devices (`LocalBackend`) or a fleet's replicas
    (`FleetBackend`); the engine keeps the front door, the result cache, the start-up warm-up and the counters."""

    def __init__(self, settings: Settings, hardware: HardwareRegistry, backend: Backend, stats: EngineStats,
                 artifacts: ArtifactStore, node: str):
        self.settings, self.hardware, self.backend, self.stats = settings, hardware, backend, stats
        self.artifacts, self.node = artifacts, node
        self.results = ResultCache(settings.result_cache)
        self._startup = Startup()
        self._startup_lock = threading.Lock()
        self._timers: list[threading.Timer] = []
        registry = self.stats.registry
        Gauge("acceldemo_queue_depth", "Requests waiting in line for a device", registry=registry) \
            .set_function(self.queue_depth)
        Gauge("acceldemo_resident_pipelines", "Pipelines resident in memory", registry=registry) \
            .set_function(backend.resident_pipelines)
        Gauge("acceldemo_busy_devices", "Devices running a job", registry=registry) \
            .set_function(backend.busy_devices)
        # Precompiled (AOTInductor) packages built, or loaded from the persistent cache instead, since start.
        packages = Gauge("acceldemo_precompiled_packages", "AOTInductor packages by event since start", ("event",),
                         registry=registry)
        for event in EVENTS:
            packages.labels(event).set_function(lambda event=event: self.artifacts.counts()[event])
        if self.artifacts.remote is not None:
            # 1 while the shared store answers, 0 during an outage (the app compiles locally meanwhile).
            Gauge("acceldemo_artifact_store_up", "Whether the shared artifact store answers (ACCELDEMO_ARTIFACTS)",
                  registry=registry).set_function(lambda: float(self.artifacts.remote.problem is None))
            # Packages the store offered and this host refused, by reason (checksum, incomplete, unsigned,
            # bad_signature, untrusted_key), since start.
            rejections = Gauge("acceldemo_artifact_rejections", "Shared-store packages refused, by reason",
                               ("reason",), registry=registry)
            for reason in self.artifacts.rejections():
                rejections.labels(reason).set_function(lambda reason=reason: self.artifacts.rejections()[reason])
            if self.artifacts.remote.trust is None:
                log.warning("artifact store %s: %s", shown_url(self.artifacts.remote.url), NO_TRUST)
            # Asked once at start, in the background, so an unreachable store shows before the first compile.
            threading.Thread(target=self.artifacts.remote.check, name="artifact-store-check", daemon=True).start()

    # --- the front door --------------------------------------------------------------------------------------------

    def check(self, params: GenerateParams, kind: Kind = Kind.GENERATE) -> Request:
        """The request typed with every default filled in, or the first thing wrong with it (a typed error, counted
        as the request's outcome). Each request is checked exactly once."""
        try:
            return check_request(params, self.settings, self.hardware)
        except AcceldemoError as error:
            self.stats.count(kind, outcome_of(error))
            raise

    def submit(self, request: Request, on_progress: ProgressCallback = no_progress,
               cancelled: Callable[[], bool] = never, client: str = "", visitor_token: str | None = None) -> Job:
        """Admit the request now — onto free replicas, or into the line — or refuse it at once (QueueFull with the
        expected wait; ClientQueueFull past `client`'s share of the line); then it runs in threads of its own. Its
        images (one per seed) are admitted together, all or none, and may run side by side on several replicas, or be
        drawn in one call with each other and with other requests that share the call's settings; the request's
        outcome is counted once, whatever it is. `client`: who sent it (the line takes turns across clients);
        `visitor_token`: the platform's token for the visitor (ZeroGPU's X-IP-Token: their GPU quota is charged)."""
        job = Job(request, cancelled, client, visitor_token)
        started = time.perf_counter()
        if self.results.entries:
            found = self.results.find(request, time.perf_counter() - started)
            if found is not None:
                self.stats.result_hits.inc()
                self.stats.count(Kind.GENERATE, Outcome.OK)
                job.future.set_result(found)
                return job
            job.future.add_done_callback(self._keep_result)
        return self.backend.start(job, on_progress, started)

    def _keep_result(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.results.keep(future.result())

    def generate(self, request: GenerateParams | Request, on_progress: ProgressCallback = no_progress,
                 cancelled: Callable[[], bool] = never) -> GenerateResult:
        """Check (when not yet), submit and wait: for front ends that block anyway (the CLI, the bench, tests)."""
        if isinstance(request, GenerateParams):
            request = self.check(request)
        return self.submit(request, on_progress, cancelled).result()

    def submit_comparison(self, first: GenerateParams, second: GenerateParams,
                          on_progress: ProgressCallback = no_progress) -> Job:
        """One prompt and seed under two configurations (`second` takes the first's prompt, model, seed and size): the
        first drawn, then the second, each on the line like any request and counted as one; the job's result is the
        `Comparison`. Progress events say which side they are of (`A: …`, `B: …`)."""
        a = self.check(first)
        b = self.check(second_side(a, second))
        try:
            check_pair(a, b)
        except AcceldemoError as error:
            self.stats.count(Kind.GENERATE, outcome_of(error))
            raise
        job = Job(a)

        def side(name: str) -> ProgressCallback:
            return lambda event: on_progress(dataclasses.replace(event, message=f"{name}: {event.message}"))

        def run() -> None:
            try:
                results = []
                for name, request in (("A", a), ("B", b)):
                    results.append(self.submit(request, side(name), job.cancelled).result())
                job.future.set_result(Comparison(*results))
            except BaseException as error:
                job.future.set_exception(error if isinstance(error, AcceldemoError) else
                                         GenerationFailed(f"internal error: {describe_error(error)}"))

        threading.Thread(target=run, name="comparison", daemon=True).start()
        return job

    def submit_warm_up(self, params: GenerateParams | Request, shapes: Iterable[object] | None = None,
                       on_progress: ProgressCallback = no_progress, batches: Iterable[int] = (1,)) -> Job:
        """Compile the given shapes (None: the request's own) ahead of requests, at each of the given batch sizes
        (a compiled mode's buckets: calls drawing that many requests together), one denoise step each, on every
        replica (or the request's own device), one replica after the other: the first compiles each shape, the others
        load what it left in the persistent compile caches. The job's result: the shapes' records, replica by
        replica. A checked `Request` (a fleet replica's, as its front door checked it) is warmed as it is."""
        base = params if isinstance(params, Request) else self.check(params, Kind.WARMUP)
        try:
            sizes = sorted({_batch_size(size) for size in batches}) or [1]
            warm = [(base.at(check_shape(get_model(base.model), *_sides(shape)), steps=1), size)
                    for shape in (shapes if shapes is not None else [base.shape]) for size in sizes]
        except AcceldemoError as error:
            self.stats.count(Kind.WARMUP, outcome_of(error))
            raise
        job = Job(base)
        if not warm:
            job.future.set_result([])
            self.stats.count(Kind.WARMUP, Outcome.OK)
            return job
        return self.backend.start_warm_up(job, warm, on_progress)

    def warm_up(self, params: GenerateParams | Request, shapes: Iterable[object] | None = None,
                on_progress: ProgressCallback = no_progress, batches: Iterable[int] = (1,)) -> list[CompiledShape]:
        return self.submit_warm_up(params, shapes, on_progress, batches).result()

    def start_warm_up(self, mode: object, shapes: list[Shape], model: str | None = None,
                      batches: Iterable[int] = (1,), quantization: object = None, step_cache: object = None,
                      lora: object = None) -> None:
        """The start-up warm-up (`--warmup`), in the background; `startup` says how it goes, and turns ready when it
        ends or has run past ACCELDEMO_WARMUP_TIMEOUT_S (it goes on: a compile cannot be interrupted)."""
        with self._startup_lock:
            self._startup = Startup(StartupState.WARMING, f"{', '.join(map(str, shapes))} ({mode})")
        try:
            job = self.submit_warm_up(GenerateParams(prompt="warm-up", model=model, mode=mode,
                                                     quantization=quantization, step_cache=step_cache, lora=lora),
                                      shapes, batches=batches)
        except AcceldemoError as error:
            self._set_startup(Startup(StartupState.FAILED, str(error)))
            return
        job.future.add_done_callback(self._warmed_up)
        limit = self.settings.warmup_timeout_s
        timer = threading.Timer(limit, self._startup_overdue, args=(limit,))
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def _warmed_up(self, future: Future) -> None:
        try:
            records = future.result()
            self._set_startup(Startup(StartupState.DONE, ", ".join(
                f"{r.shape}{f' ×{r.batch}' if r.batch > 1 else ''} {r.state}" for r in records)))
        except Exception as error:  # every failure ends the warm-up, and the app serves anyway
            self._set_startup(Startup(StartupState.FAILED, str(error)))

    def _startup_overdue(self, limit: float) -> None:
        with self._startup_lock:
            if self._startup.state is StartupState.WARMING:
                self._startup = Startup(StartupState.WARMING, self._startup.detail, limit)

    def _set_startup(self, startup: Startup) -> None:
        with self._startup_lock:
            self._startup = startup

    @property
    def startup(self) -> Startup:
        with self._startup_lock:
            return self._startup

    def close(self) -> None:
        """Free every resident pipeline and stop every process the executor started."""
        for timer in self._timers:
            timer.cancel()
        self.backend.close()

    # --- the views --------------------------------------------------------------------------------------------------

    def queue_depth(self) -> int:
        """Requests waiting in line (running ones not counted), from every front end."""
        return self.backend.queue_depth()

    def offer(self, model: object, hardware: object, placement: Placement | None = None) -> Offer:
        """What a model can do on a hardware here: the proposed placement, each mode with why not, the TP sizes."""
        spec, adapter = get_model(model), self.hardware.get(hardware)
        found = adapter.detect()
        if not found.available:
            return Offer(spec.name, adapter.name, False, found.reason, None, (), ())
        proposal = propose_placement(spec, found, adapter.tensor_parallel_sizes(), self.settings.max_batch)
        quantizations = tuple({"name": str(q), "refused": adapter.quantization_refusal(q),
                               "weight_bytes": sum(component_bytes_at(spec, q).values())} for q in Quantization)
        return Offer(spec.name, adapter.name, True, found.reason, proposal,
                     tuple(mode_options(spec, adapter, placement)),
                     tuple(tensor_parallel_options(spec, adapter, self.settings.pool_nnodes)), quantizations)

    def plan(self, model: object, host: object, quantization: object = None) -> HostPlan:
        """What a model would get on a host kind (`trn2.48xlarge`, `v6e-4`, ...), present here or not."""
        try:
            weights = Quantization.NONE if quantization in (None, "") else Quantization(quantization)
        except ValueError:
            raise UnknownName("quantization", quantization, [str(q) for q in Quantization]) from None
        return plan_host(get_model(model), named_host(host), self.settings, weights)

    def describe(self) -> Description:
        """What this host offers: every hardware (absent ones with why), every model with what it can do here."""
        found = self.hardware.detect_all()
        hardware = tuple(HardwareView(hw.name, found[hw.name].available, found[hw.name].reason,
                                      found[hw.name].generation, hw.devices(), hw.modes, hw.compile_backend,
                                      hw.dist_backend) for hw in self.hardware)
        here = [hw.name for hw in hardware if hw.available]
        models = []
        for spec in CATALOG.values():
            available, where = model_availability(spec, self.settings)
            models.append(ModelView(
                spec.name, spec.title, str(spec.family), spec.repo, spec.description, spec.steps, spec.guidance,
                spec.default_shape, spec.presets, spec.only_presets, spec.granularity, spec.example_prompts,
                available, where, spec.name == self.settings.default_model,
                tuple(self.offer(spec.name, name) for name in here),
                tuple(style.describe() for style in model_loras(spec, self.settings).values()), spec.edits,
                spec.inpaints, step_cache_views(spec), spec.cache_advice.describe()))
        return Description(hardware, tuple(models), self.settings.default_model, self.hardware.best_available(),
                           self.settings.pool_nnodes, self.artifacts.report(self.settings.precompile))

    def snapshot(self) -> Snapshot:
        """What runs here now: the start-up warm-up, the line, the counters, devices, replicas, pipelines."""
        running = self.backend.running()
        return Snapshot(self.startup, running.queue_depth, self.settings.queue_size, self.stats.snapshot(),
                        running.devices, running.replicas, running.pipelines,
                        self.artifacts.report(self.settings.precompile), self.artifacts.store_report(),
                        running.downloads)


def _batch_size(size: object) -> int:
    """A warm-up's batch size: a whole number from 1 to ACCELDEMO_MAX_BATCH's ceiling."""
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_BATCH:
        raise InvalidRequest("batch", size, f"a whole number from 1 to {MAX_BATCH}")
    return size


def _sides(shape: object) -> tuple[int, int]:
    """A warm-up shape's width and height: a Shape, or WIDTHxHEIGHT text."""
    parsed = parse_resolution(shape)
    return parsed.width, parsed.height
