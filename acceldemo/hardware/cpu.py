"""Plain CPU: always here; eager or inductor; gloo for tensor parallelism."""
from __future__ import annotations

import os

from .base import Availability, GiB, Hardware


class CpuHardware(Hardware):
    name = "cpu"
    device = "cpu"
    # Tests and quick demos may pick a lighter backend (e.g. aot_eager); inductor is the real one.
    compile_backend = os.environ.get("ACCELDEMO_CPU_COMPILE_BACKEND", "inductor")
    aot_artifacts = True
    dist_backend = "gloo"
    mesh_device_type = "cpu"
    cache_env = {"TORCHINDUCTOR_CACHE_DIR": "inductor"}

    def _precheck(self) -> Availability:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return Availability(True, f"{os.cpu_count()} cores, {memory / GiB:.0f} GiB RAM", 1, memory)

    def offload_kwargs(self) -> dict:
        # diffusers refuses offload without an accelerator unless the execution device is named.
        return {"device": "cpu"}
