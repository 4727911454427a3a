"""Loading a pipeline sharded over a device mesh: each rank reads only its slice of every sharded weight."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import Settings
from ..records import Quantization
from .catalog import ModelSpec
from .loading import load_pipeline, model_source


@dataclass(frozen=True)
class ShardedComponent:
    """How much of one component this rank holds as tensor-parallel shards."""

    name: str
    sharded: int  # parameters that are DTensor shards
    parameters: int

    def __str__(self) -> str:
        return f"{self.name} {self.sharded}/{self.parameters}"


def load_sharded_pipeline(spec: ModelSpec, settings: Settings, mesh,
                          quantization: Quantization = Quantization.NONE) -> tuple[object, list[ShardedComponent]]:
    """The model's pipeline with every component of `spec.tp_components` sharded over `mesh` (a mesh of one rank:
    the whole pipeline, at `quantization`; sharded loading takes no quantized weights, the engine refuses both).

    diffusers models load with `parallel_config=TensorParallelConfig(mesh=mesh)`, transformers text encoders with
    their own TP plan (`DistributedConfig(tp_plan="auto")`); the rest loads whole. Placing the pipeline on the
    rank's device is the recipe's job, as for any pipeline.
    """

    if mesh.size() == 1:  # nothing to shard: the whole pipeline (a 1-rank pool measures the pool's own path)
        pipe = load_pipeline(spec, settings, quantization)
        return pipe, [_count(name, getattr(pipe, name)) for name in spec.tp_components]
    if mesh.device_type == "cpu":
        from ..compat import allow_cpu_tensor_parallel

        allow_cpu_tensor_parallel()
    # The unsharded parts first: a model that is not on this host fails here, before the long sharded reads.
    pipe = load_pipeline(spec, settings, **{name: None for name in spec.tp_components})
    source = model_source(spec, settings)
    index = spec.family.pipeline_class().load_config(source, local_files_only=True)
    sharded = {name: _load_sharded(source, name, index[name], spec, mesh) for name in spec.tp_components}
    pipe.register_modules(**sharded)
    counts = [_count(name, module) for name, module in sharded.items()]
    for count in counts:
        if not count.sharded:
            raise RuntimeError(f"{spec.name}: {count.name} loaded whole, its tensor-parallel plan sharded nothing")
    return pipe, counts


def _load_sharded(source: str, name: str, entry: list[str], spec: ModelSpec, mesh):
    import importlib

    import torch

    library, class_name = entry
    model_class = getattr(importlib.import_module(library), class_name)
    common = dict(subfolder=name, dtype=getattr(torch, spec.dtype), local_files_only=True)
    if library == "diffusers":
        from diffusers import TensorParallelConfig

        return model_class.from_pretrained(source, parallel_config=TensorParallelConfig(mesh=mesh), **common)
    if library == "transformers":
        from transformers.distributed import DistributedConfig

        # transformers 5 builds its own mesh over the whole world from the config (it ignores `device_mesh=`
        # whenever a DistributedConfig shards): the pool's world is exactly the TP group, so the two meshes agree.
        return model_class.from_pretrained(source, distributed_config=DistributedConfig(tp_plan="auto"), **common)
    raise ValueError(f"{spec.name}: no tensor-parallel loader for {name} ({library}.{class_name})")


def _count(name: str, module) -> ShardedComponent:
    from torch.distributed.tensor import DTensor

    parameters = list(module.parameters())
    return ShardedComponent(name, sum(isinstance(p, DTensor) for p in parameters), len(parameters))
