"""The engine: one typed request checked once, one line for every front end, replicas supervised, compiled shapes
ledgered, resident pipelines within a budget, counters; and the views every front end renders."""
from .batching import together
from .core import Engine
from .fleet_backend import Fleet, FleetBackend
from .jobs import Backend, Job
from .ledger import CompiledShape
from .local_backend import LocalBackend
from .stats import OUTCOMES, Kind, Outcome, outcome_of
from .validation import (
                         MAX_IMAGES,
                         MAX_SEED,
                         Option,
                         PlacementProposal,
                         mode_options,
                         parse_resolution,
                         propose_placement,
                         tensor_parallel_options,
)
from .views import (
                         Description,
                         DeviceView,
                         HardwareView,
                         ModelView,
                         Offer,
                         PipelineView,
                         ReplicaView,
                         Snapshot,
                         Startup,
                         StartupState,
                         as_json,
)

__all__ = ["MAX_IMAGES", "MAX_SEED", "OUTCOMES", "Backend", "CompiledShape", "Description", "DeviceView", "Engine",
           "Fleet", "FleetBackend", "HardwareView", "Job", "Kind", "LocalBackend", "ModelView", "Offer", "Option",
           "Outcome", "PipelineView", "PlacementProposal", "ReplicaView", "Snapshot", "Startup", "StartupState",
           "as_json", "mode_options", "outcome_of", "parse_resolution", "propose_placement", "tensor_parallel_options",
           "together"]
