"""Hugging Face ZeroGPU: a Space's process has no GPU of its own; the platform lends one (a slice of an H200) to a
forked child process for the length of each call of a `@spaces.GPU` function. The `spaces` package does the
lending (read in `spaces` 0.51.3); `executors/zerogpu.py` runs each draw as such a call.

On by the platform's own switch, SPACES_ZERO_GPU (1, t or true, as `spaces` reads it). Eager, and compiled from
AOTInductor packages only (the platform's rule: a JIT compile would die with its child process), one package per
shape built by a warm-up or found in the store. One device, and no pools: the child is a daemon process, which may
not start others.
"""
from __future__ import annotations

import importlib.util
import os

from ..records import DeviceSet, Mode, Placement
from .base import Availability, Hardware, HostKind

GB = 1000**3
_SOURCE = ("Hugging Face ZeroGPU docs (H200 slices: large is half an H200, 70 GB; xlarge a whole one, 141 GB; "
           "spaces.GPU(size=...))")
HOST_KINDS = (
    HostKind("zerogpu", "zerogpu", 1, 70 * GB, "sm_90", "ZeroGPU large: half an H200, 70 GB, lent per call", _SOURCE),
    HostKind("zerogpu-xlarge", "zerogpu", 1, 141 * GB, "sm_90", "ZeroGPU xlarge: a whole H200, 141 GB, lent per call",
             _SOURCE),
)
SIZES = {"large": HOST_KINDS[0], "xlarge": HOST_KINDS[1]}
POOL_REFUSAL = ("ZeroGPU lends one GPU to one forked process per call, and that process may not start others: no "
                "worker pools, tensor, CFG or context parallelism, replicas or Ray fleet there")


def zero_gpu_on(environ: dict[str, str] | None = None) -> bool:
    """SPACES_ZERO_GPU as the `spaces` package reads it: 1, t or true, in any case."""
    env = os.environ if environ is None else environ
    return env.get("SPACES_ZERO_GPU", "").strip().lower() in ("1", "t", "true")


class ZeroGpuHardware(Hardware):
    name = "zerogpu"
    device = "cuda"
    preference = 3  # on a ZeroGPU Space it is the GPU; elsewhere it is absent
    compile_backend = "inductor"
    dist_backend = "nccl"
    mesh_device_type = "cuda"
    package = "spaces"
    host_kinds = HOST_KINDS
    # Each draw asks the platform for the GPU (`executors/zerogpu.py`).
    lent_per_call = True
    # Mode compiled: AOTInductor packages (executors/artifacts.py), built in the lent GPU's process and saved.
    aot_artifacts = True

    @classmethod
    def offered_modes(cls) -> tuple[Mode, ...]:
        return (*cls.eager_modes, Mode.COMPILED)

    def _precheck(self) -> Availability:
        if not zero_gpu_on():
            return Availability(False, "not a ZeroGPU Space (SPACES_ZERO_GPU is not 1, t or true)")
        if importlib.util.find_spec("spaces") is None:
            return Availability(False, "SPACES_ZERO_GPU is set but the spaces package is not installed "
                                       "(pip install spaces==0.51.3)")
        kind = SIZES[self.settings.zero_gpu_size]
        return Availability(True, kind.detail, 1, kind.memory_bytes, kind.generation)

    def torch_device(self, devices: DeviceSet) -> str:
        return self.device

    def in_process(self, devices: DeviceSet) -> bool:
        return True

    def mode_refusal(self, mode: Mode) -> str | None:
        if mode is Mode.COMPILED and self.settings.precompile == "off":
            return ("on ZeroGPU compiled runs from AOTInductor packages, which ACCELDEMO_PRECOMPILE=off turns off (a "
                    "JIT compile would die with each process the platform forks)")
        if mode is Mode.REGIONAL:
            return ("on ZeroGPU a JIT compile dies with the process the platform forks for each call, and packaged "
                    "repeated blocks are not built here: use compiled (an AOTInductor package per shape) or eager")
        return None

    @property
    def modes(self) -> tuple[Mode, ...]:
        # Without packages (ACCELDEMO_PRECOMPILE=off) compiled would be a JIT compile in every forked process.
        return self.eager_modes if self.settings.precompile == "off" else self.offered_modes()

    def placement_refusal(self, placement: Placement) -> str | None:
        if placement.pooled:
            return POOL_REFUSAL
        if placement is Placement.OFFLOAD:
            return ("the whole pipeline moves to the lent GPU for each call; offloading it piece by piece from this "
                    "process is not built for ZeroGPU")
        return None

    def tensor_parallel_refusal(self, per_host: int) -> str:
        return POOL_REFUSAL

    def in_cluster(self, resources: dict[str, float], cpus: float = 1.0) -> Availability:
        return Availability(False, "ZeroGPU is lent per call to a Space's process, never a Ray cluster's resource")

    def toolchain(self) -> str:
        import torch

        return f"{super().toolchain()}, cuda {torch.version.cuda}, ZeroGPU {self.settings.zero_gpu_size}"
