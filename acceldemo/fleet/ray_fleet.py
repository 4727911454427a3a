"""The fleet on Ray Serve: the app joins a Ray cluster, deploys the pipeline replicas there (one per device set Ray
can place, on any node; or as Serve autoscales them), and runs each image on one of them through a deployment handle.
The app's engine keeps the front door: typed requests, the line's limit (Serve's max_queued_requests agrees with it),
the counters and the views."""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from ..builder import build_engine
from ..config import Settings
from ..engine import CompiledShape, Engine, ReplicaView
from ..engine.validation import propose_placement
from ..errors import Cancelled, GenerationFailed, HardwareUnavailable, QueueFull, ReplicaLost
from ..hardware import ADAPTERS, Availability, HardwareRegistry
from ..models.catalog import get_model
from ..records import DeviceSet, GenerateResult, Phase, Progress, ProgressCallback, ReplicaState, Request

log = logging.getLogger("acceldemo.fleet")
APP = "acceldemo"
PACKAGE = Path(__file__).resolve().parents[1]
# Ray's own variables: Ray reads them; the app only checks that they are there and names them.
RAY_TOKEN_HOWTO = ("set RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN or in a file named by "
                   "RAY_AUTH_TOKEN_PATH, as on its `ray start` nodes (see docs/fleet.md)")


def fleet_engine(settings: Settings, model: str | None = None) -> Engine:
    """An engine whose requests run on the Ray cluster at `settings.ray_address`, its replicas holding `model` (None:
    the default) from their start: the hardware it offers is the cluster's, not this host's."""
    fleet = RayFleet(settings, model=model)
    return build_engine(settings, HardwareRegistry(settings, fleet.found), node=fleet.node, fleet=fleet)


def ray_auth(settings: Settings, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the app joins its Ray cluster with Ray's token: RAY_AUTH_MODE=token (Ray then finds the token itself,
    in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or its default file ~/.ray/auth_token, and refuses to start without one).
    Without it the app joins only with ACCELDEMO_RAY_INSECURE=1, and warns; otherwise a ValueError says what to set."""
    env = os.environ if environ is None else environ
    mode = env.get("RAY_AUTH_MODE", "")
    if mode.lower() == "token":  # as Ray reads it, in any case
        return True
    if not settings.ray_insecure:
        shown = f" (RAY_AUTH_MODE is {mode!r})" if mode else ""
        raise ValueError(f"the app joins a Ray cluster only with token authentication{shown}: {RAY_TOKEN_HOWTO}; "
                         "or ACCELDEMO_RAY_INSECURE=1 to join one without it")
    log.warning("joining the Ray cluster at %s WITHOUT token authentication (ACCELDEMO_RAY_INSECURE=1): whoever "
                "reaches its GCS port can run code on every node of it", settings.ray_address or "auto")
    return False


def join_refusal(error: ConnectionError, with_token: bool) -> str:
    """Why `ray.init` could not join: the cluster refused this app's token, or asked for one the app did not send
    (Ray says so only in the error its ConnectionError wraps), or no cluster answered."""
    if "AuthenticationError" not in str(error.__cause__):
        return f"no Ray cluster to join ({error})"
    if with_token:
        return ("the Ray cluster refused this app's token: RAY_AUTH_TOKEN or the file RAY_AUTH_TOKEN_PATH names must "
                "hold the token its nodes were started with")
    return f"the Ray cluster asks for its token: {RAY_TOKEN_HOWTO}"


@dataclasses.dataclass(frozen=True)
class FleetPlan:
    """What the fleet deploys on a cluster: the hardware served (the best the cluster offers), what each replica asks
    Ray for (one device set: T devices of one node for a tensor-parallel model), how many replicas, and at most how
    many run at once."""

    found: dict[str, Availability]
    hardware: str
    devices_per_replica: int
    replicas: int
    capacity: int
    actor_options: dict
    reason: str


def plan_fleet(settings: Settings, resources: dict[str, float], model: str | None = None,
               cpus_per_replica: float = 1.0) -> FleetPlan:
    """The plan for a cluster whose total resources are `resources` (Ray's `cluster_resources()`), serving `model`
    (None: the default) as the single host would place it: the placement proposal for the cluster's devices decides
    the tensor-parallel size T; a replica then asks Ray for T devices in one actor, which Ray places on one node."""
    found = {name: adapter(settings).in_cluster(resources, cpus_per_replica) for name, adapter in ADAPTERS.items()}
    usable = [name for name, there in found.items() if there.available]
    if not usable:
        raise HardwareUnavailable("ray", f"the Ray cluster offers no devices: {resources}")
    hardware = max(usable, key=lambda name: ADAPTERS[name].preference)
    for name in usable:  # one hardware is served: the others are named as such, not offered
        if name != hardware:
            found[name] = Availability(False, f"the fleet serves {hardware}")
    adapter = ADAPTERS[hardware](settings, found[hardware])
    proposal = propose_placement(get_model(model or settings.default_model), found[hardware],
                                 adapter.tensor_parallel_sizes())
    # CPU ranks share one device (gloo): a CPU replica is one device whatever its TP size.
    per_replica = proposal.world_size if proposal.placement.pooled and adapter.ray_resource else 1
    replicas = settings.replicas_of(hardware) or max(1, found[hardware].device_count // per_replica)
    autoscaling = settings.ray_autoscaling
    capacity = int(autoscaling.get("max_replicas", replicas)) if autoscaling else replicas
    return FleetPlan(found, hardware, per_replica, replicas, capacity,
                     adapter.ray_actor_options(per_replica, cpus_per_replica), proposal.reason)


class RayFleet:
    """Pipeline replicas as one Ray Serve deployment (`pipelines-<hardware>`) for the best hardware of the cluster.

    Routing: Serve's model multiplexing with `ShapeRouter` (a free replica holding the pipeline at the request's
    shape first, else the least loaded). Placement: each replica asks Ray for one device set (`num_gpus`,
    `neuron_cores`, `TPU`, or CPU cores). Back-pressure: one image at a time per replica (max_ongoing_requests=1);
    the engine's line sends this handle at most its dispatch window (the replicas, or with autoscaling the maximum
    replicas × target_ongoing_requests, what the autoscaler must see to scale to its maximum) and holds the others,
    taking turns across clients.
    """

    def __init__(self, settings: Settings, cpus_per_replica: float = 1.0, model: str | None = None):
        with_token = ray_auth(settings)  # refused before Ray is even imported
        import ray
        from ray import serve
        from ray.exceptions import AuthenticationError
        from ray.serve.config import AutoscalingConfig, RequestRouterConfig

        from .replica import PipelineReplica
        from .routing import ShapeRouter

        self.settings = settings
        address = settings.ray_address or "auto"
        try:
            ray.init(address=address, namespace=APP, log_to_driver=False, ignore_reinit_error=True,
                     runtime_env={"py_modules": [str(PACKAGE)], "excludes": ["__pycache__"]})
        except AuthenticationError as error:  # token mode, but no token here: Ray's message names where it looked
            raise ValueError(error.message) from None
        except ConnectionError as error:
            raise ConnectionError(join_refusal(error, with_token)) from None
        # Anything of this process that looks for Ray later (Serve's own helpers) finds this cluster, never starts a
        # local one of its own.
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        self.node = f"{os.uname().nodename}/{ray.get_runtime_context().get_node_id()[:12]} (ingress)"
        resources = ray.cluster_resources()
        plan = plan_fleet(settings, resources, model, cpus_per_replica)
        self.found, self.hardware, replicas, self._capacity = plan.found, plan.hardware, plan.replicas, plan.capacity
        self._devices = plan.devices_per_replica
        autoscaling = dict(settings.ray_autoscaling)
        try:
            scaling = AutoscalingConfig(**autoscaling) if autoscaling else None
        except (TypeError, ValueError) as error:  # pydantic's ValidationError is a ValueError
            raise ValueError(f"ACCELDEMO_RAY_AUTOSCALING is not Ray Serve's autoscaling config: {error}") from None
        self._window = self._capacity * (math.ceil(scaling.target_ongoing_requests) if scaling else 1)
        self.deployment = f"pipelines-{self.hardware}"
        serve.start(http_options={"location": "NoServer"})
        options = dict(
            name=self.deployment, max_ongoing_requests=1, max_queued_requests=self._window,
            ray_actor_options=plan.actor_options,
            request_router_config=RequestRouterConfig(request_router_class=ShapeRouter,
                                                      request_router_kwargs={"deployment": self.deployment},
                                                      request_routing_stats_period_s=1.0),
            health_check_period_s=2.0, graceful_shutdown_timeout_s=5.0)
        if scaling:
            options["autoscaling_config"] = scaling
        else:
            options["num_replicas"] = replicas
        deployment = serve.deployment(PipelineReplica).options(**options)
        settings_json = dataclasses.replace(settings, ray_address=None).to_json()
        self.handle = serve.run(deployment.bind(settings_json, self.hardware, model), name=APP, route_prefix=None,
                                blocking=False)
        self._views: tuple[float, list[ReplicaView]] = (0.0, [])
        self._lock = threading.Lock()
        log.info("fleet: %s on the Ray cluster at %s (%s), %s; %s", self.deployment, address,
                 "token authentication" if with_token else "NO authentication",
                 f"autoscaling {autoscaling}" if autoscaling else f"{replicas} replica(s)", plan.reason)

    def capacity(self, hardware: str) -> int:
        return self._capacity if hardware == self.hardware else 0

    def dispatch_window(self, hardware: str) -> int:
        return self._window if hardware == self.hardware else 0

    def devices_per_replica(self, hardware: str) -> int:
        return self._devices if hardware == self.hardware else 0

    def run(self, request: Request, on_progress: ProgressCallback, cancelled: Callable[[], bool]) -> GenerateResult:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
        from ray.serve.exceptions import BackPressureError, RequestCancelledError

        from ..executors.replies import Done, Failed, Reported
        from .replica import Started, routing_key

        handle = self.handle.options(stream=True, multiplexed_model_id=routing_key(request))
        lost = None
        for attempt in (1, 2):
            response = handle.generate.remote(request)
            done = threading.Event()
            watcher = threading.Thread(target=_cancel_when, args=(cancelled, done, response), daemon=True)
            watcher.start()
            try:
                for item in response:
                    if isinstance(item, Started):
                        on_progress(Progress(Phase.QUEUE, f"running on replica {item.replica} of {item.node}", 0))
                    elif isinstance(item, Reported):
                        on_progress(item.event)
                    elif isinstance(item, Done):
                        return item.value
                    elif isinstance(item, Failed):
                        raise item.error
                raise GenerationFailed("the replica ended its answer without an image")
            except BackPressureError:
                raise QueueFull(self.settings.queue_size, self.settings.queue_size) from None
            except RequestCancelledError:
                raise Cancelled("stopped: the request was cancelled on its replica") from None
            except (ActorDiedError, ActorUnavailableError, RayActorError) as error:
                if cancelled():
                    raise Cancelled("stopped: the request was cancelled") from None
                lost = error
                log.warning("a replica was lost with %s at %s (attempt %d): %s", request.model, request.shape,
                            attempt, type(error).__name__)
                on_progress(Progress(Phase.QUEUE, "its replica was lost: running it again on another", 0))
            finally:
                done.set()
        raise ReplicaLost(self.deployment, f"two replicas were lost while drawing this image: {lost}")

    def warm_up(self, request: Request, shapes: list[Request]) -> list[CompiledShape]:
        """Each shape warmed by one replica, under the shape's routing key: the router then sends that shape's
        requests to the replica that holds it compiled."""
        from .replica import routing_key

        return [record for shape in shapes for record in self.handle.options(
            multiplexed_model_id=routing_key(shape)).warm_up.remote(request, [shape]).result()]

    def replicas(self) -> list[ReplicaView]:
        """Every replica the routers of this process know, with what each last reported (node, served, latency)."""
        with self._lock:
            seen, views = self._views
            if time.monotonic() - seen < 1.0:
                return views
        from .replica import RoutingKey
        from .seen import known_replicas

        views = []
        for index, (replica_id, replica) in enumerate(sorted(known_replicas(self.deployment).items())):
            stats = replica.routing_stats or {}
            held = [key for text in replica.multiplexed_model_ids if (key := RoutingKey.parse(text)) is not None]
            shapes = sorted({key.shape for key in held})
            busy = stats.get("busy") or ""
            views.append(ReplicaView(
                DeviceSet(self.hardware, (index,)), ReplicaState.BUSY if busy else ReplicaState.IDLE,
                f"busy: {busy}" if busy else "idle", 0, tuple(shapes), int(stats.get("served", 0)),
                stats.get("last_latency"), 0, tuple(sorted({key.model for key in held})),
                stats.get("node") or f"node {str(replica.node_id)[:12]}", replica_id))
        with self._lock:
            self._views = (time.monotonic(), views)
        return views

    def close(self) -> None:
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        try:
            serve.delete(APP)
        except Exception as error:  # the cluster may already be gone; closing must still end
            log.warning("could not delete the Serve app: %s", error)
        ray.shutdown()


def _cancel_when(cancelled: Callable[[], bool], done: threading.Event, response) -> None:
    """Cancel a replica's answer once the request is cancelled (the replica stops at its next denoise step)."""
    while not done.wait(0.2):
        if cancelled():
            response.cancel()
            return
