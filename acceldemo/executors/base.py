"""What the session manager asks of an executor, whether the pipeline lives here or in a worker pool."""
from __future__ import annotations

from typing import Protocol

from ..models.catalog import ModelSpec
from ..records import GenerateRequest, PipelineKey, ProgressCallback, RunOutput


class LoadedPipeline(Protocol):
    """A pipeline placed and compiled per its key, ready to run requests."""

    def run(self, request: GenerateRequest, expect_compile: bool, on_progress: ProgressCallback,
            cancelled=...) -> RunOutput: ...

    def close(self) -> None: ...


class Executor(Protocol):
    """Loads pipelines somewhere (this process, a torchrun pool) and hands back a handle to run them."""

    def load(self, key: PipelineKey, spec: ModelSpec, on_progress: ProgressCallback) -> LoadedPipeline: ...

    def close(self) -> None:
        """Stop every process it started; its pipelines are gone after."""
