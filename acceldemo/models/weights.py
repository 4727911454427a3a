"""What a model's weights take: the tensors they are saved as, and the bytes a loaded pipeline holds."""
from __future__ import annotations

# Bytes per value of the dtypes the catalog's recipes load weights in.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def saved_tensors(module) -> list:
    """The tensors a module's weights are saved as: its parameters (a tied one once) and its persistent buffers (SD3's
    positional embedding table is one: 226 M values at 384 positions)."""
    saved = set(module.state_dict(keep_vars=True))
    return [*module.parameters(), *(buffer for name, buffer in module.named_buffers() if name in saved)]


def weight_bytes(pipe) -> int:
    """Bytes the pipeline's weights take as held (`saved_tensors`): quantized tensors by their int8/fp8 data and
    scales, a sharded tensor by this rank's shard."""
    import torch

    total = 0
    for component in pipe.components.values():
        if not isinstance(component, torch.nn.Module):
            continue
        for tensor in saved_tensors(component):
            stack = [tensor]
            while stack:
                part = stack.pop()
                if type(part) in (torch.Tensor, torch.nn.Parameter):
                    total += part.numel() * part.element_size()
                elif hasattr(part, "to_local"):  # a DTensor: this rank's shard
                    stack.append(part.to_local())
                else:  # a tensor subclass (torchao's quantized tensors): the plain tensors it holds
                    names, _ = part.__tensor_flatten__()
                    stack.extend(getattr(part, name) for name in names)
    return total
