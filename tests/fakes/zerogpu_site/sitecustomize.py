"""Loaded by every Python process that has this folder on PYTHONPATH (tests/test_zerogpu.py's app): on a CPU-only
torch, the patches that let the real `spaces` package take the ZeroGPU path (tests/fakes/zerogpu_api.py), and the
CPU standing in for the GPU the platform lends."""
import os

if os.environ.get("SPACES_ZERO_GPU"):
    from tests.fakes.zerogpu_api import keep_tensors_on_cpu_in_the_child, lend_the_cpu, patch_cpu_torch_for_spaces

    patch_cpu_torch_for_spaces()
    import spaces  # noqa: F401,E402  (first, as on the platform; after the patches it needs here)

    keep_tensors_on_cpu_in_the_child()
    lend_the_cpu()
