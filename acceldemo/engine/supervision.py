"""Replica supervision: each replica's state as its jobs move through their phases, what it served; a replica whose
processes are lost is restarted in the background, and the job it was running is run once more elsewhere."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from ..errors import AcceldemoError, GenerationFailed, ReplicaLost
from ..models.catalog import get_model
from ..records import DeviceSet, Phase, PipelineKey, Progress, ProgressCallback, ReplicaState, Shape, no_progress
from .admission import Line, Ticket
from .residency import Residency
from .stats import EngineStats

log = logging.getLogger("acceldemo.engine")

# A lost replica is started again in the background at most this many times in a row, this far apart.
RESTART_ATTEMPTS = 3
RESTART_BACKOFF_S = 5.0

T = TypeVar("T")


@dataclass(frozen=True)
class Replica:
    """One replica as the supervisor knows it."""

    devices: DeviceSet
    state: ReplicaState = ReplicaState.IDLE
    compiling: Shape | None = None  # the shape it compiles, while it does
    # While it compiles: seconds in, and the seconds a compile of this kind took here before (None: not known).
    compile_elapsed: float = 0.0
    compile_expected: float | None = None
    down: str = ""  # why it is out of service, while it is
    served: int = 0
    last_latency: float | None = None
    restarts: int = 0

    @property
    def shown(self) -> str:
        """The state as the page and /status write it."""
        if self.state is ReplicaState.DOWN:
            return f"down: {self.down}"
        if self.state is ReplicaState.COMPILING and self.compiling is not None:
            if self.compile_expected:
                return (f"compiling {self.compiling} — {self.compile_elapsed:.0f} s of about "
                        f"{self.compile_expected:.0f} s")
            return f"compiling {self.compiling}"
        return str(self.state)


_PHASE_STATES = {Phase.LOAD: ReplicaState.LOADING, Phase.COMPILE: ReplicaState.COMPILING}


class Supervisor:
    """Replicas by device set; every change to one is made under the supervisor's lock."""

    def __init__(self, line: Line, residency: Residency, stats: EngineStats):
        self.line, self.residency, self.stats = line, residency, stats
        self._replicas: dict[DeviceSet, Replica] = {}
        self._lock = threading.Lock()

    def _update(self, devices: DeviceSet, **changes) -> Replica:
        with self._lock:
            replica = replace(self._replicas.get(devices, Replica(devices)), **changes)
            self._replicas[devices] = replica
            return replica

    def replica(self, devices: DeviceSet) -> Replica:
        with self._lock:
            return self._replicas.get(devices, Replica(devices))

    def replicas(self) -> dict[DeviceSet, Replica]:
        with self._lock:
            return dict(self._replicas)

    def is_down(self, devices: DeviceSet) -> bool:
        return self.replica(devices).state is ReplicaState.DOWN

    def following(self, devices: DeviceSet, shape: Shape, on_progress: ProgressCallback) -> ProgressCallback:
        """`on_progress`, with the replica's state following the job's phases (loading, compiling WxH, busy)."""
        def progress(event: Progress) -> None:
            with self._lock:
                replica = self._replicas.get(devices, Replica(devices))
                if replica.state not in (ReplicaState.RESTARTING, ReplicaState.DOWN):
                    state = _PHASE_STATES.get(event.phase, ReplicaState.BUSY)
                    compiling = state is ReplicaState.COMPILING
                    self._replicas[devices] = replace(replica, state=state, compiling=shape if compiling else None,
                                                      compile_elapsed=event.elapsed if compiling else 0.0,
                                                      compile_expected=event.expected if compiling else None)
            on_progress(event)
        return progress

    def idle(self, devices: DeviceSet, served_seconds: float | None = None, served: int = 1) -> None:
        """The replica's job ended; `served_seconds`: it served `served` requests (drawn in one call) in that long
        (not a warm-up)."""
        with self._lock:
            replica = self._replicas.get(devices, Replica(devices))
            if replica.state not in (ReplicaState.RESTARTING, ReplicaState.DOWN):
                replica = replace(replica, state=ReplicaState.IDLE, compiling=None)
            if served_seconds is not None:
                replica = replace(replica, served=replica.served + served, last_latency=served_seconds)
            self._replicas[devices] = replica

    def attempt(self, ticket: Ticket, candidates: list[DeviceSet], started: float, on_progress: ProgressCallback,
                cancelled: Callable[[], bool], work: Callable[[Ticket, float, float], T]) -> T:
        """Wait for the ticket's devices, do the work on the ones given (`work(ticket, started, queue_wait)`; the
        devices are `ticket.granted`), free them.

        A replica lost during the work (its process died or hung) is restarted in the background, and the work is
        done once more on another replica: a generation is idempotent for its seeds, so nothing is lost. The retry
        enters the line again past its limit: the request was admitted already. Of a shared call, only its leader
        reports the loss.
        """
        lost: list[ReplicaLost] = []
        while True:
            try:
                self.line.wait(ticket, on_progress, cancelled)
                return work(ticket, started, time.perf_counter() - started)
            except ReplicaLost as error:
                if ticket.leader is None:
                    self.lose(ticket.granted, error)
                if lost:  # retried once already
                    raise
                lost.append(error)
                on_progress(Progress(Phase.QUEUE, f"{error.devices} was lost ({error}): running again on another "
                                                  "replica"))
            finally:
                self.line.release(ticket)
            usable = [c for c in candidates if str(c) not in {e.devices for e in lost} and not self.is_down(c)]
            if not usable:
                raise lost[-1]
            ticket = self.line.reenter(ticket, usable)

    def usable(self, candidates: list[DeviceSet]) -> list[DeviceSet]:
        """The candidates not down; GenerationFailed naming why when every one is."""
        usable = [c for c in candidates if not self.is_down(c)]
        if candidates and not usable:
            raise GenerationFailed("every replica is down: " + "; ".join(f"{c} {self.replica(c).shown}"
                                                                          for c in candidates))
        return usable

    def lose(self, devices: DeviceSet, error: ReplicaLost) -> None:
        """A replica's processes are gone: forget its pipelines and start it again in the background."""
        log.error("replica %s lost: %s", devices, error)
        replica = self.replica(devices)
        self._update(devices, state=ReplicaState.RESTARTING, restarts=replica.restarts + 1)
        keys = self.residency.evict_on(devices, f"replica {devices} lost")
        self.stats.restarts.inc()
        threading.Thread(target=self._restart, args=(devices, keys), name=f"restart-{devices}", daemon=True).start()

    def _restart(self, devices: DeviceSet, keys: list[PipelineKey]) -> None:
        """Load the lost replica's pipelines again, in its own turn on its devices, a few times if it must."""
        why = "no pipeline to load"
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            ticket = self.line.enter(f"restarting {devices}", [devices], admitted=True)
            try:
                self.line.wait(ticket)
                for key in keys:
                    resident, _ = self.residency.acquire(key, get_model(key.model), no_progress)
                    self.residency.release(resident)
                self._update(devices, state=ReplicaState.IDLE, down="")
                log.info("replica %s is back (attempt %d)", devices, attempt)
                return
            except AcceldemoError as error:
                why = str(error)
                log.warning("restarting replica %s failed (attempt %d of %d): %s", devices, attempt,
                            RESTART_ATTEMPTS, why)
            finally:
                self.line.release(ticket)
            time.sleep(RESTART_BACKOFF_S * attempt)
        self._update(devices, state=ReplicaState.DOWN, down=why)
