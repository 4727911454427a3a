"""How long compiles took on this host, per kind of compile, and the estimate the next one of that kind shows: kept in
the cache folder (compile_times.json), so a restarted app or another process on the same cache knows them too."""
from __future__ import annotations

import fcntl
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..files import write_atomically
from ..records import Phase, PipelineKey, Progress, ProgressCallback, Request, placement_label

# Durations kept per kind; the estimate is the median of these.
KEPT = 5
# How often a running compile's progress event is sent again with its elapsed time (the bar moves meanwhile).
TICK_S = 1.0


@dataclass(frozen=True)
class Estimate:
    """What the next compile of a kind is expected to take: the median of the last few, and the last one."""

    expected: float
    last: float

    def __str__(self) -> str:
        return f"about {_seconds(self.expected)} ({_seconds(self.last)} last time on this host)"


def _seconds(value: float) -> str:
    if value < 10:
        return f"{value:.1f} s"
    if value < 120:
        return f"{value:.0f} s"
    return f"{value / 60:.0f} min"


def compile_kind(key: PipelineKey, request: Request, generation: str) -> str:
    """What makes two compiles alike: model, hardware and its generation, mode, placement (and its degree), and the
    graph the shape needs (shapes sharing a graph, e.g. 64x128 and 128x64 on packed latents, are one kind)."""
    where = placement_label(key.placement, key.tp_size, key.cp_size)
    graph = "x".join(str(part) for part in request.graph_key)
    return f"{key.model}|{key.hardware}:{generation or '-'}|{key.mode}|{where}|{graph}"


class CompileTimes:
    """compile_times.json in the cache folder: the last durations per kind. Read at every compile and updated under a
    file lock with an atomic replace, so processes sharing the cache folder see each other's records."""

    def __init__(self, cache_dir: Path):
        self.path = cache_dir / "compile_times.json"
        self._lock = threading.Lock()

    def _read(self) -> dict[str, list[float]]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def estimate(self, kind: str) -> Estimate | None:
        seen = self._read().get(kind)
        return Estimate(statistics.median(seen), seen[-1]) if seen else None

    def record(self, kind: str, seconds: float) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock, open(self.path.with_name(".compile_times.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            records = self._read()
            records[kind] = [*records.get(kind, []), round(seconds, 3)][-KEPT:]
            write_atomically(self.path, json.dumps(records, indent=1, sort_keys=True))


class CompileClock:
    """A call's progress callback that says how long its compile should take: the first compile event of the call
    gets the estimate of its kind (or says there is none yet), and while the compile runs the event is sent again
    every TICK_S with its elapsed time and the expected seconds (the bar advances by elapsed ÷ expected).
    `measured`: seconds from the compile's first event to the call's next phase."""

    def __init__(self, on_progress: ProgressCallback, estimate: Callable[[], Estimate | None]):
        self.on_progress, self.estimate = on_progress, estimate
        self.measured: float | None = None
        self._compiling: Progress | None = None
        self._started = 0.0
        self._expected: float | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, event: Progress) -> None:
        with self._lock:
            if event.phase is Phase.COMPILE and self.measured is None:
                if self._compiling is None:
                    self._start(event)
                    event = self._compiling
                else:
                    event = self._compiling = replace(self._compiling, message=self._shown(event.message))
            elif self._compiling is not None:
                self.measured = time.perf_counter() - self._started
                self._compiling = None
                self._done.set()
        self.on_progress(event)

    def _start(self, event: Progress) -> None:
        estimate = self.estimate()
        self._started = time.perf_counter()
        self._expected = estimate.expected if estimate else None
        self._note = str(estimate) if estimate else "no estimate yet: the first compile of this kind on this host"
        self._compiling = replace(event, message=self._shown(event.message), expected=self._expected, elapsed=0.0)
        threading.Thread(target=self._tick, name="compile-clock", daemon=True).start()

    def _shown(self, message: str) -> str:
        return f"{message} — {self._note}"

    def _tick(self) -> None:
        while not self._done.wait(TICK_S):
            with self._lock:
                if self._compiling is None:
                    return
                event = self._compiling = replace(self._compiling, elapsed=time.perf_counter() - self._started)
            self.on_progress(event)

    def stop(self) -> None:
        """The call ended (a compile that never reached another phase is not measured)."""
        with self._lock:
            self._compiling = None
        self._done.set()
