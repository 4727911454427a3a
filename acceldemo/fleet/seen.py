"""The request routers of this process (one per deployment handle), so the app can show what they last heard of each
replica. Not kept in `routing`: Serve pickles the router's module by value, so its module globals there are a copy,
while this module is imported by name."""
from __future__ import annotations

import weakref

# By id: a router is not hashable (a WeakSet of them stays empty).
ROUTERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def known_replicas(deployment: str) -> dict:
    """The replicas (Serve's RunningReplica) of a deployment this process's routers know, by replica id."""
    found = {}
    for router in list(ROUTERS.values()):
        if router.deployment == deployment:
            found.update({replica_id.unique_id: replica for replica_id, replica in router.curr_replicas.items()})
    return found
