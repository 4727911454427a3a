"""Google TPU through TorchTPU (torch_tpu): device "tpu", strict or fused eager, AOT compile, torch-tpu's launch env."""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from ..errors import HardwareUnavailable, UnsupportedCombination
from ..records import DeviceSet, Mode
from .base import MODE_NOTES, Availability, GiB, Hardware, HostKind, package_versions, probe_script

EAGER_MODE_NAMES = {Mode.EAGER: "DEFER_NEVER", Mode.EAGER_FUSED: "DEFER_AND_FUSE"}
# Processes per host that torch-tpu's launcher accepts, by the generation torch.tpu names: set_tpu_launch_env looks
# the count up in its generation's topology table and raises ("No TPU topology found for count: 2") for any other.
TENSOR_PARALLEL_SIZES = {
    "TPU v4": (1, 2, 4, 8),
    "TPU v5p": (1, 2, 4, 8),
    "TPU v5e": (1, 4, 8),
    "TPU v6e": (1, 4, 8),
    "TPU v7": (2, 4, 8),
}
_GOOGLE = "Google Cloud TPU system architecture pages (HBM per chip: v5e 16 GiB, v6e 32 GiB, v5p 95 GiB)"
# A device here is a chip, what torch-tpu's launcher counts; a slice named vX-N has N chips (v5p: N TensorCores,
# two per chip).
HOST_KINDS = (
    *(HostKind(f"v6e-{n}", "tpu", n, 32 * GiB, "TPU v6e", f"{n} TPU v6e (Trillium) chip(s) x 32 GiB HBM", _GOOGLE)
      for n in (1, 4, 8)),
    *(HostKind(f"v5e-{n}", "tpu", n, 16 * GiB, "TPU v5e", f"{n} TPU v5e chip(s) x 16 GiB HBM", _GOOGLE)
      for n in (1, 4, 8)),
    HostKind("v5p-8", "tpu", 4, 95 * GiB, "TPU v5p", "4 TPU v5p chips (8 TensorCores) x 95 GiB HBM", _GOOGLE),
)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_LAUNCH_ENV_MARK = "ACCELDEMO-TPU-LAUNCH-ENV "


class TpuHardware(Hardware):
    name = "tpu"
    ray_resource = "TPU"
    device = "tpu"
    preference = 2
    eager_modes = (Mode.EAGER, Mode.EAGER_FUSED)
    mode_notes = {**MODE_NOTES,
                  Mode.EAGER_FUSED: "TorchTPU defers ops and fuses them into larger graphs (EagerMode.DEFER_AND_FUSE)"}
    compile_backend = "tpu"
    every_shape_compiles = True
    dist_backend = "tpu_dist"
    mesh_device_type = "tpu"
    # Read once, by torch_tpu's C++ runtime, when the compilation cache is first used.
    cache_env = {"TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": "tpu"}
    # The shared artifact store keeps that folder in step across hosts (torch-tpu has no remote cache of its own).
    synced_cache_env = "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"
    # torch-tpu 0.2.0 reads this one (it overwrites TPU_VISIBLE_CHIPS from it).
    visible_devices_env = "TPU_VISIBLE_DEVICES"
    package = "torch_tpu"
    host_kinds = HOST_KINDS
    # torch.tpu.is_available() raises without the legacy flag; torch.accelerator is the supported query. The chip
    # count and torch.tpu.get_device_properties() come from torch_tpu's PCI scan and tables: no chip is claimed.
    probe_code = probe_script(f"""
import os, sys
import torch
if os.environ.get('TORCH_DEVICE_BACKEND_AUTOLOAD', '1') != '1':
    sys.path.insert(0, {_PACKAGE_ROOT!r})
    from acceldemo.hardware.tpu import start_device
    start_device()
acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
if acc is None or acc.type != 'tpu':
    return {{'available': False, 'reason': 'torch_tpu is installed but finds no TPU chip'}}
n = torch.accelerator.device_count()
chip = torch.tpu.get_device_properties()
return {{'available': True, 'reason': f'{{n}} x {{chip.name}}', 'device_count': n, 'memory_bytes': chip.total_memory,
        'generation': chip.name}}
""")

    def _precheck(self) -> Availability | None:
        missing = super()._precheck()
        if missing:
            return missing
        problem = libtpu_problem()
        return Availability(False, problem) if problem else None

    def activate(self) -> None:
        """With backend autoload off, start the device as torch_tpu's loader would, or say why there is none."""
        if _autoload_on():
            return
        start_device()
        import torch

        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if accelerator is None or accelerator.type != "tpu":
            raise HardwareUnavailable(self.name,
                                      "torch_tpu's loader (its torch.backends entry point) found no TPU chip")

    def mode_context(self, mode: Mode) -> contextlib.AbstractContextManager:
        import torch

        return torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, EAGER_MODE_NAMES.get(mode, "DEFER_NEVER")))

    def device_sets(self, size: int) -> list[DeviceSet]:
        # In a torchrun rank, torch-tpu 0.2.0 sets TPU_VISIBLE_DEVICES to the rank's LOCAL_RANK itself: a
        # tensor-parallel pool always takes chips 0..N-1, so a host has one group of each size.
        found = super().device_sets(size)
        return found[:1] if size > 1 else found

    def toolchain(self) -> str:
        # TPU programs are compiled by libtpu for the runtime torch-tpu drives.
        return f"{super().toolchain()}, {package_versions('torch-tpu', 'libtpu')}"

    def tensor_parallel_sizes(self) -> tuple[int, ...] | None:
        return TENSOR_PARALLEL_SIZES.get(self.detect().generation)

    def launcher_env(self, nproc_per_node: int) -> dict[str, str]:
        """What torch.tpu.distributed.set_tpu_launch_env sets for `nproc_per_node` ranks: TORCH_TPU_TOPOLOGY,
        TORCH_TPU_SLICEBUILDER_ADDRESSES, TORCH_TPU_XPROF_SESSION_ID (and the rendezvous variables across hosts).

        Computed in a child process, as torch-tpu's own launcher does, so this process never initialises TPU state.
        """
        done = subprocess.run([sys.executable, "-c", _LAUNCH_ENV_CODE, str(nproc_per_node)],
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        for line in done.stdout.splitlines():
            if done.returncode == 0 and line.startswith(_LAUNCH_ENV_MARK):
                return json.loads(line[len(_LAUNCH_ENV_MARK):])
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}, no output"])[-1]
        raise UnsupportedCombination(
            "tp_size", f"torch.tpu.distributed.set_tpu_launch_env(nproc_per_node={nproc_per_node}) failed: {why[:300]}")


_LAUNCH_ENV_CODE = f"""
import json, os, sys
if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "1":
    import torch_tpu  # torch.tpu and its distributed module exist once the package is imported
import torch.tpu.distributed
before = dict(os.environ)
torch.tpu.distributed.set_tpu_launch_env(nproc_per_node=int(sys.argv[1]))
print({_LAUNCH_ENV_MARK!r} + json.dumps({{k: v for k, v in os.environ.items() if before.get(k) != v}}))
"""


def start_device() -> None:
    """Run torch_tpu's `torch.backends` entry point, as `import torch` does when backend autoload is on.

    With autoload off, importing torch_tpu defines `torch.tpu` and the "tpu" compile backend but starts nothing:
    the "tpu" device and the "tpu_dist" process-group backend come from this loader, once it finds a chip.
    Running it again does nothing more.
    """
    for entry in importlib.metadata.entry_points(group="torch.backends"):
        if entry.module.partition(".")[0] == "torch_tpu":
            entry.load()()


def libtpu_problem() -> str | None:
    """Why torch_tpu could not load libtpu here, or None. Without it, importing torch_tpu aborts the process.

    An operator's TPU_LIBRARY_PATH wins over the libtpu package (which only fills the variable in when it is unset).
    """
    path = os.environ.get("TPU_LIBRARY_PATH")
    if path:
        if os.path.isfile(path):
            return None
        return f"TPU_LIBRARY_PATH={path} is not a file (torch_tpu loads libtpu from it)"
    if importlib.util.find_spec("libtpu") is None:
        return "torch_tpu is installed but libtpu is missing: install libtpu, or set TPU_LIBRARY_PATH to a libtpu.so"
    return None


def tpu_autoload_would_abort() -> bool:
    """torch_tpu's autoload aborts `import torch` uncatchably when it cannot load libtpu."""
    return importlib.util.find_spec("torch_tpu") is not None and _autoload_on() and libtpu_problem() is not None


def _autoload_on() -> bool:
    # torch runs the `torch.backends` entry points only when the variable is unset or exactly "1".
    return os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "1"
