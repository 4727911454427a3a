"""Narrow, version-guarded shims for library releases that lack something the product needs; each says when it goes."""
from __future__ import annotations

import contextlib
import functools

# The last diffusers release known to refuse a CPU mesh; a newer one gets no shim, so a test fails if it still refuses.
_CPU_TP_REFUSED_UP_TO = "0.42"


def allow_cpu_tensor_parallel() -> bool:
    """Let stock diffusers 0.42.x shard a model over a CPU (gloo) mesh, as it already does over cuda/neuron/tpu ones.

    diffusers 0.42 refuses a CPU mesh twice: `ModelMixin._resolve_parallel_config` divides the rank by
    `torch.accelerator.device_count()`, which is 0 without an accelerator, and `apply_tensor_parallel` checks the
    mesh type against `_SUPPORTED_TP_DEVICES`, which lacks "cpu". Only the worker pool calls this, only for a CPU
    mesh, and only for diffusers <= 0.42.x; it changes nothing when an accelerator is present. Remove it once
    diffusers shards over CPU meshes itself. Returns whether the shim is in place.
    """
    import diffusers
    import diffusers.hooks.tensor_parallel as tensor_parallel
    from diffusers.models.modeling_utils import ModelMixin
    from packaging.version import Version

    if Version(diffusers.__version__).release[:2] > Version(_CPU_TP_REFUSED_UP_TO).release[:2]:
        return False
    if "cpu" not in tensor_parallel._SUPPORTED_TP_DEVICES:
        tensor_parallel._SUPPORTED_TP_DEVICES = (*tensor_parallel._SUPPORTED_TP_DEVICES, "cpu")
    resolve = ModelMixin._resolve_parallel_config
    if not getattr(resolve, "_acceldemo_cpu_shim", False):
        ModelMixin._resolve_parallel_config = _with_one_device_when_none(resolve)
    return True


def _with_one_device_when_none(resolve):
    """`resolve` seeing one device where torch counts none, so `rank % device_count()` names the CPU."""
    import torch

    @functools.wraps(resolve)
    def resolve_parallel_config(self, config):
        if torch.accelerator.device_count() > 0:
            return resolve(self, config)
        with _device_count(1):
            return resolve(self, config)

    resolve_parallel_config._acceldemo_cpu_shim = True
    return resolve_parallel_config


@contextlib.contextmanager
def _device_count(count: int):
    import torch

    real = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: count
    try:
        yield
    finally:
        torch.accelerator.device_count = real
