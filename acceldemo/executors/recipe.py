"""The model recipes applied to a loaded pipeline, and one measured pipeline call; shared by every executor."""
from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from ..config import Settings
from ..hardware import Hardware
from ..models.catalog import ModelSpec
from ..models.weights import weight_bytes
from ..records import Batch, Mode, Phase, Placement, Progress, ProgressCallback, Quantization, Request, RunOutput
from .artifacts import COUNTED, ArtifactStore, PrecompiledTransformer
from .edits import EditCall
from .prepared import PreparedPipeline
from .previews import PreviewMaker
from .remote import STORE_EVENTS
from .step_cache import step_cache
from .styles import prepare_styles, use_style

# Graphs one new shape can add to one code object: regional FLUX.1 adds 3 (its first single block sees a
# contiguous input, later ones a strided slice).
GRAPHS_PER_SHAPE = 4
# Batch sizes a compiled mode builds graphs for, per shape (a call between two runs at the next one, padded).
BUCKETS = (1, 2, 4)


def recompile_limits(settings: Settings) -> dict[str, int]:
    """Dynamo's limits sized for every shape the app allows, so a new shape never hits the default limit of 8.

    In torch 2.13 a change to dynamo's config holds only in the thread (context) that made it, so a compiled call
    runs under these limits wherever it runs (`run_pipeline`), not once at load time.
    """
    wanted = GRAPHS_PER_SHAPE * len(BUCKETS) * settings.max_shapes_per_pipeline * max(settings.max_resident_pipelines,
                                                                                        1)
    return {"recompile_limit": wanted, "accumulated_recompile_limit": 4 * wanted}


def precompiles(settings: Settings, hardware: Hardware, mode: Mode, placement: Placement,
                quantization: Quantization = Quantization.NONE) -> bool:
    """Whether mode compiled is served from saved AOTInductor packages rather than `transformer.compile`. Not for
    quantized weights: a package is exported from plain tensors, torchao's quantized ones are tensor subclasses."""
    return (settings.precompile == "auto" and mode is Mode.COMPILED and placement is Placement.DEVICE
            and quantization is Quantization.NONE and hardware.aot_artifacts
            and hardware.compile_backend == "inductor")


def compile_transformer(pipe, backend: str, mode: Mode) -> None:
    """The recipes' compile: the whole transformer, or only its repeated block, for static shapes."""
    if mode is Mode.COMPILED:
        pipe.transformer.compile(backend=backend, fullgraph=True, dynamic=False)
    elif mode is Mode.REGIONAL:
        pipe.transformer.compile_repeated_blocks(backend=backend, fullgraph=True, dynamic=False)


def apply_recipe(pipe, hardware: Hardware, mode: Mode, placement: Placement, settings: Settings, spec: ModelSpec,
                 precompiled: ArtifactStore | None = None, device: str | None = None) -> PreparedPipeline:
    """Place the pipeline on `device` (the hardware's own device string by default) or offload it, and compile its
    transformer as the model recipes do: the pipeline, prepared (see `PreparedPipeline`).

    With an artifact store, mode compiled compiles the same whole, static-shape transformer with inductor, ahead
    of time, one package per shape (see `artifacts`).
    """
    # LoRA layers before the first compile (see `styles`).
    styles = prepare_styles(pipe, spec, settings) if placement is not Placement.TP else None
    if placement is Placement.OFFLOAD:
        pipe.enable_model_cpu_offload(**hardware.offload_kwargs())
    else:
        pipe.to(device or hardware.device)
    if mode is Mode.COMPILED and precompiled is not None:
        PrecompiledTransformer.install(pipe, precompiled, spec.name, hardware, str(placement))
    else:
        compile_transformer(pipe, hardware.compile_backend, mode)
    prepared = PreparedPipeline(pipe, spec, weight_bytes=weight_bytes(pipe), styles=styles)
    prepared.seam()  # after the compile: the step caches' seam wraps the compiled call
    return prepared


def pipeline_kwargs(call: Request | Batch, output_type: str = "pil", **extra) -> dict:
    """The diffusers call for a request, or for requests drawn together: the same arguments wherever the pipeline
    runs (and in the bench).

    One CPU generator per image (seed, seed+1, ...; each request's own), so every image is the image its seed gives
    alone; on CPU, as the FLUX.2-dev recipe makes it, because out-of-tree devices have no generator of their own.
    Requests drawn together pass one prompt per image.
    """
    import torch

    batch = Batch.of(call)
    request = batch.first
    generators = [torch.Generator("cpu").manual_seed(seed) for seed in batch.seeds]
    alone = len(batch.requests) == 1 and batch.size == request.num_images
    kwargs = dict(
        prompt=request.prompt if alone else batch.prompts, height=request.height, width=request.width,
        num_inference_steps=request.steps, guidance_scale=request.guidance,
        num_images_per_prompt=request.num_images if alone else 1,
        generator=generators[0] if len(generators) == 1 else generators, output_type=output_type, **extra)
    if request.graph.max_sequence_length:
        kwargs["max_sequence_length"] = request.graph.max_sequence_length
    return kwargs


class CompileGate:
    """Lets a call that may compile run alone among this process's compiled-mode calls.

    Dynamo counts graphs and compile seconds per process, not per call; with pipelines on several devices of one
    process, two calls compiling at once would read each other's graphs. A call that may compile takes the gate
    for itself (and a second device's first visit to a shape then finds the first one's compiled artifacts);
    calls at shapes already compiled share it and run side by side.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._sharing = 0
        self._alone = False
        self._waiting_alone = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: not self._alone and not self._waiting_alone)
            self._sharing += 1
        try:
            yield
        finally:
            with self._changed:
                self._sharing -= 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        with self._changed:
            self._waiting_alone += 1
            self._changed.wait_for(lambda: not self._alone and not self._sharing)
            self._waiting_alone -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._changed:
                self._alone = False
                self._changed.notify_all()


COMPILE_GATE = CompileGate()  # one per process, as dynamo's counters are


class _CompileMeter:
    """Graphs dynamo built and seconds it spent compiling during one call, from dynamo's own counters, plus the
    precompiled packages the call built or loaded."""

    def __init__(self, precompiled: PrecompiledTransformer | None):
        self.precompiled = precompiled
        self.graphs, self.seconds, self.cache_hits = 0, 0.0, 0
        self.package_events: dict[str, int] = {}
        self.store_problem: str | None = None

    @staticmethod
    def _read() -> tuple[int, float, int]:
        from torch._dynamo.utils import compilation_time_metrics, counters

        # Inductor's FX-graph cache and AOTAutograd's cache: hits mean a persistent artifact was reused.
        hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
        return (counters["stats"]["unique_graphs"], sum(compilation_time_metrics.get("_compile.compile_inner", ())),
                hits)

    def __enter__(self) -> _CompileMeter:
        if self.precompiled is not None:
            self.precompiled.events = Counter()
        self._start = self._read()
        return self

    def __exit__(self, *exc) -> None:
        graphs, seconds, hits = self._read()
        # An AOTInductor package built is one whole graph; one loaded from disk is a persistent artifact reused.
        events = self.precompiled.events if self.precompiled is not None else Counter()
        self.graphs = graphs - self._start[0] + events["built"]
        self.seconds = seconds - self._start[1] + events["build_seconds"]
        self.cache_hits = hits - self._start[2] + events["loaded"]
        self.package_events = {str(event): events[event] for event in COUNTED if events[event]}
        if any(events[event] for event in STORE_EVENTS):  # what the call found of the shared store, for its owner
            self.store_problem = self.precompiled.store.remote.problem


def run_pipeline(prepared: PreparedPipeline, hardware: Hardware, call: Request | Batch, expect_compile: bool,
                 on_progress: ProgressCallback, cancelled: Callable[[], bool] = lambda: False,
                 output_type: str = "pil", limits: dict[str, int] | None = None,
                 cache_dir: Path | None = None) -> RunOutput:
    """One pipeline call — one request, or requests drawn together — with progress per phase; counts the graphs it
    compiled. Its images are the requests' own, in order (a padded batch's extra images dropped).

    `output_type` is diffusers' own: "pil" for people, "np" (floats in [0, 1]) to compare runs exactly; `limits`:
    dynamo's recompile limits for a compiled mode (`recompile_limits`); `cache_dir`: where a model's preview map
    fitted here is kept (a request asking for previews gets one with its denoise steps).
    """
    import torch._dynamo

    batch = Batch.of(call)
    request = batch.first
    steps = request.denoise_steps
    pipe = prepared.pipe
    started = time.perf_counter()  # restarted once the call may begin (after any wait at the compile gate)
    step_ends: list[float] = []
    previews = PreviewMaker(prepared, request, cache_dir) if request.previews and cache_dir else None
    edit: EditCall | None = None

    def on_step_end(pipeline, i, t, tensors):
        edit.after_step(i, tensors)
        step_ends.append(time.perf_counter())
        preview = previews.at_step(i + 1, tensors["latents"], step_ends[-1] - started) if previews else None
        on_progress(Progress(Phase.DENOISE, f"step {i + 1}/{steps}", i + 1, steps, step_ends[-1] - started,
                             preview=preview))
        if cancelled():
            pipeline._interrupt = True
        if i + 1 == steps:
            on_progress(Progress(Phase.DECODE, "decoding the image", elapsed=step_ends[-1] - started))
        return tensors

    precompiled = pipe.transformer.forward if isinstance(pipe.transformer.forward, PrecompiledTransformer) else None
    if precompiled is not None:  # it knows whether a shape's package is built now or loaded from disk
        precompiled.label = batch.label
        precompiled.notify = lambda phase, text: on_progress(Progress(phase, text, elapsed=time.perf_counter()
                                                                      - started))
    elif expect_compile:
        on_progress(Progress(Phase.COMPILE, f"compiling {batch.label} (first time for this shape)"))
    kwargs = pipeline_kwargs(batch, output_type, callback_on_step_end=on_step_end)
    use_style(prepared.styles, pipe, prepared.spec, request.lora, request.lora_scale)
    edit = EditCall(prepared, batch, kwargs)
    # Eager modes apply no torch.compile: nothing of theirs can compile, so they need not wait for a compile.
    gate = contextlib.nullcontext() if not request.mode.compiles else \
        COMPILE_GATE.alone() if expect_compile else COMPILE_GATE.shared()
    sized = torch._dynamo.config.patch(**limits) if limits and request.mode.compiles else contextlib.nullcontext()
    with gate, sized, _CompileMeter(precompiled) as meter, hardware.mode_context(request.mode), \
            step_cache(prepared.seam(), pipe, edit.pipe, request) as cache:
        started = time.perf_counter()
        images = edit.pipe(**kwargs).images
        hardware.synchronize()
    seconds = time.perf_counter() - started
    step_seconds = [b - a for a, b in zip(step_ends, step_ends[1:])]
    denoise = max(step_ends[-1] - cache.first_call - meter.seconds, 0.0) if step_ends and cache.first_call else None
    return RunOutput(images=list(images[:batch.images]), seconds=seconds, new_graphs=meter.graphs,
                     compile_seconds=meter.seconds, compile_cache_hits=meter.cache_hits, step_seconds=step_seconds,
                     preview_seconds=previews.spent if previews else 0.0,
                     package_events=meter.package_events, store_problem=meter.store_problem, cache=cache.use,
                     denoise_seconds=denoise, weight_bytes=prepared.weight_bytes)
