"""The backend of an engine in front of a fleet (replicas on other hosts, a Ray Serve deployment): its line is the
fleet's own queue, bounded here by the fleet's capacity plus ACCELDEMO_QUEUE_SIZE; each image runs on a replica in a
thread of its own, counted like any request."""
from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Protocol

from ..config import Settings
from ..errors import ClientQueueFull, InvalidRequest, QueueFull
from ..hardware import HardwareRegistry
from ..records import GenerateResult, ProgressCallback, Request, Shape, placement_label
from .jobs import Job, Running, of_image, run_together
from .ledger import CompiledShape
from .stats import EngineStats, Kind, Outcome
from .views import DeviceView, ReplicaView


class Fleet(Protocol):
    """Replicas on other hosts (a Ray Serve deployment). Its own placement and routing decide which replica draws
    an image."""

    def capacity(self, hardware: str) -> int:
        """Replicas of `hardware` the fleet may run at once (its autoscaling maximum): requests beyond them wait."""

    def devices_per_replica(self, hardware: str) -> int:
        """Devices (GPUs, NeuronCores, chips, CPU cores) each replica of `hardware` holds: the most ranks one
        pipeline of a replica can span (0 where the fleet serves no `hardware`)."""

    def run(self, request: Request, on_progress: ProgressCallback, cancelled: Callable[[], bool]) -> GenerateResult:
        """One image drawn by a replica (retried once elsewhere when its replica is lost), or its typed error."""

    def warm_up(self, request: Request, shapes: list[Request]) -> list[CompiledShape]:
        """The shapes compiled by one replica (the others find them in the shared artifact store)."""

    def replicas(self) -> list[ReplicaView]:
        """Every node's replicas as the fleet last saw them."""

    def close(self) -> None: ...


class FleetBackend:
    """Requests run by a fleet's replicas (see `Backend`)."""

    def __init__(self, settings: Settings, hardware: HardwareRegistry, fleet: Fleet, stats: EngineStats):
        self.settings, self.hardware, self.fleet, self.stats = settings, hardware, fleet, stats
        # Images sent to the fleet and not yet answered, by hardware.
        self._in_fleet: dict[str, int] = {}
        # And by client (Ray Serve orders them; each client's are capped at the replicas plus its share of the line).
        self._by_client: dict[str, int] = {}
        self._latency: dict[tuple[str, Shape], float] = {}
        self._lock = threading.Lock()

    def start(self, job: Job, on_progress: ProgressCallback, started: float) -> Job:
        request = job.request
        bodies = [lambda i=i, member=member: self._image(member, of_image(i, on_progress), job.cancelled)
                  for i, member in enumerate(request.members())]
        return self._admit(job, Kind.GENERATE, bodies, lambda parts: GenerateResult.of_images(request, parts))

    def start_warm_up(self, job: Job, warm: list[tuple[Request, int]], on_progress: ProgressCallback) -> Job:
        """One replica compiles each shape once (a fleet warms batch size 1); the others load its packages from the
        shared artifact store."""
        shapes = list(dict.fromkeys(one for one, _ in warm))
        return self._admit(job, Kind.WARMUP, [lambda: self.fleet.warm_up(job.request, shapes)],
                           lambda parts: parts[0])

    def _image(self, request: Request, on_progress: ProgressCallback, cancelled: Callable[[], bool]):
        result = self.fleet.run(request, on_progress, cancelled)
        self.stats.observe(result)
        with self._lock:
            self._latency[(request.model, request.shape)] = \
                result.seconds - result.queue_wait - result.load_seconds
        return result

    def _admit(self, job: Job, kind: Kind, bodies: list[Callable[[], object]],
               combine: Callable[[list], object]) -> Job:
        """Admitted while the fleet's replicas plus ACCELDEMO_QUEUE_SIZE places hold every body, all or none;
        refused with QueueFull (counted) otherwise."""
        request = job.request
        if request.devices is not None:
            self.stats.count(kind, Outcome.INVALID)
            raise InvalidRequest("device", str(request.devices), "none: on a Ray fleet, Ray Serve places the replicas")
        held = self.fleet.devices_per_replica(request.hardware)
        if request.world_size > held:
            # Refused before anything is sent: a replica would fail to start a pool of more ranks than its devices.
            self.stats.count(kind, Outcome.INVALID)
            raise InvalidRequest("placement", placement_label(request.placement, request.tp_size, request.cp_size),
                                 f"a placement of at most {held} rank(s): each replica of this fleet holds {held} "
                                 f"{request.hardware} device(s)")
        capacity = self.fleet.capacity(request.hardware)
        share = self.settings.client_queue_limit
        with self._lock:
            in_flight = self._in_fleet.get(request.hardware, 0)
            own = self._by_client.get(job.client, 0)
            if job.client and share < self.settings.queue_size and own + len(bodies) > capacity + share:
                self.stats.count(kind, Outcome.REFUSED)
                waiting = max(0, own - capacity)
                raise ClientQueueFull(waiting, share, waiting, self._retry_after(request, waiting, capacity))
            if in_flight + len(bodies) > capacity + self.settings.queue_size:
                waiting = max(0, in_flight - capacity)
                self.stats.count(kind, Outcome.REFUSED)
                raise QueueFull(waiting, self.settings.queue_size, waiting,
                                self._retry_after(request, waiting, capacity))
            self._in_fleet[request.hardware] = in_flight + len(bodies)
            if job.client:
                self._by_client[job.client] = own + len(bodies)

        def done(_: int) -> None:
            with self._lock:
                self._in_fleet[request.hardware] -= 1
                if job.client:
                    self._by_client[job.client] -= 1
                    if not self._by_client[job.client]:
                        del self._by_client[job.client]

        return run_together(job, kind, self.stats, bodies, combine, done)

    def _retry_after(self, request: Request, waiting: int, capacity: int) -> int:
        """Seconds until a replica is likely free for one more: the `waiting` ahead of it at the recent latency of its
        model and shape, spread over the fleet's replicas."""
        latency = self._latency.get((request.model, request.shape)) or 1.0
        return max(1, math.ceil((waiting + 1) * latency / max(capacity, 1)))

    def queue_depth(self) -> int:
        with self._lock:
            return sum(max(0, n - self.fleet.capacity(hw)) for hw, n in self._in_fleet.items())

    def busy_devices(self) -> int:
        return 0  # the fleet's devices are its replicas' hosts'

    def resident_pipelines(self) -> int:
        return 0

    def running(self) -> Running:
        devices = tuple(DeviceView(device, None, 0, ()) for device in self.hardware.devices())
        return Running(self.queue_depth(), devices, tuple(self.fleet.replicas()))

    def close(self) -> None:
        self.fleet.close()
