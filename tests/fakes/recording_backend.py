"""A torch.compile backend that records every graph it is given and runs it eagerly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._dynamo

# Dynamo's registry raises on a second registration, so each name's record list
# is kept here and handed back to later callers.
_records_by_name: dict[str, list[CompiledGraph]] = {}


@dataclass(frozen=True)
class CompiledGraph:
    """One call of the backend: what dynamo asked it to compile."""

    graph: torch.fx.GraphModule
    input_count: int
    input_device_types: tuple[str, ...]


def register_recording_backend(name: str, on_graph: Callable[[], None] = lambda: None) -> list[CompiledGraph]:
    """Register `name` as a compile backend; return the list it appends each graph to.

    `on_graph` runs before each graph is recorded (a stand-in package reads its settings then).
    Calling again with the same name returns the same list. A name that someone
    else registered (for example "inductor") raises ValueError rather than hiding
    the real backend.
    """
    if name in _records_by_name:
        return _records_by_name[name]
    if name in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"compile backend {name!r} is already registered by someone else")
    records: list[CompiledGraph] = []

    def record_and_run_eagerly(
        gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
    ) -> Callable[..., object]:
        on_graph()
        records.append(
            CompiledGraph(
                graph=gm,
                input_count=len(example_inputs),
                input_device_types=tuple(
                    t.device.type for t in example_inputs if isinstance(t, torch.Tensor)
                ),
            )
        )
        return gm.forward

    torch._dynamo.register_backend(record_and_run_eagerly, name=name)
    _records_by_name[name] = records
    return records
