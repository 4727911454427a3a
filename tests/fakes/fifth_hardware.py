"""A fifth hardware, declared in this one file: "twin", two devices that compute on the CPU.

It reaches the app the way an out-of-tree accelerator would, as a plugin under the entry-point group
`acceldemo.hardware` (see `write_plugin`), or in one process with `acceldemo.hardware.register`. Nothing else in
the app names it: it shows up in `info`, the CLI's and the bench's `--hardware` choices and the page's dropdown
because they all read the registry.
"""
from __future__ import annotations

from pathlib import Path

from acceldemo.hardware.base import Availability, GiB, Hardware
from acceldemo.records import DeviceSet


class TwinAccelerator(Hardware):
    name = "twin"
    device = "cpu"  # its tensors live on the CPU: what the tests check is the engine's use of two devices
    preference = -1  # never the default hardware
    compile_backend = "aot_eager"
    dist_backend = "gloo"
    mesh_device_type = "cpu"

    def _precheck(self) -> Availability:
        return Availability(True, "2 twin devices computing on the CPU", 2, 4 * GiB)

    def torch_device(self, devices: DeviceSet) -> str:
        return "cpu"

    def in_process(self, devices: DeviceSet) -> bool:
        return True


def write_plugin(root: Path) -> Path:
    """A distribution under `root` that declares TwinAccelerator as an acceldemo hardware plugin; returns `root`."""
    info = root / "acceldemo_twin-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acceldemo-twin\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[acceldemo.hardware]\ntwin = tests.fakes.fifth_hardware:TwinAccelerator\n")
    return root
