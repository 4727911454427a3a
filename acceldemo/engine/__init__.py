"""The engine: one typed request checked once, one line for every front end, replicas supervised, compiled shapes
ledgered, resident pipelines within a budget, counters; and the views every front end renders."""
from .batching import together
from .core import Engine, Fleet, Job
from .ledger import CompiledShape
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

__all__ = ["MAX_IMAGES", "MAX_SEED", "OUTCOMES", "CompiledShape", "Description", "DeviceView", "Engine", "Fleet",
           "HardwareView", "Job", "Kind", "ModelView", "Offer", "Option", "Outcome", "PipelineView",
           "PlacementProposal", "ReplicaView", "Snapshot", "Startup", "StartupState", "as_json", "mode_options",
           "outcome_of", "parse_resolution", "propose_placement", "tensor_parallel_options", "together"]
