"""Google TPU through TorchTPU (torch_tpu): device "tpu", strict or fused eager, AOT compile."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys

from .base import MODE_NOTES, Availability, GiB, Hardware, probe_script

EAGER_MODE_NAMES = {"eager": "DEFER_NEVER", "eager-fused": "DEFER_AND_FUSE"}


class TpuHardware(Hardware):
    name = "tpu"
    device = "tpu"
    preference = 2
    eager_modes = ("eager", "eager-fused")
    mode_notes = {**MODE_NOTES,
                  "eager-fused": "TorchTPU defers ops and fuses them into larger graphs (EagerMode.DEFER_AND_FUSE)"}
    compile_backend = "tpu"
    dist_backend = "tpu_dist"
    mesh_device_type = "tpu"
    cache_env = {"TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": "tpu"}
    # torch-tpu 0.2.0 reads this one (it overwrites TPU_VISIBLE_CHIPS from it).
    visible_devices_env = "TPU_VISIBLE_DEVICES"
    package = "torch_tpu"
    # v6e has 32 GiB of HBM per chip.
    default_memory_bytes = 32 * GiB
    # torch.tpu.is_available() raises without the legacy flag; torch.accelerator is the supported query.
    probe_code = probe_script("""
import os, importlib
import torch
if os.environ.get('TORCH_DEVICE_BACKEND_AUTOLOAD') == '0':
    importlib.import_module('torch_tpu')
acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
if acc is None or acc.type != 'tpu':
    return {'available': False, 'reason': 'torch_tpu is installed but finds no TPU chip'}
n = torch.accelerator.device_count()
return {'available': True, 'reason': f'{n} TPU chips', 'device_count': n}
""")

    def _precheck(self) -> Availability | None:
        missing = super()._precheck()
        if missing:
            return missing
        if importlib.util.find_spec("libtpu") is None:
            return Availability(False, "torch_tpu is installed but libtpu is missing")
        return None

    def mode_context(self, mode: str) -> contextlib.AbstractContextManager:
        import torch

        return torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, EAGER_MODE_NAMES.get(mode, "DEFER_NEVER")))

    def launcher_env(self, nproc_per_node: int) -> dict[str, str]:
        """The exports TorchTPU's launcher computes: torch-tpu ≥ 0.2.0's API, else the brief's wrapper module."""
        done = subprocess.run([sys.executable, "-c", _LAUNCH_ENV_CODE, str(nproc_per_node)],
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        if done.returncode == 0 and done.stdout.strip():
            return json.loads(done.stdout.strip().splitlines()[-1])
        legacy = subprocess.run(
            [sys.executable, "-m", "torch_tpu._internal.distributed.launchers.singlehost_wrapper",
             f"--nproc_per_node={nproc_per_node}"],
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        if legacy.returncode != 0:
            raise RuntimeError("neither torch.tpu.distributed.set_tpu_launch_env nor "
                               "torch_tpu._internal.distributed.launchers.singlehost_wrapper worked: "
                               f"{done.stderr.strip()[-300:]} | {legacy.stderr.strip()[-300:]}")
        return parse_exports(legacy.stdout)


_LAUNCH_ENV_CODE = """
import json, os, sys
if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "0":
    import torch_tpu  # with autoload off, torch.tpu exists only once the package is imported (SPEC §1)
import torch.tpu.distributed as d
before = dict(os.environ)
d.set_tpu_launch_env(nproc_per_node=int(sys.argv[1]))
print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))
"""


def parse_exports(text: str) -> dict[str, str]:
    """`export K=V` lines (as a launcher prints them for a shell) to a dict."""
    found = {}
    for match in re.finditer(r"^\s*export\s+([A-Za-z_][A-Za-z0-9_]*)=(.*)$", text, re.M):
        found[match[1]] = match[2].strip().strip("'\"")
    return found


def tpu_autoload_would_abort() -> bool:
    """torch_tpu's autoload aborts `import torch` uncatchably when libtpu is missing."""
    return importlib.util.find_spec("torch_tpu") is not None and importlib.util.find_spec("libtpu") is None and \
        os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") != "0"
