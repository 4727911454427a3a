"""The recipes of SPEC §1 applied to a loaded pipeline, and one measured pipeline call; shared by every executor."""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..config import Settings
from ..hardware import Hardware
from ..models.catalog import ModelSpec
from ..records import GenerateRequest, Progress, ProgressCallback, RunOutput
from . import artifacts
from .artifacts import ArtifactStore, PrecompiledTransformer

# Graphs one new shape can add to one code object: regional FLUX.1 adds 3 (FACTS.md).
GRAPHS_PER_SHAPE = 4


def size_recompile_limit(settings: Settings) -> None:
    """Give dynamo room for every shape the app allows, so a new shape never hits the default limit of 8."""
    import torch._dynamo

    wanted = GRAPHS_PER_SHAPE * settings.max_shapes_per_pipeline * max(settings.max_resident_pipelines, 1)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, wanted)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * wanted)


def precompiles(settings: Settings, hardware: Hardware, mode: str, placement: str) -> bool:
    """Whether mode compiled is served from saved AOTInductor packages rather than `transformer.compile`."""
    return (settings.precompile == "auto" and mode == "compiled" and placement == "device"
            and hardware.aot_artifacts and hardware.compile_backend == "inductor")


def apply_recipe(pipe, hardware: Hardware, mode: str, placement: str, precompiled: ArtifactStore | None = None,
                 model: str = "") -> None:
    """Place the pipeline and compile its transformer exactly as the brief's recipes do.

    With an artifact store, mode compiled compiles the same whole, static-shape transformer with inductor, ahead
    of time, one package per shape (see `artifacts`).
    """
    if placement == "offload":
        pipe.enable_model_cpu_offload(**hardware.offload_kwargs())
    else:
        pipe.to(hardware.device)
    if mode == "compiled" and precompiled is not None:
        PrecompiledTransformer.install(pipe, precompiled, model, hardware)
    elif mode == "compiled":
        pipe.transformer.compile(backend=hardware.compile_backend, fullgraph=True, dynamic=False)
    elif mode == "regional":
        pipe.transformer.compile_repeated_blocks(backend=hardware.compile_backend, fullgraph=True, dynamic=False)


@dataclass
class _CompileMeter:
    """Graphs dynamo built and seconds it spent compiling, read from dynamo's own counters."""

    graphs: int = 0
    seconds: float = 0.0
    cache_hits: int = 0

    @staticmethod
    def _read() -> tuple[int, float, int]:
        from torch._dynamo.utils import compilation_time_metrics, counters

        # Inductor's FX-graph cache and AOTAutograd's cache: hits mean a persistent artifact was reused.
        # An AOTInductor package built is one whole graph; one loaded from disk is a persistent artifact reused.
        hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"] \
            + artifacts.counters["loaded"]
        return (counters["stats"]["unique_graphs"] + artifacts.counters["built"],
                sum(compilation_time_metrics.get("_compile.compile_inner", ())) + artifacts.counters["build_seconds"],
                hits)

    def __enter__(self) -> "_CompileMeter":
        self._start = self._read()
        return self

    def __exit__(self, *exc) -> None:
        graphs, seconds, hits = self._read()
        self.graphs, self.seconds, self.cache_hits = graphs - self._start[0], seconds - self._start[1], \
            hits - self._start[2]


def run_pipeline(pipe, spec: ModelSpec, hardware: Hardware, request: GenerateRequest, expect_compile: bool,
                 on_progress: ProgressCallback, cancelled=lambda: False, output_type: str = "pil") -> RunOutput:
    """One pipeline call with progress per phase; counts the graphs it compiled.

    `output_type` is diffusers' own: "pil" for people, "np" (floats in [0, 1]) to compare runs exactly.
    """
    import torch

    steps = int(request.steps)
    started = time.perf_counter()
    step_ends: list[float] = []

    def on_step_end(pipeline, i, t, tensors):
        step_ends.append(time.perf_counter())
        on_progress(Progress("denoise", f"step {i + 1}/{steps}", i + 1, steps, step_ends[-1] - started))
        if cancelled():
            pipeline._interrupt = True
        if i + 1 == steps:
            on_progress(Progress("decode", "decoding the image", elapsed=step_ends[-1] - started))
        return tensors

    precompiled = pipe.transformer.forward if isinstance(pipe.transformer.forward, PrecompiledTransformer) else None
    if precompiled is not None:  # it knows whether a shape's package is built now or loaded from disk
        precompiled.label = f"{request.width}x{request.height}"
        precompiled.notify = lambda phase, text: on_progress(Progress(phase, text, elapsed=time.perf_counter()
                                                                      - started))
    elif expect_compile:
        on_progress(Progress("compile", f"compiling {request.width}x{request.height} (first time for this shape)"))
    kwargs = dict(
        prompt=request.prompt, height=int(request.height), width=int(request.width), num_inference_steps=steps,
        guidance_scale=float(request.guidance), num_images_per_prompt=int(request.num_images),
        generator=torch.Generator("cpu").manual_seed(int(request.seed)), output_type=output_type,
        callback_on_step_end=on_step_end)
    if spec.max_sequence_length:
        kwargs["max_sequence_length"] = spec.max_sequence_length
    with _CompileMeter() as meter, hardware.mode_context(request.mode):
        images = pipe(**kwargs).images
        hardware.synchronize()
    seconds = time.perf_counter() - started
    step_seconds = [b - a for a, b in zip(step_ends, step_ends[1:])]
    return RunOutput(images=images, seconds=seconds, new_graphs=meter.graphs, compile_seconds=meter.seconds,
                     compile_cache_hits=meter.cache_hits, step_seconds=step_seconds)
