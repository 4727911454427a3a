"""The one interface every hardware adapter fills in: what it is, as data, and the few hooks where it differs."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

GiB = 1024**3
PROBE_TIMEOUT_S = float(os.environ.get("ACCELDEMO_PROBE_TIMEOUT_S", "60"))


@dataclass(frozen=True)
class Availability:
    """Whether a hardware is usable here; `reason` says why not, or describes it when it is."""

    available: bool
    reason: str
    device_count: int = 0
    memory_bytes: int = 0  # per device
    # The chip generation as its package names it ("TPU v6e"), where the hardware has generations that differ.
    generation: str = ""


# Modes that compile the transformer (every hardware offers both); the eager modes are each adapter's own.
COMPILED_MODES = ("compiled", "regional")


class Hardware:
    """One accelerator kind. Subclasses declare class attributes and override only what differs."""

    name: ClassVar[str]
    device: ClassVar[str]
    eager_modes: ClassVar[tuple[str, ...]] = ("eager",)
    compile_backend: ClassVar[str]
    dist_backend: ClassVar[str]
    mesh_device_type: ClassVar[str]
    # Environment variable -> sub-folder of the app cache dir holding this hardware's compiled artifacts.
    cache_env: ClassVar[Mapping[str, str]] = {}
    # Whether mode "compiled" can be served from saved AOTInductor packages (see executors/artifacts.py).
    aot_artifacts: ClassVar[bool] = False
    # The out-of-tree PyTorch backend package, when the device is not built into torch.
    package: ClassVar[str | None] = None
    # Used when the probe cannot read device memory; overridable with ACCELDEMO_<NAME>_MEMORY_GB.
    default_memory_bytes: ClassVar[int] = 0

    def __init__(self) -> None:
        self._detected: Availability | None = None
        self._lock = threading.Lock()

    @property
    def modes(self) -> tuple[str, ...]:
        return self.eager_modes + COMPILED_MODES

    def detect(self) -> Availability:
        """Is it here? Probed once, in a child process, so an aborting backend cannot take us down."""
        with self._lock:
            if self._detected is None:
                self._detected = self._with_memory_override(self._precheck() or self._probe())
            return self._detected

    def _with_memory_override(self, found: Availability) -> Availability:
        override = os.environ.get(f"ACCELDEMO_{self.name.upper()}_MEMORY_GB")
        if not found.available or not override:
            return found
        return dataclasses.replace(found, memory_bytes=int(float(override) * GiB))

    def _precheck(self) -> Availability | None:
        """Cheap checks done without importing torch; an Availability ends detection early."""
        if self.package and importlib.util.find_spec(self.package) is None:
            return Availability(False, f"{self.package} is not installed")
        return None

    # Python run in a fresh interpreter; it must print one JSON object:
    # {"available": bool, "reason": str, "device_count": int, "memory_bytes": int, "generation": str}.
    probe_code: ClassVar[str] = ""

    def _probe(self) -> Availability:
        env = dict(os.environ)
        try:
            done = subprocess.run(
                [sys.executable, "-c", self.probe_code], capture_output=True, text=True,
                timeout=PROBE_TIMEOUT_S, env=env, stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return Availability(False, f"probing {self.name} did not finish within {PROBE_TIMEOUT_S:.0f} s")
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return Availability(False, f"probing {self.name} failed (exit {done.returncode}): {tail[:300]}")
        found = json.loads(lines[-1])
        memory = int(found.get("memory_bytes") or self.default_memory_bytes)
        return Availability(bool(found["available"]), str(found["reason"]), int(found.get("device_count", 0)), memory,
                            str(found.get("generation", "")))

    def activate(self) -> None:
        """Make the device usable in this process. With autoload on, `import torch` already did it."""
        if self.package and os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "0":
            importlib.import_module(self.package)

    def mode_context(self, mode: str) -> contextlib.AbstractContextManager:
        """Process state a mode needs while a pipeline of that mode runs (TPU's eager flavours)."""
        return contextlib.nullcontext()

    def offload_kwargs(self) -> dict:
        """Arguments to `enable_model_cpu_offload`; the recipe lets diffusers find the device itself."""
        return {}

    def tensor_parallel_sizes(self) -> tuple[int, ...] | None:
        """The processes per host this hardware's launcher accepts here; None when any number works."""
        return None

    def tensor_parallel_refusal(self, per_host: int) -> str | None:
        """Why `per_host` tensor-parallel processes per host cannot be launched here, or None when they can."""
        sizes = self.tensor_parallel_sizes()
        if sizes is None or per_host in sizes:
            return None
        listed = ", ".join(map(str, sizes[:-1])) + f" or {sizes[-1]}" if len(sizes) > 1 else str(sizes[0])
        return f"{self.detect().generation or self.name} runs tensor parallel on {listed} chips — " \
               f"{per_host} is not one of them"

    def launcher_env(self, nproc_per_node: int) -> dict[str, str]:
        """Environment torchrun's processes need on this hardware, beyond torchrun's own."""
        return {}

    def prepare_rank(self, local_rank: int) -> None:
        """Per-rank set-up before the process group starts (e.g. which core a rank owns)."""

    def toolchain(self) -> str:
        """What compiled machine code for this hardware depends on besides the model: torch and the CPU's ISA
        (the host code of every inductor package); accelerators add their own."""
        import torch

        return f"torch {torch.__version__}, cpu {torch.backends.cpu.get_cpu_capability()}"

    def empty_cache(self) -> None:
        """Give freed device memory back after an eviction."""

    def synchronize(self) -> None:
        """Wait for queued device work, so timings measure the work and not its dispatch."""


def probe_script(body: str) -> str:
    """Wrap a probe body so any exception still prints a JSON answer with the reason."""
    return (
        "import json\n"
        "def _probe():\n"
        + "".join(f"    {line}\n" for line in body.strip().splitlines())
        + "try:\n    out = _probe()\n"
        "except Exception as e:\n    out = {'available': False, 'reason': f'{type(e).__name__}: {e}'}\n"
        "print(json.dumps(out))\n"
    )


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for a block and restore them after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
