"""Plain CPU: always here; eager or inductor; gloo for tensor parallelism; a device is a set of its cores."""
from __future__ import annotations

import os

from ..config import Settings
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
        return self.settings.cpu_compile_backend

    def __init__(self, settings: Settings, found: Availability | None = None) -> None:
        super().__init__(settings, found)
        # The cores this process may use when it first looked: a worker pinned to some of them later still splits
        # the CPU into the same devices as the app that started it.
        self._cores = _usable_cores()

    def detect(self) -> Availability:
        # Cheap: no child process.
        return self._found or self._with_memory_override(self._precheck())

    def _precheck(self) -> Availability:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return Availability(True, f"{len(self._cores)} cores, {memory / GiB:.0f} GiB RAM", len(self._groups()),
                            memory)

    def _groups(self) -> list[list[int]]:
        """The CPU's devices: its cores split into as many contiguous groups as the operator asked for (the CPU's
        replicas, or ACCELDEMO_CPU_DEVICES), the first groups one core larger when they do not divide evenly."""
        chosen = self.settings
        count = min(chosen.cpu_devices or chosen.replicas_of(self.name) or 1, len(self._cores))
        size, extra = divmod(len(self._cores), count)
        groups, start = [], 0
        for i in range(count):
            end = start + size + (i < extra)
            groups.append(self._cores[start:end])
            start = end
        return groups

    def devices(self) -> tuple[Device, ...]:
        if self._found is not None:  # a cluster's: its devices are its replicas, wherever they are
            return super().devices()
        memory = self.detect().memory_bytes  # shared by every device: what one pipeline may use at most
        return tuple(Device(self.name, i, memory, f"cores {_spans(cores)}") for i, cores in enumerate(self._groups()))

    def device_sets(self, size: int) -> list[DeviceSet]:
        # Ranks of a tensor-parallel pool share the cores of one CPU device: gloo needs no device of its own.
        return [DeviceSet(self.name, (d.index,)) for d in self.devices()]

    def torch_device(self, devices: DeviceSet) -> str:
        return "cpu"

    def in_process(self, devices: DeviceSet) -> bool:
        # One device is all the cores, this process's own; split into several, each is a pinned worker's.
        return len(self._groups()) == 1

    def cores(self, devices: DeviceSet) -> list[int]:
        """The cores of a CPU device set."""
        groups = self._groups()
        return sorted(core for i in devices.indices for core in groups[i])

    def pin_env(self, devices: DeviceSet) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(_threads(len(self.cores(devices))))}

    def prepare_rank(self, local_rank: int, devices: DeviceSet) -> None:
        # Every rank of the pool on these cores, and torch's threads shared out so they never oversubscribe them.
        import torch

        cores = self.cores(devices)
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(_threads(max(1, len(cores) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))

    def offload_kwargs(self) -> dict:
        # diffusers refuses offload without an accelerator unless the execution device is named.
        return {"device": "cpu"}


def _threads(cores: int) -> int:
    """Threads for a process on `cores` cores: one per core, or fewer where the person set OMP_NUM_THREADS (torch's
    own ceiling, which a tiny model on a busy host wants at 1)."""
    asked = os.environ.get("OMP_NUM_THREADS", "")
    return max(1, min(cores, int(asked))) if asked.isdigit() and int(asked) > 0 else max(1, cores)


def _usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _spans(cores: list[int]) -> str:
    return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1)) \
        else ",".join(map(str, cores))
