"""How an entry point puts the engine together, once: a hardware registry from its settings, then the backend its
requests run on — this host's devices through the executor chosen here (this process, or torchrun worker pools),
or a fleet's replicas — and the engine in front of it."""
from __future__ import annotations

import socket

from .config import Settings
from .engine import Engine, Fleet, FleetBackend, LocalBackend
from .engine.stats import EngineStats
from .executors.artifacts import ArtifactStore
from .executors.routing import RoutingExecutor
from .hardware import HardwareRegistry


def build_engine(settings: Settings, hardware: HardwareRegistry | None = None, node: str | None = None,
                 fleet: Fleet | None = None, **executors) -> Engine:
    """The engine every front end talks to; `executors` replace the routing executor's own (`local=`, `pools=`);
    `node` names the host in results (default: its host name); `fleet`: replicas elsewhere that run its requests."""
    hardware = hardware or HardwareRegistry(settings)
    node = node or socket.gethostname()
    stats, artifacts = EngineStats(), ArtifactStore.of(settings)
    if fleet is not None:
        backend = FleetBackend(settings, hardware, fleet, stats)
    else:
        backend = LocalBackend(settings, hardware, RoutingExecutor(settings, hardware, **executors), stats, artifacts,
                               node)
    return Engine(settings, hardware, backend, stats, artifacts, node)
