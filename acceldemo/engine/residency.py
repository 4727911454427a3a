"""Resident pipelines: loaded through the executor (wherever it places them), kept per device within the operator's
budget, the least recently used idle one evicted first; loading again after an out-of-memory once."""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import AcceldemoError, GenerationFailed, describe_error
from ..executors.base import Executor, LoadedPipeline
from ..models.catalog import ModelSpec
from ..records import DeviceSet, Phase, PipelineKey, Progress, ProgressCallback
from .stats import EngineStats

log = logging.getLogger("acceldemo.engine")


@dataclass
class Resident:
    """One pipeline the engine has loaded (and may since have evicted), most recently used last."""

    key: PipelineKey
    loaded: LoadedPipeline | None = None
    load_seconds: float = 0.0
    busy: bool = False


@dataclass(frozen=True)
class ResidentView:
    key: PipelineKey
    resident: bool
    busy: bool
    load_seconds: float


class Residency:
    """The pipelines the engine holds, by key. One job at a time runs a pipeline (`acquire` ... `release`)."""

    def __init__(self, executor: Executor, budget: int, stats: EngineStats):
        self.executor, self.budget, self.stats = executor, budget, stats
        self._pipelines: OrderedDict[PipelineKey, Resident] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions: list[tuple[float, PipelineKey]] = []

    def acquire(self, key: PipelineKey, spec: ModelSpec, on_progress: ProgressCallback) -> tuple[Resident, float]:
        """The key's pipeline resident (loading it now if needed) and marked busy; the seconds spent loading."""
        with self._lock:
            resident = self._pipelines.setdefault(key, Resident(key))
            self._pipelines.move_to_end(key)
            resident.busy = True
            if resident.loaded is not None:
                return resident, 0.0
        try:
            loaded, seconds = self._load(key, spec, on_progress)
        except BaseException:
            self.release(resident)
            raise
        with self._lock:
            resident.loaded, resident.load_seconds = loaded, seconds
        self.stats.loads.inc()
        return resident, seconds

    def release(self, resident: Resident) -> None:
        with self._lock:
            resident.busy = False

    def _load(self, key: PipelineKey, spec: ModelSpec, on_progress: ProgressCallback) -> tuple[LoadedPipeline, float]:
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
                on_progress(Progress(Phase.LOAD, f"out of memory: freed {evicted} pipeline(s), loading again"))
                loaded = self.executor.load(key, spec, on_progress)
        except AcceldemoError:
            raise
        except Exception as error:
            log.exception("loading %s failed", key)
            hint = " (out of memory even with nothing else resident: try placement offload or tp)" \
                if isinstance(error, MemoryError) else ""
            raise GenerationFailed(f"loading {key} failed: {describe_error(error)}{hint}") from None
        return loaded, time.perf_counter() - started

    def _make_room(self, keep: PipelineKey, budget: int | None = None) -> int:
        """Evict least recently used idle pipelines sharing a device with `keep` until one more fits the budget of
        resident pipelines per device; returns how many went."""
        budget = self.budget if budget is None else budget
        evicted = 0
        while True:
            with self._lock:
                resident = [r for r in self._pipelines.values() if r.loaded is not None and r.key != keep
                            and r.key.devices is not None and r.key.devices.overlaps(keep.devices)]
                if len(resident) < budget:
                    return evicted
                idle = [r for r in resident if not r.busy]
                if not idle:
                    log.warning("over the budget of %d resident pipelines on %s: all are busy", budget, keep.devices)
                    return evicted
            self.evict(idle[0].key, f"budget of {budget} resident pipelines per device")
            evicted += 1

    def evict(self, key: PipelineKey, why: str = "asked") -> None:
        """Free a resident pipeline (the ledger keeps its shapes, so a reload shows what was compiled)."""
        with self._lock:
            resident = self._pipelines.get(key)
            if resident is None or resident.loaded is None:
                return
            loaded, resident.loaded = resident.loaded, None
            self.evictions.append((time.time(), key))
        self.stats.evictions.inc()
        log.info("evicted %s (%s)", key, why)
        loaded.close()

    def evict_on(self, devices: DeviceSet, why: str) -> list[PipelineKey]:
        """Free every pipeline resident on these devices (their replica was lost); returns their keys."""
        with self._lock:
            keys = [r.key for r in self._pipelines.values() if r.key.devices == devices and r.loaded is not None]
        for key in keys:
            self.evict(key, why)
        return keys

    def views(self) -> list[ResidentView]:
        """Every pipeline loaded since start, most recently used last."""
        with self._lock:
            return [ResidentView(r.key, r.loaded is not None, r.busy, r.load_seconds)
                    for r in self._pipelines.values()]

    def is_resident(self, key: PipelineKey) -> bool:
        with self._lock:
            resident = self._pipelines.get(key)
            return resident is not None and resident.loaded is not None

    def resident_keys(self) -> list[PipelineKey]:
        with self._lock:
            return [r.key for r in self._pipelines.values() if r.loaded is not None]

    def close(self) -> None:
        for key in list(self._pipelines):
            self.evict(key, "shutdown")
