"""Importable stand-ins for torch_neuronx and torch_tpu, written to a folder that goes on PYTHONPATH.

Each does, in miniature, what the real package does when it loads: makes its device's
`torch.<name>` namespace usable, registers the compile backend under the real name
(a recording one, from recording_backend.py), and notes the compile-cache variable it read,
so a test can tell when the app loaded it and with which environment. The fake device
itself comes from fake_device.py.

The torch_tpu stand-in follows torch-tpu 0.2.0, which tests/test_torch_tpu_conformance.py
checks it against: a distribution whose `torch.backends` entry point (its loader) starts
the device and registers the "tpu_dist" process-group backend only on a host with chips,
while importing it defines `torch.tpu` and the "tpu" compile backend, chips or not. The
host's chips are the simulated ones named by ACCELDEMO_TEST_SIMULATED_TPUS, as for the real
package in the conformance tests. It has no launch API: TorchTPU's launch environment is
tested against the real package only.
The torch_neuronx stand-in cannot be checked against its package, which installs only from
AWS's own repository: it does what AWS documents, registering the "neuron" backend at import
where the fake device is present and reading its NEFF cache folder then.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.fakes.fake_process import REPO_ROOT

# "GENERATION:CHIPS" ("v6e:4"): the TPU chips a process's host has, for the stand-in and the simulated real package.
SIMULATED_TPUS = "ACCELDEMO_TEST_SIMULATED_TPUS"

_TPU_INIT = '''
"""Stand-in for TorchTPU (torch_tpu) 0.2.0 on the fake device of tests/fakes."""
import contextlib
import enum
import os
import sys
import types
import warnings

# As torch_tpu's loader does: autoload off while torch loads, or importing this package first would make torch run
# the entry point of a half-imported package. `load()` puts the value back.
_AUTOLOAD_AT_IMPORT = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.fakes import fake_device  # noqa: E402
from tests.fakes.recording_backend import register_recording_backend  # noqa: E402

_LOADED = False
# What TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT held when the cache was first used (the first compile): the real
# runtime reads it once, then.
COMPILATION_CACHE_ROOT = None
_cache_root_read = False


def _read_compilation_cache_root():
    global COMPILATION_CACHE_ROOT, _cache_root_read
    if not _cache_root_read:
        COMPILATION_CACHE_ROOT, _cache_root_read = os.environ.get("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"), True


class EagerMode(enum.Enum):
    DEFER_AND_FUSE = 0
    DEFER_NEVER = 1
    DEFER_NEVER_AND_LAUNCH_BLOCKING = 2
    _INTERNAL_COMPILE_FX_GRAPH = 4


# Modes entered through set_eager_mode, innermost last: what is active right now.
_entered = []


def active_eager_mode():
    """The mode a `set_eager_mode` block made active, or None outside every such block."""
    return _entered[-1].name if _entered else None


def set_eager_mode(mode):
    warnings.warn("<TorchTpu/ApiStage/ExperimentalApi/> set_eager_mode is experimental and subject to change",
                  UserWarning, stacklevel=2)
    if not isinstance(mode, EagerMode):
        raise TypeError(f"set_eager_mode takes an EagerMode, not {mode!r}")
    return _eager_mode_block(mode)


@contextlib.contextmanager
def _eager_mode_block(mode):
    before, torch.tpu.eager_mode = torch.tpu.eager_mode, mode
    _entered.append(mode)
    try:
        yield
    finally:
        _entered.pop()
        torch.tpu.eager_mode = before


def _publish(module):
    module.EagerMode, module.set_eager_mode, module.eager_mode = EagerMode, set_eager_mode, EagerMode.DEFER_NEVER


def _simulated_chips():
    return int(os.environ.get("ACCELDEMO_TEST_SIMULATED_TPUS", "").partition(":")[2] or 0)


def _no_collectives(store, rank, size, timeout):
    raise NotImplementedError("the torch_tpu stand-in has no collectives; tensor parallel on TPU is tested against "
                              "the real package")


def load():
    """The `torch.backends` entry point: on a host with chips, the device "tpu" and the "tpu_dist" backend."""
    global _LOADED
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = _AUTOLOAD_AT_IMPORT
    if _LOADED or not _simulated_chips():
        return
    if fake_device._installed_name != "tpu":
        del torch.tpu
        sys.modules.pop("torch.tpu", None)
        fake_device.install_fake_device("tpu")
        _publish(torch.tpu)
    dist.Backend.register_backend("tpu_dist", _no_collectives, devices=["tpu"])
    _LOADED = True


if not hasattr(torch, "tpu"):
    torch.tpu = sys.modules["torch.tpu"] = types.ModuleType("torch.tpu")
_publish(torch.tpu)
GRAPHS = register_recording_backend("tpu", on_graph=_read_compilation_cache_root)
if _AUTOLOAD_AT_IMPORT == "1":
    load()
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


def write_torch_tpu(root: Path) -> Path:
    """A torch_tpu stand-in distribution under `root`, found by torch's backend autoload; returns `root`."""
    _write(root, "torch_tpu/__init__.py", _TPU_INIT)
    _write(root, "torch_tpu-0.0.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: torch_tpu\nVersion: 0.0.0\n")
    _write(root, "torch_tpu-0.0.0.dist-info/entry_points.txt", "[torch.backends]\ntorch_tpu = torch_tpu:load\n")
    return root


def python_path(*roots: Path) -> str:
    """PYTHONPATH for a process that imports the stand-ins (they import tests.fakes from the repo)."""
    return ":".join([*(str(r) for r in roots), str(REPO_ROOT)])
