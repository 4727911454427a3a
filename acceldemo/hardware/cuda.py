"""NVIDIA CUDA: built into torch; inductor; NCCL for tensor parallelism."""
from __future__ import annotations

from ..records import DeviceSet, Quantization
from .base import Hardware, HostKind, probe_script

_NVIDIA = "NVIDIA's data sheets (memory per GPU as sold: H100 SXM 80 GB, H200 141 GB, A100 80 GB, L4 24 GB, A10G 24 GB)"
GB = 1000**3
HOST_KINDS = (
    HostKind("h100", "cuda", 1, 80 * GB, "sm_90", "1 x H100 SXM 80 GB", _NVIDIA),
    HostKind("h100x8", "cuda", 8, 80 * GB, "sm_90", "8 x H100 SXM 80 GB (p5.48xlarge, a3-highgpu-8g)", _NVIDIA),
    HostKind("h200", "cuda", 1, 141 * GB, "sm_90", "1 x H200 141 GB", _NVIDIA),
    HostKind("h200x8", "cuda", 8, 141 * GB, "sm_90", "8 x H200 141 GB (p5e.48xlarge)", _NVIDIA),
    HostKind("a100x8", "cuda", 8, 80 * GB, "sm_80", "8 x A100 80 GB (p4de.24xlarge)", _NVIDIA),
    HostKind("l4", "cuda", 1, 24 * GB, "sm_89", "1 x L4 24 GB (g6.xlarge)", _NVIDIA),
    HostKind("a10g", "cuda", 1, 24 * GB, "sm_86", "1 x A10G 24 GB (g5.xlarge)", _NVIDIA),
)


class CudaHardware(Hardware):
    name = "cuda"
    ray_resource = "GPU"
    device = "cuda"
    preference = 1
    compile_backend = "inductor"
    aot_artifacts = True
    dist_backend = "nccl"
    mesh_device_type = "cuda"
    cache_env = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    host_kinds = HOST_KINDS
    probe_code = probe_script("""
import torch
if torch.version.cuda is None:
    return {'available': False, 'reason': 'this torch is a CPU-only build (torch.version.cuda is None)'}
n = torch.cuda.device_count()
if n == 0:
    return {'available': False, 'reason': 'no CUDA device found (torch.cuda.device_count() == 0)'}
p = torch.cuda.get_device_properties(0)
return {'available': True, 'reason': f'{n} x {p.name}', 'device_count': n, 'memory_bytes': p.total_memory,
        'generation': f'sm_{p.major}{p.minor}'}
""")
    # fp8 (e4m3) matmuls: Ada (sm_89) and Hopper (sm_90) and newer.
    fp8_from = (8, 9)

    def torch_device(self, devices: DeviceSet) -> str:
        return f"cuda:{devices.indices[0]}"

    def in_process(self, devices: DeviceSet) -> bool:
        return True  # one process drives every GPU it sees, each by its index

    def prepare_rank(self, local_rank: int, devices: DeviceSet) -> None:
        # The pool sees only its own GPUs (CUDA_VISIBLE_DEVICES), renumbered from 0: without this every rank would
        # land on the first of them.
        import torch

        torch.cuda.set_device(local_rank)

    def quantization_refusal(self, quantization: Quantization) -> str | None:
        generation = self.detect().generation  # sm_XY
        if quantization is not Quantization.FP8 or not generation.startswith("sm_"):
            return None
        digits = generation[3:]
        if (int(digits[:-1]), int(digits[-1])) >= self.fp8_from:
            return None
        return (f"this GPU is {generation}: fp8 matmuls need sm_89 or newer (Ada, Hopper); int8 halves the weights "
                "as fp8 would")

    def toolchain(self) -> str:
        import torch

        major, minor = torch.cuda.get_device_capability()
        return f"{super().toolchain()}, cuda {torch.version.cuda} sm_{major}{minor}"

    def empty_cache(self) -> None:
        import torch

        torch.cuda.empty_cache()

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()
