"""The compiled-shape ledger: for every pipeline, each static shape it met — cold, compiling, ready or failed — with
what compiling it cost and how often it was reused."""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from ..errors import CapacityExceeded
from ..records import DeviceSet, PipelineKey, Request, RunOutput, Shape, ShapeState


@dataclass(frozen=True)
class CompiledShape:
    """What one static shape of one pipeline costs and how often it was reused."""

    shape: Shape
    devices: DeviceSet | None = None  # the replica holding it
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
    shape: Shape
    graph_key: tuple
    first: bool
    expect_compile: bool


class ShapeLedger:
    """Compiled shapes per pipeline, and the graphs each pipeline holds (a shape's graph key: several shapes may share
    one, e.g. 64x128 and 128x64 on packed latents). Records outlive eviction: a reload shows what was compiled."""

    def __init__(self, max_shapes: int):
        self.max_shapes = max_shapes
        self._shapes: dict[PipelineKey, dict[Shape, CompiledShape]] = {}
        self._graphs: dict[PipelineKey, set[tuple]] = {}
        self._lock = threading.Lock()

    def begin(self, key: PipelineKey, request: Request) -> Visit:
        """Record a call at the request's shape; CapacityExceeded past the operator's shapes per pipeline."""
        shape = request.shape
        with self._lock:
            shapes = self._shapes.setdefault(key, {})
            record = shapes.get(shape)
            if record is None:
                known = [s for s in shapes.values() if s.state is not ShapeState.FAILED]
                if len(known) >= self.max_shapes:
                    raise CapacityExceeded(
                        f"{key} already holds {len(known)} shapes (ACCELDEMO_MAX_SHAPES={self.max_shapes}); use one "
                        f"of {', '.join(str(s.shape) for s in known)} or raise the limit")
                record = CompiledShape(shape, key.devices)
            first = record.state in (ShapeState.COLD, ShapeState.FAILED)
            expect_compile = key.mode.compiles and request.graph_key not in self._graphs.get(key, ())
            shapes[shape] = replace(record, state=ShapeState.COMPILING) if expect_compile else record
        return Visit(key, shape, request.graph_key, first, expect_compile)

    def abandoned(self, visit: Visit) -> None:
        """The call ended before its pipeline could say anything of the shape (its replica was lost, it was
        stopped in a pool): the record goes back to what it was."""
        with self._lock:
            record = self._shapes[visit.key][visit.shape]
            if record.state is ShapeState.COMPILING:
                state = ShapeState.COLD if visit.first else ShapeState.READY
                self._shapes[visit.key][visit.shape] = replace(record, state=state)

    def failed(self, visit: Visit, reason: str) -> None:
        """The call failed: a first visit's shape is marked failed with the reason (asking again retries it)."""
        with self._lock:
            record = self._shapes[visit.key][visit.shape]
            if visit.first:
                self._shapes[visit.key][visit.shape] = replace(record, state=ShapeState.FAILED, reason=reason)
            elif record.state is ShapeState.COMPILING:
                self._shapes[visit.key][visit.shape] = replace(record, state=ShapeState.READY)

    def finished(self, visit: Visit, out: RunOutput, warm_up: bool) -> CompiledShape:
        with self._lock:
            self._graphs.setdefault(visit.key, set()).add(visit.graph_key)
            record = self._shapes[visit.key][visit.shape]
            record = replace(record, state=ShapeState.READY, reason="", graphs=record.graphs + out.new_graphs,
                             compile_seconds=record.compile_seconds + out.compile_seconds,
                             first_call_seconds=out.seconds if visit.first else record.first_call_seconds,
                             hits=record.hits + (not visit.first),
                             last_latency=out.seconds if not warm_up and not visit.first else record.last_latency)
            self._shapes[visit.key][visit.shape] = record
            return record

    def holds(self, key: PipelineKey, graph_key: tuple) -> bool:
        """Whether the pipeline has a graph for this graph key (its shape compiled)."""
        with self._lock:
            return graph_key in self._graphs.get(key, ())

    def record(self, key: PipelineKey, shape: Shape) -> CompiledShape:
        with self._lock:
            return self._shapes[key][shape]

    def shapes(self, key: PipelineKey) -> tuple[CompiledShape, ...]:
        with self._lock:
            return tuple(self._shapes.get(key, {}).values())

    def ready_on(self, devices: DeviceSet) -> list[Shape]:
        """The shapes compiled (ready) in any pipeline on these devices."""
        with self._lock:
            return sorted({s.shape for key, shapes in self._shapes.items() if key.devices == devices
                           for s in shapes.values() if s.state is ShapeState.READY})

    def latency(self, model: str, shape: Shape) -> float | None:
        """Recent seconds of one call of this model at this shape, on any replica: its last warm call, else its
        first call."""
        with self._lock:
            seen = [s.last_latency or s.first_call_seconds for key, shapes in self._shapes.items()
                    if key.model == model for s in shapes.values() if s.shape == shape]
        seen = [seconds for seconds in seen if seconds]
        return min(seen) if seen else None
