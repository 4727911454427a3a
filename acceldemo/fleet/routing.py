"""Ray Serve's request router for pipeline replicas: a request goes to a free replica that already holds its model
compiled at its shape (Serve's multiplexed model id, see `routing_key`), else to the least-loaded other one — the
single-host line's policy, with Serve's own mixins; no router of our own in front of Ray."""
from __future__ import annotations

from ray.serve.request_router import FIFOMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

from . import seen


class ShapeRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    """Rank 0: replicas holding the request's pipeline and shape; rank 1: the others, fewest held first. Serve probes
    a rank's replicas and takes the least loaded that accepts (max_ongoing_requests=1: a free one), else the next
    rank; when none is free the request waits in FIFO order in Serve's queue (max_queued_requests)."""

    deployment = ""

    def initialize_state(self, deployment: str = "", **kwargs) -> None:
        # Called by Serve with the deployment's request_router_kwargs.
        self.deployment = deployment
        seen.ROUTERS[id(self)] = self  # what it hears of the replicas is the app's replicas view

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        # Every replica is offered each round: when none took the request, Serve waits (backs off, up to 0.5 s)
        # before the next round, rather than probing busy replicas in a tight loop.
        pending_request.routing_context.should_backoff = True
        key = pending_request.metadata.multiplexed_model_id
        if not key:
            return [candidate_replicas]
        holding, fewest, rest = self.rank_replicas_via_multiplex(candidate_replicas, key)
        others = sorted(fewest + rest, key=lambda replica: len(replica.multiplexed_model_ids))
        return [rank for rank in (holding, others) if rank]

