"""The ZeroGPU executor: pipelines are held in this process's memory, and each draw runs inside a `spaces.GPU` call —
in the child process `spaces` forks, which the platform lends a GPU for the seconds the call asks for.

What the `spaces` package (0.51.3) makes of a call, and so what this executor keeps to:
- The child is forked from this process and reused while the platform says its GPU stayed idle. It inherits the
  pipelines loaded before it was forked (`_RESIDENT`); a pipeline loaded after is loaded again inside the child.
- The call's arguments and result cross a pipe: a pipeline's key, its `ModelSpec`, the request and the seconds asked
  go in; CPU images and the run's figures come back. Progress comes back, and Stop goes in, through a queue and
  flags made before the first fork (`_Channel`).
- Weights stay on the CPU here, where no thread may touch CUDA, and move to the GPU inside the child, once per child
  (as `spaces` itself moves what `.to("cuda")` put aside at start).
- `duration` is asked per call from the request: steps x the step time measured for this pipeline, shape and batch,
  plus a margin; before a measure, `ACCELDEMO_ZEROGPU_FIRST_S`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import multiprocessing
import os
import re
import threading
import time
from collections.abc import Callable, Iterator

from ..config import Settings
from ..errors import AcceldemoError, CapacityExceeded, DeviceBusy, GpuQuotaExceeded, UnsupportedCombination
from ..hardware import Hardware, HardwareRegistry
from ..models.catalog import ModelSpec
from ..records import VISITOR_TOKEN, Batch, GpuLease, Phase, PipelineKey, Progress, ProgressCallback, Request, RunOutput
from .local import LocalExecutor, LocalPipeline
from .recipe import precompiles

log = logging.getLogger("acceldemo.executor")

# The longest call the platform grants.
MAX_SECONDS = 1500
# The pipelines this process holds, by key: what a forked child finds already loaded.
_RESIDENT: dict[PipelineKey, LocalPipeline] = {}
# Inside a child: the keys whose weights it has moved to its GPU.
_ON_DEVICE: set[PipelineKey] = set()


class _Channel:
    """Progress from the lent GPU's processes back to this one, and Stop the other way: a queue and a row of flags
    made before the first fork (every process the platform forks inherits them), one slot per call in flight. A
    thread here reads the events, hands each to its call's listener and, once the call is stopped, raises its flag,
    which the child reads at its next step."""

    SLOTS = 64

    def __init__(self):
        context = multiprocessing.get_context("fork")
        self.events = context.SimpleQueue()
        self.stops = context.RawArray("b", self.SLOTS)
        self.lock = threading.Lock()
        self.listeners: dict[int, tuple[ProgressCallback, Callable[[], bool], threading.Event]] = {}
        self.reader: threading.Thread | None = None

    # --- in this process ------------------------------------------------------------------------------------------

    def open(self, on_progress: ProgressCallback, cancelled: Callable[[], bool]) -> int:
        with self.lock:
            slot = next((i for i in range(self.SLOTS) if i not in self.listeners), None)
            if slot is None:
                raise CapacityExceeded(f"{self.SLOTS} ZeroGPU calls are in flight already")
            self.stops[slot] = 0
            self.listeners[slot] = (on_progress, cancelled, threading.Event())
            if self.reader is None:
                self.reader = threading.Thread(target=self._read, name="zerogpu-progress", daemon=True)
                self.reader.start()
        return slot

    def close(self, slot: int, ended: bool) -> None:
        """The call returned: wait (briefly) for the child's last event, so none arrives after the result."""
        if ended:
            self.listeners[slot][2].wait(2.0)
        with self.lock:
            del self.listeners[slot]

    def _read(self) -> None:
        while True:
            slot, event = self.events.get()
            listener = self.listeners.get(slot)
            if listener is None:
                continue
            on_progress, cancelled, ended = listener
            if event is None:
                ended.set()
                continue
            try:
                on_progress(event)
                if cancelled():
                    self.stops[slot] = 1
            except Exception:  # a listener's failure must not end the reading for every call
                log.exception("a ZeroGPU progress listener failed")

    # --- in the lent GPU's process --------------------------------------------------------------------------------

    def reporter(self, slot: int) -> ProgressCallback:
        return lambda event: self.events.put((slot, event))

    def stopped(self, slot: int) -> Callable[[], bool]:
        return lambda: bool(self.stops[slot])

    def end(self, slot: int) -> None:
        self.events.put((slot, None))


_CHANNEL = _Channel()


def _asked(key: PipelineKey, spec: ModelSpec, settings: Settings, call: Request | Batch, expect_compile: bool,
           seconds: int, slot: int) -> int:
    """`spaces.GPU`'s duration: called with the draw's own arguments; the seconds were worked out before."""
    return seconds


def _draw(key: PipelineKey, spec: ModelSpec, settings: Settings, call: Request | Batch, expect_compile: bool,
          seconds: int, slot: int) -> tuple[RunOutput, int]:
    """One draw, inside the lent GPU's process: the pipeline (loaded here if this process was forked before it was
    loaded) moved to the GPU once, then run, its progress sent back and its Stop read through the channel's `slot`.
    Returns its output (PIL images: CPU data) and this process's id."""
    report = _CHANNEL.reporter(slot)
    try:
        pipeline = _RESIDENT.get(key)
        if pipeline is None:
            log.warning("%s was loaded after this GPU process was forked: loading it again here", key)
            pipeline = _RESIDENT[key] = ZeroGpuExecutor(settings, HardwareRegistry(settings)).load_on_cpu(
                key, spec, report)
        if key not in _ON_DEVICE:
            started = time.perf_counter()
            pipeline.prepared.pipe.to(pipeline.hardware.device)
            _ON_DEVICE.add(key)
            report(Progress(Phase.LOAD, f"moved to the lent GPU in {time.perf_counter() - started:.1f} s"))
        return pipeline.run(call, expect_compile, report, _CHANNEL.stopped(slot)), os.getpid()
    finally:
        _CHANNEL.end(slot)


@functools.cache
def gpu_call(size: str):
    """`_draw` wrapped in `spaces.GPU` for a slice size, made once per process (the package keeps its wrappers per
    function)."""
    import spaces

    return spaces.GPU(duration=_asked, size=size)(_draw)


# When `spaces` says to try again ("Try again in 0:01:23."), as Python writes a timedelta.
_TRY_AGAIN = re.compile(r"Try again in (?:(\d+) days?, )?(\d+):(\d\d):(\d\d)")
# What to tell a client to wait when the platform's refusal names no time.
UNNAMED_WAIT_S = 30


def platform_refusal(error: BaseException) -> AcceldemoError | None:
    """The platform's refusal to lend a GPU, as `spaces` raises it (a `gradio.Error` with a "ZeroGPU ..." title), as
    this app's own error: a spent quota is a 429 with the platform's Retry-After, no GPU free a 503; None for any
    other failure (the draw's own)."""
    title = str(getattr(error, "title", "") or "")
    message = " ".join(str(getattr(error, "message", error)).split())
    if title in ("ZeroGPU quota exceeded", "ZeroGPU pending credits exceeded"):
        wait = _TRY_AGAIN.search(message)
        days, hours, minutes, seconds = (int(part or 0) for part in wait.groups()) if wait else (0, 0, 0, 0)
        after = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
        return GpuQuotaExceeded(f"{title}: {message}", after or UNNAMED_WAIT_S)
    if title in ("ZeroGPU queue timeout", "ZeroGPU client error"):
        return DeviceBusy(f"{title}: {message}")
    return None


class _Headers(dict):
    """Request headers as `spaces` reads them from a Gradio request (a mapping with `get` and a `__dict__`)."""


class _Visitor:
    """The part of a Gradio request `spaces` reads when it asks for a GPU: the visitor's X-IP-Token header."""

    def __init__(self, token: str):
        self.headers = _Headers({"x-ip-token": token})


@contextlib.contextmanager
def _as_visitor(token: str | None) -> Iterator[None]:
    """In this thread, for the length of a `spaces.GPU` call: the Gradio request `spaces` looks for, carrying the
    visitor's token, so the platform charges that visitor's quota (none: the call is the Space's own)."""
    if token is None:
        yield
        return
    from gradio.context import LocalContext

    reset = LocalContext.request.set(_Visitor(token))
    try:
        yield
    finally:
        LocalContext.request.reset(reset)


def start_zero_gpu(settings: Settings) -> None:
    """What `spaces` does when a Gradio app launches (it wraps `gr.Blocks.launch`, which this app does not call: it
    serves through uvicorn), in the thread that imported it: the GPU function made, whatever `.to("cuda")` put aside
    packed, and the platform told the app is up (`POST /startup-report`)."""
    import spaces.zero

    gpu_call(settings.zero_gpu_size)
    spaces.zero.startup()


def _shape(batch: Batch) -> tuple[int, int, int]:
    """What a step time is measured per: the width, the height and the requests drawn together."""
    return batch.first.width, batch.first.height, len(batch.requests)


class ZeroGpuPipeline:
    """A pipeline held in this process, drawn with inside a lent GPU."""

    def __init__(self, key: PipelineKey, spec: ModelSpec, settings: Settings):
        self.key, self.spec, self.settings = key, spec, settings
        # Seconds per denoise step measured per (width, height, batch), asked for by the next call of that shape.
        self.step_seconds: dict[tuple[int, int, int], float] = {}

    def duration(self, call: Request | Batch, expect_compile: bool = False) -> int:
        """Seconds to ask the platform for: a compile's (a warm-up building a package); else steps x the step time
        measured for this shape and batch, plus the margin; before a measure, the first call's seconds."""
        batch = Batch.of(call)
        step = self.step_seconds.get(_shape(batch))
        if expect_compile:
            seconds = self.settings.zero_gpu_compile_s
        elif step is None:
            seconds = self.settings.zero_gpu_first_s
        else:
            seconds = batch.first.denoise_steps * step + self.settings.zero_gpu_margin_s
        return min(MAX_SECONDS, math.ceil(seconds))

    def run(self, call: Request | Batch, expect_compile: bool, on_progress: ProgressCallback,
            cancelled=lambda: False) -> RunOutput:
        seconds = self.duration(call, expect_compile)
        on_progress(Progress(Phase.QUEUE, f"asking ZeroGPU for a {self.settings.zero_gpu_size} GPU for {seconds} s"))
        started = time.perf_counter()
        slot, ended = _CHANNEL.open(on_progress, cancelled), False
        try:
            with _as_visitor(VISITOR_TOKEN.get()):
                output, pid = gpu_call(self.settings.zero_gpu_size)(self.key, self.spec, self.settings, call,
                                                                     expect_compile, seconds, slot)
            ended = True
        except Exception as error:
            refusal = platform_refusal(error)
            if refusal is None:
                raise
            raise refusal from None
        finally:
            _CHANNEL.close(slot, ended)
        used = time.perf_counter() - started
        if output.step_seconds:
            self.step_seconds[_shape(Batch.of(call))] = max(output.step_seconds)
        output = dataclasses.replace(output, gpu_lease=GpuLease(self.settings.zero_gpu_size, seconds, used,
                                                                   output.seconds, pid))
        log.info("%s drew on a ZeroGPU %s slice: asked %d s, used %.2f s (process %d)", self.key,
                 self.settings.zero_gpu_size, seconds, used, pid)
        return output

    def close(self) -> None:
        _RESIDENT.pop(self.key, None)


class ZeroGpuExecutor:
    """Loads pipelines into this process's memory, on the CPU, for draws inside `spaces.GPU` calls."""

    def __init__(self, settings: Settings, hardware: HardwareRegistry):
        self.settings, self.hardware = settings, hardware
        self.local = LocalExecutor(settings, hardware)

    def load_on_cpu(self, key: PipelineKey, spec: ModelSpec, on_progress: ProgressCallback) -> LocalPipeline:
        """The pipeline as `LocalExecutor` loads it, placed on the CPU: it moves to the lent GPU in the child."""
        hardware: Hardware = self.hardware.get(key.hardware)
        if key.mode.compiles and not precompiles(self.settings, hardware, key.mode, key.placement, key.quantization):
            raise UnsupportedCombination("quantization", f"{key.mode} with {key.quantization} weights is not possible "
                                                         f"on {hardware.name}: only plain weights are packaged ahead "
                                                         "(AOTInductor), and a JIT compile would die with each "
                                                         "process the platform forks")
        return self.local.load(key, spec, on_progress, device="cpu")

    def load(self, key: PipelineKey, spec: ModelSpec, on_progress: ProgressCallback) -> ZeroGpuPipeline:
        _RESIDENT[key] = self.load_on_cpu(key, spec, on_progress)
        return ZeroGpuPipeline(key, spec, self.settings)

    def close(self) -> None:
        _RESIDENT.clear()
