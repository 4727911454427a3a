"""NVIDIA CUDA: built into torch; inductor; NCCL for tensor parallelism."""
from __future__ import annotations

from .base import Hardware, probe_script


class CudaHardware(Hardware):
    name = "cuda"
    device = "cuda"
    compile_backend = "inductor"
    aot_artifacts = True
    dist_backend = "nccl"
    mesh_device_type = "cuda"
    cache_env = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
    probe_code = probe_script("""
import torch
if torch.version.cuda is None:
    return {'available': False, 'reason': 'this torch is a CPU-only build (torch.version.cuda is None)'}
n = torch.cuda.device_count()
if n == 0:
    return {'available': False, 'reason': 'no CUDA device found (torch.cuda.device_count() == 0)'}
p = torch.cuda.get_device_properties(0)
return {'available': True, 'reason': f'{n} x {p.name}', 'device_count': n, 'memory_bytes': p.total_memory}
""")

    def prepare_rank(self, local_rank: int) -> None:
        # Without this every rank of a pool would land on cuda:0.
        import torch

        torch.cuda.set_device(local_rank)

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
