"""Importable stand-ins for torch_neuronx and torch_tpu, written to a folder that goes on PYTHONPATH.

Each does, in miniature, what the real package does when it loads: makes its device's
`torch.<name>` namespace usable, registers the compile backend under the real name
(a recording one, from recording_backend.py) when its device is present, and notes what
it saw at import (its compile-cache variable), so a test can tell when the app loaded it
and with which environment. The fake device itself comes from fake_device.py.

The torch_tpu stand-in is a distribution with a `torch.backends` entry point, so torch's
backend autoload finds it as it finds the real one; its launch API is either the one of
torch-tpu 0.2.0 (`torch.tpu.distributed.set_tpu_launch_env`) or the brief's older
`python -m torch_tpu._internal.distributed.launchers.singlehost_wrapper`.
Both record each launch-env call as a JSON line in the file named by
STANDIN_TORCH_TPU_CALLS, as those calls happen in processes the app starts.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.fakes.fake_process import REPO_ROOT

# What either launch API exports for N processes on one host, as TorchTPU's launcher would.
_LAUNCH = '''
"""The exports of the launch env for one host; both launch APIs of the stand-in use them."""
import json
import os


def exports(nproc_per_node):
    return {
        "TPU_VISIBLE_CHIPS": ",".join(str(i) for i in range(nproc_per_node)),
        "TPU_PROCESS_BOUNDS": f"1,1,{nproc_per_node}",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
    }


def record(api, **arguments):
    path = os.environ.get("STANDIN_TORCH_TPU_CALLS")
    if path:
        with open(path, "a") as calls:
            calls.write(json.dumps({"api": api, **arguments}) + "\\n")
'''

_TPU_DISTRIBUTED = '''
"""Stand-in for torch.tpu.distributed of torch-tpu 0.2.0."""
import os

from torch_tpu._launch import exports, record


def set_tpu_launch_env(*, nproc_per_node):
    record("set_tpu_launch_env", nproc_per_node=nproc_per_node)
    os.environ.update(exports(nproc_per_node))
'''

_SINGLEHOST_WRAPPER = '''
"""Stand-in for the brief's launcher module: prints the exports for a shell to source."""
import argparse

from torch_tpu._launch import exports, record

parser = argparse.ArgumentParser()
parser.add_argument("--nproc_per_node", type=int, required=True)
nproc_per_node = parser.parse_args().nproc_per_node
record("singlehost_wrapper", nproc_per_node=nproc_per_node)
print("# run these before torchrun:")
for name, value in exports(nproc_per_node).items():
    print(f"export {name}={value}")
'''

_TPU_INIT = '''
"""Stand-in for TorchTPU (torch_tpu)."""
import contextlib
import enum
import os
import sys
import types


def _autoload():
    """torch's `torch.backends` entry point: importing the package does the work.

    Defined before `import torch`: when this package is imported first, that import autoloads
    it again while it is still half-initialised.
    """


import torch  # noqa: E402

# Where the compilation cache pointed when the package loaded: it reads it then.
COMPILATION_CACHE_ROOT_AT_IMPORT = os.environ.get("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT")


class EagerMode(enum.Enum):
    DEFER_NEVER = "DEFER_NEVER"
    DEFER_AND_FUSE = "DEFER_AND_FUSE"


# Modes entered through set_eager_mode, innermost last: what is active right now.
_entered = []


def active_eager_mode():
    """The mode a `set_eager_mode` block made active, or None outside every such block."""
    return _entered[-1].name if _entered else None


@contextlib.contextmanager
def set_eager_mode(mode):
    if not isinstance(mode, EagerMode):
        raise TypeError(f"set_eager_mode takes an EagerMode, not {mode!r}")
    before, tpu.eager_mode = tpu.eager_mode, mode
    _entered.append(mode)
    try:
        yield
    finally:
        _entered.pop()
        tpu.eager_mode = before


# Where a TPU device is present (the fake device of tests/fakes), torch.tpu is its device module.
device_present = hasattr(torch, "tpu")
tpu = torch.tpu if device_present else types.ModuleType("torch.tpu")
if not device_present:
    torch.tpu = sys.modules["torch.tpu"] = tpu
tpu.EagerMode, tpu.set_eager_mode, tpu.eager_mode = EagerMode, set_eager_mode, EagerMode.DEFER_NEVER
{launch_api}
if device_present:
    from tests.fakes.recording_backend import register_recording_backend

    GRAPHS = register_recording_backend("tpu")

'''

_NEW_LAUNCH_API = '''
from torch_tpu import _distributed

tpu.distributed = sys.modules["torch.tpu.distributed"] = _distributed
'''

_NEURONX_INIT = '''
"""Stand-in for TorchNeuron (torch_neuronx)."""
import os

import torch

# The real package reads its NEFF cache folder when it loads.
NEFF_CACHE_DIR_AT_IMPORT = os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR")

if hasattr(torch, "neuron"):
    from tests.fakes.recording_backend import register_recording_backend

    # accelerate's offload hooks call it between components once torch_neuronx is installed.
    if not hasattr(torch.neuron, "empty_cache"):
        torch.neuron.empty_cache = lambda: None

    GRAPHS = register_recording_backend("neuron")
'''


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())


def write_torch_neuronx(root: Path) -> Path:
    """A torch_neuronx stand-in under `root`; returns `root`."""
    _write(root, "torch_neuronx/__init__.py", _NEURONX_INIT)
    return root


def write_torch_tpu(root: Path, launch_api: str = "set_tpu_launch_env") -> Path:
    """A torch_tpu stand-in distribution under `root`; returns `root`.

    launch_api: "set_tpu_launch_env" (torch-tpu 0.2.0) or "singlehost_wrapper" (the brief's module).
    """
    if launch_api not in ("set_tpu_launch_env", "singlehost_wrapper"):
        raise ValueError(f"unknown launch_api {launch_api!r}")
    new_api = launch_api == "set_tpu_launch_env"
    _write(root, "torch_tpu/__init__.py", _TPU_INIT.replace("{launch_api}", _NEW_LAUNCH_API if new_api else ""))
    _write(root, "torch_tpu/_launch.py", _LAUNCH)
    if new_api:
        _write(root, "torch_tpu/_distributed.py", _TPU_DISTRIBUTED)
    else:
        for package in ("_internal", "_internal/distributed", "_internal/distributed/launchers"):
            _write(root, f"torch_tpu/{package}/__init__.py", "")
        _write(root, "torch_tpu/_internal/distributed/launchers/singlehost_wrapper.py", _SINGLEHOST_WRAPPER)
    _write(root, "torch_tpu-0.0.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: torch_tpu\nVersion: 0.0.0\n")
    _write(root, "torch_tpu-0.0.0.dist-info/entry_points.txt", "[torch.backends]\ntorch_tpu = torch_tpu:_autoload\n")
    return root


def python_path(*roots: Path) -> str:
    """PYTHONPATH for a process that imports the stand-ins (they import tests.fakes from the repo)."""
    return ":".join([*(str(r) for r in roots), str(REPO_ROOT)])
