"""The backend of an engine in front of a fleet (replicas on other hosts, a Ray Serve deployment): the engine's line
(`Line`, the same as on local devices) holds the images until the fleet has room for them (its dispatch window), so
clients take turns there and ACCELDEMO_QUEUE_SIZE and ACCELDEMO_CLIENT_QUEUE bound it; each image then runs on a
replica in a thread of its own, counted like any request."""
from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from ..config import Settings
from ..errors import InvalidRequest
from ..hardware import HardwareRegistry
from ..records import DeviceSet, GenerateResult, ProgressCallback, Request, Shape, placement_label
from .admission import Line, Ticket
from .jobs import Job, Running, admit, of_image
from .ledger import CompiledShape
from .stats import EngineStats, Kind, Outcome
from .views import DeviceView, ReplicaView


class Fleet(Protocol):
    """Replicas on other hosts (a Ray Serve deployment). Its own placement and routing decide which replica draws
    an image."""

    def capacity(self, hardware: str) -> int:
        """Replicas of `hardware` the fleet may run at once (its autoscaling maximum): requests beyond them wait."""

    def dispatch_window(self, hardware: str) -> int:
        """Images of `hardware` to have with the fleet at once: its replicas' worth, or as many as its autoscaler must
        see queued to scale to its maximum. The engine's line holds the others, taking turns across clients."""

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
        # Its devices are the fleet's dispatch window: one slot per image it may hold at once.
        self.line = Line(settings.queue_size, settings.device_wait_s, settings.client_queue_limit)
        self._latency: dict[tuple[str, Shape], float] = {}
        self._lock = threading.Lock()

    def start(self, job: Job, on_progress: ProgressCallback, started: float) -> Job:
        request = job.request
        bodies = [lambda ticket, i=i, member=member: self._image(ticket, member, of_image(i, on_progress),
                                                                  job.cancelled)
                  for i, member in enumerate(request.members())]
        return self._admit(job, Kind.GENERATE, f"{request.shape} · {request.model} · {request.mode}", bodies,
                           lambda parts: GenerateResult.of_images(request, parts))

    def start_warm_up(self, job: Job, warm: list[tuple[Request, int]], on_progress: ProgressCallback) -> Job:
        """One replica compiles each shape once (a fleet warms batch size 1); the others load its packages from the
        shared artifact store."""
        shapes = list(dict.fromkeys(one for one, _ in warm))

        def warm_up(ticket: Ticket) -> list[CompiledShape]:
            self.line.wait(ticket, on_progress, job.cancelled)
            return self.fleet.warm_up(job.request, shapes)

        return self._admit(job, Kind.WARMUP, f"warm-up · {job.request.model} · {job.request.mode}", [warm_up],
                           lambda parts: parts[0])

    def _image(self, ticket: Ticket, request: Request, on_progress: ProgressCallback,
               cancelled: Callable[[], bool]) -> GenerateResult:
        """Once the ticket's turn has come and the fleet has room: the image, drawn by one of its replicas."""
        began = time.perf_counter()
        self.line.wait(ticket, on_progress, cancelled)
        waited = time.perf_counter() - began  # in this line: the replica counts its own queue's wait
        result = self.fleet.run(request, on_progress, cancelled)
        result = dataclasses.replace(result, seconds=result.seconds + waited, queue_wait=result.queue_wait + waited)
        self.stats.observe(result)
        with self._lock:
            self._latency[(request.model, request.shape)] = \
                result.seconds - result.queue_wait - result.load_seconds
        return result

    def _admit(self, job: Job, kind: Kind, what: str, bodies: list[Callable[[Ticket], object]],
               combine: Callable[[list], object]) -> Job:
        """One ticket per body in the line, all or none (a refusal counted: QueueFull past ACCELDEMO_QUEUE_SIZE,
        ClientQueueFull past the client's share); each body runs in a thread of its own once its ticket has a place
        in the fleet's dispatch window."""
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
        window = [DeviceSet(request.hardware, (slot,)) for slot in range(self.fleet.dispatch_window(request.hardware))]
        return admit(job, kind, self.stats, self.line,
                     lambda: self.line.enter_together(what, window, len(bodies), client=job.client,
                                                      place_name=f"the fleet's {request.hardware} replicas"),
                     bodies, combine,
                     lambda ahead: self._retry_after(request, ahead, self.fleet.capacity(request.hardware)))

    def _retry_after(self, request: Request, waiting: int, capacity: int) -> int:
        """Seconds until a replica is likely free for one more: the `waiting` ahead of it at the recent latency of its
        model and shape, spread over the fleet's replicas."""
        latency = self._latency.get((request.model, request.shape)) or 1.0
        return max(1, math.ceil((waiting + 1) * latency / max(capacity, 1)))

    def queue_depth(self) -> int:
        """Images waiting: in the engine's line, and those with the fleet beyond its replicas (in its own queue)."""
        sent = Counter(hardware for hardware, _ in self.line.running())
        return len(self.line.waiting()) + sum(max(0, n - self.fleet.capacity(hw)) for hw, n in sent.items())

    def busy_devices(self) -> int:
        return 0  # the fleet's devices are its replicas' hosts'

    def resident_pipelines(self) -> int:
        return 0

    def running(self) -> Running:
        devices = tuple(DeviceView(device, None, 0, ()) for device in self.hardware.devices())
        return Running(self.queue_depth(), devices, tuple(self.fleet.replicas()))

    def close(self) -> None:
        self.fleet.close()
