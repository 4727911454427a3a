"""Replicas across hosts: the pipeline replicas as a Ray Serve deployment on a Ray cluster's nodes, routed by shape
with Serve's model multiplexing, autoscaled by Serve; the app's engine keeps the front door, the line's limit and the
counters. Needs `requirements-fleet.txt` (ray[serve]); the single-host path imports none of it."""
from .ray_fleet import RayFleet, fleet_engine

__all__ = ["RayFleet", "fleet_engine"]
