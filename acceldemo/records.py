"""Records that cross layers: requests, shapes, progress events and results."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_SIZE = re.compile(r"^\s*(\d+)\s*[xX×]\s*(\d+)\s*$")


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


@dataclass(frozen=True)
class GenerateRequest:
    """One text-to-image request; None means the model's or the host's default."""

    prompt: str
    model: str | None = None
    hardware: str | None = None
    mode: str = "eager"
    placement: str | None = None
    tp_size: int | None = None
    width: Any = None
    height: Any = None
    steps: Any = None
    guidance: Any = None
    seed: Any = 0
    num_images: Any = 1

    @property
    def shape(self) -> Shape:
        return Shape(int(self.width), int(self.height))


@dataclass(frozen=True)
class PipelineKey:
    """What keeps one pipeline resident: a model on a hardware in a mode and placement."""

    model: str
    hardware: str
    mode: str
    placement: str
    tp_size: int = 1

    def __str__(self) -> str:
        where = f"tp{self.tp_size}" if self.placement == "tp" else self.placement
        return f"{self.model} · {self.hardware} · {self.mode} · {where}"


@dataclass(frozen=True)
class Progress:
    """One progress event; phase is load, compile, denoise or decode (or wait for the device)."""

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
        }
