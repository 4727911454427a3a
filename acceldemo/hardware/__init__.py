"""Hardware adapters by name; adding an accelerator is one new module and one line here."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ..errors import HardwareUnavailable, UnknownName
from .base import COMPILED_MODES, Availability, Hardware
from .cpu import CpuHardware
from .cuda import CudaHardware
from .neuron import NeuronHardware
from .tpu import TpuHardware

HARDWARE: dict[str, Hardware] = {hw.name: hw for hw in (CpuHardware(), CudaHardware(), NeuronHardware(), TpuHardware())}
ALL_MODES = ("eager", "eager-fused", "compiled", "regional")


def get_hardware(name: str) -> Hardware:
    """The adapter called `name`; unknown names are answered with the known ones."""
    try:
        return HARDWARE[name]
    except (KeyError, TypeError):
        raise UnknownName("hardware", name, HARDWARE) from None


def detect_all() -> dict[str, Availability]:
    """Every adapter's availability, probed side by side (each probe is a child process)."""
    with ThreadPoolExecutor(len(HARDWARE)) as pool:
        return dict(zip(HARDWARE, pool.map(Hardware.detect, HARDWARE.values())))


def require_available(name: str) -> Hardware:
    """The adapter, if its hardware is here; otherwise the reason it is not, as an error."""
    hardware = get_hardware(name)
    found = hardware.detect()
    if not found.available:
        raise HardwareUnavailable(name, found.reason)
    return hardware


def best_available() -> str:
    """The first accelerator found, else cpu: the default hardware for a request that names none."""
    found = detect_all()
    return next((n for n in ("neuron", "tpu", "cuda") if found[n].available), "cpu")


__all__ = ["ALL_MODES", "Availability", "HARDWARE", "Hardware", "best_available", "detect_all",
           "get_hardware", "require_available"]
