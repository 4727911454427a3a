"""What a model would get on a host, present or not: the placement proposal, its tensor-parallel degree, the memory
each device holds, the mode to run and why the others do not, the batch cap. The same answer the engine gives for
this host's own hardware (`Engine.offer`), asked of a host described by kind (`trn2.48xlarge`) or by numbers."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import Settings
from ..errors import AcceldemoError, InvalidRequest, UnknownName
from ..hardware import ADAPTERS, Hardware, HostKind, host_kinds
from ..models.catalog import ModelSpec, component_bytes_at
from ..records import CFG_RANKS, Mode, Placement, Quantization, Shape, placement_label
from .validation import (
    Option,
    PlacementProposal,
    check_cfg_parallel,
    context_parallel_degrees,
    held_bytes,
    mode_options,
    propose_placement,
    tensor_parallel_options,
    whole_weights_refusal,
)

GiB = 1024**3
# The mode a plan recommends: the first the placement allows.
MODE_PREFERENCE = (Mode.COMPILED, Mode.REGIONAL, Mode.EAGER)


@dataclass(frozen=True)
class HostPlan:
    """One model on one host: where it goes, how it runs, what each device holds."""

    model: str
    host: str
    hardware: str
    devices: int
    memory_bytes: int  # per device
    quantization: Quantization
    proposal: PlacementProposal
    mode: Mode
    modes: tuple[Option, ...]
    tp_sizes: tuple[int, ...]
    weights_per_device: int
    source: str = ""
    # Context-parallel degrees that work at the planned shape, and why CFG parallel does not (None: it does).
    cp_sizes: tuple[int, ...] = ()
    cfg_refusal: str | None = None
    shape: Shape | None = None

    @property
    def degrees(self) -> dict[str, int]:
        """The ways one image is split over devices: tensor, CFG and context parallel degrees (1: not split)."""
        return {"tp": self.proposal.tp_size, "cfg": CFG_RANKS if self.proposal.placement is Placement.CFG else 1,
                "cp": self.proposal.cp_size}

    def facts(self) -> dict:
        return {"model": self.model, "host": self.host, "hardware": self.hardware, "devices": self.devices,
                "memory_gb_per_device": round(self.memory_bytes / 1e9, 1), "quantization": str(self.quantization),
                "placement": str(self.proposal.placement), "degrees": self.degrees, "mode": str(self.mode),
                "weights_gb_per_device": round(self.weights_per_device / 1e9, 2), "replicas": self.proposal.replicas,
                "batch": self.proposal.batch, "why": self.proposal.reason,
                "modes": [{"name": str(o.name), "ok": o.ok, "reason": o.reason} for o in self.modes],
                "tp_sizes": list(self.tp_sizes), "cp_sizes": list(self.cp_sizes), "cfg": self.cfg_refusal is None,
                "cfg_refusal": self.cfg_refusal, "size": str(self.shape), "source": self.source}

    def lines(self) -> list[str]:
        """The plan as a person reads it."""
        placement = placement_label(self.proposal.placement, self.proposal.tp_size, self.proposal.cp_size)
        refused = [f"{o.name} ({o.reason})" for o in self.modes if not o.ok]
        return [f"{self.model} on {self.host} ({self.devices} x {self.memory_bytes / 1e9:.1f} GB {self.hardware}"
                + (f", {self.quantization} weights" if self.quantization is not Quantization.NONE else "") + ")",
                f"  placement: {placement} — {self.proposal.reason}",
                f"  mode: {self.mode}; weights per device: {self.weights_per_device / 1e9:.1f} GB; "
                f"up to {self.proposal.batch} request(s) per call; {self.proposal.replicas} replica(s)",
                f"  tensor-parallel sizes accepted: {', '.join(map(str, self.tp_sizes)) or 'none'}; context-parallel "
                f"degrees at {self.shape}: {', '.join(map(str, self.cp_sizes)) or 'none'}; CFG parallel: "
                + ("yes" if self.cfg_refusal is None else "no"),
                *([f"  not: {'; '.join(refused)}"] if refused else [])]


def parse_memory(text: object) -> int:
    """Device memory as typed: `24GB`, `24 GiB`, `80` (GB), in bytes."""
    value = str(text).strip().lower().replace(" ", "")
    unit = 1e9
    for suffix, size in (("gib", GiB), ("gb", 1e9), ("g", 1e9)):
        if value.endswith(suffix):
            value, unit = value[: -len(suffix)], size
            break
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not 0 < number <= 10_000:
        raise InvalidRequest("device_memory", text, "a size per device such as 24GB, 24GiB or 80 (GB)")
    return int(number * unit)


def described_host(hardware: str, devices: int, memory: object, generation: str = "") -> HostKind:
    """A host described by numbers: hardware, devices, memory per device (and the chip generation, for TPU)."""
    if hardware not in ADAPTERS:
        raise UnknownName("hardware", hardware, ADAPTERS)
    if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= 1024:
        raise InvalidRequest("devices", devices, "a whole number of devices from 1 to 1024")
    size = parse_memory(memory)
    return HostKind(f"{devices} x {size / 1e9:.0f} GB {hardware}" + (f" ({generation})" if generation else ""),
                    hardware, devices, size, generation, "described by numbers")


def named_host(name: object) -> HostKind:
    known = host_kinds()
    if name not in known:
        raise UnknownName("host", name, known)
    return known[name]  # type: ignore[index]


def plan(spec: ModelSpec, host: HostKind, settings: Settings, quantization: Quantization = Quantization.NONE,
         shape: Shape | None = None) -> HostPlan:
    """The model on that host, as the engine would propose it there (at its default size, or `shape`)."""
    adapter: Hardware = ADAPTERS[host.hardware](settings, host.availability())
    found = adapter.detect()
    proposal = propose_placement(spec, found, adapter.tensor_parallel_sizes(), settings.max_batch, quantization,
                                 shape)
    modes = tuple(mode_options(spec, adapter, proposal.placement))
    usable = {o.name for o in modes if o.ok}
    mode = next(m for m in MODE_PREFERENCE if m in usable)
    held = int(held_bytes(spec, component_bytes_at(spec, quantization), proposal.placement, proposal.tp_size))
    shape = shape or spec.default_shape
    cp_sizes = tuple(context_parallel_degrees(spec, adapter, shape, 0, settings.pool_nnodes)) \
        if spec.context_parallel and whole_weights_refusal(spec, adapter, Placement.CP, quantization) is None else ()
    try:
        check_cfg_parallel(spec, adapter, spec.guidance, settings.pool_nnodes, quantization)
        cfg_refusal = None
    except AcceldemoError as error:
        cfg_refusal = str(error)
    return HostPlan(spec.name, host.name, host.hardware, found.device_count, found.memory_bytes, quantization,
                    proposal, mode, modes, tuple(tensor_parallel_options(spec, adapter, settings.pool_nnodes)), held,
                    host.source, cp_sizes, cfg_refusal, shape)
