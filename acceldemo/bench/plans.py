"""What a bench run is asked for and what its in-process sections share: the plans (full, quick, smoke) with their
counts, the options, and the one engine of this process every in-process section sends its requests to."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..config import Settings
from ..records import GenerateParams, Request, Shape

MODEL = "tiny-flux2-klein"
PROMPT = "a red circle on a blue square"
SECTIONS = ("manager", "pool", "restart", "regional", "compiled", "revisits", "serving", "mcp", "replicas",
            "batching", "previews", "styles", "acceleration", "parallel", "fairness")
# Asked for by name only (--sections): they start Ray clusters or object stores of their own.
OPTIONAL_SECTIONS = ("fleet", "store")

def _shapes(*sizes: str) -> tuple[Shape, ...]:
    return tuple(Shape.parse(size) for size in sizes)


# Revisits. A packed-latent model compiles one graph per image-token count ((W/16)·(H/16)), so shapes with the
# same count share a graph. The full run visits 12 shapes with 12 counts: more than dynamo's default limit of 8
# graphs per code object, which the engine must have raised. --quick visits 12 shapes over 4 counts.
REVISIT_DISTINCT = _shapes("64x64", "64x128", "64x192", "128x128", "64x320", "128x192", "64x448", "128x256",
                           "192x192", "160x256", "176x256", "192x256")
REVISIT_SHARED = _shapes("64x64", "64x128", "128x64", "128x128", "64x256", "256x64", "128x192", "192x128", "96x256",
                         "256x96", "64x384", "384x64")


@dataclass(frozen=True)
class Plan:
    """How much a run measures: the compile backend of the in-process sections and the run counts."""

    name: str
    backend: str  # compile backend of this process's compiled sections on cpu (accelerators use their own)
    overhead_pairs: int
    shapes: tuple[Shape, ...]  # compiled vs eager, one figure each
    latency_runs: int
    revisit_shapes: tuple[Shape, ...]
    compile_runs: int  # regional vs whole: compiles of each, after a dynamo reset each time
    warm_runs: int
    restart_backend: str  # inductor: the backend whose persistent caches a restart reuses
    cold_runs: int
    restart_runs: int
    serving_mode: str
    serving_single: int  # requests of the one client, interleaved with in-process calls
    serving_clients: int
    serving_per_client: int
    pool_pairs: int
    replica_clients: int  # concurrent clients of each replica configuration (section 8)
    replica_per_client: int
    batch_clients: int  # concurrent clients of the one-core replica, batched and not (section 10)
    batch_per_client: int
    batch_rounds: int  # rounds of each, alternating which goes first
    batch_single: int  # requests of one client alone, interleaved between the two
    mcp_pairs: int  # rounds of one request as an MCP tool call, over /v1, and as a tool call with progress (section 15)
    notes: tuple[str, ...] = ()


PLANS = {
    "full": Plan("full", "inductor", overhead_pairs=30, shapes=_shapes("64x64", "128x128", "256x256"),
                 latency_runs=15, revisit_shapes=REVISIT_DISTINCT, compile_runs=2, warm_runs=15,
                 restart_backend="inductor", cold_runs=2, restart_runs=3, serving_mode="compiled",
                 serving_single=20, serving_clients=8, serving_per_client=5, pool_pairs=40,
                 replica_clients=8, replica_per_client=8, batch_clients=8, batch_per_client=8, batch_rounds=3,
                 batch_single=30, mcp_pairs=20),
    "quick": Plan("quick", "aot_eager", overhead_pairs=16, shapes=_shapes("64x64", "128x128"), latency_runs=6,
                  revisit_shapes=REVISIT_SHARED, compile_runs=1, warm_runs=6, restart_backend="inductor",
                  cold_runs=1, restart_runs=1, serving_mode="eager", serving_single=8, serving_clients=8,
                  serving_per_client=2, pool_pairs=4, replica_clients=8, replica_per_client=4, batch_clients=8,
                  batch_per_client=4, batch_rounds=1, batch_single=10, mcp_pairs=8,
                  notes=("--quick: the in-process compiled sections (1, 4, 5, 6) use the aot_eager backend, which "
                         "traces like inductor but runs at eager speed: compile seconds and graph counts are "
                         "real, compiled-vs-eager latencies are not; the full run uses inductor. Restart (3) "
                         "uses inductor (AOTInductor packages), one cold start and one restart. Revisits (6) use "
                         "12 shapes over 4 graphs (the full run: 12 graphs). Serving (7) runs eager.",)),
    "smoke": Plan("smoke", "eager", overhead_pairs=3, shapes=_shapes("64x64"), latency_runs=2,
                  revisit_shapes=_shapes("64x64", "64x128", "128x64"), compile_runs=1, warm_runs=2,
                  restart_backend="eager", cold_runs=1, restart_runs=1, serving_mode="eager", serving_single=2,
                  serving_clients=2, serving_per_client=1, pool_pairs=2, replica_clients=2, replica_per_client=1,
                  batch_clients=2, batch_per_client=1, batch_rounds=1, batch_single=1, mcp_pairs=2,
                  notes=("--smoke: checks that every section runs, with dynamo's 'eager' backend (tracing and "
                         "guards, no code generation) and the fewest runs; its figures are not measurements.",)),
}
RESTART_MODE = "compiled"


@dataclass(frozen=True)
class BenchOptions:
    """What `python -m acceldemo bench` was asked for."""

    plan: Plan = PLANS["full"]
    hardware: str = "cpu"
    sections: tuple[str, ...] = SECTIONS
    command: str = "python -m acceldemo bench"


class _RecordingExecutor:
    """The engine's own in-process executor, remembering the pipeline objects it loads (for the bare calls)."""

    def __init__(self, inner):
        self.inner = inner
        self.loaded = {}

    def load(self, key, spec, on_progress):
        loaded = self.inner.load(key, spec, on_progress)
        self.loaded[key] = loaded
        return loaded

    def close(self) -> None:
        self.inner.close()


class InProcessBench:
    """One engine of this process and the requests every in-process section sends it."""

    def __init__(self, options: BenchOptions, settings: Settings):
        import torch

        from ..builder import build_engine
        from ..executors.local import LocalExecutor
        from ..hardware import HardwareRegistry

        self.options, self.plan = options, options.plan
        registry = HardwareRegistry(settings)
        self.hardware = registry.get(options.hardware)
        self.executor = _RecordingExecutor(LocalExecutor(settings, registry))
        self.engine = build_engine(settings, registry, local=self.executor)
        # On a shared CPU host other processes' time slices fall into wall time at random; with one torch thread,
        # this process's CPU seconds are the call's own work. Accelerators run asynchronously: wall time there.
        self.cpu_seconds = self.hardware.name == "cpu" and torch.get_num_threads() == 1
        self.clock = time.process_time if self.cpu_seconds else time.perf_counter
        # Started by run_bench when their sections are asked for: the app server, and the pools (or why none).
        self.server = None
        self.pools = None

    def request(self, mode: str, shape: Shape, **extra) -> Request:
        return self.engine.check(GenerateParams(prompt=PROMPT, model=MODEL, hardware=self.options.hardware,
                                                 mode=mode, placement="device", resolution=shape, seed=0, **extra))

    def timed(self, request: Request, wall: bool = False) -> float:
        """Seconds of one call through the engine: on `clock`, or wall time to set beside another process."""
        clock = time.perf_counter if wall else self.clock
        started = clock()
        self.engine.generate(request)
        return clock() - started

    def bare_call(self, request: Request) -> Callable[[], float]:
        """The same call straight into diffusers, on the engine's own pipeline object: no engine, no progress."""
        from ..executors.recipe import pipeline_kwargs

        self.engine.generate(request)  # loads (and compiles) the pipeline if it is not yet
        key = next(k for k in self.executor.loaded if k.mode == request.mode and k.placement == request.placement)
        pipe = self.executor.loaded[key].pipe

        def call() -> float:
            started = self.clock()
            with self.hardware.mode_context(request.mode):
                pipe(**pipeline_kwargs(request))
                self.hardware.synchronize()
            return self.clock() - started

        return call

    def close(self) -> None:
        self.engine.close()
