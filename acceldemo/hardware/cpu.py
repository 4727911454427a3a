"""Plain CPU: always here; eager or inductor; gloo for tensor parallelism; a device is a set of cores."""
from __future__ import annotations

import os

from ..config import settings
from ..records import DeviceSet
from .base import Availability, Device, GiB, Hardware


class CpuHardware(Hardware):
    name = "cpu"
    device = "cpu"
    aot_artifacts = True
    dist_backend = "gloo"
    mesh_device_type = "cpu"
    cache_env = {"TORCHINDUCTOR_CACHE_DIR": "inductor"}

    @property
    def compile_backend(self) -> str:  # type: ignore[override]
        return settings().cpu_compile_backend

    def _precheck(self) -> Availability:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return Availability(True, f"{len(_usable_cores())} cores, {memory / GiB:.0f} GiB RAM", 1, memory)

    def devices(self) -> tuple[Device, ...]:
        cores = _usable_cores()
        return (Device(self.name, 0, self.detect().memory_bytes, f"cores {_spans(cores)}"),)

    def device_sets(self, size: int) -> list[DeviceSet]:
        # Ranks of a tensor-parallel pool share the cores of one CPU device: gloo needs no device of its own.
        return [DeviceSet(self.name, (d.index,)) for d in self.devices()]

    def torch_device(self, devices: DeviceSet) -> str:
        return "cpu"

    def in_process(self, devices: DeviceSet) -> bool:
        return True

    def cores(self, devices: DeviceSet) -> list[int]:
        """The cores of a CPU device set."""
        return _usable_cores()

    def pin_env(self, devices: DeviceSet) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(len(self.cores(devices)))}

    def prepare_rank(self, local_rank: int, devices: DeviceSet) -> None:
        # Every rank of the pool on these cores, and torch's threads shared out so they never oversubscribe them.
        import torch

        cores = self.cores(devices)
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(max(1, len(cores) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))

    def offload_kwargs(self) -> dict:
        # diffusers refuses offload without an accelerator unless the execution device is named.
        return {"device": "cpu"}


def _usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _spans(cores: list[int]) -> str:
    return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1)) \
        else ",".join(map(str, cores))
