"""One image's work split over a pool's ranks without sharding its weights: CFG parallel (each rank runs one of the
step's two guidance branches, at the transformer's call seam) and context parallel (diffusers' Ulysses attention:
each rank holds a slice of the image and text tokens). Tensor parallelism, which shards the weights, loads in
`models.tensor_parallel`."""
from __future__ import annotations

from ..records import CFG_RANKS, Placement


class CfgSplit:
    """At the transformer's call seam of a CFG-parallel pool: the call's batch (the unconditional and conditional
    halves, as a guided pipeline stacks them) split over the ranks, each rank's half computed, and the noise
    predictions gathered back in order, so every rank continues the pipeline with the whole batch. A batch that does
    not split evenly (guidance off: one branch) is computed whole on every rank."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def __call__(self, inner, args: tuple, kwargs: dict):
        import torch
        import torch.distributed as dist

        batch = kwargs["hidden_states"].shape[0] if "hidden_states" in kwargs else args[0].shape[0]
        if batch % self.world:
            return inner(*args, **kwargs)
        mine_args, mine_kwargs = branch(args, kwargs, batch, self.rank, self.world)
        output = inner(*mine_args, **mine_kwargs)
        sample = output[0] if isinstance(output, tuple) else output
        parts = [torch.empty_like(sample) for _ in range(self.world)]
        dist.all_gather(parts, sample.contiguous())
        whole = torch.cat(parts, dim=0)
        return (whole, *output[1:]) if isinstance(output, tuple) else whole


def branch(args: tuple, kwargs: dict, batch: int, rank: int, world: int) -> tuple[tuple, dict]:
    """One rank's share of a transformer call's inputs: every tensor `batch` deep cut to the rank's slice of the batch
    (a guided pipeline stacks its branches along it), the other inputs whole. `batch` must divide by `world`."""
    import torch

    share = batch // world
    mine = slice(rank * share, (rank + 1) * share)

    def part(value):
        return value[mine] if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch else value

    return tuple(part(a) for a in args), {name: part(value) for name, value in kwargs.items()}


def enable_context_parallel(pipe, degree: int, mesh_device_type: str) -> None:
    """diffusers' own context parallelism on the pipeline's transformer: Ulysses attention over `degree` ranks (the
    transformer's `_cp_plan` splits its inputs and gathers its output). Before any compile: the graph is traced
    with it."""
    from diffusers import ContextParallelConfig

    if mesh_device_type == "cpu":  # diffusers 0.42 divides by the accelerator count, 0 on a CPU mesh (compat)
        from ..compat import allow_cpu_tensor_parallel

        allow_cpu_tensor_parallel()
    pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree))


def split_work(seam, placement: Placement, rank: int, world: int) -> None:
    """After the recipe: a CFG-parallel pool's ranks each take one guidance branch at the transformer's call seam
    (`PreparedPipeline.seam()`)."""
    if placement is Placement.CFG:
        seam.split = CfgSplit(rank, min(world, CFG_RANKS))
