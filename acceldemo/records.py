"""Records that cross layers: requests, shapes, progress events and results."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_SIZE = re.compile(r"^\s*(\d+)\s*[xX×]\s*(\d+)\s*$")
_DEVICES = re.compile(r"^\s*([a-z][a-z0-9_]*):(\d{1,4}(?:-\d{1,4})?(?:,\d{1,4}(?:-\d{1,4})?)*)\s*$")


@dataclass(frozen=True, order=True)
class Shape:
    """An image size as a person writes it: WIDTHxHEIGHT."""

    width: int
    height: int

    def __str__(self) -> str:
        return f"{self.width}x{self.height}"

    @staticmethod
    def parse(text: str) -> "Shape | None":
        """The shape written as WxH, or None when the text is not of that form."""
        match = _SIZE.match(str(text))
        return Shape(int(match[1]), int(match[2])) if match else None


@dataclass(frozen=True, order=True)
class DeviceSet:
    """Devices of one hardware that one pipeline occupies, as a person writes them: `cpu:0`, `cuda:3`,
    `neuron:0-1` (a group of NeuronCores for tensor parallelism), `cuda:0,2`."""

    hardware: str
    indices: tuple[int, ...]

    def __str__(self) -> str:
        first, last = self.indices[0], self.indices[-1]
        if len(self.indices) > 1 and self.indices == tuple(range(first, last + 1)):
            return f"{self.hardware}:{first}-{last}"
        return f"{self.hardware}:{','.join(map(str, self.indices))}"

    def __len__(self) -> int:
        return len(self.indices)

    def overlaps(self, other: "DeviceSet") -> bool:
        return self.hardware == other.hardware and bool(set(self.indices) & set(other.indices))

    @staticmethod
    def parse(text: str) -> "DeviceSet | None":
        """`hw:i`, `hw:i-j` or `hw:i,j,...` as a device set; None when the text is not of that form."""
        match = _DEVICES.match(str(text))
        if not match:
            return None
        indices: list[int] = []
        for part in match[2].split(","):
            low, _, high = part.partition("-")
            indices.extend(range(int(low), int(high or low) + 1))
        if not indices or len(set(indices)) != len(indices):
            return None
        return DeviceSet(match[1], tuple(sorted(indices)))


@dataclass(frozen=True)
class GenerateRequest:
    """One text-to-image request; None means the model's or the host's default."""

    prompt: str
    model: str | None = None
    hardware: str | None = None
    mode: str = "eager"
    placement: str | None = None
    tp_size: int | None = None
    # The size as a person types it, WIDTHxHEIGHT; when given it sets width and height.
    resolution: Any = None
    width: Any = None
    height: Any = None
    steps: Any = None
    guidance: Any = None
    seed: Any = 0
    num_images: Any = 1
    # A device set to run on (`cuda:1`, `neuron:0-1`); None lets the engine pick a free one.
    device: str | None = None

    @property
    def shape(self) -> Shape:
        return Shape(int(self.width), int(self.height))


@dataclass(frozen=True)
class PipelineKey:
    """What keeps one pipeline resident: a model on a device set in a mode and placement."""

    model: str
    hardware: str
    mode: str
    placement: str
    tp_size: int = 1
    devices: DeviceSet | None = None

    def __str__(self) -> str:
        where = f"tp{self.tp_size}" if self.placement == "tp" else self.placement
        return f"{self.model} · {self.devices or self.hardware} · {self.mode} · {where}"


@dataclass(frozen=True)
class Progress:
    """One progress event; phase is queue (waiting in line for a device), load, compile, denoise or decode."""

    phase: str
    message: str
    step: int | None = None
    total: int | None = None
    elapsed: float = 0.0


ProgressCallback = Callable[[Progress], None]


def no_progress(_: Progress) -> None:
    """A progress callback that drops every event."""


@dataclass(frozen=True)
class RunOutput:
    """What an executor returns for one pipeline call, before the manager adds its bookkeeping."""

    images: list
    seconds: float
    new_graphs: int
    compile_seconds: float
    compile_cache_hits: int = 0
    step_seconds: list[float] = field(default_factory=list)
    # Precompiled packages this call built, loaded or rejected as unusable (its process's store counts them).
    package_events: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerateResult:
    """A finished request: the images and the facts a person wants to see beside them."""

    request: GenerateRequest
    key: PipelineKey
    images: list
    seconds: float
    queue_wait: float
    load_seconds: float
    compile_seconds: float
    new_graphs: int
    warm: bool
    compile_cache_hits: int = 0
    step_seconds: list[float] = field(default_factory=list)
    # Words of the prompt the model was not trained on, and the sentence that tells a person so ("" if none).
    unknown_words: tuple[str, ...] = ()
    note: str = ""

    @property
    def image(self):
        return self.images[0]

    def facts(self) -> dict[str, Any]:
        """The result as plain JSON-able values (for CLI --json, the HTTP API and logs)."""
        r = self.request
        return {
            "model": r.model, "hardware": r.hardware, "mode": r.mode, "placement": r.placement,
            "tp_size": r.tp_size, "width": r.width, "height": r.height, "steps": r.steps,
            "guidance": r.guidance, "seed": r.seed, "num_images": r.num_images,
            "seconds": round(self.seconds, 4), "queue_wait": round(self.queue_wait, 4),
            "load_seconds": round(self.load_seconds, 4),
            "compile_seconds": round(self.compile_seconds, 4), "new_graphs": self.new_graphs,
            "compile_cache_hits": self.compile_cache_hits, "warm": self.warm,
            "device": str(self.key.devices or self.key.hardware),
            "unknown_words": list(self.unknown_words), "note": self.note,
        }
