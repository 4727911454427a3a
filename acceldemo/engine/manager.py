"""The session manager: resident pipelines per (model, hardware, mode, placement) and their compiled shapes."""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from ..config import Settings
from ..errors import AcceldemoError, Cancelled, CapacityExceeded, GenerationFailed
from ..executors import artifacts
from ..executors.base import Executor, LoadedPipeline
from ..executors.recipe import size_recompile_limit
from ..hardware import COMPILED_MODES
from ..models.catalog import get_model
from ..records import GenerateRequest, GenerateResult, PipelineKey, Progress, ProgressCallback, Shape, no_progress
from .validation import check_request

log = logging.getLogger("acceldemo.engine")


@dataclass
class CompiledShape:
    """What one static shape of one pipeline costs and how often it was reused."""

    shape: Shape
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


@dataclass
class _Entry:
    key: PipelineKey
    shapes: dict[Shape, CompiledShape] = field(default_factory=dict)
    graph_keys: set = field(default_factory=set)
    loaded: LoadedPipeline | None = None
    load_seconds: float = 0.0
    busy: bool = False


def describe(error: BaseException) -> str:
    """One line a person can read: the compiler's own error rather than dynamo's wrapper around it."""
    inner = getattr(error, "inner_exception", None)
    prefix = "compiling failed: " if inner is not None else ""
    error = inner or error
    text = " ".join(str(error).split())
    text = text.split(" Set TORCHDYNAMO_VERBOSE")[0]
    return f"{prefix}{type(error).__name__}: {text}"[:400]


class SessionManager:
    """Runs requests on resident pipelines, one job at a time per device, within a memory budget."""

    def __init__(self, settings: Settings | None = None, executor: Executor | None = None,
                 pool_executor: Executor | None = None):
        from ..executors.local import LocalExecutor

        self.settings = settings or Settings.from_env()
        self.executor = executor or LocalExecutor(self.settings)
        self._pool_executor = pool_executor
        self._entries: OrderedDict[PipelineKey, _Entry] = OrderedDict()
        self._lock = threading.RLock()
        self._device_locks: dict[str, threading.Lock] = defaultdict(threading.Lock)
        self._waiting: Counter = Counter()
        self.counters: Counter = Counter()
        self.evictions: list[tuple[float, PipelineKey]] = []
        size_recompile_limit(self.settings)

    def generate(self, request: GenerateRequest, on_progress: ProgressCallback = no_progress,
                 cancelled: Callable[[], bool] = lambda: False) -> GenerateResult:
        """Validate, wait for the device, load if needed, run; counts every step of it."""
        self.counters["requests"] += 1
        try:
            return self._run(request, on_progress, cancelled, warm_up=False)
        except AcceldemoError:
            self.counters["errors"] += 1
            raise

    def warm_up(self, request: GenerateRequest, shapes: Iterable[Shape],
                on_progress: ProgressCallback = no_progress) -> list[CompiledShape]:
        """Compile the given shapes ahead of requests (one denoise step each); returns their records."""
        shapes = list(shapes)
        done = []
        for i, shape in enumerate(shapes, 1):
            on_progress(Progress("compile", f"warming {shape} ({i}/{len(shapes)})", i, len(shapes)))
            one = replace(request, width=shape.width, height=shape.height, steps=1)
            result = self._run(one, on_progress, lambda: False, warm_up=True)
            done.append(replace(self._entries[result.key].shapes[shape]))
        return done

    def status(self) -> list[PipelineStatus]:
        """Every pipeline the manager has known, most recently used last."""
        with self._lock:
            return [PipelineStatus(e.key, e.loaded is not None, e.busy, e.load_seconds,
                                   tuple(replace(s) for s in e.shapes.values())) for e in self._entries.values()]

    def precompiled(self) -> dict:
        """The AOTInductor package store behind mode compiled on CPU/CUDA: packages, builds, loads, hit rate."""
        return artifacts.report(self.settings)

    def package_events(self) -> dict[str, int]:
        """Packages built, loaded and rejected since start, without reading the disk (for frequent scrapes)."""
        return artifacts.events()

    def queue_depth(self, hardware: str | None = None) -> int:
        """Jobs waiting for a device (one hardware, or all)."""
        with self._lock:
            return self._waiting[hardware] if hardware else sum(self._waiting.values())

    def evict(self, key: PipelineKey, why: str = "asked") -> None:
        """Free a resident pipeline; its shape records stay, so a reload shows what was compiled."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.loaded is None:
                return
            loaded, entry.loaded = entry.loaded, None
            self.evictions.append((time.time(), key))
            self.counters["evictions"] += 1
        log.info("evicted %s (%s)", key, why)
        loaded.close()

    def close(self) -> None:
        """Free every resident pipeline and stop any worker pool."""
        for key in list(self._entries):
            self.evict(key, "shutdown")
        if self._pool_executor is not None:
            self._pool_executor.close()

    def _run(self, request: GenerateRequest, on_progress: ProgressCallback, cancelled, warm_up: bool
             ) -> GenerateResult:
        request = check_request(request)
        started = time.perf_counter()
        spec = get_model(request.model)
        key = PipelineKey(request.model, request.hardware, request.mode, request.placement, request.tp_size)
        device_lock = self._device_locks[key.hardware]
        with self._lock:
            self._waiting[key.hardware] += 1
            ahead = self._waiting[key.hardware] - 1 + device_lock.locked()
        if ahead:
            on_progress(Progress("wait", f"waiting for {key.hardware}: {ahead} job(s) ahead"))
        acquired = device_lock.acquire(timeout=self.settings.device_wait_s)
        with self._lock:
            self._waiting[key.hardware] -= 1
        if not acquired:
            raise CapacityExceeded(f"{key.hardware} stayed busy for {self.settings.device_wait_s:.0f} s "
                                   f"(ACCELDEMO_DEVICE_WAIT_S); retry in a moment")
        try:
            queue_wait = time.perf_counter() - started
            entry, load_seconds = self._load(key, spec, on_progress)
            try:
                return self._call(entry, spec, request, on_progress, cancelled, warm_up, queue_wait,
                                  load_seconds, started)
            finally:
                entry.busy = False
        finally:
            device_lock.release()

    def _call(self, entry: _Entry, spec, request: GenerateRequest, on_progress, cancelled, warm_up: bool,
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
                record = entry.shapes[shape] = CompiledShape(shape)
            expect_compile = entry.key.mode in COMPILED_MODES and graph_key not in entry.graph_keys
            if expect_compile:
                record.state = "compiling"
        try:
            out = entry.loaded.run(request, expect_compile, on_progress, cancelled)
        except AcceldemoError:
            raise
        except Exception as error:  # a compiler or pipeline failure must not take the server down
            what = describe(error)
            with self._lock:
                if first_visit:
                    record.state, record.reason = "failed", what
            log.exception("generation failed for %s at %s", entry.key, shape)
            raise GenerationFailed(f"{entry.key} failed at {shape}: {what}") from None
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
            self.counters["graphs"] += out.new_graphs
            self.counters["compile_seconds"] += out.compile_seconds
            self.counters["compile_cache_hits"] += out.compile_cache_hits
            self.counters["shape_hits" if not first_visit else "shape_misses"] += 1
        if cancelled():
            self.counters["cancelled"] += 1
            raise Cancelled(f"stopped at {shape} after {len(out.step_seconds) + 1} of {request.steps} steps; "
                            f"{entry.key.hardware} is free for the next job")
        return GenerateResult(
            request=request, key=entry.key, images=out.images, seconds=time.perf_counter() - started,
            queue_wait=queue_wait, load_seconds=load_seconds, compile_seconds=out.compile_seconds,
            new_graphs=out.new_graphs, warm=not first_visit and out.new_graphs == 0,
            compile_cache_hits=out.compile_cache_hits, step_seconds=out.step_seconds)

    def _load(self, key: PipelineKey, spec, on_progress: ProgressCallback) -> tuple[_Entry, float]:
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
                loaded = self.executor_for(key).load(key, spec, on_progress)
            except MemoryError as error:  # torch.OutOfMemoryError is one too
                evicted = self._make_room(keep=key, budget=1)
                if not evicted:
                    raise
                log.warning("out of memory loading %s (%s): evicted %d pipeline(s), retrying once",
                            key, describe(error), evicted)
                on_progress(Progress("load", f"out of memory: freed {evicted} pipeline(s), loading again"))
                loaded = self.executor_for(key).load(key, spec, on_progress)
        except AcceldemoError:
            entry.busy = False
            raise
        except Exception as error:
            entry.busy = False
            log.exception("loading %s failed", key)
            hint = " (out of memory even with nothing else resident: try placement offload or tp)" \
                if isinstance(error, MemoryError) else ""
            raise GenerationFailed(f"loading {key} failed: {describe(error)}{hint}") from None
        with self._lock:
            entry.loaded, entry.load_seconds = loaded, time.perf_counter() - started
            self.counters["loads"] += 1
        return entry, entry.load_seconds

    def executor_for(self, key: PipelineKey) -> Executor:
        """Tensor-parallel pipelines live in a torchrun worker pool; every other one in this process."""
        if key.placement != "tp":
            return self.executor
        if self._pool_executor is None:
            from ..executors.pool import PoolExecutor

            self._pool_executor = PoolExecutor(self.settings)
        return self._pool_executor

    def _make_room(self, keep: PipelineKey, budget: int | None = None) -> int:
        """Evict least recently used idle pipelines until one more fits the budget; returns how many went."""
        budget = self.settings.max_resident_pipelines if budget is None else budget
        evicted = 0
        while True:
            with self._lock:
                resident = [e for e in self._entries.values() if e.loaded is not None and e.key != keep]
                if len(resident) < budget:
                    return evicted
                idle = [e for e in resident if not e.busy]
                if not idle:
                    log.warning("over the budget of %d resident pipelines: all are busy", budget)
                    return evicted
            self.evict(idle[0].key, f"budget of {budget} resident pipelines")
            evicted += 1
