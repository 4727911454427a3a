"""The engine: the session manager and request validation, below every front end."""
from .manager import CompiledShape, PipelineStatus, SessionManager
from .validation import Option, Placement, check_request, mode_options, parse_resolution, propose_placement

__all__ = ["CompiledShape", "Option", "PipelineStatus", "Placement", "SessionManager", "check_request",
           "mode_options", "parse_resolution", "propose_placement"]
