"""Where a pipeline lives, chosen from its key alone: in this process, or in a torchrun worker pool."""
from __future__ import annotations

from ..config import Settings
from ..hardware import HardwareRegistry
from ..models.catalog import ModelSpec
from ..records import PipelineKey, ProgressCallback
from .base import Executor, LoadedPipeline
from .local import LocalExecutor


class RoutingExecutor:
    """The executor the engine is given: this process for devices it can drive itself, a worker pool
    pinned to the key's devices for tensor parallelism and for devices only a process of their own can drive."""

    def __init__(self, settings: Settings, hardware: HardwareRegistry, local: Executor | None = None,
                 pools: Executor | None = None):
        self.settings, self.hardware = settings, hardware
        self.local = local or LocalExecutor(settings, hardware)
        self._pools = pools
        self._lent: Executor | None = None

    @property
    def lent(self) -> Executor:
        """The executor for a device lent per call (ZeroGPU), made on first use."""
        if self._lent is None:
            from .zerogpu import ZeroGpuExecutor

            self._lent = ZeroGpuExecutor(self.settings, self.hardware)
        return self._lent

    def executor_for(self, key: PipelineKey) -> Executor:
        if self.hardware.get(key.hardware).lent_per_call:
            return self.lent
        if not key.placement.pooled and self.hardware.get(key.hardware).in_process(key.devices):
            return self.local
        return self.pools

    @property
    def pools(self) -> Executor:
        """The pool executor, made on first use: an app that never needs a pool imports no torchrun machinery."""
        if self._pools is None:
            from .pool import PoolExecutor

            self._pools = PoolExecutor(self.settings, self.hardware)
        return self._pools

    def load(self, key: PipelineKey, spec: ModelSpec, on_progress: ProgressCallback) -> LoadedPipeline:
        return self.executor_for(key).load(key, spec, on_progress)

    def health(self) -> list:
        """Every worker pool's health (none before the first pool)."""
        return self._pools.health() if self._pools is not None else []

    def close(self) -> None:
        self.local.close()
        for executor in (self._pools, self._lent):
            if executor is not None:
                executor.close()
