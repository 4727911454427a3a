"""The engine's front door: every front end's requests are checked here once into a typed `Request`, admitted into
one line with one limit as they arrive, run on a replica — drawn in one pipeline call with the requests waiting for
it that can share the call —, counted; and the two views every front end renders."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Protocol

from prometheus_client import Gauge

from ..config import MAX_BATCH, Settings
from ..errors import AcceldemoError, Cancelled, GenerationFailed, InvalidRequest, QueueFull, describe_error
from ..executors.artifacts import EVENTS, ArtifactStore
from ..executors.base import Executor
from ..hardware import HardwareRegistry
from ..models.catalog import CATALOG, component_bytes_at, get_model, step_cache_views
from ..models.download import Downloads
from ..models.loading import model_availability
from ..models.loras import model_loras
from ..records import (
    Batch,
    DeviceSet,
    GenerateParams,
    GenerateResult,
    Phase,
    Placement,
    Progress,
    ProgressCallback,
    Quantization,
    ReplicaState,
    Request,
    Shape,
    no_progress,
)
from .admission import Line, Sharing, Ticket
from .batching import BatchPolicy, Member, together
from .compare import Comparison, check_pair, second_side
from .compile_times import CompileClock, CompileTimes, compile_kind
from .ledger import CompiledShape, ShapeLedger
from .planning import HostPlan, named_host
from .planning import plan as plan_host
from .residency import Residency
from .results import ResultCache
from .stats import EngineStats, Kind, Outcome, outcome_of
from .supervision import Replica, Supervisor
from .validation import (
    check_request,
    check_shape,
    local_devices,
    mode_options,
    parse_resolution,
    propose_placement,
    tensor_parallel_options,
)
from .views import (
    Description,
    DeviceView,
    HardwareView,
    ModelView,
    Offer,
    PipelineView,
    ReplicaView,
    Snapshot,
    Startup,
    StartupState,
)

log = logging.getLogger("acceldemo.engine")


def _never() -> bool:
    return False


class Job:
    """One admitted request, running in a thread of its own: `future` gets its result (or its error); `cancel()`
    stops it at its next denoise step, or takes it out of the line."""

    def __init__(self, request: Request, cancelled: Callable[[], bool] = _never):
        self.request = request
        self.future: Future = Future()
        self._stop = threading.Event()
        self._asked = cancelled

    def cancel(self) -> None:
        self._stop.set()

    def cancelled(self) -> bool:
        return self._stop.is_set() or self._asked()

    def result(self, timeout: float | None = None):
        return self.future.result(timeout)


class Fleet(Protocol):
    """Replicas on other hosts (a Ray Serve deployment): where an engine with a fleet runs its requests instead of
    its own devices. Its own placement and routing decide which replica draws an image."""

    def capacity(self, hardware: str) -> int:
        """Replicas of `hardware` the fleet may run at once (its autoscaling maximum): requests beyond them wait."""

    def run(self, request: Request, on_progress: ProgressCallback, cancelled: Callable[[], bool]) -> GenerateResult:
        """One image drawn by a replica (retried once elsewhere when its replica is lost), or its typed error."""

    def warm_up(self, request: Request, shapes: list[Request]) -> list[CompiledShape]:
        """The shapes compiled by one replica (the others find them in the shared artifact store)."""

    def replicas(self) -> list[ReplicaView]:
        """Every node's replicas as the fleet last saw them."""

    def close(self) -> None: ...


class Engine:
    """The one way into the engine for every front end: `check` a request once, `submit` it (admitted at once or
    refused with QueueFull), `describe` and `snapshot` for the views. Where a pipeline lives (this process, a worker
    pool) is the executor's business, chosen outside the engine; with a `fleet`, replicas on other hosts run the
    requests, and the engine keeps only the front door, the line's limit and the counters."""

    def __init__(self, settings: Settings, hardware: HardwareRegistry, executor: Executor, node: str | None = None,
                 fleet: Fleet | None = None):
        self.settings, self.hardware, self.executor = settings, hardware, executor
        self.node = node or socket.gethostname()
        self.fleet = fleet
        # Images sent to the fleet and not yet answered, by hardware (a fleet's line is Ray Serve's queue).
        self._in_fleet: dict[str, int] = {}
        self._fleet_latency: dict[tuple[str, Shape], float] = {}
        self._fleet_lock = threading.Lock()
        self.stats = EngineStats()
        self.line = Line(settings.queue_size, settings.device_wait_s)
        self.artifacts = ArtifactStore.of(settings)
        self.ledger = ShapeLedger(settings.max_shapes_per_pipeline)
        self.compile_times = CompileTimes(settings.cache_dir)
        self.batching = BatchPolicy(settings, hardware, self.ledger)
        self.results = ResultCache(settings.result_cache)
        self.downloads = Downloads(settings)
        self._calls = itertools.count(1)
        self.residency = Residency(executor, settings.max_resident_pipelines, self.stats)
        self.supervisor = Supervisor(self.line, self.residency, self.stats)
        self._startup = Startup()
        self._startup_lock = threading.Lock()
        self._timers: list[threading.Timer] = []
        registry = self.stats.registry
        Gauge("acceldemo_queue_depth", "Requests waiting in line for a device", registry=registry) \
            .set_function(self.queue_depth)
        Gauge("acceldemo_resident_pipelines", "Pipelines resident in memory", registry=registry) \
            .set_function(lambda: len(self.residency.resident_keys()))
        Gauge("acceldemo_busy_devices", "Devices running a job", registry=registry) \
            .set_function(lambda: len(self.line.running()))
        # Precompiled (AOTInductor) packages built, or loaded from the persistent cache instead, since start.
        packages = Gauge("acceldemo_precompiled_packages", "AOTInductor packages by event since start", ("event",),
                         registry=registry)
        for event in EVENTS:
            packages.labels(event).set_function(lambda event=event: self.artifacts.counts()[event])
        if self.artifacts.remote is not None:
            # 1 while the shared store answers, 0 during an outage (the app compiles locally meanwhile).
            Gauge("acceldemo_artifact_store_up", "Whether the shared artifact store answers (ACCELDEMO_ARTIFACTS)",
                  registry=registry).set_function(lambda: float(self.artifacts.remote.problem is None))
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
               cancelled: Callable[[], bool] = _never) -> Job:
        """Admit the request now — onto free replicas, or into the line — or refuse it at once (QueueFull with the
        expected wait); then it runs in threads of its own. Its images (one per seed) are admitted together, all or
        none, and may run side by side on several replicas, or be drawn in one call with each other and with other
        requests that share the call's settings; the request's outcome is counted once, whatever it is."""
        job = Job(request, cancelled)
        started = time.perf_counter()
        if self.results.entries:
            found = self.results.find(request, time.perf_counter() - started)
            if found is not None:
                self.stats.result_hits.inc()
                self.stats.count(Kind.GENERATE, Outcome.OK)
                job.future.set_result(found)
                return job
            job.future.add_done_callback(self._keep_result)
        if self.fleet is not None:
            return self._start_in_fleet(job, request, on_progress)
        candidates = self._candidates(request)
        members = [Member(part, _of_image(i, on_progress), job.cancelled, started)
                   for i, part in enumerate(request.members())]

        def image(ticket: Ticket, started: float) -> GenerateResult:
            return self.supervisor.attempt(ticket, candidates, started, on_progress, job.cancelled,
                                           lambda ticket, started, queue_wait: self._draw(ticket))

        return self._start(job, Kind.GENERATE, f"{request.shape} · {request.model} · {request.mode}", candidates,
                           [image] * len(members), lambda parts: GenerateResult.of_images(request, parts),
                           self.batching.sharing(request), members, started)

    def _keep_result(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.results.keep(future.result())

    def generate(self, request: GenerateParams | Request, on_progress: ProgressCallback = no_progress,
                 cancelled: Callable[[], bool] = _never) -> GenerateResult:
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
            candidates = self.supervisor.usable(self._candidates(base)) if self.fleet is None else []
        except AcceldemoError as error:
            self.stats.count(Kind.WARMUP, outcome_of(error))
            raise
        job = Job(base)
        if self.fleet is not None and warm:
            fleet = self.fleet
            shapes_once = list(dict.fromkeys(one for one, _ in warm))
            return self._start_in_fleet(job, base, on_progress, Kind.WARMUP,
                                        [lambda: fleet.warm_up(base, shapes_once)], lambda parts: parts[0])
        what = f"warm-up of {', '.join(_label(one, size) for one, size in warm)} · {base.model} · {base.mode}"

        def warm_replica(ticket: Ticket, started: float, queue_wait: float) -> list[CompiledShape]:
            records, devices = [], ticket.granted
            for i, (one, size) in enumerate(warm, 1):
                on_progress(Progress(Phase.COMPILE, f"warming {_label(one, size)} on {devices} ({i}/{len(warm)})", i,
                                     len(warm)))
                outcome = self._run(devices, [Member(one, on_progress, _never, started)], True, size)[0]
                if isinstance(outcome, BaseException):
                    raise outcome
                records.append(self.ledger.record(outcome.key, one.shape, size))
            return records

        def every_replica(ticket: Ticket, started: float) -> list[CompiledShape]:
            records = self.supervisor.attempt(ticket, candidates[:1], started, on_progress, _never, warm_replica)
            for replica in candidates[1:]:
                later = self.line.enter(what, [replica], self._preference(base), admitted=True)
                records += self.supervisor.attempt(later, [replica], time.perf_counter(), on_progress, _never,
                                                   warm_replica)
            return records

        if not warm:
            job.future.set_result([])
            self.stats.count(Kind.WARMUP, Outcome.OK)
            return job
        return self._start(job, Kind.WARMUP, what, candidates[:1], [every_replica], lambda parts: parts[0])

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

    def evict(self, key, why: str = "asked") -> None:
        self.residency.evict(key, why)

    def close(self) -> None:
        """Free every resident pipeline and stop every process the executor started."""
        for timer in self._timers:
            timer.cancel()
        self.residency.close()
        self.executor.close()
        if self.fleet is not None:
            self.fleet.close()

    # --- admission ------------------------------------------------------------------------------------------------

    def _start(self, job: Job, kind: Kind, what: str, candidates: list[DeviceSet],
               bodies: list[Callable[[Ticket, float], object]], combine: Callable[[list], object],
               sharing: Sharing | None = None, members: list[Member] | None = None,
               started: float | None = None) -> Job:
        """Enter the line now with one ticket per body, all or none (counting a refusal) — with `sharing`, each
        ticket carrying its member, to be drawn in one call with others —; then run each `body(ticket, started)` in a
        thread of its own, set the job's result (`combine` of theirs, in order) or its first failure (the others are
        stopped), and count its outcome once."""
        started = time.perf_counter() if started is None else started
        try:
            tickets = self.line.enter_together(what, self.supervisor.usable(candidates), len(bodies),
                                               self._preference(job.request), sharing=sharing, payloads=members)
        except QueueFull as full:
            self.stats.count(kind, Outcome.REFUSED)
            raise QueueFull(full.waiting, full.limit, full.ahead,
                            self._retry_after(job.request, full.ahead, candidates)) from None
        except AcceldemoError as error:
            self.stats.count(kind, outcome_of(error))
            raise
        results: list = [None] * len(bodies)
        failures: list[BaseException] = []
        left = [len(bodies)]
        lock = threading.Lock()

        def finish() -> None:
            if failures:
                error = next((f for f in failures if not isinstance(f, Cancelled)), failures[0])
                self.stats.count(kind, outcome_of(error))
                job.future.set_exception(error)
            else:
                try:
                    job.future.set_result(combine(results))
                    self.stats.count(kind, Outcome.OK)
                except BaseException as error:  # a bug must reach the person as a message, never hang a front end
                    log.exception("%s failed", kind)
                    self.stats.count(kind, Outcome.FAILED)
                    job.future.set_exception(GenerationFailed(f"internal error: {describe_error(error)}"))

        def run(i: int, body: Callable[[Ticket, float], object], ticket: Ticket) -> None:
            try:
                results[i] = body(ticket, started)
            except BaseException as error:
                if not isinstance(error, AcceldemoError):
                    log.exception("%s failed", kind)
                    error = GenerationFailed(f"internal error: {describe_error(error)}")
                with lock:
                    failures.append(error)
                job.cancel()  # the request has failed: its other images stop at their next step, or leave the line
            finally:
                self.line.release(ticket)  # a no-op after attempt() released it; frees it if the body never started
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    finish()

        for i, (body, ticket) in enumerate(zip(bodies, tickets)):
            threading.Thread(target=run, args=(i, body, ticket), name=f"{kind}-{ticket.number}", daemon=True).start()
        return job

    def _start_in_fleet(self, job: Job, request: Request, on_progress: ProgressCallback, kind: Kind = Kind.GENERATE,
                        bodies: list[Callable[[], object]] | None = None,
                        combine: Callable[[list], object] | None = None) -> Job:
        """Admit a request into the fleet's line — refused with QueueFull once the fleet's replicas are all taken and
        ACCELDEMO_QUEUE_SIZE images wait — then run each image on the fleet in a thread of its own, count once."""
        fleet = self.fleet
        assert fleet is not None
        if request.devices is not None:
            self.stats.count(kind, Outcome.INVALID)
            raise InvalidRequest("device", str(request.devices), "none: on a Ray fleet, Ray Serve places the replicas")
        if bodies is None:
            bodies = [lambda i=i, member=member: fleet.run(member, _of_image(i, on_progress), job.cancelled)
                      for i, member in enumerate(request.members())]
            combine = lambda parts: GenerateResult.of_images(request, parts)  # noqa: E731
        capacity = fleet.capacity(request.hardware)
        with self._fleet_lock:
            in_flight = self._in_fleet.get(request.hardware, 0)
            if in_flight + len(bodies) > capacity + self.settings.queue_size:
                waiting = max(0, in_flight - capacity)
                self.stats.count(kind, Outcome.REFUSED)
                latency = self._fleet_latency.get((request.model, request.shape)) or 1.0
                raise QueueFull(waiting, self.settings.queue_size, waiting,
                                max(1, math.ceil((waiting + 1) * latency / max(capacity, 1))))
            self._in_fleet[request.hardware] = in_flight + len(bodies)
        results: list = [None] * len(bodies)
        failures: list[BaseException] = []
        left = [len(bodies)]
        lock = threading.Lock()

        def run(i: int, body: Callable[[], object]) -> None:
            try:
                results[i] = part = body()
                if isinstance(part, GenerateResult):
                    self.stats.observe(part)
                    with self._fleet_lock:
                        self._fleet_latency[(part.request.model, part.request.shape)] = \
                            part.seconds - part.queue_wait - part.load_seconds
            except BaseException as error:
                if not isinstance(error, AcceldemoError):
                    log.exception("%s failed on the fleet", kind)
                    error = GenerationFailed(f"internal error: {describe_error(error)}")
                with lock:
                    failures.append(error)
                job.cancel()
            finally:
                with self._fleet_lock:
                    self._in_fleet[request.hardware] -= 1
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    if failures:
                        error = next((f for f in failures if not isinstance(f, Cancelled)), failures[0])
                        self.stats.count(kind, outcome_of(error))
                        job.future.set_exception(error)
                    else:
                        self.stats.count(kind, Outcome.OK)
                        job.future.set_result(combine(results))

        for i, body in enumerate(bodies):
            threading.Thread(target=run, args=(i, body), name=f"{kind}-fleet-{i}", daemon=True).start()
        return job

    def _retry_after(self, request: Request, ahead: int, candidates: list[DeviceSet]) -> int:
        """Seconds until a device this request could use is likely free: the requests ahead of it for those devices
        (and the ones running on them) at the recent latency of its model and shape, spread over the devices."""
        latency = self.ledger.latency(request.model, request.shape)
        if latency is None:
            latency = max((r.last_latency or 0.0 for r in self.supervisor.replicas().values()), default=0.0)
        return max(1, math.ceil((ahead + 1) * (latency or 1.0) / max(len(candidates), 1)))

    def _candidates(self, request: Request) -> list[DeviceSet]:
        """The device sets a request may run on: the one it names, or the hardware's replicas."""
        if request.devices is not None:
            return [request.devices]
        hardware = self.hardware.get(request.hardware)
        size = local_devices(request.placement, request.world_size, self.settings.pool_nnodes)
        return hardware.device_sets(size)[:self.settings.replicas_of(hardware.name)]

    def _preference(self, request: Request) -> Callable[[DeviceSet], int]:
        """Where a request is best served: its pipeline resident with its shape compiled, then resident, then any."""
        def preference(devices: DeviceSet) -> int:
            key = request.key(devices)
            if not self.residency.is_resident(key):
                return 0
            return 2 if self.ledger.holds(key, request.graph_key) else 1
        return preference

    # --- running on the devices a ticket got ------------------------------------------------------------------------

    def _draw(self, ticket: Ticket) -> GenerateResult:
        """The ticket's image. A rider's comes from the call it was drawn in; a leader draws its own and its riders'
        in one call (after holding it open ACCELDEMO_BATCH_WAIT_MS for more), hands each rider its outcome, and
        returns its own."""
        if ticket.leader is not None:
            return ticket.outcome.result()
        if self.settings.batch_wait_ms and ticket.sharing is not None:
            self.line.gather(ticket, time.monotonic() + self.settings.batch_wait_ms / 1000)
        riders = list(ticket.riders)
        members = [ticket.payload, *(rider.payload for rider in riders)]
        try:
            outcomes = self._run(ticket.granted, members)
        except BaseException as error:  # the call as a whole failed (or its replica was lost): so did every image
            outcomes = [error] * len(members)
        for rider, outcome in zip(riders, outcomes[1:]):
            rider.deliver(outcome)
        if isinstance(outcomes[0], BaseException):
            raise outcomes[0]
        return outcomes[0]

    def _run(self, devices: DeviceSet, members: list[Member], warm_up: bool = False,
             size: int | None = None) -> list[GenerateResult | BaseException]:
        """One pipeline call on `devices` drawing every member not yet stopped (at `size`: a warm-up's bucket; by
        default the batching's size for that many); each member's result, or why it has none."""
        began = time.perf_counter()
        live = [m for m in members if not m.cancelled()]
        unstarted = Cancelled(f"stopped before its call began on {devices}; nothing was started")
        if not live:
            return [unstarted] * len(members)
        batch = Batch(tuple(m.request for m in live),
                      size or self.batching.size(live[0].request, devices, sum(m.request.num_images for m in live)))
        key = batch.first.key(devices)

        def everyone(event: Progress) -> None:
            for member in live:
                member.on_progress(event)

        progress = self.supervisor.following(devices, batch.first.shape, everyone)
        shared = together(len(live) - 1)
        progress(Progress(Phase.QUEUE, f"running on {devices}" + (f", {shared}" if shared else ""), 0))
        served = None
        try:
            if not self.residency.is_resident(key):  # a real model not on this host, fetched when allowed
                self.downloads.ensure(get_model(batch.first.model), lambda fetch: progress(
                    Progress(Phase.LOAD, fetch.describe(), fetch.done, fetch.total, time.perf_counter() - began)))
            resident, load_seconds = self.residency.acquire(key, get_model(batch.first.model), progress)
            try:
                results = self._call(resident.loaded, key, batch, live, progress, warm_up, load_seconds, began)
            finally:
                self.residency.release(resident)
            if not warm_up:
                served = time.perf_counter() - began - load_seconds
        finally:
            self.supervisor.idle(devices, served, len(live))
        drawn = dict(zip(map(id, live), results))
        return [drawn.get(id(m)) or unstarted for m in members]

    def _call(self, loaded, key, batch: Batch, members: list[Member], on_progress, warm_up: bool,
              load_seconds: float, began: float) -> list[GenerateResult | Cancelled]:
        visit = self.ledger.begin(key, batch)
        adapter = self.hardware.get(key.hardware)
        if visit.expect_compile:  # a compiler cache the shared store keeps in step (TPU): what other hosts compiled
            self.artifacts.sync_compiler_cache(adapter, push=False)
        kind = compile_kind(key, batch, adapter.detect().generation)
        clock = CompileClock(on_progress, lambda: self.compile_times.estimate(kind))
        try:
            # A call shared by several stops early only once every one of them is stopped.
            out = loaded.run(batch, visit.expect_compile, clock, lambda: all(m.cancelled() for m in members))
        except AcceldemoError:
            self.ledger.abandoned(visit)
            raise
        except Exception as error:  # a compiler or pipeline failure must not take the server down
            what = describe_error(error)
            self.ledger.failed(visit, what)
            log.exception("generation failed for %s at %s", key, batch.label)
            raise GenerationFailed(f"{key} failed at {batch.label}: {what}") from None
        finally:
            clock.stop()
        if out.new_graphs and clock.measured is not None:
            self.compile_times.record(kind, clock.measured)
        self.artifacts.record(out.package_events, out.store_problem)
        if out.new_graphs:
            self.artifacts.sync_compiler_cache(adapter, push=True)
        self.ledger.finished(visit, out, warm_up)
        call, ended, shared = next(self._calls), time.perf_counter(), len(members)
        results: list[GenerateResult | Cancelled] = []
        spec = get_model(batch.first.model)
        for i, (member, images) in enumerate(zip(members, batch.split(out.images))):
            request = member.request
            result = GenerateResult(
                request=request, key=key, images=images, seconds=ended - member.started,
                queue_wait=began - member.started, load_seconds=load_seconds, compile_seconds=out.compile_seconds,
                new_graphs=out.new_graphs, warm=not visit.first and out.new_graphs == 0,
                compile_cache_hits=out.compile_cache_hits, step_seconds=out.step_seconds,
                preview_seconds=out.preview_seconds,
                unknown_words=spec.unknown_words(request.prompt), note=spec.prompt_note(request.prompt),
                node=self.node, batch=shared, call=call, cache=out.cache, denoise_seconds=out.denoise_seconds,
                weight_bytes=out.weight_bytes)
            self.stats.observe(result, count_call=i == 0)
            if not member.cancelled():
                results.append(result)
            elif shared > 1 and not all(m.cancelled() for m in members):
                results.append(Cancelled(f"stopped: its image at {request.shape} was dropped from a call "
                                         f"{together(shared - 1)}, which finished for them"))
            else:
                results.append(Cancelled(f"stopped at {request.shape} after {len(out.step_seconds) + 1} of "
                                         f"{request.steps} steps; {key.devices} is free for the next job"))
        return results

    # --- the views --------------------------------------------------------------------------------------------------

    def queue_depth(self) -> int:
        """Requests waiting in line (running ones not counted), from every front end."""
        if self.fleet is not None:
            with self._fleet_lock:
                return sum(max(0, n - self.fleet.capacity(hw)) for hw, n in self._in_fleet.items())
        return len(self.line.waiting())

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
        weights = Quantization.NONE if quantization in (None, "") else Quantization(quantization)
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
        running, waiting = self.line.running(), self.line.waiting()
        residents = self.residency.views()
        resident_keys = [v.key for v in residents if v.resident]
        devices = []
        for device in self.hardware.devices():
            at = (device.hardware, device.index)
            ticket = running.get(at)
            devices.append(DeviceView(device, ticket.what if ticket else None, sum(at in t.devices for t in waiting),
                                      tuple(str(k) for k in resident_keys if k.devices is not None
                                            and k.hardware == device.hardware and device.index in k.devices.indices)))
        known = self.supervisor.replicas()
        sets = {d for hw in self.hardware for d in hw.device_sets(1)[:self.settings.replicas_of(hw.name)]}
        sets |= {k.devices for k in resident_keys if k.devices is not None} | set(known)
        replicas = []
        for devices_set in sorted(sets):
            replica = known.get(devices_set, Replica(devices_set))
            mine = {(devices_set.hardware, i) for i in devices_set.indices}
            if replica.state is ReplicaState.IDLE and mine & set(running):
                state, shown = ReplicaState.BUSY, str(ReplicaState.BUSY)
            else:
                state, shown = replica.state, replica.shown
            replicas.append(ReplicaView(
                devices_set, state, shown, sum(bool(t.devices & mine) for t in waiting),
                tuple(self.ledger.ready_on(devices_set)), replica.served, replica.last_latency, replica.restarts,
                tuple(str(k) for k in resident_keys if k.devices == devices_set), self.node))
        if self.fleet is not None:
            replicas = list(self.fleet.replicas())
        pipelines = tuple(PipelineView(v.key, v.resident, v.busy, v.load_seconds, self.ledger.shapes(v.key))
                          for v in residents)
        depth = self.queue_depth() if self.fleet is not None else len(waiting)
        return Snapshot(self.startup, depth, self.settings.queue_size, self.stats.snapshot(), tuple(devices),
                        tuple(replicas), pipelines, self.artifacts.report(self.settings.precompile),
                        self.artifacts.store_report(), tuple(self.downloads.active()))


def _of_image(image: int, on_progress: ProgressCallback) -> ProgressCallback:
    """`on_progress` for one image of a request: its events say which image they are about."""
    if image == 0:
        return on_progress
    return lambda event: on_progress(dataclasses.replace(event, image=image))


def _batch_size(size: object) -> int:
    """A warm-up's batch size: a whole number from 1 to ACCELDEMO_MAX_BATCH's ceiling."""
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_BATCH:
        raise InvalidRequest("batch", size, f"a whole number from 1 to {MAX_BATCH}")
    return size


def _label(request: Request, size: int) -> str:
    return Batch((request,), size).label


def _sides(shape: object) -> tuple[int, int]:
    """A warm-up shape's width and height: a Shape, or WIDTHxHEIGHT text."""
    parsed = parse_resolution(shape)
    return parsed.width, parsed.height
