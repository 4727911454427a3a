"""Ray Serve's request router for pipeline replicas: a request goes to a free replica that already holds its model
compiled at its shape (Serve's multiplexed model id, see `routing_key`), else to the least-loaded other one — the
single-host line's policy, with Serve's own mixins; no router of our own in front of Ray."""
from __future__ import annotations

import weakref

from ray.serve.request_router import FIFOMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

class ShapeRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    """Rank 0: replicas holding the request's pipeline and shape; rank 1: the others, fewest held first. Serve probes
    a rank's replicas and takes the least loaded that accepts (max_ongoing_requests=1: a free one), else the next
    rank; when none is free the request waits in FIFO order in Serve's queue (max_queued_requests)."""

    deployment = ""
    # The routers of this process (one per deployment handle): what they last heard of each replica is the replicas
    # view. Kept on the class: Serve hands the router class over serialized, its functions' module globals are a copy.
    # (By id: a router is not hashable.)
    instances: "weakref.WeakValueDictionary[int, ShapeRouter]" = weakref.WeakValueDictionary()

    def initialize_state(self, deployment: str = "", **kwargs) -> None:
        # Called by Serve with the deployment's request_router_kwargs.
        self.deployment = deployment
        type(self).instances[id(self)] = self

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not key:
            return [candidate_replicas]
        holding, fewest, rest = self.rank_replicas_via_multiplex(candidate_replicas, key)
        others = sorted(fewest + rest, key=lambda replica: len(replica.multiplexed_model_ids))
        return [rank for rank in (holding, others) if rank]


def known_replicas(deployment: str) -> dict[str, RunningReplica]:
    """The replicas of a deployment this process's routers know, by replica id."""
    found = {}
    for router in list(ShapeRouter.instances.values()):
        if router.deployment == deployment:
            found.update({replica_id.unique_id: replica for replica_id, replica in router.curr_replicas.items()})
    return found
