"""Hardware adapters by name: every module of this package that defines one, and every installed plugin.

Adding an accelerator is one new module here (or, outside the project, a package that declares its adapter under
the entry-point group `acceldemo.hardware`, as vLLM's platform plugins do). Everything else — the CLI's choices,
the page's dropdowns, the bench, validation — reads the names, modes and preference order from this registry.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import pkgutil
from concurrent.futures import ThreadPoolExecutor

from ..errors import HardwareUnavailable, UnknownName
from .base import COMPILED_MODES, Availability, Device, Hardware

log = logging.getLogger("acceldemo.hardware")
PLUGIN_GROUP = "acceldemo.hardware"

HARDWARE: dict[str, Hardware] = {}


def register(hardware: Hardware) -> Hardware:
    """Add an adapter to the registry (kept in name order); a second adapter of one name is refused."""
    if hardware.name in HARDWARE and type(HARDWARE[hardware.name]) is not type(hardware):
        raise ValueError(f"hardware {hardware.name!r} is already registered by {type(HARDWARE[hardware.name])}")
    HARDWARE[hardware.name] = hardware
    for name in sorted(HARDWARE):
        HARDWARE[name] = HARDWARE.pop(name)
    return hardware


def _adapters_in(module) -> list[type[Hardware]]:
    return [cls for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, Hardware) and cls.__module__ == module.__name__ and "name" in cls.__dict__]


def _discover() -> None:
    for found in pkgutil.iter_modules(__path__):
        if found.name != "base":
            for cls in _adapters_in(importlib.import_module(f"{__name__}.{found.name}")):
                register(cls())
    for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        try:
            loaded = entry.load()
            register(loaded() if inspect.isclass(loaded) else loaded)
        except Exception as error:  # a broken plugin must not take the app down; it is named in the log
            log.error("hardware plugin %s (%s) could not be loaded: %s: %s", entry.name, entry.value,
                      type(error).__name__, error)


def get_hardware(name: str) -> Hardware:
    """The adapter called `name`; unknown names are answered with the known ones."""
    try:
        return HARDWARE[name]
    except (KeyError, TypeError):
        raise UnknownName("hardware", name, HARDWARE) from None


def hardware_names() -> tuple[str, ...]:
    return tuple(HARDWARE)


def all_modes() -> tuple[str, ...]:
    """Every mode some hardware offers: the eager flavours in the order adapters declare them, then the compiled."""
    eager = dict.fromkeys(mode for hardware in HARDWARE.values() for mode in hardware.eager_modes)
    return (*eager, *COMPILED_MODES)


def mode_note(mode: str) -> str:
    """What a mode means, as the adapter that offers it says."""
    return next((hw.mode_notes[mode] for hw in HARDWARE.values() if mode in hw.mode_notes), mode)


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
    """The most preferred hardware found (accelerators before cpu): the default for a request that names none."""
    found = detect_all()
    return max((hw for hw in HARDWARE.values() if found[hw.name].available), key=lambda hw: hw.preference).name


_discover()

__all__ = ["COMPILED_MODES", "HARDWARE", "Availability", "Device", "Hardware", "all_modes", "best_available",
           "detect_all", "get_hardware", "hardware_names", "mode_note", "register", "require_available"]
