"""The in-process executor: the pipeline lives in this process, on this process's device."""
from __future__ import annotations

import gc
import logging
import time
from pathlib import Path

from ..config import Settings
from ..hardware import Hardware, HardwareRegistry
from ..models.catalog import ModelSpec
from ..models.loading import load_pipeline
from ..records import Batch, Phase, PipelineKey, Progress, ProgressCallback, Request, RunOutput
from .artifacts import ArtifactStore
from .prepared import PreparedPipeline
from .recipe import apply_recipe, precompiles, recompile_limits, run_pipeline

log = logging.getLogger("acceldemo.executor")


class LocalPipeline:
    """A pipeline resident in this process."""

    def __init__(self, key: PipelineKey, prepared: PreparedPipeline, hardware: Hardware, limits: dict[str, int],
                 cache_dir: Path | None = None):
        self.key, self.prepared, self.hardware, self.limits = key, prepared, hardware, limits
        self.cache_dir = cache_dir

    @property
    def pipe(self):
        """The diffusers pipeline itself (for a bare call of it)."""
        return self.prepared.pipe

    def run(self, call: Request | Batch, expect_compile: bool, on_progress: ProgressCallback,
            cancelled=lambda: False) -> RunOutput:
        return run_pipeline(self.prepared, self.hardware, call, expect_compile, on_progress, cancelled,
                            limits=self.limits, cache_dir=self.cache_dir)

    def close(self) -> None:
        self.prepared = None
        gc.collect()
        self.hardware.empty_cache()


class LocalExecutor:
    """Loads pipelines into this process."""

    def __init__(self, settings: Settings, hardware: HardwareRegistry):
        self.settings, self.hardware = settings, hardware
        self.store = ArtifactStore.of(settings)

    def load(self, key: PipelineKey, spec: ModelSpec, on_progress: ProgressCallback,
             device: str | None = None) -> LocalPipeline:
        """The pipeline loaded, placed and compiled per its key; `device`: where to place it instead of the key's own
        devices (the CPU, for a GPU lent per call: `executors/zerogpu.py`)."""
        hardware = self.hardware.get(key.hardware)
        hardware.activate()
        started = time.perf_counter()
        on_progress(Progress(Phase.LOAD, f"loading {spec.title}"))
        pipe = load_pipeline(spec, self.settings, key.quantization)
        # Progress goes through our own events; diffusers' tqdm bars would only clutter logs.
        pipe.set_progress_bar_config(disable=True)
        on_progress(Progress(Phase.LOAD, f"placing on {device or key.devices} ({key.placement}, {key.mode})",
                             elapsed=time.perf_counter() - started))
        store = self.store if precompiles(self.settings, hardware, key.mode, key.placement, key.quantization) else None
        prepared = apply_recipe(pipe, hardware, key.mode, key.placement, self.settings, spec, store,
                                device or hardware.torch_device(key.devices))
        log.info("loaded %s in %.2f s", key, time.perf_counter() - started)
        return LocalPipeline(key, prepared, hardware, recompile_limits(self.settings), self.settings.cache_dir)

    def close(self) -> None:
        """Nothing of its own to stop: its pipelines are closed one by one by whoever loaded them."""
