"""The session manager: every request's admission, counting and scheduling onto devices, and the resident pipelines
per (model, device set, mode, placement) with their compiled shapes."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from prometheus_client import Gauge

from ..config import Settings
from ..errors import AcceldemoError, Cancelled, CapacityExceeded, GenerationFailed, ReplicaLost, describe_error
from ..executors.artifacts import EVENTS, ArtifactStore
from ..executors.base import Executor, LoadedPipeline
from ..hardware import COMPILED_MODES, HARDWARE, Device, get_hardware
from ..models.catalog import ModelSpec, get_model
from ..records import (DeviceSet, GenerateRequest, GenerateResult, PipelineKey, Progress, ProgressCallback, Shape,
                       no_progress)
from .admission import Line
from .stats import EngineStats, outcome_of
from .validation import check_request, local_devices

log = logging.getLogger("acceldemo.engine")


@dataclass
class CompiledShape:
    """What one static shape of one pipeline costs and how often it was reused."""

    shape: Shape
    devices: DeviceSet | None = None  # the replica holding it
    state: str = "cold"  # cold | compiling | ready | failed
    reason: str = ""
    graphs: int = 0
    compile_seconds: float = 0.0
    first_call_seconds: float | None = None
    last_latency: float | None = None
    hits: int = 0


@dataclass(frozen=True)
class PipelineStatus:
    """A snapshot of one pipeline the manager knows, resident or evicted."""

    key: PipelineKey
    resident: bool
    busy: bool
    load_seconds: float
    shapes: tuple[CompiledShape, ...]


@dataclass(frozen=True)
class DeviceStatus:
    """One device as the engine sees it: what runs on it, how many wait for it, which pipelines it holds."""

    device: Device
    running: str | None  # what the job on it is, None when idle
    waiting: int
    pipelines: tuple[str, ...]


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica (a device set that holds pipelines) as a person sees it."""

    devices: DeviceSet
    state: str  # idle | loading | compiling WxH | busy | restarting | down: <why>
    waiting: int
    shapes: tuple[str, ...]  # the shapes its pipelines hold compiled
    served: int
    last_latency: float | None
    restarts: int
    pipelines: tuple[str, ...]


@dataclass
class _Replica:
    devices: DeviceSet
    state: str = "idle"
    served: int = 0
    last_latency: float | None = None
    restarts: int = 0
    down: str | None = None  # why it is out of service, while it is


# A lost replica is started again in the background at most this many times in a row, this far apart.
RESTART_ATTEMPTS = 3
RESTART_BACKOFF_S = 5.0


@dataclass
class _Entry:
    key: PipelineKey
    shapes: dict[Shape, CompiledShape] = field(default_factory=dict)
    graph_keys: set = field(default_factory=set)
    loaded: LoadedPipeline | None = None
    load_seconds: float = 0.0
    busy: bool = False


class SessionManager:
    """The one way into the engine for every front end: validation, one line with one limit, outcome counters,
    one job at a time per device, resident pipelines within a budget per device.

    The executor (chosen outside the manager) decides where a pipeline lives: this process or a worker pool.
    """

    def __init__(self, settings: Settings, executor: Executor):
        self.settings = settings
        self.executor = executor
        self.line = Line(settings.queue_size, settings.device_wait_s)
        self.stats = EngineStats()
        self.artifacts = ArtifactStore.of(settings)
        self._entries: OrderedDict[PipelineKey, _Entry] = OrderedDict()
        self._replicas: dict[DeviceSet, _Replica] = {}
        self._lock = threading.RLock()
        self.evictions: list[tuple[float, PipelineKey]] = []
        registry = self.stats.registry
        Gauge("acceldemo_queue_depth", "Requests waiting in line for a device", registry=registry) \
            .set_function(self.queue_depth)
        Gauge("acceldemo_resident_pipelines", "Pipelines resident in memory", registry=registry) \
            .set_function(lambda: sum(p.resident for p in self.status()))
        Gauge("acceldemo_busy_devices", "Devices running a job", registry=registry) \
            .set_function(lambda: len(self.line.running()))
        # Precompiled (AOTInductor) packages built, or loaded from the persistent cache instead, since start.
        packages = Gauge("acceldemo_precompiled_packages", "AOTInductor packages by event since start", ("event",),
                         registry=registry)
        for event in EVENTS:
            packages.labels(event).set_function(lambda event=event: self.artifacts.counts()[event])

    # --- front ends call these ----------------------------------------------------------------------------------

    def check(self, request: GenerateRequest, counted: bool = False) -> GenerateRequest:
        """The request with every default filled in, or the first thing wrong with it (a typed error). `counted`: a
        refusal counts as one request, for a front end that checks once before asking for several images of it."""
        try:
            return check_request(request, self.settings)
        except AcceldemoError as error:
            if counted:
                self.stats.count("generate", outcome_of(error))
            raise

    def generate(self, request: GenerateRequest, on_progress: ProgressCallback = no_progress,
                 cancelled: Callable[[], bool] = lambda: False) -> GenerateResult:
        """Validate, wait in line for a device, load if needed, run; counts the outcome whatever it is."""
        with self._counted("generate"):
            request = self.check(request)
            what = f"{request.width}x{request.height} · {request.model} · {request.mode}"
            return self._admitted(request, what, on_progress, cancelled,
                                  lambda devices, started, queue_wait: self._run(
                                      devices, request, on_progress, cancelled, False, started, queue_wait))

    def warm_up(self, request: GenerateRequest, shapes: Iterable[Shape],
                on_progress: ProgressCallback = no_progress) -> list[CompiledShape]:
        """Compile the given shapes ahead of requests (one denoise step each) on every replica (or the request's own
        device), one replica after the other: the first compiles each shape, the others load what it left in the
        persistent compile caches. Returns the records, replica by replica."""
        with self._counted("warmup"):
            base = self.check(request)
            warm = [self.check(replace(base, width=s.width, height=s.height, steps=1)) for s in shapes]
            what = f"warm-up of {', '.join(f'{r.width}x{r.height}' for r in warm)} · {base.model} · {base.mode}"
            replicas = self._candidates(base)
            done: list[CompiledShape] = []

            def work(devices: DeviceSet, started: float, queue_wait: float) -> list[CompiledShape]:
                records = []
                for i, one in enumerate(warm, 1):
                    on_progress(Progress("compile", f"warming {one.shape} on {devices} ({i}/{len(warm)})", i,
                                         len(warm)))
                    result = self._run(devices, one, on_progress, lambda: False, True, started, queue_wait)
                    with self._lock:
                        records.append(replace(self._entries[result.key].shapes[one.shape]))
                return records

            for replica in replicas if warm else ():
                done += self._admitted(base, what, on_progress, lambda: False, work, [replica])
            return done

    def status(self) -> list[PipelineStatus]:
        """Every pipeline the manager has known, most recently used last."""
        with self._lock:
            return [PipelineStatus(e.key, e.loaded is not None, e.busy, e.load_seconds,
                                   tuple(replace(s) for s in e.shapes.values())) for e in self._entries.values()]

    def replicas(self) -> list[ReplicaStatus]:
        """Every replica: the device sets requests are scheduled on (for each hardware found, its single devices or
        the groups its tensor-parallel pipelines hold), with state, line, shapes held and requests served."""
        running, waiting = self.line.running(), self.line.waiting()
        with self._lock:
            entries = list(self._entries.values())
            known = dict(self._replicas)
        sets = {d for hw in HARDWARE.values() for d in hw.device_sets(1)[:self._replica_limit(hw)]}
        sets |= {e.key.devices for e in entries if e.key.devices is not None} | set(known)
        found = []
        for devices in sorted(sets):
            replica = known.get(devices, _Replica(devices))
            mine = [e for e in entries if e.key.devices == devices]
            busy = any((devices.hardware, i) in running for i in devices.indices)
            state = replica.down or (replica.state if replica.state != "idle" else "busy" if busy else "idle")
            found.append(ReplicaStatus(
                devices, state, sum(bool(t.devices & {(devices.hardware, i) for i in devices.indices})
                                    for t in waiting),
                tuple(sorted({str(s.shape) for e in mine for s in e.shapes.values() if s.state == "ready"})),
                replica.served, replica.last_latency, replica.restarts,
                tuple(str(e.key) for e in mine if e.loaded is not None)))
        return found

    def devices(self) -> list[DeviceStatus]:
        """Every device of the hardware found here: busy or idle, its line, its resident pipelines."""
        running, waiting = self.line.running(), self.line.waiting()
        with self._lock:
            resident = [e.key for e in self._entries.values() if e.loaded is not None]
        found = []
        for hardware in HARDWARE.values():
            for device in hardware.devices():
                at = (device.hardware, device.index)
                ticket = running.get(at)
                found.append(DeviceStatus(
                    device, ticket.what if ticket else None, sum(at in t.devices for t in waiting),
                    tuple(str(k) for k in resident if k.devices is not None and device.index in k.devices.indices
                          and k.hardware == device.hardware)))
        return found

    def queue_depth(self) -> int:
        """Requests waiting in line (running ones not counted)."""
        return len(self.line.waiting())

    def capacity(self) -> int:
        """How many requests the engine holds at most: one running per device, plus the line."""
        return sum(len(hw.devices()) for hw in HARDWARE.values()) + self.settings.queue_size

    def counters(self) -> dict:
        """The engine's counts (requests by outcome, graphs, compile seconds, hits, loads, evictions)."""
        return self.stats.snapshot()

    def precompiled(self) -> dict:
        """The AOTInductor package store behind mode compiled on CPU/CUDA: packages, builds, loads, hit rate."""
        return self.artifacts.report(self.settings.precompile)

    def package_events(self) -> dict[str, int]:
        """Packages built, loaded and rejected since start, without reading the disk (for frequent scrapes)."""
        return self.artifacts.counts()

    def evict(self, key: PipelineKey, why: str = "asked") -> None:
        """Free a resident pipeline; its shape records stay, so a reload shows what was compiled."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.loaded is None:
                return
            loaded, entry.loaded = entry.loaded, None
            self.evictions.append((time.time(), key))
        self.stats.evictions.inc()
        log.info("evicted %s (%s)", key, why)
        loaded.close()

    def close(self) -> None:
        """Free every resident pipeline and stop every process the executor started."""
        for key in list(self._entries):
            self.evict(key, "shutdown")
        self.executor.close()

    # --- admission and counting ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _counted(self, kind: str) -> Iterator[None]:
        """Count the request's outcome once; anything but the engine's own errors becomes GenerationFailed."""
        try:
            yield
        except AcceldemoError as error:
            self.stats.count(kind, outcome_of(error))
            raise
        except Exception as error:  # a bug must reach the person as a message, never take the server down
            self.stats.count(kind, "failed")
            log.exception("%s failed", kind)
            raise GenerationFailed(f"internal error: {describe_error(error)}") from None
        self.stats.count(kind, "ok")

    def _admitted(self, request: GenerateRequest, what: str, on_progress: ProgressCallback, cancelled,
                  work: Callable[[DeviceSet, float, float], object], candidates: list[DeviceSet] | None = None):
        """Take a ticket for the request's devices, wait for them, do the work on the ones given, free them.

        A replica lost during the work (its process died or hung) is restarted in the background, and the work is
        done once more on another replica: a generation is idempotent for its seed, so nothing is lost.
        """
        started = time.perf_counter()
        candidates = self._candidates(request) if candidates is None else candidates
        lost: list[ReplicaLost] = []
        while True:
            usable = [c for c in candidates if str(c) not in {e.devices for e in lost} and not self._is_down(c)]
            if not usable:
                raise lost[-1] if lost else GenerationFailed(
                    "every replica is down: " + "; ".join(f"{c} {self._replicas[c].down}" for c in candidates))
            ticket = self.line.enter(what, usable, self._preference(request))
            try:
                devices = self.line.wait(ticket, on_progress, cancelled)
                return work(devices, started, time.perf_counter() - started)
            except ReplicaLost as error:
                self._lose(devices, error)
                if lost:  # retried once already
                    raise
                lost.append(error)
                on_progress(Progress("queue", f"{devices} was lost ({error}): running again on another replica"))
            finally:
                self.line.release(ticket)

    def _candidates(self, request: GenerateRequest) -> list[DeviceSet]:
        """The device sets a request may run on: the one it names, or the hardware's replicas."""
        if request.device:
            return [DeviceSet.parse(request.device)]
        hardware = get_hardware(request.hardware)
        size = local_devices(request.placement, request.tp_size, self.settings.pool_nnodes)
        return hardware.device_sets(size)[:self._replica_limit(hardware)]

    def _replica_limit(self, hardware) -> int | None:
        """The operator's replica count for the hardware; None (all device sets) otherwise."""
        return self.settings.replicas_of(hardware.name)

    def _is_down(self, devices: DeviceSet) -> bool:
        with self._lock:
            replica = self._replicas.get(devices)
            return replica is not None and replica.down is not None

    def _replica(self, devices: DeviceSet) -> _Replica:
        with self._lock:
            return self._replicas.setdefault(devices, _Replica(devices))

    def _lose(self, devices: DeviceSet, error: ReplicaLost) -> None:
        """A replica's processes are gone: forget its pipelines and start it again in the background."""
        log.error("replica %s lost: %s", devices, error)
        with self._lock:
            keys = [e.key for e in self._entries.values() if e.key.devices == devices and e.loaded is not None]
            replica = self._replica(devices)
            replica.state, replica.restarts = "restarting", replica.restarts + 1
        for key in keys:
            self.evict(key, f"replica {devices} lost")
        self.stats.restarts.inc()
        threading.Thread(target=self._restart, args=(devices, keys), name=f"restart-{devices}", daemon=True).start()

    def _restart(self, devices: DeviceSet, keys: list[PipelineKey]) -> None:
        """Load the lost replica's pipelines again, in its own turn on its devices, a few times if it must."""
        why = "no pipeline to load"
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            ticket = self.line.enter(f"restarting {devices}", [devices])
            try:
                self.line.wait(ticket)
                for key in keys:
                    entry, _ = self._load(key, get_model(key.model), no_progress)
                    entry.busy = False
                with self._lock:
                    replica = self._replica(devices)
                    replica.state, replica.down = "idle", None
                log.info("replica %s is back (attempt %d)", devices, attempt)
                return
            except AcceldemoError as error:
                why = str(error)
                log.warning("restarting replica %s failed (attempt %d of %d): %s", devices, attempt,
                            RESTART_ATTEMPTS, why)
            finally:
                self.line.release(ticket)
            time.sleep(RESTART_BACKOFF_S * attempt)
        with self._lock:
            replica = self._replica(devices)
            replica.state, replica.down = "down", f"down: {why}"

    def _preference(self, request: GenerateRequest) -> Callable[[DeviceSet], int]:
        """Where a request is best served: its pipeline resident with its shape compiled, then resident, then any."""
        spec = get_model(request.model)
        graph_key = spec.graph_key(request.shape, request.num_images, request.guidance)

        def preference(devices: DeviceSet) -> int:
            with self._lock:
                entry = self._entries.get(self._key(request, devices))
                if entry is None or entry.loaded is None:
                    return 0
                return 2 if graph_key in entry.graph_keys else 1
        return preference

    @staticmethod
    def _key(request: GenerateRequest, devices: DeviceSet) -> PipelineKey:
        return PipelineKey(request.model, request.hardware, request.mode, request.placement, request.tp_size, devices)

    # --- running on the devices a ticket got ----------------------------------------------------------------------

    def _run(self, devices: DeviceSet, request: GenerateRequest, on_progress: ProgressCallback, cancelled,
             warm_up: bool, started: float, queue_wait: float) -> GenerateResult:
        spec = get_model(request.model)
        key = self._key(request, devices)
        replica = self._replica(devices)

        def progress(event: Progress) -> None:  # the replica's state follows its job's phases
            replica.state = {"load": "loading", "compile": f"compiling {request.width}x{request.height}"}.get(
                event.phase, "busy")
            on_progress(event)

        progress(Progress("queue", f"running on {devices}", 0))
        try:
            entry, load_seconds = self._load(key, spec, progress)
            try:
                result = self._call(entry, spec, request, progress, cancelled, warm_up, queue_wait, load_seconds,
                                    started)
            finally:
                entry.busy = False
        finally:
            with self._lock:
                if replica.state != "restarting":
                    replica.state = "idle"
        if not warm_up:
            with self._lock:
                replica.served += 1
                replica.last_latency = result.seconds - result.queue_wait - result.load_seconds
        return result

    def _call(self, entry: _Entry, spec: ModelSpec, request: GenerateRequest, on_progress, cancelled, warm_up: bool,
              queue_wait: float, load_seconds: float, started: float) -> GenerateResult:
        shape = request.shape
        graph_key = spec.graph_key(shape, request.num_images, request.guidance)
        with self._lock:
            record = entry.shapes.get(shape)
            first_visit = record is None or record.state in ("cold", "failed")
            if record is None:
                known = [s for s in entry.shapes.values() if s.state != "failed"]
                if len(known) >= self.settings.max_shapes_per_pipeline:
                    raise CapacityExceeded(
                        f"{entry.key} already holds {len(known)} shapes (ACCELDEMO_MAX_SHAPES="
                        f"{self.settings.max_shapes_per_pipeline}); use one of "
                        f"{', '.join(str(s.shape) for s in known)} or raise the limit")
                record = entry.shapes[shape] = CompiledShape(shape, entry.key.devices)
            expect_compile = entry.key.mode in COMPILED_MODES and graph_key not in entry.graph_keys
            if expect_compile:
                record.state = "compiling"
        try:
            out = entry.loaded.run(request, expect_compile, on_progress, cancelled)
        except AcceldemoError:
            raise
        except Exception as error:  # a compiler or pipeline failure must not take the server down
            what = describe_error(error)
            with self._lock:
                if first_visit:
                    record.state, record.reason = "failed", what
            log.exception("generation failed for %s at %s", entry.key, shape)
            raise GenerationFailed(f"{entry.key} failed at {shape}: {what}") from None
        self.artifacts.record(out.package_events)
        with self._lock:
            entry.graph_keys.add(graph_key)
            record.state, record.reason = "ready", ""
            record.graphs += out.new_graphs
            record.compile_seconds += out.compile_seconds
            if first_visit:
                record.first_call_seconds = out.seconds
            else:
                record.hits += 1
            if not warm_up and not first_visit:
                record.last_latency = out.seconds
        result = GenerateResult(
            request=request, key=entry.key, images=out.images, seconds=time.perf_counter() - started,
            queue_wait=queue_wait, load_seconds=load_seconds, compile_seconds=out.compile_seconds,
            new_graphs=out.new_graphs, warm=not first_visit and out.new_graphs == 0,
            compile_cache_hits=out.compile_cache_hits, step_seconds=out.step_seconds,
            unknown_words=spec.unknown_words(request.prompt), note=spec.prompt_note(request.prompt))
        self.stats.observe(result)
        if cancelled():
            raise Cancelled(f"stopped at {shape} after {len(out.step_seconds) + 1} of {request.steps} steps; "
                            f"{entry.key.devices} is free for the next job")
        return result

    def _load(self, key: PipelineKey, spec: ModelSpec, on_progress: ProgressCallback) -> tuple[_Entry, float]:
        """The key's entry with its pipeline resident (loading it now if needed), marked busy."""
        with self._lock:
            entry = self._entries.setdefault(key, _Entry(key))
            self._entries.move_to_end(key)
            entry.busy = True
            if entry.loaded is not None:
                return entry, 0.0
        self._make_room(keep=key)
        started = time.perf_counter()
        try:
            try:
                loaded = self.executor.load(key, spec, on_progress)
            except MemoryError as error:  # torch.OutOfMemoryError is one too
                evicted = self._make_room(keep=key, budget=1)
                if not evicted:
                    raise
                log.warning("out of memory loading %s (%s): evicted %d pipeline(s), retrying once",
                            key, describe_error(error), evicted)
                on_progress(Progress("load", f"out of memory: freed {evicted} pipeline(s), loading again"))
                loaded = self.executor.load(key, spec, on_progress)
        except AcceldemoError:
            entry.busy = False
            raise
        except Exception as error:
            entry.busy = False
            log.exception("loading %s failed", key)
            hint = " (out of memory even with nothing else resident: try placement offload or tp)" \
                if isinstance(error, MemoryError) else ""
            raise GenerationFailed(f"loading {key} failed: {describe_error(error)}{hint}") from None
        with self._lock:
            entry.loaded, entry.load_seconds = loaded, time.perf_counter() - started
        self.stats.loads.inc()
        return entry, entry.load_seconds

    def _make_room(self, keep: PipelineKey, budget: int | None = None) -> int:
        """Evict least recently used idle pipelines sharing a device with `keep` until one more fits the budget of
        resident pipelines per device; returns how many went."""
        budget = self.settings.max_resident_pipelines if budget is None else budget
        evicted = 0
        while True:
            with self._lock:
                resident = [e for e in self._entries.values() if e.loaded is not None and e.key != keep
                            and e.key.devices is not None and e.key.devices.overlaps(keep.devices)]
                if len(resident) < budget:
                    return evicted
                idle = [e for e in resident if not e.busy]
                if not idle:
                    log.warning("over the budget of %d resident pipelines on %s: all are busy", budget, keep.devices)
                    return evicted
            self.evict(idle[0].key, f"budget of {budget} resident pipelines per device")
            evicted += 1
