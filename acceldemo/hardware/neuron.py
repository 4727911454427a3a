"""AWS Trainium through TorchNeuron (torch_neuronx): device "neuron", NEFF compile cache."""
from __future__ import annotations

import glob
import os

from ..records import DeviceSet
from .base import Availability, GiB, Hardware, package_versions, probe_script


class NeuronHardware(Hardware):
    name = "neuron"
    ray_resource = "neuron_cores"
    device = "neuron"
    preference = 3
    compile_backend = "neuron"
    every_shape_compiles = True
    dist_backend = "neuron"
    mesh_device_type = "neuron"
    # Read by torch_neuronx when it loads (at `import torch` with autoload), so it is set before.
    cache_env = {"TORCH_NEURONX_NEFF_CACHE_DIR": "neff"}
    visible_devices_env = "NEURON_RT_VISIBLE_CORES"
    package = "torch_neuronx"
    # A trn2 logical NeuronCore at LNC=2 has about 24 GiB of HBM.
    default_memory_bytes = 24 * GiB
    probe_code = probe_script("""
import os, importlib
import torch
if os.environ.get('TORCH_DEVICE_BACKEND_AUTOLOAD') == '0':
    importlib.import_module('torch_neuronx')
n = torch.neuron.device_count() if torch.neuron.is_available() else 0
if n == 0:
    return {'available': False, 'reason': 'torch_neuronx sees no NeuronCore (torch.neuron.is_available() is False)'}
return {'available': True, 'reason': f'{n} NeuronCores', 'device_count': n}
""")

    def _precheck(self) -> Availability | None:
        missing = super()._precheck()
        if missing:
            return Availability(False, missing.reason + " (it comes from AWS's Neuron pip repository; see requirements-neuron.txt)")
        if not glob.glob("/dev/neuron*"):
            return Availability(False, "no /dev/neuron* device")
        return None

    def pin_env(self, devices: DeviceSet) -> dict[str, str]:
        # The Neuron runtime takes a range of cores ("4-7"); our device sets are contiguous groups.
        return {self.visible_devices_env: str(devices).partition(":")[2]}

    def prepare_rank(self, local_rank: int, devices: DeviceSet) -> None:
        # One NeuronCore per rank, read by the runtime when torch_neuronx starts the device.
        os.environ[self.visible_devices_env] = str(devices.indices[local_rank])

    def toolchain(self) -> str:
        # A NEFF is compiled by neuronx-cc for the runtime torch-neuronx drives.
        return f"{super().toolchain()}, {package_versions('torch-neuronx', 'neuronx-cc')}"

    @classmethod
    def store_env(cls, url: str) -> dict[str, str]:
        """torch-neuronx's own remote compile cache: NEURON_COMPILE_CACHE_URL takes an s3:// URL or a folder, and
        keys its NEFFs by compiler version and graph itself. Other stores (gs://, hf://) leave the NEFF cache local."""
        scheme = url.partition("://")[0] if "://" in url else "file"
        if scheme not in ("s3", "file"):
            return {}
        return {"NEURON_COMPILE_CACHE_URL": f"{url.rstrip('/')}/neuron"}
