"""A simulated TPU host for the real torch_tpu package, in every Python process that has this folder on PYTHONPATH.

ACCELDEMO_TEST_SIMULATED_TPUS="v6e:4" gives the process a PCI bus with 4 TPU v6e chips, each behind VFIO, where
torch_tpu's hardware module looks (/sys/bus/pci/devices, /dev/vfio); "v6e:0" a bus without TPUs. Nothing else
changes: torch_tpu's own scan finds the chips and picks the generation's name and topology table. The variable is
inherited, so the probes and launch-env children the adapter starts see the same host.

ACCELDEMO_TEST_WITHOUT_LIBTPU_PACKAGE=1 makes the installed libtpu package unimportable, as if it were not there.
"""
import atexit
import importlib.machinery
import os
import pathlib
import shutil
import sys
import tempfile

_HARDWARE_MODULE = "torch_tpu._internal.utils.hardware"
_HOST_FOLDERS = ("/sys/bus/pci/devices", "/dev/vfio")


def _fake_host(hardware, generation: str, chips: int) -> str:
    """A folder holding the host folders torch_tpu scans, with `chips` chips of `generation` ("v6e")."""
    name = f"TPU {generation}"
    device_ids = [i for i, known in hardware._PCI_DEVICE_ID_TO_NAME.items() if known == name]
    if not device_ids:
        raise ValueError(f"ACCELDEMO_TEST_SIMULATED_TPUS: torch_tpu knows no {name!r}; it knows "
                         f"{', '.join(sorted(hardware._PCI_DEVICE_ID_TO_NAME.values()))}")
    root = tempfile.mkdtemp(prefix="simulated-tpu-host-")
    atexit.register(shutil.rmtree, root, True)
    devices, vfio = pathlib.Path(root + _HOST_FOLDERS[0]), pathlib.Path(root + _HOST_FOLDERS[1])
    devices.mkdir(parents=True)
    vfio.mkdir(parents=True)
    for chip in range(chips):
        device = devices / f"0000:00:{4 + chip:02x}.0"
        device.mkdir()
        (device / "vendor").write_text(hardware._GOOGLE_PCI_VENDOR_ID + "\n")
        (device / "device").write_text(device_ids[0] + "\n")
        group = pathlib.Path(root, "sys/kernel/iommu_groups", str(chip))
        group.mkdir(parents=True)
        (device / "iommu_group").symlink_to(group)
        (vfio / str(chip)).touch()
    return root


class _HostPaths:
    """`pathlib` as torch_tpu's hardware module uses it, with the host folders moved under the simulated host."""

    def __init__(self, root: str):
        self._root = root

    def Path(self, *parts):  # noqa: N802 - the name pathlib gives it
        path = pathlib.Path(*parts)
        if any(str(path) == folder or str(path).startswith(folder + "/") for folder in _HOST_FOLDERS):
            return pathlib.Path(self._root + str(path))
        return path

    def __getattr__(self, name):
        return getattr(pathlib, name)


class _SimulatedHost:
    """Finds torch_tpu's hardware module as usual and points it at the simulated host once it has run."""

    def __init__(self, generation: str, chips: int):
        self.generation, self.chips = generation, chips

    def find_spec(self, name, path=None, target=None):
        if name != _HARDWARE_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            module.pathlib = _HostPaths(_fake_host(module, self.generation, self.chips))

        spec.loader.exec_module = exec_module
        return spec


class _WithoutLibtpu:
    """The path finder, blind to the libtpu package."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "libtpu":
            return None
        return self._finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self._finder, name)


_host = os.environ.get("ACCELDEMO_TEST_SIMULATED_TPUS")
if _host:
    _generation, _, _chips = _host.partition(":")
    sys.meta_path.insert(0, _SimulatedHost(_generation, int(_chips)))
if os.environ.get("ACCELDEMO_TEST_WITHOUT_LIBTPU_PACKAGE") == "1":
    sys.meta_path[:] = [_WithoutLibtpu(f) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
