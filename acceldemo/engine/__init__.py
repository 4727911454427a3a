"""The engine: the session manager, its line for devices, its counters, and request validation, below every front
end."""
from .manager import CompiledShape, DeviceStatus, PipelineStatus, SessionManager
from .stats import OUTCOMES, outcome_of
from .validation import (MAX_IMAGES, MAX_SEED, PLACEMENTS, Option, Placement, mode_options, parse_resolution,
                         propose_placement, tensor_parallel_options)

__all__ = ["MAX_IMAGES", "MAX_SEED", "OUTCOMES", "PLACEMENTS", "CompiledShape", "DeviceStatus", "Option", "PipelineStatus",
           "Placement", "SessionManager", "mode_options", "outcome_of", "parse_resolution", "propose_placement",
           "tensor_parallel_options"]
