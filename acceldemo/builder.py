"""How an entry point puts the engine together: a hardware registry from its settings, the executor chosen outside
the engine (this process, or torchrun worker pools), and the engine over both."""
from __future__ import annotations

from .config import Settings
from .engine import Engine, Fleet
from .executors.routing import RoutingExecutor
from .hardware import HardwareRegistry


def build_engine(settings: Settings, hardware: HardwareRegistry | None = None, node: str | None = None,
                 fleet: Fleet | None = None, **executors) -> Engine:
    """The engine every front end talks to; `executors` replace the routing executor's own (`local=`, `pools=`);
    `node` names the host in results (default: its host name); `fleet`: replicas elsewhere that run its requests."""
    hardware = hardware or HardwareRegistry(settings)
    return Engine(settings, hardware, RoutingExecutor(settings, hardware, **executors), node=node, fleet=fleet)
