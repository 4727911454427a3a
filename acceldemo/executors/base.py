"""What the engine asks of an executor, whether the pipeline lives here or in a worker pool."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..models.catalog import ModelSpec
from ..records import Batch, PipelineKey, ProgressCallback, Request, RunOutput


class LoadedPipeline(Protocol):
    """A pipeline placed and compiled per its key, ready to run checked requests: one, or several drawn together in
    one call (a `Batch`)."""

    def run(self, call: Request | Batch, expect_compile: bool, on_progress: ProgressCallback,
            cancelled: Callable[[], bool] = ...) -> RunOutput: ...

    def close(self) -> None: ...


class Executor(Protocol):
    """Loads pipelines somewhere (this process, a torchrun pool) and hands back a handle to run them."""

    def load(self, key: PipelineKey, spec: ModelSpec, on_progress: ProgressCallback) -> LoadedPipeline: ...

    def close(self) -> None:
        """Stop every process it started; its pipelines are gone after."""
