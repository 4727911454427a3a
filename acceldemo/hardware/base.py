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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from ..config import Settings
from ..records import COMPILED_MODES, DeviceSet, Mode, Placement, Quantization

GiB = 1024**3
# Probe answers of this process, by adapter class and probe (see Hardware._probe).
_PROBED: dict[tuple[type, str], Availability] = {}
_PROBING: dict[tuple[type, str], threading.Lock] = {}
_PROBED_LOCK = threading.Lock()


@dataclass(frozen=True)
class Availability:
    """Whether a hardware is usable here; `reason` says why not, or describes it when it is."""

    available: bool
    reason: str
    device_count: int = 0
    memory_bytes: int = 0  # per device
    # The chip generation as its package names it ("TPU v6e"), where the hardware has generations that differ.
    generation: str = ""


@dataclass(frozen=True)
class Device:
    """One device an adapter found: `hardware:index`, its memory, and what else a person should know of it."""

    hardware: str
    index: int
    memory_bytes: int
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.hardware}:{self.index}"


@dataclass(frozen=True)
class HostKind:
    """A kind of host an operator may rent: its accelerator devices as this hardware counts them (NeuronCores,
    chips, GPUs), the memory of each, and where the figures come from."""

    name: str
    hardware: str
    devices: int
    memory_bytes: int
    generation: str = ""
    detail: str = ""
    source: str = ""

    def availability(self) -> Availability:
        """What the hardware's adapter would find on such a host."""
        return Availability(True, f"{self.name}: {self.detail}", self.devices, self.memory_bytes, self.generation)


# What each mode means, for the notes beside the mode selector; an adapter with a mode of its own adds its note.
MODE_NOTES = {
    Mode.EAGER: "each op runs as it is issued",
    Mode.COMPILED: "whole transformer compiled per static shape (fullgraph, dynamic=False)",
    Mode.REGIONAL: "the repeated transformer block compiled once and reused (compile_repeated_blocks)",
}


class Hardware:
    """One accelerator kind. Subclasses declare class attributes and override only what differs; an instance
    answers for one host under one `Settings` (a registry of them: `HardwareRegistry`)."""

    name: ClassVar[str]
    device: ClassVar[str]
    # Which hardware a request that names none gets: the highest found wins (cpu, always found, is 0).
    preference: ClassVar[int] = 0
    eager_modes: ClassVar[tuple[Mode, ...]] = (Mode.EAGER,)
    mode_notes: ClassVar[Mapping[Mode, str]] = MODE_NOTES
    compile_backend: ClassVar[str]
    dist_backend: ClassVar[str]
    mesh_device_type: ClassVar[str]
    # Environment variable -> sub-folder of the app cache dir holding this hardware's compiled artifacts.
    cache_env: ClassVar[Mapping[str, str]] = {}
    # Whether every new tensor shape is a compile here, in eager modes too (Neuron compiles each op on first run,
    # TorchTPU traces): each batch size is one more compile, so requests share a call only at the batch sizes a
    # warm-up compiled.
    every_shape_compiles: ClassVar[bool] = False
    # Whether mode "compiled" can be served from saved AOTInductor packages (see executors/artifacts.py).
    aot_artifacts: ClassVar[bool] = False
    # The out-of-tree PyTorch backend package, when the device is not built into torch.
    package: ClassVar[str | None] = None
    # Used when the probe cannot read device memory; overridable with ACCELDEMO_<NAME>_MEMORY_GB.
    default_memory_bytes: ClassVar[int] = 0
    # The variable that limits which devices a process sees (its value lists device indices); None where a
    # process is pinned otherwise.
    visible_devices_env: ClassVar[str | None] = None
    # The Ray resource that counts this hardware's devices on a cluster's nodes (Ray's own names: GPU for CUDA,
    # neuron_cores for Trainium, TPU for TPU hosts); None for the CPU, whose devices are CPU cores.
    ray_resource: ClassVar[str | None] = None
    # The variable naming this hardware's own compiler cache folder when the shared artifact store keeps that folder
    # in step across hosts (TPU's tier-3 cache); None where the store holds AOTInductor packages (CPU, CUDA) or the
    # compiler reaches the store itself (Neuron, `store_env`).
    synced_cache_env: ClassVar[str | None] = None
    # Host kinds of this hardware that `python -m acceldemo plan --host NAME` knows (hardware/hosts are data).
    host_kinds: ClassVar[tuple[HostKind, ...]] = ()
    # The device is lent per call by a platform (ZeroGPU): each draw runs in a call that asks for it, in a process the
    # platform forks (executors/zerogpu.py), not on a device this process holds.
    lent_per_call: ClassVar[bool] = False

    def __init__(self, settings: Settings, found: Availability | None = None) -> None:
        self.settings = settings
        # `found`: what another place (a cluster's resources) says of this hardware, instead of probing this host.
        self._found = found
        self._detected: Availability | None = found
        self._lock = threading.Lock()

    @classmethod
    def offered_modes(cls) -> tuple[Mode, ...]:
        return (*cls.eager_modes, *COMPILED_MODES)

    @property
    def modes(self) -> tuple[Mode, ...]:
        return self.offered_modes()

    def detect(self) -> Availability:
        """Is it here? Probed once, in a child process, so an aborting backend cannot take us down."""
        with self._lock:
            if self._detected is None:
                self._detected = self._with_memory_override(self._precheck() or self._probe())
            return self._detected

    def _with_memory_override(self, found: Availability) -> Availability:
        override = self.settings.device_memory_gb.get(self.name)
        if not found.available or not override:
            return found
        return dataclasses.replace(found, memory_bytes=int(override * GiB))

    def devices(self) -> tuple[Device, ...]:
        """The devices found here, `hardware:0` first; none when the hardware is absent."""
        found = self.detect()
        return tuple(Device(self.name, i, found.memory_bytes) for i in range(found.device_count)) \
            if found.available else ()

    def device_sets(self, size: int) -> list[DeviceSet]:
        """The disjoint groups of `size` devices one pipeline can occupy (a tensor-parallel group, or one device)."""
        indices = [d.index for d in self.devices()]
        return [DeviceSet(self.name, tuple(indices[i:i + size])) for i in range(0, len(indices) - size + 1, size)]

    def torch_device(self, devices: DeviceSet) -> str:
        """The torch device string of a device set's first device, for a pipeline in this process: the bare device
        name (the process's current device, as the model recipes write it) for its first one."""
        index = devices.indices[0]
        return self.device if index == 0 else f"{self.device}:{index}"

    def in_process(self, devices: DeviceSet) -> bool:
        """Whether this process can drive these devices itself; otherwise a worker pinned to them does. An
        out-of-tree backend gives a process its first visible device, so only that one is driven in-process."""
        return devices.indices == (0,)

    def pin_env(self, devices: DeviceSet) -> dict[str, str]:
        """Environment that limits a process (and its children) to `devices`."""
        if self.visible_devices_env is None:
            return {}
        return {self.visible_devices_env: ",".join(str(i) for i in devices.indices)}

    def _precheck(self) -> Availability | None:
        """Cheap checks done without importing torch; an Availability ends detection early."""
        if self.package and importlib.util.find_spec(self.package) is None:
            return Availability(False, f"{self.package} is not installed")
        return None

    # Python run in a fresh interpreter; it must print one JSON object:
    # {"available": bool, "reason": str, "device_count": int, "memory_bytes": int, "generation": str}.
    probe_code: ClassVar[str] = ""

    def _probe(self) -> Availability:
        """The probe's answer: asked once per process (a child process each time would cost seconds per engine), for
        the host's hardware does not change under a running process. A probe that timed out is asked again."""
        key = (type(self), self.probe_code)
        with _PROBED_LOCK:
            lock = _PROBING.setdefault(key, threading.Lock())
        with lock:  # one probe of each kind at a time; probes of different hardware run side by side
            known = _PROBED.get(key)
            if known is None:
                known = self._run_probe()
                if not known.reason.startswith(f"probing {self.name} did not finish"):
                    _PROBED[key] = known
            return known

    def _run_probe(self) -> Availability:
        limit = self.settings.probe_timeout_s
        try:
            done = subprocess.run(
                [sys.executable, "-c", self.probe_code], capture_output=True, text=True,
                timeout=limit, env=dict(os.environ), stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return Availability(False, f"probing {self.name} did not finish within {limit:.0f} s "
                                       "(ACCELDEMO_PROBE_TIMEOUT_S)")
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

    def mode_context(self, mode: Mode) -> contextlib.AbstractContextManager:
        """Process state a mode needs while a pipeline of that mode runs (TPU's eager flavours)."""
        return contextlib.nullcontext()

    def offload_kwargs(self) -> dict:
        """Arguments to `enable_model_cpu_offload`; the recipe lets diffusers find the device itself."""
        return {}

    def mode_refusal(self, mode: Mode) -> str | None:
        """Why this hardware does not offer a mode, where it has more to say than that it does not."""
        return None

    def placement_refusal(self, placement: Placement) -> str | None:
        """Why a pipeline cannot be placed so on this hardware, or None when it can."""
        return None

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

    def quantization_refusal(self, quantization: Quantization) -> str | None:
        """Why this hardware cannot run weights at that quantization, or None when it can. int8 weight-only is plain
        tensor ops (int8 weights dequantized into the matmul) and runs everywhere; fp8 needs fp8 matmuls that torchao
        drives, CUDA's (`CudaHardware`)."""
        if quantization is not Quantization.FP8:
            return None
        return (f"{self.name} has no fp8 matmul torchao drives: its float8 kernels are CUDA's (sm_89 and newer); "
                "Trainium2's and TPU v7's own fp8 are reached through their compilers, not wired here yet. int8 "
                "halves the weights as fp8 would")

    def launcher_env(self, nproc_per_node: int) -> dict[str, str]:
        """Environment torchrun's processes need on this hardware, beyond torchrun's own."""
        return {}

    def prepare_rank(self, local_rank: int, devices: DeviceSet) -> None:
        """Per-rank set-up before torch starts the device: the rank owns `devices.indices[local_rank]` of the
        pool's device set (its process already sees only the set, through `pin_env`)."""

    def toolchain(self) -> str:
        """What compiled machine code for this hardware depends on besides the model: torch and the CPU's ISA
        (the host code of every inductor package); accelerators add their own."""
        import torch

        return f"torch {torch.__version__}, cpu {torch.backends.cpu.get_cpu_capability()}"

    @classmethod
    def store_env(cls, url: str) -> dict[str, str]:
        """Environment that points this hardware's own compiler cache at the shared artifact store `url`, for a
        compiler that reads and writes a remote cache itself."""
        return {}

    def ray_actor_options(self, devices: int, cpus: float = 1.0) -> dict:
        """What one replica of `devices` devices asks Ray for: the devices as Ray names them, and `cpus` CPU cores
        (for the CPU itself, the cores are the device)."""
        if self.ray_resource is None:
            return {"num_cpus": cpus * devices}
        if self.ray_resource == "GPU":
            return {"num_cpus": cpus, "num_gpus": devices}
        return {"num_cpus": cpus, "resources": {self.ray_resource: devices}}

    def in_cluster(self, resources: dict[str, float], cpus: float = 1.0) -> Availability:
        """This hardware on a Ray cluster whose total resources are `resources`: how many replica devices it has."""
        count = int(resources.get(self.ray_resource or "CPU", 0) // (1 if self.ray_resource else cpus))
        if count < 1:
            return Availability(False, f"no node of the Ray cluster has {self.ray_resource or 'CPU'} resources")
        return self._with_memory_override(Availability(
            True, f"{count} {self.ray_resource or 'CPU replica'} device(s) on the Ray cluster", count,
            self.default_memory_bytes or self._host_memory()))

    @staticmethod
    def _host_memory() -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def empty_cache(self) -> None:
        """Give freed device memory back after an eviction."""

    def synchronize(self) -> None:
        """Wait for queued device work, so timings measure the work and not its dispatch."""


def package_versions(*names: str) -> str:
    """`name version` of each installed distribution (`name absent` otherwise), without importing them."""
    import importlib.metadata

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    return ", ".join(f"{name} {version(name)}" for name in names)


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
