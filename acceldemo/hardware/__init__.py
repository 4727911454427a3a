"""Hardware adapters by name: every module of this package that defines one, and every installed plugin; and the
registry of them one engine (or one worker process) asks, built from its `Settings`.

Adding an accelerator is one new module here (or, outside the project, a package that declares its adapter under
the entry-point group `acceldemo.hardware`, as vLLM's platform plugins do). Everything else — the CLI's choices,
the page's dropdowns, the bench, validation — reads the names, modes and preference order from here.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import os
import pkgutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from ..config import Settings
from ..errors import HardwareUnavailable, UnknownName
from ..records import COMPILED_MODES, Mode
from .base import Availability, Device, Hardware, HostKind

log = logging.getLogger("acceldemo.hardware")
PLUGIN_GROUP = "acceldemo.hardware"

# The adapter classes by name, in name order: what the product knows of each hardware, before any host is asked.
ADAPTERS: dict[str, type[Hardware]] = {}


def register(adapter: type[Hardware]) -> type[Hardware]:
    """Add an adapter class (registries built afterwards include it); a second class of one name is refused."""
    if adapter.name in ADAPTERS and ADAPTERS[adapter.name] is not adapter:
        raise ValueError(f"hardware {adapter.name!r} is already registered by {ADAPTERS[adapter.name]}")
    ADAPTERS[adapter.name] = adapter
    for name in sorted(ADAPTERS):
        ADAPTERS[name] = ADAPTERS.pop(name)
    return adapter


def unregister(name: str) -> None:
    """Forget an adapter class (a plugin a test registered for a while)."""
    ADAPTERS.pop(name, None)


def _adapters_in(module) -> list[type[Hardware]]:
    return [cls for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, Hardware) and cls.__module__ == module.__name__ and "name" in cls.__dict__]


def _discover() -> None:
    for found in pkgutil.iter_modules(__path__):
        if found.name != "base":
            for cls in _adapters_in(importlib.import_module(f"{__name__}.{found.name}")):
                register(cls)
    for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        try:
            loaded = entry.load()
            register(loaded if inspect.isclass(loaded) else type(loaded))
        except Exception as error:  # a broken plugin must not take the app down; it is named in the log
            log.error("hardware plugin %s (%s) could not be loaded: %s: %s", entry.name, entry.value,
                      type(error).__name__, error)


def hardware_names() -> tuple[str, ...]:
    return tuple(ADAPTERS)


def host_kinds() -> dict[str, HostKind]:
    """Every host kind an adapter knows, by name (`python -m acceldemo plan --host NAME`)."""
    return {kind.name: kind for adapter in ADAPTERS.values() for kind in adapter.host_kinds}


def all_modes() -> tuple[Mode, ...]:
    """Every mode some hardware offers: the eager flavours in the order adapters declare them, then the compiled."""
    eager = dict.fromkeys(mode for adapter in ADAPTERS.values() for mode in adapter.eager_modes)
    return (*eager, *COMPILED_MODES)


def mode_note(mode: Mode) -> str:
    """What a mode means, as the adapter that offers it says."""
    return next((adapter.mode_notes[mode] for adapter in ADAPTERS.values() if mode in adapter.mode_notes), str(mode))


def offered_by(mode: Mode) -> list[str]:
    """The hardware that offers a mode."""
    return [name for name, adapter in ADAPTERS.items() if mode in adapter.offered_modes()]


class HardwareRegistry:
    """One adapter of every known hardware, each answering under the same settings; probes run once, when first
    asked, and their answers are kept. `found`: each hardware's availability as another place knows it (a Ray
    cluster's resources, see `Hardware.in_cluster`), instead of this host's probes."""

    def __init__(self, settings: Settings, found: dict[str, Availability] | None = None):
        self.settings = settings
        self._adapters = {name: adapter(settings, (found or {}).get(name)) for name, adapter in ADAPTERS.items()}
        self._best: str | None = None
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[Hardware]:
        return iter(self._adapters.values())

    def names(self) -> tuple[str, ...]:
        return tuple(self._adapters)

    def get(self, name: object) -> Hardware:
        """The adapter called `name`; unknown names are answered with the known ones."""
        try:
            return self._adapters[name]  # type: ignore[index]
        except (KeyError, TypeError):
            raise UnknownName("hardware", name, self._adapters) from None

    def detect_all(self) -> dict[str, Availability]:
        """Every adapter's availability, probed side by side (each probe is a child process) the first time."""
        with ThreadPoolExecutor(len(self._adapters)) as pool:
            # Each adapter's own detect (the CPU's reads the host, and keeps what it found out of `_detected`).
            return dict(zip(self._adapters, pool.map(lambda hardware: hardware.detect(), self._adapters.values())))

    def require_available(self, name: object) -> Hardware:
        """The adapter, if its hardware is here; otherwise the reason it is not, as an error."""
        hardware = self.get(name)
        found = hardware.detect()
        if not found.available:
            raise HardwareUnavailable(hardware.name, found.reason)
        return hardware

    def best_available(self) -> str:
        """The most preferred hardware found (accelerators before cpu): the default for a request that names none."""
        with self._lock:
            if self._best is None:
                found = self.detect_all()
                self._best = max((hw for hw in self if found[hw.name].available), key=lambda hw: hw.preference).name
            return self._best

    def devices(self) -> list[Device]:
        """Every device of every hardware found here."""
        return [device for hardware in self for device in hardware.devices()]

    def toolchain_here(self, name: str) -> str | None:
        """The toolchain compiled code for `name` needs, where that hardware is here; None where it is not."""
        adapter = self._adapters.get(name)
        return adapter.toolchain() if adapter is not None and adapter.detect().available else None


def prepare_process(settings: Settings) -> None:
    """What a process of the app does once, before the first `import torch`: point every compiler cache at the app's
    cache dir, and keep a broken accelerator backend from aborting torch. An operator's own setting of any variable
    wins. Called by the entry points (app.py, the CLI, a pool's ranks), never on import."""
    from .tpu import tpu_autoload_would_abort
    from .zerogpu import zero_gpu_on

    if zero_gpu_on():
        # The platform's rule: `spaces` before torch, so it can patch torch before CUDA is touched.
        try:
            import spaces  # noqa: F401
        except ImportError as error:
            raise RuntimeError("SPACES_ZERO_GPU is set but the spaces package cannot be imported "
                               f"(pip install spaces==0.51.3): {error}") from error
    for adapter in ADAPTERS.values():
        for variable, folder in adapter.cache_env.items():
            os.environ.setdefault(variable, str(settings.cache_dir / folder))
        for variable, value in (adapter.store_env(settings.artifacts) if settings.artifacts else {}).items():
            os.environ.setdefault(variable, value)
    if tpu_autoload_would_abort():
        os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
        log.warning("torch_tpu is installed without libtpu: backend autoload turned off so torch can load")
    # torchao (quantized weights) warns at import about each CUDA kernel library a CPU build cannot load, about enums
    # it registers with torch's pytree, and diffusers about torchao classes of older releases it cannot import: none
    # of them is used here, and each is printed by every process that imports diffusers.
    for name in ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"):
        logging.getLogger(name).setLevel(logging.ERROR)


_discover()

__all__ = ["ADAPTERS", "Availability", "Device", "Hardware", "HardwareRegistry", "HostKind", "all_modes",
           "hardware_names", "host_kinds", "mode_note", "offered_by", "prepare_process", "register", "unregister"]
