"""AWS Trainium through TorchNeuron (torch_neuronx): device "neuron", NEFF compile cache."""
from __future__ import annotations

import glob
import os

from ..records import DeviceSet
from .base import Availability, GiB, Hardware, HostKind, package_versions, probe_script

_AWS = "AWS EC2 accelerated-computing instance specifications (and FACTS.md, checked against the Neuron docs)"
# A device here is a logical NeuronCore, what NEURON_RT_VISIBLE_CORES and torchrun's ranks count.
HOST_KINDS = (
    HostKind("trn2.48xlarge", "neuron", 64, 24 * GiB, "Trainium2",
             "16 Trainium2 chips x 96 GiB HBM, 64 logical NeuronCores at LNC=2 (24 GiB each)", _AWS),
    HostKind("trn2.3xlarge", "neuron", 4, 24 * GiB, "Trainium2",
             "1 Trainium2 chip x 96 GiB HBM, 4 logical NeuronCores at LNC=2 (24 GiB each)", _AWS),
    HostKind("trn1.32xlarge", "neuron", 32, 16 * GiB, "Trainium",
             "16 Trainium chips x 32 GiB HBM, 2 NeuronCore-v2 each (16 GiB per core; 512 GiB in all)", _AWS),
    HostKind("trn1.2xlarge", "neuron", 2, 16 * GiB, "Trainium",
             "1 Trainium chip x 32 GiB HBM, 2 NeuronCore-v2 (16 GiB each)", _AWS),
    HostKind("inf2.48xlarge", "neuron", 24, 16 * GiB, "Inferentia2",
             "12 Inferentia2 chips x 32 GiB HBM, 2 NeuronCore-v2 each (16 GiB per core; 384 GiB in all)", _AWS),
    HostKind("inf2.xlarge", "neuron", 2, 16 * GiB, "Inferentia2",
             "1 Inferentia2 chip x 32 GiB HBM, 2 NeuronCore-v2 (16 GiB each)", _AWS),
)


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
    host_kinds = HOST_KINDS
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
            return Availability(False, missing.reason
                                + " (it comes from AWS's Neuron pip repository; see requirements-neuron.txt)")
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
