"""The compiled-shape ledger: for every pipeline, each static shape it met — its size and the batch of images a
call drew at it (a compiled mode builds a graph per batch bucket) — cold, compiling, ready or failed, with what
compiling it cost and how often it was reused."""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from ..errors import CapacityExceeded
from ..records import Batch, DeviceSet, PipelineKey, RunOutput, Shape, ShapeState


@dataclass(frozen=True)
class CompiledShape:
    """What one static shape of one pipeline, at one batch size, costs and how often it was reused."""

    shape: Shape
    devices: DeviceSet | None = None  # the replica holding it
    batch: int = 1  # images one call drew at it (in a compiled mode, a bucket of its own graphs)
    state: ShapeState = ShapeState.COLD
    reason: str = ""
    graphs: int = 0
    compile_seconds: float = 0.0
    first_call_seconds: float | None = None
    last_latency: float | None = None
    hits: int = 0


@dataclass(frozen=True)
class Visit:
    """A call about to run, as the ledger saw it: the first at its shape (or a retry of a failed one), and whether
    it should compile (its pipeline has no graph for it yet)."""

    key: PipelineKey
    row: tuple[Shape, int]  # (shape, batch size)
    graph_key: tuple
    first: bool
    expect_compile: bool


class ShapeLedger:
    """Compiled shapes per pipeline, one record per shape and batch size, and the graphs each pipeline holds (a
    call's graph key: several shapes may share one, e.g. 64x128 and 128x64 on packed latents). Records outlive
    eviction: a reload shows what was compiled. The operator's limit counts shapes, whatever their batch sizes."""

    def __init__(self, max_shapes: int):
        self.max_shapes = max_shapes
        self._shapes: dict[PipelineKey, dict[tuple[Shape, int], CompiledShape]] = {}
        self._graphs: dict[PipelineKey, set[tuple]] = {}
        self._lock = threading.Lock()

    def begin(self, key: PipelineKey, batch: Batch) -> Visit:
        """Record a call at the batch's shape and size; CapacityExceeded past the operator's shapes per pipeline."""
        shape, row = batch.first.shape, (batch.first.shape, batch.size)
        with self._lock:
            shapes = self._shapes.setdefault(key, {})
            record = shapes.get(row)
            if record is None:
                known = list(dict.fromkeys(s.shape for s in shapes.values() if s.state is not ShapeState.FAILED))
                if shape not in known and len(known) >= self.max_shapes:
                    raise CapacityExceeded(
                        f"{key} already holds {len(known)} shapes (ACCELDEMO_MAX_SHAPES={self.max_shapes}); use one "
                        f"of {', '.join(map(str, known))} or raise the limit")
                record = CompiledShape(shape, key.devices, batch.size)
            first = record.state in (ShapeState.COLD, ShapeState.FAILED)
            expect_compile = key.mode.compiles and batch.graph_key not in self._graphs.get(key, ())
            shapes[row] = replace(record, state=ShapeState.COMPILING) if expect_compile else record
        return Visit(key, row, batch.graph_key, first, expect_compile)

    def abandoned(self, visit: Visit) -> None:
        """The call ended before its pipeline could say anything of the shape (its replica was lost, it was
        stopped in a pool): the record goes back to what it was."""
        with self._lock:
            record = self._shapes[visit.key][visit.row]
            if record.state is ShapeState.COMPILING:
                state = ShapeState.COLD if visit.first else ShapeState.READY
                self._shapes[visit.key][visit.row] = replace(record, state=state)

    def failed(self, visit: Visit, reason: str) -> None:
        """The call failed: a first visit's shape is marked failed with the reason (asking again retries it)."""
        with self._lock:
            record = self._shapes[visit.key][visit.row]
            if visit.first:
                self._shapes[visit.key][visit.row] = replace(record, state=ShapeState.FAILED, reason=reason)
            elif record.state is ShapeState.COMPILING:
                self._shapes[visit.key][visit.row] = replace(record, state=ShapeState.READY)

    def finished(self, visit: Visit, out: RunOutput, warm_up: bool) -> CompiledShape:
        with self._lock:
            self._graphs.setdefault(visit.key, set()).add(visit.graph_key)
            record = self._shapes[visit.key][visit.row]
            record = replace(record, state=ShapeState.READY, reason="", graphs=record.graphs + out.new_graphs,
                             compile_seconds=record.compile_seconds + out.compile_seconds,
                             first_call_seconds=out.seconds if visit.first else record.first_call_seconds,
                             hits=record.hits + (not visit.first),
                             last_latency=out.seconds if not warm_up and not visit.first else record.last_latency)
            self._shapes[visit.key][visit.row] = record
            return record

    def holds(self, key: PipelineKey, graph_key: tuple) -> bool:
        """Whether the pipeline has a graph for this graph key (its shape compiled)."""
        with self._lock:
            return graph_key in self._graphs.get(key, ())

    def record(self, key: PipelineKey, shape: Shape, batch: int = 1) -> CompiledShape:
        with self._lock:
            return self._shapes[key][(shape, batch)]

    def shapes(self, key: PipelineKey) -> tuple[CompiledShape, ...]:
        with self._lock:
            return tuple(self._shapes.get(key, {}).values())

    def ready_on(self, devices: DeviceSet) -> list[Shape]:
        """The shapes compiled (ready) in any pipeline on these devices."""
        with self._lock:
            return sorted({s.shape for key, shapes in self._shapes.items() if key.devices == devices
                           for s in shapes.values() if s.state is ShapeState.READY})

    def latency(self, model: str, shape: Shape) -> float | None:
        """Recent seconds per image of this model at this shape, on any replica and batch size: its last warm call,
        else its first call, divided by the images it drew."""
        with self._lock:
            seen = [(s.last_latency or s.first_call_seconds or 0.0) / s.batch for key, shapes in self._shapes.items()
                    if key.model == model for s in shapes.values() if s.shape == shape]
        seen = [seconds for seconds in seen if seconds]
        return min(seen) if seen else None

    def warm_latency(self, key: PipelineKey, shape: Shape, batch: int) -> float | None:
        """The last warm call's seconds of this pipeline at this shape and batch size (None before one)."""
        with self._lock:
            record = self._shapes.get(key, {}).get((shape, batch))
            return record.last_latency if record is not None else None
