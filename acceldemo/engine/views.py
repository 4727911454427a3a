"""The engine's views, the one picture every front end renders: `Description` (what this host offers: hardware,
models, modes and why not) and `Snapshot` (what runs now: the start-up warm-up, the line, counters, devices, replicas,
pipelines and their shapes); and `as_json`, the one place they become JSON."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path

from ..hardware import Device
from ..records import DeviceSet, EditMethod, Mode, PipelineKey, ReplicaState, Shape
from .ledger import CompiledShape
from .stats import Counters
from .validation import Option, PlacementProposal


class StartupState(enum.StrEnum):
    """The start-up warm-up (`--warmup`)."""

    NONE = "none configured"
    WARMING = "warming"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Startup:
    """The start-up warm-up: what it warms or how it ended, and whether /ready stopped waiting for it."""

    state: StartupState = StartupState.NONE
    detail: str = ""
    # /ready stopped waiting (ACCELDEMO_WARMUP_TIMEOUT_S) while the warm-up still runs.
    overdue_after_s: float | None = None

    @property
    def ready(self) -> bool:
        return self.state is not StartupState.WARMING or self.overdue_after_s is not None

    @property
    def shown(self) -> str:
        if self.state is StartupState.NONE:
            return str(self.state)
        text = f"{self.state}: {self.detail}" if self.state is not StartupState.WARMING else \
            f"warming {self.detail}"
        if self.state is StartupState.WARMING and self.overdue_after_s is not None:
            text += (f"; still going after {self.overdue_after_s:.0f} s (ACCELDEMO_WARMUP_TIMEOUT_S): serving "
                     "meanwhile, requests for that device wait for it")
        return text


@dataclass(frozen=True)
class PipelineView:
    """One pipeline the engine has known, resident or evicted, with its compiled shapes."""

    key: PipelineKey
    resident: bool
    busy: bool
    load_seconds: float
    shapes: tuple[CompiledShape, ...]


@dataclass(frozen=True)
class DeviceView:
    """One device: what runs on it, how many wait for it, which pipelines it holds."""

    device: Device
    running: str | None  # what the job on it is, None when idle
    waiting: int
    pipelines: tuple[str, ...]


@dataclass(frozen=True)
class ReplicaView:
    """One replica (a device set that holds pipelines) as a person sees it."""

    devices: DeviceSet
    state: ReplicaState
    shown: str  # the state in words: idle, loading, compiling WxH, busy, restarting, down: <why>
    waiting: int
    shapes: tuple[Shape, ...]  # the shapes its pipelines hold compiled
    served: int
    last_latency: float | None
    restarts: int
    pipelines: tuple[str, ...]
    # The host it runs on (on a Ray cluster: host name/Ray node id).
    node: str = ""
    # Its name where a serving system names it (a Ray Serve replica id); empty on a single host.
    replica: str = ""


@dataclass(frozen=True)
class Snapshot:
    """What runs here now: the /status content, and what the page's panels show."""

    startup: Startup
    queue_depth: int
    queue_limit: int
    counters: Counters
    devices: tuple[DeviceView, ...]
    replicas: tuple[ReplicaView, ...]
    pipelines: tuple[PipelineView, ...]
    precompiled: dict
    # The shared artifact store (ACCELDEMO_ARTIFACTS): url, reachable, error and since when, what was fetched,
    # published, rejected and failed; None without one.
    artifacts_store: dict | None = None
    # Models being fetched from the Hub now (ACCELDEMO_DOWNLOAD): model, repo, done_bytes, total_bytes, files.
    downloads: tuple[dict, ...] = ()


@dataclass(frozen=True)
class Offer:
    """What one model can do on one hardware here: the proposed placement, each mode with why not, TP sizes."""

    model: str
    hardware: str
    available: bool
    reason: str  # why the hardware is absent, when it is
    proposal: PlacementProposal | None
    modes: tuple[Option, ...]
    tp_sizes: tuple[int, ...]
    # Each quantization with why it is refused on this hardware (None: offered), and the weight bytes it leaves.
    quantizations: tuple[dict, ...] = ()


@dataclass(frozen=True)
class HardwareView:
    name: str
    available: bool
    reason: str
    generation: str
    devices: tuple[Device, ...]
    modes: tuple[Mode, ...]
    compile_backend: str
    dist_backend: str


@dataclass(frozen=True)
class ModelView:
    name: str
    title: str
    pipeline: str
    repo: str | None
    description: str
    steps: int
    guidance: float
    default_size: Shape
    presets: tuple[Shape, ...]
    only_presets: bool
    granularity: int
    example_prompts: tuple[str, ...]
    available: bool  # its weights are on this host
    availability: str
    default: bool
    offers: tuple[Offer, ...]  # one per hardware found here
    # Its LoRA styles (name, rank, layers, bytes), and how it edits a picture ("strength" or "reference") and
    # whether it takes a mask.
    loras: tuple[dict, ...] = ()
    edits: EditMethod = EditMethod.STRENGTH
    inpaints: bool = False
    # Each step cache: the model's preset (name, title, params, why; `eager_only` for diffusers' block hooks) or why
    # it is refused; and what `auto` picks (cache, from_steps, why).
    step_caches: tuple[dict, ...] = ()
    cache_advice: dict | None = None


@dataclass(frozen=True)
class Description:
    """What this host offers: every hardware (absent ones with the reason), every model with its offers here."""

    hardware: tuple[HardwareView, ...]
    models: tuple[ModelView, ...]
    default_model: str
    default_hardware: str
    pool_nodes: int
    precompiled: dict

    def model(self, name: str) -> ModelView:
        return next(m for m in self.models if m.name == name)


def as_json(value):
    """A view as JSON values: enums by their value, shapes, device sets and keys as a person writes them, devices
    with their memory in GB."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Shape | DeviceSet | PipelineKey | Path):
        return str(value)
    if isinstance(value, Device):
        return {"device": str(value), "hardware": value.hardware, "index": value.index,
                "memory_gb": round(value.memory_bytes / 1e9, 1), "detail": value.detail}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: as_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {**fields, **_derived(value)}
    if isinstance(value, dict):
        return {str(as_json(k)): as_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [as_json(v) for v in value]
    if isinstance(value, float):
        return round(value, 4)
    return value


def _derived(value) -> dict:
    """Properties a client wants beside a view's fields."""
    if isinstance(value, Startup):
        return {"ready": value.ready, "shown": value.shown}
    if isinstance(value, PipelineView):
        key = value.key
        return {"model": key.model, "hardware": key.hardware, "device": str(key.devices), "mode": key.mode.value,
                "placement": key.placement.value, "tp_size": key.tp_size, "quantization": key.quantization.value}
    return {}
