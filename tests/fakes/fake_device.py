"""A pure-Python fake accelerator ("neuron" or "tpu") whose tensors compute on CPU.

What it covers: `.to(name)`/`.cpu()`, factories with `device=name`, `Module.to`,
whole diffusers pipelines (eager, `enable_model_cpu_offload`, `torch.compile` with
`fullgraph=True, dynamic=False` whole or regional), `torch.accelerator` queries.
Where it differs from hardware, on purpose or not:
- one process, one fake, one device (index 0); `torch.Generator(name)` does not
  exist and a CPU generator in a device op raises: draw on CPU, then move;
- CPU/device operand mixes raise as on hardware (0-dim CPU tensors allowed);
- `Module.to(name)` swaps parameters (`torch.utils.swap_tensors`), which fails
  while an autograd graph still holds them: run models under no_grad first;
- bfloat16 matches CPU only to bf16 rounding (SDPA takes its math path);
- no memory statistics (`torch.accelerator.memory_allocated` asserts).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

# PrivateUse1 can be renamed only once per process, so the installed name is global.
_installed_name: str | None = None
# Registrations live as long as these Library objects do.
_libraries: list[torch.library.Library] = []

# Ops that legitimately take tensors from two devices: the copies that move data.
_CROSS_DEVICE_OPS = frozenset(
    {
        torch.ops.aten.copy_.default,
        torch.ops.aten._to_copy.default,
        torch.ops.aten._copy_from.default,
        torch.ops.aten._copy_from_and_resize.default,
        # Index tensors may stay on CPU, as on CUDA.
        torch.ops.aten.index.Tensor,
        torch.ops.aten.index_put.default,
        torch.ops.aten.index_put_.default,
        torch.ops.aten._index_put_impl_.default,
    }
)


# A wrapper owns no memory. Claiming a storage that never runs out lets it take
# any new shape its CPU data takes (see `rewrap`) without a bounds error.
_WRAPPER_STORAGE_BYTES = 2**48


class FakeDeviceTensor(torch.Tensor):
    """A tensor that reports the fake device and keeps its data in a CPU tensor."""

    _cpu: torch.Tensor
    device_name: str = ""
    # Plain Tensor semantics at the Python level; the work happens at dispatch.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, cpu: torch.Tensor) -> FakeDeviceTensor:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            cpu.shape,
            strides=cpu.stride(),
            storage_offset=cpu.storage_offset(),
            dtype=cpu.dtype,
            layout=cpu.layout,
            device=torch.device(cls.device_name, 0),
            requires_grad=cpu.requires_grad,
            storage_size=_WRAPPER_STORAGE_BYTES,
        )

    def __init__(self, cpu: torch.Tensor) -> None:
        self._cpu = cpu

    def __repr__(self, **kwargs: Any) -> str:
        return f"{repr(self._cpu)[:-1]}, device='{self.device}')"

    def __format__(self, format_spec: str) -> str:
        # torch formats only exact Tensors through item(); do it for the wrapper too.
        return self._cpu.__format__(format_spec)

    # The two methods below make the subclass traceable by dynamo.
    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_cpu"], None

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], ctx: None, outer_size: Any, outer_stride: Any
    ) -> FakeDeviceTensor:
        return FakeDeviceTensor(inner["_cpu"])

    # Dynamo must never compile this as a frame of its own: it would record
    # per-op graphs of the fake's plumbing instead of the user's model.
    @classmethod
    @torch._dynamo.disable
    def __torch_dispatch__(
        cls,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._has_compatible_shallow_copy_type.default:
            # A device tensor never shares a TensorImpl type with a CPU one; asking
            # the CPU data would say yes and send Module.to down the `.data =` path.
            return all(isinstance(t, FakeDeviceTensor) for t in args)
        _check_same_device(func, args, kwargs)
        # Map each unwrapped CPU tensor back to the object the caller passed, so
        # in-place and out= ops return the caller's tensor, not a new wrapper.
        originals: dict[int, torch.Tensor] = {}

        def unwrap(x: Any) -> Any:
            if isinstance(x, FakeDeviceTensor):
                originals[id(x._cpu)] = x
                return x._cpu
            if isinstance(x, torch.Tensor) and x.device.type == cls.device_name:
                # Only dynamo's fake tensors get here: while tracing, factory
                # calls make plain FakeTensors on the device instead of wrappers.
                return x.to("cpu")
            if isinstance(x, torch.Tensor):
                originals[id(x)] = x
            if isinstance(x, torch.device) and x.type == cls.device_name:
                return torch.device("cpu")
            return x

        wants_cpu = _is_cpu(kwargs.get("device"))
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

        def rewrap(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if id(x) in originals:
                original = originals[id(x)]
                if isinstance(original, FakeDeviceTensor) and _metadata(original) != _metadata(x):
                    # out= ops resize their output (torch.arange does, internally) and
                    # unsqueeze_/t_ restride in place: the wrapper follows its data.
                    with torch._C._DisableTorchDispatch():
                        original.as_strided_(x.shape, x.stride(), x.storage_offset())
                return original
            return x if wants_cpu else FakeDeviceTensor(x)

        return tree_map(rewrap, out)


def _metadata(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.storage_offset()


def _is_cpu(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _check_same_device(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
    """Refuse CPU/device mixes the way a real accelerator would.

    Without this the fake would silently accept code that fails on hardware.
    Zero-dim CPU tensors are allowed, as on CUDA.
    """
    if func in _CROSS_DEVICE_OPS:
        return
    found: list[torch.Tensor] = []
    tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) else None, (args, kwargs))
    on_device = [t for t in found if t.device.type == FakeDeviceTensor.device_name]
    on_cpu = [t for t in found if t.device.type == "cpu" and t.dim() > 0]
    if on_device and on_cpu:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two "
            f"devices, {on_device[0].device} and cpu! ({func})"
        )
    generators = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Generator)]
    if on_device and generators:
        raise RuntimeError(
            f"Expected a '{FakeDeviceTensor.device_name}' device type for generator but "
            f"found '{generators[0].device.type}': draw random numbers on CPU and move them"
        )


# The two allocation kernels of the device: torch builds every factory
# (zeros, randn, arange, `.to(device)`, ...) on one of them plus ops on the result.
def _empty_memory_format(
    size: Any,
    *,
    dtype: torch.dtype | None = None,
    layout: Any = None,
    device: Any = None,
    pin_memory: Any = None,
    memory_format: Any = None,
) -> FakeDeviceTensor:
    cpu = torch.empty(size, dtype=dtype, layout=layout, memory_format=memory_format)
    return FakeDeviceTensor(cpu)


def _empty_strided(
    size: Any,
    stride: Any,
    *,
    dtype: torch.dtype | None = None,
    layout: Any = None,
    device: Any = None,
    pin_memory: Any = None,
) -> FakeDeviceTensor:
    return FakeDeviceTensor(torch.empty_strided(size, stride, dtype=dtype, layout=layout))


class _FakeDeviceModule:
    """What `torch.<name>` offers: the calls the app and torch itself make."""

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def synchronize(self, device: Any = None) -> None:
        """Work is synchronous on CPU, so there is nothing to wait for."""

    def manual_seed_all(self, seed: int) -> None:
        """Nothing to seed: device random numbers come from CPU's default generator,
        which `torch.manual_seed` seeds anyway."""


def install_fake_device(name: str) -> None:
    """Make `name` a working torch device in this process, computing on CPU.

    Idempotent for the same name; a second, different name raises because torch
    has a single PrivateUse1 slot per process.
    """
    global _installed_name
    if _installed_name == name:
        return
    if _installed_name is not None:
        raise RuntimeError(
            f"fake device {_installed_name!r} is already installed; a process holds one "
            f"(asked for {name!r}): run it in another process"
        )
    _setup_privateuseone_for_python_backend(name, backend_module=_FakeDeviceModule())
    FakeDeviceTensor.device_name = name
    # Only factories reach PrivateUse1 kernels: every op with a FakeDeviceTensor
    # argument stops at __torch_dispatch__ (the Python key runs first).
    aten = torch.library.Library("aten", "IMPL")
    aten.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
    aten.impl("empty_strided", _empty_strided, "PrivateUse1")
    _libraries.append(aten)
    _installed_name = name
    _let_accelerator_synchronize()
    _forget_diffusers_device_detection()


def _let_accelerator_synchronize() -> None:
    """Make `torch.accelerator.synchronize()` a no-op for the fake, as timing code calls it.

    Its C++ path asks the device guard, which a Python backend cannot implement.
    """
    synchronize = torch.accelerator.synchronize

    def synchronize_unless_fake(device: Any = None) -> None:
        target = torch.accelerator.current_accelerator() if device is None else device
        if torch.device(target).type != _installed_name:
            synchronize(device)

    torch.accelerator.synchronize = synchronize_unless_fake


def _forget_diffusers_device_detection() -> None:
    """Let diffusers see the new accelerator even if it was imported first.

    `import diffusers` caches the detected accelerator ("cpu" here), and
    `enable_model_cpu_offload()` reads that cache to find its device.
    """
    torch_utils = sys.modules.get("diffusers.utils.torch_utils")
    if torch_utils is not None:
        torch_utils.TorchDeviceBackend._detect_device_type.cache_clear()
